"""Calibration: fit the affine linear ends of the units on data, and the one-shot linearization.

A unit at slope ``a = 1`` computes its channel's *linear end*: the identity ``x`` by default, or the
affine map ``alpha * x + beta`` set by :meth:`~linearize.unit.LinearizableActivation.set_linear_end`.
For a mostly inactive channel (``gelu(x) ~ 0`` on the data) the identity is the wrong end: replacing
``gelu(x)`` by ``x`` changes the next layer's input by ``x - gelu(x)``, where the least-squares fit
of ``gelu(x)`` by ``alpha * x + beta`` changes it by its residual only.

- :func:`fit_linear_ends`: per channel, the least-squares fit of ``act(x)`` on ``x`` over the
  calibration data (float64 sufficient statistics), set as every unit's linear end;
- :func:`one_shot`: choose, per unit, the channels whose replacement by their linear end changes the
  next layer's output least, and set them to ``a = 1`` (frozen there) with their fitted ends; then
  fine-tune the model as usual. ``end="hybrid"`` chooses per FFN, at a FLOP budget, between linear
  channels (affine ends, one ``d x d`` passthrough) and removed ones (constant ends, no passthrough).
  Then (``refit=True``) the layer each unit feeds is refit by least squares to give, from the unit's new
  output, what it gave from the old one on the same data: the reconstruction step of post-training pruning.

Only positions that are data count: when a batch is a mapping with an ``attention_mask`` ``[B, T]``
and a unit's input is ``[B, T, C]`` (channels last), the padded positions (mask 0) are left out.
"""

from __future__ import annotations

import copy
import math
import sys
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.nn.utils import parametrize

from .folding.layers import CONVS, dense_shape, dense_wb, is_dense, is_hf_conv1d, is_pointwise_conv
from .inputs import Batches, call_model, eval_mode, hooks, inputs_fit, model_device, num_rows
from .checks import is_real
from .unit import LinearizableActivation, nested_parts, require_units

__all__ = ["fit_linear_ends", "one_shot", "LinearEndFit", "OneShotSite", "FFNPlan", "RunningFit", "NonfiniteInputs"]

_ENDS = ("affine", "identity", "constant", "hybrid")


@dataclass
class LinearEndFit:
    """One unit's calibration statistics (float64 ``[C]`` tensors over ``count`` positions).

    ``alpha``, ``beta``: the least-squares fit ``act(x) ~ alpha * x + beta`` per channel (a constant
    channel, ``x`` the same at every position, gets ``alpha = 0`` and ``beta = act(x)``: exact);
    ``residual``: the mean square of ``act(x) - (alpha * x + beta)`` (the error of the affine end);
    ``identity_residual``: the mean square of ``act(x) - x`` (the error of the identity end);
    ``count``: the positions seen (a :class:`RunningFit`'s decayed, so effective, count);
    ``outgoing``: the squared norm of each channel's outgoing weights (the column of the layer the unit
    feeds), ``None`` where :func:`fit_linear_ends` did not look for it;
    ``mean``: the mean of ``act(x)`` (the best constant end, ``alpha = 0``: a removed channel);
    ``variance``: the mean square of ``act(x) - mean`` (the error of that constant end).
    """

    alpha: torch.Tensor
    beta: torch.Tensor
    residual: torch.Tensor
    identity_residual: torch.Tensor
    count: float
    outgoing: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    variance: torch.Tensor | None = None


class _Stats:
    """Sums of ``x, x^2, y, x * y, y^2`` per channel in float64 (``y = act(x)``) and their count (a float: a
    :class:`RunningFit` decays both); ``nonfinite_batch``: the first batch whose sums were not finite (where
    :meth:`add` is told the batch); ``dropped``: the rows left out as non-finite (a device tensor, counted in
    ``count``: the reader subtracts it), ``None`` before any."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None  # [5, C]
        self.count = 0.0
        self.nonfinite_batch: int | None = None
        self.dropped: torch.Tensor | None = None

    def add(self, x: torch.Tensor, y: torch.Tensor, batch: int | None = None, drop_nonfinite: bool = False) -> None:
        """Add rows ``x`` ``[P, C]`` and their activations ``y``; with ``batch`` (its index in the calibration
        data), remember it when its sums are not finite (one device sync). ``drop_nonfinite``: a row holding
        NaN/inf in ``x`` or ``y`` adds zeros, and is counted in ``dropped`` (no device sync)."""
        x, y = x.double(), y.double()
        if drop_nonfinite:
            bad = ~(torch.isfinite(x).all(1) & torch.isfinite(y).all(1))
            x, y = x.masked_fill(bad[:, None], 0.0), y.masked_fill(bad[:, None], 0.0)
            dropped = bad.sum()
            self.dropped = dropped if self.dropped is None else self.dropped + dropped.to(self.dropped.device)
        s = torch.stack([x.sum(0), (x * x).sum(0), y.sum(0), (x * y).sum(0), (y * y).sum(0)])
        if batch is not None and self.nonfinite_batch is None and not bool(torch.isfinite(s).all()):
            self.nonfinite_batch = batch
        self.sums = s if self.sums is None else self.sums + s.to(self.sums.device)
        self.count += x.shape[0]

    def merge(self, other: "_Stats") -> None:
        """Add ``other``'s sums, count and dropped rows to these."""
        if other.sums is not None:
            self.sums = other.sums if self.sums is None else self.sums + other.sums.to(self.sums.device)
        if other.dropped is not None:
            self.dropped = other.dropped if self.dropped is None else self.dropped + other.dropped.to(
                self.dropped.device)
        self.count += other.count

    def fit(self, name: str) -> LinearEndFit:
        if self.sums is None or self.count == 0:
            raise ValueError(f"unit {name!r} saw no data position (it was never called, or every position was "
                             "padding): calibrate on data that runs through it")
        if not bool(torch.isfinite(self.sums).all()):
            where = "" if self.nonfinite_batch is None else f" in batch {self.nonfinite_batch}"
            raise ValueError(f"the calibration data holds NaN/inf (or values too large for float64 sums): unit "
                             f"{name!r} saw non-finite inputs or activations{where} of data, so its fit is not "
                             "finite. Fix: drop or repair those samples")
        n = float(self.count)
        sx, sxx, sy, sxy, syy = self.sums.cpu()
        mx, my = sx / n, sy / n
        # centred sums, each a sum of squares or products of deviations (clamped at 0 against rounding)
        cxx = (sxx - sx * mx).clamp(min=0)
        cxy = sxy - sx * my
        cyy = (syy - sy * my).clamp(min=0)
        # a constant channel (x the same at every position, up to float64 rounding of the sums) has no slope
        constant = cxx <= 1e-12 * sxx.clamp(min=torch.finfo(torch.float64).tiny)
        alpha = torch.where(constant, torch.zeros_like(cxx), cxy / torch.where(constant, torch.ones_like(cxx), cxx))
        beta = my - alpha * mx
        residual = torch.where(constant, cyy, (cyy - alpha * cxy)).clamp(min=0) / n
        identity = ((syy - 2 * sxy + sxx) / n).clamp(min=0)
        return LinearEndFit(alpha, beta, residual, identity, n, mean=my, variance=cyy / n)


@dataclass
class _Channels:
    """What :func:`_outgoing_norms` reads of a unit: its channel count and axis (for an element unit's map)."""

    num_channels: int
    channel_dim: int = 1
    granularity: str = "channel"


def _outgoing_norms(layer: nn.Module, unit: LinearizableActivation, ndim: int) -> torch.Tensor | None:
    """Squared norm ``[C]`` of the weights of each of ``unit``'s channels in ``layer`` (a Linear, HF Conv1D or
    conv whose input, of ``ndim`` dims, is the unit's output), or None when the layer mixes other axes."""
    if unit.granularity == "element":  # a position of channel c feeds what channel c feeds: its norm, per position
        shape = unit.map_shape  # [C, *spatial] before a conv, [F] before a Linear
        per_channel = _outgoing_norms(layer, _Channels(shape[0], 1 if len(shape) > 1 else -1), ndim)
        return None if per_channel is None else per_channel.repeat_interleave(math.prod(shape[1:]))
    w, channels, dim = layer.weight.detach().double(), unit.num_channels, unit.channel_dim % ndim
    if dim != (1 if isinstance(layer, CONVS) else ndim - 1):
        return None
    if is_hf_conv1d(layer):
        return (w * w).sum(1) if w.shape[0] == channels else None
    if type(layer) is nn.Linear:
        return (w * w).sum(0) if w.shape[1] == channels else None
    if isinstance(layer, CONVS) and layer.in_channels == channels:
        groups = layer.groups
        per_group = (w * w).flatten(2).sum(2)  # [out, in / groups]
        out_per_group = layer.out_channels // groups
        return torch.cat([per_group[g * out_per_group:(g + 1) * out_per_group].sum(0) for g in range(groups)])
    return None


