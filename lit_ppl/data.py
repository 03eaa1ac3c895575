"""Documents → tokens → evaluation windows → exactly sharded batches.

Documents come from local files (``.txt``: a whole file is one document unless ``document_separator``
splits it; ``.jsonl``/``.json``/``.parquet`` with a text field) or a hub dataset, loaded with Hugging Face
``datasets``. Tokenization is a batched ``map`` whose result ``datasets`` caches on disk under a
fingerprint of (documents, tokenizer, lit-ppl version), so a second run over the same text and tokenizer
does not tokenize again.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lit_ppl.balance import given_weights, measured_weights, probe_tokens_per_s
from lit_ppl.sampler import PAD, ExactBatchSampler
from lit_ppl.tokenizer import Tokenizer
from lit_ppl.windows import Windows, build_windows, doc_offsets

DEMO_TEXT = "package://lit_ppl.assets/demo.txt"
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TOKENIZE_VERSION = "1"  # bump when the tokenization output changes, to invalidate caches


@dataclass
class DataSpec:
    """Where the documents come from.

    Attributes:
        path: one local file or a list of them (``.txt``, ``.jsonl``, ``.json``, ``.parquet``); the default
            is a short text shipped with the package.
        hub_name: a hub dataset name (used when ``path`` is empty), e.g. ``wikitext``.
        hub_config: the hub dataset's configuration, e.g. ``wikitext-2-raw-v1``.
        split: which split to evaluate.
        text_field: the column holding the text (``.jsonl``/``.parquet``/hub datasets).
        join_rows: concatenate all rows into one text before splitting (line-per-row hub datasets).
        document_separator: a regex that splits each text into documents (``None``: one text, one document).
        encoding_errors: how ``.txt`` files that are not valid UTF-8 are read: ``strict`` (an error naming the
            file and byte offset), ``replace`` (U+FFFD) or ``ignore``.
        cache_dir: where ``datasets`` keeps loaded and tokenized data (``None``: its default cache).
    """

    path: Any = DEMO_TEXT
    hub_name: str | None = None
    hub_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    join_rows: bool = False
    document_separator: str | None = None
    encoding_errors: str = "strict"
    cache_dir: str | None = None
    paths: list[str] = field(init=False)

    def __post_init__(self) -> None:
        raw = [] if self.path in (None, "") else [self.path] if isinstance(self.path, str) else list(self.path)
        self.paths = [_resolve(p) for p in raw]
        if not self.paths and not self.hub_name:
            raise ValueError("no data: set data.path=FILE (or a list of files) or data.hub_name=NAME")
        suffixes = {Path(p).suffix for p in self.paths}
        if len(suffixes) > 1 or not suffixes <= set(_BUILDERS):
            raise ValueError(
                f"data.path has files of type {sorted(suffixes)}; give files of one type among {sorted(_BUILDERS)}"
            )
        if self.encoding_errors not in ("strict", "replace", "ignore"):
            raise ValueError(f"data.encoding_errors={self.encoding_errors!r} is not one of strict, replace, ignore")
        if self.document_separator is not None:
            try:
                re.compile(self.document_separator)
            except re.error as err:
                raise ValueError(f"data.document_separator={self.document_separator!r} is not a regex: {err}") from err


def _resolve(path: str) -> str:
    if path.startswith("package://"):
        package, name = path.removeprefix("package://").split("/", 1)
        return str(files(package) / name)
    local = Path(path).expanduser()
    if not local.is_file():
        raise FileNotFoundError(f"data.path={path!r} is not a file")
    return str(local.resolve())


def _check_utf8(paths: list[str]) -> None:
    """Fail before loading with the file and byte offset of the first invalid UTF-8 sequence."""
    for path in paths:
        try:
            Path(path).read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{path} is not valid UTF-8 at byte offset {err.start} ({err.reason}); fix the file or set "
                "data.encoding_errors=replace (or ignore)"
            ) from None


def load_texts(spec: DataSpec):
    """Load the raw texts as a ``datasets.Dataset`` with one column, ``text``, one row per document."""
    import datasets

    if spec.paths:
        builder = _BUILDERS[Path(spec.paths[0]).suffix]
        kwargs = {"sample_by": "document", "encoding_errors": spec.encoding_errors} if builder == "text" else {}
        if builder == "text" and spec.encoding_errors == "strict":
            _check_utf8(spec.paths)
        ds = datasets.load_dataset(builder, data_files=spec.paths, split="train", cache_dir=spec.cache_dir, **kwargs)
    else:
        ds = datasets.load_dataset(spec.hub_name, spec.hub_config, split=spec.split, cache_dir=spec.cache_dir)
    if spec.text_field not in ds.column_names:
        raise ValueError(f"data.text_field={spec.text_field!r} is not a column; the dataset has {ds.column_names}")
    ds = (
        ds.select_columns([spec.text_field]).rename_columns({spec.text_field: "text"})
        if spec.text_field != "text"
        else ds.select_columns(["text"])
    )
    if spec.join_rows:
        ds = datasets.Dataset.from_dict({"text": ["".join(ds["text"])]})
    if spec.document_separator is not None:
        sep = spec.document_separator
        ds = ds.map(
            lambda b: {"text": [d for t in b["text"] for d in re.split(sep, t) if d.strip()]},
            batched=True,
            desc="splitting documents",
        )
    if len(ds) == 0:
        raise ValueError(f"the dataset {spec.paths or spec.hub_name} has no documents")
    return ds


def tokenize(texts, tokenizer: Tokenizer, batch_size: int = 256):
    """Add ``input_ids``, ``words`` and ``bytes`` columns; cached by ``datasets`` under a stable fingerprint.

    Words and bytes follow lm-evaluation-harness: ``len(re.split(r"\\s+", doc))`` and the UTF-8 length.
    """

    def encode(batch: dict[str, list[str]]) -> dict[str, list]:
        return {
            "input_ids": tokenizer.encode(batch["text"]),
            "words": [len(re.split(r"\s+", t)) for t in batch["text"]],
            "bytes": [len(t.encode("utf-8")) for t in batch["text"]],
        }

    key = f"{texts._fingerprint}|{tokenizer.fingerprint}|{TOKENIZE_VERSION}"
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:32]
    return texts.map(encode, batched=True, batch_size=batch_size, new_fingerprint=fingerprint, desc="tokenizing")


@dataclass(frozen=True)
class Corpus:
    """Tokenized documents laid out flat as ``[BOS] + doc`` for each document."""

    tokens: np.ndarray  # int64, all documents with their BOS
    scorable: np.ndarray  # bool, False at every document's BOS
    doc_lengths: np.ndarray
    doc_words: np.ndarray
    doc_bytes: np.ndarray

    @classmethod
    def from_dataset(cls, ds, context_id: int) -> Corpus:
        ids = ds["input_ids"]
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        empty = np.flatnonzero(lengths == 0)
        if len(empty):
            raise ValueError(
                f"{len(empty)} of {len(lengths)} documents have no tokens (first: document {int(empty[0])}); "
                "remove empty documents or adjust data.document_separator"
            )
        offsets = doc_offsets(lengths)
        tokens = np.empty(int(lengths.sum() + len(lengths)), dtype=np.int64)
        tokens[offsets] = context_id
        body = np.ones(len(tokens), dtype=bool)
        body[offsets] = False
        tokens[body] = np.fromiter((t for doc in ids for t in doc), dtype=np.int64, count=int(lengths.sum()))
        return cls(tokens, body, lengths, np.asarray(ds["words"], np.int64), np.asarray(ds["bytes"], np.int64))


class WindowCollator:
    """Turns a list of window ids into a batch; everything the step needs is computed here, on the host.

    The batch holds ``input_ids`` ``(b, t)`` (right-padded: a causal model's real positions never see the
    padding), the flat indices into ``(b·t)`` of the scored positions and their target ids, and the
    documents / words / bytes that the batch's windows start, and each scored token's document. Shapes are
    known without a device sync.
    """

    def __init__(self, corpus: Corpus, windows: Windows, pad_id: int = 0) -> None:
        self.corpus, self.windows, self.pad_id = corpus, windows, pad_id
        self.offsets = doc_offsets(corpus.doc_lengths)

    def __call__(self, ids: list[int]) -> dict[str, Any]:
        real = [i for i in ids if i != PAD]
        w, tokens = self.windows, self.corpus.tokens
        width = max([int(w.end[i] - w.start[i]) for i in real], default=1)
        input_ids = np.full((len(ids), width), self.pad_id, dtype=np.int64)
        index, targets, docs = [], [], []
        for row, i in enumerate(ids):
            if i == PAD:
                continue
            start, end = int(w.start[i]), int(w.end[i])
            input_ids[row, : end - start] = tokens[start:end]
            target_pos = np.arange(start + 1, end + 1)
            keep = (target_pos >= w.score_from[i]) & self.corpus.scorable[target_pos]
            index.append(row * width + np.flatnonzero(keep))
            targets.append(tokens[target_pos[keep]])
            docs.append(np.searchsorted(self.offsets, target_pos[keep], side="right") - 1)
        cat = lambda parts: torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))  # noqa: E731
        return {
            "input_ids": torch.from_numpy(input_ids),
            "score_index": cat(index),
            "targets": cat(targets),
            "doc_ids": cat(docs),  # the document each scored token belongs to (for the per-document table)
            "documents": torch.tensor(int(w.documents[real].sum())),
            "words": torch.tensor(int(w.words[real].sum())),
            "bytes": torch.tensor(int(w.bytes[real].sum())),
            "window_ids": list(ids),
        }


class WindowIds(Dataset):
    """The identity over window ids: the sampler yields ids (``PAD`` included), the collator builds tensors.

    Not ``range(n)``: ``range(n)[PAD]`` is the last window, which would then be scored twice.
    """

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not (i == PAD or 0 <= i < self.n):
            raise IndexError(f"window id {i} out of range [0, {self.n})")
        return i


class PerplexityDataModule(L.LightningDataModule):
    """Evaluation windows over a corpus, sharded exactly over the trainer's ranks.

    Args:
        data: where the documents come from.
        tokenizer: the model's tokenizer.
        mode: ``rolling``, ``sliding`` or ``block`` (see :mod:`lit_ppl.windows`).
        seq_len: most input tokens per window.
        stride: ``sliding`` mode's stride.
        batch_size: windows per batch, or ``"auto"``: the largest that fits (:mod:`lit_ppl.autobatch`).
        num_workers: DataLoader workers (batches are cheap to build; 0 is usually right).
        limits: the model's ``(vocab_size, max_positions)``, checked against the data and ``seq_len``.
        autobatch: options of :func:`lit_ppl.autobatch.resolve` for ``batch_size="auto"``.
        deterministic: batches formed independently of the world size, whole batches per rank (:mod:`lit_ppl.sampler`).
        balance: ``tokens``, ``weights`` or ``measured`` (:mod:`lit_ppl.balance`).
        weights: ``balance=weights``: relative speed per node or per rank.
    """

    def __init__(
        self,
        data: DataSpec,
        tokenizer: Tokenizer,
        mode: str = "rolling",
        seq_len: int = 512,
        stride: int | None = None,
        batch_size: int | str = 8,
        num_workers: int = 0,
        limits: tuple[int, int | None] | None = None,
        autobatch: dict[str, Any] | None = None,
        deterministic: bool = False,
        balance: str = "tokens",
        weights: list[float] | None = None,
    ) -> None:
        super().__init__()
        self.deterministic, self.balance, self.weights = deterministic, balance, weights
        # Resolved in val_dataloader (or restored by a resume, so that the plan is the one the progress belongs to).
        self.rank_weights: list[float] | None = None
        self.measured_tokens_per_s: list[float] | None = None
        if batch_size != "auto" and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size={batch_size!r} must be a positive integer or auto")
        self.limits, self.autobatch = limits, autobatch or {}
        self.spec, self.tokenizer = data, tokenizer
        self.mode, self.seq_len, self.stride = mode, seq_len, stride
        self.batch_size, self.num_workers = batch_size, num_workers
        self.corpus: Corpus | None = None
        self.windows: Windows | None = None
        self.skip_batches = 0  # set when resuming: this many batches of every rank are already done

    def prepare_data(self) -> None:
        # Lightning runs this on one process per node before setup(): it fills the tokenization cache
        # once, and every rank's setup() then reads it instead of tokenizing again.
        tokenize(load_texts(self.spec), self.tokenizer)

    def setup(self, stage: str | None = None) -> None:
        if self.corpus is not None:
            return
        if self.limits is not None and self.limits[1] is not None and self.seq_len > self.limits[1]:
            raise ValueError(
                f"eval.seq_len={self.seq_len} exceeds the model's maximum of {self.limits[1]} positions; "
                f"use eval.seq_len<={self.limits[1]}"
            )
        corpus = Corpus.from_dataset(tokenize(load_texts(self.spec), self.tokenizer), self.tokenizer.context_id)
        vocab = self.limits[0] if self.limits is not None else None
        if vocab is not None and corpus.tokens.max() >= vocab:
            raise ValueError(
                f"token id {int(corpus.tokens.max())} is out of the model's vocabulary of {vocab}: the tokenizer "
                "does not match the model"
            )
        self.windows = build_windows(
            self.mode, corpus.doc_lengths, self.seq_len, self.stride, corpus.doc_words, corpus.doc_bytes
        )
        self.corpus = corpus

    def batch_sampler(self, rank: int, world_size: int, skip: int = 0) -> ExactBatchSampler:
        assert self.windows is not None, "call setup() first"
        return ExactBatchSampler(
            self.windows.lengths, rank, world_size, self.batch_size, skip, self.rank_weights, self.deterministic
        )

    def resolve_weights(self) -> list[float] | None:
        """Every rank's relative speed under ``balance`` (``None``: all alike); the model is built by now."""
        if self.balance == "tokens":
            return None
        if self.balance == "weights":
            return given_weights(self.weights or [], self.trainer.world_size, self.trainer.num_nodes)
        tokens_per_s = probe_tokens_per_s(
            self.trainer.lightning_module.scorer,
            self.batch_size,
            self.seq_len,
            self.trainer.precision_plugin.val_step_context,
        )
        self.measured_tokens_per_s, weights = measured_weights(tokens_per_s)
        return weights

    def val_dataloader(self) -> DataLoader:
        if self.batch_size == "auto":  # the model is built by now: probe it
            from lit_ppl.autobatch import resolve

            self.batch_size = resolve(self.trainer, self.seq_len, **self.autobatch)
        if self.rank_weights is None and self.trainer is not None:
            self.rank_weights = self.resolve_weights()
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        return DataLoader(
            WindowIds(len(self.windows)),
            batch_sampler=self.batch_sampler(rank, world, self.skip_batches),
            collate_fn=WindowCollator(self.corpus, self.windows),
            num_workers=self.num_workers,
        )
