"""Calibration text for calibrated quantization (:mod:`lit_ppl.quant.calibrated`), sharded over ranks.

The text is read like ``data`` (:mod:`lit_ppl.data.sources`) into the token store and cut into ``block`` windows
(:mod:`lit_ppl.data.windows`); of a text longer than ``quant.calibration.tokens``, whole windows spread evenly over
it (:func:`~lit_ppl.data.windows.spread`), as GPTQ and AWQ sample over their calibration set: the first pages of a
corpus are one or two documents, whose topic neither calibrates the other layers nor shows how the loss varies
between texts (``quant=auto``'s bound). The windows are batched once independently of the world size
(:func:`lit_ppl.data.sampler.global_batches`) and dealt out over the data-parallel ranks in turn;
:mod:`lit_ppl.quant.calibrated.stream` runs a method's share through the model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_ppl.config.quant import CalibrationConfig
from lit_ppl.config.schema import DistributedConfig
from lit_ppl.data.sampler import global_batches
from lit_ppl.data.sources import DataSpec
from lit_ppl.data.store import Corpus, prepare
from lit_ppl.data.windows import Windows, build_windows, spread
from lit_ppl.errors import LitPplError
from lit_ppl.model.tokenizer import Tokenizer

DATA_KEYS = ("path", "format", "text_field", "document_separator", "encoding_errors", "limit", "cache_dir")


@dataclass
class CalibrationSpec:
    """``quant.calibration``: which text calibrates (as ``data`` takes it: path, format, limit, ...) and how much of
    it, the typed node (:class:`~lit_ppl.config.quant.CalibrationConfig`): window length, tokens, batch size, AWQ's
    grid, whether the evaluated text may be it."""

    data: DataSpec
    config: CalibrationConfig

    @classmethod
    def from_cfg(cls, cfg: CalibrationConfig, method: str) -> CalibrationSpec:
        """The spec of a typed node; ``method`` (``quant=auto`` or a calibrated method's name) for the message when
        the node gives no text."""
        if not cfg.path:
            raise LitPplError(
                f"quant.method={method} needs calibration text: "
                "set quant.calibration.path=FILE (not the evaluated text)"
            )
        return cls(data=DataSpec(**{k: getattr(cfg, k) for k in DATA_KEYS}), config=cfg)


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
        total = self.text_tokens
        if len(self.corpus.doc_lengths) == 0 or total < 1:
            raise LitPplError(
                f"quant.calibration.path={self.spec.data.describe()!r} holds no tokens: calibration needs text"
            )
        seq_len = self.spec.config.seq_len
        whole = build_windows("block", self.corpus.doc_lengths, seq_len)
        n = min(self.spec.config.tokens, total)
        count, ids = -(-n // seq_len), np.arange(len(whole))
        if count < len(whole):  # a longer text: whole windows spread over all of it, not its first pages
            full = np.flatnonzero(whole.lengths == seq_len)
            ids = full[spread(len(full), count)]
        read = np.cumsum(whole.lengths[ids]) - whole.lengths[ids]  # tokens read before each window
        ids, read = ids[read < n], read[read < n]
        start = whole.start[ids]
        end = np.minimum(whole.end[ids], start + n - read)  # the last window is cut so that exactly n tokens are read
        zeros = np.zeros(len(ids), np.int64)
        self.windows = Windows(start, end, start + 1, zeros, zeros, zeros)

    @property
    def tokens(self) -> int:
        return int(self.windows.lengths.sum())

    @property
    def text_tokens(self) -> int:
        """The whole text's inputs (every position that has a next token), of which the windows read :attr:`tokens`."""
        return len(self.corpus.tokens) - 1

    def batches(self, rank: int, world_size: int) -> list[list[int]]:
        """This rank's batches of window ids: formed once for every world size, global batch ``g`` on rank
        ``g mod world_size`` (its step ``g // world_size``), so that the ranks' partial sums of one step, added in
        rank order, follow the global batch order (:class:`lit_ppl.quant.calibrated.stream.Sums`)."""
        return global_batches(self.windows.lengths, self.spec.config.batch_size)[rank::world_size]

    def steps(self, world_size: int) -> int:
        """How many steps every rank takes (the most batches a rank has)."""
        return len(self.batches(0, world_size))

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
            "text_tokens": self.text_tokens,
            "windows": len(self.windows),
            "seq_len": self.spec.config.seq_len,
            "batch_size": self.spec.config.batch_size,
            "grid": self.spec.config.grid,
            "allow_overlap": self.spec.config.allow_overlap,
            "token_store": str(self.store),
        }


def prepare_calibration(
    spec: CalibrationSpec,
    tokenizer: Tokenizer,
    evaluated: DataSpec | None,
    timeout_s: float = DistributedConfig.timeout_s,
) -> Path:
    """Check the calibration text against the evaluated one and tokenize it (before any process group exists)."""
    if not spec.config.allow_overlap:
        check_overlap(spec.data, evaluated)
    try:
        return prepare(spec.data, tokenizer, timeout_s, progress=False)
    except ValueError as err:  # e.g. an empty file: say it is the calibration text, not data.path, at fault
        raise LitPplError(f"quant.calibration.path={spec.data.describe()!r}: {err}") from None
