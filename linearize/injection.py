"""The injection core: probe a model's activation calls, plan the units, install them.

Used by :func:`linearize.convert` (blend units, :mod:`~linearize.conversion`) and by the gated
split (:mod:`~linearize.gated`), so neither imports the other. One probe forward on example inputs
(eval mode, no grad; every module's flag restored) records, with global module hooks, every call
of every activation module (caller, input shape, the last leaf layer before it: the channel
dimension), and with a ``TorchFunctionMode`` the functional activation calls made inside
``forward`` code and the products that make an activation's output a gate. :func:`plan_conversion`
turns that into one replacement per registration ``owner.attr`` (a unit, or a :class:`CallSites`
dispatcher for a module called several times per owner forward) and one unit per functional call
of an owner (:mod:`~linearize.functional_sites`).
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .activations import (
    FUNCTIONAL_SPECS,
    GATE_KINDS,
    OTHER_ELEMENTWISE,
    OTHER_FUNCTIONS,
    FunctionalActivation,
    activation_kind,
    activation_module,
)
from .checks import as_patterns, check_channel_dim
from .config import LinearizeConfig
from .example_inputs import guess_example_inputs, guessed_input_error
from .dispatch import (
    THREAD_CALL,
    FunctionalSiteError,
    Scope,
    ThreadWatch,
    eager,
    prime_eager,
    IN_FUNCTION,
    attach_owner,
    caller_scope,
    code_position,
    compiled_submodules,
    hooked_module,
    Positions,
    loop_error,
    moved_call,
    refuse_fx_root,
    refuse_scripting,
    unreachable_call,
    watch_child,
)
from .functional_sites import ATTR, drop_site_modes
from .inputs import call_model, eval_mode, inputs_fit, output_tensors
from .module_stack import ModuleStack
from .unit import LinearizableActivation

__all__ = ["CallSites", "install_call_sites", "settle_placed_modules", "SiteInfo", "ConversionReport", "ActivationCall",
           "OwnerPlan", "plan_conversion", "call_channels",
           "activation_registrations", "wrap_function_attributes",
           "function_attributes_wrapped", "restored_on_error"]

# products that make an activation's output a multiplicative gate: op -> positions of the factors
_PRODUCTS: dict[Callable, tuple[int, int]] = {
    torch.mul: (0, 1), torch.Tensor.mul: (0, 1), torch.Tensor.mul_: (0, 1), torch.Tensor.__mul__: (0, 1),
    torch.Tensor.__rmul__: (0, 1), torch.Tensor.__imul__: (0, 1), torch.addcmul: (1, 2),
    torch.Tensor.addcmul: (1, 2), torch.Tensor.addcmul_: (1, 2),
}
# ops whose output is the same values as their first argument (a gate is often reshaped first)
_SAME_VALUES: set[Callable] = {
    torch.Tensor.view, torch.Tensor.view_as, torch.Tensor.reshape, torch.reshape, torch.Tensor.reshape_as,
    torch.Tensor.expand,
    torch.Tensor.expand_as, torch.Tensor.flatten, torch.flatten, torch.Tensor.unsqueeze, torch.unsqueeze,
    torch.Tensor.squeeze, torch.squeeze, torch.Tensor.permute, torch.permute, torch.Tensor.transpose,
    torch.transpose, torch.Tensor.contiguous, torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.clone,
    torch.clone, torch.Tensor.__getitem__, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
    F.dropout,
}
# elementwise ops with a scalar (a Python number or a 0-dim tensor): ``relu6(x + 3) / 6`` (a hand-written hard
# sigmoid) and ``2 * sigmoid(s)`` keep their source's role (a gate stays a gate); multiplications by a scalar are
# among _PRODUCTS
_SCALAR_OPS: set[Callable] = {
    torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.sub, torch.Tensor.sub,
    torch.Tensor.__sub__, torch.Tensor.__rsub__, torch.rsub, torch.div, torch.Tensor.div, torch.true_divide,
    torch.Tensor.__truediv__, torch.Tensor.__rtruediv__,
}
_MOVES_AXES = {torch.Tensor.permute, torch.permute, torch.Tensor.transpose, torch.transpose}  # of _SAME_VALUES
# what the probe records of a call (a user's hook calling one of these is not the model's own code)
_WATCHED = {*FUNCTIONAL_SPECS, *_PRODUCTS, torch.einsum, *OTHER_FUNCTIONS}
_CHANNEL_FIRST = (nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase, nn.GroupNorm)
# functional convs: their weight has one dim more than an unbatched input ([C, *spatial]) and its output
_CONVS = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}


def _unbatched_conv_error(what: str, output: torch.Tensor) -> ValueError:
    """The refusal of an example input that reaches a conv (``what``) without a batch dim (its ``output``)."""
    return ValueError(
        f"linearize.convert: the example input reaches {what} without a batch dim (its output has shape "
        f"{tuple(output.shape)}, channels first), so the activations after it would take image rows or columns "
        "for channels. Fix: pass a batched example input, e.g. example_inputs=x.unsqueeze(0) for one image x")


class CallSites(nn.Module):
    """One unit per call of a reused activation module.

    The ``k``-th call of this module within one forward of its owner runs ``calls[k]``. The position is
    counted per forward and per thread (:mod:`~linearize.dispatch`), so threads, nested forwards,
    exceptions and re-runs of the owner (gradient checkpointing of a module) all dispatch the same way.
    ``after[k]`` (when not None) names the module of the owner that its code calls right before call ``k`` (a loop's
    iteration: ``for layer in self.layers: x = self.act(layer(x))``); a call made after another one raises
    :class:`~linearize.dispatch.FunctionalSiteError` instead of running another iteration's unit. ``positions[k]``
    (when not empty) is where in the owner's code the probe saw call ``k`` (:func:`~linearize.dispatch.code_position`):
    a call made elsewhere (branches calling the module in another order) raises that error too.
    """

    def __init__(self, calls: list[LinearizableActivation], where: str = "",
                 after: list[str | None] | None = None, positions: list[tuple] | None = None) -> None:
        super().__init__()
        self.calls = nn.ModuleList(calls)
        self.where = where  # "<owner class>.<attribute>", for errors
        self.after = list(after) if after is not None else []
        self.positions = Positions(positions or ())

    def __setstate__(self, state: dict) -> None:  # unpickled (torch.load of a whole model, spawn): no __init__
        prime_eager()
        state.setdefault("positions", Positions())
        super().__setstate__(state)

    @eager  # the position is per-forward state, not a graph input
    def _position(self) -> int:
        where = self.where or "of this site"
        scope = caller_scope(lambda: f"a call of the activation module {where}", skip=1)
        if scope is None:
            raise FunctionalSiteError(
                f"linearize: the activation module {where} holds one unit per call of its owner's forward, "
                "matched by call order, and was called from elsewhere: a hook, another module, a thread that the "
                "owner's forward started, a function run by torch.utils.checkpoint (recomputed outside the owner's "
                "forward) or a custom autograd.Function. Fix: call it only from its owner's own forward code, on "
                "the thread that runs that forward (checkpoint the owner module itself), or give the other caller "
                "its own activation module.")
        k = scope.next_position(self)
        expected = self.after[k] if k < len(self.after) else None
        if expected is not None and scope.last_child is not scope.owner.get_submodule(expected):
            scope.loops.setdefault(id(self.__dict__), loop_error(f"the activation module {where}", k, expected, scope))
        if k < len(self.positions) and (moved := moved_call(
                f"the activation module {where}", k, self.positions[k], scope, "give each call its own activation "
                "module (self.act_a = nn.ReLU(), converted to a unit of its own, whatever the order), or convert "
                "with exclude_modules= naming this owner to keep its activation as it is")):
            scope.loops.setdefault(id(self.__dict__), moved)
        if k >= len(self.calls):
            raise FunctionalSiteError(
                f"linearize: the activation module {where} was called more than "
                f"{len(self.calls)} times in one forward of its owner; the probe forward of linearize.convert "
                f"saw {len(self.calls)} calls and made one unit per call (matched by order, which fails when the "
                "number of calls depends on the input). Fix: convert with example_inputs= that take the path "
                "with the most calls, or exclude_modules= naming this owner to keep its activation as it is.")
        return k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.calls[self._position()](x)

    def begin_forward(self, scope: Scope) -> None:
        """An owner forward begins: the modules its loop calls before this site's calls are watched."""
        for name in getattr(self, "after", ()):
            if name is not None:
                watch_child(scope.owner.get_submodule(name))

    def check_forward(self, scope: Scope) -> None:
        """An owner forward returned: raise :class:`FunctionalSiteError` if it called this module fewer times
        than the probe did, but not never (a call may have run the unit of another call), or a loop's call after
        another module than the probe's (its output is never returned)."""
        made = scope.positions.get(id(self.__dict__), 0)
        if 0 < made < len(self.calls):  # none: no unit ran, nothing went to the wrong one
            where = self.where or "of this site"
            raise FunctionalSiteError(
                f"linearize: the activation module {where} was called {made} times in one forward of its owner, "
                f"where the probe forward of linearize.convert saw {len(self.calls)} calls and made one unit per "
                "call, matched by order: with fewer calls (a layer skipped: LayerDrop, stochastic depth, an early "
                "exit) the later calls ran the units of earlier ones. Fix: give each call its own activation "
                "module (self.acts = nn.ModuleList(...)), or convert with exclude_modules= naming this owner to "
                "keep its activation as it is.")
        if id(self.__dict__) in scope.loops:  # as many calls, after other modules or elsewhere: the end says so
            raise FunctionalSiteError(scope.loops[id(self.__dict__)])

    def __prepare_scriptable__(self) -> nn.Module:
        refuse_scripting(self)

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        refuse_fx_root(self, prefix)  # torch.fx.symbolic_trace of the owner itself cannot count its calls
        return super().named_modules(memo, prefix, remove_duplicate)

    def extra_repr(self) -> str:
        return f"calls={len(self.calls)}"


