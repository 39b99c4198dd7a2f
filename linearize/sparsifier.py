"""Sparsity pressure on the slopes of linearizable units, on a schedule.

The penalty is ``sum_c w_c * (1 - a_c)`` over all free channels ``c`` (``w_c = 1`` unless weighted
by cost). By default it is applied as a **proximal step** after each optimizer step::

    a <- min(1, a + delta_t * w)        then clamp to [0, 1] and restore frozen channels

so that channels become *exactly* linear (``a == 1``), not 0.98, and stay there unless the loss
gradient pulls harder. The per-step displacement ``delta_t`` is given in **slope units per step**,
independent of the optimizer's scale::

    delta_t = rate * shape_t * (lr_t / lr_peak)

``shape_t`` is the schedule's multiplier in ``[0, 1]``; ``lr_t / lr_peak`` is the current learning
rate of the slopes' param group over the largest one seen so far (1 without an optimizer), so the
push follows the *shape* of the LR schedule but not its scale: the same ``rate`` means the same
under SGD at lr 0.1 and AdamW at lr 2e-5, from scratch or fine-tuning. The default ``rate=None``
is ``1 / ramp_steps`` (``end - start`` of a :func:`~linearize.schedules.target` schedule, else
``total_steps``): a free slope that nothing resists drifts across ``[0, 1]`` once over the ramp.

=====================  ===========================================  ==================================
argument               a free slope moves per step by               meaning
=====================  ===========================================  ==================================
``rate=None`` (auto)   ``shape_t * lr_t/lr_peak / ramp_steps``      crosses [0, 1] once over the ramp
``rate=r``             ``r * shape_t * lr_t/lr_peak``               r slope units per step at peak LR
``lam=l`` (legacy)     ``lr_t * l * shape_t``                       depends on the optimizer's scale
=====================  ===========================================  ==================================

The legacy ``lam`` (also a schedule built with its own ``lam``, a number, or a plain function
``(step, total_steps) -> lam``) keeps the old ``lr * lam`` step; its strength depends on the
optimizer (``lam = 1e-3`` under SGD at lr 0.1 is ``1e-4`` per step, the same ``lam`` under AdamW at
lr 2e-5 is ``2e-8``: nothing).

**Which channels a target makes linear** (``select``). With ``select="slope"`` (default) the
channels whose slopes the pressure carried highest go first: the loss gradient decides by holding
important slopes down against the push. That works when the optimizer can move a slope about as
far per step as the push (SGD at usual rates), but not under Adam fine-tuning, where a slope moves
about ``lr`` (2e-5) per step against a push of ``1 / ramp_steps`` (1e-3): every slope drifts up
alike, the choice is arbitrary, and the channels left nonlinear end at ``1 - release``, nearly
linear. ``select="saliency"`` (a target schedule only) measures instead what each channel costs:
the running mean of its squared loss gradient ``E[(dL/da_c)^2]`` (the diagonal Fisher of the
slope, a second-order estimate of the loss increase of moving it; decay ``0.9`` per step,
optimizer-independent), divided by the channel's ``weights`` (cost per unit of saving), and glides
the *cheapest* channels to 1; there is no uniform push (``rate``, ``lam`` and ``mode="loss"`` do
not apply), so the channels kept nonlinear keep their slopes (the loss alone moves them). A
channel already selected counts at half its cost (hysteresis: the choice does not flicker with
gradient noise), the selection is fixed once the target is reached, and a channel whose slope has
never had a gradient (frozen, unused, ``requires_grad=False``) is never chosen before one that has.
Gradients are read at each :meth:`Sparsifier.step` (after ``optimizer.step()``, before
``zero_grad()``; :meth:`attach` does); a step with NaN/inf gradients (a step a loss scaler skipped)
is not counted, and a warning says when the ramp runs without any slope gradient.

A :func:`~linearize.schedules.target` schedule adds a **gentle budget projection** (see
:meth:`Sparsifier.max_step`): the channels the cubic path wants linear ``G`` steps ahead are
selected (highest slopes first, a selected channel stays selected), each selected channel moves up
by ``1 / G`` per step and becomes exactly 1 when it arrives (within ``1 / G`` of 1); unselected
channels at 1 are released to ``1 - release``. No slope rises by more than ``1 / G`` in one step, so
no channel is snapped from far away, and the exactly-linear count reaches the target exactly at
``end`` and holds it. ``G = ceil(glide * (end - start))``; ``glide=0`` is the old instant projection.

:meth:`Sparsifier.penalty` offers the same prior as a differentiable loss term instead
(``mode="loss"``): its gradient ``-lam_t * w`` goes through the optimizer, so with Adam it is
rescaled per parameter and momentum carries it past 1; the proximal step is optimizer-agnostic.

**Cost targets** (``target(flops=0.6)`` or ``target(latency=0.7)``, with ``granularity="site"`` or
``"block"`` and ``example_inputs``) steer the *folded* model's cost instead of the nonlinear
fraction: the cost of a set of linear groups (sites, or blocks) is measured by folding a copy of the
model with exactly those groups linear and every other free channel at slope 0
(:func:`linearize.fold`; FLOPs by fold's own counter, or the median CPU latency of the folded
model), as a fraction of the **original** model folded (every slope 0, frozen or not: each unit is
its own activation, BatchNorm merged), so a budget counts only what linearization saves. A site
left partly linear folds to a PReLU/blend that costs more than its original activation (on a CPU at
batch 1 a ``ChannelPReLU`` call takes about twice a ReLU's), so a cost target glides the free
channels of every group outside its plan down to exactly 0 (at ``1 / G`` per step, like the glide
up) and holds them there: those sites fold back to their original activation (a site with a channel
frozen linear stays a PReLU/blend, and is counted so) and the folded model costs what the plan
counted. Latencies are timed interleaved with the original's (the ratio is measured side by side),
planning folds are not verified (``fold(verify=False)``: only their structure is measured).

At the target's start a plan is made once: a modified greedy for the covering knapsack
"lose the least importance with cost <= budget" adds groups by importance per unit of *marginal*
saving (each from a real fold, so interactions between sites count), records every group that
alone would complete the budget as a candidate instead of adding it, keeps the least important
candidate, drops every group it can do without, and ends at its shortest prefix within the budget
(measured costs need not be monotone). A latency plan's last set is then timed again, on its own and
longer, and the plan made again with that time in place of the first until its last set so timed is
within the budget: among many noisy times the plan picks those that came in low (on CIFAR
MobileNet-V2, a single block once timed 0.51 of the original). Once two sets are refused, every
planning time is divided by the mildest of their planning-over-timed-again ratios (a load that reads
every time low; one glitch alone moves nothing); when no plan tried meets the budget, the closest is
kept, with a warning. Importance is the slope gap ``sum (1 - a)``
of a group's free channels (``select="slope"``) or the sum of their saliencies
(``select="saliency"``, once every group has had a gradient: start the target after some steps).
For additive savings this greedy loses at most twice the optimal importance (the bound of the
modified greedy for min-knapsack); fold's savings interact (merging two layers needs both sites
linear), where no bound holds, but the budget is always met: the plan's last set is folded and
counted. The path then descends from the cost at ``start`` to the budget along the cubic path, each
step making linear the shortest prefix of the plan whose folded cost is within the path's value
(groups glide to 1 as with a fraction target; the plan's other groups stay below ``1 - release``,
groups outside the plan glide to 0), and holds it from ``end`` on. Planning folds the model
``O(groups^2)`` times (once); a budget below the cost with every group linear, a cost target with
``granularity="channel"`` or without ``example_inputs`` are refused with the fix.

Three added lines in a plain loop::

    sparsifier = linearize.Sparsifier(model, linearize.schedules.target(0.10, end=0.8), total_steps)
    sparsifier.attach(optimizer)        # or: sparsifier.step() after each optimizer.step()
"""

from __future__ import annotations

import copy
import functools
import json
import math
import warnings
import weakref
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from . import schedules as _schedules
from .checks import check_positive, check_positive_int, finite_nonnegative, is_real
from .distributed import full_value, refuse_sharded, write_full
from .folding.blocks import residual_block_types
from .folding.core import fold
from .folding.flops import module_flops
from .folding.layers import CONVS, is_hf_conv1d
from .inputs import call_model, map_tensors
from .timing import busy_cpu, median_latency_ms, median_ms
from .unit import (LinearizableActivation, check_finite_slopes, count_channels, linear_masks, project_slopes,
                   require_units, units)

__all__ = ["Sparsifier", "param_groups", "flops_weights", "latency_weights", "site_groups"]

