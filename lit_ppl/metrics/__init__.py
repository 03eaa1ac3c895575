"""The torchmetrics metrics: float64 perplexity sums, exact fixed-point sums, KL divergence and mergeable
histograms. Each holds sums that synchronise once, at the end.

Imports :mod:`lit_ppl.errors` only.
"""
