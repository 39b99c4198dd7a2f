"""Units for functional activation calls made inside a module's own ``forward``.

``out = F.relu(self.bn1(self.conv1(x)))`` (CIFAR ResNets, torchvision GoogLeNet / Inception /
DenseNet), ``x.relu_()``, ``torch.relu``, ``F.gelu`` ... cannot be swapped like a module. Each such
call gets its own :class:`~linearize.unit.LinearizableActivation`, held by a
:class:`FunctionalSites` child registered on the module that makes the call (its *owner*) as
``owner.linearize_functional``: the units are ordinary submodules (state dict, ``.to()``, DDP,
deepcopy), named ``<owner>.linearize_functional.<kind>_<k>`` for the ``k``-th functional
activation call of the owner's forward.

How calls reach their units: a forward pre-hook of the owner pushes a ``TorchFunctionMode``
(:class:`_SiteMode`) that sends the owner's ``k``-th activation call to unit ``k`` (every other
torch function passes straight through), and its forward hook pops it. Only the owner's *own*
code runs under the mode: while the owner's forward runs, process-wide module hooks (installed
for that time only) take the mode off the stack around every module call (a child, a
grandchild reached through a ``ModuleList``, a module passed in), and put it back after, so
calls made inside children (which are owners themselves, with their own mode) are never
counted. At most one site mode is on the stack at any time.

Where it cannot work: an owner whose number (or kinds, or widths) of activation calls changes
from one forward to the next (control flow on the input) cannot be matched by call order; the
owner's forward hook detects it and raises :class:`FunctionalSiteError` naming the owner.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .activations import FUNCTIONAL_SPECS, INPLACE_ARG, _arg
from .unit import write_into

__all__ = ["FunctionalSites", "FunctionalSiteError", "ATTR", "install_functional_sites"]

ATTR = "linearize_functional"  # the owner's child that holds its functional units

class FunctionalSiteError(RuntimeError):
    """An owner's activation calls (functional ones, or those of a reused module) differ from those the
    probe forward of ``linearize.convert`` saw."""


def _in_place(func: Callable, args: tuple, kwargs: dict) -> bool:
    kind, always = FUNCTIONAL_SPECS[func]
    return always or (kind in INPLACE_ARG and bool(_arg(args, kwargs, INPLACE_ARG[kind], "inplace", False)))


class _SiteMode(TorchFunctionMode):
    """Sends the owner's activation calls to its :class:`FunctionalSites`; the rest passes through."""

    def __init__(self, sites: "FunctionalSites") -> None:
        super().__init__()
        self.sites = sites

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FUNCTIONAL_SPECS:
            return self.sites.call(func, args, kwargs)
        return func(*args, **kwargs)


class FunctionalSites(nn.Module):
    """The units of one owner's functional activation calls, dispatched by call order.

    Args:
        owner_name: the owner's qualified name (for errors).
        kinds: the kind of every intercepted call of one owner forward, in order.
        channels: ``(channel_dim, width)`` of every call's input as the probe saw it (None: a scalar).
        modules: ``{position: unit}`` for the converted calls; the others (gates, calls excluded
            by the config) run their original function.

    Call ``k`` runs the module registered as ``f"{kinds[k]}_{k}"`` (a unit, or the plain module
    :func:`linearize.fold` put in its place). An in-place call (``F.relu(x, inplace=True)``,
    ``x.relu_()``) writes the unit's output into its input and returns it.
    """

    def __init__(self, owner_name: str, kinds: list[str], channels: list[tuple[int, int] | None],
                 modules: dict[int, nn.Module]) -> None:
        super().__init__()
        self.owner_name = owner_name
        self.kinds = list(kinds)
        self.channels = list(channels)
        self.slots: list[str | None] = [f"{k}_{i}" if i in modules else None for i, k in enumerate(kinds)]
        for i, module in modules.items():
            self.add_module(self.slots[i], module)
        self.position = 0
        self.seen: list[str] = []  # kinds of this forward's calls, kept only after a mismatch
        self.mismatch = False

    def extra_repr(self) -> str:
        return f"owner={self.owner_name or '<root>'!r}, calls={len(self.kinds)}"

    def begin(self) -> None:
        """Start an owner forward: the next call is call 0."""
        self.position, self.mismatch, self.seen, self.width = 0, False, [], ""

    @torch.compiler.disable  # eager under torch.compile: the call counter is state, not a graph input
    def call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Run the owner's next functional activation call through its unit."""
        k = self.position
        self.position += 1
        kind = FUNCTIONAL_SPECS[func][0]
        x = args[0] if args else kwargs.get("input")
        if not self.mismatch and not self._expected(k, kind, x):
            self.mismatch = True
            self.seen = self.kinds[:k]
            if k < len(self.kinds) and self.kinds[k] == kind and self.channels[k] is not None:
                dim, width = self.channels[k]
                self.width = (f"call {k} ({kind}) has input shape {tuple(getattr(x, 'shape', ()))}, its unit "
                              f"{width} channels at dim {dim}")
        if self.mismatch:
            self.seen.append(kind)
            return func(*args, **kwargs)
        slot = self.slots[k]
        if slot is None:
            return func(*args, **kwargs)
        unit = self._modules[slot]
        if not _in_place(func, args, kwargs):
            return unit(x)
        return write_into(x, unit, unit.parameters())

    def _expected(self, k: int, kind: str, x: Any) -> bool:
        if k >= len(self.kinds) or self.kinds[k] != kind:
            return False
        if not isinstance(x, torch.Tensor) or self.slots[k] is None:  # a proxy, or a call left as it is (a gate)
            return True
        if self.channels[k] is None:
            return x.ndim == 0
        dim, width = self.channels[k]
        return -x.ndim <= dim < x.ndim and x.shape[dim] == width

    def end(self) -> None:
        """Finish an owner forward; raise :class:`FunctionalSiteError` if its calls were not the probe's."""
        if self.mismatch or self.position != len(self.kinds):
            seen = self.seen if self.mismatch else self.kinds[: self.position]
            name = self.owner_name or "<root>"
            pattern = self.owner_name or f"{ATTR}.*"  # the root's units (exclude_modules cannot be empty)
            if self.width:  # the probe's calls, but one is wider or narrower along its unit's channel dim
                raise FunctionalSiteError(
                    f"linearize: in module {name!r}, {self.width}: the probe forward of linearize.convert took "
                    "that dim for the features, but its size changed with the input. Either it is a sequence or "
                    "spatial axis (fix: convert with channel_dim= set to the feature axis, e.g. channel_dim=1 "
                    "for (batch, features, length) maps), or the call's input comes from another layer on this "
                    f"input (control flow; fix: exclude_modules=[{pattern!r}] to keep its functional calls as "
                    "they are, or example_inputs= that take this path)."
                )
            raise FunctionalSiteError(
                f"linearize: module {name!r} made {len(seen)} functional activation call(s) in this forward "
                f"({', '.join(seen) or 'none'}), the probe forward of linearize.convert made {len(self.kinds)} "
                f"({', '.join(self.kinds)}){' (a kind or an input width differs)' if self.mismatch else ''}. "
                "Its calls are matched to their units by order, which fails when the calls depend on the input "
                f"(control flow). Fix: convert with exclude_modules=[{pattern!r}] to keep its functional "
                "calls as they are, or pass example_inputs= that take this path."
            )


