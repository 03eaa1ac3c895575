"""How the ranks are laid out: data parallel (replicated × sharded) × tensor parallel, as one validated object.

In the spirit of torchtitan's ``ParallelDims``: ``world = dp_replicate × dp_shard × tp``. Tensor parallelism is the
innermost dimension, so a tensor-parallel group is ``tp`` consecutive ranks (on one node unless asked otherwise);
data parallelism is everything outside it. Every rank of a tensor-parallel group runs the same batch, so the data
is sharded over the ``dp_replicate × dp_shard`` data-parallel ranks only.

=========  ================  ==========  ========================================================
preset     ``dp_replicate``  ``dp_shard``  ``tp``
=========  ================  ==========  ========================================================
auto/ddp   -1 (all)          1           1
fsdp       1                 -1 (all)    1
hsdp       num_nodes         -1          1
tp         -1                1           trainer.devices (one node tensor-parallel, nodes replicate)
fsdp_tp    1                 -1          trainer.devices (one node tensor-parallel, nodes shard)
=========  ================  ==========  ========================================================

Context parallelism is not offered: evaluation windows are a few thousand tokens, which a tensor-parallel group
already holds comfortably; it would only pay for contexts of hundreds of thousands of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_ppl.errors import LitPplError

KINDS = ("single", "ddp", "fsdp", "hsdp", "tp", "fsdp_tp", "hsdp_tp")


@dataclass(frozen=True)
class Layout:
    """A resolved rank layout (no ``-1`` left); build it with :func:`resolve`.

    Examples:
        >>> layout = resolve(dp_replicate=1, dp_shard=-1, tp=2, world_size=8, num_nodes=2)
        >>> layout.dp_shard, layout.kind, layout.dp_size, layout.dp_rank(5), layout.tp_rank(5)
        (4, 'fsdp_tp', 4, 2, 1)
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    num_nodes: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each gets its own share of the windows."""
        return self.dp_replicate * self.dp_shard

    @property
    def sharded(self) -> bool:
        """Whether anything splits the weights (FSDP or TP): the model is then built on meta and loaded in shards."""
        return self.dp_shard > 1 or self.tp > 1

    @property
    def kind(self) -> str:
        """The preset this layout is (``single``, ``ddp``, ``fsdp``, ``hsdp``, ``tp``, ``fsdp_tp``, ``hsdp_tp``)."""
        if self.world_size == 1:
            return "single"
        data = "hsdp" if self.dp_replicate > 1 and self.dp_shard > 1 else "fsdp" if self.dp_shard > 1 else "ddp"
        if self.tp == 1:
            return data
        return "tp" if data == "ddp" else f"{data}_tp"

    def dp_rank(self, global_rank: int) -> int:
        return global_rank // self.tp

    def tp_rank(self, global_rank: int) -> int:
        return global_rank % self.tp

    def describe(self) -> dict[str, Any]:
        """For ``results.json``."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "kind": self.kind}

    def check_model(self, sizes: dict[str, int | None]) -> None:
        """``tp`` must divide every number in ``sizes`` (heads, MLP width), except the key/value heads, which it may
        also be a multiple of (each KV head is then replicated: :mod:`lit_ppl.parallel.tensor_parallel`); one line
        naming the number and the tp values that work."""
        if self.tp == 1:
            return
        for what, n in sizes.items():
            if n is not None and not fits(what, n, self.tp):
                valid = [d for d in range(2, max(v for v in sizes.values() if v) + 1) if works(sizes, d)][:6]
                kv = " (nor is a multiple of)" if what == KV_HEADS else ""
                raise LitPplError(
                    f"parallel.tp={self.tp} does not divide{kv} the model's {n} {what}; tp values that fit this model: "
                    f"{', '.join(map(str, valid)) if valid else 'none but 1 (use strategy=fsdp)'}"
                )


KV_HEADS = "key/value heads"


def fits(what: str, n: int, tp: int) -> bool:
    """Whether ``tp`` ranks can split ``n`` of ``what``: divide them, or for KV heads also replicate each."""
    return n % tp == 0 or (what == KV_HEADS and tp % n == 0)


def works(sizes: dict[str, int | None], tp: int) -> bool:
    return all(n is None or fits(what, n, tp) for what, n in sizes.items())


def resolve(
    dp_replicate: int, dp_shard: int, tp: int, world_size: int, num_nodes: int = 1, tp_across_nodes: bool = False
) -> Layout:
    """Fill in the one ``-1`` and check the layout against the world: one line naming the numbers on failure.

    Examples:
        >>> resolve(-1, 1, 1, world_size=4).kind
        'ddp'
        >>> resolve(2, 2, 2, world_size=4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_ppl.errors.LitPplError: parallel dp_replicate=2 × dp_shard=2 × tp=2 = 8 is not the world size 4 ...
    """
    dims = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}
    for name, value in dims.items():
        if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
            raise LitPplError(
                f"parallel.{name}={value!r} must be a positive integer or -1 (the rest of the world size)"
            )
    rest = [name for name, value in dims.items() if value == -1]
    if len(rest) > 1:
        raise LitPplError(f"parallel: only one of dp_replicate, dp_shard, tp may be -1, got {dims}")
    known = 1
    for value in dims.values():
        known *= value if value != -1 else 1
    if rest:
        if world_size % known:
            raise LitPplError(
                f"parallel {' × '.join(f'{k}={v}' for k, v in dims.items() if v != -1)} = {known} does not divide "
                f"the world size {world_size}, so parallel.{rest[0]}=-1 has no integer value"
            )
        dims[rest[0]] = world_size // known
    product = dims["dp_replicate"] * dims["dp_shard"] * dims["tp"]
    if product != world_size:
        raise LitPplError(
            f"parallel {' × '.join(f'{k}={v}' for k, v in dims.items())} = {product} is not the world size "
            f"{world_size} (trainer.devices × trainer.num_nodes); make the product {world_size}, or set one of them "
            "to -1"
        )
    per_node = world_size // num_nodes if world_size % num_nodes == 0 else world_size
    if dims["tp"] > 1 and per_node % dims["tp"] and not tp_across_nodes:
        raise LitPplError(
            f"parallel.tp={dims['tp']} does not fit within a node of {per_node} ranks: a tensor-parallel group "
            "across nodes all-reduces every layer over the slow links; use a tp that divides "
            f"{per_node}, or set parallel.tp_across_nodes=true"
        )
    return Layout(dims["dp_replicate"], dims["dp_shard"], dims["tp"], num_nodes)
