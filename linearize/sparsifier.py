"""Sparsity pressure on the slopes of linearizable units, on a schedule.

The penalty is ``lam * sum_c w_c * (1 - a_c)`` over all free channels ``c`` (``w_c = 1`` unless
weighted by cost). By default it is applied as a **proximal step** after each optimizer step::

    a <- min(1, a + lr_eff * lam_t * w)        then clamp to [0, 1] and restore frozen channels

so that channels become *exactly* linear (``a == 1``), not 0.98, and stay there unless the loss
gradient pulls harder than ``lam``. ``lr_eff`` is the current learning rate of the optimizer
param group that holds the slope, so the pressure follows the LR schedule like a gradient would.

:meth:`Sparsifier.penalty` offers the same prior as a differentiable loss term instead
(``mode="loss"``). The difference: the loss term's gradient ``-lam * w`` goes through the
optimizer, so with Adam it is rescaled per parameter by the running second moment (``lam``
then means something different for every slope and every optimizer), momentum carries it past
1 (the projection clips it, but the momentum keeps pushing), and units reach exactly 1 only by
clipping. With plain SGD without momentum both coincide (except where the clamp at 0 binds: the
proximal step adds ``lr * lam`` after clamping). The proximal step is optimizer-agnostic.

Choosing ``lam``: a free slope moves by ``lr * lam`` per step, the loss moves it by ``lr * grad`` under
SGD but by about ``lr`` under Adam(W), whatever the gradient scale: the recipes use ``lam = 1e-3`` with
SGD (``cifar.py``) and ``lam = 1`` with AdamW (``wmt14.py``). Too small a ``lam`` leaves a :func:`~linearize.schedules.target` schedule to its
projection alone, which sets channels to exactly 1 from wherever their slopes are. Measured on Multi30k
(``recipes/wmt14.py``, AdamW, FFN at 10% nonlinear channels): -0.95 BLEU with ``lam = 1``,
-1.52 BLEU with ``lam = 1e-3``.

Three added lines in a plain loop::

    sparsifier = linearize.Sparsifier(model, linearize.schedules.target(0.10, end=0.8), total_steps)
    sparsifier.attach(optimizer)        # or: sparsifier.step() after each optimizer.step()
"""

from __future__ import annotations

import json
import math
import warnings
import weakref
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from . import schedules as _schedules
from .checks import check_positive, check_positive_int
from .unit import check_finite_slopes, count_channels, linear_masks, project_slopes, require_units, units

__all__ = ["Sparsifier", "param_groups", "flops_weights"]

