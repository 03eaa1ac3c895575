"""The Lightning objects of one evaluation: the module that scores every batch (and the comparison that also
runs a reference), the Trainer built for a layout, and preemption-safe resume.

Imports every room below it (:mod:`lit_ppl.runtime` … :mod:`lit_ppl.quant`); never :mod:`lit_ppl.report`.
"""
