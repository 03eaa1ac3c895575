"""Streaming the calibration windows through the float model with hooks that accumulate fixed-size statistics.

A calibrated method (:mod:`lit_ppl.quant.calibrated.awq`, :mod:`lit_ppl.quant.calibrated.gptq`) registers a forward
pre-hook per observed layer (:func:`stream`), streams this rank's share of the calibration batches
(:meth:`lit_ppl.quant.calibrated.text.Calibration.batches`), and sums its statistics over the ranks with one
``all_reduce`` each (:func:`all_reduce`), so every rank holds the numbers of the whole calibration set and memory
does not grow with it.

Why float64 ``all_reduce`` and not :mod:`lit_ppl.metrics.exact`'s fixed-point sums: at one world size every rank
receives the same reduced bits (one collective, identical ranks' inputs in a fixed order), which is what makes
the ranks' weights identical, and :func:`lit_ppl.quant.consistency.check_ranks_agree` proves it by hash. Across
world sizes the sums are associated differently and may differ in the last bits (relative ~1e-16); the fixed-point
representation would remove that but needs every value below ``2^22`` and resolves ``2^-40`` absolutely, which
activations with outliers (``x²`` sums in the millions) and small channels both break, and it costs a per-term
conversion where ``XᵀX`` is one matmul. The AWQ choice (an argmin) and the int8/int4 rounding after it are
insensitive to such last-bit differences except at exact ties; the 1/2/3-rank tests check the hashes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lit_ppl.model.scorer import decoder_and_head
from lit_ppl.quant.calibrated.text import Calibration


def layer_statistics(
    lm: nn.Module,
    names: list[str],
    calibration: Calibration,
    rank: int,
    world_size: int,
    sums: Callable[[torch.Tensor], dict[str, torch.Tensor]],
) -> tuple[dict[str, nn.Module], list[list[int]], list[torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """What a calibrated method's pass starts from: the observed layers, this rank's calibration batches, the box
    its hooks read the real-position mask from, and per layer the zeroed ``sums(weight)`` plus a token ``count``."""
    modules = {n: lm.get_submodule(n) for n in names}
    stats = {
        name: {**sums(mod.weight), "count": torch.zeros((), dtype=torch.int64, device=mod.weight.device)}
        for name, mod in modules.items()
    }
    return modules, calibration.batches(rank, world_size), [torch.ones(0)], stats


def all_reduce(t: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
    return t


class Stop(Exception):
    """Raised after the last observed block: the rest of the forward pass would observe nothing."""


def _stop_hook(*_: Any) -> None:
    raise Stop


BLOCK = re.compile(r"(.*?)\.(\d+)\.")  # "model.layers.3.mlp.up_proj" -> block list "model.layers", index 3


def block_of(name: str) -> tuple[str, int] | None:
    """``(block list, index)`` of a module inside a numbered decoder block, or ``None`` (e.g. the head)."""
    m = BLOCK.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def _run(lm: nn.Module, calibration: Calibration, batches: list[list[int]], real_box: list[torch.Tensor]) -> None:
    """Stream ``batches`` through the float model; hooks read ``real_box[0]``, the mask of real positions."""
    decoder, head = decoder_and_head(lm)
    device = next(lm.parameters()).device
    with torch.no_grad():
        for ids in batches:
            input_ids, real = calibration.batch(ids, device)
            real_box[0] = real
            try:
                out = decoder(input_ids=input_ids, use_cache=False)
            except Stop:
                continue
            hidden = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)
            if getattr(head, "_lit_ppl_awq", False):  # the head's input only matters when the head is calibrated
                head(hidden)


def stream(
    lm: nn.Module,
    modules: dict[str, nn.Module],
    make: Callable[[str], Callable[[nn.Module, tuple], None]],
    calibration: Calibration,
    batches: list[list[int]],
    real_box: list[torch.Tensor],
    stop: nn.Module | None = None,
) -> None:
    """One pass of ``batches`` with the pre-hook ``make(name)`` on every module of ``modules``; ``stop``: a module
    after whose forward each batch's pass ends (nothing after it is observed)."""
    handles = [mod.register_forward_pre_hook(make(name)) for name, mod in modules.items()]
    if stop is not None:
        handles.append(stop.register_forward_hook(_stop_hook))
    head = lm.get_output_embeddings()
    marked = head is not None and any(m is head for m in modules.values())
    if marked:
        head._lit_ppl_awq = True
    try:
        _run(lm, calibration, batches, real_box)
    finally:
        for h in handles:
            h.remove()
        if marked:
            del head._lit_ppl_awq
