"""Schedules of the sparsity pressure: how strong it is at each optimizer step.

A schedule is a small object (or any plain function) evaluated at ``(step, total_steps)``:

- :func:`constant` ``lam`` from step 0;
- :func:`early` pressure from step 0, optionally ramped up over ``ramp`` steps;
- :func:`late` no pressure until ``start``, then on (optionally ramped);
- :func:`linear` / :func:`cosine` warm-up ramps of ``lam``;
- :func:`target` steer the *nonlinear fraction* (or the folded model's FLOPs or latency, or the
  nonlinear ReLUs per sample) to a requested value by ``end`` and hold it.

Step arguments (``start``, ``end``, ``ramp``) are either a **float in [0, 1]**, a fraction of
``total_steps``, or an **int**, an absolute optimizer step (so ``1.0`` is the end of training,
``1`` is step one).

``lam=None`` in a schedule (the default) means "the pressure of the :class:`~linearize.Sparsifier`"
(its scale-free ``rate`` in slope units per step, or its legacy ``lam``): the schedule then only
gives the shape (a multiplier in ``[0, 1]``). A schedule with its own ``lam`` is the legacy
``lr * lam`` pressure. Called directly,
``schedule(step, total_steps)`` returns ``lam * shape`` (``shape`` alone when ``lam`` is None).
A plain function ``f(step, total_steps) -> lam`` works as a schedule too.

Why :func:`target` does not steer ``lam`` with a feedback controller: with an L1 proximal step,
slopes sit just below 1 after every optimizer step, so the measured fraction stays at 100% until
``lam`` has grown by orders of magnitude, and then every unit flips at once (a probe on CIFAR-10
overshot to 7% and collapsed, or oscillated between 3% and 47%; see
the project notes, ``shared/notes/sparsity-schedule-probe.md``). Instead the *wanted fraction* follows a
smooth cubic path from the fraction measured at ``start`` to the target at ``end`` (as in gradual
magnitude pruning), a mild L1 proximal step orders the channels (those the loss tolerates drift
up first), and a gentle budget projection selects the channels the path wants linear a glide time
``G`` ahead (highest slopes first, kept once selected), moves them up by at most ``1 / G`` per step
and sets them to exactly 1 when they arrive (see :class:`~linearize.Sparsifier`, ``glide``). From
``end`` on the fraction is exactly ``round(target * C) / C`` at every step, so it stays within
+-0.01 without oscillation for any model of 50 channels or more.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Union

__all__ = [
    "Schedule",
    "Ramp",
    "Target",
    "constant",
    "early",
    "late",
    "linear",
    "cosine",
    "target",
    "resolve_step",
    "from_dict",
    "as_schedule",
    "check_lam",
    "Function",
]

StepSpec = Union[int, float]
SHAPES = ("linear", "cosine")


def resolve_step(value: StepSpec, total_steps: int) -> int:
    """An absolute step from a fraction of training (float in [0, 1]) or a step (int >= 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a step must be an int (absolute step) or a float in [0, 1], got {value!r}")
    if isinstance(value, float):
        return int(round(value * total_steps))
    return value


def _check_step(name: str, value: StepSpec | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be an int (absolute step) or a float in [0, 1], got {value!r}")
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise ValueError(
            f"{name}={value} is a float, so it is read as a fraction of training and must lie in "
            f"[0, 1]; pass an int for an absolute step"
        )
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_lam(lam: float | None) -> None:
    """``ValueError`` unless ``lam`` is ``None`` or a finite number >= 0 (a legacy pressure)."""
    if lam is None:
        return
    if not isinstance(lam, (int, float)) or isinstance(lam, bool) or not math.isfinite(lam):
        raise ValueError(f"lam must be a finite number >= 0, got {lam!r}")
    if lam < 0:
        raise ValueError(f"lam must be >= 0 (it pushes slopes towards 1, i.e. linear), got {lam}")


class Schedule:
    """Base class: ``shape(step, total_steps)`` in ``[0, 1]`` times ``lam``.

    What the :class:`~linearize.Sparsifier` asks a schedule at step ``t``: :meth:`pressure` (how hard to
    push), :attr:`steers` and :meth:`wanted` (a target: which nonlinear fraction or cost is wanted),
    :meth:`ramp_steps` (over how many steps the pressure acts), :attr:`cost` (a cost target's measure) and
    :attr:`relus` (a ReLU target's budget).
    """

    lam: float | None = None
    steers = False  # True for a target: the Sparsifier projects the slopes to what it wants
    cost: str | None = None  # a cost target's measure ("flops", "latency"); None otherwise
    relus: float | None = None  # a ReLU target's budget (nonlinear ReLUs per sample); None otherwise

    def shape(self, step: int, total_steps: int) -> float:
        raise NotImplementedError

    def __call__(self, step: int, total_steps: int) -> float:
        """``lam`` at ``step`` (the bare shape when ``lam`` is None)."""
        scale = self.shape(step, total_steps)
        return scale if self.lam is None else self.lam * scale

    @property
    def legacy(self) -> bool:
        """Whether the schedule gives the legacy ``lam`` itself (its own ``lam``), not a shape in ``[0, 1]``."""
        return self.lam is not None

    def pressure(self, step: int, total_steps: int, scale: float) -> float:
        """The pressure at ``step``: the schedule's own ``lam_t``, or its shape times ``scale`` (the
        Sparsifier's ``rate`` or legacy ``lam``) when it has none.

        Example:
            >>> late(start=5).pressure(7, 10, scale=0.5), late(start=5, lam=2.0).pressure(7, 10, scale=0.5)
            (0.5, 2.0)
        """
        value = self(step, total_steps)
        return value if self.legacy else value * scale

    def ramp_steps(self, total_steps: int) -> int:
        """Steps over which the pressure acts: ``total_steps`` (a target: its ramp ``end - start``)."""
        return total_steps

    def wanted(self, step: int, total_steps: int, initial: float) -> float | None:
        """The nonlinear fraction (cost ratio, ReLU count) wanted at ``step``: ``None``, no target wants one."""
        return None

    def validate(self, total_steps: int) -> None:
        """Raise ``ValueError`` when the resolved steps are inconsistent for ``total_steps``."""

    def to_dict(self) -> dict:
        """JSON-serializable description (inverse: :func:`from_dict`)."""
        return {"type": type(self).__name__, **dataclasses.asdict(self)}


@dataclass
class Ramp(Schedule):
    """Zero before ``start``, ramps to ``lam`` over ``ramp`` steps, stops after ``end`` (if set).

    Attributes:
        lam: full pressure (``None``: the Sparsifier's ``lam``).
        start, end, ramp: steps (int) or fractions of training (float in [0, 1]).
        kind: ``"linear"`` or ``"cosine"`` (half-cosine) ramp shape.
    """

    lam: float | None = None
    start: StepSpec = 0
    ramp: StepSpec = 0
    end: StepSpec | None = None
    kind: str = "linear"

    def __post_init__(self) -> None:
        check_lam(self.lam)
        for name in ("start", "ramp", "end"):
            _check_step(name, getattr(self, name))
        if self.kind not in SHAPES:
            raise ValueError(f"ramp kind must be one of {SHAPES}, got {self.kind!r}")
        if self.end is not None and type(self.start) is type(self.end) and self.start > self.end:
            raise ValueError(f"start ({self.start}) is after end ({self.end})")

    def validate(self, total_steps: int) -> None:
        start = resolve_step(self.start, total_steps)
        if self.end is not None and start > resolve_step(self.end, total_steps):
            raise ValueError(
                f"start ({self.start}) is after end ({self.end}) for total_steps={total_steps}"
            )
        if start >= total_steps:  # steps run 0 .. total_steps - 1: no pressure would ever apply
            raise ValueError(f"the pressure starts at step {start} (start={self.start}), but the last step is "
                             f"{total_steps - 1} (total_steps={total_steps}): give start as a fraction of training "
                             "below 1, e.g. 0.5, or a step < total_steps, or pass the run's real total_steps")
        exact = lambda v: v * total_steps if isinstance(v, float) else v  # noqa: E731  (before any rounding)
        full = exact(self.start) + exact(self.ramp)  # the first step at full lam
        last = total_steps if self.end is None else min(total_steps, exact(self.end) + 1)
        if full > last:  # lam would never reach its full value
            raise ValueError(f"the ramp (start={self.start}, ramp={self.ramp}) reaches full pressure at step {full:g}, "
                             f"after {'the end of training' if last == total_steps else f'end={self.end}'} "
                             f"(step {last:g}, total_steps={total_steps}): shorten the ramp (e.g. warmup=0.1), "
                             "start earlier, or pass the run's real total_steps")

    def shape(self, step: int, total_steps: int) -> float:
        start = resolve_step(self.start, total_steps)
        if step < start or (self.end is not None and step > resolve_step(self.end, total_steps)):
            return 0.0
        ramp = resolve_step(self.ramp, total_steps)
        if ramp <= 0:
            return 1.0
        p = min(1.0, (step - start + 1) / ramp)
        return p if self.kind == "linear" else 0.5 * (1.0 - math.cos(math.pi * p))


@dataclass
class Target(Schedule):
    """Steer the nonlinear fraction, the folded model's cost or the nonlinear ReLUs per sample to a goal by
    ``end``, then hold it (see module docs).

    Attributes:
        fraction: wanted nonlinear fraction in ``(0, 1]``.
        start, end: the path runs from ``start`` (value measured there) to ``end``.
        lam: L1 proximal pressure during ``[start, end]`` (``None``: the Sparsifier's ``lam``);
            after ``end`` only the projection acts unless ``hold`` is set.
        power: exponent of the path ``f(p) = goal + (f0 - goal) * (1 - p) ** power``.
        hold: pressure after ``end`` as a fraction of ``lam`` (default 0: the projection alone
            holds the target).
        flops: instead of ``fraction``: the folded model's FLOPs (``linearize.fold`` then
            ``count_flops``) as a fraction in ``(0, 1]`` of the original model folded (every
            slope 0; a cost target: see :class:`~linearize.Sparsifier`).
        latency: instead of ``fraction``: the folded model's measured CPU latency, likewise.
        relus: instead of ``fraction``: at most this many nonlinear activation elements ("ReLUs") per
            sample, as the private-inference literature counts them (:func:`linearize.measures.count_relus`;
            a ReLU target: see :class:`~linearize.Sparsifier`).

    Exactly one of ``fraction``, ``flops``, ``latency`` and ``relus`` is given.
    """

    steers = True

    fraction: float | None = None
    start: StepSpec = 0
    end: StepSpec = 0.8
    lam: float | None = None
    power: float = 3.0
    hold: float = 0.0
    flops: float | None = None
    latency: float | None = None
    relus: float | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("fraction", "flops", "latency", "relus") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "a target needs exactly one goal: fraction= (nonlinear channels), flops= or latency= (the "
                "folded model's cost) or relus= (nonlinear ReLUs per sample), got "
                f"{given or 'none'}; e.g. target(0.1), target(flops=0.6) or target(relus=50_000)"
            )
        name = given[0]
        value = getattr(self, name)
        relus = name == "relus"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"target {name} must be a number "
                            f"{'> 0 (nonlinear ReLUs per sample)' if relus else 'in (0, 1]'}, got {value!r}")
        if relus and not 0.0 < value < math.inf:  # NaN fails too
            raise ValueError(f"target relus must be a positive finite number (nonlinear ReLUs per sample), got {value}")
        if not relus and not 0.0 < value <= 1.0:
            what = ("the share of channels kept nonlinear" if name == "fraction" else
                    f"the folded model's {name} over the original model's, folded")
            raise ValueError(f"target {name} must lie in (0, 1] ({what}), got {value}")
        check_lam(self.lam)
        if not 0.0 <= self.hold <= 1.0:
            raise ValueError(f"hold must lie in [0, 1] (a fraction of lam), got {self.hold}")
        _check_step("start", self.start)
        _check_step("end", self.end)
        if isinstance(self.power, bool) or not isinstance(self.power, (int, float)) or not 0 < self.power < math.inf:
            raise ValueError(f"power must be a finite number > 0, got {self.power!r}")
        if type(self.start) is type(self.end) and self.start > self.end:
            raise ValueError(f"start ({self.start}) is after end ({self.end})")

    @property
    def cost(self) -> str | None:
        """``"flops"`` or ``"latency"`` for a cost target, ``None`` for a fraction target."""
        return "flops" if self.flops is not None else "latency" if self.latency is not None else None

    @property
    def goal(self) -> float:
        """The value the path reaches at ``end``: the fraction, the cost ratio or the ReLU count."""
        return next(v for v in (self.fraction, self.flops, self.latency, self.relus) if v is not None)

    def to_dict(self) -> dict:
        """JSON-serializable description; ``relus`` only when set (so states and histories saved before
        ReLU targets existed still describe the same schedule)."""
        described = super().to_dict()
        if described["relus"] is None:
            del described["relus"]
        return described

    def span(self, total_steps: int) -> tuple[int, int]:
        """The target's ``(start, end)`` as absolute steps of a run of ``total_steps``."""
        return resolve_step(self.start, total_steps), resolve_step(self.end, total_steps)

    def ramp_steps(self, total_steps: int) -> int:
        """``end - start`` (at least 1): the steps over which the path descends."""
        start, end = self.span(total_steps)
        return max(1, end - start)

    def validate(self, total_steps: int) -> None:
        start, end = self.span(total_steps)
        if start > end:
            raise ValueError(f"start ({self.start}) is after end ({self.end}) for total_steps={total_steps}")
        if start >= total_steps:  # steps run 0 .. total_steps - 1: the target would never act
            raise ValueError(f"the target starts at step {start} (start={self.start}), but the last step is "
                             f"{total_steps - 1} (total_steps={total_steps}): give start as a fraction of training "
                             "below 1, or a step < total_steps, or pass the run's real total_steps")
        if end > total_steps:  # the target would never be reached (or, past start, never pressed at all)
            raise ValueError(f"the target is reached at step {end} (end={self.end}), after the last of "
                             f"total_steps={total_steps}: give end (and start) as fractions of training, e.g. "
                             "end=0.8, or steps <= total_steps, or pass the run's real total_steps")

    def shape(self, step: int, total_steps: int) -> float:
        start, end = self.span(total_steps)
        if step < start:
            return 0.0
        return 1.0 if step <= end else self.hold

    def wanted(self, step: int, total_steps: int, initial: float) -> float | None:
        """Wanted value at ``step`` (nonlinear fraction, cost ratio or ReLU count) given ``initial`` at ``start``.

        ``None`` before ``start`` (no projection yet).
        """
        start, end = self.span(total_steps)
        if step < start:
            return None
        p = 1.0 if end <= start else min(1.0, (step - start + 1) / (end - start))
        return self.goal + (initial - self.goal) * (1.0 - p) ** self.power


