"""The per-token files of one run, driven by the module's hooks: ``report.per_token`` and ``save_reference``.

``report.per_token=true`` writes ``per_token.npy`` (float64: the NLL of every scored token as the run summed it, so
its float64 sum is ``nll_sum`` up to the order of the additions) and ``per_token_index.npy`` (``(tokens, 2)`` int64:
document id, position) in ``output_dir``, with ``per_token.json`` (what lit-ppl wrote there, and whether it is
complete). ``save_reference=DIR``: :mod:`lit_ppl.evaluation.reference`.

The first process makes the files before any row is written: whole and fresh for a fresh run (replacing only files
lit-ppl wrote), the same files for a resumed one (refused in one line if they are gone); every rank then opens
them. At the end it checks every row written (:mod:`lit_ppl.evaluation.token_arrays`) before it marks them complete;
the verdict is every rank's. A run saving a reference also measures its noise floor
(:mod:`lit_ppl.evaluation.noise_floor`) and stores it in the manifest, for the comparisons that read the store.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_ppl.config.quant import CompareConfig
from lit_ppl.errors import LitPplError
from lit_ppl.evaluation.noise_floor import Reference, measure, not_measured, reference_context
from lit_ppl.evaluation.reference import ReferenceWriter, store_keys
from lit_ppl.evaluation.token_arrays import TokenArrays, corpus_rows
from lit_ppl.model.scorer import TokenScorer
from lit_ppl.runtime.files import atomic_path, write_json_atomic

PER_TOKEN, RECORD, INDEX = "per_token", "per_token.json", "per_token_index.npy"


def write_per_token_index(directory: Path, chunks: Iterable[tuple[slice, np.ndarray, np.ndarray, np.ndarray]]) -> Path:
    """``per_token_index.npy``: ``(tokens, 2)`` int64 document id and position of every row of ``per_token.npy``
    (``chunks``: :func:`lit_ppl.evaluation.token_arrays.corpus_rows`)."""
    path = directory / INDEX
    rows = np.concatenate([np.stack([doc, position], axis=1) for _, doc, position, _ in chunks])
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, rows)
    return path


def per_document(parts: dict[str, torch.Tensor], nll_sum: float, datamodule: Any) -> tuple[torch.Tensor, ...]:
    """The per-document table's ``(tokens, nll sum)`` of the breakdown's ``parts``, checked: it must count every
    scored token of each document (from the windows alone) and add up to ``nll_sum``. Its sums are synced like the
    metric's, so a difference is a bug, said with its traceback."""
    tokens, nll_sums = parts["doc_tokens"], parts["doc_nll_sum"]
    dm = datamodule
    if dm.windows.joined:  # llamacpp scores part of each chunk: count the rows
        docs = [
            doc for _, doc, _, _ in corpus_rows(dm.windows, dm.corpus.doc_lengths, dm.corpus.tokens, dm.first_token)
        ]
        expected = np.bincount(np.concatenate(docs), minlength=len(dm.corpus.doc_lengths))
    else:  # every other mode scores each document's every token once
        expected = np.asarray(dm.corpus.doc_lengths)
    counted = tokens.double().numpy()
    total = float(nll_sums.double().sum())
    if not (counted == expected).all() or not abs(total - nll_sum) <= 1e-9 * abs(nll_sum):
        wrong = np.flatnonzero(counted != expected)
        raise RuntimeError(
            f"the per-document table counts {len(wrong)} documents' tokens wrongly (first: document "
            f"{int(wrong[0]) if len(wrong) else None}) or sums to {total!r} against nll_sum {nll_sum!r}: a bug in "
            "lit-ppl"
        )
    return tokens, nll_sums


