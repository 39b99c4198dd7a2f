"""Which call of its owner's forward an activation call is: per thread, per forward, safe on every exit.

Units of a reused activation module (:class:`~linearize.injection.CallSites`) and of functional calls
(:class:`~linearize.functional_sites.FunctionalSites`) are matched to calls by their order within one
forward of the module that makes them (their *owner*). The owner's forward pre-hook opens a :class:`Scope`
(the position counters of that one forward) keyed by the owner's ``Module._call_impl`` frame on this
thread; its forward hook (always called, first of the owner's hooks) closes it. So:

- two threads, or a forward inside a forward, each count on their own (nothing is shared between calls);
- an exception closes the scope; a scope left open by an interrupt that skips hooks (``KeyboardInterrupt``)
  is found stale (its frame is no longer running) and dropped by the next forward on that thread, and its
  functional interception passes every call through meanwhile;
- whose call it is comes from the interpreter's frames, not from hooks around every module: the owner's
  *own* code is the code whose innermost running module is the owner, less the owner's hook functions, so a
  child's calls and a user's monitoring hook that calls an activation are never counted;
- a call the owner's forward makes inside ``torch.utils.checkpoint`` (its recomputation in the backward pass
  runs outside the owner's forward, where no unit can be reached) or inside a custom ``autograd.Function``
  (whose backward is its own) is left as it is, as the probe of ``convert`` left and listed it; a checkpoint
  the probe did not see is refused with the fix (:func:`checkpoint_error`). Checkpointing a module, as
  Hugging Face's gradient checkpointing does, works: its hooks run again.
- ``torch.fx.symbolic_trace`` runs every module but the root through its hooks, so the calls of a traced
  owner reach their units, and each unit is recorded as a ``call_module`` node (:func:`fx_leaf_call`): the
  GraphModule runs the units. The root's own forward runs without hooks, where no call can reach a unit:
  tracing an owner as the root is refused with the fix (:func:`refuse_fx_root`).
- ``torch.compile`` runs the dispatch eagerly between graphs; ``fullgraph=True`` cannot, and its error
  carries :data:`COMPILE_REASON` (the fix).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import has_torch_function_variadic
from torch.utils._device import DeviceContext

__all__ = ["Scope", "attach_owner", "detach_owner", "caller_scope", "hooked_module", "IN_FUNCTION", "user_hooks",
           "user_hooks_removed",
           "compiled_submodules", "refuse_scripting", "unreachable_call", "checkpoint_error", "foreign_torch_function",
           "SITE_MODE", "FunctionalSiteError", "COMPILE_REASON", "fx_leaf_call", "fx_tracer", "refuse_fx_root",
           "ThreadWatch", "THREAD_CALL", "eager", "prime_eager", "code_position", "watch_child",
           "loop_error", "Positions", "moved_call", "position_name"]

_CALL_IMPL: CodeType = nn.Module._call_impl.__code__
# the code of ``Tracer.trace`` itself: once anything was passed to ``torch.compile``, torch._dynamo has replaced
# the attribute by its generic disable wrapper, whose code runs every ``torch.compiler.disable``d function
_FX_TRACE: CodeType = inspect.unwrap(torch.fx.Tracer.trace).__code__
COMPILE_REASON = (
    "linearize's call-site dispatch (one unit per call of a reused activation module or per functional "
    "activation call, matched by call order) runs eagerly, between compiled graphs, so torch.compile with "
    "fullgraph=True cannot compile this model. Fix: torch.compile(model) without fullgraph=True, or "
    "linearize.fold(model, example_inputs) for a plain model that compiles whole")
THREAD_CALL = (
    "on a thread the forward started, which convert cannot follow (it sees the forward's own thread): neither "
    "converted nor counted, so the model is less linear than the counts say. Fix: call the activation on the "
    "forward's own thread, or through an activation module registered on the model (self.act = nn.ReLU())")
_CHECKPOINT_FILE = torch.utils.checkpoint.__file__
_FUNCTION_FORWARDS: dict[CodeType, bool] = {}  # code -> whether it is a custom autograd.Function's forward
_RERUNS: dict[CodeType, bool] = {}  # a Function's backward code -> whether it may run autograd (see _backward_reruns)
# names a backward uses to run autograd itself (a reentrant checkpoint: forward again under enable_grad, then
# torch.autograd.backward / grad through it)
_AUTOGRAD_NAMES = frozenset({"backward", "grad", "enable_grad", "set_grad_enabled"})


_EAGER: list[list] = []  # [function, its torch.compiler.disable'd version once made]


def eager(fn: Callable) -> Callable:
    """``fn`` run eagerly under ``torch.compile``: ``torch.compiler.disable(fn, reason=COMPILE_REASON)``, made by
    :func:`prime_eager` (or at the first call) instead of at import, since importing ``torch._dynamo`` costs
    about 2 s per process that a model without call-site dispatch never needs.

    Example:
        >>> double = eager(lambda x: 2 * x)
        >>> double(torch.ones(1))
        tensor([2.])
    """
    entry = [fn, None]
    _EAGER.append(entry)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if entry[1] is None:
            prime_eager()
        return entry[1](*args, **kwargs)

    return run


def prime_eager() -> None:
    """Make the disabled version of every :func:`eager` function: called by whatever installs call-site
    dispatch, so that under ``torch.compile`` every dispatch call is a disabled function already."""
    for entry in _EAGER:
        if entry[1] is None:
            entry[1] = torch.compiler.disable(entry[0], reason=COMPILE_REASON)


def _function_forward(frame: FrameType) -> bool:
    """Whether ``frame`` runs the ``forward`` of a ``torch.autograd.Function`` subclass (cached per code): a
    subclass that defines a ``forward`` of this code (found among the subclasses, so also one defined in a
    function or whose name is rebound to its ``apply``, old style or new), or a ``forward`` whose first argument
    is a ``ctx`` (``FunctionCtx``: one inherited from a mixin)."""
    code = frame.f_code
    known = _FUNCTION_FORWARDS.get(code)
    if known is None:
        known = code.co_name == "forward" and (code in _function_forwards() or bool(
            code.co_argcount and isinstance(frame.f_locals.get(code.co_varnames[0]), torch.autograd.function.FunctionCtx)))
        _FUNCTION_FORWARDS[code] = known
    return known


def _function_class(frame: FrameType) -> type | None:
    """The ``torch.autograd.Function`` subclass whose ``forward`` ``frame`` runs (read from its ``ctx``, or the
    subclass that defines a ``forward`` of this code); None when neither tells."""
    code = frame.f_code
    ctx = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
    cls = getattr(type(ctx), "_forward_cls", None)
    return cls if isinstance(cls, type) else _function_forwards().get(code)


def _backward_reruns(cls: type | None) -> bool:
    """Whether the backward of the Function ``cls`` may run autograd itself, as a reentrant checkpoint does (it
    runs the forward again under ``torch.enable_grad`` and calls ``torch.autograd.backward`` / ``grad`` through
    it, so an activation module called in the forward gets its gradient): its code, or a Python function of its
    module that it calls (a few deep), names one of those. True when that cannot be read (no Python code)."""
    backward = inspect.unwrap(getattr(getattr(cls, "backward", None), "__func__", getattr(cls, "backward", None)))
    code = getattr(backward, "__code__", None)
    if code is None:
        return True
    known = _RERUNS.get(code)
    if known is None:
        names: set[str] = set()
        todo, seen = [(backward, 0)], set()
        while todo:
            fn, depth = todo.pop()
            if fn.__code__ in seen:
                continue
            seen.add(fn.__code__)
            codes = [fn.__code__]
            while codes:  # the function's code and the code of functions and lambdas defined in it
                c = codes.pop()
                names.update(c.co_names)
                codes += [k for k in c.co_consts if isinstance(k, CodeType)]
            if depth < 3:
                todo += [(f, depth + 1) for name in names if inspect.isfunction(f := fn.__globals__.get(name))]
        known = _RERUNS[code] = bool(names & _AUTOGRAD_NAMES)
    return known


def _function_forwards() -> dict[CodeType, type]:
    """The code objects of the ``forward`` of every ``torch.autograd.Function`` subclass now defined, each with
    the subclass that defines it."""
    codes, todo, seen = {}, [torch.autograd.Function], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo += type.__subclasses__(cls)
        forward = getattr(vars(cls).get("forward"), "__func__", vars(cls).get("forward"))
        code = getattr(forward, "__code__", None)
        if code is not None:
            codes[code] = cls
    return codes


# linearize's own code (see code_position), spelled as its code objects spell their files
_OWN_DIR = os.path.dirname(inspect.currentframe().f_code.co_filename) + os.sep
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN, _TORCH = "linearize", "torch"
_CODE_INFO: dict[CodeType, tuple[bool, bool, Any]] = {}  # see _code_info
_MODULE_FILE = nn.Module._call_impl.__code__.co_filename  # its nested ``inner`` runs hooks and forward
_LOCAL = threading.local()  # .scopes: {id(owner's _call_impl frame): Scope} of this thread
_MARK = "_linearize_dispatch"  # owner attribute: the handles of its two hooks
_WATCHED = "_linearize_watched"  # a watched module's attribute: the handle of its hook (watch_child)


SITE_MODE = "linearize_site_mode"  # class attribute of linearize's own torch-function modes


def foreign_torch_function(*tensors: torch.Tensor) -> bool:
    """Whether a call on ``tensors`` would be intercepted by someone else than linearize's own site modes: a
    tensor subclass, or a torch-function mode of another tool (FLOP counting, linear regions). A device
    context (``with torch.device(...)``) only places new tensors: it is not such a tool."""
    if not has_torch_function_variadic(*tensors):
        return False
    if any(type(t) not in (torch.Tensor, nn.Parameter) for t in tensors):
        return True
    stack = torch._C._len_torch_function_stack()
    return any(not getattr(mode, SITE_MODE, False) and not isinstance(mode, DeviceContext)
               for mode in map(torch._C._get_function_stack_at, range(stack)))


class FunctionalSiteError(RuntimeError):
    """An owner's activation calls (functional ones, or those of a reused module) cannot be matched to the
    units that the probe forward of ``linearize.convert`` made for them (the message says why and the fix)."""


@dataclass
class Scope:
    """One running forward of an owner: its frame and the position counters of its call sites."""

    owner: nn.Module
    frame: FrameType
    positions: dict[int, int] = field(default_factory=dict)  # call sites (by id of their __dict__) -> calls so far
    checkpointed: list[str] = field(default_factory=list)  # calls made inside torch.utils.checkpoint, left as they are
    data: Any = None  # what the owner's functional sites keep for this forward (their mode)
    last_child: nn.Module | None = None  # the last module watched by watch_child that the owner's code called
    loops: dict[int, str] = field(default_factory=dict)  # call sites (as positions) -> a loop_error or moved_call
    where: tuple = ()  # the code position (code_position) of the call caller_scope last found this scope for

    def next_position(self, sites: nn.Module) -> int:
        """The position of ``sites``' call now being made (0 for the first in this forward). Keyed by the
        module's ``__dict__``, which tracing proxies of the module (``torch.export``'s) share with it."""
        key = id(sites.__dict__)
        k = self.positions.get(key, 0)
        self.positions[key] = k + 1
        return k


def _scopes() -> dict[int, Scope]:
    scopes = getattr(_LOCAL, "scopes", None)
    if scopes is None:
        scopes = _LOCAL.scopes = {}
    return scopes


def _live_frames(frame: FrameType | None) -> set[int]:
    ids = set()
    while frame is not None:
        ids.add(id(frame))
        frame = frame.f_back
    return ids


def _call_impl_frame(owner: nn.Module) -> FrameType:
    """The ``Module._call_impl`` frame of ``owner`` now running on this thread (a hook is called from it)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is owner:
            return frame
        frame = frame.f_back
    raise FunctionalSiteError(f"linearize: a forward hook of {type(owner).__name__} ran outside its module call")


