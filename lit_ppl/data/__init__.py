"""The text to score: corpus files and formats, the memory-mapped token store, windows, the exact sampler, the
batch plan (size, rank weights, batches to skip) and the Lightning datamodule that serves it.

Imports :mod:`lit_ppl.runtime`, :mod:`lit_ppl.config`, :mod:`lit_ppl.parallel` (the layout) and :mod:`lit_ppl.model`
(the tokenizer; the scorer for ``batch_size=auto`` and ``balance=measured`` probes); nothing above.
"""
