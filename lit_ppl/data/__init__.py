"""The text to score: corpus files and formats, the memory-mapped token store, windows, the exact sampler, the
batch plan (size, rank weights, batches to skip) and the Lightning datamodule that serves it.

Imports :mod:`lit_ppl.errors`, :mod:`lit_ppl.runtime`, :mod:`lit_ppl.config`, :mod:`lit_ppl.parallel` (the layout)
and :mod:`lit_ppl.model` (the tokenizer); nothing above. The scorer that ``batch_size=auto`` and
``balance=measured`` time is handed in (:class:`~lit_ppl.data.batch_plan.ScorerProbe`), not imported.
"""
