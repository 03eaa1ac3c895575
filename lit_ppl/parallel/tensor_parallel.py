"""Tensor parallelism from a model's own plan, with plain local shards.

Hugging Face models declare how their decoder splits (``config.base_model_tp_plan``: q/k/v and gate/up
``colwise``, o/down ``rowwise``). Each rank of a tensor-parallel group keeps its slice of every planned layer as an
ordinary ``nn.Linear`` (a column-parallel layer holds a block of output rows; a row-parallel layer a block of input
columns and sums its partial outputs over the group), the embedding and the output head are split along the
vocabulary, and the attention works on the rank's own heads (the models reshape with ``-1`` heads).

Why not ``torch.distributed.tensor.parallel.parallelize_module``: its DTensor weights cannot hold torchao's quantized
tensors (measured with torchao 0.18: ``aten.view`` is not implemented for ``Int8Tensor`` nor
``IntxUnpackedToInt8Tensor`` under DTensor), and quantized models are the ones that most need splitting. Plain local
shards quantize like any linear layer, and a slice of a row keeps its groups of input features whole, so int4's
group-wise scales of a shard equal those of the whole weight wherever the group size divides the shard.

The output head's logits stay split: :func:`lit_ppl.model.nll.chunked_nll` takes the log-sum-exp across the group, so
no rank ever holds a full row of logits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lit_ppl.errors import LitPplError
from lit_ppl.parallel.layout import KV_HEADS

STYLES = ("colwise", "rowwise")
KV_PROJECTIONS = ("k_proj", "v_proj")  # column-parallel layers whose output is the key/value heads
VOCAB_PARALLEL = "_lit_ppl_vocab_parallel"  # an embedding's attribute (outside nn.Module's registries): its hooks


@dataclass(frozen=True)
class Group:
    """This rank's place in its tensor-parallel group."""

    group: dist.ProcessGroup
    rank: int
    size: int


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``torch.tensor_split(range(n), parts)``: the first ``n % parts`` parts are one larger."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def split(t: torch.Tensor, dim: int, tp: Group) -> torch.Tensor:
    """This rank's slice of ``t`` along ``dim`` (a view)."""
    return t.tensor_split(tp.size, dim)[tp.rank]


class RowParallelLinear(nn.Linear):
    """A block of input columns: partial outputs summed over the group, the bias added once after the sum."""

    tp: Group
    calls_f_linear = True  # its weight may be a torchao tensor: F.linear is what runs it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.tp.group)
        return out if self.bias is None else out + self.bias


