"""Per-token outputs in corpus order, and the saved reference a comparison reads instead of a second model.

Every scored token has one index in corpus order (:func:`lit_ppl.data.windows.token_offsets`), carried by each batch
as ``token_index``; whichever rank scores a window writes its tokens' rows there in shared memory-mapped ``.npy``
files (:func:`lit_ppl.runtime.files.shared_npy`), so the files do not depend on the world size or layout that wrote
them, and a resumed run rewrites only what it scores again.

* ``report.per_token=true``: ``per_token.npy`` (float32 NLL) and ``per_token_index.npy`` (document id, position).
* ``save_reference=DIR``: the final hidden state of every scored token (the output head's input) in the run's compute
  dtype, its NLL and target id, the head once (weight, bias and the logit transform), and ``manifest.json`` with what
  a comparison must match (text, tokenizer, windows) — hidden × dtype + 8 bytes per token, exact, where llama.cpp's
  ``--kl-divergence-base`` keeps a uint16 log-probability of every vocabulary entry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lit_ppl.data.windows import Windows, scored_positions
from lit_ppl.errors import LitPplError
from lit_ppl.model.scorer import TokenScorer, logit_transform, transform
from lit_ppl.parallel.tensor_parallel import gather_vocab
from lit_ppl.runtime.files import shared_npy, write_json_atomic

FORMAT = 1
MANIFEST, HEAD = "manifest.json", "head.pt"
# numpy has no bfloat16: its bits are stored as uint16 and viewed back.
STORED = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16, torch.bfloat16: np.uint16}
DTYPE_NAMES = {str(t).removeprefix("torch."): t for t in STORED}
# What a store must share with the run that reads it, and how each difference is named.
MATCH = {
    "tokenizer": "another tokenizer",
    "text": "another text (token store)",
    "windows": "other windows (eval.mode, eval.seq_len, eval.stride or the documents' token counts)",
    "tokens": "another number of scored tokens",
    "vocab": "another vocabulary size",
}


class TokenArrays:
    """Named per-token ``.npy`` arrays of ``tokens`` rows in ``directory``, written at corpus-order indices."""

    def __init__(self, directory: Path, tokens: int, fields: dict[str, tuple[tuple[int, ...], Any]]) -> None:
        self.arrays = {
            name: shared_npy(directory / f"{name}.npy", (tokens, *shape), dtype)
            for name, (shape, dtype) in fields.items()
        }

    def write(self, index: torch.Tensor, **values: torch.Tensor) -> None:
        rows = index.cpu().numpy()
        for name, value in values.items():
            array = self.arrays[name]
            host = value.detach().cpu()
            if host.dtype == torch.bfloat16:
                host = host.view(torch.int16)  # the same bits, in a dtype numpy has
            array[rows] = host.numpy().view(array.dtype).reshape(len(rows), *array.shape[1:])

    def flush(self) -> None:
        """Push the written rows to the file (each progress save: a preempted run's rows survive the node)."""
        for array in self.arrays.values():
            array.flush()

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def write_per_token_index(directory: Path, windows: Windows, doc_lengths: np.ndarray) -> Path:
    """``per_token_index.npy``: ``(tokens, 2)`` int64 document id and position of every row of ``per_token.npy``."""
    doc, position = scored_positions(windows, doc_lengths)
    path = directory / "per_token_index.npy"
    np.save(path, np.stack([doc, position], axis=1))
    return path


def full_head(scorer: TokenScorer) -> dict[str, torch.Tensor]:
    """The whole output head of ``scorer`` on every rank (gathered from FSDP shards and tensor-parallel slices)."""
    head = scorer.head_module
    out = {}
    for name in ("weight", "bias"):
        t = getattr(head, name, None)
        if t is None:
            continue
        if hasattr(t, "full_tensor"):  # an FSDP2 shard
            t = t.full_tensor()
        if hasattr(t, "__tensor_flatten__"):  # quant.head=true (torchao): the values the model computes with
            t = t.dequantize()
        if scorer.tp is not None:
            t = gather_vocab(t, scorer.tp, dim=0)
        out[name] = t.detach().cpu()
    return out


class ReferenceWriter:
    """``save_reference=DIR``: the store a later ``compare=saved`` reads. ``keys``: what the reader must match."""

    def __init__(self, directory: Path, tokens: int, keys: dict[str, Any]) -> None:
        self.dir, self.tokens, self.keys = Path(directory), tokens, keys
        self.arrays: TokenArrays | None = None
        self.head: dict[str, Any] = {}

    def open(self, scorer: TokenScorer, write_head: bool) -> None:
        """Called on every rank once the model is built (the head's gathering is collective)."""
        head = full_head(scorer)
        width, dtype = head["weight"].shape[1], head["weight"].dtype
        manifest = self.dir / MANIFEST
        if manifest.exists():
            old = json.loads(manifest.read_text())
            if {k: old.get(k) for k in self.keys} != self.keys:
                raise LitPplError(
                    f"save_reference={str(self.dir)!r} holds a reference of another run; use another directory "
                    "or delete it"
                )
        scale, cap = logit_transform(scorer.lm.config)
        self.head = {"dtype": str(dtype).removeprefix("torch."), "hidden": width, "scale": scale, "softcap": cap}
        self.arrays = TokenArrays(
            self.dir,
            self.tokens,
            {"hidden": ((width,), STORED[dtype]), "nll": ((), np.float32), "target": ((), np.int32)},
        )
        if write_head:
            self.dir.mkdir(parents=True, exist_ok=True)
            torch.save({**head, "scale": scale, "softcap": cap}, self.dir / HEAD)
            write_json_atomic(manifest, {**self.manifest(), "complete": False})

    def manifest(self) -> dict[str, Any]:
        return {"format": FORMAT, **self.keys, **self.head}

    def write(self, index: torch.Tensor, hidden: torch.Tensor, nll: torch.Tensor, targets: torch.Tensor) -> None:
        assert self.arrays is not None, "open() first"
        self.arrays.write(index, hidden=hidden, nll=nll.float(), target=targets.int())

    def finish(self, facts: dict[str, Any]) -> dict[str, Any]:
        """Rank 0, after every rank has flushed: the manifest marked complete; returns what results.json records."""
        assert self.arrays is not None
        head_bytes = (self.dir / HEAD).stat().st_size
        done = {**self.manifest(), **facts, "complete": True}
        write_json_atomic(self.dir / MANIFEST, done)
        return {"path": str(self.dir), "tokens": self.tokens, "bytes": self.arrays.nbytes() + head_bytes}


class StoredHead(nn.Module):
    """A saved output head: ``transform(hidden @ weight.T + bias)``, this rank's vocabulary slice under TP."""

    def __init__(self, saved: dict[str, Any], rows: slice | None = None) -> None:
        super().__init__()
        weight, bias = saved["weight"], saved.get("bias")
        if rows is not None:
            weight, bias = weight[rows], None if bias is None else bias[rows]
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
        self.scale, self.cap = saved.get("scale"), saved.get("softcap")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return transform(nn.functional.linear(hidden, self.weight, self.bias), self.scale, self.cap)


class SavedReference:
    """A complete store opened for reading, checked against the run's ``keys`` (one line per difference)."""

    def __init__(self, directory: str | Path, keys: dict[str, Any]) -> None:
        self.dir = Path(directory)
        path = self.dir / MANIFEST
        if not path.is_file():
            raise LitPplError(f"compare.reference.store={str(self.dir)!r} holds no {MANIFEST}: not a saved reference")
        self.manifest = json.loads(path.read_text())
        if not self.manifest.get("complete"):
            raise LitPplError(
                f"compare.reference.store={str(self.dir)!r} is incomplete: the run saving it did not finish; rerun it "
                "(it resumes)"
            )
        differ = [MATCH.get(k, k) for k, v in keys.items() if self.manifest.get(k) != v]
        if differ:
            raise LitPplError(
                f"compare.reference.store={str(self.dir)!r} was saved for {', '.join(differ)} than this run's; save "
                "a reference with this run's data and eval settings"
            )
        self.dtype = DTYPE_NAMES[self.manifest["dtype"]]
        self.hidden = np.load(self.dir / "hidden.npy", mmap_mode="r")
        self.nll = np.load(self.dir / "nll.npy", mmap_mode="r")
        self.target = np.load(self.dir / "target.npy", mmap_mode="r")

    def head(self, rows: slice | None = None) -> StoredHead:
        return StoredHead(torch.load(self.dir / HEAD, map_location="cpu", weights_only=True), rows)

    def read(self, index: torch.Tensor, targets: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(hidden (n, d), nll (n,))`` of the corpus tokens ``index``; refuses rows whose target differs."""
        rows = index.cpu().numpy()
        stored, given = torch.from_numpy(self.target[rows].astype(np.int64)), targets.cpu()
        if not torch.equal(stored, given):
            bad = int(rows[(stored != given).nonzero()[0, 0]])
            raise LitPplError(
                f"compare.reference.store={str(self.dir)!r}: corpus token {bad} is another token in the store than "
                "in this run's text"
            )
        hidden = torch.from_numpy(np.ascontiguousarray(self.hidden[rows]))
        if self.dtype == torch.bfloat16:
            hidden = hidden.view(torch.bfloat16)
        nll = torch.from_numpy(self.nll[rows].astype(np.float64))
        return hidden.to(device), nll.to(device)


def vocab_rows(scorer: TokenScorer) -> slice | None:
    """This rank's rows of a whole head under tensor parallelism (the candidate's own slice), else ``None``."""
    if scorer.tp is None:
        return None
    start = int(scorer.head_module.vocab_start)
    return slice(start, start + scorer.head_module.weight.shape[0])  # an FSDP DTensor's shape is the whole slice


def store_keys(datamodule: Any) -> dict[str, Any]:
    """What a saved reference shares with every run that may read it (see :data:`MATCH`)."""
    return {
        "tokenizer": datamodule.tokenizer.fingerprint,
        "text": datamodule.store.name,  # the token store's key: the text and the tokenizer
        "windows": datamodule.windows_digest(),
        "tokens": datamodule.scored_tokens,
        "vocab": datamodule.limits[0] if datamodule.limits else None,
    }


class TokenOutputs:
    """The per-token files of one run (``report.per_token``, ``save_reference``), driven by the module's hooks."""

    def __init__(self, output_dir: Path | None, reference_dir: Path | None) -> None:
        self.output_dir, self.reference_dir = output_dir, reference_dir
        self.per_token: TokenArrays | None = None
        self.reference: ReferenceWriter | None = None
        self.datamodule: Any = None

    @property
    def wants_hidden(self) -> bool:
        return self.reference_dir is not None

    def setup(self, datamodule: Any) -> None:
        self.datamodule = datamodule
        tokens = datamodule.scored_tokens
        if self.output_dir is not None:
            self.per_token = TokenArrays(self.output_dir, tokens, {"per_token": ((), np.float32)})
        if self.reference_dir is not None:
            self.reference = ReferenceWriter(self.reference_dir, tokens, store_keys(datamodule))

    def open(self, scorer: TokenScorer, rank0: bool) -> None:
        if self.reference is not None:
            self.reference.open(scorer, rank0)

    def write(self, batch: dict[str, Any], nll: torch.Tensor, hidden: torch.Tensor | None) -> None:
        index = batch["token_index"]
        if self.per_token is not None:
            self.per_token.write(index, per_token=nll.float())
        if self.reference is not None:
            assert hidden is not None
            self.reference.write(index, hidden, nll, batch["targets"])

    def flush(self) -> None:
        for arrays in (self.per_token, self.reference and self.reference.arrays):
            if arrays is not None:
                arrays.flush()

    def finish(self, facts: dict[str, Any]) -> dict[str, Any]:
        """Rank 0, once every rank has flushed: the index file and the manifest; what results.json records."""
        out: dict[str, Any] = {}
        dm = self.datamodule
        if self.per_token is not None and self.output_dir is not None:
            index = write_per_token_index(self.output_dir, dm.windows, dm.corpus.doc_lengths)
            out["per_token"] = {"path": str(self.output_dir / "per_token.npy"), "index": str(index)}
        if self.reference is not None:
            out["saved_reference"] = self.reference.finish(facts)
        return out