def _hook_codes(owner: nn.Module | None) -> set[CodeType]:
    """Code objects of the user's hook functions that ``Module._call_impl`` calls for ``owner`` (not those of
    :func:`attach_owner`): a call made by one of them, anywhere between it and the activation, is the hook's."""
    from torch.nn.modules import module as m

    own = [*owner._forward_pre_hooks.values(), *owner._forward_hooks.values()] if isinstance(owner, nn.Module) else []
    hooks = [*own, *m._global_forward_pre_hooks.values(), *m._global_forward_hooks.values()]
    codes = set()
    for h in hooks:
        if h is _open or h is _shut or h is _child_done:
            continue
        while hasattr(h, "func"):  # functools.partial
            h = h.func
        # the function's own code, under decorators (torch.no_grad, torch.compiler.disable share their wrapper's)
        fn = inspect.unwrap(getattr(h, "__func__", h))
        code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
        if code is not None:
            codes.add(code)
    return codes


@dataclass
class _Caller:
    """What lies between a call and the innermost running module: its ``Module._call_impl`` frame (or None),
    the code objects of the frames between, whether ``torch.utils.checkpoint`` ran there, and whether the call
    is made inside a custom ``autograd.Function``'s forward (whose backward is its own): the frames of those
    forwards."""

    frame: FrameType | None
    codes: set[CodeType]
    checkpointed: bool
    functions: list[FrameType]
    position: tuple[tuple[CodeType, tuple], ...] = ()  # see code_position

    @property
    def in_function(self) -> bool:
        return bool(self.functions)

    def reruns(self) -> bool:
        """Whether the backward of every Function the call is made in may run it again through autograd
        (:func:`_backward_reruns`), so that an activation module called there gets its gradient."""
        return all(_backward_reruns(_function_class(f)) for f in self.functions)