class VocabParallel:
    """Hooks that make an embedding hold a block ``[start, start + rows)`` of the vocabulary: ids outside it look up
    row 0 and are zeroed after the embedding's own forward, and the group sums the outputs.

    Hooks rather than a forward of our own: the embedding's class keeps its behaviour (Gemma's scales its output
    by ``sqrt(hidden)``, which a replaced forward would silently drop: measured 1.5e-2 off in PPL).
    """

    def __init__(self, embed: nn.Embedding, start: int, tp: Group) -> None:
        self.start, self.rows, self.tp = start, embed.weight.shape[0], tp
        self.outside: torch.Tensor | None = None
        self.paused = False  # the embedding holds the whole table for a while (see ``of``): a plain lookup
        embed.register_forward_pre_hook(self.localize)
        embed.register_forward_hook(self.reduce)
        embed.__dict__[VOCAB_PARALLEL] = self

    @staticmethod
    def of(embed: nn.Module) -> VocabParallel | None:
        """The hooks holding ``embed``'s block of the vocabulary, if any (to pause them while it holds the whole
        table)."""
        return embed.__dict__.get(VOCAB_PARALLEL)

    def localize(self, module: nn.Module, args: tuple) -> tuple | None:
        if self.paused:
            return None
        ids, *rest = args
        local = ids - self.start
        self.outside = (local < 0) | (local >= self.rows)
        return (local.masked_fill(self.outside, 0), *rest)

    def reduce(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if self.paused:
            return None
        out = out.masked_fill(self.outside[..., None], 0)
        self.outside = None
        dist.all_reduce(out, group=self.tp.group)
        return out


def check_plan(cfg: object) -> dict[str, str]:
    """The config's ``base_model_tp_plan``, if lit-ppl can follow it; one line naming the model type if not."""
    # The input embedding is split along the vocabulary whatever the plan says: its own entry adds nothing.
    tp_plan = {k: v for k, v in (getattr(cfg, "base_model_tp_plan", None) or {}).items() if v != "embedding_rowwise"}
    if not tp_plan:
        raise LitPplError(
            f"model_type {cfg.model_type!r} declares no tensor-parallel plan (config.base_model_tp_plan), so lit-ppl "
            "cannot split its layers; use parallel.tp=1 (e.g. strategy=fsdp)"
        )
    # Layers a plan keeps whole on every rank (Gemma 3's per-head q/k norms): nothing to split.
    tp_plan = {k: v for k, v in tp_plan.items() if not v.startswith("replicated")}
    bad = sorted({s for s in tp_plan.values() if s not in STYLES})
    if bad:
        raise LitPplError(
            f"model_type {cfg.model_type!r}'s tensor-parallel plan uses {', '.join(bad)}; lit-ppl splits only "
            f"{' and '.join(STYLES)} linear layers; use parallel.tp=1 (e.g. strategy=fsdp)"
        )
    return dict(tp_plan)


def plan(lm: nn.Module) -> dict[str, str]:
    """``{module name: style}`` for every layer the model's ``base_model_tp_plan`` splits."""
    cfg = lm.config
    tp_plan = check_plan(cfg)
    prefix = f"{lm.base_model_prefix}."
    patterns = [(re.compile(re.escape(k).replace(r"\*", r"\d+")), v) for k, v in tp_plan.items()]
    out = {}
    for name, module in lm.named_modules():
        inner = name.removeprefix(prefix)
        style = next((s for p, s in patterns if p.fullmatch(inner)), None)
        if style is not None:
            if type(module) is not nn.Linear:
                raise LitPplError(
                    f"{name} ({type(module).__name__}) is planned {style} but is not a linear layer; "
                    "lit-ppl splits linear layers only; use parallel.tp=1"
                )
            out[name] = style
    if not out:
        raise LitPplError(f"model_type {cfg.model_type!r}: no layer matches its tensor-parallel plan {tp_plan}")
    return out


def widths(config: object) -> dict[str, int | None]:
    """The numbers ``tp`` must divide: heads, key/value heads and the MLP width, from the config alone."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(cfg, "num_attention_heads", None)
    return {
        "attention heads": heads,
        KV_HEADS: getattr(cfg, "num_key_value_heads", None) or heads,
        "MLP width (intermediate_size)": getattr(cfg, "intermediate_size", None),
    }


def _shard_param(module: nn.Module, name: str, dim: int, tp: Group, parts: int = 0, index: int = 0) -> None:
    """Keep this rank's slice of ``module.name`` along ``dim``: part ``tp.rank`` of ``tp.size``, or (a replicated
    KV head) part ``index`` of ``parts``."""
    param = getattr(module, name)
    if param is not None:
        piece = param.data.tensor_split(parts, dim)[index] if parts else split(param.data, dim, tp)
        setattr(module, name, nn.Parameter(piece.clone(), requires_grad=False))


def _text_config(lm: nn.Module) -> object:
    return lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config


def _kv_replication(lm: nn.Module, tp: Group) -> tuple[int, int] | None:
    """``(KV heads, this rank's KV head)`` when ``tp`` exceeds the model's key/value heads (each then serves
    ``tp / kv`` consecutive ranks, whose query heads all read it), else ``None``."""
    cfg = _text_config(lm)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if kv is None or tp.size <= kv:
        return None
    return kv, tp.rank // (tp.size // kv)


def parallelize(lm: nn.Module, tp: Group) -> dict[str, int | tuple[int, int, int]]:
    """Split ``lm`` in place (meta or real parameters); return ``{parameter name: split dim}`` for loading, or
    ``(dim, parts, index)`` for a replicated KV head's projection.

    Planned linear layers split as planned; the input embedding and the output head split along the vocabulary
    (their weights' dim 0). A tied head and embedding stay one parameter.
    """
    styles = plan(lm)
    modules = dict(lm.named_modules())
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    splits: dict[str, int | tuple[int, int, int]] = {}
    replicated = _kv_replication(lm, tp)
    for name, style in styles.items():
        module = modules[name]
        parent, _, leaf = name.rpartition(".")
        if style == "colwise" and replicated is not None and leaf in KV_PROJECTIONS:
            kv, index = replicated  # this rank's KV head, whole: part index of kv
            _shard_param(module, "weight", 0, tp, kv, index)
            _shard_param(module, "bias", 0, tp, kv, index)
            module.out_features = module.weight.shape[0]
            splits.update({f"{name}.weight": (0, kv, index), f"{name}.bias": (0, kv, index)})
            attention = modules[parent]
            if hasattr(attention, "num_key_value_groups"):  # the rank's query heads per KV head it holds
                attention.num_key_value_groups = _text_config(lm).num_attention_heads // tp.size
        elif style == "colwise":
            _shard_param(module, "weight", 0, tp)
            _shard_param(module, "bias", 0, tp)
            module.out_features = module.weight.shape[0]
            splits.update({f"{name}.weight": 0, f"{name}.bias": 0})
        else:
            _shard_param(module, "weight", 1, tp)
            module.__class__ = RowParallelLinear
            module.tp, module.full_in_features = tp, module.in_features
            module.in_features = module.weight.shape[1]
            splits[f"{name}.weight"] = 1
    names = {id(m): n for n, m in modules.items()}
    vocab = embed.weight.shape[0]
    _shard_param(embed, "weight", 0, tp)
    start = sum(split_sizes(vocab, tp.size)[: tp.rank])
    embed.num_embeddings = embed.weight.shape[0]
    VocabParallel(embed, start, tp)
    splits[f"{names[id(embed)]}.weight"] = 0
    if head is not None:
        if head.weight.shape[0] != vocab:  # the loss assumes one split of one vocabulary for both
            raise LitPplError(
                f"model_type {lm.config.model_type!r}: its output head has {head.weight.shape[0]} rows but its "
                f"embedding {vocab}; lit-ppl's tensor parallelism splits both alike: use parallel.tp=1"
            )
        if tied:
            head.weight = embed.weight
        else:
            _shard_param(head, "weight", 0, tp)
        head.out_features = head.weight.shape[0]
        head.vocab_start = start  # the same split of the same vocabulary
        splits[f"{names[id(head)]}.weight"] = 0
        if getattr(head, "bias", None) is not None:
            _shard_param(head, "bias", 0, tp)
            splits[f"{names[id(head)]}.bias"] = 0
    return {k: v for k, v in splits.items() if k in dict(lm.named_parameters(remove_duplicate=False))}


def all_gather_uneven(t: torch.Tensor, dim: int, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim``, rank ``i``'s holding ``sizes[i]`` there (gloo's all_gather
    wants equal shapes: each part is padded to the largest and trimmed after)."""
    longest = max(sizes)
    pad = list(t.shape)
    pad[dim] = longest - t.shape[dim]
    padded = torch.cat([t, t.new_zeros(pad)], dim=dim) if pad[dim] else t.contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=dim)


def gather_vocab(t: torch.Tensor, tp: Group, dim: int = -1) -> torch.Tensor:
    """The whole vocabulary from every rank's slice along ``dim`` (logits: the last; a head's weight: rows), for the
    scorer's self-check and a saved head: once per run, not per step."""
    dim = dim % t.dim()
    sizes = [torch.zeros((), dtype=torch.long, device=t.device) for _ in range(tp.size)]
    dist.all_gather(sizes, torch.tensor(t.shape[dim], device=t.device), group=tp.group)
    return all_gather_uneven(t.contiguous(), dim, [int(s) for s in sizes], tp.group)


def vocab_parallel_cross_entropy_(logits: torch.Tensor, targets: torch.Tensor, start: int, tp: Group) -> torch.Tensor:
    """Per-row NLL of ``targets`` from this rank's vocabulary slice ``[start, start + logits.shape[1])``, in place.

    The same formula as :func:`lit_ppl.model.nll.cross_entropy_` with the max, the sum of exponentials and the target's
    logit reduced over the group: two all-reduces per chunk, never a full row of logits.
    """
    local = targets - start
    mine = (local >= 0) & (local < logits.shape[1])
    picked = logits.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None]).squeeze(1)
    maxes = logits.amax(dim=1)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=tp.group)
    logits.sub_(maxes[:, None]).exp_()
    sums = torch.stack([logits.sum(dim=1), torch.where(mine, picked - maxes, torch.zeros_like(picked))])
    dist.all_reduce(sums, group=tp.group)
    return sums[0].log_().sub_(sums[1])