def settle_placed_modules(model: nn.Module) -> None:
    """Make the modules linearize placed (units, their plain forms) hold in ``model``; called by convert,
    the gated split, fold and load_folded.

    - Fused fast paths that compute an activation themselves are switched off where it is no longer the
      plain one: ``nn.TransformerEncoderLayer`` in eval mode under ``no_grad`` runs relu/gelu inside one
      kernel when ``activation_relu_or_gelu`` (set at its init) says so, bypassing a unit or a folded
      ChannelPReLU; an ``nn.TransformerEncoder`` over such layers stops making nested tensors, which
      units do not take, and gets a hook that zeroes the padded positions as its nested tensors did.
    - A module placed at a name its owner's ``__setstate__`` fills in when the name is missing from the
      state (``nn.TransformerDecoderLayer`` puts ``F.relu`` at ``activation``) is kept in the instance
      dict too: ``copy.deepcopy`` or unpickling would otherwise shadow the module with that default, a
      copy silently computing relu.
    """
    for m in model.modules():
        act = getattr(m, "activation", None)
        act = act.fn if isinstance(act, FunctionalActivation) else act  # F.relu held as an attribute, wrapped
        if getattr(m, "activation_relu_or_gelu", 0) and not (act in (F.relu, F.gelu) or type(act) in (nn.ReLU, nn.GELU)):
            m.activation_relu_or_gelu = 0  # torch's fast-path check then names "activation_relu_or_gelu"
    for m in model.modules():
        if not isinstance(m, nn.TransformerEncoder):
            continue
        if getattr(m, "use_nested_tensor", False) and any(
            not getattr(layer, "activation_relu_or_gelu", 1) for layer in m.layers
        ):
            m.use_nested_tensor = False
            m.padded_like_nested = True  # a plain attribute: save_folded records it, load_folded hooks again
        if m.__dict__.get("padded_like_nested") and _padded_like_nested not in m._forward_hooks.values():
            m.register_forward_hook(_padded_like_nested, with_kwargs=True)
    for m in model.modules():
        for name in _shadowed_on_copy(m):
            m.__dict__[name] = m._modules[name]


def _padded_like_nested(encoder: nn.TransformerEncoder, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
    """Forward hook of an ``nn.TransformerEncoder`` whose nested tensors :func:`settle_placed_modules` switched
    off: where its own forward would have made one (the conditions of ``nn.TransformerEncoder.forward``: eval,
    a batched input, a left-aligned ``src_key_padding_mask`` and no ``mask``, no autocast, no grad to track,
    a supported device), the layers' output is zero at the padded positions before ``norm``, as the original's
    ``to_padded_tensor(0.0)`` makes it. With a ``norm``, those positions get the norm of a zero row (exact for
    row-wise norms such as ``LayerNorm``)."""
    given = dict(zip(("src", "mask", "src_key_padding_mask"), args), **kwargs)
    src, pad = given["src"], given.get("src_key_padding_mask")
    if pad is None or given.get("mask") is not None or not isinstance(output, torch.Tensor):
        return None
    first = encoder.layers[0]
    pad = F._canonical_mask(mask=pad, mask_name="src_key_padding_mask", other_type=None, other_name="",
                            target_type=src.dtype, check_other=False)
    pad = pad != 0 if pad.is_floating_point() else pad  # _canonical_mask makes a float mask, -inf where padded
    tensors = (src, first.self_attn.in_proj_weight, first.self_attn.in_proj_bias, first.self_attn.out_proj.weight,
               first.self_attn.out_proj.bias, first.norm1.weight, first.norm1.bias, first.norm2.weight,
               first.norm2.bias, first.linear1.weight, first.linear1.bias, first.linear2.weight, first.linear2.bias)
    mask_check = getattr(encoder, "mask_check", True)
    nested = (torch.backends.mha.get_fastpath_enabled() and not first.training and src.dim() == 3
              and not src.is_nested and not torch.is_autocast_enabled()
              and not (mask_check and (torch.compiler.is_compiling()
                                       or not torch._nested_tensor_from_mask_left_aligned(src, pad.logical_not())))
              and not torch.overrides.has_torch_function(tensors)
              and src.device.type in ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)
              and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)))
    if not nested:
        return None
    if encoder.norm is None:  # batch first: use_nested_tensor needs it
        return output.masked_fill(pad[..., None], 0.0)
    return torch.where(pad[..., None], encoder.norm.forward(torch.zeros_like(output)), output)


def _shadowed_on_copy(m: nn.Module) -> list[str]:
    """Names of ``m``'s submodules that its class's own ``__setstate__`` would set as plain attributes
    (found by running it on a blank instance with ``m``'s state less those submodule names)."""
    cls = type(m)
    if cls.__setstate__ is nn.Module.__setstate__ or not m._modules:
        return []
    state = {k: dict(v) if isinstance(v, dict) else v for k, v in m.__dict__.items() if k not in m._modules}
    blank = cls.__new__(cls)
    try:
        blank.__setstate__(state)
    except Exception:  # noqa: BLE001 -- a __setstate__ that needs more than its state: nothing learnt
        return []
    return [n for n, sub in m._modules.items() if sub is not None and n in blank.__dict__ and blank.__dict__[n] is not sub]


def install_call_sites(owner: nn.Module, attr: str, modules: list[nn.Module],
                       after: list[str | None] | None = None, positions: list[tuple] | None = None) -> None:
    """Put one module per call at ``owner.attr``: the module itself, or a :class:`CallSites`
    dispatcher (counted per forward of ``owner``: :func:`~linearize.dispatch.attach_owner`) when the site is
    called several times (then :func:`settle_placed_modules` on the model). Every other attribute of ``owner``
    holding the same module (``act`` twice in an ``nn.Sequential``, ``self.a1 = self.a2 = nn.ReLU()``) gets
    the same replacement: its calls are among those the probe counted. ``after``, ``positions``: see
    :class:`CallSites`."""
    old = owner._modules[attr]
    new = modules[0] if len(modules) == 1 else CallSites(modules, f"{type(owner).__name__}.{attr}", after, positions)
    for name in [n for n, m in owner._modules.items() if m is old]:
        setattr(owner, name, new)
    if len(modules) > 1:
        attach_owner(owner)


@dataclass
class SiteInfo:
    """One converted call site: unit name, activation kind, channels and the probe input shape."""

    name: str
    kind: str
    num_channels: int
    channel_dim: int
    input_shape: list[int]


