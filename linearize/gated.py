"""Gated splits (seed 003): turn a ReLU network into its DGN or DLGN form.

A ReLU computes ``relu(q) = q * 1[q > 0]``: a linear map times an input-dependent on/off *gate*.
The gated split puts the two factors in two networks of the same architecture:

* the **feature** (gating) network ``F`` computes, at every activation call site ``s``, a
  pre-activation ``q_s(x)`` that produces the gate ``G_s = sigmoid(beta * q_s)`` (or the hard
  step ``1[q_s > 0]`` with ``hard_gates=True``);
* the **value** network ``V`` is a copy of the architecture in which each activation is
  replaced by a *GaLU*: its own pre-activation ``z_s`` times the gate, ``z_s * G_s``.
  ``forward(x)`` returns the value network's output.

Modes (``GatedConfig.mode``, options in :class:`~linearize.config.GatedConfig`):

``"dgn"``
    Deep gated network. The feature network keeps its ReLUs. With ``init="copy"``, hard gates
    and ``value_input="x"`` it computes *exactly* the original network (``z_s == q_s``).
``"dlgn"``
    Deep linearly gated network. The feature network is linear: each ReLU becomes the identity
    and ``nn.MaxPool*d`` / ``nn.AdaptiveMaxPool*d`` become average pooling of the same geometry
    (a max pooling that cannot be replaced, e.g. ``F.max_pool2d`` called inside ``forward``,
    raises). In eval mode (BatchNorm is affine) every gate pre-activation is then an affine
    function of the input (the "primal linearity"). With ``value_input="ones"`` the value network
    sees a constant all-ones input: everything input-dependent comes through the gates.

Defaults from seed 003: ``beta = 4`` (DGN) and ``beta = 10`` (DLGN), ``init="independent"``: the
feature network is re-initialized (``reset_parameters()`` of each of its modules, i.e. PyTorch's
default initializers, also for Hugging Face layers), the value network keeps the model's
weights. ``init="copy"`` starts both from the model's weights. ``freeze_feature=True`` keeps the
feature network fixed (``requires_grad=False`` and always in eval mode): the "fixed learnt gates"
setting, with the feature network copied from a trained model (``init="copy"``). Hard gates pass
no gradient to the feature network (the step has none): only soft gates train it.

Gated activation kinds: ``relu``, ``leaky_relu`` (gate ``s + (1 - s) G`` with the negative slope
``s``, exact with hard gates) and ``relu6``, gated by its ReLU part only (the value network drops
the cap at 6, so a hard-gated copy equals the original only where pre-activations stay below 6;
MobileNet-V2 uses ReLU6). Smooth activations (GELU, SiLU, tanh...) are not gated: they stay as they
are in both networks, and a model with no ReLU-family activation at all raises.

Every activation *call* gets its own gate: a module called several times per forward of its owner
(torchvision ``BasicBlock.relu`` twice, ``Bottleneck.relu`` three times, the last one after the
residual add) becomes a :class:`~linearize.injection.CallSites` dispatcher in both networks, and
the ``k``-th call of the value network is gated by the ``k``-th call of the feature network
(sites are named like ``layer1.0.relu.calls.1``, as units of :func:`linearize.convert`). A block
applied several times per forward (weight tying: ALBERT's shared layer, a looped block) has one site
per activation call of the block, and its ``n``-th application in the value network is gated by the
``n``-th application in the feature network.

Transformers: in Hugging Face models the FFN activation is a module, so each FFN channel of
the value network is gated by the same channel of the feature copy's FFN pre-activation. In a
DLGN the feature path is still not strictly linear there: attention (softmax of products of
the input with itself) and LayerNorm (division by the standard deviation) remain nonlinear.
"""

from __future__ import annotations

import copy
import math
import sys
import warnings
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from tqdm.auto import tqdm

from .activations import activation_kind, negative_slope
from .config import BlendConfig, GatedConfig, LinearizeConfig
from .example_inputs import guess_example_inputs
from .injection import (
    activation_registrations,
    settle_placed_modules,
    install_call_sites,
    plan_conversion,
    wrap_function_attributes,
)
from .inputs import Batches, as_call, call_model, eval_mode, map_tensors, model_device
from .module_stack import ModuleStack
from .unit import write_into