MODES = ("proximal", "loss")
SELECT = ("slope", "saliency")
GRANULARITY = ("channel", "site", "block")
SALIENCY_DECAY = 0.9  # running mean of the squared slope gradients, per step
# free slopes closer together than this when a cost plan is made with select="slope": the slope gaps of
# the groups are their channel counts give or take this much, so the plan says it ranks by count alone
SLOPE_SPREAD = 0.1
SALIENCY_HYSTERESIS = 0.5  # a selected channel's cost counts this much in the ranking
LATENCY_BUDGET_S = 0.3  # seconds of repetitions per folded model a latency target times
# seconds of repetitions when a latency plan's last set is timed again, on its own, before it is used
LATENCY_CONFIRM_S = 1.5
# torch optimizer -> weakref to the Sparsifier attached to it (one per optimizer: two would apply the pressure twice)
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` inside wrappers such as accelerate's ``AcceleratedOptimizer``."""
    inner = optimizer
    while hasattr(inner, "optimizer"):  # AcceleratedOptimizer subclasses Optimizer but wraps one
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer (or a wrapper of one), got {type(optimizer).__name__}")
    return inner


class Sparsifier:
    """Scheduled sparsity pressure on every unit of ``model`` (see the module docs).

    Args:
        model: a converted model (raises ``ValueError`` when it has no units).
        schedule: a :mod:`linearize.schedules` object, a function ``(step, total_steps) -> lam``
            (legacy ``lam``), a number (constant legacy ``lam``) or ``None`` (constant pressure).
        total_steps: number of optimizer steps of the run (resolves fractional schedule steps).
        rate: pressure in slope units per step at the peak LR (see the module docs); ``None``:
            ``1 / ramp_steps``. Used by schedules built with ``lam=None``.
        lam: legacy pressure: a free slope moves by ``lr * lam`` per step (depends on the
            optimizer's scale). Give either ``rate`` or ``lam``, not both.
        glide: a target schedule's glide time ``G`` as a fraction of its ramp ``end - start``:
            no slope rises by more than ``1 / G`` per step (:attr:`max_step`); ``0`` = the old
            instant projection (snaps channels to 1 from wherever they are). ``None``: 0.1 with
            ``rate``, 0 with a legacy ``lam`` (which then reproduces earlier results exactly).
        weights: per-unit cost weighting: ``None`` (all 1), ``"flops"`` (multiply-adds of the
            layers next to the unit, per channel; needs ``example_inputs``, see
            :func:`flops_weights`), ``"latency"`` (measured CPU time of those layers, per channel,
            see :func:`latency_weights`) or a dict ``{unit_name: weight}`` (missing names weigh 1).
            Weights are normalized to mean 1 over channels, so ``rate`` keeps its meaning.
        mode: ``"proximal"`` (default: the step applies the pressure) or ``"loss"`` (add
            :meth:`penalty` to the loss yourself; the step then only projects and logs).
        optimizer: the optimizer, to read the learning rate and detect a missed optimizer step
            (:meth:`attach` sets it too).
        lr: learning rate of the slopes when no optimizer is known (legacy ``lam`` only).
        release: a :func:`~linearize.schedules.target` schedule keeps exactly its budget of
            linear channels; channels at 1 beyond it are set back to ``1 - release``.
        log_every: record the per-site fractions every this many steps (default: about 500
            records per run).
        example_inputs: inputs for ``weights="flops"`` / ``"latency"`` and for a cost target (one
            small batch shaped like the real inputs).
        granularity: ``"channel"`` (each channel on its own) or ``"site"``: the push is a group
            proximal step per unit (group lasso: the channels of a call site move together and
            become exactly linear together), and a target makes whole sites linear (the cheapest
            first; it reaches its fraction to within one site). Whole linear sites are what fold
            can remove from convolutional networks. ``"block"``: the same with all sites of one
            residual block as one group (see :func:`site_groups`; fold merges a block's body only
            when all its inner sites are linear).
        blocks: with ``granularity="block"``: the module names of the blocks (a site belongs to the
            innermost one containing it); ``None``: every residual block of a known class
            (:func:`~linearize.folding.blocks.residual_block_types`). Sites outside any block are
            groups of their own.
        select: how a target schedule picks the channels it makes linear: ``"slope"`` (pushed
            highest first) or ``"saliency"`` (lowest running mean of the squared loss gradient
            of the slope first, no uniform push; for fine-tuning under Adam, see the module docs).

    Example::

        sp = Sparsifier(model, schedules.target(0.25, start=0.1, end=0.8), total_steps=2000)
        sp.attach(torch.optim.AdamW(param_groups(model), lr=2e-5))   # rate = 1/1400 per step

    Example:
        >>> model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        >>> opt = torch.optim.SGD(linearize.param_groups(model), lr=0.01)
        >>> sp = linearize.Sparsifier(model, linearize.schedules.target(0.25, start=0.0, end=1.0), total_steps=20)
        >>> _ = sp.attach(opt)
        >>> for _ in range(20):
        ...     opt.zero_grad(); model(torch.randn(16, 4)).square().mean().backward(); opt.step()
        >>> linearize.nonlinear_fraction(model)  # 6 of the 8 channels exactly linear
        0.25
    """

    def __init__(
        self,
        model: nn.Module,
        schedule: _schedules.ScheduleLike = None,
        total_steps: int = 1,
        lam: float | None = None,
        weights: str | Mapping[str, float] | None = None,
        mode: str = "proximal",
        optimizer: torch.optim.Optimizer | None = None,
        lr: float | None = None,
        release: float = 0.01,
        log_every: int | None = None,
        example_inputs=None,
        rate: float | None = None,
        glide: float | None = None,
        select: str = "slope",
        granularity: str = "channel",
        blocks: Sequence[str] | None = None,
    ) -> None:
        self._units = require_units(model, "there is nothing to sparsify")
        if granularity not in GRANULARITY:
            raise ValueError(f"granularity must be one of {GRANULARITY}, got {granularity!r}")
        if blocks is not None and granularity != "block":
            raise ValueError(f"blocks= names the groups of granularity='block', got granularity={granularity!r}")
        cost = getattr(schedule, "cost", None) if isinstance(schedule, _schedules.Target) else None
        if cost is not None and granularity == "channel":
            raise ValueError(f"a cost target (target({cost}=...)) makes whole sites linear, the only linearity "
                             "fold removes: pass granularity='site' or granularity='block'")
        if cost is not None:
            refuse_sharded(model, f"a cost target (target({cost}=...)) folds copies of the model to plan, so it")
        if cost is not None and example_inputs is None:
            raise ValueError(f"a cost target (target({cost}=...)) folds the model to measure its cost: pass "
                             "example_inputs= (one small batch shaped like the real inputs)")
        if select not in SELECT:
            raise ValueError(f"select must be one of {SELECT}, got {select!r}")
        if select == "saliency" and not isinstance(schedule, _schedules.Target):
            raise ValueError("select='saliency' picks the channels of a target schedule: pass "
                             "schedule=linearize.schedules.target(...), or select='slope'")
        if select == "saliency" and (rate is not None or lam is not None or mode != "proximal"
                                     or getattr(schedule, "lam", None) is not None):
            raise ValueError("select='saliency' applies no uniform push, so rate=, lam= (or a schedule with "
                             "its own lam) and mode='loss' do not apply: drop them, or use select='slope'")
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
        _schedules._check_lam(lam)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0.0 < release < 1.0:
            raise ValueError(f"release must lie in (0, 1), got {release}")
        if schedule is None or isinstance(schedule, (int, float)):
            schedule = _schedules.constant(None if schedule is None else float(schedule))
        elif not callable(schedule):
            raise TypeError(f"schedule must be a linearize.schedules object, a function or a number, got {schedule!r}")
        if isinstance(schedule, _schedules.Schedule):
            schedule.validate(total_steps)
        # legacy lr * lam: an explicit lam, a schedule with its own lam, or a plain function (returns lam)
        legacy = lam is not None or not isinstance(schedule, _schedules.Schedule) or schedule.lam is not None
        if legacy and rate is not None:
            raise ValueError(
                "pass either rate= (slope units per step) or a legacy lam (Sparsifier(lam=...), a "
                "schedule with its own lam, a number or a function), not both"
            )
        if rate is not None and (isinstance(rate, bool) or not math.isfinite(rate) or rate < 0):
            raise ValueError(f"rate must be a finite number >= 0 (slope units per step), got {rate!r}")
        if glide is None:
            glide = 0.0 if legacy else 0.1
        if isinstance(glide, bool) or not isinstance(glide, (int, float)) or not 0.0 <= glide <= 1.0:
            raise ValueError(f"glide must lie in [0, 1] (a fraction of the target's ramp), got {glide!r}")
        self.schedule = schedule
        self.total_steps = total_steps
        self.legacy = legacy
        self.lam = None if lam is None else float(lam)
        self.rate = (1.0 / self.ramp_steps()) if rate is None else float(rate)
        self.glide = float(glide)
        self.mode = mode
        self.lr = None if lr is None else check_positive(lr, "lr")
        self.release = release
        self.log_every = max(1, total_steps // 500) if log_every is None else check_positive_int(log_every, "log_every")
        self.optimizer = torch_optimizer(optimizer) if optimizer is not None else None
        self._weights = self._build_weights(model, weights, example_inputs)
        self.step_count = 0
        self.initial_fraction: float | None = None  # measured at a target's start (a cost target: the cost ratio)
        self._selected: torch.Tensor | None = None  # bool [C], channels the target glides to 1
        self.select = select
        self.granularity = granularity
        names = [n for n, _ in self._units]
        self._groups: list[list[int]] = (  # unit indices of each group (a site, or a block's sites)
            [[i] for i in range(len(names))] if granularity != "block" else
            [[names.index(n) for n in g] for g in site_groups(model, blocks).values()])
        unit_group = {i: g for g, group in enumerate(self._groups) for i in group}
        self._channel_group = torch.cat([torch.full((u.num_channels,), unit_group[i])  # group of each channel
                                         for i, (_, u) in enumerate(self._units)])
        # a cost target: the model to fold, its reference cost, the plan (groups in the order they go linear)
        self._model = model if cost is not None else None
        self._cost_inputs = None if cost is None else map_tensors(  # float32 CPU, as every folded copy
            example_inputs, lambda t: t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu())
        self._original: nn.Module | None = None  # the original model folded, timed beside each other set
        self._costs: dict[frozenset | None, float] = {}  # cache: set of linear groups -> cost / original's
        self._plan: list[int] | None = None
        self._plan_start: set[int] = set()  # groups linear (or frozen linear) when the plan was made
        self._plan_costs: list[float] | None = None  # cost ratio of each plan prefix (len(plan) + 1)
        self._reference: float | None = None  # the original's folded cost (FLOPs or ms)
        self._frozen_measured: torch.Tensor | None = None  # frozen values when the costs were measured
        self._said: set[str] = set()  # warnings given once
        if cost is not None:
            self._check_budget()
        # float64 [C]: running mean of squared slope gradients (select="saliency")
        self._saliency = torch.zeros(sum(u.num_channels for _, u in self._units), dtype=torch.float64)
        self._seen = torch.zeros(self._saliency.numel(), dtype=torch.bool)  # channels with a gradient seen
        self._had_grad = False  # any slope gradient tensor at a step() so far
        self._lr_peak: list[float | None] = [None] * len(self._units)  # largest slope LR seen, per unit
        self.history: list[dict] = []
        self._hook = None
        self._versions = self._slope_versions()
        self._warned = False

    # ------------------------------------------------------------------ setup
    def _build_weights(self, model, weights, example_inputs) -> list[float]:
        names = [n for n, _ in self._units]
        if weights is None:
            raw = {n: 1.0 for n in names}
        elif isinstance(weights, str):
            if weights not in ("flops", "latency"):
                raise ValueError(f"weights must be None, 'flops', 'latency' or a dict name -> weight, got {weights!r}")
            if example_inputs is None:
                raise ValueError(f"weights={weights!r} needs example_inputs (one batch) to measure the layers")
            raw = (flops_weights if weights == "flops" else latency_weights)(model, example_inputs)
        elif isinstance(weights, Mapping):
            unknown = set(weights) - set(names)
            if unknown:
                raise ValueError(
                    f"weights name units the model does not have: {sorted(unknown)[:5]}; units: {names[:5]}..."
                )
            raw = {n: float(weights.get(n, 1.0)) for n in names}
        else:
            raise TypeError(f"weights must be None, 'flops', 'latency' or a dict, got {type(weights).__name__}")
        if any(not math.isfinite(w) or w < 0 for w in raw.values()):
            raise ValueError("unit weights must be finite and >= 0")
        channels = sum(u.num_channels for _, u in self._units)
        mean = sum(raw[n] * u.num_channels for n, u in self._units) / channels
        if not math.isfinite(mean):  # huge weights overflowed the sum: only their ratios matter
            top = max(raw.values())
            raw = {n: w / top for n, w in raw.items()}
            mean = sum(raw[n] * u.num_channels for n, u in self._units) / channels
        if mean <= 0:
            raise ValueError("all unit weights are 0: no unit would get any pressure")
        return [raw[n] / mean for n in names]

    @property
    def weights(self) -> dict[str, float]:
        """Normalized weight of each unit (mean 1 over channels)."""
        return {n: w for (n, _), w in zip(self._units, self._weights)}

    def attach(self, optimizer) -> "Sparsifier":
        """Run :meth:`step` after every step of ``optimizer`` (a step post hook); returns self.

        Accepts wrappers such as accelerate's ``AcceleratedOptimizer`` (the hook goes on the
        torch optimizer inside, so skipped accumulation steps do not count).

        Raises:
            RuntimeError: this Sparsifier is attached already, or another one is attached to
                ``optimizer`` (each would apply the pressure once per step): :meth:`detach` first.
        """
        inner = torch_optimizer(optimizer)
        if self._hook is not None:
            raise RuntimeError(
                "this Sparsifier is already attached to an optimizer: a second hook would apply the "
                "pressure twice per step; call sparsifier.detach() before attaching it again"
            )
        other = _ATTACHED.get(inner)
        other = other() if other is not None else None
        if other is not None and other._hook is not None:
            raise RuntimeError(
                f"another Sparsifier is already attached to this {type(inner).__name__}: both would apply "
                "their pressure after every step; use one Sparsifier, or call detach() on the other first"
            )
        if not self._lr_by_slope(inner) and any(u.slope.requires_grad for _, u in self._units):
            # before any state changes: a warning turned into an error leaves this Sparsifier detached
            self._warn_once(f"attach(): this {type(inner).__name__} holds none of the unit slopes, so the pressure "
                            "runs after a step that does not move them: attach the optimizer that trains the slopes "
                            "(linearize.param_groups(model) puts them in one)")
        self.optimizer = inner
        self._hook = inner.register_step_post_hook(lambda opt, args, kwargs: self.step())
        _ATTACHED[inner] = weakref.ref(self)
        return self

    def __getstate__(self) -> dict:
        # a hook handle belongs to one optimizer object: a copy (deepcopy, pickle) re-attaches to its
        # own copy of the optimizer instead of holding a handle that drives nothing
        state = dict(self.__dict__, _hook=None)
        state["_attached"] = self._hook is not None
        return state

    def __setstate__(self, state: dict) -> None:
        attached = state.pop("_attached", False)
        self.__dict__.update(state)
        other = _ATTACHED.get(self.optimizer) if self.optimizer is not None else None
        other = other() if other is not None else None
        # a shallow copy shares the optimizer, which its original still drives: the copy stays detached
        if attached and self.optimizer is not None and (other is None or other._hook is None):
            self.attach(self.optimizer)

    def detach(self) -> None:
        """Remove the hook installed by :meth:`attach`."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
            ref = _ATTACHED.get(self.optimizer)
            if ref is not None and ref() is self:
                del _ATTACHED[self.optimizer]

    # ------------------------------------------------------------------ schedule
    def ramp_steps(self) -> int:
        """Steps over which the pressure acts: ``end - start`` of a target schedule, else ``total_steps``
        (at least 1). The auto ``rate`` is ``1 / ramp_steps()``."""
        sched, total = self.schedule, self.total_steps
        if isinstance(sched, _schedules.Target):
            return max(1, _schedules.resolve_step(sched.end, total) - _schedules.resolve_step(sched.start, total))
        return total

    def glide_steps(self) -> int:
        """``G``: a selected channel of a target schedule reaches 1 within ``G`` steps (0: instantly)."""
        return math.ceil(self.glide * self.ramp_steps()) if self.glide > 0 else 0

    @property
    def max_step(self) -> float:
        """The most a slope rises in one step of a target schedule: ``1 / G`` (``inf`` with ``glide=0``).

        Example: ``Sparsifier(model, target(0.1, start=0, end=1000), 1000).max_step == 0.01``.
        """
        g = self.glide_steps()
        return 1.0 / g if g > 0 else math.inf

    def lam_at(self, step: int | None = None) -> float:
        """Pressure at ``step`` (default: the next step): ``rate * shape_t`` in slope units per step at
        the peak LR, or the legacy ``lam_t`` (see the module docs)."""
        step = self.step_count if step is None else step
        value = self.schedule(step, self.total_steps)
        if isinstance(self.schedule, _schedules.Schedule) and self.schedule.lam is None:
            value = value * (self.lam if self.legacy else self.rate)
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"the schedule returned lam={value} at step {step}; it must be finite and >= 0")
        return value

    def _lr_by_slope(self, optimizer: torch.optim.Optimizer | None = None) -> dict[int, float]:
        optimizer = optimizer if optimizer is not None else self.optimizer
        if optimizer is None:
            return {}
        slope_ids = {id(u.slope) for _, u in self._units}
        return {
            id(p): float(group["lr"])
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) in slope_ids
        }

    def _project(self) -> None:
        """Clamp all slopes to ``[0, 1]`` and restore frozen channels, in one batched call."""
        project_slopes(u for _, u in self._units)

    def _slope_versions(self) -> list[int]:
        return [u.slope._version for _, u in self._units]

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        """Apply the schedule once: proximal step, target projection, log. Call after optimizer.step().

        Raises :class:`~linearize.unit.NonFiniteSlopeError` naming the units when a slope is NaN or
        inf (the training diverged): nothing is projected or logged then (one device sync per step).
        """
        check_finite_slopes(self._units, f"Sparsifier.step (step {self.step_count})")
        if self._slope_versions() == self._versions and not self._warned:
            warnings.warn(
                "Sparsifier.step() was called but the slopes did not change since the last call: "
                "call it after optimizer.step() (or use sparsifier.attach(optimizer)), and check "
                "that the unit slopes are in the optimizer",
                UserWarning,
                stacklevel=2,
            )
            self._warned = True
        if self.select == "saliency":
            self._observe()
        self._project()
        target = isinstance(self.schedule, _schedules.Target)
        low = next((u.slope.dtype for _, u in self._units if u.slope.dtype in (torch.bfloat16, torch.float16)), None)
        if low is not None and not target and not self.legacy and 0 < self.rate < torch.finfo(low).eps / 4:
            self._warn_once(f"the slopes are {low}: a push of {self.rate:.3g} per step is below half a {low} ulp "
                            f"near 1 ({torch.finfo(low).eps / 4:.3g}) and rounds away, so the pressure does nothing; "
                            "keep the slopes in float32 (for _, u in linearize.units(model): u.slope.data = "
                            "u.slope.data.float(); the units take inputs of any dtype)")
        before = torch.cat([full_value(u.slope.detach()).float() for _, u in self._units]) if target else None
        lam_t = self.lam_at()
        if self.mode == "proximal" and lam_t > 0 and self.select == "slope":
            self._proximal(lam_t)
        wanted = None
        if target:
            start = _schedules.resolve_step(self.schedule.start, self.total_steps)
            if self.initial_fraction is None and self.step_count >= start:
                if self._model is not None:  # a cost target: plan which groups go linear, from the cost now
                    self._make_plan(before)
                    self.initial_fraction = self._plan_costs[0]
                else:
                    self.initial_fraction = self._fraction("Sparsifier target start")
            if self.initial_fraction is not None and self.select == "saliency" and not self._had_grad:
                self._warn_once("select='saliency' has seen no slope gradient since the start of the run: call "
                                "sparsifier.step() after optimizer.step() and before zero_grad() (attach(optimizer) "
                                "does), with the slopes trainable; until then channels are chosen by slope")
            if self.initial_fraction is not None:
                wanted = self.schedule.wanted(self.step_count, self.total_steps, self.initial_fraction)
                ahead = self.schedule.wanted(self.step_count + self.glide_steps(), self.total_steps,
                                             self.initial_fraction)
                self._project_budget(ahead, before)
                if self._model is None and (self.step_count == start or self.step_count % self.log_every == 0):
                    self._check_reachable()
        self.step_count += 1
        if self.step_count % self.log_every == 0 or self.step_count == 1:
            self._record(lam_t, wanted)
        self._versions = self._slope_versions()

    def _observe(self) -> None:
        """Fold this step's slope gradients into the running saliency. Units without a gradient
        this step (unused, frozen) keep theirs; a step with a NaN/inf gradient anywhere (one a loss
        scaler skipped), or with all gradients exactly 0 (zeroed already), is left out."""
        grads = [None if u.slope.grad is None else full_value(u.slope.grad) for _, u in self._units]
        self._had_grad |= any(g is not None for g in grads)
        if any(g is not None and not torch.isfinite(g).all() for g in grads):
            return
        if all(g is None or not g.any() for g in grads):  # zeroed already, or a loss at its minimum: no news
            return
        for grad, part, seen in zip(grads, self._per_unit(self._saliency), self._per_unit(self._seen)):
            if grad is not None:
                part.mul_(SALIENCY_DECAY).add_(grad.detach().double().cpu().square(), alpha=1 - SALIENCY_DECAY)
                seen.fill_(True)

    def _check_reachable(self) -> None:
        """Warn (once) when channels frozen nonlinear (slope 0) keep a fraction target out of reach."""
        total = sum(u.num_channels for _, u in self._units)
        frozen = sum(int((u.frozen == 0).sum()) for _, u in self._units)
        if frozen / total > self.schedule.fraction + 0.5 / total:
            self._warn_once(f"target fraction {self.schedule.fraction} cannot be reached: {frozen} of {total} channels "
                            f"are frozen nonlinear (slope 0), a floor of {frozen / total:.4f}; unfreeze them "
                            "(unit.frozen.fill_(float('nan'))) or set a target at or above the floor")

    def _warn_once(self, message: str) -> None:
        if message not in self._said:
            warnings.warn(message, UserWarning, stacklevel=3)
            self._said.add(message)  # after: a warning turned into an error is raised again next time

    def _cost(self, selected: torch.Tensor) -> torch.Tensor:
        """Ranking cost per channel (``select="saliency"``): saliency per unit of weight, halved for
        the selected, ``inf`` for a channel never seen with a gradient."""
        weights = torch.cat([torch.full((u.num_channels,), float(w), dtype=torch.float64)
                             for (_, u), w in zip(self._units, self._weights)])
        cost = torch.where(weights > 0, self._saliency / weights, torch.tensor(math.inf, dtype=torch.float64))
        cost = torch.where(selected.cpu(), cost * SALIENCY_HYSTERESIS, cost)
        return torch.where(self._seen, cost, torch.tensor(math.inf, dtype=torch.float64))

    def saliency(self) -> dict[str, torch.Tensor]:
        """Per unit, the running mean of each channel's squared slope gradient (``select="saliency"``)."""
        return {name: part.clone() for (name, _), part in zip(self._units, self._per_unit(self._saliency))}

    def _per_unit(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``flat`` (one entry per channel, units in order) split into one view per unit."""
        return torch.split(flat, [u.num_channels for _, u in self._units])

    def _proximal(self, lam_t: float) -> None:
        lrs = self._lr_by_slope()
        steps = []
        for i, ((name, unit), w) in enumerate(zip(self._units, self._weights)):
            lr = lrs.get(id(unit.slope), self.lr)
            if self.legacy:
                if lr is None:
                    raise ValueError(
                        f"no learning rate for the slopes of {name!r}: attach(optimizer) with the slopes "
                        "in it, pass optimizer=..., or pass lr=... to the Sparsifier (legacy lam only)"
                    )
                steps.append(lr * lam_t * w)
                continue
            scale = 1.0
            if lr is not None and lr > 0:  # follow the LR schedule's shape, not its scale
                peak = self._lr_peak[i] = max(lr, self._lr_peak[i] or 0.0)
                scale = lr / peak
            steps.append(lam_t * scale * w)
        if self.granularity == "channel":
            for (_, unit), step in zip(self._units, steps):
                unit.slope.add_(step)
        else:
            for group in self._groups:
                self._push_group([self._units[i][1] for i in group], [steps[i] for i in group])
        self._project()

    @staticmethod
    def _push_group(members: list[LinearizableActivation], steps: list[float]) -> None:
        """The group proximal step of ``||1 - a||_2`` over the free channels of ``members`` (one site,
        or a block's sites), scaled by ``sqrt(C)``: a group whose channels sit at the same slope moves
        by the channel-weighted mean of ``steps`` and reaches 1 all at once."""
        slopes = [full_value(u.slope.detach()) for u in members]  # FSDP2: the global slopes
        frees = [torch.isnan(u.frozen).to(a.device) for u, a in zip(members, slopes)]
        gaps = [(1.0 - a.double()) * free for a, free in zip(slopes, frees)]
        counts = [int(free.sum()) for free in frees]
        n = sum(counts)
        norm = math.sqrt(sum(float(gap.square().sum()) for gap in gaps))
        if n == 0 or norm == 0:
            return
        step = sum(s * c for s, c in zip(steps, counts)) / n
        shrink = max(0.0, 1.0 - step * math.sqrt(n) / norm)
        for unit, a, free, gap in zip(members, slopes, frees, gaps):
            write_full(unit.slope, torch.where(free, 1.0 - gap * shrink, a.double()).to(a.dtype))

    def _project_budget(self, wanted: float, before: torch.Tensor) -> None:
        """Glide the selected channels to 1 so that ``round(wanted * C)`` stay nonlinear, or for a cost
        target the groups of the shortest plan prefix whose folded cost is within ``wanted`` (module docs).

        ``wanted``: the path's value ``G`` steps ahead; ``before``: the slopes before the
        proximal step (a slope rises by at most :attr:`max_step` from there).
        """
        slopes = torch.cat([full_value(u.slope.detach()).float() for _, u in self._units])
        frozen = torch.cat([u.frozen for _, u in self._units]).to(slopes.device)
        before = before.to(slopes.device)
        free = torch.isnan(frozen)
        total = slopes.numel()
        k = total - int(round(wanted * total))  # linear channels wanted
        k_free = min(max(k - int((frozen == 1).sum()), 0), int(free.sum()))
        linear = torch.cat(self._linear_masks()).to(slopes.device)
        selected = (self._selected.to(slopes.device) if self._selected is not None else linear) & free
        # rank free channels (stable sorts, the last key first): "slope": selected first (hysteresis),
        # then "linear now", then by slope; "saliency": linear now first, then the cheapest, then by slope
        ranked = torch.nonzero(free).squeeze(1)
        if self._plan is not None:  # a cost target: the shortest plan prefix within the wanted cost
            k = next(k for k, c in enumerate(self._plan_costs) if c <= wanted or k == len(self._plan))
            groups = torch.tensor(self._start_groups() + self._plan[:k], dtype=torch.long)
            held = torch.isin(self._channel_group.to(slopes.device), groups.to(slopes.device))
            if bool((held & (frozen == 0)).any()):  # frozen nonlinear since the plan was made: never linear now
                stuck = [self._units[i][0] for g in groups.tolist() for i in self._groups[g]
                         if bool((self._units[i][1].frozen == 0).any())]
                self._warn_once(
                    f"cost target: sites {stuck} of the plan were frozen nonlinear after it was made, so the folded "
                    f"model cannot reach {self.schedule.cost}={self.schedule.goal}: unfreeze them (unit.unfreeze_()), "
                    "or start the target again (a new Sparsifier plans around frozen channels)")
            mine = held[ranked]
            ranked = torch.cat([ranked[mine], ranked[~mine]])
            k_free, keys = int(mine.sum()), ()
        elif self.select == "slope":
            keys = (linear, slopes, selected)
        else:
            end = _schedules.resolve_step(self.schedule.end, self.total_steps)
            if self._selected is not None and self.step_count >= end:  # reached: hold the selection
                keys = (slopes, selected)
            else:
                keys = (slopes, -self._cost(selected).to(slopes.device))
        for key in keys:
            ranked = ranked[torch.sort(key[ranked].double(), descending=True, stable=True).indices]
        if self.granularity != "channel" and self._plan is None:
            ranked, k_free = self._by_group(ranked, k_free)
        chosen, beyond = ranked[:k_free], ranked[k_free:]
        delta = self.max_step
        new = torch.minimum(slopes, before + delta)  # the proximal step's share of the cap
        new[chosen] = torch.clamp(before[chosen] + delta, max=1.0)  # exactly 1 once within delta of 1
        end = _schedules.resolve_step(self.schedule.end, self.total_steps)
        at_target = self.step_count >= end - 1
        if at_target:  # the path is at the target: a chosen channel the loss pulled down
            new[chosen] = 1.0  # harder than the glide arrives now (held exactly)
        new[beyond] = torch.minimum(new[beyond], torch.tensor(1.0 - self.release))
        if self._plan is not None:  # outside the plan: glide to 0, the original activation (module docs)
            planned = torch.tensor(sorted(self._plan_start.union(self._plan)), dtype=torch.long)
            outside = free & ~torch.isin(self._channel_group.to(slopes.device), planned.to(slopes.device))
            new[outside] = 0.0 if at_target else torch.clamp(before[outside] - delta, min=0.0)
        for (_, unit), part in zip(self._units, self._per_unit(new)):
            write_full(unit.slope, part.to(unit.slope.dtype))
        self._project()
        self._selected = torch.zeros(total, dtype=torch.bool)
        self._selected[chosen.cpu()] = True

    def _by_group(self, ranked: torch.Tensor, k_free: int) -> tuple[torch.Tensor, int]:
        """Reorder the ranked free channels group by group (a site, or a block's sites; a group's
        place: the mean rank of its free channels) and round ``k_free`` up to whole groups."""
        site = self._channel_group.to(ranked.device)[ranked]
        position = torch.arange(len(ranked), dtype=torch.float64, device=ranked.device)
        count = torch.bincount(site, minlength=len(self._groups)).double()
        score = torch.bincount(site, weights=position, minlength=len(self._groups)) / count.clamp_min(1)
        order = [i for i in torch.argsort(score, stable=True).tolist() if count[i] > 0]
        groups = [ranked[site == i] for i in order]
        n = 0
        for group in groups:
            if n >= k_free:
                break
            n += len(group)
        return (torch.cat(groups) if groups else ranked), n

    # ------------------------------------------------------------------ cost target
    def _group_frozen(self) -> tuple[list[bool], list[bool]]:
        """Per group: all its channels frozen linear; any channel frozen nonlinear (never linear)."""
        frozen = torch.cat([u.frozen.cpu() for _, u in self._units])
        always = [bool((frozen[self._channel_group == g] == 1).all()) for g in range(len(self._groups))]
        never = [bool((frozen[self._channel_group == g] == 0).any()) for g in range(len(self._groups))]
        return always, never

    def _start_groups(self) -> list[int]:
        """Groups linear when the plan was made (kept linear), and those frozen linear."""
        return sorted(self._plan_start)

    def _folded_cost(self, linear: frozenset | None) -> float:
        """Cost of the model folded (:func:`linearize.fold`) with the groups ``linear`` exactly linear and
        every other channel at slope 0, its original activation (frozen channels keep their value), as a
        fraction of the original model folded (``linear=None``: every slope 0, frozen ones too; its
        absolute cost is :attr:`_reference`): FLOPs counted by fold's counter, or median CPU latencies,
        each measured interleaved with the original's (:func:`~linearize.timing.median_latency_ms`), so
        a load that comes and goes during planning changes both alike. Cached per set. Always on a
        float32 CPU copy: the model may have moved since (``accelerator.prepare``, ``.to("cuda")``,
        ``.half()``), and every cost of the plan must be measured alike."""
        if linear not in self._costs:  # the original (None, and the empty set without frozen channels): _check_budget
            folded = self._fold_copy(linear)
            if self.schedule.cost == "flops":
                self._costs[linear] = float(folded.linearize_fold_summary.flops_after) / self._reference
            else:
                self._costs[linear] = self._latency_ratio(folded, LATENCY_BUDGET_S)
        return self._costs[linear]

    def _latency_ratio(self, folded: nn.Module, budget_s: float) -> float:
        """``folded``'s median CPU latency over the original's, timed interleaved for ``budget_s`` seconds."""
        ref, ms = median_latency_ms([self._original, folded], self._cost_inputs, budget_s)
        return ms / ref

    def _fold_copy(self, linear: frozenset | None) -> nn.Module:
        """A float32 CPU copy of the model folded with the groups ``linear`` at slope 1, every other channel
        at 0 (frozen ones keep their value; ``None``: all at 0, unfrozen). Not verified: this measures the
        folded structure; a float32 model whose own rounding exceeds fold's 1e-4 (badly conditioned
        BatchNorm) must not stop planning."""
        probe = copy.deepcopy(self._model).eval().cpu().float()
        units_ = require_units(probe)
        on = {i for g in linear or () for i in self._groups[g]}
        with torch.no_grad():
            for i, (_, unit) in enumerate(units_):
                unit.slope.fill_(1.0 if i in on else 0.0)
                if linear is None:
                    unit.unfreeze_()
        project_slopes(u for _, u in units_)
        return fold(probe, self._cost_inputs, latency=False, verify=False)

    def _check_budget(self) -> None:
        """Measure the original model's cost and refuse a goal below the fully linear cost (again at the
        plan's start if channels were frozen since: the cached costs and the floor depend on them)."""
        self._costs.clear()
        self._frozen_measured = self._frozen_now()
        _, never = self._group_frozen()
        self._original = self._fold_copy(None)
        self._reference = (float(self._original.linearize_fold_summary.flops_after) if self.schedule.cost == "flops"
                           else median_latency_ms([self._original], self._cost_inputs, LATENCY_BUDGET_S)[0])
        self._costs[None] = 1.0
        if not any(u.has_frozen() for _, u in self._units):
            self._costs[frozenset()] = 1.0  # the same model: one measure (a second would differ by its noise)
        every = frozenset(g for g in range(len(self._groups)) if not never[g])
        floor = self._folded_cost(every)
        cost, goal = self.schedule.cost, self.schedule.goal
        if goal < floor and cost == "latency":  # a time is noisy: time it again, longer, and warn, not refuse
            floor = self._costs[every] = self._latency_ratio(self._fold_copy(every), LATENCY_CONFIRM_S)
            busy = busy_cpu()
            if goal < floor:
                self._warn_once(
                    f"target(latency={goal}) is below the time of this model folded with every site linear "
                    f"({floor:.4f} of the original, timed twice{', on a busy CPU: ' + busy if busy else ''}), so the "
                    f"plan will make every site it can linear and may still miss it: pass latency= of at least "
                    f"{math.ceil(floor * 1e4) / 1e4:.4f}, or plan on a quieter machine")
        elif goal < floor:
            raise ValueError(f"target({cost}={goal}) is below the cost of this model folded with every site linear "
                             f"({floor:.4f} of the original model folded; sites frozen nonlinear stay so): pass {cost}= "
                             f"of at least {math.ceil(floor * 1e4) / 1e4:.4f}")

    def _frozen_now(self) -> torch.Tensor:
        """Every channel's frozen value, free ones as -1 (NaN would never compare equal)."""
        return torch.cat([u.frozen.detach().cpu() for _, u in self._units]).nan_to_num(nan=-1.0)

    def _importance(self, before: torch.Tensor) -> list[float]:
        """What making each group linear costs the model: ``select="slope"``: the slope gap
        ``sum (1 - a)`` of its free channels (the loss held them down); ``select="saliency"``: the sum of
        their running squared slope gradients, when every group has had a gradient (else the slope gap)."""
        free = torch.cat([torch.isnan(u.frozen).cpu() for _, u in self._units])
        value = (1.0 - before.double().cpu()) * free
        if self.select == "saliency" and bool(self._seen[free].all()):
            value = self._saliency * free
        elif self.select == "saliency":
            unseen = [name for (name, _), part in zip(self._units, self._per_unit(free & ~self._seen)) if part.any()]
            self._warn_once(f"select='saliency': the slopes of {len(unseen)} site(s) had no gradient before the cost "
                            f"plan was made ({', '.join(unseen[:5])}{', ...' if len(unseen) > 5 else ''}), so every "
                            "group is ranked by slope gap instead: put those slopes in the optimizer (with "
                            "requires_grad) and start the target after some steps, e.g. start=0.05")
        return torch.zeros(len(self._groups), dtype=torch.float64).index_add_(0, self._channel_group, value).tolist()

    def _make_plan(self, before: torch.Tensor) -> None:
        """Choose the groups a cost target makes linear and the order they go (see the module docs).

        Modified greedy for the covering knapsack "least importance lost with cost <= budget": add
        groups by importance per unit of *marginal* saving (each saving from a real fold); whenever
        one group alone would reach the budget, record that completion as a candidate instead of
        adding it; keep the least important candidate, then drop every group it can do without.
        """
        busy = busy_cpu() if self.schedule.cost == "latency" else None
        if busy:
            self._warn_once(f"latency target: the CPU is busy while the plan times folded models ({busy}), so their "
                            "times are noisy, up to 2x either way, and the plan may miss the budget: plan on a quieter "
                            "machine (start the target when other jobs are done), or target flops= instead")
        if not torch.equal(self._frozen_now(), self._frozen_measured):
            self._check_budget()
        always, never = self._group_frozen()
        linear_before = before.cpu() == 1  # linear before this step's push: kept
        start = {g for g in range(len(self._groups))
                 if always[g] or bool(linear_before[self._channel_group == g].all())}
        self._plan_start = start
        importance = self._importance(before)
        budget = self.schedule.goal
        rest = [g for g in range(len(self._groups)) if g not in start and not never[g]]
        ranked = before.cpu()[torch.isin(self._channel_group, torch.tensor(rest, dtype=torch.long))]
        if self.select == "slope" and len(rest) > 1 and float(ranked.max() - ranked.min()) < SLOPE_SPREAD:
            self._warn_once(
                f"the cost target plans by slope gap sum(1 - a), and every slope it can choose from lies in "
                f"[{ranked.min().item():.3g}, {ranked.max().item():.3g}]: the groups are ranked by channel count alone, "
                "which says nothing about what each costs the model "
                "(on a trained CIFAR MobileNet-V2, channel count ranked the blocks against the accuracy each costs). "
                "Pass select='saliency' (--select saliency) and start the target after some steps (e.g. start=0.05) "
                "so that each group is ranked by its loss gradients")
        timed: dict[frozenset, float] = {}  # latency: the sets timed again, on their own
        bias = 1.0  # planning time over time again, of the sets refused so far (the mildest, once two are)
        tried: list[tuple[list[int], list[float]]] = []

        def cost(groups: set[int]) -> float:  # timed again if it was, else as planned, corrected for the bias
            key = frozenset(groups)
            return timed[key] if key in timed else self._folded_cost(key) / bias

        for _ in range(2 * len(rest) + 2):  # latency: plan again until its last set, timed again, is within budget
            plan, costs = self._greedy(start, list(rest), importance, budget, cost)
            linear = frozenset(start | set(plan))
            if self.schedule.cost != "latency" or not plan or linear in timed:
                break  # (no group chosen: nothing was picked among noisy times)
            timed[linear] = costs[-1] = self._latency_ratio(self._fold_copy(linear), LATENCY_CONFIRM_S)
            tried.append((plan, costs))
            if costs[-1] <= budget:
                break
            if len(timed) >= 2:  # a steady low reading (load): correct every planning time; one glitch alone does not
                bias = min(1.0, max(self._folded_cost(key) / t for key, t in timed.items()))
        if tried and costs[-1] > budget:
            plan, costs = min(tried, key=lambda t: t[1][-1])
            self._warn_once(f"latency target {budget}: no plan tried met it when timed again (the closest costs "
                            f"{costs[-1]:.3f} of the original): set a higher budget, or plan with less load on the "
                            "CPU (latencies are noisy under load)")
        self._plan, self._plan_costs = plan, costs

    def _greedy(self, start: set[int], rest: list[int], importance: list[float], budget: float,
                cost: Callable[[set[int]], float]) -> tuple[list[int], list[float]]:
        """The plan (groups of ``rest`` in order) and the cost of each of its prefixes (after ``start``),
        by ``cost`` of a set of linear groups (see :meth:`_make_plan`)."""
        taken: list[int] = []
        best: tuple[float, list[int]] | None = (0.0, []) if cost(start) <= budget else None
        while best is None or best[1]:  # (while the best plan needs a group at all)
            now = cost(start | set(taken))
            after = {g: cost(start | set(taken) | {g}) for g in rest}
            lost = sum(importance[g] for g in taken)
            for g in rest:
                if after[g] <= budget and (best is None or lost + importance[g] < best[0]):
                    best = (lost + importance[g], taken + [g])
            grow = [g for g in rest if after[g] > budget and after[g] < now]
            if not grow:
                break
            g = min(grow, key=lambda g: (importance[g] / (now - after[g]), g))
            taken.append(g)
            rest.remove(g)
        plan = best[1] if best is not None else taken + rest  # rest: every group (>= the floor, checked)
        for g in sorted(plan, key=lambda g: -importance[g]):  # drop what the budget does not need
            if cost(start | set(plan) - {g}) <= budget:
                plan.remove(g)
        costs = [cost(start | set(plan[:k])) for k in range(len(plan) + 1)]
        # measured costs need not be monotone (timing noise, merges that need two sites): the path holds the
        # shortest prefix within the budget, so the plan ends there and no group is left waiting beyond it
        k = next((k for k, c in enumerate(costs) if c <= budget), len(plan))
        return plan[:k], costs[:k + 1]

    @property
    def cost_plan(self) -> list[dict] | None:
        """A cost target's plan (``None`` before its start): for each prefix, the groups linear (their
        site names) and the folded cost (every other free channel at slope 0, its original activation) as a
        fraction of the original model folded.

        Example: ``sp.cost_plan[-1]["cost"] <= 0.6`` for ``target(flops=0.6)``.
        """
        if self._plan is None:
            return None
        names = [n for n, _ in self._units]
        sites = lambda groups: [names[i] for g in groups for i in self._groups[g]]  # noqa: E731
        return [{"sites": sites(self._start_groups() + self._plan[:k]), "cost": c}
                for k, c in enumerate(self._plan_costs)]

    # ------------------------------------------------------------------ penalty and measures
    def penalty(self) -> torch.Tensor:
        """Differentiable ``lam_t * sum_c w_c * (1 - a_c)`` over free channels (scalar tensor); with
        ``granularity="site"`` / ``"block"`` the group lasso ``lam_t * sum_groups w * sqrt(C) * ||1 - a||_2``
        (``w``: the channel-weighted mean weight of the group's sites).

        For ``mode="loss"``: add it to the loss before ``backward()``. See the module docs for
        how it differs from the proximal step.
        """
        lam_t = self.lam_at()
        gaps = [(1.0 - full_value(unit.slope)) * torch.isnan(unit.frozen) for _, unit in self._units]
        if self.granularity == "channel":
            return lam_t * torch.stack([w * gap.sum() for gap, w in zip(gaps, self._weights)]).sum()
        terms = []
        for group in self._groups:  # group lasso: w * sqrt(C) * ||1 - a||_2, w the channel-weighted mean
            counts = [int(torch.isnan(self._units[i][1].frozen).sum()) for i in group]
            n = max(sum(counts), 1)
            w = sum(self._weights[i] * c for i, c in zip(group, counts)) / n
            # vector_norm's gradient at 0 is 0 (a linear or frozen group), sqrt(sum of squares)'s is NaN
            norm = torch.linalg.vector_norm(torch.cat([gaps[i].reshape(-1) for i in group]))
            terms.append(w * math.sqrt(sum(counts)) * norm)
        return lam_t * torch.stack(terms).sum()

    def _linear_masks(self, where: str = "Sparsifier target projection") -> list[torch.Tensor]:
        """Linear channels (slope exactly 1) of every unit, by :func:`linearize.unit.linear_masks` with ``tol=0``."""
        return linear_masks(self._units, 0.0, where)

    def _counts(self, where: str) -> dict:
        return count_channels(self._units, 0.0, where)

    def _fraction(self, where: str = "Sparsifier.nonlinear_fraction") -> float:
        counts = self._counts(where)
        return counts["nonlinear"] / counts["total"]

    def nonlinear_fraction(self) -> float:
        """Fraction of channels with slope < 1 (now); the same as ``linearize.nonlinear_fraction(model)``.

        Raises :class:`~linearize.unit.NonFiniteSlopeError` on NaN/inf slopes.
        """
        return self._fraction()

    def linear_units(self) -> int:
        """Number of channels with slope exactly 1 (now)."""
        return self._counts("Sparsifier.linear_units")["linear"]

    def _record(self, lam_t: float, wanted: float | None) -> None:
        counts = self._counts("Sparsifier history")
        self.history.append(
            {
                "step": self.step_count,
                "lam": lam_t,
                "nonlinear_fraction": counts["nonlinear"] / counts["total"],
                "wanted": wanted,
                "sites": {name: site["fraction"] for name, site in counts["sites"].items()},
            }
        )

    def save_history(self, path: str | Path) -> Path:
        """Write the per-site nonlinear fraction log as JSON ``{"sites", "total_steps", "history"}``
        (atomically: an interrupted write leaves the previous file)."""
        from ._files import atomic_write

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "sites": [n for n, _ in self._units],
            "total_steps": self.total_steps,
            "schedule": (
                self.schedule.to_dict() if isinstance(self.schedule, _schedules.Schedule) else repr(self.schedule)
            ),
            "history": self.history,
        }
        return atomic_write(path, json.dumps(payload))

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """JSON-serializable state (works with ``accelerator.register_for_checkpointing``)."""
        return {
            "step_count": self.step_count,
            "initial_fraction": self.initial_fraction,
            "selected": None if self._selected is None else torch.nonzero(self._selected).squeeze(1).tolist(),
            "channels": sum(u.num_channels for _, u in self._units),
            "lam": self.lam,
            "rate": self.rate,
            "lr_peak": list(self._lr_peak),
            "history": list(self.history),
            "select": self.select,
            "granularity": self.granularity,
            "saliency": self._saliency.tolist() if self.select == "saliency" else None,
            "seen": torch.nonzero(self._seen).squeeze(1).tolist() if self.select == "saliency" else None,
            "groups": len(self._groups),
            "cost": self.schedule.cost if self._model is not None else None,
            "cost_reference": self._reference,
            "cost_reference_of": "original",  # older states measured against the model at slopes 0.5
            "plan": self._plan,
            "plan_start": sorted(self._plan_start),
            "plan_costs": self._plan_costs,
            "weights": list(self._weights),  # measured ones (weights="latency") would differ on a new measure
            "sites": [[name, u.num_channels] for name, u in self._units],
            "total_steps": self.total_steps,
            "schedule": self.schedule.to_dict() if isinstance(self.schedule, _schedules.Schedule) else None,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` (slopes themselves live in the model's state dict). Everything
        is checked before anything changes."""
        channels = sum(u.num_channels for _, u in self._units)
        self._check_state_values(state, channels)
        if state["channels"] != channels:
            raise ValueError(f"state is for {state['channels']} channels, this model has {channels}")
        if state.get("granularity", "channel") != self.granularity:
            raise ValueError(f"state was saved with granularity={state.get('granularity', 'channel')!r}, this "
                             f"Sparsifier has granularity={self.granularity!r}: build it with the same one to resume")
        if state.get("select", "slope") != self.select:
            raise ValueError(f"state was saved with select={state.get('select', 'slope')!r}, this Sparsifier "
                             f"has select={self.select!r}: build it with the same select to resume")
        if state.get("groups", len(self._groups)) != len(self._groups):
            raise ValueError(f"state has {state['groups']} groups of sites, this Sparsifier has {len(self._groups)}: "
                             "build it with the same granularity and blocks to resume")
        cost = self.schedule.cost if self._model is not None else None
        if state.get("cost") != cost:
            raise ValueError(f"state was saved with a cost target of {state.get('cost')!r}, this Sparsifier has "
                             f"{cost!r} (target(flops=/latency=)): build it with the same schedule to resume")
        if state.get("cost_reference") is not None and state.get("cost_reference_of") != "original":
            raise ValueError("state's cost target was measured against the model folded at slopes 0.5 (saved by an "
                             "older linearize), this one against the original model: restart the cost target")
        weights = state.get("weights")
        if weights is not None and not finite_nonnegative(weights, len(self._units)):
            raise ValueError(f"state's weights must be {len(self._units)} finite numbers >= 0, one per unit")
        self._check_plan(state)
        mine = self.schedule.to_dict() if isinstance(self.schedule, _schedules.Schedule) else None
        if state.get("schedule") is not None and mine is not None and state["schedule"] != mine:
            raise ValueError(f"state was saved with the schedule {state['schedule']!r:.200}, this Sparsifier has "
                             f"{mine!r:.200}: build it with the same schedule to resume")
        saliency, seen = self._saliency, self._seen
        if state.get("saliency") is not None:
            saliency = torch.tensor(state["saliency"], dtype=torch.float64)
            if saliency.shape != self._saliency.shape or not torch.isfinite(saliency).all() or (saliency < 0).any():
                raise ValueError(f"state's saliency must be {channels} finite values >= 0")
            seen = torch.zeros(channels, dtype=torch.bool)
            seen[torch.tensor(state.get("seen") or [], dtype=torch.long)] = True
        self.step_count = int(state["step_count"])
        self.initial_fraction = state["initial_fraction"]
        self._selected = None
        selected = state.get("selected", state.get("linear"))  # "linear": states saved before the glide
        if selected is not None:
            self._selected = torch.zeros(channels, dtype=torch.bool)
            self._selected[torch.tensor(selected, dtype=torch.long)] = True
        self.lam = None if state["lam"] is None else float(state["lam"])
        self.rate = float(state.get("rate", self.rate))
        peaks = state.get("lr_peak")
        self._lr_peak = list(peaks) if peaks is not None else [None] * len(self._units)
        self.history = list(state["history"])
        self._saliency, self._seen = saliency, seen
        if state.get("cost_reference") is not None:  # measured before: latency would differ on a new measure
            self._reference = float(state["cost_reference"])
        self._plan = None if state.get("plan") is None else [int(g) for g in state["plan"]]
        self._plan_start = {int(g) for g in state.get("plan_start") or []}
        self._plan_costs = None if state.get("plan_costs") is None else [float(c) for c in state["plan_costs"]]
        if weights is not None:
            self._weights = [float(w) for w in weights]
        self._versions = [-1] * len(self._units)  # the model was loaded: do not warn on the next step

    def _check_state_values(self, state: Mapping, channels: int) -> None:
        """``ValueError`` naming the key for a state that is not a :meth:`state_dict` of this run: missing
        keys, values of the wrong type or range, other sites (names, widths) or run length (the schedule is
        compared last, after the more specific checks of :meth:`load_state_dict`)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping (Sparsifier.state_dict()), got {type(state).__name__}")
        missing = [k for k in ("channels", "step_count", "initial_fraction", "lam", "history") if k not in state]
        if missing:
            raise ValueError(f"state lacks {missing}: not a Sparsifier.state_dict()")

        def bad(key: str, what: str) -> ValueError:
            return ValueError(f"state's {key} must be {what}, got {state[key]!r:.80}")

        def count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        def fraction(v: object) -> bool:
            return is_real(v) and 0 <= v <= 1

        if not count(state["step_count"]):
            raise bad("step_count", "an int >= 0")
        # a cost target's is the folded cost at its start: above 1 where a site frozen partly linear costs more
        start = state["initial_fraction"]
        if start is not None and not (fraction(start) or state.get("cost") and finite_nonnegative([start], 1)):
            raise bad("initial_fraction", "null or a number in [0, 1] (a cost target's: a finite number >= 0)")
        if state["lam"] is not None and not (is_real(state["lam"]) and math.isfinite(state["lam"])):
            raise bad("lam", "null or a finite number")
        if "rate" in state and not (is_real(state["rate"]) and 0 <= state["rate"] < math.inf):
            raise bad("rate", "a finite number >= 0")
        if not (isinstance(state["history"], list) and all(isinstance(h, dict) for h in state["history"])):
            raise bad("history", "a list of records (mappings)")
        for key in ("selected", "seen"):
            ids = state.get(key)
            if ids is not None and not (isinstance(ids, list) and all(count(i) and i < channels for i in ids)
                                        and len(set(ids)) == len(ids)):
                raise bad(key, f"null or distinct channel indices in [0, {channels})")
        peaks = state.get("lr_peak")
        if peaks is not None and not (isinstance(peaks, list) and len(peaks) == len(self._units) and all(
                p is None or (is_real(p) and 0 < p < math.inf) for p in peaks)):
            raise bad("lr_peak", f"null or {len(self._units)} entries, each null or a finite number > 0")
        sites = [[name, u.num_channels] for name, u in self._units]
        if state.get("sites") is not None and state["sites"] != sites:
            theirs = state["sites"] if isinstance(state["sites"], list) else []
            diff = next((f"{a} there, {b} here" for a, b in zip(theirs, sites) if a != b),
                        f"{len(theirs)} sites there, {len(sites)} here")
            raise ValueError(f"state is for other sites ({diff}): it belongs to another model")
        if state.get("total_steps") is not None and state["total_steps"] != self.total_steps:
            raise ValueError(f"state was saved in a run of total_steps={state['total_steps']!r}, this Sparsifier has "
                             f"{self.total_steps}: its schedule would jump; build it with the same total_steps")

    def _check_plan(self, state: Mapping) -> None:
        """A cost target's plan in ``state``: distinct groups of this Sparsifier, one cost per plan prefix."""
        groups = range(len(self._groups))

        def group_ids(key: str) -> list:
            ids = state.get(key) or []
            if not isinstance(ids, list) or not all(isinstance(g, int) and not isinstance(g, bool) and g in groups
                                                    for g in ids) or len(set(ids)) != len(ids):
                raise ValueError(f"state's {key} must list distinct group indices in [0, {len(self._groups)})")
            return ids

        plan, _ = group_ids("plan"), group_ids("plan_start")
        costs = state.get("plan_costs")
        if state.get("plan") is None:
            if costs is not None:
                raise ValueError("state has plan_costs but no plan")
            return
        if not finite_nonnegative(costs, len(plan) + 1):
            raise ValueError(f"state's plan_costs must be {len(plan) + 1} finite costs >= 0 (one per prefix of the plan)")


def site_groups(model: nn.Module, blocks: Sequence[str] | None = None) -> dict[str, list[str]]:
    """The sites (unit names) of each residual block: ``{block_name: [unit names]}``, in unit order.

    A site belongs to its innermost ancestor module that is a block: one named in ``blocks``, or
    with ``blocks=None`` an instance of a residual block class fold knows
    (:func:`~linearize.folding.blocks.residual_block_types`: torchvision ``BasicBlock``,
    ``Bottleneck``, ``InvertedResidual``, timm's). A site outside every block is a group of its own,
    keyed by its own name. Fold merges a block's body only when all its inner sites are linear, so
    ``Sparsifier(granularity="block")`` makes them linear together.

    Raises:
        TypeError: ``blocks`` is a string (it would be read as one name per character) or holds
            something other than strings.
        ValueError: ``blocks`` names a module the model does not have, or ``blocks=None`` and the
            model has no block of a known class (pass ``blocks=[...]``).

    Example:
        >>> net = linearize.convert(torchvision.models.resnet18(), example_inputs=torch.randn(1, 3, 32, 32))
        >>> site_groups(net)["layer1.0"]
        ['layer1.0.relu.calls.0', 'layer1.0.relu.calls.1']
    """
    modules = dict(model.named_modules())
    if blocks is not None:
        if isinstance(blocks, (str, bytes)):
            raise TypeError(f"blocks must be a list of module names, got the string {blocks!r} (read as one name "
                            f"per character): pass blocks=[{blocks!r}]")
        blocks = list(blocks)
        odd = [b for b in blocks if not isinstance(b, str)]
        if odd:
            raise TypeError(f"blocks must hold module names (strings from model.named_modules()), got "
                            f"{type(odd[0]).__name__} {odd[0]!r}")
        unknown = [b for b in blocks if b not in modules]
        if unknown:
            raise ValueError(f"blocks names modules the model does not have: {unknown[:5]}; pass module names "
                             f"from model.named_modules(), e.g. {[n for n in modules if n][:3]}")
    kinds = residual_block_types()

    def is_block(name: str) -> bool:
        return name in blocks if blocks is not None else bool(kinds) and isinstance(modules[name], kinds)

    groups: dict[str, list[str]] = {}
    found = False
    for name, _ in require_units(model):
        parts = name.split(".")
        owner = next((p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)) if is_block(p)), None)
        found |= owner is not None
        groups.setdefault(name if owner is None else owner, []).append(name)
    if not found:
        raise ValueError("granularity='block' found no residual block around any site (known classes: torchvision "
                         "and timm BasicBlock, Bottleneck, InvertedResidual, ...): pass blocks=[module names]")
    return groups