def _unit_rows(unit: LinearizableActivation, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """A unit's input ``x`` as ``[positions, C]`` rows (padding left out where ``mask`` ``[B, T]`` fits a
    channels-last ``[B, T, C]`` input; an element unit: a row per sample; a nested tensor: the rows of its
    :func:`~linearize.unit.nested_parts`, which hold no padding), or ``None`` when ``x`` does not fit the unit
    (its own call raises the clear error)."""
    if x.is_nested:
        parts = nested_parts(x, unit.channel_dim if unit.granularity == "channel" else None)
        rows = None if parts is None else [_unit_rows(unit, part, None) for part in parts]
        return None if rows is None or any(r is None for r in rows) else torch.cat(rows)
    dim = unit.channel_dim % x.ndim
    if unit.granularity == "element":  # one "channel" per position of the map: a row per sample
        return x.reshape(x.shape[0], unit.num_channels) if x.numel() == x.shape[0] * unit.num_channels else None
    if x.shape[dim] != unit.num_channels:
        return None
    if mask is not None and x.ndim == 3 and dim == 2 and tuple(x.shape[:2]) == tuple(mask.shape):
        return x[mask.to(x.device).bool()]
    return x.movedim(dim, -1).reshape(-1, x.shape[dim])


class _Hook:
    """A :class:`_Recorder`'s hook on a model's module (``hook``: the closure that records). A deep copy or a
    pickle of the module holds a hook that does nothing in its place: the closure records for the original
    module only, and holds the recorder, which does not pickle, so the model pickles (``torch.save(model)``)
    while it is recorded, and so do its copies. Retired (:func:`_retire`) inside a module call, it does nothing
    and removes itself at its next call."""

    def __init__(self, hook: Callable[..., None] | None = None) -> None:
        self.hook = hook
        self.handle: Any = None  # set by _retire: this hook, inert, removes itself at its next call

    def __call__(self, *args: Any) -> None:
        if self.hook is not None:
            self.hook(*args)
        elif self.handle is not None:  # torch calls a module's hooks from a copy of its dict: removing is safe here
            self.handle.remove()
            self.handle = None

    def __reduce__(self) -> tuple:
        return _Hook, ()

    def __deepcopy__(self, memo: dict) -> "_Hook":
        return _Hook()


def _module_call_running() -> bool:
    """Whether an ``nn.Module`` call is on this thread's stack (torch may be iterating a module's hook dict)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            return True
        frame = frame.f_back
    return False


_CALL_IMPL = nn.Module._call_impl.__code__


def _retire(handles: list, deferred: bool = False) -> None:
    """Remove the :class:`_Hook` hooks of ``handles`` (emptied). ``deferred`` (from a garbage collection's
    finalizer, which may run anywhere: while torch lists a module's hooks, while ``copy.deepcopy`` iterates a hook
    dict), or called inside a module call: the hooks are made inert instead and each removes itself at its next
    call, so no hook dict changes under an iteration."""
    later = deferred or _module_call_running()
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        wrapper = None if hooks is None else hooks.get(handle.id)
        if not later:
            handle.remove()
        elif isinstance(wrapper, _Hook):
            wrapper.hook, wrapper.handle = None, handle
    handles.clear()


class _Recorder:
    """Hooks that add every unit's input statistics to ``stats`` and, for the units named in ``consumers``,
    record which layers (Linear, HF Conv1D, conv) take the unit's output as their input (``fed``) and, with
    ``producers``, which layers' output is the unit's input (``fed_by``).
    ``mask``: the padding mask of the batch being run; ``outputs``: unit and layer outputs of the batch,
    cleared per batch (:meth:`clear`). ``training_only``: record only calls made in training mode, leaving out
    the rows (positions) whose input or activation holds NaN/inf (:class:`RunningFit`). ``batch``: the
    index of the batch being run (set by :func:`_run`; ``None`` for training batches), named by a non-finite fit."""

    def __init__(self, model: nn.Module, named: list[tuple[str, LinearizableActivation]], consumers: set[str],
                 training_only: bool = False, producers: bool = False) -> None:
        self.stats = {name: _Stats() for name, _ in named}
        self.fed: dict[str, list[tuple[nn.Module, int]]] = {name: [] for name in consumers}
        self.fed_by: dict[str, list[nn.Module]] = {name: [] for name in consumers}
        self.mask: torch.Tensor | None = None
        self.batch: int | None = None
        self.outputs: dict[int, tuple[str, torch.Tensor]] = {}
        self.layer_outputs: dict[int, tuple[nn.Module, torch.Tensor]] = {}
        self.training_only = training_only
        # hooks are closures, not bound methods (a bound method would carry the recorder, with the tensors it
        # holds, into a deep copy of the model), each wrapped in a _Hook: neither a deep copy (a teacher copied
        # from the student) nor a pickle of the model (torch.save(model)) takes it along
        self.handles = [u.register_forward_pre_hook(_Hook(self._stats_hook(n, u))) for n, u in named]
        self.layer_handles = [u.register_forward_hook(_Hook(self._output_hook(n, u)))
                              for n, u in named if n in consumers]
        if consumers:
            layers = [m for m in model.modules() if is_dense(m) or isinstance(m, CONVS)]
            self.layer_handles += [m.register_forward_pre_hook(_Hook(self._layer_hook(m))) for m in layers]
            if producers:
                self.layer_handles += [m.register_forward_hook(_Hook(self._layer_output_hook(m))) for m in layers]
                self.layer_handles += [u.register_forward_pre_hook(_Hook(self._producer_hook(n, u)))
                                       for n, u in named if n in consumers]

    def _stats_hook(self, name: str, unit: LinearizableActivation):
        def hook(mod, args):  # before the call: an in-place unit overwrites its input
            if mod is not unit or (self.training_only and not mod.training):  # a deep copy shares the hook
                return
            rows = _unit_rows(unit, args[0].detach(), self.mask)
            if rows is not None:
                with torch.no_grad():
                    self.stats[name].add(rows, unit.activation(rows), self.batch, drop_nonfinite=self.training_only)
        return hook

    def _layer_output_hook(self, layer: nn.Module):
        def hook(mod, args, out):
            if mod is layer and isinstance(out, torch.Tensor):
                self.layer_outputs[id(out)] = (layer, out)  # the tensor is held, so its id is not reused
        return hook

    def _producer_hook(self, name: str, unit: LinearizableActivation):
        def hook(mod, args):
            seen = self.layer_outputs.get(id(args[0])) if args and mod is unit else None
            if seen is not None and seen[1] is args[0] and all(m is not seen[0] for m in self.fed_by[name]):
                self.fed_by[name].append(seen[0])
        return hook

    def _output_hook(self, name: str, unit: LinearizableActivation):
        def hook(mod, args, out):
            if mod is unit:
                self.outputs[id(out)] = (name, out)  # the tensor is held, so its id is not reused
        return hook

    def _layer_hook(self, layer: nn.Module):
        def hook(mod, args) -> None:
            seen = self.outputs.get(id(args[0])) if args and mod is layer else None
            if seen is not None and seen[1] is args[0] and all(m is not layer for m, _ in self.fed[seen[0]]):
                self.fed[seen[0]].append((layer, args[0].ndim))
        return hook

    def clear(self) -> None:
        self.outputs.clear()
        self.layer_outputs.clear()

    def stop_finding_layers(self, deferred: bool = False) -> None:
        _retire(self.layer_handles, deferred)
        self.clear()

    def close(self, deferred: bool = False) -> None:
        """Remove the hooks (``deferred``: see :func:`_retire`)."""
        self.stop_finding_layers(deferred)
        _retire(self.handles, deferred)


@contextmanager
def _recording(model: nn.Module, named: list[tuple[str, LinearizableActivation]], consumers: set[str],
               producers: bool = False) -> Iterator[_Recorder]:
    """A :class:`_Recorder` for the block; its hooks are removed on exit, on an exception too."""
    recorder = _Recorder(model, named, consumers, producers=producers)
    try:
        yield recorder
    finally:
        recorder.close()


def _run(model: nn.Module, data: Any, recorder: Any) -> None:
    """Run ``data`` through ``model`` (eval mode, no grad) for a recorder's hooks: its ``mask`` is set to each
    batch's ``attention_mask`` (``None`` without one), a :class:`_Recorder`'s ``batch`` to the batch's index, and
    ``clear()`` is called after each batch."""
    with eval_mode(model), torch.no_grad():
        for index, inputs in enumerate(Batches.of(data).to(model_device(model))):
            if not num_rows(inputs):
                continue
            recorder.mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
            if isinstance(recorder, _Recorder):
                recorder.batch = index
            with inputs_fit(inputs, "data batch"):
                call_model(model, inputs)
            recorder.clear()


def _outgoing(unit: LinearizableActivation, layers: list[tuple[nn.Module, int]]) -> torch.Tensor | None:
    """Squared outgoing-weight norms ``[C]`` of a unit that feeds exactly one Linear / Conv1D / conv layer whose
    input channels are the unit's; else ``None``."""
    return _outgoing_norms(layers[0][0], unit, layers[0][1]) if len(layers) == 1 else None


def _calibrate(model: nn.Module, data: Any, named: list[tuple[str, LinearizableActivation]],
               consumers: set[str] = frozenset(), producers: bool = False) -> tuple[dict[str, LinearEndFit], _Recorder]:
    """:class:`LinearEndFit` per unit over ``data`` (eval mode, no grad), with the outgoing norms of the units
    named in ``consumers`` (the layer their output feeds is found on the data), and the (closed) recorder,
    whose ``fed`` / ``fed_by`` (with ``producers``) name the layers around those units. With ``producers``, a
    consumer without outgoing norms keeps ``outgoing=None`` (the caller raises)."""
    with _recording(model, named, set(consumers), producers) as rec:
        _run(model, data, rec)
    fits = {name: rec.stats[name].fit(name) for name, _ in named}
    for name, unit in named:
        if name in consumers:
            layers = rec.fed[name]
            norms = _outgoing(unit, layers)
            if norms is None and producers:  # an FFN's unit is checked by the caller (_ffn_layers), with its fix
                continue
            if norms is None:
                what = (f"feeds {len(layers)} layers ({', '.join(type(m).__name__ for m, _ in layers)})"
                        if len(layers) > 1 else f"feeds {type(layers[0][0]).__name__}, whose input channels are not "
                        "the unit's"
                        if layers else "feeds no Linear / Conv1D / conv layer directly")
                raise ValueError(
                    f"one_shot: the output of unit {name!r} {what}, so the outgoing weights of its channels are not "
                    f"known. Fix: pass outgoing={{{name!r}: <[{unit.num_channels}] squared norms of each channel's "
                    "outgoing weights>}, or leave the unit out (units=[...])")
            fits[name].outgoing = norms.cpu()
    return fits, rec


def _selected(model: nn.Module, units: Any, what: str) -> list[tuple[str, LinearizableActivation]]:
    found = require_units(model, what=what)
    if units is None:
        return found
    wanted = list(units)
    by_name = dict(found)
    missing = [n for n in wanted if n not in by_name]
    if missing:
        raise ValueError(f"{what}: no unit named {missing[:3]} in the model; its units are "
                         f"{[n for n, _ in found][:5]}{' ...' if len(found) > 5 else ''}")
    return [(n, by_name[n]) for n in dict.fromkeys(wanted)]


def fit_linear_ends(model: nn.Module, data: Any, units: list[str] | None = None) -> dict[str, LinearEndFit]:
    """Set every unit's linear end to the least-squares affine fit of its activation on ``data``.

    Per channel, ``alpha`` and ``beta`` minimise the mean of ``(act(x) - alpha * x - beta)^2`` over every
    sample and position of the unit's input ``x`` on ``data`` (padding excluded, see the module
    docstring): ``alpha = cov(x, act(x)) / var(x)``, ``beta = mean(act(x)) - alpha * mean(x)``, from sums of
    ``x, x^2, act(x), x * act(x)`` accumulated in float64. A constant channel gets ``alpha = 0`` and
    ``beta`` its constant activation. The model runs in eval mode without gradients; slopes do not change:
    a channel at ``a = 1`` now computes its fit, one at ``a = 0`` still its activation.

    Args:
        model: a converted model (``linearize.convert``).
        data: calibration data: a tensor batch, a mapping of keyword arguments, an ``(inputs, *targets)``
            pair or an iterable of such batches (:mod:`linearize.inputs`).
        units: names of the units to fit (default: all).

    Returns: ``{unit name: LinearEndFit}`` (the fit, its residual and the identity's, in float64).

    Example:
        >>> net = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)),
        ...                         example_inputs=torch.randn(2, 4))
        >>> fits = linearize.fit_linear_ends(net, torch.randn(256, 4))
        >>> bool((fits["1"].residual <= fits["1"].identity_residual).all())
        True
    """
    named = _selected(model, units, "fit_linear_ends")
    fits, _ = _calibrate(model, data, named)
    for name, unit in named:
        unit.set_linear_end(fits[name].alpha, fits[name].beta)
    return fits


class RunningFit:
    """The least-squares affine fit of every unit's activation on the batches a model *trains* on.

    What :func:`fit_linear_ends` computes on calibration data, kept up to date during training without any:
    forward pre-hooks add the statistics of every training-mode call of a unit (``x, x^2, act(x), ...`` per
    channel, float64) to the sums of the current step; :meth:`step` (once per optimizer step) folds them into
    running sums that decay by ``decay`` per step, a moving window of about ``1 / (1 - decay)`` steps (as
    BatchNorm's running statistics), summed over all processes first when ``torch.distributed`` is
    initialized (every process then holds the same fits). Every position counts (padding too: the hooks do
    not see the batch's mask; of a nested tensor, those of its sequences), but a position whose input or
    activation holds NaN/inf in any channel (NaN padding, a batch that overflowed) is left out of the unit's
    sums, so such positions do not end the fit;
    ``left_out`` counts them per unit (and the positions of a step whose float64 sums still overflowed: that
    step is dropped), ``empty_steps`` the steps whose training forwards held no position (empty batches). The
    forwards whose gradients no optimizer step took are left out whole, as if their batches had not been run:
    when a backward finds that the slopes' gradients of an earlier backward since the last :meth:`step` were
    dropped (set to ``None`` by ``zero_grad()``: the step a loss scaler such as ``torch.amp.GradScaler``
    skipped), the forwards before that earlier backward are left out (``skipped_batches`` counts those backwards;
    hooks on each slope's gradient, before and after it is accumulated into ``.grad``, no device sync; gradients
    zeroed in place, ``zero_grad(set_to_none=False)``, look accumulated and are kept, and so do the ones
    ``backward(create_graph=True)`` accumulates). The first training forward also finds the
    layer each unit's output feeds, for
    the outgoing weight norms of :meth:`fits` (``outgoing`` stays ``None`` for a unit that feeds no single
    Linear / Conv1D / conv layer). Eval-mode calls are not recorded. The :class:`~linearize.Sparsifier` uses
    one for ``select="fit"`` and ``linear_end="affine"``.

    Example:
        >>> net = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)),
        ...                         example_inputs=torch.randn(2, 4))
        >>> tracker = linearize.RunningFit(net)
        >>> for _ in range(3):
        ...     _ = net(torch.randn(64, 4)); tracker.step()
        >>> fit = tracker.fits()["1"]
        >>> fit.alpha.shape, fit.outgoing.shape, bool((fit.residual <= fit.identity_residual).all())
        (torch.Size([8]), torch.Size([8]), True)
        >>> tracker.close()
    """

    def __init__(self, model: nn.Module, units: list[str] | None = None, decay: float = 0.95) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must lie in [0, 1) (the running sums' factor per step), got {decay!r}")
        self.decay = float(decay)
        self._named = _selected(model, units, "RunningFit")
        self._recorder = _Recorder(model, self._named, {n for n, _ in self._named}, training_only=True)
        self._running: dict[str, _Stats] = {name: _Stats() for name, _ in self._named}
        self._outgoing: dict[str, torch.Tensor | None] | None = None  # found at the first step with data
        self.steps = 0
        self.left_out: dict[str, float] = {name: 0.0 for name, _ in self._named}  # NaN/inf positions, this run
        self.empty_steps = 0  # steps whose training forwards (empty batches) gave the units no position, this run
        self.skipped_batches = 0  # backwards (with their forwards) no optimizer step took, left out, this run
        # the statistics of the forwards before the backwards since the last step, and how many backwards
        self._backward: tuple[dict[str, _Stats], int] | None = None
        self._accumulated: set[int] = set()  # slope indices that got a gradient from a backward since the last step
        self._was_none: dict[int, bool] = {}  # slope index -> its .grad was None as this backward's gradient came
        trained = [(i, u.slope) for i, (_, u) in enumerate(self._named) if u.slope.requires_grad]
        self._grad_handles = [slope.register_hook(_Hook(self._gradient_hook(i, slope))) for i, slope in trained]
        self._grad_handles += [slope.register_post_accumulate_grad_hook(_Hook(self._backward_hook(i, slope)))
                               for i, slope in trained]

    def _gradient_hook(self, index: int, slope: torch.Tensor):
        # before the gradient is accumulated into .grad: whether zero_grad() dropped the earlier one (an object
        # identity test after it cannot tell: backward(create_graph=True) accumulates out of place, a new .grad)
        def hook(grad: torch.Tensor) -> None:
            self._was_none[index] = slope.grad is None
        return hook

    def _backward_hook(self, index: int, slope: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            if param is not slope or param.grad is None:
                return
            stats = self._recorder.stats
            if any(s.sums is not None for s in stats.values()):  # the first slope of a backward after forwards
                dropped = index in self._accumulated and self._was_none.get(index, False)
                if self._backward is not None and dropped:  # the earlier backward's gradient dropped, not stepped
                    self.skipped_batches += self._backward[1]
                    self._backward = None
                self._recorder.stats = {name: _Stats() for name in stats}
                if self._backward is None:
                    self._backward = (stats, 0)
                else:
                    for name, s in stats.items():
                        self._backward[0][name].merge(s)
                self._backward = (self._backward[0], self._backward[1] + 1)
            self._accumulated.add(index)
        return hook

    def _taken(self) -> dict[str, _Stats]:
        """This step's statistics without the forwards whose gradients were dropped (see the class docs)."""
        pending = self._recorder.stats
        if self._backward is not None:
            for name, s in self._backward[0].items():
                pending[name].merge(s)
        self._backward = None
        self._accumulated.clear()
        self._recorder.stats = {name: _Stats() for name, _ in self._named}
        return pending

    def step(self) -> None:
        """Fold this step's statistics into the running sums (all processes' summed under ``torch.distributed``),
        without the positions that held NaN/inf; a unit's step whose sums are still not finite is dropped (the
        running sums stay finite). Both are counted in ``left_out``."""
        pending = self._taken()
        if self._outgoing is None and any(s.count for s in pending.values()):
            self._outgoing = {n: (_outgoing(u, self._recorder.fed[n]) if self._recorder.fed[n] else None)
                              for n, u in self._named}
            self._outgoing = {n: None if v is None else v.cpu() for n, v in self._outgoing.items()}
            self._recorder.stop_finding_layers()
        self._recorder.clear()
        if all(s.sums is not None and s.count == 0 for s in pending.values()):
            self.empty_steps += 1
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1
        for name, unit in self._named:
            new, run = pending[name], self._running[name]
            sums = new.sums if new.sums is not None else torch.zeros(5, unit.num_channels, dtype=torch.float64,
                                                                      device=unit.slope.device)
            dropped = 0.0 if new.dropped is None else float(new.dropped)
            self.left_out[name] += dropped
            count = torch.tensor([new.count - dropped], dtype=torch.float64, device=sums.device)
            if distributed:
                torch.distributed.all_reduce(sums)
                torch.distributed.all_reduce(count)
            if not bool(torch.isfinite(sums).all()):  # after the reduction: every process drops it alike
                self.left_out[name] += new.count - dropped
                sums, count = torch.zeros_like(sums), torch.zeros_like(count)
            run.count = run.count * self.decay + float(count)
            sums = sums.cpu()
            run.sums = sums if run.sums is None else run.sums * self.decay + sums
        self.steps += 1

    def fits(self) -> dict[str, LinearEndFit]:
        """``{unit name: LinearEndFit}`` of the running sums, for every unit that has seen a position."""
        out = {}
        for name, _ in self._named:
            run = self._running[name]
            if run.sums is not None and run.count > 0:
                out[name] = run.fit(name)
                out[name].outgoing = None if self._outgoing is None else self._outgoing.get(name)
        return out

    def state_dict(self) -> dict:
        """The running sums (float64, CPU) and the outgoing weight norms measured at the first step, for an
        exact resume (measured again from the resumed weights, the norms would differ)."""
        outgoing = None if self._outgoing is None else {
            n: None if v is None else v.clone() for n, v in self._outgoing.items()}
        return {"decay": self.decay, "steps": self.steps, "outgoing": outgoing,
                "units": {n: {"count": s.count, "sums": None if s.sums is None else s.sums.clone()}
                          for n, s in self._running.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` (the same units; the sums checked finite and shaped ``[5, C]``)."""
        units = state.get("units") if isinstance(state, Mapping) else None
        if not isinstance(units, Mapping) or set(units) != set(self._running):
            raise ValueError(f"RunningFit state must hold the units {sorted(self._running)[:3]}..., got "
                             f"{sorted(units)[:3] if isinstance(units, Mapping) else type(units).__name__}")
        restored = {}
        for name, unit in self._named:
            entry, stats = units[name], _Stats()
            sums = entry.get("sums")
            count = entry.get("count")
            if not is_real(count) or not math.isfinite(count) or count < 0:
                raise ValueError(f"RunningFit state of unit {name!r}: count must be a finite number >= 0, got {count!r}")
            if sums is not None:
                sums = torch.as_tensor(sums, dtype=torch.float64)
                if tuple(sums.shape) != (5, unit.num_channels) or not torch.isfinite(sums).all():
                    raise ValueError(f"RunningFit state of unit {name!r}: sums must be finite, shaped "
                                     f"[5, {unit.num_channels}], got {tuple(sums.shape)}")
            stats.sums, stats.count = sums, float(count)
            restored[name] = stats
        outgoing = self._checked_outgoing(state.get("outgoing"))
        self._running = restored
        self.steps = int(state.get("steps", 0))
        if outgoing is not None:  # measured at the first step of the run: not again from the resumed weights
            self._outgoing = outgoing
            self._recorder.stop_finding_layers()

    def _checked_outgoing(self, outgoing: Any) -> dict[str, torch.Tensor | None] | None:
        """The outgoing weight norms of a :meth:`state_dict` (None: not measured yet, or a state saved before
        they were kept), each None or finite, >= 0, one per channel of its unit; else ``ValueError``."""
        if outgoing is None:
            return None
        if not isinstance(outgoing, Mapping) or set(outgoing) != set(self._running):
            raise ValueError(f"RunningFit state: outgoing must map the units {sorted(self._running)[:3]}... to "
                             f"their outgoing weight norms, got {type(outgoing).__name__}")
        checked: dict[str, torch.Tensor | None] = {}
        for name, unit in self._named:
            norms = outgoing[name]
            if norms is not None:
                norms = torch.as_tensor(norms, dtype=torch.float64)  # exact for any weights (the fits are float64)
                if norms.numel() != unit.num_channels or not torch.isfinite(norms).all() or (norms < 0).any():
                    raise ValueError(f"RunningFit state of unit {name!r}: outgoing norms must be {unit.num_channels} "
                                     f"finite numbers >= 0, got {tuple(norms.shape)}")
            checked[name] = norms
        return checked

    def close(self, deferred: bool = False) -> None:
        """Remove the hooks (the fits stay readable; ``deferred``: see :func:`_retire`)."""
        self._recorder.close(deferred)
        _retire(self._grad_handles, deferred)


@dataclass
class FFNPlan:
    """What ``one_shot(end="hybrid")`` chose for one FFN (the unit between two dense / 1x1 conv layers).

    ``mode``: ``"linear"`` (the linear channels keep their affine ends and, folded, share one ``d_in x d_out``
    passthrough) or ``"removed"`` (the linear channels are constants, ``alpha = 0``: folded, the FFN is just
    narrower); ``flops``, ``flops_full``: FLOPs per position of the folded FFN and of the dense one (2 per
    multiply-add, as :func:`~linearize.count_flops`): ``2 (d_in n + n d_out)``, plus ``2 d_in d_out`` in
    ``"linear"`` mode, against ``2 (d_in m + m d_out)``; ``errors``: each mode's measured calibration error
    (the mean over positions of the squared change of the second layer's output when that mode's channels
    all compute their ends, the others unchanged; ``None`` for ``"linear"`` where its passthrough alone is
    over the budget); ``d_in``, ``d_out``: the FFN's input and output widths; ``refit_errors``: with the refit,
    each mode's error after the refit of the second layer (on the data as the refits before it left the model),
    on which the mode was chosen; None where the FFN was not refit (the mode chosen on ``errors``).
    """

    mode: str
    flops: int
    flops_full: int
    errors: dict[str, float | None]
    d_in: int
    d_out: int
    refit_errors: dict[str, float | None] | None = None


@dataclass
class OneShotSite:
    """What :func:`one_shot` did to one unit: ``linear`` (bool ``[C]``, the channels set to ``a = 1``),
    ``score`` (float64 ``[C]``, each channel's predicted output error, see :func:`one_shot`), ``fit``,
    for ``end="hybrid"`` the FFN's ``plan`` (:class:`FFNPlan`), and ``refit``: the name of the layer refit
    after it, or why none was (``refit=True``; ``None`` with ``refit=False``)."""

    linear: torch.Tensor
    score: torch.Tensor
    fit: LinearEndFit
    plan: FFNPlan | None = None
    refit: str | None = None

    @property
    def nonlinear(self) -> int:
        return int((~self.linear).sum())


def _linear_channels(score: torch.Tensor, keep: int) -> torch.Tensor:
    """Bool ``[C]``: every channel but the ``keep`` highest-scored (equal scores keep the lower index first)."""
    linear = torch.ones(score.numel(), dtype=torch.bool)
    linear[torch.sort(score, descending=True, stable=True).indices[:keep]] = False
    return linear


def _set_linear(unit: LinearizableActivation, linear: torch.Tensor, freeze: bool) -> None:
    """Put channels ``linear`` at ``a = 1`` (frozen there with ``freeze``)."""
    mask = linear.to(unit.slope.device)
    if freeze:
        unit.freeze_(mask, 1.0)
    else:
        unit.slope[mask] = 1.0


@torch.no_grad()
def one_shot(
    model: nn.Module,
    data: Any,
    target: float | None = None,
    end: str = "affine",
    units: list[str] | None = None,
    outgoing: Mapping[str, torch.Tensor] | None = None,
    freeze: bool = True,
    flops: float | None = None,
    refit: bool = True,
) -> dict[str, OneShotSite]:
    """Linearize a converted model in one step from calibration data: per unit, keep the ``target``
    fraction of channels whose replacement would change the model most, and set the rest to ``a = 1``.

    The score of channel ``c`` of a unit that feeds the layer ``W`` (a Linear, HF Conv1D or conv; found
    by running ``data``) is the mean square error its replacement puts on that layer's output:
    ``score_c = E[(act(x_c) - end(x_c))^2] * ||W[:, c]||^2`` (the squared norm of the channel's outgoing
    weights, over every output and kernel tap), with ``E`` the mean over the calibration positions and
    ``end`` the channel's least-squares affine fit (``end="affine"``: :func:`fit_linear_ends`, and every
    unit gets the fitted ends), the identity (``end="identity"``: today's linear end, ends left as they
    are) or the channel's mean (``end="constant"``: ``alpha = 0, beta = E[act(x)]`` as fixed buffers, so the
    score is ``Var[act(x_c)] * ||W[:, c]||^2``; fold removes those channels and adds their means to the next
    layer's bias: structured pruning with mean compensation, and with the refit below, pruning with a
    reconstruction of the next layer). For a dense layer this is exactly the expected squared change of its output from that channel
    alone; channels are scored one at a time (their errors' correlations are ignored), and for a conv
    the residual is taken as uncorrelated across positions.

    The fraction is **per unit**: each unit keeps ``round(target * C)`` channels nonlinear (at least one
    where ``target > 0``). Channels already linear (``a = 1``) stay linear and the others are ranked, so a
    second call on the same data keeps the same channels (a unit with fewer channels left than the target
    keeps all of them, with a warning); ``end="hybrid"`` refuses a unit that has linear channels already. Scores of different units are errors at different layers, which the rest of
    the network amplifies differently, so ranking them against each other would not rank their effect on
    the model's output; a per-unit fraction also gives every FFN the same width, as the FLOP count of a
    fraction assumes. The nonlinear channels keep their slopes (0 after ``convert``).

    ``end="hybrid"`` takes a FLOP budget instead of ``target``: every unit must sit in an FFN (its input
    the output of one Linear / HF Conv1D / 1x1 conv, its output the input of one more), and each FFN gets at
    most ``flops`` times its FLOPs once folded (:func:`linearize.fold`). A folded FFN costs ``d_in n + n d_out``
    multiply-adds per position for ``n`` nonlinear channels, plus ``d_in d_out`` for the passthrough that its
    linear channels share, unless every linear channel is a constant (``alpha = 0``). So per FFN there are two
    plans: **linear** (pay the passthrough; the fewest nonlinear channels, the others at their affine fit,
    scored as ``end="affine"``) and **removed** (no passthrough; the most nonlinear channels, the others at
    their mean ``alpha = 0, beta = E[act(x)]``, scored by ``Var[act(x_c)] * ||W[:, c]||^2``). A second pass over
    ``data`` measures each plan's error, the mean squared change of the FFN's output with all of its channels
    replaced together, and the FFN takes the lower (the removed plan on a tie); with the refit (below),
    each refit FFN chooses again, on each plan's error after its own refit (pruning with a reconstruction of the
    second layer is then the removed plan's special case). A removed FFN's ends are fixed buffers
    (``set_linear_end(..., trainable=False)``, which save and load keep), so a fine-tune keeps its channels
    constants and its FLOPs; the plan is in each site's ``plan`` (:class:`FFNPlan`).

    Args:
        model: a converted model (``linearize.convert``); changed in place.
        data: calibration data (the forms of :func:`fit_linear_ends`).
        target: fraction of each unit's channels left nonlinear, in ``[0, 1]`` (default 0.25; not with
            ``end="hybrid"``).
        end: ``"affine"`` (default), ``"identity"``, ``"constant"`` or ``"hybrid"``.
        units: names of the units to linearize (default: all).
        outgoing: ``{unit name: [C] squared outgoing-weight norms}`` for units whose output does not feed
            one Linear / Conv1D / conv layer directly (then they are not looked up; not with ``"hybrid"``).
        freeze: freeze the linearized channels at ``a = 1`` (:meth:`~linearize.unit.LinearizableActivation.freeze_`),
            so that a fine-tune trains the weights and the linear ends but keeps the fraction; ``False``
            leaves the slopes free.
        flops: with ``end="hybrid"`` only: the fraction of each FFN's FLOPs its folded form may cost, in ``[0, 1]``.
        refit: then refit the layer each unit feeds (see below).

    **Refit** (``refit=True``, default): one more pass over ``data`` gathers, per unit whose output is the
    whole input of one Linear / HF Conv1D / 1x1 conv (and nothing else's), the normal equations of the least
    squares problem ``min ||u W'^T + c - v W^T||^2 + r ||W' - W||^2`` over every position: ``u`` the
    unit's new output (nonlinear channels ``act(x)``, linear ones their ends), ``v W^T`` what the layer
    computed from the unit's output before this call; then ``W <- W'`` and the bias ``b <- b + c`` (no ``c`` for a layer
    without bias), solved in float64, ``r`` = ``1e-3`` times the mean of ``u``'s squares (a ridge towards
    the layer's own weights). The layers are refit one after the other in model order, each on the data as the
    refits before it left the model (so a deep stack's refits make up for each other's errors: one pass per
    refit layer). A unit that computes what it did leaves its layer as it is (``one_shot`` again on a unit whose input did not change changes nothing). A linear channel's contribution is affine in
    the FFN's input, so the refit finds the best passthrough (not only per-channel ends) and re-weights the
    nonlinear channels to make up for the others; the folded FLOPs do not change. Measured on MiniLM-L6
    (0.375x FFN FLOPs, 1,024 calibration sentences, no fine-tune): mean cosine to the original 0.90 without,
    0.96 with it (``recipes/benchmarks/hybrid_one_shot.py``). Units feeding anything else, element units, layers
    wider than 8,192 inputs (the normal equations take ``(C + 1)^2`` float64), layers whose weight a hook or
    parametrization computes (``weight_norm``, ``prune``), weights tied to another module and units whose output is
    0 on all the data are not refit; each
    site's ``refit`` says which layer was, or why not.

    A call that raises leaves the model as it was (slopes, frozen flags, ends and refit layers put back).

    Returns: ``{unit name: OneShotSite}``.

    Example:
        >>> net = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)),
        ...                         example_inputs=torch.randn(2, 4))
        >>> sites = linearize.one_shot(net, torch.randn(256, 4), target=0.25)
        >>> sites["1"].nonlinear, linearize.nonlinear_fraction(net)
        (2, 0.25)
        >>> fresh = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)),
        ...                           example_inputs=torch.randn(2, 4))
        >>> plan = linearize.one_shot(fresh, torch.randn(256, 4), end="hybrid", flops=0.5)["1"].plan
        >>> plan.mode in ("linear", "removed"), plan.flops <= 0.5 * plan.flops_full
        (True, True)
    """
    undo = _Undo()
    try:
        return _one_shot(model, data, target, end, units, outgoing, freeze, flops, refit, undo)
    except BaseException:  # a failed call leaves the model as it was
        undo.restore()
        raise


class _Undo:
    """What :func:`one_shot` may change, kept to put back when it fails: each unit's parameters and buffers (the
    same tensors, with their values) and each refit layer's weight and bias, kept before the refit writes them."""

    def __init__(self) -> None:
        self.units: list[tuple[nn.Module, dict, dict, dict[str, torch.Tensor]]] = []
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep_units(self, named: list[tuple[str, LinearizableActivation]]) -> None:
        for _, unit in named:
            tensors = {**{k: t for k, t in unit._buffers.items() if t is not None},
                       **{k: t for k, t in unit._parameters.items() if t is not None}}
            self.units.append((unit, dict(unit._parameters), dict(unit._buffers),
                               {k: t.detach().clone() for k, t in tensors.items()}))

    def keep_layer(self, layer: nn.Module) -> None:
        self.layers += [(p, p.detach().clone()) for p in (layer.weight, layer.bias) if p is not None]

    @torch.no_grad()
    def restore(self) -> None:
        for p, value in self.layers:
            p.copy_(value)
        for unit, parameters, buffers, values in self.units:
            unit._parameters.clear()
            unit._parameters.update(parameters)
            unit._buffers.clear()
            unit._buffers.update(buffers)
            for k, value in values.items():
                t = parameters.get(k)
                (buffers[k] if t is None else t).copy_(value)


def _one_shot(model: nn.Module, data: Any, target: float | None, end: str, units: list[str] | None,
              outgoing: Mapping[str, torch.Tensor] | None, freeze: bool, flops: float | None, refit: bool,
              undo: _Undo) -> dict[str, OneShotSite]:
    """:func:`one_shot` (under its ``no_grad``), keeping in ``undo`` what it changes."""
    if end not in _ENDS:
        raise ValueError(f"end must be one of {_ENDS}, got {end!r}")
    if end == "hybrid":
        if target is not None:
            raise ValueError(f"one_shot(end='hybrid') takes a FLOP budget, flops=<fraction of each FFN's FLOPs>, "
                             f"not target={target!r} (the budget sets each FFN's nonlinear channels)")
        if outgoing is not None:
            raise ValueError("one_shot(end='hybrid') measures each FFN's error through its second layer, found on the "
                             "data: outgoing= is not used, leave it out")
        if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not 0.0 <= flops <= 1.0:
            raise ValueError(f"flops must be a fraction in [0, 1] (of each FFN's FLOPs, its folded form's budget), "
                             f"got {flops!r}")
        named = _selected(model, units, "one_shot")
        undo.keep_units(named)
        started = [n for n, u in named if bool(u.linear_mask(name=n).any())]
        if started:
            raise ValueError(f"one_shot(end='hybrid') plans every FFN from the start, and unit(s) {started[:3]} already "
                             "have linear channels (a = 1), which its plans would change. Fix: run it on a freshly "
                             "converted model (linearize.convert of the original)")
        before = _snapshot(named, refit)
        sites, options = _hybrid(model, data, float(flops), named, freeze)
        return _refit(model, data, named, sites, before, undo, options, freeze)
    if flops is not None:
        raise ValueError(f"flops={flops!r} is the budget of end='hybrid'; end={end!r} takes target= (the fraction of "
                         "each unit's channels kept nonlinear)")
    target = 0.25 if target is None else target
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 <= target <= 1.0:
        raise ValueError(f"target must be a fraction in [0, 1] (of each unit's channels kept nonlinear), got {target!r}")
    named = _selected(model, units, "one_shot")
    undo.keep_units(named)
    before = _snapshot(named, refit)
    given = dict(outgoing or {})
    unknown = sorted(set(given) - {n for n, _ in named})
    if unknown:
        raise ValueError(f"one_shot: outgoing names {unknown[:3]}, which are not units being linearized")
    fits, _ = _calibrate(model, data, named, consumers={n for n, _ in named if n not in given})
    result: dict[str, OneShotSite] = {}
    short: list[str] = []
    for name, unit in named:
        fit = fits[name]
        if name in given:
            norms = torch.as_tensor(given[name], dtype=torch.float64).cpu()
            if tuple(norms.shape) != (unit.num_channels,):
                raise ValueError(f"one_shot: outgoing[{name!r}] must have shape [{unit.num_channels}], "
                                 f"got {tuple(norms.shape)}")
            fit.outgoing = norms
        residual = {"affine": fit.residual, "identity": fit.identity_residual, "constant": fit.variance}[end]
        score = residual * fit.outgoing
        keep = 0 if target == 0 else max(1, round(target * unit.num_channels))
        already = unit.linear_mask(name=name).cpu()  # linear channels stay linear: ranked among the others
        free = int((~already).sum())
        if keep > free:
            short.append(f"{name} ({free} of {keep})")
        linear = _linear_channels(score.masked_fill(already, -math.inf), min(keep, free))
        if end == "affine":
            unit.set_linear_end(fit.alpha, fit.beta)
        elif end == "constant":  # removed channels: their constants stay constants in a fine-tune
            unit.set_linear_end(*_ends(fit, "removed"), trainable=False)
        _set_linear(unit, linear, freeze)
        result[name] = OneShotSite(linear, score, fit)
    if short:
        warnings.warn(f"one_shot(target={target}): {len(short)} unit(s) had fewer channels left nonlinear than the "
                      f"target keeps, so all of those stay nonlinear: {', '.join(short[:5])}. Linear channels (a = 1) "
                      "are not made nonlinear again; to start over, convert the original model",
                      stacklevel=4)  # the caller of one_shot (through its no_grad wrapper)
    return _refit(model, data, named, result, before, undo)


def _is_ffn_layer(m: nn.Module) -> bool:
    return is_dense(m) or (type(m) is nn.Conv2d and is_pointwise_conv(m))


def _ffn_layers(name: str, unit: LinearizableActivation, rec: _Recorder, fit: LinearEndFit
                ) -> tuple[nn.Module, nn.Module]:
    """The (first, second) layers of the FFN around ``unit``, found on the data, or a ``ValueError``."""
    before, after = rec.fed_by[name], [m for m, _ in rec.fed[name]]
    if len(before) == 1 and len(after) == 1 and _is_ffn_layer(before[0]) and _is_ffn_layer(after[0]) and \
            is_dense(before[0]) == is_dense(after[0]) and fit.outgoing is not None and \
            dense_shape(before[0])[0] == unit.num_channels == dense_shape(after[0])[1]:
        return before[0], after[0]
    names = lambda ms: ", ".join(type(m).__name__ for m in ms) or "no layer"  # noqa: E731
    raise ValueError(
        f"one_shot(end='hybrid'): unit {name!r} is not the middle of an FFN (one Linear / HF Conv1D / 1x1 Conv2d "
        f"with {unit.num_channels} outputs into it, one with {unit.num_channels} inputs out of it, on the unit's "
        f"channel axis): it "
        f"is fed by {names(before)} and feeds {names(after)}, so its FLOPs are not an FFN's. Fix: leave it out "
        "(units=[...]), or use end='affine' with target=")


def _plans(d_in: int, channels: int, d_out: int, flops: float) -> dict[str, int]:
    """``{mode: nonlinear channels}`` of the plans within ``flops`` of an FFN's multiply-adds (``"linear"``
    only where its passthrough fits); a fraction's float rounding is forgiven (1e-9 of a channel)."""
    budget = flops * (d_in + d_out) * channels
    plans = {"removed": min(channels, math.floor(budget / (d_in + d_out) + 1e-9))}
    linear = math.floor((budget - d_in * d_out) / (d_in + d_out) + 1e-9)
    if linear >= 0:
        plans["linear"] = min(channels, linear)
    return plans


def _ends(fit: LinearEndFit, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(alpha, beta)`` of a mode's linear channels: the affine fit, or the constant mean (``alpha = 0``)."""
    return (fit.alpha, fit.beta) if mode == "linear" else (torch.zeros_like(fit.mean), fit.mean)


class _ModeErrors:
    """Hooks summing, per unit and mode, the squared change of the second layer's output (float64) when the
    mode's linear channels compute their ends and the others their activation, over the data's positions
    (padding left out: ``mask``, set per batch by :func:`_run`)."""

    def __init__(self, weights: dict[str, torch.Tensor],
                 modes: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]) -> None:
        self.weights, self.modes = weights, modes  # weights: [d_out, C]; modes: {mode: (linear, alpha, beta)}
        self.sums = {name: {mode: 0.0 for mode in by_mode} for name, by_mode in modes.items()}
        self.count = {name: 0 for name in modes}
        self.mask: torch.Tensor | None = None

    def hook(self, name: str, unit: LinearizableActivation):
        def pre(mod, args):
            rows = _unit_rows(unit, args[0].detach(), self.mask) if mod is unit else None
            if rows is None:
                return
            y = unit.activation(rows).double()
            x = rows.double()
            w = self.weights[name].to(x.device)
            for mode, (linear, alpha, beta) in self.modes[name].items():
                lin = linear.to(x.device)
                change = (alpha.to(x.device)[lin] * x[:, lin] + beta.to(x.device)[lin] - y[:, lin]) @ w[:, lin].T
                self.sums[name][mode] += float((change * change).sum())
            self.count[name] += rows.shape[0]
        return pre

    def clear(self) -> None:
        """Nothing is held across a batch (the sums are totals)."""

    def errors(self) -> dict[str, dict[str, float]]:
        return {name: {mode: total / max(self.count[name], 1) for mode, total in by_mode.items()}
                for name, by_mode in self.sums.items()}


_Options = dict[str, dict[str, tuple[OneShotSite, torch.Tensor, torch.Tensor]]]


def _hybrid(model: nn.Module, data: Any, flops: float, named: list[tuple[str, LinearizableActivation]],
            freeze: bool) -> tuple[dict[str, OneShotSite], _Options]:
    """``one_shot(end="hybrid")``: per FFN, the linear or the removed plan, whichever errs less on ``data``; and
    every FFN's plans, ``{unit name: {mode: (site, alpha, beta)}}``, for the refit to choose again."""
    fits, rec = _calibrate(model, data, named, consumers={n for n, _ in named}, producers=True)
    weights, options = {}, {}
    for name, unit in named:
        fit = fits[name]
        first, second = _ffn_layers(name, unit, rec, fit)
        d_in, d_out = dense_shape(first)[1], dense_shape(second)[0]
        weights[name] = dense_wb(second)[0]
        options[name] = {}
        for mode, keep in _plans(d_in, unit.num_channels, d_out, flops).items():
            score = (fit.residual if mode == "linear" else fit.variance) * fit.outgoing
            linear = _linear_channels(score, keep)
            alpha, beta = _ends(fit, mode)
            n = int((~linear).sum())
            plan = FFNPlan(mode, 2 * (n * (d_in + d_out) + (d_in * d_out if mode == "linear" else 0)),
                           2 * unit.num_channels * (d_in + d_out), {}, d_in, d_out)
            options[name][mode] = (OneShotSite(linear, score, fit, plan), alpha, beta)
    measured = _ModeErrors(weights, {name: _ends_of(plans) for name, plans in options.items()})
    with hooks() as handles:
        handles += [unit.register_forward_pre_hook(measured.hook(name, unit)) for name, unit in named]
        _run(model, data, measured)
    errors = measured.errors()
    result: dict[str, OneShotSite] = {}
    for name, unit in named:
        err = {"linear": errors[name].get("linear"), "removed": errors[name]["removed"]}
        for site, _, _ in options[name].values():
            site.plan.errors = err
        result[name] = _use_mode(unit, options[name][_lower(err)], freeze)
    return result, options


def _ends_of(plans: dict[str, tuple[OneShotSite, torch.Tensor, torch.Tensor]]
             ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``{mode: (linear channels, alpha, beta)}`` of an FFN's plans."""
    return {mode: (site.linear, alpha, beta) for mode, (site, alpha, beta) in plans.items()}


def _lower(errors: dict[str, float | None]) -> str:
    """The mode with the lower error (``"removed"`` on a tie or where ``"linear"`` has none)."""
    linear = errors.get("linear")
    return "linear" if linear is not None and linear < errors["removed"] else "removed"


def _use_mode(unit: LinearizableActivation, option: tuple[OneShotSite, torch.Tensor, torch.Tensor],
              freeze: bool) -> OneShotSite:
    """Set ``unit`` to one hybrid plan: its linear channels at ``a = 1`` with the plan's ends."""
    site, alpha, beta = option
    unit.set_linear_end(alpha, beta, trainable=site.plan.mode == "linear")  # a removed FFN's constants stay constants
    _set_linear(unit, site.linear, freeze)
    return site


REFIT_MAX_INPUTS = 8192  # the normal equations of a wider layer ((C + 1)^2 float64) are not gathered
_RIDGE = 1e-3


class _Refit:
    """Hooks gathering the normal equations of the least-squares refit of the layer ``unit`` feeds (float64), per
    option: ``gram`` = ``U1^T U1`` and ``cross`` = ``U1^T (v W^T)``, ``U1`` the unit's new output with a column of
    ones, ``v`` the output of ``before`` (the unit as it was before :func:`one_shot`); ``energy``: the sum of
    ``(v W^T)^2``, ``count``: the positions; ``foreign``: the layer also took an input that was not the unit's
    output (not refit). ``options``: a hybrid FFN's plans, ``{mode: (linear, alpha, beta)}``, each gathered with
    its linear channels at their ends; None: the unit's output as it is (key None)."""

    def __init__(self, unit: LinearizableActivation, layer: nn.Module, before: LinearizableActivation,
                 options: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.unit, self.layer, self.before, self.options = unit, layer, before, options
        self.weight = dense_wb(layer)[0]  # before any change
        self.gram: dict[str | None, torch.Tensor] = {}
        self.cross: dict[str | None, torch.Tensor] = {}
        self.energy, self.count = 0.0, 0
        self.output: torch.Tensor | None = None
        self.foreign = False
        self.mask: torch.Tensor | None = None

    def _outputs(self, rows: torch.Tensor) -> dict[str | None, torch.Tensor]:
        """The unit's new output of ``rows`` ([P, C], float64) per option."""
        if self.options is None:  # the units' own forward (no hooks)
            return {None: _forward_rows(self.unit, rows)}
        x, y = rows.double(), self.unit.activation(rows.clone()).double()
        return {mode: torch.where(linear.to(x.device), alpha.to(x.device) * x + beta.to(x.device), y)
                for mode, (linear, alpha, beta) in self.options.items()}

    def unit_pre(self, mod, args) -> None:
        rows = _unit_rows(self.unit, args[0].detach(), self.mask) if mod is self.unit else None
        if rows is None:
            return
        target = _forward_rows(self.before, rows) @ self.weight.to(rows.device).T
        self.energy += float((target * target).sum())
        self.count += rows.shape[0]
        for key, new in self._outputs(rows).items():
            u1 = torch.cat([new, new.new_ones(new.shape[0], 1)], 1)
            self.gram[key] = u1.T @ u1 + self.gram.get(key, 0)
            self.cross[key] = u1.T @ target + self.cross.get(key, 0)

    def unit_post(self, mod, args, out) -> None:
        if mod is self.unit:
            self.output = out  # held until the batch ends: its id is not reused

    def layer_pre(self, mod, args) -> None:
        if mod is self.layer and (self.output is None or not args or args[0] is not self.output):
            self.foreign = True

    def clear(self) -> None:
        self.output = None


def _forward_rows(unit: LinearizableActivation, rows: torch.Tensor) -> torch.Tensor:
    """A channel unit's forward (no hooks) of ``rows`` ``[P, C]``, as float64 ``[P, C]``: the rows laid out as the
    unit's inputs, ``P`` samples with the channels at its ``channel_dim`` and size-1 axes elsewhere (a unit built on
    ``[N, C, H, W]`` inputs refuses 2-D ones); a copy, which an in-place unit may overwrite."""
    ndim = max(unit.input_ndim or 2, 2)
    dim = unit.channel_dim % ndim
    x = rows.reshape(*rows.shape, *[1] * (ndim - 2)).movedim(1, dim).clone()
    return unit.forward(x).movedim(dim, 1).reshape(rows.shape).double()


def _refit_target(name: str, unit: LinearizableActivation, rec_fed: list[tuple[nn.Module, int]]) -> nn.Module | str:
    """The layer ``unit`` feeds that a refit may change, or why there is none."""
    if unit.granularity == "element":
        return "an element unit (not refit)"
    if len(rec_fed) != 1:
        return f"feeds {len(rec_fed)} layers (not refit)"
    layer, ndim = rec_fed[0]
    dim = unit.channel_dim % ndim
    if not (is_dense(layer) and dim == ndim - 1 or type(layer) in CONVS and is_pointwise_conv(layer) and dim == 1):
        return f"feeds a {type(layer).__name__} that is not a dense map of its channels (not refit)"
    if dense_shape(layer)[1] != unit.num_channels:
        return f"feeds a {type(layer).__name__} whose input is not the unit's channels (not refit)"
    if unit.num_channels > REFIT_MAX_INPUTS:
        return f"feeds a layer of {unit.num_channels} inputs, more than {REFIT_MAX_INPUTS} (not refit)"
    return layer


@torch.no_grad()
def _snapshot(named: list[tuple[str, LinearizableActivation]], refit: bool) -> dict[str, LinearizableActivation] | None:
    """Copies of the units as they are before :func:`one_shot` changes them (what the refit aims at), or None."""
    return {name: copy.deepcopy(unit) for name, unit in named} if refit else None


def _unchanged(unit: LinearizableActivation, before: LinearizableActivation) -> bool:
    """Whether ``unit`` computes what ``before`` did: the same slopes, and the same linear ends wherever a slope
    uses them (above 0; the identity is ``alpha = 1, beta = 0``)."""
    if not torch.equal(unit.slope, before.slope):
        return False
    used = unit.slope.detach() != 0
    ends = [u.linear_end or (torch.ones_like(u.slope), torch.zeros_like(u.slope)) for u in (unit, before)]
    return all(torch.equal(a[used], b[used]) for a, b in zip(*ends))


def _owners(model: nn.Module) -> dict[int, list[str]]:
    """``{id(parameter): names of the modules holding it}`` (a weight tied between modules has several)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None and name not in owners.setdefault(id(p), []):
                owners[id(p)].append(name)
    return owners


def _refit_layer(layer: nn.Module, owners: dict[int, list[str]]) -> str | None:
    """Why ``layer`` may not be refit (its weight computed by a hook or parametrization, or shared), or None."""
    if parametrize.is_parametrized(layer) or layer._forward_pre_hooks or any(
            hasattr(layer, n) for n in ("weight_orig", "weight_g", "weight_v")):
        return "its layer's weight is computed by a hook or parametrization (weight_norm, prune): not refit"
    for p in (layer.weight, layer.bias):
        held = owners.get(id(p), []) if p is not None else []
        if len(held) > 1:
            return f"its layer's parameters are shared with {held[1]!r}: not refit"
    return None


@torch.no_grad()
def _refit(model: nn.Module, data: Any, named: list[tuple[str, LinearizableActivation]],
           sites: dict[str, OneShotSite], before: dict[str, LinearizableActivation] | None, undo: _Undo,
           options: _Options | None = None, freeze: bool = True) -> dict[str, OneShotSite]:
    """:func:`one_shot`'s refit of the layer each unit feeds (see its docstring), unit after unit in model order,
    each on the data as the refits before it left the model; sets each site's ``refit``. With a hybrid's
    ``options``, each refit FFN takes the plan whose refit errs less (then ``plan.refit_errors``)."""
    if before is None:
        return sites
    with _recording(model, named, {n for n, _ in named}) as rec:  # which layer each unit's output feeds
        _run(model, data, rec)
        fed = dict(rec.fed)
    owners, names = _owners(model), {id(m): n for n, m in model.named_modules()}
    for name, unit in named:
        target = _refit_target(name, unit, fed.get(name, []))
        if _unchanged(unit, before[name]):
            target = "the unit computes what it did (not refit)"
        elif not isinstance(target, str):
            target = _refit_layer(target, owners) or target
        if isinstance(target, str):
            sites[name].refit = target
            continue
        plans = options.get(name) if options else None
        refits = _Refit(unit, target, before[name], None if plans is None else _ends_of(plans))
        with hooks() as handles:
            handles += [unit.register_forward_pre_hook(refits.unit_pre), unit.register_forward_hook(refits.unit_post),
                        target.register_forward_pre_hook(refits.layer_pre)]
            _run(model, data, refits)
        solved = {key: _solve(refits, key) for key in refits.gram} or {None: "no data reached it (not refit)"}
        reason = next((s for s in solved.values() if isinstance(s, str)), None)
        if reason is None and plans is not None:  # choose the plan again, on its error after the refit
            errors = {mode: solved[mode][1] if mode in solved else None for mode in ("linear", "removed")}
            mode = _lower(errors)
            if mode != sites[name].plan.mode:
                unit.slope.copy_(before[name].slope)
                unit.frozen.copy_(before[name].frozen)
                sites[name] = _use_mode(unit, plans[mode], freeze)
            for site, _, _ in plans.values():
                site.plan.refit_errors = errors
            solved = {None: solved[mode]}
        if reason is not None:
            sites[name].refit = reason
            continue
        weight, _ = next(iter(solved.values()))
        undo.keep_layer(target)
        _write_dense(target, weight[:unit.num_channels].T,
                     weight[unit.num_channels] if target.bias is not None else None)
        sites[name].refit = names.get(id(target), type(target).__name__)
    return sites


def _solve(refits: _Refit, key: str | None) -> tuple[torch.Tensor, float] | str:
    """The refit of option ``key`` from the gathered normal equations: the solution (``[C (+1), out]``: the
    weights, transposed, and the bias shift where the layer has a bias) and its error (the mean over positions
    of the squared change of the layer's output from its target), or why there is none."""
    if refits.foreign:
        return "its layer takes other inputs too (not refit)"
    gram, cross = refits.gram[key], refits.cross[key]
    if refits.layer.bias is None:  # no intercept: the column of ones is left out
        gram, cross = gram[:-1, :-1], cross[:-1]
    k = refits.unit.num_channels
    if not bool(torch.isfinite(gram).all() and torch.isfinite(cross).all()):
        return "its input or its layer's output is not finite on the data (not refit)"
    ridge = _RIDGE * float(gram.diagonal()[:k].mean())  # towards the layer's own weights
    if not ridge > 0:  # the unit's output is 0 at every position: the normal equations are singular
        return "its input is 0 on the data (not refit)"
    ridged, rhs = gram.clone(), cross.clone()
    ridged.diagonal()[:k] += ridge
    rhs[:k] += ridge * refits.weight.to(cross.device).T
    try:
        solution = torch.linalg.solve(ridged, rhs)
    except torch.linalg.LinAlgError:
        solution = None
    if solution is None or not bool(torch.isfinite(solution).all()):
        return "its normal equations could not be solved in float64 (not refit)"
    error = refits.energy - 2 * float((solution * cross).sum()) + float((solution * (gram @ solution)).sum())
    return solution, max(error, 0.0) / max(refits.count, 1)


def _write_dense(layer: nn.Module, w: torch.Tensor, shift: torch.Tensor | None) -> None:
    """Put ``w [out, in]`` (float64) in a Linear / HF Conv1D / pointwise conv and add ``shift`` to its bias."""
    weight = w.T if is_hf_conv1d(layer) else w.reshape(layer.weight.shape)
    layer.weight.copy_(weight.to(layer.weight.dtype))
    if shift is not None:
        layer.bias.add_(shift.to(layer.bias.dtype))


class NonfiniteInputs:
    """Where NaN/inf entered a model's training forwards since :meth:`clear`: per unit, the positions whose input
    held NaN/inf (counted on the device, no sync), the order the units and the modules holding parameters first
    ran, and whether every tensor input of the first of them to run (the batch) was finite. Forward pre-hooks,
    training-mode calls only; the :class:`~linearize.Sparsifier` keeps one for every selection to name where a
    divergence began (:meth:`cause`) and :meth:`close` s it when it is dropped. The hooks hold it weakly: once it
    is gone they do nothing."""

    def __init__(self, model: nn.Module, named: list[tuple[str, LinearizableActivation]]) -> None:
        units = {id(u) for _, u in named}
        self._layers = {n: m for n, m in model.named_modules()
                        if id(m) not in units and next(m.parameters(recurse=False), None) is not None}
        # every module in registration order, a parameter-less leaf marked: named as a candidate when NaN/inf arose
        # where no layer holds any (an operation such as x / 0)
        self._tree = [(n, id(m) in units, not list(m.children()) and next(m.parameters(), None) is None)
                      for n, m in model.named_modules()]
        self.ran: dict[str, bool] = {}  # name -> is a unit, in the order the training forwards first ran them
        self.bad: dict[str, torch.Tensor] = {}  # unit -> positions whose input held NaN/inf
        self.batch_finite: torch.Tensor | None = None  # every tensor input of the first module to run was finite
        # hooks in _Hook wrappers, as the _Recorder's: a deep copy or pickle of the model does not take them along
        ref = weakref.ref(self)
        self.handles = [module.register_forward_pre_hook(_Hook(self._hook(ref, name, module, True)))
                        for name, module in named]
        self.handles += [module.register_forward_pre_hook(_Hook(self._hook(ref, name, module, False)))
                         for name, module in self._layers.items()]

    @staticmethod
    def _hook(ref: weakref.ref, name: str, module: nn.Module, is_unit: bool):
        def hook(mod, args):
            self = ref()
            if self is None or mod is not module or not mod.training:
                return
            self.ran.setdefault(name, is_unit)
            with torch.no_grad():
                if next(iter(self.ran)) == name:  # the first module of the forward: its inputs are the batch's
                    finite = [torch.isfinite(a.to_padded_tensor(0) if a.is_nested else a).all()  # nested: 0-padded
                              for a in args if isinstance(a, torch.Tensor)]
                    for f in finite:
                        self.batch_finite = f if self.batch_finite is None else self.batch_finite & f.to(
                            self.batch_finite.device)
                x = args[0] if is_unit and args and isinstance(args[0], torch.Tensor) and args[0].ndim else None
                if x is not None and x.is_nested:  # None where the unit refuses it (its own call names why)
                    parts = nested_parts(x, module.channel_dim if module.granularity == "channel" else None) or []
                else:
                    parts = [] if x is None else [x]
                for x in parts:  # positions (a sample of an element unit) holding NaN/inf in any channel
                    bad = ~torch.isfinite(x.detach())
                    bad = bad.flatten(1).any(1) if module.granularity == "element" else bad.any(
                        module.channel_dim % x.ndim)
                    bad = bad.sum()
                    self.bad[name] = bad if name not in self.bad else self.bad[name] + bad.to(self.bad[name].device)
        return hook

    def close(self, deferred: bool = False) -> None:
        """Remove the hooks (``deferred``: see :func:`_retire`)."""
        _retire(self.handles, deferred)

    def clear(self) -> None:
        """Start a new step."""
        self.ran.clear()
        self.bad.clear()
        self.batch_finite = None

    def cause(self) -> str | None:
        """Why NaN/inf reached the slopes: when this step's training forwards fed a unit NaN/inf inputs, the first
        such unit in the order the forward ran them and where they came from (the batch, the layers run before it,
        whose parameters are tested, or an operation without parameters there); when they fed every unit finite
        inputs but a layer's gradient is not finite, the layers and operations after the last unit or the loss;
        else ``None`` (the optimizer step made them: the training diverged). Work done only once NaN/inf is
        found: the forwards only record which units and layers ran."""
        seen = {n: int(c) for n, c in self.bad.items() if int(c)}  # one device sync per unit
        order: list[tuple[str, list[str]]] = []
        layers: list[str] = []
        for name, is_unit in self.ran.items():
            if is_unit:
                order.append((name, layers))
                layers = []
            else:
                layers.append(name)
        restore = ("A NaN/inf forward makes every gradient NaN, and the optimizer step wrote them into the weights: "
                   "restore a checkpoint.")
        first = next((i for i, (name, _) in enumerate(order) if name in seen), None)
        if first is None:
            grads = [p.grad for m in self._layers.values() for p in m.parameters(recurse=False) if p.grad is not None]
            if not order or all(bool(torch.isfinite(g).all()) for g in grads):
                return None
            last = order[-1][0]
            return (f"This step's forward fed every unit finite inputs but the gradients hold NaN/inf: they arose "
                    f"after the last unit {last!r}, {self._origin(layers, last, None)}, or in the loss (check it "
                    f"and the targets). {restore}")
        name, layers = order[first]
        positions = f"{seen[name]} position{'s' if seen[name] > 1 else ''}"
        if first > 0:
            previous = order[first - 1][0]
            return (f"This step's forward fed unit {name!r} NaN/inf inputs ({positions}), where unit {previous!r} "
                    f"before it got finite ones: they arose between the two, {self._origin(layers, previous, name)}. "
                    f"{restore}")
        if self.batch_finite is None or not bool(self.batch_finite):
            return (f"This step's forward fed unit {name!r}, the first, NaN/inf inputs ({positions}): the batch "
                    f"held them (check the data). {restore} The learning rate is not the cause.")
        return (f"This step's forward fed unit {name!r}, the first, NaN/inf inputs ({positions}) from a finite "
                f"batch: they arose before it, {self._origin(layers, None, name)}. {restore}")

    def _origin(self, layers: list[str], after: str | None, before: str | None) -> str:
        """Where NaN/inf arose among ``layers`` (the layers with parameters that ran between the units ``after``
        and ``before``; ``None``: the model's start or end). A parameter holding NaN/inf whose gradient is finite
        held them in the forward; one whose gradient is not may have got them from this step's NaN gradients (the
        optimizer step ran before this check); when none holds any, an operation without parameters made them,
        in one of the parameter-less modules registered between the two units if that is where it runs."""
        listed = ", ".join(repr(n) for n in layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
        held, written = [], []
        for n in layers:
            for p, t in self._layers[n].named_parameters(recurse=False):
                if not bool(torch.isfinite(t).all()):
                    (held if t.grad is None or bool(torch.isfinite(t.grad).all()) else written).append(f"{n}.{p}")
        damaged = ("a damaged checkpoint, or an earlier optimizer step that wrote NaN/inf into them, e.g. float16 "
                   "parameters under Adam, whose eps underflows: keep them float32 under autocast")
        if held:
            return (f"in the weights {', '.join(held[:4])}{' and more' if len(held) > 4 else ''}, which hold NaN/inf "
                    f"that this step's gradients did not write ({damaged})")
        names = [n for n, _, _ in self._tree]
        lo = names.index(after) + 1 if after in names else 0
        hi = names.index(before) if before in names else len(names)
        units = tuple(f"{n}." for n, is_unit, _ in self._tree if is_unit)
        free = [n for n, is_unit, leaf in self._tree[lo:hi] if leaf and not is_unit and not n.startswith(units)]
        ops = "an operation without parameters (x / 0, the log of a negative number, an overflow)" + (
            f", e.g. in {', '.join(repr(n) for n in free[:4])}{' and more' if len(free) > 4 else ''}" if free else "")
        if written:
            more = " and more" if len(written) > 4 else ""
            return (f"in {ops}, or in the weights of {listed} if they held NaN/inf in that forward ({damaged}): "
                    f"this step's NaN gradients have since made {', '.join(written[:4])}{more} NaN/inf, so which it "
                    "was cannot be told now")
        where = (f"no layer with parameters there ({listed}) holds NaN/inf" if layers
                 else "no layer with parameters ran there")
        return f"{where}: {ops} produced them"
