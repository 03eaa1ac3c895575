"""The saved reference: what a later comparison reads instead of a second model (``save_reference=DIR``, then
``compare=saved compare.reference.store=DIR``).

DIR holds, for every scored token in corpus order (:mod:`lit_ppl.evaluation.token_arrays`), the final hidden state
(the output head's input) in the run's compute dtype (``hidden.npy``), its NLL (``nll.npy``, float32) and target id
(``target.npy``, int32): hidden × dtype + 8 bytes per token, exact, where llama.cpp's ``--kl-divergence-base`` keeps a
uint16 log-probability of every vocabulary entry. Besides: the head once (``head.pt``: weight, bias, the logit
transform); per window a 64-bit digest of its rows in each of the three files (``digest.npy``); and
``manifest.json``: what a reader must match (text, tokenizer, windows), what the saving run was (its weights'
identity, precision and quantization) and, once complete, the SHA-256 of ``head.pt`` and ``digest.npy``.

A store is one run's: one writer at a time (a lock like the run's, :mod:`lit_ppl.runtime.lock`); a store of another
model, text, window plan, precision or quantization is refused, and so is a complete one (never overwritten). It is
marked complete only once every row is checked written: every window's digests present, the targets equal to the
token stream's, the NLLs summing to the run's ``nll_sum``. A reader (:mod:`lit_ppl.evaluation.saved_reference`)
checks the manifest, each file's shape and dtype and the two digested files when it opens the store, and each
window's rows against their digests as it reads them (so no file is read twice): damage is one line naming the file,
never a wrong number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_ppl.errors import LitPplError
from lit_ppl.evaluation.token_arrays import TokenArrays, row_digest, window_spans
from lit_ppl.model.scorer import TokenScorer, logit_transform
from lit_ppl.parallel.tensor_parallel import gather_vocab
from lit_ppl.runtime.files import atomic_path, write_json_atomic
from lit_ppl.runtime.lock import directory_lock, holds

FORMAT = 2
MANIFEST, HEAD, DIGESTS, LOCK = "manifest.json", "head.pt", "digest", ".lit_ppl.store.lock"
ROWS = ("hidden", "nll", "target")  # the per-token files, in digest.npy's column order
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
# What a run writing into a store must share with the run that began it.
WRITER = {
    "model": "another model (other weight files)",
    "precision": "another precision",
    "quant": "another quantization",
}


def store_fields(tokens: int, windows: int, width: int, dtype: torch.dtype) -> dict[str, tuple]:
    """The store's arrays: ``name: (shape, numpy dtype, what a fresh file holds)``."""
    return {
        "hidden": ((tokens, width), STORED[dtype], None),
        "nll": ((tokens,), np.float32, np.nan),
        "target": ((tokens,), np.int32, -1),
        DIGESTS: ((windows, len(ROWS)), np.uint64, None),
    }


def store_lock(directory: str | None, holder: bool) -> contextlib.AbstractContextManager:
    """``DIR/.lit_ppl.store.lock`` while a run saves a reference there (its first process holds it)."""
    if not directory:
        return contextlib.nullcontext()
    return directory_lock(Path(directory).expanduser(), holder, LOCK, "save_reference")