__all__ = ["GATED_KINDS", "GaLU", "FeatureTap", "GatedNetwork", "convert_gated", "gate_statistics"]

GATED_KINDS = ("relu", "leaky_relu", "relu6")
_MAX_POOLS = {
    nn.MaxPool1d: nn.AvgPool1d, nn.MaxPool2d: nn.AvgPool2d, nn.MaxPool3d: nn.AvgPool3d,
}
_ADAPTIVE_MAX_POOLS = {
    nn.AdaptiveMaxPool1d: nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool2d: nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool3d: nn.AdaptiveAvgPool3d,
}
_MAX_POOL_FUNCTIONS = {
    F.max_pool1d, F.max_pool2d, F.max_pool3d, F.max_pool1d_with_indices, F.max_pool2d_with_indices,
    F.max_pool3d_with_indices, F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
    F.adaptive_max_pool1d_with_indices, F.adaptive_max_pool2d_with_indices,
    F.adaptive_max_pool3d_with_indices, F.fractional_max_pool2d, F.fractional_max_pool3d,
    torch.max_pool1d, torch.max_pool2d, torch.max_pool3d,
}


class _GateStore:
    """What the taps and GaLUs of one gated network share: the gate-statistics switch, and the key of
    their forward's :class:`_Pass`.

    A plain object (not a module): ``deepcopy`` of the gated network copies it once and keeps it
    shared between the copied taps and GaLUs.
    """

    def __init__(self) -> None:
        self.recording = False  # gate statistics on/off

    def current(self) -> "_Pass | None":
        """The pass of the :meth:`GatedNetwork.forward` running in this thread (context), if any."""
        return _PASSES.get().get(self)


class _Pass:
    """One forward of a gated network: the feature network's pre-activations of every call site, in call
    order (a block applied several times per forward calls its sites once per application), and how many
    of them the value network has taken so far."""

    def __init__(self) -> None:
        self.preacts: dict[str, list[torch.Tensor]] = {}
        self.taken: dict[str, int] = {}

    def put(self, site: str, q: torch.Tensor) -> None:
        self.preacts.setdefault(site, []).append(q)

    def take(self, site: str) -> torch.Tensor:
        """The pre-activation of the value network's next call of ``site``: that of the feature
        network's call with the same index."""
        stored, k = self.preacts.get(site, []), self.taken.get(site, 0)
        if k >= len(stored):
            raise RuntimeError(
                f"gate site {site!r}: the value network calls it {k + 1} time(s) in this forward, the feature "
                f"network {len(stored)}; both networks must take the same path through the model"
            )
        self.taken[site] = k + 1
        return stored[k]


# the running passes of this thread (context), by store: each thread's forwards keep their own pre-activations
_PASSES: ContextVar[dict[_GateStore, _Pass]] = ContextVar("linearize_gated_passes", default={})
_CHECKPOINT_FILE = torch.utils.checkpoint.__file__


