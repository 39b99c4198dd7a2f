"""Units for functional activation calls made inside a module's own ``forward``.

``out = F.relu(self.bn1(self.conv1(x)))`` (CIFAR ResNets, torchvision GoogLeNet / Inception /
DenseNet), ``x.relu_()``, ``torch.relu``, ``F.gelu`` ... cannot be swapped like a module. Each such
call gets its own :class:`~linearize.unit.LinearizableActivation`, held by a
:class:`FunctionalSites` child registered on the module that makes the call (its *owner*) as
``owner.linearize_functional``: the units are ordinary submodules (state dict, ``.to()``, DDP,
deepcopy), named ``<owner>.linearize_functional.<kind>_<k>`` for the ``k``-th functional
activation call of the owner's forward.

How calls reach their units: while the owner's forward runs, a ``TorchFunctionMode``
(:class:`_SiteMode`, one per forward, on that thread's mode stack) sends the owner's ``k``-th activation call
to unit ``k``; every other torch function passes straight through. Only calls made by the owner's *own*
code count: :mod:`~linearize.dispatch` tells them apart by the interpreter's frames (calls inside a child,
in a hook, or after an interrupt pass through), and holds the counters per thread and per forward.

Where it cannot work: an owner whose number (or kinds, or widths) of activation calls changes
from one forward to the next (control flow on the input) cannot be matched by call order; the
end of the owner's forward detects it and raises :class:`FunctionalSiteError` naming the owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .activations import FUNCTIONAL_SPECS, call_arguments, in_place
from .dispatch import (FunctionalSiteError, Positions, Scope, attach_owner, caller_scope, checkpoint_error, eager,
                       fx_tracer, loop_error, moved_call, prime_eager, refuse_fx_root, refuse_scripting, watch_child)
from .unit import nested_parts, write_into

__all__ = ["FunctionalSites", "FunctionalSiteError", "ATTR", "install_functional_sites", "drop_site_modes"]

ATTR = "linearize_functional"  # the owner's child that holds its functional units

@dataclass
class _Calls:
    """The functional activation calls of one owner forward (kept in its :class:`~linearize.dispatch.Scope`)."""

    mode: "_SiteMode | None"  # None once end_forward took it off the stack
    suspended: TorchFunctionMode | None  # an enclosing owner's mode, off the stack while this forward runs
    position: int = 0
    seen: list[str] = field(default_factory=list)  # kinds of this forward's calls, kept only after a mismatch
    mismatch: bool = False
    width: str = ""  # a call of the probe's kind whose input width is not its unit's
    arguments: str = ""  # a call of the probe's kind made with other arguments than the probe's
    loop: str = ""  # a loop's call made after another module than the probe's (loop_error)
    moved: str = ""  # a call made at another place in the owner's code than the probe's call (moved_call)


class _SiteMode(TorchFunctionMode):
    """Sends one owner forward's own activation calls to its :class:`FunctionalSites`; the rest passes through."""

    linearize_site_mode = True  # dispatch.SITE_MODE: units under it still take their own exact paths

    def __init__(self, sites: "FunctionalSites", scope: Scope) -> None:
        super().__init__()
        self.sites, self.scope = sites, scope

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else kwargs.get("input")
        if func in FUNCTIONAL_SPECS and not (isinstance(x, torch.Tensor) and not x.is_floating_point()):
            scope = self._scope_of(func)  # an integer call (index clamping) is no site: the probe skipped it
            if scope is not None:
                return scope.data.mode.sites.call(scope, func, args, kwargs)
        return func(*args, **kwargs)

    @eager
    def _scope_of(self, func: Callable) -> Scope | None:
        """The open forward whose owner's own code made this call, if that owner has functional sites: this
        mode's, or another's (an outer forward that caught an interrupt of an inner one, whose mode stayed
        on top: its calls still reach their units); None: the call passes through."""
        scope = caller_scope(lambda: f"the functional call {getattr(func, '__name__', func)} of "
                                     f"{self.sites.owner_name or '<root>'!r}")
        return scope if scope is not None and isinstance(scope.data, _Calls) and scope.data.mode is not None else None


