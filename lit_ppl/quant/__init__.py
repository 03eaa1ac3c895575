"""Weight quantization: the plan (schemes, rules, targets), applying torchao's configs, calibration text, AWQ and
GPTQ statistics reduced across ranks, the per-layer precision search (``quant=auto``), a stored INT8 checkpoint
split as stored, and the check that every rank holds the same quantized weights.

Imports :mod:`lit_ppl.errors`, :mod:`lit_ppl.runtime`, :mod:`lit_ppl.config`, :mod:`lit_ppl.metrics` (the KL
divergence ``quant=auto`` measures), :mod:`lit_ppl.parallel`, :mod:`lit_ppl.model` and :mod:`lit_ppl.data`
(calibration text goes through the token store); nothing above.
"""