def _in_checkpoint() -> bool:
    """Whether the caller runs inside ``torch.utils.checkpoint`` (in backward: a recomputation)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == _CHECKPOINT_FILE:
            return True
        frame = frame.f_back
    return False


class FeatureTap(nn.Module):
    """Feature-network side of one call site: stores the pre-activation ``q`` and continues.

    DGN: returns ``act(q)`` (the original ReLU / LeakyReLU / ReLU6), written into ``q`` when ``inplace``
    (as the replaced in-place activation did: a later read of ``q`` sees what it saw).
    DLGN: returns a copy of ``q`` (identity; a copy so later in-place ops cannot alter ``q``; an identity
    written in place would leave ``q`` as it is, so ``inplace`` changes nothing).
    """

    inplace = False

    def __init__(self, site: str, kind: str, leak: float, linear: bool, store: _GateStore) -> None:
        super().__init__()
        self.site, self.kind, self.leak, self.linear = site, kind, leak, linear
        self._store = store

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        run = self._store.current()  # None: the feature network called on its own, nothing to gate
        if run is not None:  # the gate needs q as it was before an in-place write
            run.put(self.site, q.clone() if self.inplace and not self.linear else q)
        if self.linear:
            return q.clone()
        return write_into(q, self._act) if self.inplace else self._act(q)

    def _act(self, q: torch.Tensor) -> torch.Tensor:
        if self.kind == "relu6":
            return F.relu6(q)
        return F.leaky_relu(q, self.leak) if self.leak else F.relu(q)

    def extra_repr(self) -> str:
        return f"{self.site!r}, {'identity' if self.linear else self.kind}"


class GaLU(nn.Module):
    """Value-network side of one call site: ``z * G(q)``, a gated linear unit.

    ``z`` is the value network's own pre-activation, ``q`` the feature network's pre-activation of
    the same site (same shape), ``G(q) = sigmoid(beta q)`` (or ``1[q > 0]`` with hard gates),
    raised to ``s + (1 - s) G`` for a leaky ReLU of negative slope ``s``.

    Attributes for counters and reports: ``site`` (name), ``kind``, ``num_channels`` (``C``),
    ``channel_dim`` (1 for ``[N, C, H, W]``, -1 for ``[..., C]``), ``beta``, ``hard``; ``inplace``: the
    result is written into ``z``, as the replaced in-place activation did.
    """

    inplace = False

    def __init__(self, site: str, kind: str, num_channels: int, channel_dim: int, leak: float,
                 beta: float, hard: bool, store: _GateStore) -> None:
        super().__init__()
        self.site, self.kind, self.num_channels, self.channel_dim = site, kind, num_channels, channel_dim
        self.leak, self.beta, self.hard = leak, beta, hard
        self._store = store
        self.on_counts: torch.Tensor | None = None  # float64 [C], filled while recording
        self.positions = 0

    def gate(self, q: torch.Tensor) -> torch.Tensor:
        """Gate values ``G(q)`` in ``[0, 1]`` (``[s, 1]`` for a leaky ReLU), same shape as ``q``."""
        g = (q > 0).to(q.dtype) if self.hard else torch.sigmoid(self.beta * q)
        return self.leak + (1.0 - self.leak) * g if self.leak else g

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        run = self._store.current()
        if run is None and _in_checkpoint():
            raise RuntimeError(
                f"gate site {self.site!r} is recomputed by gradient checkpointing (torch.utils.checkpoint) in "
                "backward, after the GatedNetwork's forward has returned and its feature pre-activations are "
                "gone: a gated split cannot checkpoint its value network. Turn checkpointing off in both "
                "networks: gated.value.gradient_checkpointing_disable() and the same on gated.feature "
                "(Hugging Face; activation_checkpointing_disable() in newer versions), "
                "set_grad_checkpointing(False) (timm), or call the blocks without "
                "torch.utils.checkpoint"
            )
        if run is None:
            raise RuntimeError(
                f"gate site {self.site!r} got no pre-activation from the feature network in this "
                "forward: call the GatedNetwork itself, not its .value network"
            )
        q = run.take(self.site)
        if q.shape != z.shape:
            raise RuntimeError(
                f"gate site {self.site!r}: feature pre-activation {tuple(q.shape)} does not match the "
                f"value pre-activation {tuple(z.shape)}; both networks must see inputs of one shape"
            )
        if self._store.recording:
            self._record(q)
        if self.inplace:  # the replaced activation was in place: write as it did
            return write_into(z, lambda t: self._gated(t, q), (q,))
        return self._gated(z, q)

    def _gated(self, z: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``z * G(q)``, with 0 where the gate is 0 and ``z`` is below 0 or +inf, as ReLU gives for a closed
        gate: ``-inf * 0`` is NaN and ``-1 * 0`` is -0 (a NaN ``z`` stays NaN, a -0 stays -0, as in ReLU)."""
        g = self.gate(q)
        return (z * g).masked_fill((g == 0) & ((z < 0) | (z == math.inf)), 0)

    @torch.no_grad()
    def _record(self, q: torch.Tensor) -> None:
        on = (q > 0).movedim(self.channel_dim, -1).reshape(-1, self.num_channels)
        counts = on.sum(0, dtype=torch.float64).cpu()
        self.on_counts = counts if self.on_counts is None else self.on_counts + counts
        self.positions += on.shape[0]

    def extra_repr(self) -> str:
        g = "hard" if self.hard else f"beta={self.beta:g}"
        return f"{self.site!r}, {self.kind}, channels={self.num_channels}, channel_dim={self.channel_dim}, {g}"


