"""The LightningModule: score every batch's tokens, accumulate them in the float64 metric, sync once."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from torch import nn
from torchmetrics import Metric

from lit_ppl.distributed import check_peers, control_group
from lit_ppl.metric import NLLBreakdown, Perplexity
from lit_ppl.models import ModelSpec, key_problem
from lit_ppl.results import peak_memory, rank_memory
from lit_ppl.scorer import TokenScorer, check_scorer

# Weights are loaded directly in the dtype a "*-true" precision computes in (a 70B checkpoint must not
# pass through float32 first); mixed precisions keep float32 weights and autocast.
LOAD_DTYPE = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


def _to_host(value: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return [v.detach().cpu().clone() for v in value]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly FSDP-sharded) tensor, sharing its memory."""
    return t.to_local() if hasattr(t, "to_local") else t


def unloaded_parameters(module: nn.Module) -> list[str]:
    """Names of parameters still NaN on any rank (each rank checks its own shards; one gather)."""
    import torch.distributed as dist

    names = [n for n, p in module.named_parameters() if bool(torch.isnan(_local(p)).any())]
    if dist.is_available() and dist.is_initialized():
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, names)
        names = sorted({n for part in gathered for n in part or []})
    return names


class PerplexityModule(L.LightningModule):
    """Evaluates a causal LM's perplexity in ``trainer.validate``.

    Args:
        model: which LM to load; it is built in ``configure_model`` so sharding strategies can wrap it.
        chunk_size: scored positions per output-head chunk (bounds the logits memory).
        shard: a callable ``shard(scorer, module)`` that wraps the built model for the strategy (FSDP);
            ``None`` leaves it to the strategy (DDP replicates, single device does nothing).
        quantize: a callable ``quantize(lm) -> report`` applied after the model is built and before it is
            sharded; the report's ``quantized_params`` (names in ``lm``) are kept out of DDP/FSDP wrapping,
            whose hooks cannot handle torchao's quantized tensors.
        timeout_s: how long the final synchronisation waits for every rank before naming the missing ones.
        compile_decoder: ``torch.compile`` the decoder (:mod:`lit_ppl.compiling`).
        deterministic: accumulate in exact fixed-point sums (:mod:`lit_ppl.exact`), the same at any world size.
    """

    def __init__(
        self,
        model: ModelSpec,
        chunk_size: int = 1024,
        shard: Any = None,
        quantize: Any = None,
        timeout_s: float = 300.0,
        compile_decoder: bool = False,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        self.deterministic = deterministic
        self.compile_decoder = compile_decoder
        self.spec, self.chunk_size, self.shard, self.quantize = model, chunk_size, shard, quantize
        self.timeout_s = timeout_s
        self.quant_report: Any = None
        self.scorer: TokenScorer | None = None
        self.metric = Perplexity(exact=deterministic)
        self.breakdown: NLLBreakdown | None = None  # sized in setup(), once the corpus is known
        self.per_document: tuple[torch.Tensor, torch.Tensor] | None = None  # (tokens, nll sum) per document
        self.result: dict[str, Any] = {}
        self.scorer_check: dict[str, float] = {}  # the self-check of the scoring path (lit_ppl.scorer)
        self.tokens_seen = 0  # host-side count for tokens/s: from shapes, no device sync
        self.steps = 0

    def configure_model(self) -> None:
        if self.scorer is not None:
            return
        precision = str(self.trainer.precision) if self._trainer is not None else "32-true"
        dtype = LOAD_DTYPE.get(precision, torch.float32)
        if self.shard is not None and self.quantize is None and not self.spec.is_builtin:
            self._build_sharded(dtype)
            return
        lm = self.spec.build(dtype)
        if self.quantize is not None:
            self.quant_report = self.quantize(lm)
            # Lightning's DDP reads this attribute; FSDP2 gets the same set as ignored_params.
            self._ddp_params_and_buffers_to_ignore = [f"scorer.lm.{n}" for n in self.quant_report.quantized_params]
        self.scorer = TokenScorer(lm, self.chunk_size)
        if self.compile_decoder:
            from lit_ppl.compiling import compile_decoder

            compile_decoder(self.scorer)
        if self.shard is not None:
            self.shard(self.scorer, self)

    def _build_sharded(self, dtype: torch.dtype) -> None:
        """FSDP without ever holding the whole model on a rank: meta parameters, shard, then load the shards.

        Rank 0 loads the checkpoint as ``from_pretrained`` does and checks that its tensors are exactly the
        model's; ``set_model_state_dict`` then sends every rank its shard. Parameters start as NaN, so one that
        no tensor reached could not give a number, and :func:`unloaded_parameters` proves none is left.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        lm = self.spec.build_empty(dtype)
        expected = set(lm.state_dict())
        self.scorer = TokenScorer(lm, self.chunk_size)
        self.shard(self.scorer, self)
        buffers = dict(self.scorer.named_buffers())  # real values; to_empty would leave them uninitialised
        self.scorer.to_empty(device=self.device)
        with torch.no_grad():
            for name, buffer in self.scorer.named_buffers():
                buffer.copy_(buffers[name])
            for param in self.scorer.parameters():
                _local(param).fill_(float("nan"))
        full: dict[str, torch.Tensor] = {}
        problem = None
        if self.global_rank == 0:
            try:
                full = self.spec.full_state_dict(dtype)
                problem = key_problem(self.spec.path, expected - set(full), set(full) - expected)
            except ValueError as err:  # told to every rank below, so that none waits for a broadcast
                problem = str(err)
        problem = self.trainer.strategy.broadcast(problem)
        if problem:
            raise ValueError(problem)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
        set_model_state_dict(lm, full, options=options)
        del full
        missing = unloaded_parameters(self.scorer)
        if missing:
            raise ValueError(
                f"model.path={self.spec.path!r}: {len(missing)} parameters hold NaN after sharded loading "
                f"({', '.join(missing[:5])}): the checkpoint holds NaN there, or no tensor reached them (a bug in "
                "lit-ppl: please report it)"
            )

    def setup(self, stage: str) -> None:
        dm = self.trainer.datamodule
        if self.breakdown is None and dm is not None and getattr(dm, "corpus", None) is not None:
            self.breakdown = NLLBreakdown(len(dm.corpus.doc_lengths), dm.seq_len, exact=self.deterministic)

    def metrics(self) -> dict[str, Metric]:
        """Every torchmetrics state of the module: what syncs across ranks and what a resume restores."""
        return {name: m for name, m in self.named_modules() if isinstance(m, Metric)}

    def on_validation_start(self) -> None:
        # Precision plugins cast the whole module, metric states included; restore float64.
        for metric in self.metrics().values():
            metric.set_dtype(torch.float64)
        self._control = control_group()
        self.scorer_check = check_scorer(self.scorer, self.device)
        self._first_bad_step = torch.tensor(-1, device=self.device)
        self._t0 = time.perf_counter()

    def score(self, batch: dict[str, Any]) -> torch.Tensor:
        """Per-token NLL of the batch's scored tokens; subclasses may gather more statistics on the way."""
        return self.scorer(batch["input_ids"], batch["score_index"], batch["targets"])

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        nll = self.score(batch)
        self.metric.update(nll, batch["words"], batch["bytes"], batch["documents"])
        if self.breakdown is not None:
            self.breakdown.update(nll, batch["doc_ids"], batch["score_index"] % batch["input_ids"].shape[1])
        # Remember the first step with a non-finite loss without a host sync in the loop.
        bad = ~torch.isfinite(nll).all()
        self._first_bad_step = torch.where(bad & (self._first_bad_step < 0), batch_idx, self._first_bad_step)
        self.tokens_seen += batch["targets"].numel()
        self.steps += 1

    def progress_state(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit-identically (host copies; called between steps)."""
        return {
            "metrics": {
                name: {k: _to_host(v) for k, v in metric.metric_state.items()}
                for name, metric in self.metrics().items()
            },
            "tokens_seen": self.tokens_seen,
            "steps": self.steps,
            "first_bad_step": int(self._first_bad_step),
        }

    def load_progress_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`progress_state` (after the precision plugin and ``set_dtype`` have run)."""
        metrics = self.metrics()
        for name, states in state["metrics"].items():
            for key, value in states.items():
                current = getattr(metrics[name], key)  # every state is a fixed-size tensor
                setattr(metrics[name], key, value.to(device=current.device, dtype=current.dtype))
        self.tokens_seen, self.steps = state["tokens_seen"], state["steps"]
        self._first_bad_step = torch.tensor(state["first_bad_step"], device=self.device)

    def on_validation_epoch_end(self) -> None:
        seconds = time.perf_counter() - self._t0
        t_sync = time.perf_counter()
        check_peers(self._control, self.timeout_s, "the final metric sync")
        stats = self.metric.compute()  # the one cross-rank synchronisation of the metric
        sync_s = time.perf_counter() - t_sync
        mine = [self.tokens_seen, self.steps, int(self._first_bad_step), *peak_memory(self.device)]
        per_rank = self.all_gather(torch.tensor(mine, device=self.device)).reshape(-1, 5)
        if int(stats["nonfinite"]) > 0:
            first = {r: int(s) for r, s in enumerate(per_rank[:, 2].tolist()) if s >= 0}
            precision = str(self.trainer.precision)
            hint = (
                "the model itself produces them: check its weights"
                if precision in ("32-true", "64-true", "32", "64")
                else f"the model overflows in precision={precision}: try 32-true or bf16-mixed"
            )
            raise FloatingPointError(
                f"{int(stats['nonfinite'])} tokens had a NaN/inf loss (first at batch {first} by rank); {hint}"
            )
        self.result = {
            **{k: v.item() for k, v in stats.items() if k != "nonfinite"},
            "seconds": seconds,
            "sync_seconds": sync_s,
            "rank_tokens": per_rank[:, 0].tolist(),
            "rank_steps": per_rank[:, 1].tolist(),
            **rank_memory(per_rank[:, 3].tolist(), per_rank[:, 4].tolist()),
            "scorer_check": self.scorer_check,
        }
        for k in ("tokens", "words", "bytes", "documents"):
            self.result[k] = round(self.result[k])
        if self.breakdown is not None:
            parts = {k: v.cpu() for k, v in self.breakdown.compute().items()}  # synced like the metric
            self.result["nll_by_position"] = {
                "sum": parts["pos_sum"].tolist(),
                "sum_sq": parts["pos_sum_sq"].tolist(),
                "count": parts["pos_count"].tolist(),
            }
            self.per_document = (parts["doc_tokens"], parts["doc_nll_sum"])
        self.log_dict({"ppl": stats["ppl"].float(), "nll_mean": stats["nll_mean"].float()}, sync_dist=False)
