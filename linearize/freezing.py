"""``freeze``: snap nearly linear units to exactly linear and stop their training.

A unit channel with slope ``a >= 1 - tol`` is snapped to ``a = 1`` (exactly the identity) and
frozen there with :meth:`LinearizableActivation.freeze_`: its gradient is zeroed before every
optimizer step and its value restored after it, while the other channels keep training. With
``snap_zero`` the channels with ``a <= tol`` are snapped and frozen at ``0`` (the original
activation). With ``data``, ReLU/PReLU channels whose pre-activation is ``> 0`` for every sample
and position of the data are linear there (seed 004: stably active), so they are frozen at 1 too:
the model's outputs on that data do not change (a unit with affine linear ends gets, in those
channels, the end ``(1 - a) x + a (alpha x + beta)`` it computed there). A channel at 1 computes its
linear end: ``x``, or ``alpha * x + beta`` (:meth:`~linearize.unit.LinearizableActivation.set_linear_end`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .checks import check_tol
from .distributed import full_value, global_min
from .inputs import Batches, record_preactivations
from .unit import exact_threshold, linear_masks, require_units

__all__ = ["freeze", "FreezeSummary"]


@dataclass
class FreezeSummary:
    """What :func:`freeze` did.

    ``sites`` maps each unit's name to ``{"kind", "total", "linear_before", "linear_after",
    "snapped_one", "snapped_zero", "stably_active"}``; a channel counts as linear when its slope is
    exactly 1. ``snapped_one`` counts channels newly frozen at 1 by ``tol``, ``stably_active`` the
    further channels frozen at 1 because they were stably active on ``data``, ``snapped_zero`` the
    channels frozen at 0. ``skipped_sites`` lists units whose activation is not ReLU-like (the data
    test does not apply to them).
    """

    sites: dict[str, dict]
    skipped_sites: list[str]

    def _sum(self, key: str) -> int:
        return sum(s[key] for s in self.sites.values())

    @property
    def total(self) -> int:
        return self._sum("total")

    @property
    def linear_before(self) -> int:
        return self._sum("linear_before")

    @property
    def linear_after(self) -> int:
        return self._sum("linear_after")

    @property
    def snapped_one(self) -> int:
        return self._sum("snapped_one")

    @property
    def snapped_zero(self) -> int:
        return self._sum("snapped_zero")

    @property
    def stably_active(self) -> int:
        return self._sum("stably_active")

    def __str__(self) -> str:
        lines = [
            f"freeze: {self.linear_before} -> {self.linear_after} of {self.total} channels linear "
            f"({self.snapped_one} snapped to 1, {self.stably_active} stably active on data, "
            f"{self.snapped_zero} snapped to 0)"
        ]
        for name, s in self.sites.items():
            lines.append(
                f"  {name:<30} {s['kind']:<8} {s['linear_before']:>6} -> {s['linear_after']:>6} / {s['total']}"
            )
        return "\n".join(lines)


@torch.no_grad()
def freeze(
    model: nn.Module,
    tol: float = 1e-3,
    data: Any = None,
    snap_zero: bool = False,
    progress: bool = False,
) -> FreezeSummary:
    """Snap and freeze nearly linear unit channels of ``model`` (in place).

    Args:
        model: a model with :class:`LinearizableActivation` units (``linearize.convert`` output).
        tol: channels with slope ``a >= 1 - tol`` are set to exactly 1 and frozen; with
            ``snap_zero``, channels with ``a <= tol`` are set to exactly 0 and frozen. In
            ``[0, 0.5)``, so that no channel is in both ranges.
        data: optional data (:mod:`linearize.inputs`): a tensor batch, a mapping of keyword
            arguments, an ``(inputs, *targets)`` tuple (only ``inputs`` is fed to the model) or an
            iterable of such batches (a ``DataLoader``). ReLU-like channels whose pre-activation
            is ``> 0`` on every sample and position are frozen at 1 (element-level units: each position
            whose pre-activation is ``> 0`` on every sample).
            The pass runs in eval mode without gradients; training flags are restored after. Data
            without a batch raises ``ValueError`` before any change.
            A model sharded by FSDP2: every rank calls ``freeze`` (with the same number of batches, its
            own data) and the test holds over all ranks' data; every rank freezes the same channels.
        snap_zero: also snap ``a <= tol`` to 0.
        progress: tqdm bar over the data.

    Returns: a :class:`FreezeSummary` with per-site counts before and after; ``model`` itself is
    modified in place (snapped slopes, ``frozen`` buffers), no copy is made.

    Raises: ``ValueError`` for ``tol`` outside ``[0, 0.5)``, :class:`~linearize.unit.NonFiniteSlopeError`
    (naming the units) when a slope is NaN or inf: nothing is frozen then.

    Example:
        >>> model = linearize.convert(nn.Sequential(nn.Linear(2, 3), nn.ReLU()), example_inputs=torch.randn(1, 2))
        >>> _ = model[1].slope.data.copy_(torch.tensor([1 - 1e-4, 0.5, 0.0]))
        >>> summary = linearize.freeze(model, tol=1e-3)  # a >= 1 - tol: exactly 1, frozen
        >>> model[1].slope.tolist(), model[1].frozen.tolist()  # NaN: free
        ([1.0, 0.5, 0.0], [1.0, nan, nan])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    tol = check_tol(tol, upper=0.5)
    data = None if data is None else Batches.of(data)  # before any change: a bad type raises here,
    if data is not None:
        next(iter(data))  # and data without a batch (read whether or not a unit is ReLU-like)
    found = require_units(model, what="freeze")
    sites: dict[str, dict] = {}
    before = linear_masks(found, 0.0, "freeze")  # all masks first: freeze_ below changes slopes
    for (name, unit), one, linear in zip(found, linear_masks(found, tol, "freeze"), before):
        sites[name] = {
            "kind": unit.kind,
            "total": unit.num_channels,
            "linear_before": int(linear.sum()),
            "snapped_one": int((one & (unit.frozen != 1).to(one.device)).sum()),
            "stably_active": 0,
            "snapped_zero": 0,
        }
        unit.freeze_(one, 1.0)
    skipped = [name for name, unit in found if not unit.is_prelu]
    relu_like = [(name, unit) for name, unit in found if unit.is_prelu]
    if data is not None and relu_like:
        ranges = {}  # lowest pre-activation per slope: per channel, or per position for element units
        for per_channel in (True, False):
            group = [(n, u) for n, u in relu_like if (u.granularity == "channel") == per_channel]
            if group:
                ranges.update(record_preactivations(model, data, group, per_channel=per_channel, progress=progress))
        for name, unit in relu_like:
            lowest = global_min(ranges[name][0].reshape(-1), unit.slope)  # FSDP2: over every rank's data
            active = (lowest.to(unit.frozen.device) > 0) & ~unit.linear_mask(0.0, name)
            sites[name]["stably_active"] = int(active.sum())
            end = unit.linear_end
            if end is not None:  # there the unit computes (1 - a) x + a (alpha x + beta): that affine map is the end
                a, (alpha, beta) = unit.slope.detach(), end
                unit.set_linear_end(torch.where(active, 1 - a + a * alpha, alpha), torch.where(active, a * beta, beta))
            unit.freeze_(active, 1.0)
    for (name, unit), linear in zip(found, linear_masks(found, 0.0, "freeze")):
        if snap_zero:
            a = full_value(unit.slope.detach())
            zero = (a <= exact_threshold(tol, a.dtype, above=False)) & (unit.frozen != 0).to(a.device)
            sites[name]["snapped_zero"] = int(zero.sum())
            unit.freeze_(zero, 0.0)
        sites[name]["linear_after"] = int(linear.sum())
    return FreezeSummary(sites, skipped)