def _code_info(frame: FrameType) -> tuple[bool, bool, Any]:
    """What :func:`_calling_module_frame` needs of the code ``frame`` runs (cached per code): whether it is a custom
    autograd.Function's forward, whether it is ``torch.utils.checkpoint``'s, and ``_OWN`` (linearize's), ``_TORCH``
    (torch's, or a method of a ``torch.fx.Tracer`` subclass) or the source span of each of its instructions (the model's code: see :func:`code_position`)."""
    code = frame.f_code
    spans = _OWN if code.co_filename.startswith(_OWN_DIR) else _TORCH if code.co_filename.startswith(_TORCH_DIR) \
        or isinstance(frame.f_locals.get("self"), torch.fx.Tracer) else tuple(code.co_positions())
    return _function_forward(frame), code.co_filename == _CHECKPOINT_FILE, spans


def _calling_module_frame(skip: int) -> _Caller:
    """Walk up from here to the innermost running module's ``Module._call_impl`` frame, past ``skip`` of them
    (the frames of this module's own functions and their callers count as "between": none is a user hook,
    a checkpoint or an autograd.Function, so no call depth is assumed)."""
    frame, codes, checkpointed, functions, position = sys._getframe(1), set(), False, [], []
    while frame is not None:
        code = frame.f_code
        if code is _CALL_IMPL:
            if not skip:
                break
            skip, codes, checkpointed, functions, position = skip - 1, set(), False, [], []
        else:
            codes.add(code)
            info = _CODE_INFO.get(code)
            if info is None:
                info = _CODE_INFO[code] = _code_info(frame)
            function, checkpoint, spans = info
            checkpointed = checkpointed or checkpoint
            if function:
                functions.append(frame)
            if spans is _OWN:  # linearize's own frames (the probe's, the dispatch's) and those they call
                position = []
            elif spans is not _TORCH:
                position.append((code, spans[frame.f_lasti // 2]))
        frame = frame.f_back
    return _Caller(frame, codes, checkpointed, functions, tuple(position))


def code_position(skip: int = 0) -> tuple[tuple[CodeType, tuple], ...]:
    """Where in the innermost running module's code (past ``skip`` module calls: 1 for an activation module's own
    call) the call this function's caller handles is made: the code and the source span of the call expression
    (the instruction offset is not: Python 3.11 reports a call at its PRECALL or its CALL) of every frame between
    (its forward and the helpers it calls), innermost first, less torch's frames (``F.relu``'s, a module call's, a
    tracer's, also a ``torch.fx.Tracer`` subclass's methods as torchvision's feature extractor's, which differ with
    the way the model is run) and linearize's own frames and those they call (the
    probe's recorder, the dispatch), so that the probe and the dispatch see one call at one position. Calls with
    one position in one forward are the iterations of a loop; empty for a module of torch's own (its forward is
    torch's code)."""
    return _calling_module_frame(skip).position


class Positions(tuple):
    """The probe's :func:`code_position` of each call of a call-site dispatcher (``()`` where none is known). They
    name code objects of this process: ``copy.deepcopy`` keeps them, a pickled copy (``torch.save`` of the whole
    model, a spawned process) holds none, and then no call's position is checked."""

    def __reduce__(self) -> tuple:
        return Positions, ()

    def __copy__(self) -> "Positions":
        return self

    def __deepcopy__(self, memo: dict) -> "Positions":
        return self


def position_name(position: tuple[tuple[CodeType, tuple], ...]) -> str:
    """The line of a :func:`code_position` for messages: ``"Net.forward, line 12"`` (its innermost frame)."""
    if not position:
        return "an unknown place"
    code, span = position[0]
    return f"{getattr(code, 'co_qualname', code.co_name)}, line {span[0]}"


def moved_call(what: str, k: int, expected: tuple, scope: Scope, fix: str) -> str:
    """The message for call ``k`` of ``what`` (an activation module, a functional call) made in a forward of
    ``scope``'s owner at another place in its code (``scope.where``) than the probe's call ``k`` (``expected``),
    "" when it is made there, or when the two cannot be compared: unknown, or the forward's code is not the one
    the probe ran (``torch.compile`` runs its own)."""
    where = scope.where
    if not expected or where == expected or not where or where[-1][0] is not expected[-1][0]:
        return ""  # the same place; or the forward's code is not the probe's (torch.compile's own)
    return (f"linearize: {what} has one unit per call site, matched by the order of the calls in one forward of "
            f"{type(scope.owner).__name__}. Call {k} of this forward is made at {position_name(where)}, where the "
            f"probe forward of linearize.convert made call {k} at {position_name(expected)}: this forward makes its "
            "calls in another order, or a call the probe did not see (control flow on the input), so it would run "
            f"another call's unit. Fix: {fix}")

def hooked_module(skip: int = 0) -> nn.Module | None:
    """The innermost running module (past ``skip`` module calls: 1 for an activation module's own call) if one
    of its hook functions (a forward or forward pre-hook, its own or global), not its forward, made the call
    this function's caller handles; else None."""
    caller = _calling_module_frame(skip)
    if caller.frame is None:
        return None
    module = caller.frame.f_locals.get("self")
    return module if caller.codes & _hook_codes(module) else None


def unreachable_call(skip: int = 0) -> str:
    """Why the call this function's caller handles, made within the innermost running module (past ``skip``
    module calls: 1 for an activation module's own call), could not get a unit dispatched by its owner's
    forward ("" when it could): inside ``torch.utils.checkpoint`` (recomputed outside the owner's forward) or
    inside a custom ``torch.autograd.Function``'s forward (its own backward gives the gradients: IN_FUNCTION,
    or IN_RERUN_FUNCTION where it may run the forward again, as a reentrant checkpoint does). The probe lists
    such functional calls unconverted; the dispatch leaves a Function's calls as they are."""
    caller = _calling_module_frame(skip)
    if caller.checkpointed:
        return "inside torch.utils.checkpoint, recomputed outside its module's forward"
    if caller.in_function:
        return IN_RERUN_FUNCTION if caller.reruns() else IN_FUNCTION
    return ""


IN_FUNCTION = "inside a custom autograd.Function's forward, whose backward is its own"  # see unreachable_call
IN_RERUN_FUNCTION = ("inside a custom autograd.Function's forward, whose backward runs autograd itself "
                     "(a reentrant checkpoint recomputing it)")  # see unreachable_call


def caller_scope(what: Callable[[], str], skip: int = 0) -> Scope | None:
    """The open scope of the module whose own code made the call this function's caller handles: the scope
    of the innermost running module (past ``skip`` module calls: 1 for a module's own forward) if that module's
    forward, not one of its hooks, made the call; else None (a child's call, a hook's, or no forward running).

    A call made inside ``torch.utils.checkpoint`` or a custom ``autograd.Function`` is left as it is (None), as
    the probe left it; a checkpointed one is recorded in the scope (``what()`` names it), so that a forward whose
    calls then differ from the probe's says why (:func:`checkpoint_error`).
    """
    caller = _calling_module_frame(skip)
    frame = caller.frame
    if frame is None:
        return None
    scope = _scopes().get(id(frame))
    if scope is None or scope.frame is not frame:
        return None
    if caller.codes & _hook_codes(scope.owner):
        return None  # a hook of the owner calls an activation (monitoring): not one of the forward's calls
    if caller.checkpointed:
        scope.checkpointed.append(what())  # left as it is, as the probe did; a unit it made misses it (see below)
        return None
    if caller.in_function:
        return None  # a custom Function's forward: left as it is, as the probe did
    scope.where = caller.position
    return scope


def loop_error(what: str, k: int, expected: str, scope: Scope) -> str:
    """The message for call ``k`` of ``what`` (an activation module, a functional call) made in a loop of
    ``scope``'s owner after another module than ``expected``, the one the probe forward saw before it."""
    names = {id(m): n for n, m in scope.owner.named_modules()}
    ran = names.get(id(scope.last_child), type(scope.last_child).__name__) if scope.last_child is not None else "none"
    return (f"linearize: {what} runs in a loop of the forward of {type(scope.owner).__name__}, once per module it "
            f"loops over, and got one unit per iteration, matched by order. Call {k} of this forward came after "
            f"{ran!r} where the probe forward of linearize.convert saw it after {expected!r}: the loop ran over "
            "another subset of its modules (a mixture-of-experts' routing that depends on the input), so this call "
            "would run another module's unit. Fix: make the activation part of each module looped over (an expert "
            "module holding its own activation), or convert with exclude_modules= naming this owner to keep it "
            "as it is")


def checkpoint_error(scope: Scope) -> FunctionalSiteError:
    """The error for an owner forward whose calls were not the probe's because some ran inside
    ``torch.utils.checkpoint`` (a checkpoint the probe forward did not take, e.g. one used in training only)."""
    name = type(scope.owner).__name__
    return FunctionalSiteError(
        f"linearize: {scope.checkpointed[0]} is made inside torch.utils.checkpoint within the forward of {name}, "
        "where the probe forward of linearize.convert saw it outside (and made it a unit). Its recomputation in "
        "the backward pass runs outside that forward, where linearize cannot send it to its unit. Fix: "
        f"checkpoint a module instead (move the code into an nn.Module, or checkpoint the {name} itself: its "
        "hooks run again on recompute), or convert with example_inputs and the mode that take the checkpoint "
        "(the call is then left as it is and listed)")


@eager
def _open(owner: nn.Module, args: Any) -> None:
    scopes = _scopes()
    frame = _call_impl_frame(owner)
    _drop_stale(scopes, frame)
    scope = scopes[id(frame)] = Scope(owner, frame)
    for child in owner._modules.values():
        begin = getattr(child, "begin_forward", None)
        if begin is not None:
            begin(scope)


def _drop_stale(scopes: dict[int, Scope], frame: FrameType) -> None:
    """Close and drop the scopes whose forward no longer runs (an interrupt skipped their closing hook): those
    whose frame is not on the stack of ``frame``, the running owner's, innermost first."""
    if not scopes:
        return
    live = _live_frames(frame)
    for key in [k for k, s in reversed(scopes.items()) if id(s.frame) not in live]:
        _close(scopes[key])  # closed, then dropped: an interrupt in between leaves it to close again
        del scopes[key]


def _drop_inner(scopes: dict[int, Scope], key: int) -> None:
    """Close and drop the scopes opened after the scope ``key`` on this thread, innermost first: forwards inside
    it whose closing hook an interrupt skipped (forwards on one thread nest, so those registered later are
    inside it; none, normally, and that is one look at the last key)."""
    while (last := next(reversed(scopes))) != key:
        _close(scopes[last])  # closed, then dropped: an interrupt in between leaves it to close again
        del scopes[last]


def _close(scope: Scope) -> None:
    for child in scope.owner._modules.values():
        end = getattr(child, "end_forward", None)
        if end is not None:
            end(scope)


@eager
def _shut(owner: nn.Module, args: Any, output: Any) -> None:
    """Close this forward's scope; its sites check their calls unless the forward raised."""
    scopes = _scopes()
    frame = _call_impl_frame(owner)
    scope = scopes.get(id(frame))
    if scope is None or scope.frame is not frame:
        return
    _drop_inner(scopes, id(frame))  # forwards inside this one that an interrupt ended (caught in this forward)
    _close(scope)  # then dropped: an interrupt in between leaves it registered, stale, closed again next forward
    scopes.pop(id(frame), None)
    if output is not None or sys.exc_info()[1] is None:  # always_call hooks also run when forward raised
        for child in owner._modules.values():
            check = getattr(child, "check_forward", None)
            if check is not None:
                check(scope)


@eager
def _child_done(module: nn.Module, args: Any, output: Any) -> None:
    """A watched module's call returned: note it in the open scope of the module whose own code called it."""
    frame = _calling_module_frame(1).frame
    scope = _scopes().get(id(frame)) if frame is not None else None
    if scope is not None and scope.frame is frame:
        scope.last_child = module


def watch_child(module: nn.Module) -> None:
    """Note each call of ``module`` in the open :class:`Scope` of the module whose own code calls it
    (``Scope.last_child``), so that a loop's activation calls can be checked against the modules the probe saw
    called before them (once; again after a copy that dropped the hook, as a GraphModule's does)."""
    if module.__dict__.get(_WATCHED) in module._forward_hooks:
        return
    prime_eager()
    module.__dict__[_WATCHED] = module.register_forward_hook(_child_done).id


def attach_owner(owner: nn.Module) -> None:
    """Give ``owner`` the hooks that open and close a :class:`Scope` around each of its forwards (once).

    Its children with ``begin_forward(scope)`` / ``end_forward(scope)`` / ``check_forward(scope)`` methods
    (the call-site dispatchers) are told when a forward begins, ends, and ends without an exception.
    """
    ids = owner.__dict__.get(_MARK)
    if ids and owner._forward_pre_hooks.get(ids[0]) is _open:  # attached already (kept by copy.deepcopy)
        return
    prime_eager()
    handles = (owner.register_forward_pre_hook(_open, prepend=True),
               owner.register_forward_hook(_shut, prepend=True, always_call=True))
    owner.__dict__[_MARK] = tuple(h.id for h in handles)
    if isinstance(owner, torch.fx.GraphModule):
        _attached_in_copies(owner)


def _attached_in_copies(owner: torch.fx.GraphModule) -> None:
    """torch rebuilds a GraphModule for ``copy.deepcopy`` and pickling (``torch.save``, spawn), which drops its
    forward hooks: the copy (its deepcopy hook) and the unpickled module (its own class's ``__reduce__``, as
    each GraphModule instance has a class of its own) get them again."""
    if attach_owner not in owner._deepcopy_hooks:
        owner._register_deepcopy_hook(attach_owner)
    cls = type(owner)
    if "__reduce__" not in vars(cls):
        cls.__reduce__ = _reduce_owner


def _reduce_owner(owner: torch.fx.GraphModule) -> tuple:
    """Pickle a GraphModule owner as torch does, to be rebuilt by :func:`_rebuilt_owner`."""
    return _rebuilt_owner, super(type(owner), owner).__reduce__()


def _rebuilt_owner(rebuild: Callable, args: tuple) -> torch.fx.GraphModule:
    """An unpickled GraphModule owner, rebuilt as torch does, with the hooks of :func:`attach_owner`."""
    owner = rebuild(*args)
    attach_owner(owner)
    return owner


def user_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward or forward pre-hooks other than those of :func:`attach_owner` and
    :func:`watch_child`."""
    return any(h is not _open and h is not _shut and h is not _child_done
               for h in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()))


@contextmanager
def user_hooks_removed(modules: Iterable[nn.Module]) -> Iterator[None]:
    """For the body, ``modules`` run without their forward and forward pre-hooks other than those of
    :func:`attach_owner` (see :func:`user_hooks`); they are put back after, in their order."""
    saved = [(r, dict(r)) for m in modules for r in (m._forward_pre_hooks, m._forward_hooks)]
    try:
        for registry, hooks in saved:
            for k, h in hooks.items():
                if h is not _open and h is not _shut and h is not _child_done:
                    del registry[k]
        yield
    finally:
        for registry, hooks in saved:
            registry.clear()
            registry.update(hooks)


def detach_owner(owner: nn.Module) -> None:
    """Remove the hooks of :func:`attach_owner` (when no call-site dispatcher is left on ``owner``)."""
    ids = owner.__dict__.pop(_MARK, ())
    for hooks in (owner._forward_pre_hooks, owner._forward_hooks):
        for key in [k for k in hooks if k in ids]:
            del hooks[key]
    for key in ids:
        owner._forward_hooks_always_called.pop(key, None)
    if isinstance(owner, torch.fx.GraphModule) and attach_owner in owner._deepcopy_hooks:
        owner._unregister_deepcopy_hook(attach_owner)
    if vars(type(owner)).get("__reduce__") is _reduce_owner:
        del type(owner).__reduce__


def fx_leaf_call(module: nn.Module, x: Any) -> Any:
    """Under ``torch.fx.symbolic_trace`` (``x`` a ``torch.fx.Proxy``): record the call of ``module`` on ``x`` as
    one ``call_module`` node, so that the GraphModule runs the module itself (a unit's forward holds checks on
    the input that a proxy cannot answer). None when ``x`` is no proxy.

    Example:
        >>> fx_leaf_call(nn.ReLU(), torch.zeros(1)) is None
        True
    """
    if not isinstance(x, torch.fx.Proxy):
        return None
    return x.tracer.create_proxy("call_module", x.tracer.path_of_module(module), (x,), {})


def fx_tracer() -> torch.fx.Tracer | None:
    """The ``torch.fx.Tracer`` whose ``trace`` is running on this thread's stack (None when none is)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _FX_TRACE and isinstance(tracer := frame.f_locals.get("self"), torch.fx.Tracer):
            return tracer
        frame = frame.f_back
    return None


def refuse_fx_root(sites: nn.Module, prefix: str) -> None:
    """Raise when ``torch.fx.symbolic_trace`` (any ``torch.fx.Tracer``) traces the owner of the call-site
    dispatcher ``sites`` as its root (``sites`` is then the root's child ``prefix``): the tracer runs the root's
    forward without its hooks, so its activation calls would be recorded as the original functions, not as
    their units. Called from the dispatchers' ``named_modules``, which ``Tracer.trace`` walks first."""
    if not prefix or "." in prefix:
        return
    tracer = fx_tracer()
    root = getattr(tracer, "root", None)
    if not isinstance(root, nn.Module) or root._modules.get(prefix) is not sites:
        return
    if isinstance(root, torch.fx.graph_module._CodeOnlyModule):  # torch unpickling a GraphModule owner: its
        return  # graph is the original's, and _rebuilt_owner gives the result its hooks
    name = type(root).__name__
    tool = type(tracer).__module__.partition(".")[0] != "torch"  # a tool's tracer (torchvision's NodePathTracer)
    raise FunctionalSiteError(
        f"linearize: torch.fx.symbolic_trace of {name} itself would record the original activation functions: "
        f"the tracer runs the root module's forward without its hooks, and {name}'s own forward makes activation "
        f"calls that linearize sends to their units ({type(sites).__name__} {prefix!r}) only through them. Fix: "
        f"trace a wrapper, torch.fx.symbolic_trace(torch.nn.Sequential(model)) (each unit becomes a call_module "
        "node of the GraphModule), or linearize.fold(model, example_inputs) for a plain model" + (
            f". The model is in {'training' if root.training else 'eval'} mode now: a tool that sets the mode for "
            f"its trace ({type(tracer).__name__}: torchvision's create_feature_extractor does) does not put it back "
            "after this error, so set it again (model.eval()); and give the wrapper the model's mode, which such a "
            "tool restores at its end: create_feature_extractor(torch.nn.Sequential(model).eval(), {'0.layer': "
            "'name'}) (the wrapper's names start with '0.')" if tool else ""))


def refuse_scripting(module: nn.Module) -> None:
    """Raise the error of ``torch.jit.script`` on a model holding linearize's modules (from their
    ``__prepare_scriptable__``, which the scripting calls first on every submodule)."""
    raise TypeError(
        f"torch.jit.script cannot compile linearize's {type(module).__name__} (its dispatch and its kernels are "
        "Python). Fix: linearize.fold(model, example_inputs) gives a plain PyTorch model that "
        "scripts, or use torch.jit.trace, torch.export or torch.compile on the converted model")


class ThreadWatch:
    """Activation calls made on the threads a forward starts, which convert's probe (a torch-function mode,
    which is per thread) cannot see, so they are neither converted nor counted.

    Inside ``with ThreadWatch(functions) as watch:`` every thread started meanwhile runs a profile function
    (:func:`threading.setprofile`) that records calls of ``functions`` (``torch`` builtins, their ``Tensor``
    methods and Python functions such as ``F.relu``), except those inside the forward of a module whose id is
    in ``inside`` (activation modules, which module hooks see on every thread), as ``"thread 'Thread-1', in <function that called it>: relu"`` with
    their count (``watch.calls``), and calls the profile function set before it, if any. Only threads the
    watching thread starts (or threads they start) are recorded, not those an unrelated thread starts meanwhile
    (``threading.Thread.start`` tags each thread with its starter while a watch is open). Threads already
    running (a pool made before the forward) are not watched. Watches may overlap (converts on several threads):
    a new thread reports to every watch open then. Once the last block ends, a watched thread gets the previous
    profile function back at its next call.

    Example:
        >>> import torch.nn.functional as F
        >>> with ThreadWatch([F.relu, torch.relu]) as watch:
        ...     def work():
        ...         return F.relu(torch.ones(1))
        ...     t = threading.Thread(target=work, name="worker"); t.start(); t.join()
        >>> watch.calls
        {"thread 'worker', in work: relu": 1}
    """

    def __init__(self, functions: Any, inside: set[int] = frozenset()) -> None:
        functions = list(functions)
        self._origin: threading.Thread | None = None  # the thread that opened the watch (the probe forward's)
        self._inside = inside  # ids of modules whose forwards' calls are not recorded (activation modules)
        self._codes = {f.__code__: f.__name__ for f in functions if hasattr(f, "__code__")}
        self._builtins = {id(f): f.__name__ for f in functions if not hasattr(f, "__code__")}
        self._methods = {f.__name__ for f in functions if getattr(torch.Tensor, getattr(f, "__name__", ""), None) is f}
        self.calls: dict[str, int] = {}

    # one profile function for the process: several converts may watch at once (threads, nested converts)
    _watches: list["ThreadWatch"] = []
    _previous: Callable | None = None
    _lock = threading.Lock()
    _start: Callable = threading.Thread.start  # replaced by the one in place when the first watch opens
    _STARTER = "_linearize_started_by"  # Thread attribute: the thread that started it (while a watch is open)

    def __enter__(self) -> "ThreadWatch":
        self._origin = threading.current_thread()
        with ThreadWatch._lock:
            if not ThreadWatch._watches:
                ThreadWatch._previous = threading.getprofile()
                threading.setprofile(ThreadWatch._profile)
                ThreadWatch._start = threading.Thread.start  # as it is now (another tool may have wrapped it)
                threading.Thread.start = ThreadWatch._tagged_start  # who starts each thread: see _started_here
            ThreadWatch._watches.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with ThreadWatch._lock:
            ThreadWatch._watches.remove(self)
            if not ThreadWatch._watches:
                threading.setprofile(ThreadWatch._previous)
                threading.Thread.start = ThreadWatch._start

    @staticmethod
    def _tagged_start(thread: threading.Thread) -> None:
        setattr(thread, ThreadWatch._STARTER, threading.current_thread())
        ThreadWatch._start(thread)

    def _started_here(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` was started by the watch's thread, or by a thread it started (a pool the forward
        makes), not by an unrelated thread that happened to start one while the watch was open."""
        for _ in range(100):
            thread = getattr(thread, ThreadWatch._STARTER, None)
            if thread is None:
                return False
            if thread is self._origin:
                return True
        return False

    def _name(self, frame: FrameType, event: str, arg: Any) -> str | None:
        """The watched function this profile event calls, if any."""
        if event == "call":
            return self._codes.get(frame.f_code)
        if event != "c_call" or frame.f_code in self._codes:  # a watched Python function's own builtin call
            return None
        name = self._builtins.get(id(arg))
        if name is None and isinstance(getattr(arg, "__self__", None), torch.Tensor) and arg.__name__ in self._methods:
            name = arg.__name__
        return name

    def _in_skipped_module(self, frame: FrameType | None) -> bool:
        """Whether ``frame`` runs inside the forward of a module in ``inside`` (within 1000 frames)."""
        for _ in range(1000):
            if frame is None:
                return False
            if frame.f_code is _CALL_IMPL and id(frame.f_locals.get("self")) in self._inside:
                return True
            frame = frame.f_back
        return False

    @staticmethod
    def _profile(frame: FrameType, event: str, arg: Any) -> None:
        previous, watches = ThreadWatch._previous, ThreadWatch._watches
        if previous is not None:
            previous(frame, event, arg)
        if not watches:  # every watch has ended: this thread gets the previous profile function back
            sys.setprofile(previous)
            return
        for watch in list(watches):
            watch._record(frame, event, arg)

    def _record(self, frame: FrameType, event: str, arg: Any) -> None:
        name = self._name(frame, event, arg)
        if name is None or self._in_skipped_module(frame) or not self._started_here(threading.current_thread()):
            return
        caller = frame.f_back if event == "call" else frame
        where = getattr(caller.f_code, "co_qualname", caller.f_code.co_name) if caller is not None else ""
        key = f"thread {threading.current_thread().name!r}, in {where}: {name}"
        with ThreadWatch._lock:
            self.calls[key] = self.calls.get(key, 0) + 1


def compiled_submodules(model: nn.Module) -> list[str]:
    """Names of the outermost TorchScript submodules of ``model`` (``torch.jit.script`` / ``trace``): their code
    runs compiled, without Python frames or module hooks, so linearize can neither see nor convert the
    activations inside them ("" names ``model`` itself).

    Example:
        >>> compiled_submodules(nn.Sequential(nn.Linear(2, 2), torch.jit.script(nn.ReLU())))
        ['1']
    """
    found: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule) and not any(name.startswith(f + ".") or f == "" for f in found):
            found.append(name)
    return found
