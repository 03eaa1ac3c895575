"""``compile=true``: ``torch.compile`` the decoder, in place, where it helps.

The decoder (ids → hidden states) is compiled with ``nn.Module.compile``, which keeps the module tree and
its parameter names (so DDP/FSDP wrapping, quantization reports and checkpoints see the same names); the
output head and the chunked loss stay eager (a loop over chunks of data-dependent count). Windows of a new
length trigger one recompilation with dynamic shapes, not one per length.

Measured in ``benchmarks/compile_bench.py``: it pays on GPUs; on CPU the compile time (tens of seconds)
rarely comes back within one evaluation.
"""

from __future__ import annotations

from torch import nn


def compile_decoder(scorer: nn.Module, mode: str | None = None) -> None:
    """Compile ``scorer.decoder`` in place (``TokenScorer``'s decoder; ``mode`` as in ``torch.compile``)."""
    scorer.decoder.compile(mode=mode)
