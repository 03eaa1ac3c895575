"""A saved reference opened for reading (``compare=saved``): checked against the run and against itself, then read
window by window (the store's format: :mod:`lit_ppl.evaluation.reference`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lit_ppl.errors import LitPplError
from lit_ppl.evaluation.reference import (
    DIGESTS,
    DTYPE_NAMES,
    FORMAT,
    HEAD,
    MANIFEST,
    MATCH,
    ROWS,
    file_digest,
    head_digest,
    read_manifest,
    store_fields,
)
from lit_ppl.evaluation.token_arrays import row_digest, window_spans
from lit_ppl.model.scorer import TokenScorer, blocks_of, transform
from lit_ppl.parallel.vocab_rows import RowsHead


class StoredHead(nn.Module):
    """A saved output head: ``transform(linear(hidden))``, ``linear`` the stored ``weight`` and ``bias`` (this rank's
    vocabulary slice under TP; under FSDP sharded, or held by blocks of rows, by
    :func:`lit_ppl.model.placement.place_head`), or the model's own head where its weights are the stored ones."""

    def __init__(self, linear: nn.Module, scale: float | None, cap: float | None) -> None:
        super().__init__()
        self.linear, self.scale, self.cap = linear, scale, cap

    @classmethod
    def of(cls, saved: dict[str, Any], rows: slice | None = None) -> StoredHead:
        """The head ``head.pt`` holds (``rows``: only those vocabulary rows)."""
        weight, bias = saved["weight"], saved.get("bias")
        if rows is not None:
            weight, bias = weight[rows], None if bias is None else bias[rows]
        keep = lambda t: nn.Parameter(t.contiguous(), requires_grad=False)  # noqa: E731
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = keep(weight)
        if bias is not None:
            linear.bias = keep(bias)
        return cls(linear, saved.get("scale"), saved.get("softcap"))

    @property
    def weight(self) -> torch.Tensor:
        """The stored weight (a meta tensor of its shape and dtype where it is held by rows)."""
        return self.linear.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return transform(self.linear(hidden), self.scale, self.cap)

    def blocks(self) -> list[tuple[int, Any]] | None:
        """Where it is held by blocks of rows, those blocks' heads (:func:`lit_ppl.model.scorer.blocks_of`)."""
        return blocks_of(self.linear, self.scale, self.cap) if isinstance(self.linear, RowsHead) else None


