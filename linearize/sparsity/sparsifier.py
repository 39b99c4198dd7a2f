"""Sparsity pressure on the slopes of linearizable units, on a schedule.

The penalty is ``sum_c w_c * (1 - a_c)`` over all free channels ``c`` (``w_c = 1`` unless weighted
by cost). By default it is applied as a **proximal step** after each optimizer step::

    a <- min(1, a + delta_t * w)        then clamp to [0, 1] and restore frozen channels

so that channels become *exactly* linear (``a == 1``), not 0.98, and stay there unless the loss
gradient pulls harder. The per-step displacement ``delta_t`` is given in **slope units per step**,
independent of the optimizer's scale::

    delta_t = rate * shape_t * (lr_t / lr_peak)

``shape_t`` is the schedule's multiplier in ``[0, 1]``; ``lr_t / lr_peak`` is the current learning
rate of the slopes' param group over its peak (1 without an optimizer): the peak an LR scheduler recorded in the
group (OneCycleLR's ``max_lr``, else the ``initial_lr`` every torch scheduler sets, so a warmup starts the push
weak, and an LR of 0 pushes nothing), or the largest LR seen so far where that is higher or none was recorded
(1 while no LR above 0 was seen). So the
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

**Skipped optimizer steps** (a ``torch.amp.GradScaler`` skips a step whose gradients hold NaN/inf) are not
steps of the Sparsifier: attached, its hook does not run; stepped by hand, a :meth:`~Sparsifier.step` after
an optimizer step not taken (the slopes unchanged since the last step, a gradient of the optimizer's
parameters non-finite) does nothing. The running fit leaves out the batches whose gradients no step took
(:class:`~linearize.calibration.RunningFit`), so the run follows the optimizer steps taken, as the same run
without the skipped batches.

``select="fit"`` needs no gradient either: each unit's least-squares affine fit ``alpha * x + beta`` of its
activation is tracked on the training batches (:class:`~linearize.calibration.RunningFit`, a decayed window
of about 20 steps), and a channel's cost is the output error its replacement by that fit puts on the layer it
feeds (:func:`linearize.one_shot`'s score), ranked within its unit; with ``linear_end="affine"`` every channel
on its way to 1 computes that fit at 1 (set at each step; a channel keeps the end it had when it arrived; one
that arrived before its unit had a fit, on the first step or before any training-mode forward, computes the
identity until the first step with a fit, which gives it the fit too). A
step whose statistics hold NaN/inf for a unit (a batch that overflowed, a step a loss scaler skipped) is left
out of that unit's fit, and a fit that is not finite is never written as an end.

**Channels nonlinear in name only.** The uniform push moves every free slope, the kept ones too; when it
outruns what the loss gradient can hold (a short ramp, a small slope learning rate), the channels a target
keeps nonlinear end close to 1. The step warns at the target's end when their mean slope
(:meth:`nonlinear_mean_slope`, also in :attr:`history`) is above 0.5: on airbench94 (SGD at lr 0.3, a 96-step
ramp) the kept channels sat at 0.43-0.79 and the element units at 0.96, where ResNet-20's late runs (lr 0.02,
a 3,900-step ramp) kept theirs at 0.00-0.01 (``recipes/results/frontier/frontier.md``).

**Defaults** (``select="auto"``, ``linear_end="auto"``), settled at :meth:`attach` (or the first
:meth:`step`, from the optimizer known then: ``optimizer=``, else the one whose step moved the slopes before it,
which the Sparsifier then reads as if given; with none known it warns): a fraction target without an explicit push (no ``rate``,
``lam`` or ``mode="loss"``) under an **adaptive optimizer** (:func:`adaptive`: Adam, AdamW, RMSprop,
Adagrad, ...; the fine-tuning regime, where a slope moves about ``lr`` per step and cannot hold against a
push) is ``select="fit"`` with ``linear_end="affine"``: in a user's own loop (MiniLM, AdamW 5e-5, 300 steps,
25% nonlinear) it keeps cosine 0.951 to the original where the push with identity ends fell to 0.52 (the
measurements: ``docs/sparsity.md``). A sharded model (FSDP2) gets ``select="saliency"`` with identity ends
instead. Everything else (SGD, no optimizer, a ramp schedule, a cost target, an explicit push) is the
paper's: ``select="slope"``, identity ends. :attr:`select` and :attr:`linear_end` say what was chosen, and
the state saves it.

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
batch 1 a ``ChannelPReLU`` call takes several times a ReLU's), so a cost target glides the free
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

**ReLU targets** (``target(relus=N)``) steer the nonlinear *activation elements per sample* instead, the count
the private-inference literature reports (SNL, AutoReP: "ReLUs per image"; :func:`linearize.measures.count_relus`):
a channel of a channel-level unit counts its elements per sample (``H * W`` of a conv map, the sequence length
of a transformer), read from one forward on ``example_inputs`` (needed unless every unit is element-level,
``convert(granularity="element")``, where each position counts 1). The path runs in ReLUs from the count at
``start`` to ``N``; at each step the usual ranking (``select``) is walked from the top and its shortest prefix
whose ReLUs, made linear, leave at most the path's value nonlinear goes linear (rounded up to whole groups with
``granularity="site"`` / ``"block"``). From ``end`` on at most ``N`` ReLUs stay nonlinear, within the ReLUs of
one channel (one group) of ``N``; on element units ``relus=N`` is ``fraction=N / total``. A goal above the
model's ReLUs is refused; the history records ``nonlinear_relus``.

Three added lines in a plain loop::

    sparsifier = linearize.Sparsifier(model, linearize.schedules.target(0.10, end=0.8), total_steps)
    sparsifier.attach(optimizer)        # or: sparsifier.step() after each optimizer.step() (not both)
"""

from __future__ import annotations