class FunctionalSites(nn.Module):
    """The units of one owner's functional activation calls, dispatched by call order.

    Args:
        owner_name: the owner's qualified name (for errors).
        kinds: the kind of every intercepted call of one owner forward, in order.
        channels: ``(channel_dim, width)`` of every call's input as the probe saw it (None: a scalar).
        modules: ``{position: unit}`` for the converted calls; the others (gates, calls excluded
            by the config) run their original function.
        arguments: the probe's :func:`~linearize.activations.call_arguments` of every call (None: not checked).
            A converted call made with other arguments (``F.leaky_relu(x, 0.2 if self.training else 0.01)``)
            would run a unit of another function: the end of the forward raises :class:`FunctionalSiteError`.
        repeat: every call of the owner's forward is made by one loop whose iterations nothing tells apart (a
            mixture-of-experts' loop over its routed experts held as weights): each runs the unit of call 0, and
            their number may change from one forward to the next.
        after: per call, None or the name (in the owner) of the module its owner's code calls right before it, in a
            loop over modules (``for layer in self.layers: x = F.relu(layer(x))``): a call made after another
            module (a loop over another subset of them) raises :class:`FunctionalSiteError` at the end of the
            forward instead of running another iteration's unit.
        positions: per call, the probe's :func:`~linearize.dispatch.code_position` (``()``: not checked): a call
            made elsewhere in the owner's code (``if``/``else`` branches calling them in another order) raises
            :class:`FunctionalSiteError` at the end of the forward instead of running another call's unit.

    Call ``k`` runs the module registered as ``f"{kinds[k]}_{k}"`` (a unit, or the plain module
    :func:`linearize.fold` put in its place). An in-place call (``F.relu(x, inplace=True)``,
    ``x.relu_()``) writes the unit's output into its input and returns it.
    """

    def __init__(self, owner_name: str, kinds: list[str], channels: list[tuple[int, int] | None],
                 modules: dict[int, nn.Module], arguments: list[tuple] | None = None, repeat: bool = False,
                 after: list[str | None] | None = None, positions: list[tuple] | None = None) -> None:
        super().__init__()
        self.owner_name = owner_name
        self.kinds = list(kinds)
        self.channels = list(channels)
        self.arguments = list(arguments) if arguments is not None else [None] * len(kinds)
        self.repeat = repeat
        self.after = list(after) if after is not None else [None] * len(kinds)
        self.positions = Positions(positions or ())
        self.slots: list[str | None] = [f"{k}_{i}" if i in modules else None for i, k in enumerate(kinds)]
        for i, module in modules.items():
            self.add_module(self.slots[i], module)

    def __setstate__(self, state: dict) -> None:  # unpickled (torch.load of a whole model, spawn): no __init__
        prime_eager()
        state.setdefault("repeat", False)  # pickled before loops were told apart
        state.setdefault("after", [None] * len(state.get("kinds", ())))
        state.setdefault("positions", Positions())
        super().__setstate__(state)

    def extra_repr(self) -> str:
        return f"owner={self.owner_name or '<root>'!r}, calls={'any' if self.repeat else len(self.kinds)}"

    def __prepare_scriptable__(self) -> nn.Module:
        refuse_scripting(self)

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        refuse_fx_root(self, prefix)  # torch.fx.symbolic_trace of the owner itself would skip these units
        return super().named_modules(memo, prefix, remove_duplicate)

    def begin_forward(self, scope: Scope) -> None:
        """An owner forward begins: its calls go to this forward's mode (on this thread)."""
        n = torch._C._len_torch_function_stack()
        top = torch._C._get_function_stack_at(n - 1) if n else None
        suspended = top if isinstance(top, _SiteMode) else None  # so that a torch op meets one site mode at most
        mode = _SiteMode(self, scope)
        scope.data = _Calls(mode, suspended)  # first: an interrupt from here on leaves what end_forward undoes
        for name in self.after:
            if name is not None:
                watch_child(scope.owner.get_submodule(name))
        if suspended is not None:
            torch._C._pop_torch_function_stack()
        torch._C._push_on_torch_function_stack(mode)

    def end_forward(self, scope: Scope) -> None:
        """An owner forward ends (or was found interrupted): take its mode off this thread's mode stack and
        put back the enclosing owner's. Safe to run again after an interrupt stopped it, or stopped
        :meth:`begin_forward` anywhere: each step is done once, and only if it is still to do."""
        calls: _Calls | None = scope.data
        if calls is None:  # interrupted before begin_forward: nothing to undo
            return
        if calls.mode is not None:
            _remove_mode(calls.mode)
            calls.mode = None
        if calls.suspended is not None:
            if not _on_stack(calls.suspended):
                torch._C._push_on_torch_function_stack(calls.suspended)
            calls.suspended = None

    @eager  # eager under torch.compile: the counter is state, not an input
    def call(self, scope: Scope, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Run the owner's next functional activation call (in the forward of ``scope``) through its unit."""
        calls: _Calls = scope.data
        k = 0 if self.repeat else calls.position
        calls.position += 1
        kind = FUNCTIONAL_SPECS[func][0]
        x = args[0] if args else kwargs.get("input")
        if not calls.mismatch and not self._expected(k, kind, x):
            calls.mismatch = True
            calls.seen = self.kinds[:k]
            if k < len(self.kinds) and self.kinds[k] == kind and self.channels[k] is not None:
                dim, width = self.channels[k]
                calls.width = (f"call {k} ({kind}) has input shape {_shape(x)}, its unit "
                               f"{width} channels at dim {dim}")
        if not calls.mismatch and self.slots[k] is not None and (args_now := self._changed(k, func, x, args, kwargs)):
            calls.mismatch, calls.seen, calls.arguments = True, self.kinds[:k], args_now
        expected = self.after[k] if not calls.mismatch and k < len(self.after) else None
        if expected is not None and scope.last_child is not scope.owner.get_submodule(expected):
            calls.mismatch, calls.seen = True, self.kinds[:k]
            calls.loop = loop_error(f"the functional {kind} call of module {self.owner_name or '<root>'!r}", k,
                                    expected, scope)
        if not calls.mismatch and k < len(self.positions) and (moved := moved_call(
                f"the functional {kind} call of module {self.owner_name or '<root>'!r}", k, self.positions[k], scope,
                "make each of these calls through an activation module of its own (self.act_a = nn.ReLU(), "
                "converted to a unit of its own, whatever the order), or convert with "
                f"exclude_modules=[{self.owner_name or ATTR + '.*'!r}] to keep this module's functional calls as "
                "they are")):
            calls.mismatch, calls.seen, calls.moved = True, self.kinds[:k], moved
        if calls.mismatch:
            calls.seen.append(kind)
            return func(*args, **kwargs)
        slot = self.slots[k]
        if slot is None:
            return func(*args, **kwargs)
        unit = self._modules[slot]
        if isinstance(x, torch.fx.Proxy):  # symbolic_trace: the unit (a call_module node) and the write-back
            y = unit(x)
            return x.copy_(y) if in_place(func, args, kwargs) else y
        if (out := kwargs.get("out")) is not None:  # torch.tanh(x, out=y): the result goes into y
            y = unit(x)
            return out.resize_(y.shape).copy_(y)
        if not in_place(func, args, kwargs):
            return unit(x)
        return write_into(x, unit, unit.parameters())

    def _changed(self, k: int, func: Callable, x: Any, args: tuple, kwargs: dict) -> str:
        """Why call ``k`` (input ``x``) cannot run its unit because its arguments are not the probe's ("" when
        they are)."""
        expected = self.arguments[k]
        if expected is None or not isinstance(x, torch.Tensor):
            return ""  # not checked, or a proxy (tracing)
        now = call_arguments(func, args, kwargs)
        if all(a == b and (v == w or v != v and w != w) for (a, v), (b, w) in zip(now, expected)):  # NaN == NaN
            return ""
        show = lambda a: ", ".join(f"{n}={v!r}" for n, v in a)  # noqa: E731
        return (f"call {k} ({self.kinds[k]}) was made with {show(now)}, the probe forward of linearize.convert "
                f"saw {show(expected)}, and its unit computes the probe's function")

    def _expected(self, k: int, kind: str, x: Any) -> bool:
        if k >= len(self.kinds) or self.kinds[k] != kind:
            return False
        if not isinstance(x, torch.Tensor) or self.slots[k] is None:  # a proxy, or a call left as it is (a gate)
            return True
        if self.channels[k] is None:
            return x.ndim == 0
        dim, width = self.channels[k]
        if x.ndim < (getattr(self._modules[self.slots[k]], "input_ndim", None) or 0):
            return True  # no batch dim (an unbatched map): its unit refuses it, naming the fix
        if not -x.ndim <= dim < x.ndim:
            return False
        if x.is_nested and x.layout == torch.strided:  # no sizes of its own: its tensors', as its unit runs them
            return all(t.shape[dim] == width for t in nested_parts(x, dim))
        return x.shape[dim] == width

    def check_forward(self, scope: Scope) -> None:
        """An owner forward returned: raise :class:`FunctionalSiteError` if its calls were not the probe's."""
        calls: _Calls = scope.data
        counted = not self.repeat and calls.position != len(self.kinds)  # a loop's calls: any number
        if (calls.mismatch or counted) and scope.checkpointed:
            raise checkpoint_error(scope)
        if calls.mismatch or counted:
            seen = calls.seen if calls.mismatch else self.kinds[: calls.position]
            name = self.owner_name or "<root>"
            pattern = self.owner_name or f"{ATTR}.*"  # the root's units (exclude_modules cannot be empty)
            if fx_tracer() is not None:
                raise FunctionalSiteError(
                    f"linearize: torch.fx.symbolic_trace of module {name!r} saw {len(seen)} of its "
                    f"{len(self.kinds)} functional activation calls ({', '.join(self.kinds)}): a Tensor method "
                    "call on a tracing proxy (x.relu(), x.relu_(), x.sigmoid()) is recorded without passing "
                    "through linearize, so it would run the original function, not its unit. Fix: call the "
                    "function form in the forward (F.relu(x), torch.relu_(x)), or use torch.export.export / "
                    "torch.jit.trace, which see every call, or linearize.fold(model, example_inputs)")
            if calls.loop and not counted:  # as many calls, after other modules (fewer: the count says why)
                raise FunctionalSiteError(calls.loop)
            if calls.moved:
                raise FunctionalSiteError(calls.moved)
            if calls.arguments:
                raise FunctionalSiteError(
                    f"linearize: in module {name!r}, {calls.arguments}. Fix: give the call the same arguments in "
                    "every forward (e.g. one activation module per setting, each converted to its own unit), or "
                    f"convert with exclude_modules=[{pattern!r}] to keep this module's functional calls as they are."
                )
            if calls.width:  # the probe's calls, but one is wider or narrower along its unit's channel dim
                raise FunctionalSiteError(
                    f"linearize: in module {name!r}, {calls.width}: the probe forward of linearize.convert took "
                    "that dim for the features, but its size changed with the input. Either it is a sequence or "
                    "spatial axis (fix: convert with channel_dim= set to the feature axis, e.g. channel_dim=1 "
                    "for (batch, features, length) maps), or the call's input comes from another layer on this "
                    f"input (control flow; fix: exclude_modules=[{pattern!r}] to keep its functional calls as "
                    "they are, or example_inputs= that take this path)."
                )
            why = ("the calls depend on the input (control flow). Fix: convert with "
                   f"exclude_modules=[{pattern!r}] to keep its functional calls as they are, or pass "
                   "example_inputs= that take this path.")
            if scope.owner.training:  # the probe forward ran in eval mode: no example input takes a training path
                why = ("the calls depend on the input (control flow) or on the mode: this forward runs in training "
                       "mode, the probe forward in eval mode, so a call made only in training (`if self.training:`) "
                       f"was never seen, whatever the example inputs. Fix: convert with exclude_modules=[{pattern!r}] "
                       "to keep its functional calls as they are, make a training-only call through an activation "
                       "module (self.act = nn.GELU(), called only there), which convert leaves as it is, or pass "
                       "example_inputs= that take an input-dependent path.")
            raise FunctionalSiteError(
                f"linearize: module {name!r} made {len(seen)} functional activation call(s) in this forward "
                f"({', '.join(seen) or 'none'}), the probe forward of linearize.convert made {len(self.kinds)} "
                f"({', '.join(self.kinds)}){' (a kind or an input width differs)' if calls.mismatch else ''}. "
                f"Its calls are matched to their units by order, which fails when {why}"
            )


def _shape(x: Any) -> Any:
    """``x``'s shape for a message: a strided nested tensor's (which has none) as its tensors' shapes."""
    if isinstance(x, torch.Tensor) and x.is_nested and x.layout == torch.strided:
        return [tuple(t.shape) for t in x.unbind()]
    return tuple(getattr(x, "shape", ()))


def drop_site_modes(model: nn.Module) -> None:
    """Take the dispatch modes of ``model``'s functional sites off this thread's torch-function mode stack. A
    forward interrupted inside an owner (Ctrl-C in convert's check run) leaves its mode there until that owner
    runs again; a model that ``convert`` gives back unconverted never will, and the mode would stay for good
    (every torch op on the thread slower, ``torch.compile(fullgraph=True)`` of unrelated code refused)."""
    ours = {id(m) for m in model.modules() if isinstance(m, FunctionalSites)}
    stack = map(torch._C._get_function_stack_at, range(torch._C._len_torch_function_stack()))
    for mode in [m for m in stack if isinstance(m, _SiteMode) and id(m.sites) in ours]:
        _remove_mode(mode)


def _on_stack(mode: TorchFunctionMode) -> bool:
    """Whether ``mode`` is on this thread's torch-function mode stack."""
    return any(torch._C._get_function_stack_at(i) is mode for i in range(torch._C._len_torch_function_stack()))


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's torch-function mode stack, wherever it is (normally on top)."""
    if not _on_stack(mode):
        return
    above = []
    while torch._C._len_torch_function_stack():
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


def install_functional_sites(owner: nn.Module, sites: FunctionalSites) -> None:
    """Register ``sites`` as ``owner.linearize_functional`` and the owner hooks that dispatch to it."""
    owner.add_module(ATTR, sites)
    attach_owner(owner)
