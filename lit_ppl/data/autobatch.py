"""``batch_size=auto``: the largest batch of full-length windows that fits, found once and cached.

A probe runs the real scorer on ``b`` windows of ``seq_len`` tokens (every position scored: the worst case)
and measures its peak memory: on CUDA the allocator's peak (``max_memory_allocated``), an out-of-memory
error counting as "does not fit"; on CPU the process's peak resident set (``VmHWM``, reset before each
probe through ``/proc/self/clear_refs``), since running out of host memory kills the process instead of
raising. A batch fits when its peak stays under the budget (``max_memory_gb``; default: 90% of the free
device memory on CUDA, half the available host memory on CPU).

The search doubles ``b`` while it fits, then bisects. Activation memory grows linearly with the batch, so
after two probes a batch whose extrapolated peak exceeds the budget is rejected without running it — on
CPU a probe far over budget could exhaust the host. The answer is cached in a JSON file under a key of
(model, seq_len, precision, chunk size, device, budget).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_ppl.errors import LitPplError
from lit_ppl.runtime.files import write_text_atomic
from lit_ppl.runtime.memory import host_peak_reset, host_rss, release_free_host_memory

DEFAULT_CACHE = Path("~/.cache/lit_ppl/autobatch.json")
GiB = 2**30


def default_budget(device: torch.device) -> int:
    """Bytes a batch may use: 90% of the free CUDA memory, or half of the available host memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.9 * free)
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"] // 2