@dataclass
class ConversionReport:
    """What ``convert`` found: converted sites and everything it could not or did not convert."""

    sites: list[SiteInfo] = field(default_factory=list)
    functional_calls: dict[str, int] = field(default_factory=dict)  # "owner: fn" -> calls
    uncalled: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)  # site -> why its owner's forward cannot dispatch it
    excluded: list[str] = field(default_factory=list)
    # multiplicative gates left unconverted (LinearizeConfig.gates="exclude"): site -> why it is a gate
    # (a functional gate call is named "owner: fn", like functional_calls)
    gates: dict[str, str] = field(default_factory=dict)
    # nonlinearities no kind of convert covers (PReLU, Softsign, a recurrent layer's kernel): site -> what it is
    unsupported: dict[str, str] = field(default_factory=dict)
    # activation calls on threads the probe forward started, which convert cannot follow: "thread ...: fn" -> calls
    threads: dict[str, int] = field(default_factory=dict)
    # functional activation calls made by a user's forward (pre-)hook that changes the module's output (input):
    # "<module>: fn (forward hook)" -> calls; part of the model's function, which convert cannot give a unit
    hooks: dict[str, int] = field(default_factory=dict)

    @property
    def num_channels(self) -> int:
        """Total number of converted channels over all sites."""
        return sum(s.num_channels for s in self.sites)

    def excluded_sites(self) -> dict[str, str]:
        """Every activation left unconverted on purpose: ``{site: reason}`` (config filters, gates)."""
        return {**{n: "excluded by the config" for n in self.excluded}, **self.gates}

    def problems(self) -> list[str]:
        """Human-readable lines for everything left unconverted that was not excluded on purpose."""
        lines = [
            f"functional call {where} ({n} call(s) per forward) cannot be swapped"
            for where, n in self.functional_calls.items()
        ]
        lines += [f"{n}: never called during the probe forward" for n in self.uncalled]
        lines += [f"{n}: {why}" for n, why in self.unreachable.items()]
        lines += [f"{n}: {what}, not an activation kind convert swaps" for n, what in self.unsupported.items()]
        lines += [f"{where} ({n} call(s) per forward): {THREAD_CALL}" for where, n in self.threads.items()]
        lines += [f"{where} ({n} call(s) per forward): {HOOK_CALL}" for where, n in self.hooks.items()]
        return lines

    def __str__(self) -> str:
        rows = [f"{len(self.sites)} sites, {self.num_channels} channels converted"]
        rows += [f"  {s.name:<60} {s.kind:<12} C={s.num_channels:<6} dim={s.channel_dim}" for s in self.sites]
        problems = self.problems()
        if problems:
            rows.append(f"{len(problems)} activation(s) NOT converted:")
            rows += [f"  {p}" for p in problems]
        if self.excluded:
            rows.append(f"excluded by the config: {', '.join(self.excluded)}")
        if self.gates:
            rows.append(f"{len(self.gates)} multiplicative gate(s) left as they are (gates='exclude'):")
            rows += [f"  {n}: {why}" for n, why in self.gates.items()]
        return "\n".join(rows)


HOOK_CALL = ("made by a hook that changes the module's result, so it is part of the model's function, but convert "
             "gives units only to calls of forward code: neither converted nor counted, so the model is less linear "
             "than the counts say. Fix: apply the activation in a module's forward (a registered activation module "
             "or a functional call there), not in a hook")


# ----------------------------------------------------------------------------- probe


@dataclass
class ActivationCall:
    """One activation call of the probe forward (an entry of :func:`plan_conversion`'s plan); ``gate`` says
    why its output is a multiplicative gate."""

    caller: nn.Module | None
    shape: tuple[int, ...]
    channel_dim: int
    kind: str = ""
    gate: str | None = None
    # functional calls: "owner: fn", and for those a unit can take (FUNCTIONAL_SPECS) the module
    # whose own forward made the call, which invocation of it, and the activation module to blend
    where: str = ""
    owner: nn.Module | None = None
    invocation: int = 0
    act: nn.Module | None = None
    unreachable: str = ""  # a module call its owner's forward cannot dispatch by order (see unreachable_call)
    hook: str = ""  # a module call made by a forward (pre-)hook: the name of the module whose hook it is
    position: tuple = ()  # where in its caller's code the call is made (dispatch.code_position)
    after: tuple[nn.Module | None, int] = (None, 0)  # the last module its caller's own code called before it
    # (not an activation) and how many it called before it
    called: list[nn.Module] = field(default_factory=list)  # the modules its caller's own code called in that call
    check: str | None = None  # a loop's call: the name (in its owner) of the module that must run before it
    integer: bool = False  # a module call on an integer or bool tensor: no slope to learn, no site
    transformed: bool = False  # made under a torch.func transform (torch.vmap in the forward), where no unit runs


def _first_width(layer: nn.Module, attrs: tuple[str, ...]) -> int | None:
    """The first of ``attrs`` that ``layer`` holds as an int, else a norm's ``normalized_shape[-1]``."""
    for attr in attrs:
        width = getattr(layer, attr, None)
        if isinstance(width, int) and not isinstance(width, bool):
            return width
    shape = getattr(layer, "normalized_shape", None)  # LayerNorm / RMSNorm
    return shape[-1] if isinstance(shape, (tuple, list)) and shape and isinstance(shape[-1], int) else None


def _width(layer: nn.Module) -> int | None:
    """The width of a layer's output features (a conv's channels, a linear's or a norm's features, HF's
    ``Conv1D.nf``), or ``None`` for a layer that keeps its input's (padding, dropout, pooling)."""
    return _first_width(layer, ("out_channels", "out_features", "num_features", "num_channels", "embedding_dim", "nf"))


def _in_width(layer: nn.Module) -> int | None:
    """The width of the features a layer takes (a conv's input channels, a linear's or a norm's features)."""
    return _first_width(layer, ("in_channels", "in_features", "num_features", "num_channels"))


_UNSUPPORTED = OTHER_ELEMENTWISE + (nn.RNNBase, nn.RNNCellBase)  # nonlinear modules convert leaves as they are


class _FunctionalRecorder(TorchFunctionMode):
    """Records functional activation calls made outside activation modules."""

    def __init__(self, probe: "_Probe") -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _CONVS:
            self.probe.record_conv(func, args, kwargs or {}, out)
        hooked = hooked_module() if func in _WATCHED else None
        if hooked is not None:  # a user's hook: monitoring, unless the hook changes its module's result
            if func in FUNCTIONAL_SPECS and not self.probe.inside_activation():
                self.probe.hook_calls[id(hooked)].append(getattr(func, "__name__", str(func)))
        elif not self.probe.inside_activation():
            if func in FUNCTIONAL_SPECS:
                self.probe.record_functional(func, args, kwargs or {}, out)
            elif func in _SAME_VALUES and args:
                self.probe.follow(args[0], out, moved=func in _MOVES_AXES)
            elif func in _SCALAR_OPS and args:
                self.probe.follow_scalar_op(args, out)
            elif func in _PRODUCTS:
                self.probe.record_product(func, args, out)
            elif func is torch.einsum and args:
                self.probe.record_einsum(args, out)
            elif func in OTHER_FUNCTIONS and not any(isinstance(m, _UNSUPPORTED) for m in self.probe.running.stack):
                self.probe.record_unsupported(func)
        return out


