"""The probe forward of fold: one run of the model copy that counts FLOPs and records, per module,
how often it ran and its shapes, plus a data-flow log (which module call or op consumed which tensor)
that lets rules find layer chains in any module's ``forward`` (:meth:`Probe.flow`)."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.dropout import _DropoutNd
from torch.utils._pytree import tree_flatten

from ..inputs import call_model
from ..module_stack import ModuleStack
from .flops import FlopCounter, counter_failure

# ops that return their input unchanged when ``training`` is off (eval dropout)
_DROPOUT_OPS = {F.dropout: 2, F.dropout1d: 2, F.dropout2d: 2, F.dropout3d: 2, F.alpha_dropout: 2,
                F.feature_alpha_dropout: 2, torch.dropout: 2, torch.alpha_dropout: 2, torch.feature_dropout: 2}


@dataclass
class Node:
    """One module call or op of the probe forward, seen from the module that ran it (``parent``: the
    id of the innermost module running when it started, ``None`` at top level). ``inputs`` /
    ``outputs`` are value numbers of its tensors; ``transparent`` nodes (``nn.Identity``, eval
    dropout) pass their input through unchanged."""

    parent: int | None
    module: nn.Module | None
    func: Callable | None
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    transparent: bool


@dataclass
class Flow:
    """The data flow inside one module's forward: its direct child calls and ops (:class:`Node`),
    values resolved through transparent nodes, and who consumes each value."""

    nodes: list[Node]
    consumers: dict[int, list[Node]]
    alias: dict[int, int]

    def value(self, v: int) -> int:
        """``v`` followed back through transparent nodes."""
        while v in self.alias:
            v = self.alias[v]
        return v

    def only_consumer(self, v: int) -> Node | None:
        """The single node that consumes ``v`` (resolved), or ``None`` if there are none or several."""
        found = self.consumers.get(self.value(v), [])
        return found[0] if len(found) == 1 else None


@dataclass
class Probe:
    """Per-module call counts, callers (the modules whose forward called it; ``None``: top level),
    the input/output shape of the (last) call, and the data-flow log."""

    calls: dict[int, int] = field(default_factory=dict)
    out_shape: dict[int, tuple[int, ...]] = field(default_factory=dict)
    in_shape: dict[int, tuple[int, ...]] = field(default_factory=dict)
    keep: list[nn.Module] = field(default_factory=list)  # keeps ids valid while folding
    nodes: list[Node] = field(default_factory=list)
    returns: dict[int, tuple[int, ...]] = field(default_factory=dict)  # module id -> value numbers it returned
    callers: dict[int, set[int | None]] = field(default_factory=dict)  # module id -> ids of the modules that called it
    chains: set[int] = field(default_factory=set)  # Sequentials the ``sequential`` rule found run as chains
    _by_parent: dict[int | None, list[Node]] | None = None

    def once(self, m: nn.Module) -> bool:
        """Whether ``m`` ran exactly once in the probe forward."""
        return self.calls.get(id(m), 0) == 1

    def register(self, new: nn.Module, like: nn.Module, first: nn.Module | None = None) -> None:
        """Record a module built by fold in place of ``first .. like`` (``first`` defaults to ``like``):
        called as often as ``like``, with ``first``'s input and ``like``'s output shape."""
        first = like if first is None else first
        if id(like) in self.out_shape:
            self.out_shape[id(new)] = self.out_shape[id(like)]
        if id(first) in self.in_shape:
            self.in_shape[id(new)] = self.in_shape[id(first)]
        self.calls[id(new)] = self.calls.get(id(like), 0)
        self.callers[id(new)] = set(self.callers.get(id(like), ()))
        self.keep.append(new)

    def flow(self, module: nn.Module) -> Flow:
        """The data flow directly inside ``module``'s forward (it must have run once)."""
        if self._by_parent is None:
            self._by_parent = {}
            for n in self.nodes:
                self._by_parent.setdefault(n.parent, []).append(n)
        mine = self._by_parent.get(id(module), [])
        alias = {n.outputs[0]: n.inputs[0] for n in mine
                 if n.transparent and len(n.inputs) == 1 and len(n.outputs) == 1 and n.outputs[0] != n.inputs[0]}
        flow = Flow(mine, {}, alias)
        users = [n for n in mine if not n.transparent]
        for n in users:
            for v in dict.fromkeys(flow.value(i) for i in n.inputs):
                flow.consumers.setdefault(v, []).append(n)
        returned = Node(None, module, None, self.returns.get(id(module), ()), (), False)
        for v in dict.fromkeys(flow.value(i) for i in returned.inputs):
            flow.consumers.setdefault(v, []).append(returned)
        return flow


