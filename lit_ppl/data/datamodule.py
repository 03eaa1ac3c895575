"""Tokenized corpus → evaluation windows → exactly sharded batches.

The documents (:mod:`lit_ppl.data.sources`) are tokenized once per corpus and tokenizer into a token store
(:mod:`lit_ppl.data.store`) that every rank memory-maps; a batch reads only its own windows' tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lit_ppl.config.schema import DistributedConfig
from lit_ppl.data.batch_plan import BatchPlan
from lit_ppl.data.sampler import PAD, ExactBatchSampler
from lit_ppl.data.sources import DataSpec
from lit_ppl.data.store import Corpus, prepare
from lit_ppl.data.windows import Windows, build_windows, joined_to_flat, token_offsets
from lit_ppl.errors import LitPplError
from lit_ppl.model.tokenizer import Tokenizer
from lit_ppl.parallel.layout import Layout


class WindowCollator:
    """Turns a list of window ids into a batch; everything the step needs is computed here, on the host.

    The batch holds ``input_ids`` ``(b, t)`` (right-padded: a causal model's real positions never see the
    padding), the flat indices into ``(b·t)`` of the scored positions and their target ids, and the
    documents / words / bytes that the batch's windows start, each scored token's document and its index in corpus
    order (:func:`lit_ppl.data.windows.token_offsets`: where per-token outputs go), and the batch's window ids
    (``PAD`` for a padding entry). Shapes are known without a device sync.
    """

    def __init__(
        self, corpus: Corpus, windows: Windows, pad_id: int = 0, first_token: np.ndarray | None = None
    ) -> None:
        self.corpus, self.windows, self.pad_id = corpus, windows, pad_id
        self.offsets = corpus.offsets
        self.first_token = token_offsets(windows, corpus.doc_lengths) if first_token is None else first_token

    def __call__(self, ids: list[int]) -> dict[str, Any]:
        # Vectorised over the batch's (rows × width) grid: no numpy call per window.
        w, tokens, offsets = self.windows, self.corpus.tokens, self.offsets
        window_ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        is_real = window_ids != PAD
        real = window_ids[is_real]
        safe = np.where(is_real, window_ids, 0)  # a padding entry reads window 0's bounds, then gets no positions
        start, score_from = w.start[safe], w.score_from[safe]
        length = np.where(is_real, w.end[safe] - start, 0)
        width = int(length.max(initial=1))
        col = np.arange(width)
        inside = col < length[:, None]  # a real input position (a padding entry has none)
        target_pos = start[:, None] + col + 1  # the token each input position predicts
        input_ids = np.full((len(window_ids), width), self.pad_id, dtype=np.int64)
        if w.joined:  # llamacpp: joined-stream positions, read from the flat store; the stream has no inner BOS
            lengths = self.corpus.doc_lengths
            input_ids[inside] = tokens[joined_to_flat(target_pos[inside] - 1, lengths, w.bos_first)]
            if w.bos_first:  # llama-perplexity's BOS in place of each chunk's first token
                input_ids[is_real, 0] = tokens[offsets[0]]
            target_pos = joined_to_flat(np.minimum(target_pos, w.end[safe, None]), lengths, w.bos_first)
            keep = inside & (col >= (score_from - start - 1)[:, None])
            doc = np.searchsorted(offsets, target_pos, side="right") - 1
        else:
            input_ids[inside] = tokens[target_pos[inside] - 1]
            doc = np.searchsorted(offsets, target_pos, side="right") - 1
            # Scored: from score_from on, and never a document's BOS (context only, not part of any document).
            keep = inside & (target_pos >= score_from[:, None]) & (target_pos != offsets[doc])
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
        token_index = self.first_token[safe][:, None] + np.cumsum(keep, axis=1) - 1  # a row's scored tokens in order
        return {
            "input_ids": torch.from_numpy(input_ids),
            "score_index": as_tensor(np.flatnonzero(keep)),  # row-major: row by row, positions ascending
            "targets": as_tensor(tokens[target_pos[keep]]),
            "doc_ids": as_tensor(doc[keep]),  # the document each scored token belongs to (for the per-document table)
            "token_index": as_tensor(token_index[keep]),
            "documents": torch.tensor(int(w.documents[real].sum())),
            "words": torch.tensor(int(w.words[real].sum())),
            "bytes": torch.tensor(int(w.bytes[real].sum())),
            # One tensor, not a list: Lightning walks a batch's lists element by element on every step.
            "window_ids": torch.from_numpy(window_ids),
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
        mode: ``rolling``, ``sliding``, ``block`` or ``llamacpp`` (see :mod:`lit_ppl.data.windows`).
        seq_len: most input tokens per window.
        stride: ``sliding`` mode's stride.
        batch_size: windows per batch, or ``"auto"``: the largest that fits (:mod:`lit_ppl.data.autobatch`).
        limits: the model's ``(vocab_size, max_positions)``, checked against the data and ``seq_len``.
        timeout_s: longest wait for another process (on this node or another) tokenizing the same corpus.
        deterministic: batches formed independently of the world size, whole batches per rank
        (:mod:`lit_ppl.data.sampler`).
        layout: the rank layout (:mod:`lit_ppl.parallel.layout`): windows are shared over its data-parallel ranks only,
            every rank of a tensor-parallel group reading the same batches. ``None``: every rank data-parallel.
        plan: the batch plan (:mod:`lit_ppl.data.batch_plan`), shared with the resume callback; ``None``: one of
            ``batch_size`` windows, shared by tokens.
    """

    def __init__(
        self,
        data: DataSpec,
        tokenizer: Tokenizer,
        mode: str = "rolling",
        seq_len: int = 512,
        stride: int | None = None,
        batch_size: int | str = 8,
        limits: tuple[int, int | None] | None = None,
        deterministic: bool = False,
        timeout_s: float = DistributedConfig.timeout_s,
        layout: Layout | None = None,
        plan: BatchPlan | None = None,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.timeout_s = timeout_s
        self.deterministic = deterministic
        # The batch plan's one owner (the resume callback restores it before val_dataloader resolves it).
        self.plan = plan or BatchPlan(batch_size)
        self.plan.seq_len = seq_len
        self.limits = limits
        self.spec, self.tokenizer = data, tokenizer
        self.mode, self.seq_len, self.stride = mode, seq_len, stride
        self.corpus: Corpus | None = None
        self.store: Path | None = None  # the token store's directory, once set up
        self.windows: Windows | None = None
        self.first_token: np.ndarray | None = None  # each window's first scored token in corpus order, and the total
        self._windows_digest: str | None = None

    @property
    def batch_size(self) -> int | str:
        """Windows per step: ``"auto"`` until the plan is resolved in :meth:`val_dataloader`."""
        return self.plan.batch_size

    def prepare_data(self) -> None:
        # Lightning runs this on one process per node before setup() (lit_ppl.validate calls it on every rank
        # earlier still); the store's lock makes it one build per cache directory, so with a cache on a shared
        # filesystem one process tokenizes for the whole job.
        prepare(self.spec, self.tokenizer, self.timeout_s)

    def setup(self, stage: str | None = None) -> None:
        if self.corpus is not None:
            return
        self.store = prepare(self.spec, self.tokenizer, self.timeout_s, progress=False)
        corpus = Corpus.open(self.store)
        vocab = self.limits[0] if self.limits is not None else None
        if vocab is not None and corpus.max_token >= vocab:
            raise LitPplError(
                f"token id {corpus.max_token} is out of the model's vocabulary of {vocab}: the tokenizer "
                "does not match the model"
            )
        self.windows = build_windows(
            self.mode,
            corpus.doc_lengths,
            self.seq_len,
            self.stride,
            corpus.doc_words,
            corpus.doc_bytes,
            self.tokenizer.adds_bos,
        )
        self.first_token = token_offsets(self.windows, corpus.doc_lengths)
        self.corpus = corpus

    @property
    def scored_tokens(self) -> int:
        """Tokens the windows score, over every rank: the length of per-token outputs."""
        assert self.first_token is not None, "call setup() first"
        return int(self.first_token[-1])

    def windows_digest(self) -> str:
        """A digest of the exact windows (their bounds and scored ranges) and of every document's token count: equal
        only for the same text, tokenizer and window plan, wherever the files and the store live."""
        import hashlib

        assert self.corpus is not None and self.windows is not None, "call setup() first"
        if self._windows_digest is None:  # read by the agreement check and by resume: hashed once
            h = hashlib.sha256()
            w = self.windows
            for a in (w.start, w.end, w.score_from, self.corpus.doc_lengths):
                h.update(memoryview(np.ascontiguousarray(a)))
            if w.joined:  # llamacpp's coordinates: another plan's even where the numbers coincide
                h.update(f"joined bos={w.bos_first}".encode())  # no joined copy: 24 bytes per window
            self._windows_digest = h.hexdigest()[:16]
        return self._windows_digest

    def describe(self) -> dict[str, Any]:
        """What was evaluated, for ``results.json``: the source, ``data.limit`` and the token store."""
        assert self.corpus is not None, "call setup() first"
        return {
            "source": self.spec.describe(),
            "files": len(self.spec.paths),
            "limit": self.spec.limit,
            "documents": len(self.corpus.doc_lengths),
            "token_store": str(self.store) if self.store else None,
            "token_dtype": self.corpus.tokens.dtype.name,
        }

    def batch_sampler(self, rank: int, world_size: int, skip: int = 0) -> ExactBatchSampler:
        assert self.windows is not None, "call setup() first"
        plan = self.plan
        return ExactBatchSampler(
            self.windows.lengths, rank, world_size, plan.batch_size, skip, plan.rank_weights, self.deterministic
        )

    def val_dataloader(self) -> DataLoader:
        trainer = self.trainer
        if trainer is not None:  # the model is built by now: the plan may probe it
            tp = self.layout.tp if self.layout is not None else 1
            self.plan.resolve(trainer.lightning_module.scorer_probe, trainer.world_size, trainer.num_nodes, tp)
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        if self.layout is not None:  # a tensor-parallel group reads one share of the windows
            rank, world = self.layout.dp_rank(rank), self.layout.dp_size
        return DataLoader(
            WindowIds(len(self.windows)),
            batch_sampler=self.batch_sampler(rank, world, self.plan.skip_batches),
            collate_fn=WindowCollator(self.corpus, self.windows, first_token=self.first_token),
        )
