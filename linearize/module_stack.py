"""Which modules are running now: one tracker of the module call stack (outermost first), per thread, that
the probes of ``convert``, DLGN's audit, ``linear_regions`` and ``fold`` share.

Its hooks pop a call's entry even when the forward raises (``always_call=True``), find a reused module's
innermost call, and keep one stack per thread, so a forward on another thread never changes this one's.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

__all__ = ["ModuleStack"]

Enter = Callable[[nn.Module, tuple, dict], Any]
Leave = Callable[[nn.Module, tuple, Any, Any], None]


class ModuleStack:
    """The modules running now on this thread, outermost first (``stack``), while ``with`` is open.

    Hooks: on the distinct modules of ``model`` when the tracker is made (``model.modules()``), or with
    ``every_module=True`` torch's global module hooks, which see every module call, modules made during
    forward (Hugging Face's ``ACT2FN[...](x)``) too. ``names`` maps ``id(module)`` to its name in ``model``
    (``named_modules(remove_duplicate=False)``: a module registered under several names keeps the last;
    ``""``: the root). ``enter(module, args, kwargs)`` runs before a call's entry is pushed (``stack[-1]`` is
    its caller; ``kwargs`` is ``{}`` with ``every_module=True``, as torch gives global pre-hooks none) and
    what it returns is kept with the entry; ``leave(module, args, output, kept)`` runs after the entry is
    popped, for a call that returned (not for a forward that raised).

    The stack is right after a forward raises an ``Exception`` (its entries are popped, even when the model
    catches the error; torch runs no hook for a ``KeyboardInterrupt`` the model catches itself, whose entries
    stay until their caller returns), for a module called inside its own call, and per thread: the thread that opened the tracker
    keeps its own, and another thread's starts from that thread's modules as they are at its outermost call
    (a thread a forward starts runs inside that forward's modules) and changes no other thread's. Hooks are
    removed on exit, on an exception too.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> seen = []
        >>> def enter(module, args, kwargs):
        ...     seen.append([tracker.names[id(m)] for m in tracker.stack + [module]])
        >>> with ModuleStack(net, enter=enter) as tracker:
        ...     _ = net(torch.ones(1, 2))
        >>> seen
        [[''], ['', '0'], ['', '1']]
    """

    def __init__(self, model: nn.Module, *, every_module: bool = False, enter: Enter | None = None,
                 leave: Leave | None = None) -> None:
        self.names: dict[int, str] = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.every_module = every_module
        self._modules = [] if every_module else list(model.modules())
        self._enter, self._leave = enter, leave
        self._local = threading.local()
        self._home: int | None = None  # the thread that opened the tracker
        self._home_stack: list[nn.Module] = []
        self._handles: list = []

    def _state(self) -> threading.local:
        """This thread's ``modules`` (the stack), ``floor`` (how many of them are the opening thread's) and
        ``kept`` (per own entry: what ``enter`` returned, the exception being handled when it was pushed)."""
        local = self._local
        if not hasattr(local, "modules"):
            local.modules, local.kept, local.floor = [], [], 0
        if local.floor == len(local.modules) and threading.get_ident() != self._home:  # none of its own now
            local.modules[:] = self._home_stack
            local.floor = len(local.modules)
        return local

    @property
    def stack(self) -> list[nn.Module]:
        """The running modules of this thread, outermost first (the tracker's own list: read it only)."""
        return self._state().modules

    def innermost_registered(self) -> nn.Module | None:
        """The innermost running module that ``model`` registers (``None``: none runs, or only modules made
        during forward)."""
        return next((m for m in reversed(self.stack) if id(m) in self.names), None)

    def __enter__(self) -> "ModuleStack":
        if self._handles:
            raise RuntimeError("ModuleStack: this tracker is already open; use one `with` block at a time")
        self._local = threading.local()  # no entries left by a block that a forward never returned to
        self._home = threading.get_ident()
        self._home_stack = self.stack
        if self.every_module:
            self._handles = [register_module_forward_pre_hook(self._push),
                             register_module_forward_hook(self._pop, always_call=True)]
        else:
            for m in self._modules:
                self._handles.append(m.register_forward_pre_hook(self._push, with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._pop, always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        handles, self._handles = self._handles, []
        self._home, self._home_stack = None, []
        for h in handles:
            h.remove()

    def _push(self, module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        local, result, handling = self._state(), None, sys.exc_info()[1]
        try:
            if self._enter is not None:
                result = self._enter(module, args, {} if kwargs is None else kwargs)
        finally:  # pushed even if enter raised: the always-called hook pops it
            local.modules.append(module)
            local.kept.append((result, handling))

    def _pop(self, module: nn.Module, args: tuple, output: Any) -> None:
        local = self._state()
        stack, i = local.modules, len(local.modules) - 1
        while i >= local.floor and stack[i] is not module:  # above it: calls whose hooks never ran to the end
            i -= 1
        if i < local.floor:  # its call started before the hooks were in place
            return
        result, handling = local.kept[i - local.floor]
        del stack[i:], local.kept[i - local.floor:]
        # the forward raised iff this hook runs in torch's handler of that exception (another one than the
        # exception, if any, being handled when the call started)
        if self._leave is not None and sys.exc_info()[1] is handling:
            self._leave(module, args, output, result)
