"""Memory figures of this process: host RSS from ``/proc``, torch's device peak, and the heap's tuning."""

from __future__ import annotations

import contextlib
import ctypes
import resource
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def host_rss(field: str = "VmRSS") -> int:
    """This process's current (``VmRSS``) or peak (``VmHWM``) resident set size in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def host_peak_reset() -> None:
    """Reset this process's peak resident set size (Linux: ``VmHWM``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def release_free_host_memory() -> None:
    """Return malloc's free memory to the OS (glibc ``malloc_trim``; a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# Blocks from glibc's heap up to this size (mallopt M_MMAP_THRESHOLD); larger ones are mapped and unmapped.
_heap_blocks_up_to = [32 << 20]
LARGE_BLOCK = 1 << 20  # under FSDP or a comparison on CPU: see map_large_blocks


def keep_freed_memory_in_heap() -> None:
    """Keep a step's freed activations in glibc's heap instead of unmapping them (a no-op elsewhere).

    Without it every CPU step faults its activations in again (benchmarks/README.md, "page faults per step").
    Blocks up to 32 MB (1 MiB under :func:`map_large_blocks`) come from the heap and up to 64 MB of free heap
    stay mapped (mallopt's M_MMAP_THRESHOLD is -3, M_TRIM_THRESHOLD -1).
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to tune
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, _heap_blocks_up_to[0])
        libc.mallopt(-1, 64 << 20)


def map_large_blocks() -> None:
    """Blocks of 1 MiB and more from ``mmap``, returned to the OS when freed: for FSDP and comparisons on CPU (a no-op
    elsewhere).

    FSDP2 allocates each unit's all-gather buffers and unsharded parameters at every forward and frees them after
    it; a comparison, its chunks' logits and masks (tens of MB each) between small per-chunk results. From glibc's
    heap, the interleaved sizes fragment it: the resident size grew by about a whole model's worth over one FSDP
    forward, and by gigabytes over the 4 steps of a comparison of a 262k vocabulary (benchmarks/README.md, "Memory per
    phase and per rank", "compare=saved's memory").
    """
    _heap_blocks_up_to[0] = LARGE_BLOCK
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, LARGE_BLOCK)


@contextlib.contextmanager
def large_blocks_mapped() -> Iterator[None]:
    """Inside: blocks of 1 MiB and more from ``mmap``, as :func:`map_large_blocks`; after: the heap's own setting
    (``_heap_blocks_up_to``, which :func:`keep_freed_memory_in_heap` also sets). For
    weights read and replaced one by one (each float weight freed as its quantized one arrives): from the heap, the
    interleaved sizes fragment it to the whole float model's size."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, LARGE_BLOCK)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").mallopt(-3, _heap_blocks_up_to[0])


def rank_peak_memory(device: Any) -> tuple[int, int]:
    """This process's peak host RSS in KiB and, on a CUDA ``device``, its peak allocated bytes there (else -1).

    Integers, so that the ranks' figures travel in the same int64 all-gather as their token counts. VmHWM, not
    ``ru_maxrss``, which Linux carries over ``exec`` from the process that forked this one.
    """
    import torch

    try:
        rss_kib = host_rss("VmHWM") // 1024
    except (OSError, RuntimeError):  # not Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss_kib = rss // 1024 if sys.platform == "darwin" else rss  # bytes on macOS, KiB on Linux
    on_cuda = getattr(device, "type", None) == "cuda"
    return rss_kib, int(torch.cuda.max_memory_allocated(device)) if on_cuda else -1


def rank_memory(rss_kib: list[int], device_bytes: list[int]) -> dict[str, list[float] | None]:
    """``rank_peak_rss_mb`` and ``rank_peak_device_mb`` (``None`` off CUDA) from every rank's
    :func:`rank_peak_memory`."""
    on_cuda = all(b >= 0 for b in device_bytes)
    return {
        "rank_peak_rss_mb": [round(k / 1024, 1) for k in rss_kib],
        "rank_peak_device_mb": [round(b / 2**20, 1) for b in device_bytes] if on_cuda else None,
    }


def inner_tensors(t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The plain tensors a (possibly torchao) tensor is made of: data, scales, zero points."""
    if not hasattr(t, "__tensor_flatten__"):
        return [("", t)]
    names, _ = t.__tensor_flatten__()
    return [(f"{n}{'.' + s if s else ''}", x) for n in names for s, x in inner_tensors(getattr(t, n))]


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds: a quantized one's codes, scales and zero points; a DTensor's whole tensor (every
    rank's shards together: a rank's own are its ``to_local()``'s)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.numel() * t.element_size()
    return sum(x.numel() * x.element_size() for _, x in inner_tensors(t))


def is_quantized(t: torch.Tensor) -> bool:
    """Whether ``t`` is a quantized tensor subclass (torchao's), not a plain or a distributed (DTensor) one."""
    from torch.distributed.tensor import DTensor

    return hasattr(t, "__tensor_flatten__") and not isinstance(t, DTensor)
