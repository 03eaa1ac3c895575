"""Sums that do not depend on their order: deterministic mode's accumulation.

A float sum depends on the order of its terms: per rank, then across ranks, so a different world size gives a
different last bit. Here every value is rounded once to a multiple of ``2^-40`` and summed as an integer held in
two int64 limbs (``hi · 2^32 + lo``), so any order, any rank and any all-reduce give the same sum, exactly.

* resolution: ``2^-40`` ≈ 9.1e-13 per value (a float32 NLL near 3 nats is itself resolved to 2.4e-7);
* range: a value's magnitude must stay below ``2^22`` (4,194,304; an NLL below 2,048 nats, since its square is
  summed too); a rank's high limb below ``2^52``, i.e. at most ``2^44`` ≈ 1.8e13 in absolute sum per rank (about
  6e12 tokens at 3 nats each), so that a sum over up to 1,024 ranks stays below ``2^62``;
* past either bound the metric counts an overflow and its ``compute()`` raises — never a wrapped-around number.

Without ``exact`` the same states are plain float64 sums (the default when not in deterministic mode).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_max, dim_zero_min, dim_zero_sum
from torchmetrics.utilities.distributed import gather_all_tensors

FRACTION_BITS = 40
LIMB_BITS = 32
VALUE_LIMIT = 2.0**22
HI_LIMIT = 2**52
_LOW_MASK = 2**LIMB_BITS - 1
_ALL_REDUCE = {dim_zero_sum: dist.ReduceOp.SUM, dim_zero_min: dist.ReduceOp.MIN, dim_zero_max: dist.ReduceOp.MAX}


class FixedPointOverflow(FloatingPointError):
    """A value or a sum left the range of deterministic mode's exact sums."""


def limbs(values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(hi, lo, out_of_range)`` of ``values`` rounded to multiples of ``2^-40`` (elementwise; NaN is out of range).

    Examples:
        >>> hi, lo, bad = limbs(torch.tensor([1.5, -0.25]))
        >>> (hi * 2**32 + lo).tolist() == [int(1.5 * 2**40), int(-0.25 * 2**40)], bad.tolist()
        (True, [False, False])
    """
    x = values.detach().to(torch.float64)
    bad = ~(x.abs() < VALUE_LIMIT)
    q = torch.round(torch.where(bad, torch.zeros_like(x), x) * 2.0**FRACTION_BITS).to(torch.int64)
    return q >> LIMB_BITS, q & _LOW_MASK, bad


def value(hi: Tensor, lo: Tensor) -> Tensor:
    """The float64 value of limbs ``hi``/``lo`` (any size of ``lo``: it is carried first), rounded once."""
    hi, lo = hi + (lo >> LIMB_BITS), lo & _LOW_MASK
    return (hi.to(torch.float64) * 2.0**LIMB_BITS + lo.to(torch.float64)) * 2.0**-FRACTION_BITS


class SumStates(Metric):
    """A ``Metric`` whose sums are float64 states, or exact ones (``exact=True``), behind one interface.

    ``add_sum_state(name)`` declares a sum (a scalar, or a vector of ``size``), ``add_to(name, values, index)``
    adds values (all of them, or ``index_add_`` by ``index``), ``sum_of(name)`` reads it as float64 and
    ``check_range()`` raises :class:`FixedPointOverflow` when an exact sum overflowed. ``add_count_state`` declares
    an int64 count that stays int64 in either mode.

    States reduced by sum, min or max sync with one ``all_reduce`` each: a rank holds one copy of a state during
    the sync, whatever the world size (torchmetrics' default all-gathers ``world_size`` copies, then reduces).
    """

    def __init__(self, exact: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.exact = exact
        self._integer_states: list[str] = []
        if exact:
            self.add_state("overflow", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
            self._integer_states.append("overflow")

    def add_sum_state(self, name: str, size: int | None = None) -> None:
        shape = () if size is None else (size,)
        if not self.exact:
            self.add_state(name, default=torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
            return
        for limb in (f"{name}_hi", f"{name}_lo"):
            self.add_state(limb, default=torch.zeros(shape, dtype=torch.int64), dist_reduce_fx="sum")
            self._integer_states.append(limb)

    def add_count_state(self, name: str, size: int | None = None) -> None:
        """An int64 sum of counts; kept out of ``set_dtype(torch.float64)``, which would make it a float."""
        shape = () if size is None else (size,)
        self.add_state(name, default=torch.zeros(shape, dtype=torch.int64), dist_reduce_fx="sum")
        self._integer_states.append(name)

    def add_to(self, name: str, values: Tensor, index: Tensor | None = None) -> None:
        if not self.exact:
            state, values = getattr(self, name), values.detach().to(torch.float64)
            if index is None:
                state += values.sum()
            else:
                state.index_add_(0, index, values)
            return
        hi, lo, bad = limbs(values)
        state_hi, state_lo = getattr(self, f"{name}_hi"), getattr(self, f"{name}_lo")
        if index is None:
            state_hi += hi.sum()
            state_lo += lo.sum()
        else:
            state_hi.index_add_(0, index, hi)
            state_lo.index_add_(0, index, lo)
        state_hi += state_lo >> LIMB_BITS  # carry, so that lo never grows past 2^32 between batches
        state_lo &= _LOW_MASK
        self.overflow += bad.sum() + (state_hi.abs() >= HI_LIMIT).sum()

    def sum_of(self, name: str) -> Tensor:
        if not self.exact:
            return getattr(self, name).to(torch.float64)
        return value(getattr(self, f"{name}_hi"), getattr(self, f"{name}_lo"))

    def check_range(self) -> None:
        if self.exact and int(self.overflow) > 0:
            raise FixedPointOverflow(
                f"{int(self.overflow)} values or sums left the range of eval.deterministic=true's exact sums "
                f"(|value| < {VALUE_LIMIT:.0f}, i.e. a per-token NLL below 2048 nats; |sum| < 2^44 per rank); "
                "the model gives absurd losses, or use eval.deterministic=false"
            )

    def _sync_dist(self, dist_sync_fn: Callable = gather_all_tensors, process_group: object = None) -> None:
        if dist_sync_fn is not gather_all_tensors or any(fn not in _ALL_REDUCE for fn in self._reductions.values()):
            super()._sync_dist(dist_sync_fn, process_group=process_group)  # a custom sync, or a "cat" state
            return
        group = process_group or self.process_group
        for name, reduce_fn in self._reductions.items():
            # A copy: sync() keeps the local states to restore them in unsync().
            state = getattr(self, name).clone()
            dist.all_reduce(state, op=_ALL_REDUCE[reduce_fn], group=group)
            setattr(self, name, state)

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = ()) -> Metric:
        # The integer states follow device moves but never a dtype cast (set_dtype(float64) casts every state):
        # exactness is the point of them.
        integer = tuple(getattr(self, "_integer_states", ()))
        this = super()._apply(fn, exclude_state=(*exclude_state, *integer))
        for key in integer:
            setattr(this, key, getattr(this, key).to(this.device))
            this._defaults[key] = this._defaults[key].to(this.device)
        return this