def _neighbour_layers(model: nn.Module, example_inputs) -> tuple[dict[str, tuple], list[tuple]]:
    """For each unit, the indices of the linear layer calls just before and just after its first
    call (``None`` where there is none), and the layer calls ``(module, args, out)`` in execution order."""
    events: list[tuple[str, object]] = []
    calls: list[tuple] = []
    hooks = []
    names = {id(u): n for n, u in require_units(model)}

    def layer_hook(module, args, out):
        if isinstance(out, torch.Tensor):
            events.append(("layer", len(calls)))
            calls.append((module, args, out))

    def unit_hook(module, args, out):
        events.append(("unit", names[id(module)]))

    for module in model.modules():
        if isinstance(module, (nn.Linear, *CONVS)) or is_hf_conv1d(module):
            hooks.append(module.register_forward_hook(layer_hook))
        elif id(module) in names:
            hooks.append(module.register_forward_hook(unit_hook))
    try:
        with torch.no_grad():
            call_model(model, example_inputs)
    finally:
        for h in hooks:
            h.remove()
    around: dict[str, tuple] = {}
    for i, (kind, value) in enumerate(events):
        if kind == "unit" and value not in around:
            before = next((v for k, v in reversed(events[:i]) if k == "layer"), None)
            after = next((v for k, v in events[i + 1 :] if k == "layer"), None)
            around[value] = (before, after)
    return around, calls