class _Recorder(FlopCounter):
    """Counts FLOPs and logs every tensor-producing (or in-place) op with the module running it."""

    def __init__(self, probe: Probe, model: nn.Module) -> None:
        super().__init__()
        self.probe = probe
        # the running modules of ``model``, each call's input value numbers kept with it
        self.running = ModuleStack(model, enter=self.enter, leave=self.leave)
        self._numbers: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._count = itertools.count(1)

    def number(self, t: torch.Tensor) -> int:
        """A value number for tensor ``t``, stable while it lives (ids of dead tensors are forgotten)."""
        key = id(t)
        if key not in self._numbers:
            self._numbers[key] = next(self._count)

            def forget(_: Any, key: int = key) -> None:
                self._numbers.pop(key, None)
                self._refs.pop(key, None)

            self._refs[key] = weakref.ref(t, forget)
        return self._numbers[key]

    def tensors(self, tree: Any) -> tuple[int, ...]:
        return tuple(self.number(t) for t in tree_flatten(tree)[0]
                     if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter))

    def on_op(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        outputs = self.tensors(out)
        if not outputs and getattr(func, "__name__", "") != "__setitem__":
            return  # metadata only (shape, dtype, size ...): not a use of the values
        position = _DROPOUT_OPS.get(func)
        transparent = position is not None and not kwargs.get("training", kwargs.get("train", (
            args[position] if len(args) > position else True)))
        self.probe.nodes.append(Node(self.parent(), None, func, self.tensors((args, kwargs)), outputs, transparent))

    def parent(self) -> int | None:
        """The id of the innermost module running (``None``: top level)."""
        return id(self.running.stack[-1]) if self.running.stack else None

    def enter(self, m: nn.Module, args: tuple, kwargs: dict) -> tuple[int, ...]:
        """The value numbers of a module call's inputs."""
        with counter_failure(f"the call of {type(m).__name__}"):
            return self.tensors((args, kwargs))

    def leave(self, m: nn.Module, args: tuple, out: Any, inputs: tuple[int, ...]) -> None:
        """A module call returned ``out``: record it."""
        with counter_failure(f"the return of {type(m).__name__}"):
            self._record_call(m, args, out, inputs)

    def _record_call(self, m: nn.Module, args: tuple, out: Any, inputs: tuple[int, ...]) -> None:
        """Count ``m``'s call, record its shapes, callers and data-flow node."""
        probe = self.probe
        probe.calls[id(m)] = probe.calls.get(id(m), 0) + 1
        if isinstance(out, torch.Tensor):
            probe.out_shape[id(m)] = tuple(out.shape)
        if args and isinstance(args[0], torch.Tensor):
            probe.in_shape[id(m)] = tuple(args[0].shape)
        outputs = self.tensors(out)
        probe.returns[id(m)] = outputs
        transparent = type(m) is nn.Identity or (isinstance(m, _DropoutNd) and not m.training)
        parent = self.parent()
        probe.callers.setdefault(id(m), set()).add(parent)
        probe.nodes.append(Node(parent, m, None, inputs, outputs, transparent))


@torch.no_grad()
def run_counting(model: nn.Module, inputs: Any, probe: Probe | None = None) -> tuple[int, Any]:
    """One forward: ``(FLOPs, output)``; fills ``probe`` (call counts, shapes, data flow) when given."""
    if probe is None:
        with FlopCounter() as counter:
            out = call_model(model, inputs)
        return counter.total, out
    recorder = _Recorder(probe, model)
    with recorder.running, recorder:
        out = call_model(model, inputs)
    return recorder.total, out
