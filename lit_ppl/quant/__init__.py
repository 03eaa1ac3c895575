"""Weight quantization: the method table (:mod:`~lit_ppl.quant.methods`), schemes, each layer's choice from the
rules (:mod:`~lit_ppl.quant.assign`), applying torchao's configs (:mod:`~lit_ppl.quant.apply`), the one object the
model's placement calls (:mod:`~lit_ppl.quant.quantizer`), a stored INT8 checkpoint split as stored, and the check
that every rank holds the same quantized weights. Two rooms inside: ``calibrated/`` (calibration text, the hooks
that stream it, AWQ and GPTQ statistics reduced across ranks) and ``auto/`` (the per-layer precision search of
``quant=auto``).

Imports :mod:`lit_ppl.errors`, :mod:`lit_ppl.runtime`, :mod:`lit_ppl.config`, :mod:`lit_ppl.metrics` (the KL
divergence ``quant=auto`` measures), :mod:`lit_ppl.parallel`, :mod:`lit_ppl.model` and :mod:`lit_ppl.data`
(calibration text goes through the token store); nothing above.
"""