def probe_peak_bytes(run: Callable[[], Any], device: torch.device) -> int:
    """Peak memory (bytes) that ``run()`` needs above what is in use before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    release_free_host_memory()  # else memory freed by the last probe stays resident and hides this one's peak
    before = host_rss()
    host_peak_reset()
    run()
    return max(host_rss("VmHWM") - before, 0)


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def largest_fitting(fits: Callable[[int], bool], max_batch: int) -> int:
    """The largest ``b`` in ``[1, max_batch]`` with ``fits(b)``, assuming fitting is monotone in ``b``.

    Examples:
        >>> largest_fitting(lambda b: b <= 37, 1024)
        37
        >>> largest_fitting(lambda b: True, 100)
        100
    """
    if not fits(1):
        return 0
    good = 1
    while good < max_batch and fits(min(2 * good, max_batch)):
        good = min(2 * good, max_batch)
    bad = min(2 * good, max_batch + 1)  # first batch known (or assumed, past max_batch) not to fit
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


class Probe:
    """``fits(b)``: does a batch of ``b`` full windows stay under ``budget`` bytes? Remembers what it measured."""

    def __init__(self, run_batch: Callable[[int], Any], device: torch.device, budget: int) -> None:
        self.run_batch, self.device, self.budget = run_batch, device, budget
        self.measured: dict[int, int] = {}  # batch → peak bytes

    def predicted(self, b: int) -> float | None:
        """Linear extrapolation of the peak from the two largest probes below ``b`` (None: too few)."""
        below = sorted(k for k in self.measured if k < b)[-2:]
        if len(below) < 2:
            return None
        (b0, m0), (b1, m1) = ((k, self.measured[k]) for k in below)
        return m1 + (m1 - m0) / (b1 - b0) * (b - b1)

    def __call__(self, b: int) -> bool:
        guess = self.predicted(b)
        if guess is not None and guess > self.budget:
            return False
        try:
            self.measured[b] = probe_peak_bytes(lambda: self.run_batch(b), self.device)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
            if not is_oom(err):
                raise
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return False
        return self.measured[b] <= self.budget


def scorer_batch_runner(scorer: nn.Module, seq_len: int, context: Callable[[], Any] | None = None):
    """``run(b)``: one step of ``scorer`` on ``b`` windows of ``seq_len`` tokens, every position scored."""
    device = next(scorer.parameters()).device

    def run(b: int) -> None:
        input_ids = torch.zeros(b, seq_len, dtype=torch.long, device=device)
        index = torch.arange(b * seq_len, device=device)
        # As the Trainer steps it: under the precision plugin's val_step_context (PerplexityModule.scorer_probe).
        with torch.no_grad(), context() if context is not None else contextlib.nullcontext():
            scorer(input_ids, index, torch.zeros_like(index))

    return run


def cache_key(**parts: Any) -> str:
    return json.dumps(parts, sort_keys=True)


def read_cache(path: Path) -> dict[str, int]:
    """The cache's entries (none if the file does not exist yet); a file that is not one refuses the run, since
    writing an entry would replace it."""
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        entries = err
    if not isinstance(entries, dict) or not all(isinstance(v, int) for v in entries.values()):
        raise LitPplError(
            f"autobatch.cache={str(path)!r} exists and is not lit-ppl's batch-size cache (a JSON object of batch "
            "sizes), which batch_size=auto would overwrite; point autobatch.cache at a new file"
        )
    return entries


def write_cache(path: Path, key: str, batch_size: int) -> None:
    """Add one entry; the file is replaced atomically (concurrent runs may race, but never see half a file)."""
    entries = {**read_cache(path), key: batch_size}
    write_text_atomic(path, json.dumps(entries, indent=1, sort_keys=True))


def auto_batch_size(
    scorer: nn.Module,
    seq_len: int,
    *,
    model: str,
    precision: str,
    chunk_size: int,
    max_memory_gb: float | None = None,
    max_batch: int = 1024,
    cache: str | os.PathLike | None = DEFAULT_CACHE,
    context: Callable[[], Any] | None = None,
) -> int:
    """The largest batch of ``seq_len``-token windows that ``scorer`` runs within the memory budget.

    Args:
        scorer: the model's ``TokenScorer`` (built, on its device, in its evaluation dtype).
        seq_len: window length.
        model: the model's name or path (cache key).
        precision: the Lightning precision (cache key).
        chunk_size: the output head's chunk size (cache key: it sets the loss path's memory).
        max_memory_gb: memory a batch may use; ``None``: 90% of free CUDA memory / half the available RAM.
        max_batch: never answer more than this.
        cache: the JSON cache file (``None``: no cache).
        context: a context manager factory the probes run under (the precision plugin's autocast).

    Raises:
        ValueError: not even one window fits in the budget.
    """
    device = next(scorer.parameters()).device
    budget = int(max_memory_gb * GiB) if max_memory_gb is not None else default_budget(device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = cache_key(
        model=str(model), seq_len=seq_len, precision=str(precision), chunk_size=chunk_size, device=device_name,
        max_memory_gb=max_memory_gb, max_batch=max_batch,
    )  # fmt: skip
    path = Path(cache).expanduser() if cache is not None else None
    if path is not None and key in (hit := read_cache(path)):
        return int(hit[key])
    probe = Probe(scorer_batch_runner(scorer, seq_len, context), device, budget)
    best = largest_fitting(probe, max_batch)
    if best < 1:
        need = probe.measured.get(1)
        raise LitPplError(
            f"one window of {seq_len} tokens does not fit in {budget / GiB:.2f} GiB"
            + (f" (it needs {need / GiB:.2f} GiB)" if need else "")
            + ": raise autobatch.max_memory_gb, lower eval.seq_len or eval.chunk_size"
        )
    if path is not None:
        write_cache(path, key, best)
    return best


def resolve(
    scorer: Any,
    seq_len: int,
    *,
    model: str,
    precision: str,
    chunk_size: int,
    context: Any,
    device: torch.device,
    **options: Any,
) -> int:
    """``batch_size=auto`` inside a run (from the datamodule's ``val_dataloader``, after the model is built).

    Probes ``scorer`` (a whole model on this rank: split layouts are refused before loading, by
    :func:`check_layout`) under the precision's step ``context``, then takes the smallest answer over the ranks:
    every rank must plan the same batches, or their step counts differ and a collective waits. ``options``:
    :func:`auto_batch_size`'s ``max_memory_gb``, ``max_batch``, ``cache``.
    """
    best = auto_batch_size(
        scorer, seq_len, model=model, precision=precision, chunk_size=chunk_size, context=context, **options
    )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        agreed = torch.tensor(best, device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        best = int(agreed)
    return best


def check_layout(batch_size: int | str, layout: Any) -> None:
    """``batch_size=auto`` probes one rank's model alone: with a split model there is no such thing."""
    if batch_size == "auto" and layout.sharded:
        raise LitPplError(
            f"batch_size=auto probes each rank's model alone; with a split model (layout {layout.kind}) give a number"
        )