def _per_channel(model: nn.Module, around: dict[str, tuple], cost: dict[int, float]) -> dict[str, float]:
    """``(cost(prev) + cost(next)) / C`` per unit; units without a neighbouring layer get the mean."""
    out: dict[str, float] = {}
    for name, unit in require_units(model):
        layers = [j for j in around.get(name, ()) if j is not None]
        out[name] = sum(cost[j] for j in layers) / unit.num_channels
    known = [c for c in out.values() if c > 0]
    fill = sum(known) / len(known) if known else 1.0
    return {n: c or fill for n, c in out.items()}


def flops_weights(model: nn.Module, example_inputs) -> dict[str, float]:
    """Per-unit cost: multiply-adds of the linear layer call just before and just after it, per channel.

    Runs one forward pass on ``example_inputs`` (a tensor, a tuple of positional inputs or a
    dict of keyword inputs) and orders layer and unit calls by execution. A channel made linear
    lets these two layers fold, so its weight is ``(macs(prev) + macs(next)) / C`` per sample, the
    layers' multiply-adds counted as fold counts them (:func:`~linearize.folding.flops.module_flops`:
    ``nn.Linear``, HF ``Conv1D``, convs); units without a neighbouring layer get the mean weight.

    Example:
        >>> net = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        >>> flops_weights(net, torch.randn(3, 4))   # (4 * 8 + 8 * 2) / 8
        {'1': 6.0}
    """
    around, calls = _neighbour_layers(model, example_inputs)
    cost = {j: module_flops(m, args, out) / 2 / max(out.shape[0], 1) for j, (m, args, out) in enumerate(calls)}
    return _per_channel(model, around, cost)