import json
import math
import warnings
import weakref
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from .. import schedules as _schedules
from ..checks import NonFiniteSlopeError, check_positive, check_positive_int, finite_nonnegative, is_real
from ..calibration import NonfiniteInputs, RunningFit
from ..distributed import full_value, is_sharded, refuse_sharded, write_full
from ..unit import (LinearizableActivation, check_finite_slopes, count_channels, fixed_values, linear_masks,
                    project_slopes, require_units)
from .planning import CostPlanner, check_cost_arguments, check_plan, no_plan
from .projection import by_group, glide, glide_down, glide_steps, max_step, rank
from .relus import ReluBudget
from .selection import SELECT, selection
from .state import check_state_values
from . import watch
from .weights import site_groups, unit_weights

__all__ = ["Sparsifier", "torch_optimizer", "adaptive", "MODES", "GRANULARITY", "LINEAR_ENDS"]

MODES = ("proximal", "loss")
# mean slope of the channels kept nonlinear at a pushed target's end above which they are more linear than not
KEPT_SLOPE_WARNING = 0.5
GRANULARITY = ("channel", "site", "block")
# torch optimizer -> weakref to the Sparsifier attached to it (one per optimizer: two would apply the pressure twice)
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


LINEAR_ENDS = ("identity", "affine")
# optimizers that normalize each parameter's step (a slope moves about lr per step, whatever its gradient)
ADAPTIVE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
            torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop)
ADAPTIVE_KEYS = ("betas", "beta1", "decay_rate")  # in the param groups of Adam-like optimizers elsewhere


