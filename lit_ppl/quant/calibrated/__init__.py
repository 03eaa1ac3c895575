"""Calibrated quantization: the calibration text, the hooks that stream it through the float model, and the
statistics of AWQ and GPTQ reduced across ranks (the methods themselves are entries of :mod:`lit_ppl.quant.methods`)."""
