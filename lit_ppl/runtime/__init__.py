"""The host a process runs on: atomic files, the run lock, memory figures, CPU threads and deterministic kernels.

The bottom floor: it imports nothing of lit-ppl but :mod:`lit_ppl.errors`, and every other room may import it.
"""
