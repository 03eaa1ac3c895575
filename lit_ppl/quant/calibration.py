"""Calibration text for calibrated quantization (:mod:`lit_ppl.quant.awq`, :mod:`lit_ppl.quant.gptq`), sharded over
ranks.

The text is read like ``data`` (:mod:`lit_ppl.data.sources`) into the token store and cut into ``block`` windows
(:mod:`lit_ppl.data.windows`), batched once independently of the world size
(:func:`lit_ppl.data.sampler.plan_batches` with
``deterministic=True``) and shared out over the ranks like evaluation windows. A method streams its share through
the float model with forward pre-hooks (:func:`stream`) that accumulate fixed-size statistics, then sums them over
the ranks with one ``all_reduce`` each (:func:`all_reduce`), so every rank holds the numbers of the whole
calibration set and memory does not grow with it.

Why float64 ``all_reduce`` and not :mod:`lit_ppl.metrics.exact`'s fixed-point sums: at one world size every rank
receives the same reduced bits (one collective, identical ranks' inputs in a fixed order), which is what makes
the ranks' weights identical, and :func:`lit_ppl.quant.consistency.check_consistency` proves it by hash. Across world
sizes
the sums are associated differently and may differ in the last bits (relative ~1e-16); the fixed-point
representation would remove that but needs every value below ``2^22`` and resolves ``2^-40`` absolutely, which
activations with outliers (``x²`` sums in the millions) and small channels both break, and it costs a per-term
conversion where ``XᵀX`` is one matmul. The AWQ choice (an argmin) and the int8/int4 rounding after it are
insensitive to such last-bit differences except at exact ties; the 1/2/3-rank tests check the hashes.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lit_ppl.data.sampler import PAD, plan_batches
from lit_ppl.data.sources import DataSpec
from lit_ppl.data.store import Corpus, prepare
from lit_ppl.data.windows import Windows, build_windows
from lit_ppl.errors import LitPplError
from lit_ppl.model.scorer import decoder_and_head
from lit_ppl.model.tokenizer import Tokenizer

DATA_KEYS = ("path", "format", "text_field", "document_separator", "encoding_errors", "limit", "cache_dir")


@dataclass
class CalibrationSpec:
    """``quant.calibration``: which text calibrates, and how much of it.

    Attributes:
        data: the calibration documents, as ``data`` takes them (path, format, limit, ...).
        seq_len: tokens per calibration window (the text is cut into ``block`` windows, documents run on).
        tokens: calibration input tokens (the first ones of the text; fewer if the text is shorter).
        batch_size: windows per forward pass.
        grid: candidate scales per layer (torchao's ``scale_search_space_size``).
        allow_overlap: accept calibration text that is the evaluated text (it fits the quantization to the test).
    """

    data: DataSpec
    seq_len: int = 512
    tokens: int = 8192
    batch_size: int = 8
    grid: int = 20
    allow_overlap: bool = False

    @classmethod
    def from_cfg(cls, cfg: dict[str, Any] | None, method: str = "awq") -> CalibrationSpec:
        cfg = dict(cfg or {})
        if not cfg.get("path"):
            raise LitPplError(
                f"quant.method={method} needs calibration text: "
                "set quant.calibration.path=FILE (not the evaluated text)"
            )
        for key in ("seq_len", "tokens", "batch_size", "grid"):
            value = cfg.get(key, getattr(cls, key))
            if type(value) is not int or value < 1:
                raise LitPplError(f"quant.calibration.{key}={value!r} must be a positive integer")
        unknown = set(cfg) - {*DATA_KEYS, "seq_len", "tokens", "batch_size", "grid", "allow_overlap"}
        if unknown:
            raise LitPplError(
                f"quant.calibration has unknown keys {sorted(unknown)}; valid: {', '.join(DATA_KEYS)}, "
                "seq_len, tokens, batch_size, grid, allow_overlap"
            )
        data = DataSpec(**{k: cfg[k] for k in DATA_KEYS if k in cfg})
        rest = {k: cfg[k] for k in ("seq_len", "tokens", "batch_size", "grid", "allow_overlap") if k in cfg}
        return cls(data=data, **rest)


def _content_key(path: str) -> tuple[int, str]:
    """Size and SHA-256 of a file: a renamed copy of the evaluated text is still the evaluated text."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return Path(path).stat().st_size, h.hexdigest()


def check_overlap(calibration: DataSpec, evaluated: DataSpec | None) -> None:
    """Refuse calibration text that is the evaluated text (the same files, copies of them, or the same hub split)."""
    if evaluated is None:
        return
    shared = sorted(set(calibration.paths) & set(evaluated.paths))
    if not shared and calibration.paths and evaluated.paths:
        sizes = {Path(p).stat().st_size for p in evaluated.paths}
        candidates = [p for p in calibration.paths if Path(p).stat().st_size in sizes]
        if candidates:
            theirs = {_content_key(p): p for p in evaluated.paths if Path(p).stat().st_size in sizes}
            shared = sorted(p for p in candidates if _content_key(p) in theirs)
    hub = calibration.hub_name is not None and (calibration.hub_name, calibration.hub_config, calibration.split) == (
        evaluated.hub_name,
        evaluated.hub_config,
        evaluated.split,
    )
    if shared or hub:
        what = shared[0] if shared else calibration.describe()
        raise LitPplError(
            f"quant.calibration.path={what!r} is the evaluated text (data: {evaluated.describe()}): calibrating on it "
            "fits the quantization to the test set; give other text or set quant.calibration.allow_overlap=true"
        )


@dataclass
class Calibration:
    """The calibration windows of a :class:`CalibrationSpec` over its token store (from :func:`prepare_calibration`)."""

    spec: CalibrationSpec
    store: Path
    corpus: Corpus = field(init=False)
    windows: Windows = field(init=False)

    def __post_init__(self) -> None:
        self.corpus = Corpus.open(self.store)
        total = len(self.corpus.tokens) - 1  # inputs: every position that has a next token
        if len(self.corpus.doc_lengths) == 0 or total < 1:
            raise LitPplError(
                f"quant.calibration.path={self.spec.data.describe()!r} holds no tokens: calibration needs text"
            )
        whole = build_windows("block", self.corpus.doc_lengths, self.spec.seq_len)
        n = min(self.spec.tokens, total)
        keep = whole.start < n
        end = np.minimum(whole.end[keep], n)  # the last window is cut so that exactly n tokens are read
        zeros = np.zeros(int(keep.sum()), np.int64)
        self.windows = Windows(whole.start[keep], end, whole.start[keep] + 1, zeros, zeros, zeros)

    @property
    def tokens(self) -> int:
        return int(self.windows.lengths.sum())

    def batches(self, rank: int, world_size: int) -> list[list[int]]:
        """This rank's batches of window ids: formed once for every world size, whole batches per rank."""
        plan = plan_batches(self.windows.lengths, world_size, self.spec.batch_size, deterministic=True)
        return [b for b in plan[rank] if b != [PAD]]

    def batch(self, ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids (b, t), real (b, t) bool)``, right-padded: a causal model's real positions never see padding."""
        input_ids, real = self._rows(ids, 0)
        return torch.from_numpy(input_ids).to(device), torch.from_numpy(real).to(device)

    def targets(self, ids: list[int], device: torch.device) -> torch.Tensor:
        """``(b, t)`` the token after each input position of :meth:`batch` (0 at padding): every input has one,
        since the windows end before the text's last token."""
        return torch.from_numpy(self._rows(ids, 1)[0]).to(device)

    def _rows(self, ids: list[int], shift: int) -> tuple[np.ndarray, np.ndarray]:
        w = self.windows
        width = int(max(w.end[i] - w.start[i] for i in ids))
        tokens = np.zeros((len(ids), width), np.int64)
        real = np.zeros((len(ids), width), bool)
        for row, i in enumerate(ids):
            n = int(w.end[i] - w.start[i])
            tokens[row, :n] = self.corpus.tokens[int(w.start[i]) + shift : int(w.end[i]) + shift]
            real[row, :n] = True
        return tokens, real

    def describe(self) -> dict[str, Any]:
        """For ``results.json`` → ``quant.calibration``."""
        return {
            "source": self.spec.data.describe(),
            "limit": self.spec.data.limit,
            "documents": len(self.corpus.doc_lengths),
            "tokens": self.tokens,
            "windows": len(self.windows),
            "seq_len": self.spec.seq_len,
            "batch_size": self.spec.batch_size,
            "grid": self.spec.grid,
            "allow_overlap": self.spec.allow_overlap,
            "token_store": str(self.store),
        }


def prepare_calibration(
    spec: CalibrationSpec, tokenizer: Tokenizer, evaluated: DataSpec | None, timeout_s: float = 300.0
) -> Path:
    """Check the calibration text against the evaluated one and tokenize it (before any process group exists)."""
    if not spec.allow_overlap:
        check_overlap(spec.data, evaluated)
    try:
        return prepare(spec.data, tokenizer, timeout_s, progress=False)
    except ValueError as err:  # e.g. an empty file: say it is the calibration text, not data.path, at fault
        raise LitPplError(f"quant.calibration.path={spec.data.describe()!r}: {err}") from None


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