def constant(lam: float | None = None) -> Ramp:
    """``lam`` at every step."""
    return Ramp(lam=lam)


def early(lam: float | None = None, ramp: StepSpec = 0, kind: str = "linear") -> Ramp:
    """Pressure from step 0, ramped up over ``ramp`` steps (int) or fraction of training (float)."""
    return Ramp(lam=lam, start=0, ramp=ramp, kind=kind)


def late(start: StepSpec = 0.5, lam: float | None = None, ramp: StepSpec = 0, kind: str = "linear") -> Ramp:
    """No pressure before ``start`` (default half of training), then ``lam`` (optionally ramped).

    On a model that is already trained, ``late(start=0)`` is the same as :func:`early`.
    """
    return Ramp(lam=lam, start=start, ramp=ramp, kind=kind)


def linear(lam: float | None = None, warmup: StepSpec = 0.1, start: StepSpec = 0) -> Ramp:
    """Linear warm-up of ``lam`` from 0 over ``warmup`` steps after ``start``."""
    return Ramp(lam=lam, start=start, ramp=warmup, kind="linear")


def cosine(lam: float | None = None, warmup: StepSpec = 0.1, start: StepSpec = 0) -> Ramp:
    """Half-cosine warm-up of ``lam`` from 0 over ``warmup`` steps after ``start``."""
    return Ramp(lam=lam, start=start, ramp=warmup, kind="cosine")