def latency_weights(model: nn.Module, example_inputs, budget_s: float = 1.0) -> dict[str, float]:
    """Per-unit cost: measured CPU time (ms) of the layer calls just before and just after it, per channel.

    The same layers as :func:`flops_weights` (the ones a linear site lets fold), each timed alone on
    the inputs it received in one forward pass on ``example_inputs``: the median of interleaved
    repetitions that fit ``budget_s`` seconds in all (:func:`linearize.timing.median_ms`). The
    weight is ``(ms(prev) + ms(next)) / C``; units without a neighbouring layer get the mean.
    Timings vary from run to run by a few percent; their order between layers of clearly different
    size does not.

    Example:
        >>> net = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        >>> w = latency_weights(net, torch.randn(3, 4), budget_s=0.05)   # ms per channel
        >>> list(w), w["1"] > 0
        (['1'], True)
    """
    budget_s = check_positive(budget_s, "budget_s")
    around, calls = _neighbour_layers(model, example_inputs)
    needed = sorted({j for pair in around.values() for j in pair if j is not None})
    ms = median_ms([functools.partial(calls[j][0], *calls[j][1]) for j in needed], budget_s)
    return _per_channel(model, around, dict(zip(needed, ms)))


def param_groups(
    model: nn.Module,
    weight_decay: float = 5e-4,
    slope_lr: float | None = None,
    **kwargs,
) -> list[dict]:
    """Parameter groups for any torch optimizer: no weight decay on slopes, biases and norms.

    Weight decay pulls slopes towards 0 (back to the activation), against the sparsity
    pressure; biases and 1-d (norm) weights are excluded as is conventional.

    Returns up to three groups: ``decay`` (weights of ndim >= 2, ``weight_decay``), ``no_decay``
    (biases and 1-d parameters, 0) and ``slopes`` (0, and ``lr=slope_lr`` when given). Extra
    ``kwargs`` go into every group. Frozen (``requires_grad=False``) parameters are left out.
    """
    slope_ids = {id(u.slope) for _, u in units(model)}
    decay, no_decay, slopes = [], [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in slope_ids:
            slopes.append(p)
        elif p.ndim >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, **kwargs},
        {"params": no_decay, "weight_decay": 0.0, **kwargs},
        {"params": slopes, "weight_decay": 0.0, **kwargs, **({"lr": slope_lr} if slope_lr is not None else {})},
    ]
    return [g for g in groups if g["params"]]