MODES = ("proximal", "loss")
# torch optimizer -> weakref to the Sparsifier attached to it (one per optimizer: two would apply the pressure twice)
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
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
        schedule: a :mod:`linearize.schedules` object, a function ``(step, total_steps) -> lam``,
            a number (constant ``lam``) or ``None`` (constant ``lam``).
        total_steps: number of optimizer steps of the run (resolves fractional schedule steps).
        lam: pressure used by schedules built with ``lam=None``.
        weights: per-unit cost weighting: ``None`` (all 1), ``"flops"`` (multiply-adds of the
            layers next to the unit, per channel; needs ``example_inputs``, see
            :func:`flops_weights`) or a dict ``{unit_name: weight}`` (missing names weigh 1).
            Weights are normalized to mean 1 over channels, so ``lam`` keeps its meaning.
        mode: ``"proximal"`` (default: the step applies the pressure) or ``"loss"`` (add
            :meth:`penalty` to the loss yourself; the step then only projects and logs).
        optimizer: the optimizer, to read the learning rate and detect a missed optimizer step
            (:meth:`attach` sets it too).
        lr: learning rate for ``lr_eff`` when no optimizer is known.
        release: a :func:`~linearize.schedules.target` schedule keeps exactly its budget of
            linear channels; channels at 1 beyond it are set back to ``1 - release``.
        log_every: record the per-site fractions every this many steps (default: about 500
            records per run).
        example_inputs: inputs for ``weights="flops"``.
    """

    def __init__(
        self,
        model: nn.Module,
        schedule: _schedules.ScheduleLike = None,
        total_steps: int = 1,
        lam: float = 1e-3,
        weights: str | Mapping[str, float] | None = None,
        mode: str = "proximal",
        optimizer: torch.optim.Optimizer | None = None,
        lr: float | None = None,
        release: float = 0.01,
        log_every: int | None = None,
        example_inputs=None,
    ) -> None:
        self._units = require_units(model, "there is nothing to sparsify")
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
        self.schedule = schedule
        self.total_steps = total_steps
        self.lam = float(lam)
        self.mode = mode
        self.lr = None if lr is None else check_positive(lr, "lr")
        self.release = release
        self.log_every = max(1, total_steps // 500) if log_every is None else check_positive_int(log_every, "log_every")
        self.optimizer = _torch_optimizer(optimizer) if optimizer is not None else None
        self._weights = self._build_weights(model, weights, example_inputs)
        self.step_count = 0
        self.initial_fraction: float | None = None  # measured at a target schedule's start
        self._linear: torch.Tensor | None = None  # bool [C], linear set after the last projection
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
            if weights != "flops":
                raise ValueError(f"weights must be None, 'flops' or a dict name -> weight, got {weights!r}")
            if example_inputs is None:
                raise ValueError("weights='flops' needs example_inputs (one batch) to measure layer sizes")
            raw = flops_weights(model, example_inputs)
        elif isinstance(weights, Mapping):
            unknown = set(weights) - set(names)
            if unknown:
                raise ValueError(
                    f"weights name units the model does not have: {sorted(unknown)[:5]}; units: {names[:5]}..."
                )
            raw = {n: float(weights.get(n, 1.0)) for n in names}
        else:
            raise TypeError(f"weights must be None, 'flops' or a dict, got {type(weights).__name__}")
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
        inner = _torch_optimizer(optimizer)
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
        self.optimizer = inner
        self._hook = inner.register_step_post_hook(lambda opt, args, kwargs: self.step())
        _ATTACHED[inner] = weakref.ref(self)
        return self

    def detach(self) -> None:
        """Remove the hook installed by :meth:`attach`."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
            ref = _ATTACHED.get(self.optimizer)
            if ref is not None and ref() is self:
                del _ATTACHED[self.optimizer]

    # ------------------------------------------------------------------ schedule
    def lam_at(self, step: int | None = None) -> float:
        """Pressure ``lam_t`` at ``step`` (default: the next step)."""
        step = self.step_count if step is None else step
        value = self.schedule(step, self.total_steps)
        if isinstance(self.schedule, _schedules.Schedule) and self.schedule.lam is None:
            value = value * self.lam
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"the schedule returned lam={value} at step {step}; it must be finite and >= 0")
        return value

    def _lr_by_slope(self) -> dict[int, float]:
        if self.optimizer is None:
            return {}
        slope_ids = {id(u.slope) for _, u in self._units}
        return {
            id(p): float(group["lr"])
            for group in self.optimizer.param_groups
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
        self._project()
        lam_t = self.lam_at()
        if self.mode == "proximal" and lam_t > 0:
            self._proximal(lam_t)
        wanted = None
        if isinstance(self.schedule, _schedules.Target):
            start = _schedules.resolve_step(self.schedule.start, self.total_steps)
            if self.initial_fraction is None and self.step_count >= start:
                self.initial_fraction = self._fraction("Sparsifier target start")
            if self.initial_fraction is not None:
                wanted = self.schedule.wanted(self.step_count, self.total_steps, self.initial_fraction)
                self._project_budget(wanted)
        self.step_count += 1
        if self.step_count % self.log_every == 0 or self.step_count == 1:
            self._record(lam_t, wanted)
        self._versions = self._slope_versions()

    def _proximal(self, lam_t: float) -> None:
        lrs = self._lr_by_slope()
        for (name, unit), w in zip(self._units, self._weights):
            lr = lrs.get(id(unit.slope), self.lr)
            if lr is None:
                raise ValueError(
                    f"no learning rate for the slopes of {name!r}: attach(optimizer) with the slopes "
                    "in it, pass optimizer=..., or pass lr=... to the Sparsifier"
                )
            unit.slope.add_(lr * lam_t * w)
        self._project()

    def _project_budget(self, wanted: float) -> None:
        """Set the free slopes closest to 1 to exactly 1 so that ``round(wanted * C)`` stay nonlinear."""
        slopes = torch.cat([u.slope.detach().float() for _, u in self._units])
        frozen = torch.cat([u.frozen for _, u in self._units]).to(slopes.device)
        free = torch.isnan(frozen)
        total = slopes.numel()
        k = total - int(round(wanted * total))  # linear channels wanted
        k_free = min(max(k - int((frozen == 1).sum()), 0), int(free.sum()))
        prev = self._linear if self._linear is not None else torch.cat(self._linear_masks()).to(slopes.device)
        # rank free channels by slope, then by "was linear before" (stable sort = tie-break)
        candidates = torch.nonzero(free).squeeze(1)
        order = torch.sort(prev[candidates].to(torch.int8), descending=True, stable=True).indices
        candidates = candidates[order]
        order = torch.sort(slopes[candidates], descending=True, stable=True).indices
        ranked = candidates[order]
        new = slopes.clone()
        new[ranked[:k_free]] = 1.0
        beyond = ranked[k_free:]
        new[beyond] = torch.minimum(new[beyond], torch.tensor(1.0 - self.release))
        offset = 0
        for _, unit in self._units:
            n = unit.num_channels
            unit.slope.copy_(new[offset : offset + n].to(unit.slope))
            offset += n
        self._project()
        self._linear = torch.cat(self._linear_masks()).cpu()

    # ------------------------------------------------------------------ penalty and measures
    def penalty(self) -> torch.Tensor:
        """Differentiable ``lam_t * sum_c w_c * (1 - a_c)`` over free channels (scalar tensor).

        For ``mode="loss"``: add it to the loss before ``backward()``. See the module docs for
        how it differs from the proximal step.
        """
        lam_t = self.lam_at()
        terms = []
        for (_, unit), w in zip(self._units, self._weights):
            free = torch.isnan(unit.frozen)
            terms.append(w * ((1.0 - unit.slope) * free).sum())
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
            "linear": None if self._linear is None else torch.nonzero(self._linear).squeeze(1).tolist(),
            "channels": sum(u.num_channels for _, u in self._units),
            "lam": self.lam,
            "history": list(self.history),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` (slopes themselves live in the model's state dict)."""
        channels = sum(u.num_channels for _, u in self._units)
        if state["channels"] != channels:
            raise ValueError(f"state is for {state['channels']} channels, this model has {channels}")
        self.step_count = int(state["step_count"])
        self.initial_fraction = state["initial_fraction"]
        self._linear = None
        if state["linear"] is not None:
            self._linear = torch.zeros(channels, dtype=torch.bool)
            self._linear[torch.tensor(state["linear"], dtype=torch.long)] = True
        self.lam = float(state["lam"])
        self.history = list(state["history"])
        self._versions = [-1] * len(self._units)  # the model was loaded: do not warn on the next step


def flops_weights(model: nn.Module, example_inputs) -> dict[str, float]:
    """Per-unit cost: multiply-adds of the Linear/Conv call just before and just after it, per channel.

    Runs one forward pass on ``example_inputs`` (a tensor, a tuple of positional inputs or a
    dict of keyword inputs) and orders layer and unit calls by execution. A channel made linear
    lets these two layers fold, so its weight is ``(macs(prev) + macs(next)) / C`` (a heuristic;
    units without a neighbouring layer get the mean weight).
    """
    events: list[tuple[str, object]] = []
    hooks = []
    names = {id(u): n for n, u in require_units(model)}

    def layer_hook(module, args, out):
        if isinstance(out, torch.Tensor):  # weights x output positions per sample
            positions = out.numel() // max(out.shape[0], 1) // module.weight.shape[0]
            events.append(("layer", module.weight.numel() * positions))

    def unit_hook(module, args, out):
        events.append(("unit", names[id(module)]))

    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            hooks.append(module.register_forward_hook(layer_hook))
        elif id(module) in names:
            hooks.append(module.register_forward_hook(unit_hook))
    try:
        with torch.no_grad():
            if isinstance(example_inputs, Mapping):
                model(**example_inputs)
            elif isinstance(example_inputs, (tuple, list)):
                model(*example_inputs)
            else:
                model(example_inputs)
    finally:
        for h in hooks:
            h.remove()
    sizes = {n: u.num_channels for n, u in require_units(model)}
    cost: dict[str, float] = {}
    for i, (kind, value) in enumerate(events):
        if kind != "unit" or value in cost:
            continue
        before = next((v for k, v in reversed(events[:i]) if k == "layer"), 0)
        after = next((v for k, v in events[i + 1 :] if k == "layer"), 0)
        cost[value] = (before + after) / sizes[value]
    known = [c for c in cost.values() if c > 0]
    fill = sum(known) / len(known) if known else 1.0
    return {n: cost.get(n) or fill for n in sizes}


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