def target(
    fraction: float | None = None,
    start: StepSpec = 0,
    end: StepSpec = 0.8,
    lam: float | None = None,
    power: float = 3.0,
    hold: float = 0.0,
    *,
    flops: float | None = None,
    latency: float | None = None,
    relus: float | None = None,
) -> Target:
    """Reach the nonlinear ``fraction`` (in (0, 1]) by ``end`` along a cubic path, then hold it; or,
    with ``flops=`` / ``latency=`` instead, the folded model's cost as a fraction of the original
    model's, folded (every slope 0; needs ``Sparsifier(granularity="site" | "block", example_inputs=...)``);
    or, with ``relus=`` instead, at most that many nonlinear ReLUs (activation elements) per sample: a
    channel counts its elements per sample (``H * W`` of a conv map, a sequence length; needs
    ``Sparsifier(example_inputs=...)`` unless every unit is element-level), an element unit's position 1.

    Example:
        >>> target(0.1).goal, target(flops=0.6, end=0.9).cost, target(relus=50_000).relus
        (0.1, 'flops', 50000)
    """
    return Target(fraction=fraction, start=start, end=end, lam=lam, power=power, hold=hold, flops=flops,
                  latency=latency, relus=relus)


@dataclass
class Function(Schedule):
    """A plain function ``fn(step, total_steps) -> lam`` as a schedule: the legacy ``lr * lam`` pressure
    (what :func:`as_schedule` makes of a function). It has no :meth:`to_dict` description (``None``).
    """

    fn: Callable[[int, int], float]

    def __call__(self, step: int, total_steps: int) -> float:
        return self.fn(step, total_steps)

    @property
    def legacy(self) -> bool:
        return True

    def to_dict(self) -> None:  # type: ignore[override]
        """``None``: a function has no JSON description (saved states and histories record none)."""
        return None

    def __repr__(self) -> str:
        return repr(self.fn)


