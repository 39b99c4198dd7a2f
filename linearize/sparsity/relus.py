"""The budget of ``target(relus=N)``: nonlinear ReLUs per sample, as the private-inference literature counts them.

SNL and AutoReP report a network's nonlinearity as the activation elements ("ReLUs") one input passes
through (:func:`linearize.measures.count_relus`). A channel of a channel-level unit costs every position of
its map (``H x W`` of a conv map, the sequence length of a transformer's hidden states), an element-level
unit's position (``convert(granularity="element")``) costs 1. :class:`ReluBudget` holds those sizes (read from
one forward on ``example_inputs``) and turns the path's wanted ReLU count into the number of leading channels
of the target's ranking that go linear, so that at most that many ReLUs stay nonlinear.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import nn

from ..measures.relus import count_relus
from ..unit import LinearizableActivation

__all__ = ["ReluBudget"]


class ReluBudget:
    """The elements per sample of every channel, and how many ranked channels a ReLU target makes linear.

    Args:
        model: the converted model.
        units: the Sparsifier's ``(name, unit)`` pairs; channels are numbered in this order.
        example_inputs: one batch (its shape sets ``H x W``, a sequence length); ``None`` only when every
            unit is element-level (each position is one ReLU).
        goal: the target's ReLU count (``target(relus=N)``), at most the model's total.

    Raises ``ValueError`` naming the fix for channel units without ``example_inputs``, and for a goal above the
    model's ReLUs per sample.

    Example:
        >>> net = linearize.convert(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()))
        >>> budget = ReluBudget(net, linearize.units(net), torch.zeros(1, 3, 8, 8), 100)
        >>> budget.total, budget.positions   # 4 channels of 8 x 8
        (256, [64])
    """

    def __init__(self, model: nn.Module, units: list[tuple[str, LinearizableActivation]], example_inputs,
                 goal: float) -> None:
        if example_inputs is not None:
            sites = count_relus(model, example_inputs)["sites"]
            positions = [sites[name]["positions"] for name, _ in units]
        else:
            per_channel = [name for name, unit in units if unit.granularity != "element"]
            if per_channel:
                raise ValueError(
                    f"target(relus={goal}) counts each channel of a unit as its elements per sample (H * W of a "
                    f"conv map, a sequence length), read from one forward; {len(per_channel)} unit(s) are "
                    f"channel-level, e.g. {per_channel[:3]}: pass Sparsifier(..., example_inputs=one batch shaped "
                    "like the real inputs)")
            positions = [1] * len(units)  # one slope per position: each is one ReLU
        self.positions = positions
        self.sizes = torch.cat([torch.full((unit.num_channels,), p, dtype=torch.int64)
                                for p, (_, unit) in zip(positions, units)])
        self.total = int(self.sizes.sum())
        if goal > self.total:
            raise ValueError(f"target(relus={goal}) is above this model's {self.total} ReLUs per sample (on "
                             f"example_inputs of this shape): pass relus= at most {self.total}")
        self.goal = goal

    def allowed(self, wanted: float) -> int:
        """The nonlinear ReLUs the path allows for its value ``wanted``, rounded; shifted down by the goal's
        fractional part first, so that at the goal it allows ``floor(goal)`` (at most the goal)."""
        return int(round(wanted - (self.goal - math.floor(self.goal))))

    def linear_needed(self, ranked: torch.Tensor, wanted: float, frozen: torch.Tensor) -> int:
        """The fewest leading channels of ``ranked`` (the free channels, in the order they go linear) whose
        ReLUs, made linear, leave at most :meth:`allowed` nonlinear (all of them when even that is not enough:
        channels frozen nonlinear keep theirs). ``frozen``: every channel's frozen value (NaN: free)."""
        sizes = self.sizes.to(ranked.device)
        could = int(sizes[frozen.to(ranked.device) != 1].sum())  # nonlinear while no free channel is linear
        needed = could - self.allowed(wanted)
        if needed <= 0 or len(ranked) == 0:
            return 0
        reached = torch.cumsum(sizes[ranked], 0)
        return min(int(torch.searchsorted(reached, needed)) + 1, len(ranked))

    def nonlinear(self, linear: torch.Tensor) -> int:
        """Nonlinear ReLUs per sample for the channels' ``linear`` mask (one bool per channel)."""
        return int(self.sizes[~linear.cpu()].sum())

    def floor(self, frozen: torch.Tensor) -> int:
        """ReLUs per sample of the channels frozen nonlinear (a fixed slope below 1): no target goes below it."""
        return int(self.sizes[frozen.cpu() < 1].sum())

    def check_state(self, state: Mapping) -> None:
        """``ValueError`` when ``state`` counted other ReLUs per channel (inputs of another shape)."""
        saved = state.get("relu_positions")
        if saved is not None and saved != self.positions:
            raise ValueError(f"state was saved with {saved!r:.120} ReLUs per channel of each site, these "
                             f"example_inputs give {self.positions!r:.120}: pass example_inputs of the shape the "
                             "run started with to resume")