def saving_run(
    path: str, identity: dict[str, Any], precision: str, quant: Any, stored: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(writer keys, description)`` of the run saving a reference: what another writer must share (the weights'
    identity, the precision, every quant setting but ``source``, which says how ranks get the weights, not which),
    and what the manifest, and every comparison against it, says the reference is (its model and quantization: a
    reference saved under ``quant=int8`` is int8's). ``quant``: the run's :class:`lit_ppl.config.quant.QuantConfig`."""
    node = {k: v for k, v in dataclasses.asdict(quant).items() if k != "source"}
    described = None
    if node["name"] != "none":
        described = {k: node[k] for k in ("name", "method", "group_size", "head")}
    elif stored:
        described = {"name": stored["name"], "source": "checkpoint"}
    writer = {"model": identity["digest"], "precision": precision, "quant": node}
    return writer, {"model": path, "quant": described}


def read_manifest(directory: Path, key: str) -> dict[str, Any] | None:
    """The store's manifest (``None``: there is none); one that is not a JSON object is one line."""
    try:
        text = (directory / MANIFEST).read_text()
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(text)
    except ValueError as err:
        manifest = f"is not JSON ({err})"
    if not isinstance(manifest, dict):
        problem = manifest if isinstance(manifest, str) else "is not a JSON object"
        raise LitPplError(f"{key}={str(directory)!r}: its {MANIFEST} {problem}: the store is damaged; save it again")
    return manifest


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def head_digest(weight: torch.Tensor, bias: torch.Tensor | None, rows: Iterable[torch.Tensor] = ()) -> str:
    """SHA-256 of a head's weight and bias as computed with (dtype, shape, bytes): a comparison whose model holds a
    head of the same digest uses it instead of loading the stored copy. ``rows``: the weight's consecutive blocks of
    rows, hashed one at a time in place of ``weight``'s values (``weight`` then gives only the dtype and shape)."""
    h = hashlib.sha256()
    for t, parts in ((weight, rows), (bias, ())):
        if t is not None:
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            for part in parts or (t,):
                h.update(part.detach().contiguous().cpu().view(torch.uint8).numpy())
    return h.hexdigest()


def full_head(scorer: TokenScorer) -> dict[str, torch.Tensor]:
    """The whole output head of ``scorer`` on every rank (gathered from FSDP shards and tensor-parallel slices)."""
    head = scorer.head_module
    out = {}
    for name in ("weight", "bias"):
        t = head.full_weight() if name == "weight" and hasattr(head, "full_weight") else getattr(head, name, None)
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
    """``save_reference=DIR``: the store a later ``compare=saved`` reads.

    Args:
        directory: the store.
        keys: what a reader must match (:func:`store_keys`).
        first_token: each window's first row (and the total): where its rows go.
        writer: what the saving run is, and ``described``: what the manifest says of it (:func:`saving_run`).
    """

    def __init__(
        self,
        directory: Path,
        keys: dict[str, Any],
        first_token: np.ndarray,
        writer: dict[str, Any],
        described: dict[str, Any],
    ) -> None:
        self.dir, self.keys, self.first_token = Path(directory), keys, first_token
        self.writer, self.described = writer, described
        self.arrays: TokenArrays | None = None
        self.head: dict[str, Any] = {}  # what the manifest says of the head
        self.saved_head: dict[str, Any] = {}  # head.pt's content

    @property
    def name(self) -> str:
        return f"save_reference={str(self.dir)!r}"

    def check(self) -> None:
        """Before the model loads: a store of another run, or a complete one, is refused (never overwritten)."""
        old = read_manifest(self.dir, "save_reference")
        if old is None:
            return
        if old.get("format") != FORMAT:
            raise LitPplError(
                f"{self.name} holds a reference of format {old.get('format')!r} (this lit-ppl writes {FORMAT}); it is "
                "not overwritten: give another directory, or delete it"
            )
        was = old.get("writer") if isinstance(old.get("writer"), dict) else {}
        differ = [MATCH[k] for k, v in self.keys.items() if old.get(k) != v]
        differ += [WRITER[k] for k, v in self.writer.items() if was.get(k) != v]
        state = "complete" if old.get("complete") else "unfinished"
        if differ:
            raise LitPplError(
                f"{self.name} holds the {state} reference of another run ({', '.join(differ)}; saved from "
                f"{old.get('model')!r}); it is not overwritten: give another directory, or delete it"
            )
        if old.get("complete"):
            # Rewriting would only put a usable store at risk (a rewrite cut short leaves it unfinished) for the same
            # rows: the same weights, text, windows, precision and quantization.
            raise LitPplError(
                f"{self.name} already holds this model's complete reference (the same weights, text, windows, "
                f"precision and quantization): compare against it (compare=saved compare.reference.store={self.dir}), "
                "or delete it to save it again"
            )

    def open(self, scorer: TokenScorer) -> None:
        """Every rank once the model is built: the head, gathered (collective: from every rank's shards)."""
        head = full_head(scorer)
        width, dtype = head["weight"].shape[1], head["weight"].dtype
        scale, cap = logit_transform(scorer.lm.config)
        self.saved_head = {**head, "scale": scale, "softcap": cap}
        self.head = {"dtype": str(dtype).removeprefix("torch."), "hidden": width, "scale": scale, "softcap": cap}
        self.head["head_digest"] = head_digest(head["weight"], head.get("bias"))
        tokens, windows = int(self.first_token[-1]), len(self.first_token) - 1
        self.arrays = TokenArrays(self.dir, store_fields(tokens, windows, width, dtype))

    def manifest(self) -> dict[str, Any]:
        windows = len(self.first_token) - 1
        return {
            "format": FORMAT,
            **self.keys,
            "writer": self.writer,
            **self.described,
            **self.head,
            "window_count": windows,
        }

    def prepare(self, resumed: bool) -> str | None:
        """The first process, before any row is written: the manifest (unfinished: the directory is lit-ppl's from
        here on) and the head, then fresh files, or (resumed) what is wrong with the old ones."""
        assert self.arrays is not None, "open() first"
        write_json_atomic(self.dir / MANIFEST, {**self.manifest(), "complete": False})
        with atomic_path(self.dir / HEAD) as tmp:
            torch.save(self.saved_head, tmp)
        if not resumed:
            self.arrays.create()
            return None
        problems = self.arrays.problems()
        return f"{self.name}: {', '.join(problems)}" if problems else None

    def write(self, batch: dict[str, Any], hidden: torch.Tensor, nll: torch.Tensor) -> None:
        assert self.arrays is not None, "open() first"
        written = self.arrays.write(batch["token_index"], hidden=hidden, nll=nll.float(), target=batch["targets"].int())
        digests = self.arrays.arrays[DIGESTS]
        for window, span in window_spans(batch["window_ids"], self.first_token):
            digests[window] = [row_digest(written[name][span]) for name in ROWS]

    def unwritten(self, chunks: Iterable[tuple[slice, np.ndarray]], nll_sum: float) -> str | None:
        """What the files lack (``None``: every row written, the targets the text's, the NLLs summing to ``nll_sum``);
        ``chunks``: ``(rows, targets)`` of the corpus (:func:`lit_ppl.evaluation.token_arrays.corpus_rows`)."""
        assert self.arrays is not None
        files = {name: self.arrays.read(name) for name in (*ROWS[1:], DIGESTS)}  # nll, target: small
        if (self.dir / LOCK).exists() and not holds(self.dir / LOCK):
            return f"its lock {self.dir / LOCK} was taken over by another run while this one wrote"
        missing = np.flatnonzero((files[DIGESTS] == 0).any(axis=1))
        if len(missing):
            first = int(self.first_token[missing[0]])
            return (
                f"{len(missing):,} of {len(files[DIGESTS]):,} windows were never written (first: rows from {first:,})"
            )
        for rows, targets in chunks:
            bad = np.flatnonzero(files["target"][rows] != targets)
            if len(bad):
                at = rows.start + int(bad[0])
                return (
                    f"target.npy holds {len(bad):,} targets that are not the text's (first: row {at:,}, token "
                    f"{int(files['target'][at])} where the text has {int(targets[bad[0]])})"
                )
        total = float(np.sum(files["nll"], dtype=np.float64))
        if not abs(total - nll_sum) <= nll_sum * 2.0**-24 + 1e-9:  # each float32 NLL within 2^-24 of the run's
            return f"nll.npy sums to {total!r}, the run's nll_sum is {nll_sum!r}"
        return None

    def finish(self, facts: dict[str, Any]) -> dict[str, Any]:
        """The first process, every row checked: the manifest marked complete, with the digests of ``head.pt`` and
        ``digest.npy``; returns what results.json records."""
        assert self.arrays is not None
        self.arrays.flush()
        files = {name: file_digest(self.dir / name) for name in (HEAD, f"{DIGESTS}.npy")}
        write_json_atomic(self.dir / MANIFEST, {**self.manifest(), **facts, "files": files, "complete": True})
        size = self.arrays.nbytes() + (self.dir / HEAD).stat().st_size
        return {"path": str(self.dir), "tokens": int(self.first_token[-1]), "bytes": size}


def store_keys(datamodule: Any) -> dict[str, Any]:
    """What a saved reference shares with every run that may read it (see :data:`MATCH`)."""
    return {
        "tokenizer": datamodule.tokenizer.fingerprint,
        "text": datamodule.store.name,  # the token store's key: the text and the tokenizer
        "windows": datamodule.windows_digest(),
        "tokens": datamodule.scored_tokens,
        "vocab": datamodule.limits[0] if datamodule.limits else None,
    }