def as_schedule(schedule: "ScheduleLike") -> Schedule:
    """A :class:`Schedule` from what a :class:`~linearize.Sparsifier` accepts: a schedule (itself), a plain
    function ``(step, total_steps) -> lam`` (:class:`Function`), a number (a constant legacy ``lam``) or
    ``None`` (constant pressure at the Sparsifier's rate).

    Example:
        >>> as_schedule(None), as_schedule(0.5).lam
        (Ramp(lam=None, start=0, ramp=0, end=None, kind='linear'), 0.5)
    """
    if schedule is None or isinstance(schedule, (int, float)):
        return constant(None if schedule is None else float(schedule))
    if isinstance(schedule, Schedule):
        return schedule
    if not callable(schedule):
        raise TypeError(f"schedule must be a linearize.schedules object, a function or a number, got {schedule!r}")
    return Function(schedule)


def from_dict(d: dict) -> Schedule:
    """Rebuild a schedule from :meth:`Schedule.to_dict`."""
    kinds = {"Ramp": Ramp, "Target": Target}
    d = dict(d)
    kind = d.pop("type", None)
    if kind not in kinds:
        raise ValueError(f"unknown schedule type {kind!r}; known: {sorted(kinds)}")
    return kinds[kind](**d)


ScheduleLike = Union[Schedule, Callable[[int, int], float], float, None]
