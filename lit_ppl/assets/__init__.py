"""Texts shipped with lit-ppl, read as ``data.path=package://lit_ppl.assets/NAME``.

* ``demo.txt`` (``data=demo``, the default): a short note on perplexity, written for lit-ppl.
* ``alice.txt`` (``data=alice``): chapter I, "Down the Rabbit-Hole", of Lewis Carroll's *Alice's Adventures in
  Wonderland* (1865; public domain), from the Millennium Fulcrum Edition 2.9 as the Canterbury corpus keeps it
  (``alice29.txt``, also in Brotli's test data). Each paragraph's lines are joined into one line, runs of spaces
  made one, the edition's opening quote mark ````` written ``'``, and the closing row of asterisks dropped.
"""