def adaptive(optimizer) -> bool:
    """Whether ``optimizer`` scales each parameter's step by its own gradient statistics (Adam, AdamW, RMSprop,
    Adagrad, ..., or any optimizer whose param groups hold ``betas`` / ``beta1`` / ``decay_rate``, as
    bitsandbytes' and transformers' Adam variants and Adafactor do).

    Example:
        >>> p = [nn.Parameter(torch.zeros(1))]
        >>> adaptive(torch.optim.AdamW(p)), adaptive(torch.optim.SGD(p, lr=0.1))
        (True, False)
    """
    inner = torch_optimizer(optimizer)
    return isinstance(inner, ADAPTIVE) or any(k in g for g in inner.param_groups for k in ADAPTIVE_KEYS)


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
        example_inputs: inputs for ``weights="flops"`` / ``"latency"``, for a cost target and for a ReLU
            target (one small batch shaped like the real inputs; a ReLU target counts per sample of its shape).
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
            highest first), ``"saliency"`` (lowest running mean of the squared loss gradient
            of the slope first, no uniform push), ``"fit"`` (least output error of the channel's affine
            fit on the training batches first, no uniform push) or ``"auto"`` (default: by the optimizer,
            see **Defaults** in the module docs).
        linear_end: what a channel computes at slope 1: ``"identity"`` (``x``), ``"affine"`` (its
            least-squares fit ``alpha * x + beta`` on the training batches, tracked by a
            :class:`~linearize.calibration.RunningFit`; see :mod:`linearize.calibration`) or ``"auto"``
            (default: ``"affine"`` with ``select="fit"``, else ``"identity"``).

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
        select: str = "auto",
        granularity: str = "channel",
        blocks: Sequence[str] | None = None,
        linear_end: str = "auto",
    ) -> None:
        self._units = require_units(model, "there is nothing to sparsify")
        schedule = _schedules.as_schedule(schedule)
        if granularity not in GRANULARITY:
            raise ValueError(f"granularity must be one of {GRANULARITY}, got {granularity!r}")
        if blocks is not None and granularity != "block":
            raise ValueError(f"blocks= names the groups of granularity='block', got granularity={granularity!r}")
        check_cost_arguments(schedule, model, granularity, example_inputs)
        rate, release = _number(rate), _number(release)  # a 0-d tensor, a Decimal: as a float
        if rate is not None and not (is_real(rate) and math.isfinite(rate) and rate >= 0):
            raise ValueError(f"rate must be a finite number >= 0 (slope units per step), got {rate!r}")
        if not (is_real(release) and 0.0 < release < 1.0):
            raise ValueError(f"release must be a number in (0, 1), got {release!r}")
        if select != "auto":
            selection(select).check(schedule, rate, lam, mode)
        if linear_end not in ("auto", *LINEAR_ENDS):
            raise ValueError(f"linear_end must be 'auto', 'identity' or 'affine', got {linear_end!r}")
        if select == "fit" or linear_end == "affine":
            refuse_sharded(model, f"{'select=fit' if select == 'fit' else 'linear_end=affine'} tracks the units' "
                           "affine fits on the training batches, which")
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
        _schedules.check_lam(lam)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        schedule.validate(total_steps)
        # legacy lr * lam: an explicit lam, a schedule with its own lam, or a plain function (returns lam)
        legacy = lam is not None or schedule.legacy
        if legacy and rate is not None:
            raise ValueError(
                "pass either rate= (slope units per step) or a legacy lam (Sparsifier(lam=...), a "
                "schedule with its own lam, a number or a function), not both"
            )
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
        self._weights = unit_weights(model, self._units, weights, example_inputs)
        # a ReLU target: the elements per sample of every channel (one forward on example_inputs)
        self.relus = None if schedule.relus is None else ReluBudget(model, self._units, example_inputs,
                                                                     schedule.relus)
        self.step_count = 0
        self.initial_fraction: float | None = None  # measured at a target's start (a cost target: the cost ratio)
        self._selected: torch.Tensor | None = None  # bool [C], channels the target glides to 1
        # what was asked ("auto" resolves by the optimizer, see _resolve) and whether it is settled yet
        self._asked = (select, linear_end)
        # a fraction target without a push: the selections that need no push can choose its channels
        self._steerable = schedule.steers and schedule.cost is None and rate is None and not legacy \
            and mode == "proximal"
        self._sharded = any(is_sharded(u.slope) for _, u in self._units)
        self._resolved = False
        self.granularity = granularity
        names = [n for n, _ in self._units]
        self._groups: list[list[int]] = (  # unit indices of each group (a site, or a block's sites)
            [[i] for i in range(len(names))] if granularity != "block" else
            [[names.index(n) for n in g] for g in site_groups(model, blocks).values()])
        unit_group = {i: g for g, group in enumerate(self._groups) for i in group}
        self._channel_group = torch.cat([torch.full((u.num_channels,), unit_group[i])  # group of each channel
                                         for i, (_, u) in enumerate(self._units)])
        self._said: set[str] = set()  # warnings given once
        # a cost target: measures the model's folded cost and plans which groups go linear (at its start)
        self.planner = None if schedule.cost is None else CostPlanner(
            model, schedule, self._units, self._groups, self._channel_group, example_inputs, self._warn_once)
        # the units' affine fits on the training batches (select="fit", linear_end="affine"): hooked from the
        # start, so the first step already has them; dropped at the first step when neither is chosen
        could_fit = select == "fit" or linear_end == "affine" or (
            select == "auto" and self._steerable and not self._sharded)
        self._fit: RunningFit | None = RunningFit(model, [n for n, _ in self._units]) if could_fit else None
        # where NaN/inf entered this step's training forwards, for every selection: names it when the slopes diverge
        self._inputs = NonfiniteInputs(model, self._units)
        self._names = {id(p): name for name, p in model.named_parameters()}  # to name non-finite weights
        # the trackers' hooks go with this Sparsifier (the model outlives it)
        weakref.finalize(self, _close_trackers, self._inputs, self._fit)
        self.select, self.linear_end = self._choose()
        self.importance = selection(self.select)(self._units, self._weights, self._warn_once, self._fit)
        if self.optimizer is not None:
            self._resolve()
        self._lr_peak: list[float | None] = [None] * len(self._units)  # largest slope LR seen, per unit
        self.history: list[dict] = []
        self._hook = None
        self._versions = self._slope_versions()
        self._warned = False
        self._resumed = False  # load_state_dict ran since the last step (no "slopes did not change" warning)
        self._hook_stepping = False  # step() runs from attach()'s hook (a call by hand then is a second step)
        watch.watch(self)

    def _choose(self, asked: tuple[str, str] | None = None) -> tuple[str, str]:
        """``(select, linear_end)`` for what was asked: ``"auto"`` by the optimizer known now (module docs)."""
        select, end = asked or self._asked
        fine_tuning = self.optimizer is not None and adaptive(self.optimizer) and self._steerable
        if select == "auto":
            select = ("saliency" if self._sharded else "fit") if fine_tuning else "slope"
        if end == "auto":
            end = "affine" if select == "fit" else "identity"
        return select, end

    def _resolve(self, asked: tuple[str, str] | None = None) -> None:
        """Settle ``select`` and ``linear_end`` (at :meth:`attach`, the first :meth:`step`, or from a loaded
        state): rebuild the selection when "auto" chose another, drop the fit tracker when nothing needs it."""
        if self._resolved and asked is None:
            return
        select, end = self._choose(asked)
        if select != self.select:
            self.importance = selection(select)(self._units, self._weights, self._warn_once, self._fit)
        self.select, self.linear_end = select, end
        if self._fit is not None and select != "fit" and end != "affine":
            self._fit.close()
            self._fit = None
        self._resolved = True

    def _adopt_optimizer(self) -> None:
        """At the first step by hand without ``optimizer=``: take the optimizer that stepped these slopes before it
        (the optimizer watch saw it), so "auto" settles as under :meth:`attach`; warn (once) when none is known
        and the choice depends on it."""
        if self.optimizer is None:
            seen = watch.optimizer_of(self)
            self.optimizer = None if seen is None else torch_optimizer(seen)
        if self.optimizer is None and self._asked[0] == "auto" and self._steerable:
            self._warn_once(
                "select='auto' settled on 'slope' with identity ends (the uniform push, for training from scratch) "
                "because no optimizer is known at the first Sparsifier.step(): no optimizer had stepped the unit "
                "slopes yet. Under Adam/AdamW (fine-tuning) the defaults are select='fit', linear_end='affine'; "
                "pass optimizer= to the Sparsifier or use sparsifier.attach(optimizer), or pass select='slope' "
                "to keep the push")

    def _set_ends(self) -> None:
        """``linear_end="affine"``: every free channel below 1 gets its unit's running affine fit as its linear
        end; a channel keeps the end it had when it arrived at 1 (and a frozen one its own). The first fit of a
        unit goes to every free channel, those already at 1 too (they arrived before the unit had a fit: on this
        step, or before any training-mode forward). A fit that is not finite in the slopes' dtype (an overflow) is
        not written: the channel keeps its end."""
        fits = self._fit.fits()
        for name, unit in self._units:
            fit = fits.get(name)
            if fit is None:
                continue
            slope = unit.slope.detach()
            alpha, beta = (t.to(slope.device, slope.dtype) for t in (fit.alpha, fit.beta))
            free = torch.isnan(fixed_values(unit)).to(slope.device) & alpha.isfinite() & beta.isfinite()
            moving = free & (slope < 1)
            end = unit.linear_end
            if end is None:  # fixed buffers, in no optimizer (also after a load): the fit sets them, not the loss
                unit.set_linear_end(torch.where(free, alpha, 1.0), torch.where(free, beta, 0.0), trainable=False)
            else:
                end[0].copy_(torch.where(moving, alpha, end[0]))
                end[1].copy_(torch.where(moving, beta, end[1]))

    def slopes(self) -> list[torch.Tensor]:
        """The slope parameters of the units this Sparsifier drives, in unit order.

        Example: ``len(Sparsifier(model).slopes()) == len(linearize.units(model))``.
        """
        return [u.slope for _, u in self._units]

    @property
    def weights(self) -> dict[str, float]:
        """Normalized weight of each unit (mean 1 over channels)."""
        return {n: w for (n, _), w in zip(self._units, self._weights)}

    # ------------------------------------------------------------------ optimizer
    def attach(self, optimizer) -> "Sparsifier":
        """Run :meth:`step` after every step of ``optimizer`` (a step post hook); returns self.

        Accepts wrappers such as accelerate's ``AcceleratedOptimizer`` (the hook goes on the
        torch optimizer inside, so skipped accumulation steps do not count).

        Then do not call :meth:`step` yourself too: it would step twice per optimizer step (it raises).

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
        if self.step_count == 0:
            self._resolve()
        self._hook = inner.register_step_post_hook(lambda opt, args, kwargs: self._step_from_hook())
        _ATTACHED[inner] = weakref.ref(self)
        return self

    def _step_from_hook(self) -> None:
        self._hook_stepping = True
        try:
            self.step()
        finally:
            self._hook_stepping = False

    def __getstate__(self) -> dict:
        # a hook handle belongs to one optimizer object: a copy (deepcopy, pickle) re-attaches to its
        # own copy of the optimizer instead of holding a handle that drives nothing
        state = dict(self.__dict__, _hook=None)
        state["_attached"] = self._hook is not None
        return state

    def __setstate__(self, state: dict) -> None:
        attached = state.pop("_attached", False)
        state.setdefault("_resumed", False)  # pickled before it was kept
        self.__dict__.update(state)
        other = _ATTACHED.get(self.optimizer) if self.optimizer is not None else None
        other = other() if other is not None else None
        # a shallow copy shares the optimizer, which its original still drives: the copy stays detached
        if attached and self.optimizer is not None and (other is None or other._hook is None):
            self.attach(self.optimizer)
        watch.watch(self)  # a copy: counted afresh (attached, its hook steps it)

    def detach(self) -> None:
        """Remove the hook installed by :meth:`attach`."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
            ref = _ATTACHED.get(self.optimizer)
            if ref is not None and ref() is self:
                del _ATTACHED[self.optimizer]

    def _weights_of_optimizer(self) -> list[torch.Tensor]:
        """The parameters the optimizer steps but the slopes (none when no optimizer is known, or on a sharded
        model, whose shards each process checks alone)."""
        if self.optimizer is None or self._sharded:
            return []
        slopes = {id(s) for s in self.slopes()}
        return [p for group in self.optimizer.param_groups for p in group["params"] if id(p) not in slopes]

    def _nonfinite_weights(self) -> str | None:
        """The optimizer's parameters holding NaN/inf now, named, or ``None`` (one device sync per parameter)."""
        bad = [p for p in self._weights_of_optimizer() if not bool(torch.isfinite(p.detach()).all())]
        if not bad:
            return None
        named = [f"{self._names.get(id(p), f'a {tuple(p.shape)} parameter')!r} ({int(torch.isnan(p.detach()).sum())} "
                 f"NaN, {int(torch.isinf(p.detach()).sum())} inf of {p.numel()})" for p in bad[:5]]
        return f"{', '.join(named)}{f' and {len(bad) - 5} more' if len(bad) > 5 else ''}"

    def _written(self) -> str | None:
        """Why the slopes are not finite, for :func:`check_finite_slopes`: where NaN/inf entered this step's
        forward (:meth:`NonfiniteInputs.cause`), else the weights this optimizer step wrote NaN/inf into."""
        cause = self._inputs.cause()
        if cause is not None:
            return cause
        weights = self._nonfinite_weights()
        return None if weights is None else (
            f"The optimizer step just taken also wrote NaN/inf into the weights {weights}: a NaN/inf loss or "
            "gradient, or a too-high learning rate. Restore a checkpoint and lower the learning rate or lam.")

    @torch.no_grad()
    def _check_finite_weights(self) -> None:
        """Raise :class:`~linearize.NonFiniteSlopeError` (the divergence error) naming the parameters the optimizer
        step just taken wrote NaN/inf into while the slopes stayed finite, at that step (the next forward would
        turn every slope NaN, one step later). Not a scan of every weight at every step: the float16 / bfloat16
        parameters (whose updates overflow at ordinary values, e.g. Adam's eps underflows) are checked at every
        step, all of them only after a step that moved a slope out of [-1, 2] (an update of more than one slope
        unit: a huge learning rate or gradient, which overflows float32 weights only at far larger values). A
        parameter's sum is not finite when it holds NaN/inf; one whose sum overflowed is checked element-wise."""
        params = self._weights_of_optimizer()
        if not params:
            return
        slopes = torch.cat([u.slope.detach().float().flatten() for _, u in self._units])
        wild = bool(((slopes < -1) | (slopes > 2)).any())  # this step's update, before the projection
        sums: dict[torch.device, list[torch.Tensor]] = {}
        for p in params:
            if p.is_floating_point() and (wild or p.dtype in (torch.float16, torch.bfloat16)):
                sums.setdefault(p.device, []).append(p.detach().sum(dtype=torch.float32))
        if all(bool(torch.isfinite(torch.stack(s)).all()) for s in sums.values()):
            return
        weights = self._nonfinite_weights()
        if weights is not None:
            raise NonFiniteSlopeError(
                f"Sparsifier.step (step {self.step_count}): the optimizer step just taken wrote NaN/inf into the "
                f"weights {weights}, the slopes still finite: the next forward would make them NaN. Float16 "
                "parameters under Adam (whose eps underflows: keep them float32 under autocast), an update that "
                "overflowed (a too-high learning rate, a huge gradient). Restore a checkpoint and lower the "
                "learning rate.")

    def _optimizer_skipped(self) -> bool:
        """Whether the optimizer step this :meth:`step` follows was not taken, as a loss scaler skips a step whose
        gradients hold NaN/inf: the slopes did not change since the last step and a gradient of the optimizer's
        parameters (the slopes' where no optimizer is known) is not finite. The gradients are read only when the
        slopes did not change."""
        if self._slope_versions() != self._versions:
            return False
        params = ([p for group in self.optimizer.param_groups for p in group["params"]] if self.optimizer is not None
                  else self.slopes())
        grads = [p.grad.detach() for p in params if p.grad is not None]
        return any(not bool(torch.isfinite(g).all()) for g in grads)

    def _optimizer_moves_slopes(self) -> bool:
        """Whether an optimizer step moves a slope of this Sparsifier: one requires grad and, where the optimizer
        is known, is in it (slopes left out of it move by the Sparsifier alone; those with ``requires_grad=False``
        by nothing)."""
        trained = {id(u.slope) for _, u in self._units if u.slope.requires_grad}
        return bool(trained) if self.optimizer is None else bool(trained & self._lr_by_slope().keys())

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

    def _scheduled_peaks(self) -> dict[int, float]:
        """``{id(slope): peak LR}`` for the slopes whose param group an LR scheduler gave a peak: OneCycleLR's
        ``max_lr``, else the ``initial_lr`` every torch scheduler records (the LR before its warmup scales it)."""
        if self.optimizer is None:
            return {}
        slope_ids = {id(u.slope) for _, u in self._units}
        peaks = {}
        for group in self.optimizer.param_groups:
            peak = group.get("max_lr", group.get("initial_lr"))
            if is_real(peak) and math.isfinite(peak) and peak > 0:
                peaks.update((id(p), float(peak)) for p in group["params"] if id(p) in slope_ids)
        return peaks

    # ------------------------------------------------------------------ schedule
    def ramp_steps(self) -> int:
        """Steps over which the pressure acts: ``end - start`` of a target schedule, else ``total_steps``
        (at least 1). The auto ``rate`` is ``1 / ramp_steps()``."""
        return self.schedule.ramp_steps(self.total_steps)

    def glide_steps(self) -> int:
        """``G``: a selected channel of a target schedule reaches 1 within ``G`` steps (0: instantly)."""
        return glide_steps(self.glide, self.ramp_steps())

    @property
    def max_step(self) -> float:
        """The most a slope rises in one step of a target schedule: ``1 / G`` (``inf`` with ``glide=0``).

        Example: ``Sparsifier(model, target(0.1, start=0, end=1000), 1000).max_step == 0.01``.
        """
        return max_step(self.glide_steps())

    def lam_at(self, step: int | None = None) -> float:
        """Pressure at ``step`` (default: the next step): ``rate * shape_t`` in slope units per step at
        the peak LR, or the legacy ``lam_t`` (see the module docs)."""
        step = self.step_count if step is None else step
        value = float(self.schedule.pressure(step, self.total_steps, self.lam if self.legacy else self.rate))
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"the schedule returned lam={value} at step {step}; it must be finite and >= 0")
        return value

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
        inf (the training diverged): nothing is projected or logged then (one device sync per step); and naming
        the parameters, at this step, when the optimizer step it follows wrote NaN/inf into weights while the
        slopes stayed finite (float16 / bfloat16 weights after every step, all weights after a step that moved a
        slope out of [-1, 2]). A step after an optimizer step that was not taken (a loss scaler skipped it)
        does nothing.
        Raises ``RuntimeError`` when called by hand on an attached Sparsifier (its hook steps it already).
        """
        if self._hook is not None and not self._hook_stepping:
            raise RuntimeError(
                "Sparsifier.step() was called by hand, but this Sparsifier is attached to an optimizer, whose "
                "hook already steps it after every optimizer.step(): both would step it twice per optimizer step "
                "(the schedule at double speed). Fix: remove the sparsifier.step() call, or call "
                "sparsifier.detach() to step it by hand")
        check_finite_slopes(self._units, f"Sparsifier.step (step {self.step_count})", self._written)
        self._check_finite_weights()
        self._inputs.clear()
        watch.stepped(self)
        if self._optimizer_skipped():  # not counted: the run follows the optimizer steps taken
            return
        if self._slope_versions() == self._versions and not (self._warned or self._resumed) and \
                self._optimizer_moves_slopes():
            warnings.warn(
                "Sparsifier.step() was called but the slopes did not change since the last call: "
                "call it after optimizer.step() (or use sparsifier.attach(optimizer)), and check "
                "that the unit slopes are in the optimizer",
                UserWarning,
                stacklevel=2,
            )
            self._warned = True
        if not self._resolved:
            self._adopt_optimizer()
        self._resolve()
        if self._fit is not None:
            self._fit.step()
        self.importance.observe()
        self._project()
        target = self.schedule.steers
        low = next((u.slope.dtype for _, u in self._units if u.slope.dtype in (torch.bfloat16, torch.float16)), None)
        if low is not None and not target and not self.legacy and 0 < self.rate < torch.finfo(low).eps / 4:
            self._warn_once(f"the slopes are {low}: a push of {self.rate:.3g} per step is below half a {low} ulp "
                            f"near 1 ({torch.finfo(low).eps / 4:.3g}) and rounds away, so the pressure does nothing; "
                            "keep the slopes in float32 (for _, u in linearize.units(model): u.slope.data = "
                            "u.slope.data.float(); the units take inputs of any dtype)")
        before = torch.cat([full_value(u.slope.detach()).float() for _, u in self._units]) if target else None
        lam_t = self.lam_at()
        if self.mode == "proximal" and lam_t > 0 and self.importance.pushes:
            self._proximal(lam_t)
        wanted = None
        if target:
            start, end = self.schedule.span(self.total_steps)
            if self.initial_fraction is None and self.step_count >= start:
                if self.planner is not None:  # a cost target: plan which groups go linear, from the cost now
                    self.initial_fraction = self.planner.make_plan(before, self.importance)
                elif self.relus is not None:  # a ReLU target: the nonlinear share of the ReLUs
                    self.initial_fraction = self.relus.nonlinear(torch.cat(self._linear_masks())) / self.relus.total
                else:
                    self.initial_fraction = self._fraction("Sparsifier target start")
            if self.initial_fraction is not None:
                self.importance.warn_if_blind()
                # the path's start in the goal's units (a ReLU target's: ReLUs)
                initial = self.initial_fraction * (1 if self.relus is None else self.relus.total)
                wanted = self.schedule.wanted(self.step_count, self.total_steps, initial)
                ahead = self.schedule.wanted(self.step_count + self.glide_steps(), self.total_steps, initial)
                self._project_budget(ahead, before)
                if self.planner is None and (self.step_count == start or self.step_count % self.log_every == 0):
                    self._check_reachable()
                if self.step_count == min(end, self.total_steps - 1) and self.importance.pushes:
                    self._check_kept_slopes()
        if self.linear_end == "affine" and self._fit is not None:
            self._set_ends()
        if self._fit is not None and target and self.step_count >= self.schedule.span(self.total_steps)[1]:
            self._fit.close()  # the selection holds from now on: no hooks, the ends stay as they are
            self._fit = None
        self.step_count += 1
        if self.step_count % self.log_every == 0 or self.step_count == 1:
            self._record(lam_t, wanted)
        self._versions, self._resumed = self._slope_versions(), False

    def _check_reachable(self) -> None:
        """Warn (once) when channels frozen nonlinear (slope 0, or a nonlinear slope with ``requires_grad=False``) keep
        a fraction or ReLU target out of reach, or channels frozen linear (slope 1: :func:`linearize.freeze`,
        ``one_shot``, or a linear slope with ``requires_grad=False``) keep a fraction target out of reach."""
        if self.relus is not None:
            floor = self.relus.floor(torch.cat([fixed_values(u) for _, u in self._units]))
            if floor > self.relus.goal:
                self._warn_once(f"target relus={self.relus.goal} cannot be reached: channels frozen nonlinear (slope "
                                f"0, or a slope below 1 with requires_grad=False) hold {floor} of the "
                                f"{self.relus.total} ReLUs per sample; unfreeze them (unit.frozen.fill_(float('nan')), "
                                "unit.slope.requires_grad_(True)) or set a target at or above the floor")
            return
        total = sum(u.num_channels for _, u in self._units)
        frozen = sum(int((fixed_values(u) < 1).sum()) for _, u in self._units)
        if frozen / total > self.schedule.fraction + 0.5 / total:
            self._warn_once(f"target fraction {self.schedule.fraction} cannot be reached: {frozen} of {total} channels "
                            f"are frozen nonlinear (slope 0, or a slope below 1 with requires_grad=False), a floor of "
                            f"{frozen / total:.4f}; unfreeze them (unit.frozen.fill_(float('nan')), "
                            "unit.slope.requires_grad_(True)) or set a target at or above the floor")
        linear = sum(int((fixed_values(u) == 1).sum()) for _, u in self._units)
        if 1 - linear / total < self.schedule.fraction - 0.5 / total:
            self._warn_once(f"target fraction {self.schedule.fraction} cannot be reached: {linear} of {total} channels "
                            f"are frozen linear (slope 1, by linearize.freeze or one_shot, or with "
                            f"requires_grad=False), a ceiling of {1 - linear / total:.4f}; unfreeze them "
                            "(unit.frozen.fill_(float('nan')), unit.slope.requires_grad_(True)) or set a "
                            "target at or below the ceiling")

    def nonlinear_mean_slope(self) -> float | None:
        """Mean slope of the free channels now nonlinear (slope < 1; ``None`` when none is): 0 when they are the
        full activation, near 1 when they are nonlinear in name only (recorded in :attr:`history`).

        Example:
            >>> model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
            >>> linearize.Sparsifier(model, linearize.schedules.target(0.5), total_steps=10).nonlinear_mean_slope()
            0.0
        """
        slopes = torch.cat([full_value(u.slope.detach()).float().flatten() for _, u in self._units])
        frozen = torch.cat([fixed_values(u).flatten() for _, u in self._units]).to(slopes.device)
        kept = torch.isnan(frozen) & ~torch.cat(self._linear_masks("Sparsifier.nonlinear_mean_slope")).to(slopes.device)
        return float(slopes[kept].mean()) if bool(kept.any()) else None

    def _check_kept_slopes(self) -> None:
        """Warn (once, at the target's end) when the uniform push left the channels kept nonlinear mostly linear."""
        kept = self.nonlinear_mean_slope()
        if kept is not None and kept > KEPT_SLOPE_WARNING:
            self._warn_once(
                f"at the target's end (step {self.step_count}) the channels kept nonlinear sit at mean slope "
                f"{kept:.2f} (1 = linear): the uniform push outran what the loss gradient could hold, so the "
                "channels counted nonlinear are mostly linear and the model has less nonlinearity than its count "
                "says. To keep them nonlinear, lengthen the ramp (a later end or an earlier start), lower rate=, or "
                "choose without a uniform push: select='fit' (linear_end='affine') or select='saliency'")

    def _warn_once(self, message: str) -> None:
        if message not in self._said:
            warnings.warn(message, UserWarning, stacklevel=3)
            self._said.add(message)  # after: a warning turned into an error is raised again next time

    def saliency(self) -> dict[str, torch.Tensor]:
        """Per unit, the running mean of each channel's squared slope gradient (``select="saliency"``)."""
        return self.importance.saliency_of_units()

    def _proximal(self, lam_t: float) -> None:
        lrs = self._lr_by_slope()
        scheduled = self._scheduled_peaks()
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
            scale = 1.0  # no LR known, or only LRs of 0 so far and no scheduler's peak: the full push
            if lr is not None:  # follow the LR schedule's shape, not its scale (an LR of 0: no push)
                if lr > 0:
                    self._lr_peak[i] = max(lr, self._lr_peak[i] or 0.0)
                peak = max(self._lr_peak[i] or 0.0, scheduled.get(id(unit.slope), 0.0))
                if peak > 0:
                    scale = lr / peak
            steps.append(lam_t * scale * w)
        if self.granularity == "channel":
            for (_, unit), step in zip(self._units, steps):
                if unit.slope.requires_grad:  # a slope nothing trains stays where it is (fixed_values)
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
        frees = [torch.isnan(fixed_values(u)).to(a.device) for u, a in zip(members, slopes)]
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
        """Glide the selected channels to 1 so that ``round(wanted * C)`` stay nonlinear (a ReLU target: at most
        ``wanted`` ReLUs, :meth:`ReluBudget.linear_needed <linearize.sparsity.relus.ReluBudget.linear_needed>`), or
        for a cost target the groups of the shortest plan prefix whose folded cost is within ``wanted`` (module
        docs; the glide itself: :mod:`linearize.sparsity.projection`).

        ``wanted``: the path's value ``G`` steps ahead (a ReLU target's: nonlinear ReLUs); ``before``: the slopes
        before the proximal step (a slope rises by at most :attr:`max_step` from there).
        """
        slopes = torch.cat([full_value(u.slope.detach()).float() for _, u in self._units])
        frozen = torch.cat([fixed_values(u) for _, u in self._units]).to(slopes.device)
        before = before.to(slopes.device)
        free = torch.isnan(frozen)
        total = slopes.numel()
        k = total - int(round(wanted * total))  # linear channels a fraction target wants
        k_free = min(max(k - int((frozen == 1).sum()), 0), int(free.sum()))
        linear = torch.cat(self._linear_masks()).to(slopes.device)
        selected = (self._selected.to(slopes.device) if self._selected is not None else linear) & free
        _, end = self.schedule.span(self.total_steps)
        ranked = torch.nonzero(free).squeeze(1)
        if self.planner is not None:  # a cost target: the shortest plan prefix within the wanted cost
            mine = self.planner.held(wanted, slopes.device)[ranked]
            ranked = torch.cat([ranked[mine], ranked[~mine]])
            k_free = int(mine.sum())
        else:  # rank the free channels (stable sorts, the last key first) by the selection's keys
            hold = self._selected is not None and self.step_count >= end  # reached: hold the selection
            ranked = rank(ranked, self.importance.keys(slopes, linear, selected, hold))
            if self.relus is not None:  # the shortest ranked prefix that leaves at most `wanted` ReLUs nonlinear
                if self.granularity != "channel":  # in the order of whole groups
                    ranked, _ = by_group(ranked, 0, self._channel_group, len(self._groups))
                k_free = self.relus.linear_needed(ranked, wanted, frozen)
                if hold:  # the selection ranks first: keep all of it (a shorter prefix of it may meet the budget)
                    k_free = max(k_free, int(selected[ranked].sum()))
            if self.granularity != "channel":
                ranked, k_free = by_group(ranked, k_free, self._channel_group, len(self._groups))
        chosen, beyond = ranked[:k_free], ranked[k_free:]
        at_target = self.step_count >= end - 1
        new = glide(slopes, before, chosen, beyond, self.max_step, self.release, at_target)
        if self.planner is not None:  # outside the plan: glide to 0, the original activation (module docs)
            glide_down(new, before, free & self.planner.outside(slopes.device), self.max_step, at_target)
        for (_, unit), part in zip(self._units, torch.split(new, [u.num_channels for _, u in self._units])):
            write_full(unit.slope, part.to(unit.slope.dtype))
        self._project()
        self._selected = torch.zeros(total, dtype=torch.bool)
        self._selected[chosen.cpu()] = True

    @property
    def cost_plan(self) -> list[dict] | None:
        """A cost target's plan (``None`` before its start): for each prefix, the groups linear (their
        site names) and the folded cost (every other free channel at slope 0, its original activation) as a
        fraction of the original model folded.

        Example: ``sp.cost_plan[-1]["cost"] <= 0.6`` for ``target(flops=0.6)``.
        """
        return None if self.planner is None else self.planner.cost_plan()

    # ------------------------------------------------------------------ penalty and measures
    def penalty(self) -> torch.Tensor:
        """Differentiable ``lam_t * sum_c w_c * (1 - a_c)`` over free channels (scalar tensor); with
        ``granularity="site"`` / ``"block"`` the group lasso ``lam_t * sum_groups w * sqrt(C) * ||1 - a||_2``
        (``w``: the channel-weighted mean weight of the group's sites).

        For ``mode="loss"``: add it to the loss before ``backward()``. See the module docs for
        how it differs from the proximal step.
        """
        lam_t = self.lam_at()
        gaps = [(1.0 - full_value(unit.slope)) * torch.isnan(fixed_values(unit)) for _, unit in self._units]
        if self.granularity == "channel":
            return lam_t * torch.stack([w * gap.sum() for gap, w in zip(gaps, self._weights)]).sum()
        terms = []
        for group in self._groups:  # group lasso: w * sqrt(C) * ||1 - a||_2, w the channel-weighted mean
            counts = [int(torch.isnan(fixed_values(self._units[i][1])).sum()) for i in group]
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
        relus = {} if self.relus is None else {"nonlinear_relus": self.relus.nonlinear(torch.cat(self._linear_masks()))}
        self.history.append(
            {
                "step": self.step_count,
                "lam": lam_t,
                "nonlinear_fraction": counts["nonlinear"] / counts["total"],
                **relus,  # a ReLU target: nonlinear ReLUs per sample ("wanted" is in ReLUs too)
                "wanted": wanted,
                "nonlinear_mean_slope": self.nonlinear_mean_slope(),
                "sites": {name: site["fraction"] for name, site in counts["sites"].items()},
            }
        )

    def save_history(self, path: str | Path) -> Path:
        """Write the per-site nonlinear fraction log as JSON ``{"sites", "total_steps", "history"}``
        (atomically: an interrupted write leaves the previous file)."""
        from .._files import atomic_write

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        described = self.schedule.to_dict()  # a plain function has none: its repr
        payload = {
            "sites": [n for n, _ in self._units],
            "total_steps": self.total_steps,
            "schedule": described if described is not None else repr(self.schedule),
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
            "linear_end": self.linear_end,
            "running_fit": None if self._fit is None else _fit_state(self._fit),
            "granularity": self.granularity,
            **self.importance.state_dict(),  # saliency, seen
            "groups": len(self._groups),
            # cost, cost_reference, cost_reference_of ("original": older states measured against the model at
            # slopes 0.5), plan, plan_start, plan_costs
            **(no_plan() if self.planner is None else self.planner.state_dict()),
            "weights": list(self._weights),  # measured ones (weights="latency") would differ on a new measure
            "relu_positions": None if self.relus is None else list(self.relus.positions),  # a ReLU target's
            "sites": [[name, u.num_channels] for name, u in self._units],
            "total_steps": self.total_steps,
            "schedule": self.schedule.to_dict(),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` (slopes themselves live in the model's state dict). Everything
        is checked before anything changes."""
        channels = sum(u.num_channels for _, u in self._units)
        check_state_values(state, channels, self._units, self.total_steps)
        if state["channels"] != channels:
            raise ValueError(f"state is for {state['channels']} channels, this model has {channels}")
        if state.get("granularity", "channel") != self.granularity:
            raise ValueError(f"state was saved with granularity={state.get('granularity', 'channel')!r}, this "
                             f"Sparsifier has granularity={self.granularity!r}: build it with the same one to resume")
        saved = (state.get("select", "slope"), state.get("linear_end", "identity"))
        valid = (SELECT, LINEAR_ENDS)
        # "auto" takes what the run chose; what was asked explicitly must match it
        select, end = self._choose(tuple(theirs if mine == "auto" and theirs in ok else mine
                                         for mine, theirs, ok in zip(self._asked, saved, valid)))
        if saved[1] != end:
            raise ValueError(f"state was saved with linear_end={saved[1]!r}, this Sparsifier has linear_end={end!r}: "
                             "build it with the same one to resume")
        if saved[0] != select:
            raise ValueError(f"state was saved with select={saved[0]!r}, this Sparsifier has select={select!r}: "
                             "build it with the same select to resume")
        if (select == "fit" or end == "affine") and self._fit is None and state.get("running_fit") is not None:
            raise ValueError(f"state was saved with select={select!r}, linear_end={end!r}, which track the units' "
                             "affine fits; this Sparsifier has none (a sharded model, or other arguments): build it "
                             "as the run was built to resume")
        if state.get("groups", len(self._groups)) != len(self._groups):
            raise ValueError(f"state has {state['groups']} groups of sites, this Sparsifier has {len(self._groups)}: "
                             "build it with the same granularity and blocks to resume")
        cost = self.schedule.cost
        if state.get("cost") != cost:
            raise ValueError(f"state was saved with a cost target of {state.get('cost')!r}, this Sparsifier has "
                             f"{cost!r} (target(flops=/latency=)): build it with the same schedule to resume")
        if state.get("cost_reference") is not None and state.get("cost_reference_of") != "original":
            raise ValueError("state's cost target was measured against the model folded at slopes 0.5 (saved by an "
                             "older linearize), this one against the original model: restart the cost target")
        weights = state.get("weights")
        if weights is not None and not finite_nonnegative(weights, len(self._units)):
            raise ValueError(f"state's weights must be {len(self._units)} finite numbers >= 0, one per unit")
        check_plan(state, len(self._groups))
        if self.relus is not None:
            self.relus.check_state(state)
        mine = self.schedule.to_dict()
        if state.get("schedule") is not None and mine is not None and state["schedule"] != mine:
            raise ValueError(f"state was saved with the schedule {state['schedule']!r:.200}, this Sparsifier has "
                             f"{mine!r:.200}: build it with the same schedule to resume")
        kind = self.importance if select == self.select else selection(select)(
            self._units, self._weights, self._warn_once, self._fit)
        importance = kind.read_state(state, channels)
        if self._fit is not None and state.get("running_fit") is not None:
            self._fit.load_state_dict(state["running_fit"])  # checked whole before it changes anything
        self.importance, self.select, self.linear_end, self._resolved = kind, select, end, True
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
        self.importance.restore(importance)
        if self._fit is not None and (state.get("running_fit") is None or (select != "fit" and end != "affine")):
            self._fit.close()  # saved past its target's end, or chosen without the fits
            self._fit = None
        if self.planner is not None:
            self.planner.load_state_dict(state)
        if weights is not None:
            self._weights = [float(w) for w in weights]
            self.importance.weights = self._weights
        # the slopes as loaded: a next step() whose optimizer step a loss scaler skipped is not counted (as in the
        # uninterrupted run); the model was loaded, so that step does not warn that the slopes did not change
        self._versions, self._resumed = self._slope_versions(), True
        watch.watch(self)  # counted afresh: a resumed run must step it again (attach() after load_state_dict)


def _number(value: object) -> object:
    """``value`` as a float when it is a number of another type (a one-element tensor, a ``Decimal``);
    anything else (a string, a bool, None) as it is, for the caller's check to name."""
    if isinstance(value, (str, bytes, bool)) or value is None or is_real(value):
        return value
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one element
        return value


def _close_trackers(inputs: NonfiniteInputs, fit: RunningFit | None) -> None:
    """Retire the hooks a dropped Sparsifier's trackers put on the model: a finalizer runs wherever a garbage
    collection does (inside a forward, inside a ``copy.deepcopy`` of the model), so the hooks are made inert and
    each removes itself at its next call (a hook dict never changes under an iteration)."""
    inputs.close(deferred=True)
    if fit is not None:
        fit.close(deferred=True)


def _fit_state(fit: RunningFit) -> dict:
    """A :class:`RunningFit` state with its sums as nested lists (JSON: float64 round-trips exactly)."""
    state = fit.state_dict()
    state["units"] = {n: {"count": u["count"], "sums": None if u["sums"] is None else u["sums"].tolist()}
                      for n, u in state["units"].items()}
    if state["outgoing"] is not None:
        state["outgoing"] = {n: None if v is None else v.tolist() for n, v in state["outgoing"].items()}
    return state