class SavedReference:
    """A complete store opened for reading, checked against the run's ``keys`` (one line per difference) and against
    itself: its files' shapes and dtypes, ``head.pt`` and ``digest.npy`` against the manifest's digests now, each
    window's rows against ``digest.npy`` as :meth:`read` reads them."""

    KEY = "compare.reference.store"

    def __init__(self, directory: str | Path, keys: dict[str, Any], first_token: np.ndarray) -> None:
        self.dir, self.first_token = Path(directory), first_token
        self.manifest = read_manifest(self.dir, self.KEY)
        if self.manifest is None:
            raise self.error(f"holds no {MANIFEST}: not a saved reference")
        m = self.manifest
        if m.get("format") != FORMAT:
            raise self.error(f"its {MANIFEST} says format {m.get('format')!r}; this lit-ppl reads format {FORMAT}")
        if not m.get("complete"):
            raise self.error("is incomplete: the run saving it did not finish; rerun it (it resumes)", damaged=False)
        differ = [MATCH.get(k, k) for k, v in keys.items() if m.get(k) != v]
        if differ:
            raise LitPplError(
                f"{self.KEY}={str(self.dir)!r} was saved for {', '.join(differ)} than this run's; save a reference "
                "with this run's data and eval settings"
            )
        if m.get("dtype") not in DTYPE_NAMES or not isinstance(m.get("hidden"), int) or m["hidden"] < 1:
            raise self.error(
                f"its {MANIFEST} gives dtype {m.get('dtype')!r} and hidden {m.get('hidden')!r} (dtype: one of "
                f"{', '.join(DTYPE_NAMES)}; hidden: a positive integer)"
            )
        self.dtype = DTYPE_NAMES[m["dtype"]]
        fields = store_fields(keys["tokens"], len(first_token) - 1, m["hidden"], self.dtype)
        self.files = {name: self._load(name, shape, dtype) for name, (shape, dtype, _) in fields.items()}
        digests = m.get("files") if isinstance(m.get("files"), dict) else {}
        for name in (HEAD, f"{DIGESTS}.npy"):
            if not (self.dir / name).is_file() or file_digest(self.dir / name) != digests.get(name):
                raise self.error(f"{name} is not the file whose digest its {MANIFEST} recorded at completion")

    def error(self, problem: str, damaged: bool = True) -> LitPplError:
        tail = ": the store was changed or damaged; save the reference again" if damaged else ""
        return LitPplError(f"{self.KEY}={str(self.dir)!r} {problem}{tail}")

    def _load(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        path = self.dir / f"{name}.npy"
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:  # missing, truncated, empty, object arrays, not a .npy
            raise self.error(f"{path.name} cannot be read as a .npy array ({type(err).__name__}: {err})") from None
        if array.shape != shape or array.dtype != np.dtype(dtype):
            hidden = f" for {self.manifest['dtype']} hidden states" if name == "hidden" else ""
            raise self.error(
                f"{path.name} holds a {array.shape} {array.dtype} array where its {MANIFEST} means {shape} "
                f"{np.dtype(dtype)}{hidden}"
            )
        return array

    def head(self, rows: slice | None = None, own: nn.Module | None = None) -> StoredHead:
        """The stored head (``rows``: this rank's vocabulary slice), or ``own`` — the model's plain head, whole,
        sharded by FSDP or held by rows — where its weights are the stored ones (the same digest: a quantization that
        keeps the head, compared with its own float model), which then is not held twice."""
        try:  # weights_only: tensors and numbers, never code (the digest was checked when the store was opened)
            # Memory-mapped: its pages are read only where used, never when the model's own head serves.
            saved = torch.load(self.dir / HEAD, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # UnpicklingError, RuntimeError, EOFError...: a file this lit-ppl did not save
            raise self.error(f"{HEAD} is not a head lit-ppl saved ({type(err).__name__})") from None
        weight = saved.get("weight") if isinstance(saved, dict) else None
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.shape[1] != self.manifest["hidden"]:
            raise self.error(f"{HEAD} holds no (vocabulary, {self.manifest['hidden']}) weight")
        m = self.manifest
        if own is not None and m.get("head_digest") and self.is_stored(own):
            return StoredHead(own, m["scale"], m["softcap"])
        return StoredHead.of(saved, rows)

    def is_stored(self, head: nn.Module) -> bool:
        """Whether ``head`` is a plain linear head whose weight and bias are the stored ones, bit for bit. Where it is
        sharded (FSDP) its parts are gathered, a block of rows at a time where it is held by rows: collective."""
        if isinstance(head, RowsHead):
            return head_digest(head.weight, None, head.gathered_blocks()) == self.manifest["head_digest"]
        weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
        plain = [t for t in (weight, bias) if t is not None]
        if not plain or any(hasattr(t, "__tensor_flatten__") and not hasattr(t, "full_tensor") for t in plain):
            return False  # torchao's: not the stored float values
        whole = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in (weight, bias) if t is not None]
        return head_digest(whole[0], whole[1] if bias is not None else None) == self.manifest["head_digest"]

    def read(self, batch: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(hidden (n, d), nll (n,))`` of the batch's scored tokens, each window's rows checked against their digests
        and the targets against the run's."""
        rows = batch["token_index"].cpu().numpy()
        values = {name: self.files[name][rows] for name in ROWS}
        digests = self.files[DIGESTS]
        for window, span in window_spans(batch["window_ids"], self.first_token):
            for column, name in enumerate(ROWS):
                if row_digest(values[name][span]) != int(digests[window, column]):
                    first, last = self.first_token[window], self.first_token[window + 1] - 1
                    raise self.error(
                        f"{name}.npy rows {first:,}–{last:,} (window {window}) are not the rows the saving run wrote "
                        f"(their digest in {DIGESTS}.npy differs)"
                    )
        stored, given = torch.from_numpy(values["target"].astype(np.int64)), batch["targets"].cpu()
        if not torch.equal(stored, given):
            bad = int(rows[(stored != given).nonzero()[0, 0]])
            raise LitPplError(
                f"{self.KEY}={str(self.dir)!r}: corpus token {bad} is another token in the store than in this run's "
                "text"
            )
        hidden = torch.from_numpy(np.ascontiguousarray(values["hidden"]))
        if self.dtype == torch.bfloat16:
            hidden = hidden.view(torch.bfloat16)
        nll = torch.from_numpy(values["nll"].astype(np.float64))
        return hidden.to(device), nll.to(device)


def vocab_rows(scorer: TokenScorer) -> slice | None:
    """This rank's rows of a whole head under tensor parallelism (the candidate's own slice), else ``None``."""
    if scorer.tp is None:
        return None
    start = int(scorer.head_module.vocab_start)
    return slice(start, start + scorer.head_module.weight.shape[0])  # an FSDP DTensor's shape is the whole slice