class TokenOutputs:
    """``per_token.npy`` in ``output_dir`` (if given) and the saved reference in ``reference_dir`` (if given);
    ``saving``: :func:`lit_ppl.evaluation.reference.saving_run`'s writer keys and description; ``noise_floor``: the
    windows of the saved reference's noise floor (``compare.noise_floor``; 0: none stored)."""

    def __init__(
        self,
        output_dir: Path | None,
        reference_dir: Path | None,
        saving: tuple[dict[str, Any], dict[str, Any]] | None = None,
        noise_floor: int = CompareConfig.noise_floor,
    ) -> None:
        self.output_dir, self.reference_dir, self.saving = output_dir, reference_dir, saving
        self.noise_windows = noise_floor
        self.per_token: TokenArrays | None = None
        self.reference: ReferenceWriter | None = None
        self.datamodule: Any = None

    @property
    def wants_hidden(self) -> bool:
        return self.reference_dir is not None

    def setup(self, datamodule: Any) -> None:
        """Every rank, before the model loads: a store that is not this run's is refused now."""
        self.datamodule = datamodule
        first = datamodule.first_token
        if self.output_dir is not None:
            self.per_token = TokenArrays(self.output_dir, {PER_TOKEN: ((int(first[-1]),), np.float64, np.nan)})
        if self.reference_dir is not None:
            writer, described = self.saving or ({}, {})
            self.reference = ReferenceWriter(self.reference_dir, store_keys(datamodule), first, writer, described)
            self.reference.check()

    def start(self, scorer: TokenScorer, resumed: bool, first: bool, strategy: Any) -> None:
        """Every rank before the first step, after any progress is restored: the saved reference's head gathered and
        written, then the first process makes the files (fresh) or checks them (``resumed``), and every rank opens
        them. A problem is every rank's one line."""
        if self.reference is not None:
            self.reference.open(scorer)
        problem = None
        if first:
            try:
                problem = self._prepare(resumed)
            except LitPplError as err:
                problem = str(err)
            except OSError as err:  # a full or read-only disk under the small files
                problem = f"cannot write {err.filename}: {err.strerror or err}"
        problem = strategy.broadcast(problem)
        if problem:
            raise LitPplError(problem)
        for arrays in self._arrays():
            arrays.open()

    def _prepare(self, resumed: bool) -> str | None:
        problems = []
        if self.per_token is not None:
            path = self.per_token.path(PER_TOKEN)
            if resumed:
                problems += [f"report.per_token: {p}" for p in self.per_token.problems()]
            elif path.exists() and not (self.output_dir / RECORD).is_file():
                return (
                    f"{path} was not written by lit-ppl (there is no {RECORD} beside it): move it away or give another "
                    "output_dir"
                )
            else:
                rows = int(self.datamodule.first_token[-1])
                write_json_atomic(self.output_dir / RECORD, {"file": path.name, "rows": rows, "complete": False})
                self.per_token.create()
        if self.reference is not None:
            problems += [p for p in [self.reference.prepare(resumed)] if p]
        if problems:
            return (
                f"{'; '.join(problems)} — but this run resumes from progress saved after rows were written there; "
                "delete the progress directory (output_dir/progress) to score every row again"
            )
        return None

    def _arrays(self) -> list[TokenArrays]:
        return [a for a in (self.per_token, self.reference and self.reference.arrays) if a is not None]

    def write(self, batch: dict[str, Any], nll: torch.Tensor, hidden: torch.Tensor | None) -> None:
        if self.per_token is not None:
            self.per_token.write(batch["token_index"], per_token=nll.double())
        if self.reference is not None:
            assert hidden is not None
            self.reference.write(batch, hidden, nll)

    def flush(self) -> None:
        for arrays in self._arrays():
            arrays.flush()

    def finish(self, result: dict[str, Any], first: bool, strategy: Any) -> dict[str, Any]:
        """Every rank at the end: its rows flushed; then the first process checks every row and marks the files
        complete, and its verdict is every rank's (one line). Returns what results.json records (the first's)."""
        noise = self.noise_floor(strategy.lightning_module) if self.reference is not None else None  # collective
        self.flush()
        strategy.barrier()  # every rank's rows are in the files
        facts = {"ppl": result["ppl"], "noise_floor": noise}
        problem, files = self._finish(result["nll_sum"], facts) if first else (None, {})
        problem = strategy.broadcast(problem)
        if problem:
            raise LitPplError(problem)
        return files

    def _finish(self, nll_sum: float, facts: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
        dm = self.datamodule

        def chunks() -> Any:  # read twice, not held: its arrays are 24 bytes per token
            return corpus_rows(dm.windows, dm.corpus.doc_lengths, dm.corpus.tokens, dm.first_token)

        out: dict[str, Any] = {}
        if self.per_token is not None:
            values = self.per_token.read(PER_TOKEN)
            unwritten = int(np.isnan(values).sum())
            total = float(values.sum())
            if unwritten:
                return self._unwritten(f"{unwritten:,} of {len(values):,} rows of per_token.npy were never written"), {}
            if not abs(total - nll_sum) <= 1e-9 * nll_sum:  # the same values, added in another order
                return self._unwritten(f"per_token.npy sums to {total!r}, the run's nll_sum is {nll_sum!r}"), {}
        if self.reference is not None:
            problem = self.reference.unwritten(((rows, targets) for rows, _, _, targets in chunks()), nll_sum)
            if problem:
                return self._unwritten(f"{self.reference.name}: {problem}"), {}
        if self.per_token is not None and self.output_dir is not None:
            self.per_token.flush()
            index = write_per_token_index(self.output_dir, chunks())
            path = self.per_token.path(PER_TOKEN)
            write_json_atomic(
                self.output_dir / RECORD,
                {"file": path.name, "rows": len(values), "index": index.name, "nll_sum": nll_sum, "complete": True},
            )
            out["per_token"] = {"path": str(path), "index": str(index)}
        if self.reference is not None:
            saved = self.reference.finish({**facts, "nll_sum": nll_sum})
            out["saved_reference"] = {**saved, "noise_floor": facts["noise_floor"]}
        return None, out

    def noise_floor(self, module: Any) -> dict[str, Any] | None:
        """The saving run's model's noise floor (it is the reference the store keeps), every rank."""
        if self.noise_windows <= 0:
            return None
        if module.quantize is not None or module.spec.stored_quantization() is not None:
            return not_measured("the reference is quantized: a float64 re-score would measure its quantization")
        context = reference_context(module, contextlib.nullcontext)
        reference = Reference(module.spec, module.scorer, context, module.precision.name)
        return measure(module, reference, self.noise_windows)

    def _unwritten(self, problem: str) -> str:
        return (
            f"{problem}: not marked complete. Every rank writes its rows into these files, so they must be in one "
            "directory every node shares, and must not be deleted while a run resumes into them"
        )
