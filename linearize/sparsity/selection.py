"""Which channels a target makes linear: importance objects (``Sparsifier(select=...)``).

An importance ranks the free channels of a target's projection and values the groups of a cost plan:

- :class:`SlopeImportance` (``select="slope"``): the channels the uniform push carried highest go first
  (the loss gradient decides by holding important slopes down); a group's value is its slope gap;
- :class:`SaliencyImportance` (``select="saliency"``): no uniform push; the running mean of each
  channel's squared slope gradient (the diagonal Fisher of the slope) per unit of weight, the cheapest
  first, with hysteresis, held once the target is reached;
- :class:`FitImportance` (``select="fit"``): no uniform push; the output error each channel's replacement
  by its least-squares affine fit puts on the layer it feeds (:func:`linearize.one_shot`'s score, on the
  training batches through a :class:`~linearize.calibration.RunningFit`), ranked within each unit, the
  cheapest first, with hysteresis, held once the target is reached.

A new kind is a subclass of :class:`Importance` (its :meth:`~Importance.keys` and
:meth:`~Importance.values`, and :meth:`~Importance.observe` if it reads something at each step)
registered in :data:`SELECTIONS` under its ``select=`` name.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch

from .. import schedules as _schedules
from ..calibration import RunningFit
from ..distributed import full_value
from ..unit import LinearizableActivation

__all__ = ["Importance", "SlopeImportance", "SaliencyImportance", "FitImportance", "CostImportance", "SELECTIONS", "SELECT",
           "SALIENCY_DECAY", "SALIENCY_HYSTERESIS", "selection"]

SALIENCY_DECAY = 0.9  # running mean of the squared slope gradients, per step
SALIENCY_HYSTERESIS = 0.5  # a selected channel's cost counts this much in the ranking

Units = list[tuple[str, LinearizableActivation]]


class Importance:
    """What making a channel linear costs the model, as a target's projection and a cost plan see it.

    Args:
        units: the Sparsifier's ``(name, unit)`` pairs; channels are numbered in this order.
        weights: one normalized cost weight per unit.
        warn: the Sparsifier's warn-once function.
    """

    name = ""
    pushes = True  # the uniform push (rate, lam, mode="loss") applies alongside this selection
    reads_gradients = False  # ranks by what it measured from the loss gradients (not by the slopes alone)
    reads_fits = False  # ranks by the units' running affine fits (the Sparsifier keeps a RunningFit for it)

    def __init__(self, units: Units, weights: list[float], warn: Callable[[str], None],
                 fit: RunningFit | None = None) -> None:
        self.units, self.weights, self.warn, self.fit = units, weights, warn, fit

    @classmethod
    def check(cls, schedule: _schedules.Schedule, rate: float | None, lam: float | None, mode: str) -> None:
        """``ValueError`` for Sparsifier arguments this selection cannot honour: a selection without the
        uniform push (``pushes = False``) chooses the channels of a target and takes no push arguments."""
        if cls.pushes:
            return
        if not schedule.steers:
            raise ValueError(f"select={cls.name!r} picks the channels of a target schedule: pass "
                             "schedule=linearize.schedules.target(...), or select='slope'")
        if rate is not None or lam is not None or mode != "proximal" or schedule.legacy:
            raise ValueError(f"select={cls.name!r} applies no uniform push, so rate=, lam= (or a schedule with "
                             "its own lam) and mode='loss' do not apply: drop them, or use select='slope'")

    def per_unit(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``flat`` (one entry per channel, units in order) split into one view per unit."""
        return torch.split(flat, [u.num_channels for _, u in self.units])

    def saliency_of_units(self) -> dict[str, torch.Tensor]:
        """Per unit, the running mean of each channel's squared slope gradient (zeros: not measured)."""
        return {name: torch.zeros(u.num_channels, dtype=torch.float64) for name, u in self.units}

    def observe(self) -> None:
        """Read what this selection needs at a :meth:`Sparsifier.step` (after ``optimizer.step()``)."""

    def warn_if_blind(self) -> None:
        """Warn when the target runs without what this selection reads (nothing to read here)."""

    def keys(self, slopes: torch.Tensor, linear: torch.Tensor, selected: torch.Tensor,
             hold: bool) -> tuple[torch.Tensor, ...]:
        """Per-channel ranking keys, highest first; stable sorts apply them in order, so the last key
        decides first. ``linear``: slope exactly 1 now; ``selected``: chosen at the last step (or linear);
        ``hold``: the target was reached and a selection exists."""
        return (linear, slopes, selected)

    def values(self, before: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
        """Float64 per channel: what making it linear loses (its slope gap ``1 - a`` before this step's
        push), 0 for frozen channels; a cost plan sums them per group."""
        return (1.0 - before.double().cpu()) * free

    def state_dict(self) -> dict:
        """The selection's part of :meth:`Sparsifier.state_dict` (``saliency``, ``seen``)."""
        return {"saliency": None, "seen": None}

    def read_state(self, state: Mapping, channels: int) -> object:
        """Check this selection's part of ``state`` and return it parsed, for :meth:`restore`."""
        return None

    def restore(self, parsed: object) -> None:
        """Take over what :meth:`read_state` parsed."""


class SlopeImportance(Importance):
    """``select="slope"``: the highest slopes first (the push orders them; see the module docs)."""

    name = "slope"


class CostImportance(Importance):
    """A selection without the uniform push that ranks the free channels by a per-channel :meth:`cost`: the
    cheapest first, then by slope; once the target is reached the selection holds."""

    pushes = False

    def cost(self, selected: torch.Tensor) -> torch.Tensor:
        """Float64 ranking cost per channel (lower goes linear first); ``selected`` gets its hysteresis."""
        raise NotImplementedError

    def keys(self, slopes: torch.Tensor, linear: torch.Tensor, selected: torch.Tensor,
             hold: bool) -> tuple[torch.Tensor, ...]:
        # linear now first, then the cheapest, then by slope; once reached: hold the selection
        if hold:
            return (slopes, selected)
        return (slopes, -self.cost(selected).to(slopes.device))


class SaliencyImportance(CostImportance):
    """``select="saliency"``: the cheapest channels first, by their running squared slope gradients."""

    name = "saliency"
    reads_gradients = True

    def __init__(self, units: Units, weights: list[float], warn: Callable[[str], None],
                 fit: RunningFit | None = None) -> None:
        super().__init__(units, weights, warn, fit)
        # float64 [C]: running mean of squared slope gradients
        self.saliency = torch.zeros(sum(u.num_channels for _, u in units), dtype=torch.float64)
        self.seen = torch.zeros(self.saliency.numel(), dtype=torch.bool)  # channels with a gradient seen
        self.had_grad = False  # any slope gradient tensor at a step() so far

    def observe(self) -> None:
        """Fold this step's slope gradients into the running saliency. Units without a gradient
        this step (unused, frozen) keep theirs; a step with a NaN/inf gradient anywhere (one a loss
        scaler skipped), or with all gradients exactly 0 (zeroed already), is left out."""
        grads = [None if u.slope.grad is None else full_value(u.slope.grad) for _, u in self.units]
        self.had_grad |= any(g is not None for g in grads)
        if any(g is not None and not torch.isfinite(g).all() for g in grads):
            return
        if all(g is None or not g.any() for g in grads):  # zeroed already, or a loss at its minimum: no news
            return
        for grad, part, seen in zip(grads, self.per_unit(self.saliency), self.per_unit(self.seen)):
            if grad is not None:
                part.mul_(SALIENCY_DECAY).add_(grad.detach().double().cpu().square(), alpha=1 - SALIENCY_DECAY)
                seen.fill_(True)

    def saliency_of_units(self) -> dict[str, torch.Tensor]:
        return {name: part.clone() for (name, _), part in zip(self.units, self.per_unit(self.saliency))}

    def warn_if_blind(self) -> None:
        if not self.had_grad:
            self.warn("select='saliency' has seen no slope gradient since the start of the run: call "
                      "sparsifier.step() after optimizer.step() and before zero_grad() (attach(optimizer) "
                      "does), with the slopes trainable; until then channels are chosen by slope")

    def cost(self, selected: torch.Tensor) -> torch.Tensor:
        """Ranking cost per channel: saliency per unit of weight, halved for the selected, ``inf`` for a
        channel never seen with a gradient."""
        weights = torch.cat([torch.full((u.num_channels,), float(w), dtype=torch.float64)
                             for (_, u), w in zip(self.units, self.weights)])
        cost = torch.where(weights > 0, self.saliency / weights, torch.tensor(math.inf, dtype=torch.float64))
        cost = torch.where(selected.cpu(), cost * SALIENCY_HYSTERESIS, cost)
        return torch.where(self.seen, cost, torch.tensor(math.inf, dtype=torch.float64))

    def values(self, before: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
        """The running squared slope gradients of the free channels, when every one has had a gradient
        (else, with a warning, the slope gap)."""
        if bool(self.seen[free].all()):
            return self.saliency * free
        unseen = [name for (name, _), part in zip(self.units, self.per_unit(free & ~self.seen)) if part.any()]
        self.warn(f"select='saliency': the slopes of {len(unseen)} site(s) had no gradient before the cost "
                  f"plan was made ({', '.join(unseen[:5])}{', ...' if len(unseen) > 5 else ''}), so every "
                  "group is ranked by slope gap instead: put those slopes in the optimizer (with "
                  "requires_grad) and start the target after some steps, e.g. start=0.05")
        return super().values(before, free)

    def state_dict(self) -> dict:
        return {"saliency": self.saliency.tolist(), "seen": torch.nonzero(self.seen).squeeze(1).tolist()}

    def read_state(self, state: Mapping, channels: int) -> object:
        if state.get("saliency") is None:
            return None
        saliency = torch.tensor(state["saliency"], dtype=torch.float64)
        if saliency.shape != self.saliency.shape or not torch.isfinite(saliency).all() or (saliency < 0).any():
            raise ValueError(f"state's saliency must be {channels} finite values >= 0")
        seen = torch.zeros(channels, dtype=torch.bool)
        seen[torch.tensor(state.get("seen") or [], dtype=torch.long)] = True
        return saliency, seen

    def restore(self, parsed: object) -> None:
        if parsed is not None:
            self.saliency, self.seen = parsed


class FitImportance(CostImportance):
    """``select="fit"``: the cheapest channels first, by the output error of their affine fit.

    A channel's score is ``E[(act(x) - alpha x - beta)^2] * ||W[:, c]||^2`` over the running window of
    training batches (:class:`~linearize.calibration.RunningFit`; ``W`` the layer the unit feeds, 1 where
    there is none). Scores are errors at different layers, so they are compared only within a unit (as
    :func:`linearize.one_shot` does): a channel's cost is its rank quantile in its unit, ``(rank + 0.5) / C``,
    divided by the unit's weight, halved for the selected (hysteresis); each unit then gives up about the
    same fraction. It needs no gradient: at the start of a fine-tune the loss is at its minimum and the
    slope gradients say nothing yet, while the data already shows which channels are nearly affine.
    """

    name = "fit"
    reads_fits = True

    def __init__(self, units: Units, weights: list[float], warn: Callable[[str], None],
                 fit: RunningFit | None = None) -> None:
        if fit is None:
            raise ValueError("select='fit' ranks by a RunningFit of the units: the Sparsifier passes one")
        super().__init__(units, weights, warn, fit)

    def cost(self, selected: torch.Tensor) -> torch.Tensor:
        """Ranking cost per channel: rank quantile of the fit's score within its unit, per unit of weight,
        halved for the selected, ``inf`` for a unit not seen in training yet."""
        fits = self.fit.fits()
        costs = []
        for (name, unit), w in zip(self.units, self.weights):
            fit = fits.get(name)
            if fit is None or w <= 0:
                costs.append(torch.full((unit.num_channels,), math.inf, dtype=torch.float64))
                continue
            score = fit.residual * (fit.outgoing if fit.outgoing is not None else 1.0)
            order = torch.sort(score, stable=True).indices
            quantile = torch.empty_like(score)
            quantile[order] = (torch.arange(len(score), dtype=torch.float64) + 0.5) / len(score)
            costs.append(quantile / w)
        cost = torch.cat(costs)
        return torch.where(selected.cpu(), cost * SALIENCY_HYSTERESIS, cost)

    def warn_if_blind(self) -> None:
        if self.fit.fits():
            return
        left_out = {name: int(n) for name, n in self.fit.left_out.items() if n}
        if left_out:
            name, n = next(iter(left_out.items()))
            self.warn(f"select='fit' has no fit of the units yet: every position of the training forwards so far "
                      f"held NaN/inf in a unit's input or activation, and was left out ({n} positions of unit "
                      f"{name!r}; e.g. NaN at padded positions the loss masks); until then channels are chosen by "
                      "slope and linear_end='affine' sets no end. Fix: make the inputs finite (pad with 0, or "
                      "nan_to_num the batch) or find where the model overflows")
        elif self.fit.empty_steps:
            self.warn(f"select='fit' has no fit of the units yet: the training forwards of {self.fit.empty_steps} "
                      "step(s) so far held no position (empty batches); until one with data, channels are chosen "
                      "by slope and linear_end='affine' sets no end")
        else:
            self.warn("select='fit' has seen no training-mode forward of the units since the start of the run: "
                      "call model.train() before the forward passes; until then channels are chosen by slope")

    def values(self, before: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
        """The rank quantile of each free channel's fit (a cost plan's importance)."""
        cost = self.cost(torch.zeros(len(free), dtype=torch.bool))
        return torch.where(torch.isfinite(cost), cost, torch.ones_like(cost)) * free


SELECTIONS: dict[str, type[Importance]] = {"slope": SlopeImportance, "saliency": SaliencyImportance,
                                           "fit": FitImportance}
SELECT = tuple(SELECTIONS)


def selection(select: str) -> type[Importance]:
    """The :class:`Importance` class registered as ``select`` in :data:`SELECTIONS`.

    Example:
        >>> selection("saliency").name
        'saliency'
    """
    if select not in SELECTIONS:
        raise ValueError(f"select must be one of {SELECT}, got {select!r}")
    return SELECTIONS[select]