class _Probe:
    """One hooked forward: activation calls, their callers, and module invocation counts."""

    def __init__(
        self, model: nn.Module, candidates: set[int], activations: set[int], channel_dim: int | None
    ) -> None:
        # the modules running (every module call: one made during forward too) and their names in the model
        self.running = ModuleStack(model, every_module=True, enter=self.enter, leave=self.leave)
        self.names = self.running.names
        self.candidates = candidates
        self.activations = activations  # candidates and excluded ones: their internals are not "functional"
        self.channel_dim = channel_dim
        self.invocations: Counter[int] = Counter()
        self.calls: dict[int, list[ActivationCall]] = defaultdict(list)
        self.functional: list[tuple[str, ActivationCall]] = []  # ("owner: fn", call) per functional activation call
        self.outputs: dict[int, tuple[weakref.ref, ActivationCall]] = {}  # activation outputs (and their views)
        self.pending: dict[int, ActivationCall] = {}  # candidate module id -> its call now running
        self.last_leaf: nn.Module | None = None
        self.unsupported: Counter[str] = Counter()  # functional calls of OTHER_FUNCTIONS ("owner: fn") -> calls
        self.widths: dict[int, tuple[weakref.ref, int]] = {}  # layer outputs (and their views) -> layer width
        self.moved: dict[int, weakref.ref] = {}  # those of them whose axes a transpose or permute moved
        self.unsure: list[ActivationCall] = []  # calls whose channel dim the next layer settles (_settle)
        self.threads: dict[str, int] = {}  # activation calls on threads the forward started (ThreadWatch)
        self.recursive: set[int] = set()  # modules called while already running (a forward that calls itself)
        self.keyword_input: set[int] = set()  # candidates called with no positional input (act(input=h))
        # module id -> the last module its own code called in its call now running, and how many it called
        self.last_called: dict[int, tuple[nn.Module | None, int]] = {}
        self.called: dict[int, list[nn.Module]] = {}  # module id -> every module its own code called (ditto)
        # functional activation calls made by a module's user hooks in its call now running: module id -> names
        self.hook_calls: dict[int, list[str]] = defaultdict(list)
        # a module with user hooks -> its call's arguments / output before them, and their tensors' versions
        self.given: dict[int, tuple[Any, list[int]] | None] = {}
        self.hooks: Counter[str] = Counter()  # "<module>: fn (forward hook)" -> calls whose result its hook changed

    def inside_activation(self) -> bool:
        """Whether an activation module of the model, or a unit of an already converted model that the forward
        calls (a teacher held outside the module tree), is running: calls inside it are its own, not the model's."""
        return any(id(m) in self.activations or isinstance(m, LinearizableActivation) for m in self.running.stack)

    def _where(self, func: Callable) -> tuple[nn.Module | None, str]:
        """The innermost registered module now running and ``"<its name>: <func>"`` for reports."""
        owner = self.running.innermost_registered()
        where = self.names.get(id(owner), "") if owner is not None else ""
        return owner, f"{where or type(owner).__name__}: {getattr(func, '__name__', str(func))}"

    def record_functional(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        x = args[0] if args else kwargs.get("input")
        if isinstance(x, torch.Tensor) and not x.is_floating_point():
            return  # torch.relu on integers (index clamping), torch.tanh too (a float result): the dispatch passes it
        owner, where = self._where(func)
        inner = self.running.stack[-1] if self.running.stack else None
        if inner is not None and id(inner) not in self.names:  # a module made in forward (HF's ACT2FN[...](x)):
            where = f"{where} (inside a {type(inner).__name__} made during forward, not a registered module)"
            owner = None  # its call hides the owner's calls from the owner's dispatch, so it stays as it is
        elif why := unreachable_call():  # a unit there could never train
            where, owner = f"{where} ({why})", None
        kind = FUNCTIONAL_SPECS[func][0]
        call = ActivationCall(None, tuple(getattr(out, "shape", ())), -1, kind, where=where, transformed=_transformed())
        if func in FUNCTIONAL_SPECS and owner is not None and isinstance(out, torch.Tensor):
            call.owner, call.invocation = owner, self.invocations[id(owner)]  # a call the owner's mode will see
            call.position, call.after = code_position(), self.last_called.get(id(owner), (None, 0))
            call.called = self.called.get(id(owner), [])
            if out.ndim:  # a scalar has no channels: that call runs as it is
                if args:  # its input's width (a conv's channels) is its output's
                    self.follow(args[0], out)
                call.channel_dim, sure = self._channel_dim(f"functional call {where} (input shape {tuple(out.shape)})", out)
                if not sure:
                    self.unsure.append(call)
                call.act = activation_module(func, args, kwargs)
        self.functional.append((where, call))
        self._tag(out, call)

    def record_conv(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        """A functional conv call (``F.conv2d(x, w)`` in a forward) made ``out``: refuse it when its input has
        no batch dim (``out`` has one dim less than the weight), as :meth:`leave` refuses an ``nn.Conv*``
        module's (naming the module), else record its channels as ``out``'s width like a conv module's."""
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if not isinstance(out, torch.Tensor) or not isinstance(weight, torch.Tensor):
            return
        if out.ndim == weight.ndim - 1 and not isinstance(
                self.running.stack[-1] if self.running.stack else None, nn.modules.conv._ConvNd):
            raise _unbatched_conv_error(f"the functional call {self._where(func)[1]!r}", out)
        if out.ndim == weight.ndim:
            self.widths[id(out)] = (weakref.ref(out), out.shape[1])

    def record_unsupported(self, func: Callable) -> None:
        self.unsupported[self._where(func)[1]] += 1

    def _tag(self, out: Any, call: ActivationCall) -> None:
        if isinstance(out, torch.Tensor):
            self.outputs[id(out)] = (weakref.ref(out), call)

    def _source(self, x: Any) -> ActivationCall | None:
        """The activation call whose output ``x`` is (or is a view of), if any."""
        entry = self.outputs.get(id(x)) if isinstance(x, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0]() is x else None

    def follow(self, x: Any, out: Any, moved: bool = False) -> None:
        """``out`` holds the values of ``x`` (a view, reshape, cast; ``moved``: a transpose or permute): it
        inherits ``x``'s source and width."""
        call = self._source(x)
        if call is not None and out is not x:
            self._tag(out, call)
        width = self._width_of(x)
        if width is not None and isinstance(out, torch.Tensor) and out is not x:
            self.widths[id(out)] = (weakref.ref(out), width)
            if moved or self._moved(x):
                self.moved[id(out)] = weakref.ref(out)

    def _moved(self, x: torch.Tensor) -> bool:
        """Whether ``x`` holds a layer's output with its axes moved (a transpose or permute of it)."""
        ref = self.moved.get(id(x))
        return ref is not None and ref() is x

    def _width_of(self, x: Any) -> int | None:
        """The output width of the layer that made ``x`` (or the tensor ``x`` is a view or reshape of)."""
        entry = self.widths.get(id(x)) if isinstance(x, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0]() is x else None

    def follow_scalar_op(self, args: tuple, out: Any) -> None:
        """``out`` is an elementwise op (:data:`_SCALAR_OPS`) of ``args``: where one of them is an activation's
        output and the others are scalars, ``out`` inherits its source (``relu6(x + 3) / 6``, ``1 - sigmoid(s)``)."""
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.ndim > 0]
        if len(tensors) == 1 and all(isinstance(a, (torch.Tensor, int, float)) for a in args):
            call = self._source(tensors[0])
            if call is not None and out is not tensors[0]:
                self._tag(out, call)

    def _gate(self, call: ActivationCall, mine: torch.Tensor, other: torch.Tensor, out: torch.Tensor) -> None:
        """Mark ``call``, whose output ``mine`` multiplies ``other`` into ``out``, as a gate where it is one: a
        sigmoid-like kind scaling a tensor, or any kind broadcast."""
        if mine.numel() < out.numel():
            call.gate = f"{call.kind} output {list(mine.shape)} scales a {list(other.shape)} tensor (broadcast gate)"
        elif call.kind in GATE_KINDS:
            call.gate = f"{call.kind} output multiplies a {list(other.shape)} tensor (gate)"

    def record_product(self, func: Callable, args: tuple, out: Any) -> None:
        """Mark the activation calls whose outputs are factors of this product as gates (see
        ``LinearizeConfig.gates`` and :meth:`_gate`); a product by a scalar (``2 * sigmoid(s)``) keeps the factor's
        source (:meth:`follow_scalar_op`)."""
        i, j = _PRODUCTS[func]
        if len(args) <= j or not isinstance(out, torch.Tensor):
            return
        for mine, other in ((args[i], args[j]), (args[j], args[i])):
            call = self._source(mine)
            if call is None or call.gate is not None:
                continue
            if isinstance(other, (int, float)) or isinstance(other, torch.Tensor) and other.ndim == 0:
                if out is not mine:
                    self._tag(out, call)
                continue
            if not isinstance(other, torch.Tensor) or isinstance(other, nn.Parameter) or other.numel() <= 1:
                continue  # a constant scale keeps it linear
            self._gate(call, mine, other, out)

    def record_einsum(self, args: tuple, out: Any) -> None:
        """Mark the activation calls whose outputs are factors of ``torch.einsum(*args)`` as gates where they scale
        another operand elementwise: none of their letters is summed (``"bchw,bc->bchw"``), as in a product."""
        equation, operands = args[0], args[1:]
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):  # torch.einsum(equation, [a, b])
            operands = operands[0]
        if not isinstance(equation, str) or "->" not in equation or not isinstance(out, torch.Tensor):
            return  # an implicit output sums every letter seen twice: no elementwise factor to tell apart
        inputs, result = equation.replace(" ", "").split("->")
        specs = inputs.split(",")
        if len(specs) != len(operands) or len(operands) < 2:
            return
        kept = set(result)
        for k, (mine, spec) in enumerate(zip(operands, specs)):
            call = self._source(mine)
            others = [t for n, t in enumerate(operands) if n != k and isinstance(t, torch.Tensor)
                      and not isinstance(t, nn.Parameter) and t.numel() > 1]  # a constant scale keeps it linear
            if call is None or call.gate is not None or not others or not set(spec) <= kept:
                continue
            self._gate(call, mine, max(others, key=torch.Tensor.numel), out)

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A module call starts (``self.running.stack[-1]`` is its caller)."""
        if id(module) in self.given:  # a module with user hooks: its arguments before them (the probe's are global)
            self.given[id(module)] = (args, _versions(args))
        if id(module) in self.candidates:
            if not args:  # the global pre-hook sees no keyword arguments: a call the probe cannot record
                self.keyword_input.add(id(module))
            x = args[0] if args else None
            if isinstance(x, torch.Tensor):
                caller = self.running.stack[-1] if self.running.stack else None
                where = f"activation {self.names.get(id(module), type(module).__name__)!r} (input shape {tuple(x.shape)})"
                dim, sure = self._channel_dim(where, x)
                hooked = hooked_module(skip=1)
                hook = "" if hooked is None else self.names.get(id(hooked)) or type(hooked).__name__
                call = ActivationCall(caller, tuple(x.shape), dim, activation_kind(module) or "",
                                      unreachable=unreachable_call(skip=1), hook=hook, position=code_position(skip=1),
                                      after=self.last_called.get(id(caller), (None, 0)),
                                      called=self.called.get(id(caller), []),
                                      integer=not (x.is_floating_point() or x.is_complex()), transformed=_transformed())
                self.calls[id(module)].append(call)
                self.pending[id(module)] = call
                if not sure:
                    self.unsure.append(call)
        elif self.unsure and next(module.children(), None) is None and (width := _in_width(module)) is not None:
            self._settle(width, args[0] if args else None)
        if any(m is module for m in self.running.stack):
            self.recursive.add(id(module))
        if self.running.stack and id(module) not in self.activations:
            parent = id(self.running.stack[-1])
            self.last_called[parent] = (module, self.last_called.get(parent, (None, 0))[1] + 1)
            self.called.setdefault(parent, []).append(module)
        self.last_called[id(module)] = (None, 0)  # its own calls start
        self.called[id(module)] = []
        self.invocations[id(module)] += 1

    def leave(self, module: nn.Module, args: tuple, output: Any, _: None) -> None:
        """A module call returned ``output``."""
        if id(module) in self.given:
            self.given[id(module)] = (output, _versions(output))  # before the module's own forward hooks
        call = self.pending.pop(id(module), None)
        if call is not None:
            self._tag(output, call)
        if id(module) in self.candidates:
            return
        if next(module.children(), None) is None:
            self.last_leaf = module
        if isinstance(module, nn.modules.conv._ConvNd) and isinstance(output, torch.Tensor) and (
                output.ndim == len(module.kernel_size) + 1):  # [C, *spatial]: torch's unbatched conv input
            name = self.names.get(id(module)) or type(module).__name__
            raise _unbatched_conv_error(f"{type(module).__name__} {name!r}", output)
        width = _width(module)  # leaf or not: a weight-normed conv holds its parametrization as children
        if width is not None and isinstance(output, torch.Tensor):
            self.widths[id(output)] = (weakref.ref(output), width)

    def _channel_dim(self, where: str, x: torch.Tensor) -> tuple[int, bool]:
        """The channel dim of an activation call on ``x`` (``where`` names the call in errors) and whether
        it is settled: when ``x`` is the output of a layer with a width (a conv's channels, a linear's or a
        norm's features), or a view, reshape or transpose of it, the one of dims 1 and -1 of that size, so
        a (B, C, T) map after a LayerNorm, or (B, N, C) tokens after a BatchNorm1d, get their feature
        axis. Otherwise (a sum, a concatenation, a matmul, a pixel shuffle came between), or where both fit,
        a guess by the last layer's type, which the next layer taking this shape settles by its input
        width (:meth:`_settle`)."""
        if self.channel_dim is not None:  # forced by the config: it must fit this call's input
            check_channel_dim(self.channel_dim, x.ndim, where)
            return self.channel_dim, True
        if x.ndim <= 2:
            return -1, True
        fits = [d for d in (1, -1) if x.shape[d] == self._width_of(x)]
        if len(fits) == 1:
            return fits[0], True
        if len(fits) == 2 and self._moved(x):
            warnings.warn(
                f"linearize.convert: {where}: the layer before it has {x.shape[1]} features, and a transpose or "
                f"permute left dims 1 and -1 both of that size on the probe input, so its channel axis cannot be "
                "told (a sequence as long as the features are wide); its slopes may act on positions instead. Fix: "
                "convert with channel_dim= set to the feature axis (-1 for (batch, length, features) tokens, 1 for "
                "(batch, features, length) maps), or example_inputs of another length", stacklevel=2)
        if isinstance(self.last_leaf, _CHANNEL_FIRST):
            return 1, False
        if isinstance(self.last_leaf, (nn.Linear, nn.LayerNorm, nn.Embedding)) or (
            type(self.last_leaf).__name__ == "Conv1D"  # HF GPT-2 style linear layer
        ):
            return -1, False
        return (1 if x.ndim >= 4 else -1), False

    def _settle(self, width: int, x: Any) -> None:
        """The first layer after unsettled activation calls that takes their shape (``x``) and has an input
        ``width``: a call whose dim 1 or -1 alone has that size gets it as its channel dim."""
        if not isinstance(x, torch.Tensor):
            return
        for call in self.unsure:
            fits = [d for d in (1, -1) if call.shape[d] == width]
            if tuple(x.shape) == call.shape and len(fits) == 1:
                call.channel_dim = fits[0]
        self.unsure = []

    def _hooks_done(self, module: nn.Module, args: tuple, output: Any = None, *, kind: str = "forward hook") -> None:
        """The user's hooks of a ``module`` call have run (the probe's own run last): the functional activation
        calls they made are part of the model's function when they changed the call's arguments (pre-hooks) or
        output (forward hooks): replaced them (they are no longer the objects the probe saw before them) or
        changed their tensors in place (``F.relu(out, inplace=True)``: a tensor's version counter moved)."""
        calls = self.hook_calls.pop(id(module), [])
        now = output if kind == "forward hook" else args
        before, versions = self.given.get(id(module)) or (None, [])
        if calls and (now is not before or _versions(now) != versions):
            where = self.names.get(id(module), "") or type(module).__name__
            self.hooks.update(f"{where}: {fn} ({kind})" for fn in calls)

    def run(self, model: nn.Module, inputs: Any) -> None:
        # a ScriptModule's hooks are compiled in (they call no Python activation) and it takes no new ones
        hooked = [m for m in model.modules()
                  if (m._forward_pre_hooks or m._forward_hooks) and not isinstance(m, torch.jit.ScriptModule)]
        self.given = dict.fromkeys(map(id, hooked))
        handles = [h for m in hooked for h in (  # after the user's hooks: which of them changed the call
            m.register_forward_pre_hook(functools.partial(self._hooks_done, kind="forward pre-hook")),
            m.register_forward_hook(self._hooks_done))]
        try:
            with self.running:
                with eval_mode(model), torch.no_grad(), _FunctionalRecorder(self), ThreadWatch(
                        [*FUNCTIONAL_SPECS, *OTHER_FUNCTIONS], self.activations) as watch:
                    call_model(model, inputs)
                self.threads = watch.calls
        finally:
            for h in handles:
                h.remove()
            self.given.clear()


def _versions(x: Any) -> list[int]:
    """The version counters of the tensors in ``x`` (an in-place change moves them; -1 for an inference tensor,
    which has none)."""
    return [-1 if t.is_inference() else t._version for t in output_tensors(x)]


def _matches(name: str, patterns: list[str] | None) -> bool:
    return any(
        name == p or name.endswith("." + p) or re.fullmatch(p, name) is not None for p in patterns or []
    )


def _outside_activations(model: nn.Module, prefix: str = ""):
    """``(name, module)`` of every module not nested inside an activation module, shared ones once
    per path; an activation's own internals (HF ``GELUActivation.act``) are never candidates."""
    yield prefix, model
    for attr, child in model.named_children():
        if activation_kind(child) is None:
            yield from _outside_activations(child, f"{prefix}.{attr}" if prefix else attr)


def wrap_function_attributes(model: nn.Module) -> list[tuple[nn.Module, str, Callable]]:
    """Turn activation functions held as plain attributes into FunctionalActivation modules; returns
    ``(module, attribute, function)`` of each, for :func:`function_attributes_wrapped` to put back."""
    wrapped = []
    for _, module in list(_outside_activations(model)):
        for attr, value in list(vars(module).items()):
            if attr.startswith("_") or isinstance(value, nn.Module):
                continue
            kind = activation_kind(value)
            if kind is not None:
                delattr(module, attr)
                setattr(module, attr, FunctionalActivation(value, kind, f"{type(module).__name__}.{attr}"))
                wrapped.append((module, attr, value))
    return wrapped


@contextmanager
def function_attributes_wrapped(model: nn.Module) -> Iterator[None]:
    """:func:`wrap_function_attributes` for the body; the functions are put back when the body raises (the
    model is left as it was given)."""
    wrapped = wrap_function_attributes(model)
    try:
        yield
    except BaseException:
        for module, attr, value in wrapped:
            delattr(module, attr)
            setattr(module, attr, value)
        raise


@contextmanager
def restored_on_error(model: nn.Module) -> Iterator[None]:
    """The body may change ``model`` (submodules put in place, hooks moved or added, attributes set); when it
    raises, every module of ``model`` gets back the attributes it had, and its registries (the dicts in its
    ``__dict__``: submodules, parameters, hooks ...) their entries, in the same dict objects, so the user's hook
    handles still remove their hooks: the model is left exactly as given; and no dispatch mode of its new
    functional sites stays on the thread (:func:`~linearize.functional_sites.drop_site_modes`)."""
    saved = [(m, dict(vars(m)), {k: dict(v) for k, v in vars(m).items() if isinstance(v, dict)})
             for m in model.modules()]
    try:
        yield
    except BaseException:
        drop_site_modes(model)  # an interrupted check run's dispatch mode: no forward of the model will drop it
        for m, attrs, registries in saved:
            vars(m).clear()
            vars(m).update(attrs)
            for k, entries in registries.items():
                attrs[k].clear()
                attrs[k].update(entries)
        raise


def _called_once_by_one_other(probe: "_Probe", act: nn.Module) -> bool:
    """Whether every call of the activation module ``act`` in the probe came from one module other than its
    registered owner, once per forward of that caller (``for layer in self.layers: x = layer(x)`` over an
    ``nn.ModuleList``): such a module is swapped in place for its unit, as any module called once is; no call
    order is needed."""
    calls = probe.calls[id(act)]
    caller = calls[0].caller if calls else None
    return (caller is not None and all(c.caller is caller for c in calls)
            and len(calls) == probe.invocations[id(caller)])


def _hookless_call(owner: nn.Module, probe: "_Probe") -> str:
    """Why the activation modules of ``owner`` seem called by another module, when the probe never saw ``owner``
    called through ``nn.Module.__call__`` because its class overrides ``__call__`` (``def __call__(self, x): return
    self.forward(x)``): its module hooks never run, so its calls look like its caller's. "" otherwise."""
    call = getattr(type(owner), "__call__", None)
    if probe.invocations[id(owner)] or call is nn.Module.__call__:
        return ""
    where = getattr(call, "__qualname__", f"{type(owner).__name__}.__call__")
    return (f"its owner {type(owner).__name__} overrides __call__ ({where}), which runs its forward without "
            "nn.Module.__call__, so no module hook runs for it and its activation calls look like its caller's; "
            f"fix: remove {where} (or return super().__call__(*args, **kwargs) from it), so that the module is "
            "called as torch calls modules")


def activation_registrations(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """Every ``(qualified_name, owner, attribute, activation)``, shared modules once per owner."""
    found = []
    seen: set[tuple[int, str]] = set()
    for owner_name, owner in _outside_activations(model):
        for attr, child in owner.named_children():
            if activation_kind(child) is not None and (id(owner), attr) not in seen:
                seen.add((id(owner), attr))
                found.append((f"{owner_name}.{attr}" if owner_name else attr, owner, attr, child))
    return found


@dataclass
class OwnerPlan:
    """The functional activation calls of one owner's forward and the units some of them get."""

    owner: nn.Module
    name: str
    calls: list[ActivationCall]
    units: dict[int, SiteInfo]  # call position -> the unit it gets
    repeat: bool = False  # the calls are one loop's iterations: one unit runs every call, however many


LOOP_FIX = ("fix: move the loop into a module of its own, or call an activation module of its own in the loop "
            "(self.loop_act = nn.GELU()): its calls then share one unit")


def _loops(owner: nn.Module, calls: list[ActivationCall], names: dict[int, str]) -> list[list[int]]:
    """The loops among one forward's ``calls`` of an owner: the positions of calls made from one place in its code
    more than once. A loop whose iterations nothing tells apart (one kind and input width, no module called between
    them: the experts of a mixture-of-experts looped over as weights) is returned, to get one unit shared by its
    iterations. In a loop that calls other modules between its iterations each call gets ``check``: the name in
    ``owner`` of the module its owner called before it (a layer of ``for layer in self.layers: x =
    F.relu(layer(x))``), which its unit's dispatch checks at every forward, so that calls after another subset of
    the modules (a routed loop) never run other iterations' units."""
    by_position: dict[tuple, list[int]] = defaultdict(list)
    for k, call in enumerate(calls):
        by_position[call.position].append(k)
    shared = []
    prefix = f"{names[id(owner)]}." if names.get(id(owner)) else ""
    for group in by_position.values():
        first = calls[group[0]]
        if len(group) < 2:
            continue
        if all(calls[k].after == first.after and calls[k].kind == first.kind
               and call_channels(calls[k]) == call_channels(first) for k in group):
            shared.append(group)
            continue
        before = [calls[k].after[0] for k in group]
        if all(m is before[0] for m in before):  # one module right before each (a shared norm, a weight-tied layer)
            before = _told_apart(calls, group)
            if before is None:  # told apart by order only: never matched by order, whatever the routing
                if all(calls[k].kind == first.kind and call_channels(calls[k]) == call_channels(first) for k in group):
                    shared.append(group)
                continue
        for k, module in zip(group, before):
            name = names.get(id(module)) if module is not None else None
            calls[k].check = name[len(prefix):] if name is not None and name.startswith(prefix) else None
    return shared


def _told_apart(calls: list[ActivationCall], group: list[int]) -> list[nn.Module] | None:
    """For a loop's calls (positions ``group``) that come right after one module each (a shared norm): per
    iteration, the last module its owner called in that iteration and in no other (an expert, before the shared
    norm), which tells the iterations apart; None when an iteration has none (experts held as weights, a
    weight-tied layer)."""
    windows, start = [], calls[group[0] - 1].after[1] if group[0] else 0
    for k in group:
        windows.append(calls[k].called[start:calls[k].after[1]])
        start = calls[k].after[1]
    found = []
    for i, window in enumerate(windows):
        others = {id(m) for j, w in enumerate(windows) if j != i for m in w}
        module = next((m for m in reversed(window) if id(m) not in others), None)
        if module is None:
            return None
        found.append(module)
    return found


def _loop_last(shared: list[list[int]], count: int) -> bool:
    """Whether the one loop among an owner's ``count`` calls (:func:`_loops`) comes after every other call and they
    are not all its own (``x = F.relu(self.fc(x)); for w in self.ws: x = F.relu(x @ w)``): matched by order, the
    calls before it keep their units whatever its count, and its iterations get one unit each, the count checked
    at every forward, as a fixed-count loop (``range(3)``) needs."""
    return len(shared) == 1 and 0 < count - len(shared[0]) and shared[0] == list(range(count - len(shared[0]), count))


def _plan_functional(
    model: nn.Module, calls: list[ActivationCall], config: LinearizeConfig, report: ConversionReport,
    invocations: Counter[int], targets: list[str] | None, excludes: list[str] | None,
) -> tuple[list[OwnerPlan], list[ActivationCall]]:
    """Units for the functional activation calls each owner's own forward makes, by call order.

    An owner whose invocations in the probe made different calls (kinds, widths, count) keeps
    them unconverted: returned as the second list, to be reported, with calls on scalars (which
    keep their slot in the call order but run as they are).
    """
    names = {id(m): n for n, m in model.named_modules()}
    by_owner: dict[int, list[ActivationCall]] = defaultdict(list)
    for call in calls:
        by_owner[id(call.owner)].append(call)
    plans, left = [], []
    for owner_calls in by_owner.values():
        owner = owner_calls[0].owner
        per_call: dict[int, list[ActivationCall]] = defaultdict(list)
        for call in owner_calls:
            per_call[call.invocation].append(call)
        runs = list(per_call.values())
        signature = [[(c.kind, call_channels(c), c.position) for c in run] for run in runs]
        if isinstance(owner, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) and id(owner) in names:
            left += [c for c in owner_calls if c.act is None or c.gate is not None and config.gates == "exclude"]
            for where, n in Counter(c.where for c in owner_calls if c.act is not None and (
                    c.gate is None or config.gates != "exclude")).items():
                report.unreachable[f"functional call {where} ({n // max(1, len(runs))} call(s) per forward)"] = (
                    f"its owner {type(owner).__name__} is a container ({_container(owner)} subclass), whose "
                    "children are its layers (run, iterated, indexed), so a child holding the units of its own "
                    "forward's calls would become one of them; fix: "
                    f"make {type(owner).__name__} an nn.Module holding its layers (self.layers = nn.Sequential(...)), "
                    "or end the container with an activation module (nn.ReLU()) in place of the functional call")
            continue
        if (any(s != signature[0] for s in signature) or len(runs) != invocations[id(owner)]
                or id(owner) not in names):
            left += owner_calls  # control flow: not by order
            continue
        owner_name = names[id(owner)]
        shared = _loops(owner, runs[0], names)
        if shared and _loop_last(shared, len(runs[0])):  # by order: the loop's count cannot shift the calls before
            shared = []
        if shared and len(shared[0]) < len(runs[0]):  # a loop among other calls: its count shifts their order
            where = runs[0][shared[0][0]].where
            report.unreachable[f"functional call {where} ({len(runs[0])} call(s) per forward)"] = (
                f"{len(shared[0])} of them are made in a loop (one place in the code of {type(owner).__name__}, "
                "the same input width, nothing telling the iterations apart, as a mixture-of-experts' loop over "
                "its routed experts), whose count may depend on the input, and the owner makes other activation "
                f"calls, matched to their units by order; {LOOP_FIX}")
            continue
        plan = OwnerPlan(owner, owner_name, runs[0][:1] if shared else runs[0], {}, repeat=bool(shared))
        for k, call in enumerate(plan.calls):
            name = f"{owner_name}.{ATTR}.{call.kind}_{k}" if owner_name else f"{ATTR}.{call.kind}_{k}"
            gate = next((c.gate for run in runs for c in (run if plan.repeat else run[k:k + 1]) if c.gate is not None),
                        None)
            if call.act is None:
                left.append(call)
            elif call.kind not in config.activations or (
                targets is not None and not (_matches(name, targets) or _matches(owner_name, targets))
            ) or _matches(name, excludes) or _matches(owner_name, excludes):
                report.excluded.append(name)
            elif gate is not None and config.gates == "exclude":
                report.gates[name] = f"{gate}; functional call"
            else:
                site = SiteInfo(name, call.kind, _width_of_call(name, call), call.channel_dim, list(call.shape))
                report.sites.append(site)
                plan.units[k] = site
        if plan.units:
            plans.append(plan)
    return plans, left


def _container(owner: nn.Module) -> str:
    """The torch container class ``owner`` derives from (``"nn.Sequential"``)."""
    return next(f"nn.{c.__name__}" for c in (nn.Sequential, nn.ModuleList, nn.ModuleDict) if isinstance(owner, c))


def _width_of_call(name: str, call: ActivationCall) -> int:
    """The channels of the call a unit ``name`` is made for; ``ValueError`` for a zero-width one."""
    width = call.shape[call.channel_dim]
    if width == 0:
        raise ValueError(f"linearize.convert: activation {name!r} runs on zero channels (input shape "
                         f"{list(call.shape)}, channel dim {call.channel_dim}): there is nothing to linearize. Fix: "
                         f"exclude it, linearize.convert(..., exclude_modules=[{name.split('.calls.')[0]!r}]), "
                         "or remove the empty layer")
    return width


def _refuse_other_callers(name: str, calls: list[ActivationCall], others: list[ActivationCall], names: dict[int, str],
                          granularity: str) -> None:
    """``ValueError`` before the model is touched when calls of the activation module ``name`` that its owner does
    not make (``others``: a module it is handed to, a hook) would reach a replacement that cannot serve them:
    the units of several owner ``calls``, matched by their order among the owner's own calls, or one unit made
    for another input width. Calls one unit serves (the same width) are left to it."""
    if not others:
        return
    first = calls[0]
    fits = (lambda c: c.shape[1:] == first.shape[1:]) if granularity == "element" else (
        lambda c: -len(c.shape) <= first.channel_dim < len(c.shape)
        and c.shape[first.channel_dim] == first.shape[first.channel_dim])
    other = next((c for c in others if len(calls) > 1 or not fits(c)), None)
    if other is None:
        return
    by = (f"a hook of {other.hook!r}" if other.hook else "code outside any module's forward" if other.caller is None
          else f"{names.get(id(other.caller)) or type(other.caller).__name__!r} (the module it is handed to)")
    why = (f"it is called {len(calls)} times per forward of its owner, whose units are matched by their order among "
           "the owner's own calls, which that call is not one of" if len(calls) > 1 else
           f"its unit is made for the owner's call (input shape {list(first.shape)}), and that call's input has "
           f"shape {list(other.shape)}")
    raise ValueError(
        f"linearize.convert: the activation module {name!r} is also called by {by}: {why}. Fix: give that caller "
        f"its own activation module (e.g. an nn.ReLU() of its own), or exclude_modules=[{name!r}] to keep this one "
        "as it is; the model is left as given")


def call_channels(call: ActivationCall) -> tuple[int, int] | None:
    """``(channel_dim, width)`` of a functional call's input; None for a scalar."""
    return (call.channel_dim, call.shape[call.channel_dim]) if call.shape else None


def plan_conversion(
    model: nn.Module, config: LinearizeConfig, example_inputs: Any, functional: bool = False
) -> tuple[ConversionReport, list[tuple[nn.Module, str, nn.Module, list[ActivationCall]]], list[OwnerPlan]]:
    """Probe ``model`` and decide the replacement of every selected activation: ``(report, plan,
    owner_plans)``. ``plan`` holds one ``(owner, attr, activation, calls)`` per registration to
    replace (one call per unit); with ``functional`` the functional calls each owner's forward makes
    get units too (``owner_plans``), else they are only listed in ``report.functional_calls``
    (and ``owner_plans`` is empty). ``model`` is not modified (one probe forward in eval mode).
    """
    regs = activation_registrations(model)
    report = ConversionReport()
    chosen = []
    # validated again: a config's fields may have been set after it was built
    targets = as_patterns(config.target_modules, "target_modules")
    excludes = as_patterns(config.exclude_modules, "exclude_modules")
    for name, owner, attr, act in regs:
        if activation_kind(act) not in config.activations or (
            targets is not None and not _matches(name, targets)
        ) or _matches(name, excludes):
            report.excluded.append(name)
        else:
            chosen.append((name, owner, attr, act))
    probe = _Probe(model, {id(act) for *_, act in chosen}, {id(act) for *_, act in regs}, config.channel_dim)
    guessed = example_inputs is None
    inputs = guess_example_inputs(model) if guessed else example_inputs
    try:
        with inputs_fit(inputs) if not guessed else contextlib.nullcontext():
            probe.run(model, inputs)
    except Exception as err:  # a guessed input the model cannot take: say so, not a deep torch error
        if not guessed or isinstance(err, FunctionalSiteError):
            raise
        raise guessed_input_error(model, inputs, err) from err
    report.unsupported = {  # called in the probe, and not left out by the config's names
        name: f"{type(m).__name__} (nonlinearities inside its kernel)" if isinstance(m, nn.RNNBase) else type(m).__name__
        for name, m in model.named_modules()
        if isinstance(m, _UNSUPPORTED) and probe.invocations[id(m)] and (targets is None or _matches(name, targets))
        and not _matches(name, excludes)
    } | {where: f"functional call, {n} per forward" for where, n in probe.unsupported.items()
         if not _matches(where.split(":")[0], excludes)} | {
        name or "<root>": "TorchScript module: its code runs compiled, so the activations inside it can be neither "
        "seen nor converted (fix: convert the Python module, then script the result)"
        for name in compiled_submodules(model) if not _matches(name, excludes)}
    exclude_gates = config.gates == "exclude"
    owned = [call for _, call in probe.functional if functional and call.owner is not None]
    owner_plans, left = _plan_functional(model, owned, config, report, probe.invocations, targets, excludes)
    left_ids = {id(c) for c in left}
    skipped: Counter[str] = Counter()
    recursive: dict[str, list[ActivationCall]] = defaultdict(list)
    for where, call in probe.functional:
        if functional and call.owner is not None and id(call) not in left_ids:
            continue  # planned above
        if exclude_gates and call.gate is not None:
            report.gates.setdefault(where, f"{call.gate}; functional call")
        elif functional and call.owner is not None and id(call.owner) in probe.recursive:
            recursive[where].append(call)
        else:
            skipped[where] += 1
    report.functional_calls = dict(skipped)
    for where, calls in recursive.items():
        report.unreachable[f"functional call {where} ({len(calls)} call(s) per forward)"] = (
            f"its owner {type(calls[0].owner).__name__} calls itself (its forward runs nested inside its own "
            "forward), and a functional call gets its unit by its order within one invocation "
            "of its owner, which nested invocations of the same module mix up; fix: call a registered activation "
            "module instead (self.act = nn.ReLU() in __init__, self.act(x) in forward: one unit shared by every "
            "depth), or build each depth as its own submodule (a unit per depth)")
    report.threads = probe.threads
    report.hooks = {where: n for where, n in probe.hooks.items() if not _matches(where.split(":")[0], excludes)}

    plan = []
    transformed = [f"{p.units[k].name} (functional call {call.where})" for p in owner_plans
                   for k, call in enumerate(p.calls) if k in p.units and call.transformed]
    owned_calls: Counter[int] = Counter()
    registered: dict[int, set[int]] = defaultdict(set)  # activation -> the modules registering it
    for _, owner, _, act in regs:
        registered[id(act)].add(id(owner))
    for name, owner, attr, act in chosen:
        caller = owner
        calls = [c for c in probe.calls[id(act)] if c.caller is owner and not c.hook]
        if not calls and _called_once_by_one_other(probe, act):  # a parent looping over a ModuleList
            calls, caller = probe.calls[id(act)], probe.calls[id(act)][0].caller
        # calls that reach what replaces owner.attr from elsewhere (a module the owner hands it to, a hook)
        others = [c for c in probe.calls[id(act)] if c.hook or id(c.caller) not in registered[id(act)]] \
            if calls and caller is owner else []
        owned_calls[id(act)] += len(calls) + len(others)
        if id(act) in probe.keyword_input:  # a unit takes its input positionally, and the probe saw no such call
            report.unreachable[name] = (
                "called with its input as a keyword argument (act(input=h)), which convert cannot follow: it runs as "
                "it is; fix: call it positionally (act(h))")
            continue
        if not calls:
            if not probe.calls[id(act)]:
                report.uncalled.append(name)
            continue
        per_forward = len(calls) // max(1, probe.invocations[id(caller)])
        if any(c.integer for c in calls):  # its unit would run the activation itself there (slopes unused)
            report.unreachable[name] = (
                "called on an integer or bool tensor, which has no slope to learn: it runs as it is (as a functional "
                "call on integers does); fix: none needed if every call is on integers, else give its floating-point "
                "calls an activation module of their own")
            continue
        calls = calls[: max(1, per_forward)]
        shared = _loops(owner, calls, probe.names) if caller is owner else []
        if shared and _loop_last(shared, len(calls)):  # by order: the loop's count cannot shift the calls before
            shared = []
        if shared and len(shared[0]) < len(calls):  # a loop among other calls: its count shifts their order
            report.unreachable[name] = (
                f"called {len(calls)} times per forward of its owner, {len(shared[0])} of them in a loop (one place "
                "in its code, the same input width, nothing telling the iterations apart, as a mixture-of-experts' "
                "loop over its routed experts), whose count may depend on the input, while the other calls are "
                f"matched to their units by order; {LOOP_FIX}")
            continue
        if shared:  # every call is one loop's (MixtralExperts' eager loop): one unit, however many iterations
            calls = calls[:1]
        _refuse_other_callers(name, calls, others, probe.names, getattr(config, "granularity", "channel"))
        why = next((c.unreachable for c in calls if c.unreachable), "")
        if len(calls) > 1 and why:  # one unit per call, matched by order: a recomputed call has no position
            report.unreachable[name] = (f"called {len(calls)} times per forward of its owner, one call {why}; "
                                        "fix: give that call its own activation module")
            continue
        if why == IN_FUNCTION:  # its unit would never train: the Function's backward runs no autograd through it
            report.unreachable[name] = (f"called {why}, which runs no autograd through it; fix: call the "
                                        "activation outside the Function, where autograd differentiates it")
            continue
        for k, call in enumerate(calls):
            unit_name = name if len(calls) == 1 else f"{name}.calls.{k}"
            if call.gate is not None and exclude_gates:
                report.gates[unit_name] = call.gate
                continue
            call.gate = None  # converted: convert() builds a unit for every call without a gate
            if call.transformed:
                transformed.append(f"{unit_name} ({type(act).__name__} called by {type(caller).__name__})")
            report.sites.append(
                SiteInfo(unit_name, activation_kind(act) or "", _width_of_call(unit_name, call),
                         call.channel_dim, list(call.shape))
            )
        if any(call.gate is None for call in calls):
            plan.append((owner, attr, act, calls))
    for name, owner, attr, act in chosen:
        if probe.calls[id(act)] and owned_calls[id(act)] < len(probe.calls[id(act)]):
            report.unreachable.setdefault(name, _hookless_call(owner, probe) or (
                "called by a module that does not own it (a parent looping over a ModuleList, another module); fix: "
                "give each caller its own activation module"))
    if transformed:
        names = [t.split(" ", 1)[0] for t in transformed]
        raise ValueError(
            f"linearize: {', '.join(transformed)}: called under a torch.func transform (torch.vmap, grad, "
            "jacrev, functional_call of stacked ensembles ...) inside the model's own forward, where a unit cannot "
            "run (its custom backward cannot be transformed), so the converted model could not run. Fix: "
            f"convert with exclude_modules={names!r}, which leaves those calls as they are")
    return report, plan, owner_plans


def _transformed() -> bool:
    """Whether a torch.func transform (``torch.vmap``, ``grad``, ...) is running the current call."""
    return torch._C._functorch.peek_interpreter_stack() is not None