# ----------------------------------------------------------------------------- hooks

_STATE = threading.local()  # .saved: [(id(module), suspended mode or None)] per thread
_ACTIVE = [0]  # owners whose forward is running (all threads)
_LOCK = threading.Lock()
_GLOBAL_HANDLES: list = []


def _saved() -> list:
    saved = getattr(_STATE, "saved", None)
    if saved is None:
        saved = _STATE.saved = []
    return saved


def _top_mode() -> Any:
    n = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(n - 1) if n else None


def _suspend(module: nn.Module) -> None:
    """Take a site mode off the top of the torch-function stack for the duration of ``module``'s call."""
    top = _top_mode()
    if isinstance(top, _SiteMode):
        torch._C._pop_torch_function_stack()
    else:
        top = None
    _saved().append((id(module), top))


def _resume(module: nn.Module) -> None:
    saved = _saved()
    if saved and saved[-1][0] == id(module):
        mode = saved.pop()[1]
        if mode is not None:
            torch._C._push_on_torch_function_stack(mode)


@torch.compiler.disable
def _module_pre(module: nn.Module, args: Any) -> None:
    if ATTR not in module._modules:  # owners do this in their own hooks, in the right order
        _suspend(module)


@torch.compiler.disable
def _module_post(module: nn.Module, args: Any, output: Any) -> None:
    if ATTR not in module._modules:
        _resume(module)


@torch.compiler.disable
def _owner_pre(owner: nn.Module, args: Any) -> None:
    sites = owner._modules.get(ATTR)
    if not isinstance(sites, FunctionalSites):
        return
    _suspend(owner)
    with _LOCK:
        if _ACTIVE[0] == 0:
            register = torch.nn.modules.module
            _GLOBAL_HANDLES[:] = [register.register_module_forward_pre_hook(_module_pre),
                                  register.register_module_forward_hook(_module_post, always_call=True)]
        _ACTIVE[0] += 1
    sites.begin()
    torch._C._push_on_torch_function_stack(_SiteMode(sites))  # a new one per call: nothing to copy or replicate


@torch.compiler.disable
def _owner_post(owner: nn.Module, args: Any, output: Any) -> None:
    """Pop the owner's mode; check its calls unless its forward raised (then that error propagates)."""
    sites = owner._modules.get(ATTR)
    if not isinstance(sites, FunctionalSites):
        return
    top = _top_mode()
    if isinstance(top, _SiteMode) and top.sites is sites:
        torch._C._pop_torch_function_stack()
    with _LOCK:
        _ACTIVE[0] -= 1
        if _ACTIVE[0] == 0:
            for handle in _GLOBAL_HANDLES:
                handle.remove()
            _GLOBAL_HANDLES.clear()
    _resume(owner)
    if output is not None or sys.exc_info()[1] is None:  # always_call hooks run in forward's except clause
        sites.end()


def install_functional_sites(owner: nn.Module, sites: FunctionalSites) -> None:
    """Register ``sites`` as ``owner.linearize_functional`` and the owner hooks that dispatch to it."""
    owner.add_module(ATTR, sites)
    owner.register_forward_pre_hook(_owner_pre)
    owner.register_forward_hook(_owner_post, always_call=True)