class GatedNetwork(nn.Module):
    """A gated split: ``forward(*args, **kwargs)`` runs ``feature`` then ``value`` and returns
    the value network's output (whatever the original model returned: a tensor, an HF output...).

    Attributes: ``feature``, ``value`` (the two networks), ``linearize_config``,
    ``linearize_report`` (the :class:`~linearize.injection.ConversionReport` of the gated sites).
    """

    def __init__(self, feature: nn.Module, value: nn.Module, config: GatedConfig, store: _GateStore) -> None:
        super().__init__()
        self.feature = feature
        self.value = value
        self.linearize_config = config
        self._store = store
        self._taps_write = any(isinstance(m, FeatureTap) and m.inplace for m in feature.modules())

    def gates(self) -> list[tuple[str, GaLU]]:
        """``[(site, galu)]`` in call order of a forward (site names as for units of ``convert``)."""
        return [(m.site, m) for m in self.value.modules() if isinstance(m, GaLU)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        token = _PASSES.set({**_PASSES.get(), self._store: _Pass()})  # this thread's own, for this forward
        try:
            if self._taps_write:
                # a tap written in place may write into a model input: the value network must see it as given
                self.feature(*map_tensors(args, torch.clone), **map_tensors(kwargs, torch.clone))
            else:
                self.feature(*args, **kwargs)
            if self.linearize_config.value_input == "ones":
                args, kwargs = _constant_inputs(args, kwargs)
            return self.value(*args, **kwargs)
        finally:
            _PASSES.reset(token)

    def train(self, mode: bool = True) -> "GatedNetwork":
        super().train(mode)
        if self.linearize_config.freeze_feature:
            self.feature.eval()  # fixed gates: BatchNorm statistics stay fixed too
        return self


def _constant_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Replace the model input (first positional argument, else ``pixel_values`` /
    ``inputs_embeds`` / ``x`` / ``input``) by ``torch.ones_like``."""
    if args:
        return (_ones(args[0], "the first positional argument"), *args[1:]), kwargs
    for key in ("pixel_values", "inputs_embeds", "x", "input", "input_ids"):
        if key in kwargs:
            return args, {**kwargs, key: _ones(kwargs[key], f"{key}=")}
    raise TypeError(
        "value_input='ones' replaces the model input by ones, but the call has no positional argument "
        f"and none of pixel_values / inputs_embeds / x / input (got {sorted(kwargs)})"
    )


def _ones(x: Any, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"value_input='ones' needs a floating-point tensor input, but {what} is "
            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}; token ids are not a "
            "signal to replace by ones: pass inputs_embeds=, or use value_input='x'"
        )
    return torch.ones_like(x)


# ----------------------------------------------------------------------------- conversion


def _check(model: object, config: GatedConfig) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_gated expects a torch.nn.Module, got {type(model).__name__}")
    if isinstance(config, LinearizeConfig) and not isinstance(config, GatedConfig):
        raise ValueError(f"convert_gated needs mode 'dgn' or 'dlgn' (a GatedConfig), got {type(config).__name__} "
                         f"of mode {config.mode!r}")
    if not isinstance(config, GatedConfig):
        raise TypeError(f"config must be a GatedConfig (LinearizeConfig(mode='dgn' or 'dlgn')), got {type(config).__name__}")
    if config.beta is None or not math.isfinite(config.beta) or config.beta <= 0:
        raise ValueError(f"beta (gate sharpness of sigmoid(beta * q)) must be a finite number > 0, got {config.beta}")
    if isinstance(model, GatedNetwork):
        raise ValueError("this model is already a gated split; convert the original model")


def _no_gatable_error(model: nn.Module, config: GatedConfig, functional: dict[str, int]) -> ValueError:
    smooth = [(name, activation_kind(act)) for name, _, _, act in activation_registrations(model)]
    smooth = [(n, k) for n, k in smooth if k not in GATED_KINDS]
    text = f"{config.mode.upper()} gates ReLU-family activations ({', '.join(GATED_KINDS)}), and " \
           f"{type(model).__name__} has none that is called (activations={list(config.activations)})."
    if smooth:
        kinds = sorted({k for _, k in smooth})
        shown = ", ".join(f"{n} ({k})" for n, k in smooth[:4]) + (" ..." if len(smooth) > 4 else "")
        text += (
            f" It has {len(smooth)} smooth activation(s) {kinds}: {shown}. Gating them would replace each "
            "by z * sigmoid(beta * q) with q from the feature network, which is no exact split of "
            f"{'/'.join(kinds)}: build the model with ReLU (Hugging Face: config.hidden_act='relu') "
            "or use mode='prelu'."
        )
    if functional:
        text += f" Functional calls inside forward cannot be gated: {', '.join(functional)}."
    return ValueError(text)


def _replace_max_pools(net: nn.Module) -> None:
    """DLGN feature network: max pooling -> average pooling of the same geometry, in place."""
    for owner in list(net.modules()):
        for attr, child in list(owner.named_children()):
            if type(child) in _MAX_POOLS:
                dilation = child.dilation if isinstance(child.dilation, tuple) else (child.dilation,)
                if any(d != 1 for d in dilation) or child.return_indices:
                    raise ValueError(
                        f"DLGN: {type(child).__name__} with dilation={child.dilation}, return_indices="
                        f"{child.return_indices} has no average-pooling equivalent; the feature network "
                        "must be linear: use a plain max pooling or average pooling in the model"
                    )
                avg = _MAX_POOLS[type(child)](child.kernel_size, child.stride, child.padding,
                                              ceil_mode=child.ceil_mode, count_include_pad=False)
                setattr(owner, attr, avg)
            elif type(child) in _ADAPTIVE_MAX_POOLS:
                if child.return_indices:
                    raise ValueError(f"DLGN: {type(child).__name__}(return_indices=True) cannot become average pooling")
                setattr(owner, attr, _ADAPTIVE_MAX_POOLS[type(child)](child.output_size))


class _NonlinearityAudit(TorchFunctionMode):
    """One forward of a DLGN feature network: max pooling calls, and activations left in it (smooth
    ones, excluded ReLUs) that run before the last gate tap (so that they shape gate pre-activations)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.running = ModuleStack(net, every_module=True, enter=self.enter)  # module calls made in forward too
        self.max_pools: list[str] = []
        self.events: list[tuple[str, str]] = []  # ("tap" | "nonlinear", where)

    def _where(self) -> str:
        owner = self.running.innermost_registered()
        return (self.running.names.get(id(owner)) or "<root>") if owner is not None else "<outside>"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _MAX_POOL_FUNCTIONS:
            self.max_pools.append(f"{self._where()}: {getattr(func, '__name__', func)}")
        elif activation_kind(func) is not None and not any(isinstance(m, FeatureTap) for m in self.running.stack) \
                and not any(activation_kind(m) for m in self.running.stack):
            self.events.append(("nonlinear", f"{self._where()}: {getattr(func, '__name__', func)}"))
        return func(*args, **(kwargs or {}))

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A module call starts: a gate tap, or an activation module outside any other."""
        if isinstance(module, FeatureTap):
            self.events.append(("tap", module.site))
        elif activation_kind(module) is not None and not any(activation_kind(m) for m in self.running.stack):
            self.events.append(("nonlinear", f"{self.running.names.get(id(module), '?')} ({activation_kind(module)})"))

    def run(self, net: nn.Module, inputs: Any) -> None:
        with self.running, torch.no_grad(), self:
            call_model(net, inputs)


def _audit_dlgn_feature(feature: nn.Module, inputs: Any) -> None:
    audit = _NonlinearityAudit(feature)
    audit.run(feature, inputs)
    if audit.max_pools:
        raise ValueError(
            "DLGN: max pooling would remain in the feature network, which must be linear: "
            + ", ".join(sorted(set(audit.max_pools)))
            + ". Only nn.MaxPool*d / nn.AdaptiveMaxPool*d modules are replaced by average pooling; "
            "replace functional max pooling in forward by such a module (or by average pooling)"
        )
    last_tap = max((i for i, (what, _) in enumerate(audit.events) if what == "tap"), default=-1)
    before = sorted({where for what, where in audit.events[:last_tap] if what == "nonlinear"})
    if before:
        warnings.warn(
            "DLGN: the feature network keeps these nonlinear activations before gate sites, so its gate "
            f"pre-activations are not linear in the input: {', '.join(before)}",
            stacklevel=3,
        )


def _reset_parameters(net: nn.Module) -> None:
    for module in net.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def convert_gated(model: nn.Module, config: GatedConfig, example_inputs: Any = None) -> GatedNetwork:
    """Build the DGN / DLGN split of ``model`` as a new module; ``model`` is not modified (both networks
    are deep copies).

    Args:
        model: a network with ReLU-family activation modules (torchvision ResNet / VGG /
            MobileNet-V2, Hugging Face models with ``hidden_act="relu"``, your own).
        config: a :class:`~linearize.config.GatedConfig` (``mode`` ``"dgn"`` or ``"dlgn"``); uses ``beta``,
            ``value_input``, ``init``, ``hard_gates``, ``freeze_feature``, ``activations``,
            ``target_modules``, ``exclude_modules`` and ``channel_dim`` (see the module docstring).
        example_inputs: the probe input (a tensor, a tuple of positional arguments or a dict of
            keyword arguments); ``None`` builds one (``linearize.example_inputs.guess_example_inputs``).
            The structure (sites, channels) only depends on the model, not on these values, so
            ``convert_gated(fresh_model, config)`` rebuilds a network that loads a saved state dict.

    Returns:
        a :class:`GatedNetwork` in ``model``'s train/eval mode, on ``model``'s device.

    Raises:
        TypeError: not a module / not a config, or ``value_input="ones"`` with a non-float input.
        ValueError: ``beta <= 0``; no ReLU-family activation (smooth ones are named); a ReLU called
        functionally inside ``forward`` (it cannot be gated); max pooling left in a DLGN feature
        network.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> gated = convert_gated(net, GatedConfig(mode="dlgn"), torch.randn(2, 4))
        >>> [site for site, _ in gated.gates()], gated.feature is not net
        (['1'], True)
    """
    _check(model, config)
    gated_kinds = tuple(k for k in config.activations if k in GATED_KINDS)
    probe_config = BlendConfig(  # the same selection, ReLU-family sites only: all are gated, none is a product gate
        target_modules=config.target_modules, exclude_modules=config.exclude_modules, channel_dim=config.channel_dim,
        activations=gated_kinds or ("relu",), gates="include")
    inputs = example_inputs if example_inputs is not None else guess_example_inputs(model)
    if config.value_input == "ones":  # fail now, not at the first training step
        _constant_inputs(*as_call(inputs))

    value, feature = copy.deepcopy(model), copy.deepcopy(model)
    for net in (value, feature):
        wrap_function_attributes(net)
    names = {id(m): n for n, m in value.named_modules(remove_duplicate=False)}
    report, plan, _ = plan_conversion(value, probe_config, example_inputs)  # None: the same guess, errors explained
    functional = {w: n for w, n in report.functional_calls.items() if w.rsplit(": ", 1)[-1].rstrip("_") in
                  ("relu", "relu6", "leaky_relu")}
    if not gated_kinds or not report.sites:
        raise _no_gatable_error(value, config, functional)
    if functional:
        raise ValueError(
            f"{config.mode.upper()}: these ReLU calls are made functionally inside forward and cannot be "
            f"gated: {', '.join(functional)}. Replace them by nn.ReLU modules (one per call site is fine)"
        )
    problems = report.problems()
    if problems:
        warnings.warn("gated split left activations ungated:\n  " + "\n  ".join(problems), stacklevel=3)

    store = _GateStore()
    sites = iter(report.sites)
    linear = config.mode == "dlgn"
    for owner, attr, act, calls in plan:
        owner_name = names[id(owner)]
        feature_owner = feature.get_submodule(owner_name) if owner_name else feature
        leak = negative_slope(act)  # a GATED_KINDS activation: relu, leaky_relu, relu6
        galus, taps = [], []
        for _ in calls:
            site = next(sites)
            galus.append(GaLU(site.name, site.kind, site.num_channels, site.channel_dim, leak,
                              float(config.beta), config.hard_gates, store))
            taps.append(FeatureTap(site.name, site.kind, leak, linear, store))
        if getattr(act, "inplace", False):  # write into the input as act did (any later read sees what it saw)
            for m in galus + taps:
                m.inplace = True
        install_call_sites(owner, attr, galus)
        install_call_sites(feature_owner, attr, taps)
    settle_placed_modules(value)
    settle_placed_modules(feature)

    if config.init == "independent":
        _reset_parameters(feature)
    if linear:
        _replace_max_pools(feature)
        _audit_dlgn_feature(feature, inputs)
    if config.freeze_feature:
        feature.requires_grad_(False)

    gated = GatedNetwork(feature, value, config, store)
    gated.linearize_report = report
    gated.training = model.training  # the deep copies keep each module's own flag (and device)
    if config.freeze_feature:
        feature.eval()  # as GatedNetwork.train does: fixed gates keep their statistics
    return gated


# ----------------------------------------------------------------------------- statistics


def _plogp(p: torch.Tensor) -> torch.Tensor:
    """``p * log2(p)`` with ``0 log 0 = 0``."""
    return torch.where(p > 0, p * torch.log2(p.clamp_min(1e-300)), torch.zeros_like(p))


def gate_statistics(
    gated: GatedNetwork, inputs: Any, max_batches: int | None = None, progress: bool = True
) -> dict[str, dict]:
    """Per-site statistics of the hard on/off state ``q > 0`` of the gates, in eval mode.

    Args:
        gated: a :class:`GatedNetwork`.
        inputs: data (:mod:`linearize.inputs`): a tensor batch, a dict of keyword arguments, an
            ``(inputs, *targets)`` tuple (only ``inputs`` is fed; a model with several positional
            arguments takes ``((a, b), targets)``) or an iterable of such batches (a list, a
            ``DataLoader``).
        max_batches: stop after this many batches.
        progress: show a tqdm bar over the batches.

    Returns:
        ``{site: {"channels": C, "fraction_on": f, "entropy": H, "always_on": n1, "always_off": n0}}``
        with ``f`` the fraction of (position, channel) gates that are on, ``H`` the mean over the
        ``C`` channels of the binary entropy (bits, in ``[0, 1]``) of that channel's on-probability
        over all inputs and positions (0: the channel never switches, i.e. it is linear or dead on
        these inputs; 1: on half of the time), and ``always_on`` / ``always_off`` the number of
        channels whose gate never switched.
    """
    if not isinstance(gated, GatedNetwork):
        raise TypeError(
            f"gate_statistics expects a GatedNetwork (from convert(mode='dgn'|'dlgn')), got {type(gated).__name__}"
        )
    data = Batches.of(inputs, "inputs")
    if max_batches is not None:
        if max_batches < 1:
            raise ValueError(f"gate_statistics got no batch: max_batches must be >= 1, got {max_batches}")
        data = data.limit(batches=max_batches)
    galus = [g for _, g in gated.gates()]
    for g in galus:
        g.on_counts, g.positions = None, 0
    gated._store.recording = True
    try:
        with eval_mode(gated), torch.no_grad():
            batches = data.to(model_device(gated))
            for batch in tqdm(batches, desc="gate statistics", leave=False, disable=not progress):
                call_model(gated, batch)
    finally:
        gated._store.recording = False
    stats = {}
    for g in galus:
        if g.on_counts is None:
            raise RuntimeError(f"gate site {g.site!r} did not run on these inputs")
        p = g.on_counts / g.positions
        entropy = -(_plogp(p) + _plogp(1 - p))
        stats[g.site] = {
            "channels": g.num_channels,
            "fraction_on": float(p.mean()),
            "entropy": float(entropy.mean()),
            "always_on": int((p == 1).sum()),
            "always_off": int((p == 0).sum()),
        }
        g.on_counts, g.positions = None, 0
    return stats
