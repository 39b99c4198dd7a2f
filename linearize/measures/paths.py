"""Average path length (seed 000): how many nonlinear units a path from input to output meets.

The network is seen as a directed acyclic graph of tensors. A *path* starts at the input, ends at
the output, visits **one channel** of every unit call it passes and may take either branch at
every fork: skip connection vs residual branch, attention vs FFN sub-block of a Transformer.
The length of a path is the number of **nonlinear** channels it visits (slope ``a < 1 - tol``).

Two averages over the paths:

* ``normalized=True``: a random walk from the output back to the input that splits its
  probability equally among the branches at every merge node and picks a channel uniformly at
  every unit. A unit adds ``k / C`` (``k`` nonlinear of ``C`` channels) to the expected count; a
  merge averages its branches. A skip around any block gives the block weight 1/2.
* ``normalized=False``: every channel-level path equally likely. A unit of width ``C`` multiplies
  the number of paths by ``C``, a merge adds the path counts of its branches, so wide, deep
  branches dominate. Path counts are kept in log space (a ResNet-18 has ~10^80 paths).

Reference: one skip around 4 fully connected unit layers of width 4, all nonlinear, has
``1 + 4^4 = 257`` paths; unnormalized APL ``4 * 256 / 257 = 3.984``, normalized APL ``2.0``.
A plain chain of ``L`` unit layers gives ``sum_l k_l / C_l`` under both variants.

How the graph is obtained (``method``):

* ``"fx"``: ``torch.fx`` symbolic tracing with every unit as a leaf (torchvision CNNs, plain
  ``nn.Module`` code). Needs no forward pass.
* ``"record"``: one real forward pass on ``example_inputs`` under a ``TorchFunctionMode`` that
  tags every floating-point tensor (and integer tensors only moved by layout ops: token ids
  reshaped before an embedding) with the graph node it derives from (tensor provenance),
  plus forward hooks that turn each unit call into a unit node. Works for models that do not
  trace (Hugging Face Transformers with data-dependent control flow).
* ``"auto"`` (default): ``"fx"`` when tracing succeeds and reaches every unit, else ``"record"``.

Graph rules (both methods): operations with one input-derived tensor operand pass its node on
(linear layers, convolutions, norms, pooling, reshapes). ``add``/``sub`` with several
input-derived operands are **merge** nodes, one branch per operand (``h + attn(h)`` is a fork even
when the attention holds no unit). Any other operation with several input-derived operands
(``matmul`` of queries and keys, ``x * rsqrt(mean(x^2))`` in RMSNorm, ``act(gate(x)) * up(x)``
in a gated MLP, ``cat``) is a merge over its *distinct* operand nodes: operands that carry the
same set of paths count once. Only the tensors given by ``sources`` start paths (by default the
model's main input); masks and other inputs are constants. The output is the first tensor of
the model's output (logits, ``last_hidden_state``).
"""

from __future__ import annotations

import math
import operator
import threading
from dataclasses import asdict, dataclass
from collections.abc import Mapping
from typing import Any, Sequence

import torch
import torch.fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from ..checks import check_tol
from ..inputs import call_model, eval_mode, inputs_fit
from ..unit import LinearizableActivation, check_finite_slopes, require_units, units

__all__ = ["average_path_length", "PathLengthResult"]


@dataclass
class PathLengthResult:
    """Both variants of the average path length and what the graph looked like.

    Attributes:
        normalized: APL of the equal-split random walk (nonlinear units per path).
        unnormalized: APL with every channel-level path equally likely.
        log10_paths: log10 of the number of channel-level paths from the sources to the output.
        unit_calls: unit calls whose input derives from the sources (a reused unit counts per call).
        merges: merge nodes on the graph.
        method: ``"fx"`` or ``"record"``.
    """

    normalized: float
    unnormalized: float
    log10_paths: float
    unit_calls: int
    merges: int
    method: str

    def to_dict(self) -> dict:
        """Plain JSON-serializable dict."""
        return asdict(self)


@dataclass(frozen=True, eq=False)
class _Node:
    """Path statistics of one graph node (hashed by identity: two branches are distinct nodes)."""

    log_paths: float  # natural log of the number of channel paths from the sources
    mean_unnormalized: float  # mean nonlinear count over those paths
    mean_normalized: float  # expected nonlinear count of the equal-split random walk


_SOURCE = _Node(0.0, 0.0, 0.0)


class _Graph:
    """Builds nodes in topological order and keeps the path statistics of each one."""

    def __init__(self, tol: float) -> None:
        self.tol = tol
        self.unit_calls = 0
        self.merges = 0

    def unit(self, parent: _Node, unit: LinearizableActivation) -> _Node:
        width = unit.num_channels
        frac = (width - int(unit.linear_mask(self.tol).sum())) / width
        self.unit_calls += 1
        return _Node(
            parent.log_paths + math.log(width),
            parent.mean_unnormalized + frac,
            parent.mean_normalized + frac,
        )

    def combine(self, parents: list[_Node], is_add: bool) -> _Node:
        """Node of an operation on several input-derived operands (see the module docstring)."""
        if not is_add:
            parents = list(dict.fromkeys(parents))  # distinct nodes, in order
        if len(parents) == 1:
            return parents[0]
        self.merges += 1
        top = max(p.log_paths for p in parents)
        weights = [math.exp(p.log_paths - top) for p in parents]
        total = sum(weights)
        return _Node(
            top + math.log(total),
            sum(w * p.mean_unnormalized for w, p in zip(weights, parents)) / total,
            sum(p.mean_normalized for p in parents) / len(parents),
        )


_ADD_TARGETS = {
    operator.add, operator.iadd, operator.sub, operator.isub, torch.add, torch.sub,
    torch.Tensor.add, torch.Tensor.add_, torch.Tensor.sub, torch.Tensor.sub_,
    torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__iadd__,
    torch.Tensor.__sub__, torch.Tensor.__rsub__, torch.Tensor.__isub__, torch.rsub,
}
_ADD_METHODS = {"add", "add_", "sub", "sub_", "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__"}
# outputs that depend on the shape/dtype of an input-derived tensor but not on its values
_VALUE_FREE = {
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.randint_like, torch.Tensor.new_zeros, torch.Tensor.new_ones,
    torch.Tensor.new_empty, torch.Tensor.new_full, torch.Tensor.new_tensor,
}

# ops that move or re-type values without computing new ones: their integer results (token ids reshaped,
# cast or shifted before an embedding, as GPT-2 and BART do) keep the input's node; other integer results
# (argmax, counts) and every bool result (masks, even ids.to(torch.bool)) are constants
_LAYOUT_OPS = {
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "unsqueeze", "squeeze", "permute",
    "transpose", "swapaxes", "movedim", "t", "contiguous", "clone", "detach", "expand", "expand_as", "repeat",
    "repeat_interleave", "tile", "narrow", "select", "flip", "roll", "index_select", "gather", "take",
    "__getitem__", "__setitem__", "to", "type", "type_as", "long", "int", "short", "pad", "cat", "concat",
    "concatenate", "stack", "split", "chunk", "unbind",
}
# ops whose other tensor operands give only a shape, dtype or device (x.to(y), x.expand_as(y)): their
# result derives from the first operand alone
_TEMPLATE_OPS = {"to", "type_as", "view_as", "expand_as", "reshape_as", "new_zeros", "new_ones", "new_empty",
                 "new_full", "new_tensor"}


# ----------------------------------------------------------------------------- inputs and outputs


def _sources(example_inputs: Any, model: nn.Module, sources: Sequence[str | int] | None) -> list[torch.Tensor]:
    """The input tensors that start paths."""
    if isinstance(example_inputs, torch.Tensor):
        return [example_inputs]
    if isinstance(example_inputs, Mapping):
        keys = list(sources) if sources is not None else [_main_key(example_inputs, model)]
        missing = [k for k in keys if k not in example_inputs]
        if missing:
            raise KeyError(f"sources {missing} are not keys of example_inputs {list(example_inputs)}")
        return [example_inputs[k] for k in keys]
    if isinstance(example_inputs, (tuple, list)):
        if not example_inputs:
            raise ValueError("example_inputs is an empty tuple: give at least the input tensor")
        idx = list(sources) if sources is not None else [0]
        return [example_inputs[i] for i in idx]
    raise TypeError(
        f"example_inputs must be a tensor, a tuple of positional args or a dict of keyword args, "
        f"got {type(example_inputs).__name__}"
    )


def _main_key(inputs: dict, model: nn.Module) -> str:
    main = getattr(model, "main_input_name", None)
    if main in inputs:
        return main
    for key in ("input_ids", "pixel_values", "inputs_embeds", "input_values", "input_features"):
        if key in inputs:
            return key
    return next(iter(inputs))


def _output_leaves(out: Any) -> list[Any]:
    """Output leaves in order; a Hugging Face ``ModelOutput`` by its tuple order."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return tree_leaves(out)


# ----------------------------------------------------------------------------- record


class _ProvenanceMode(TorchFunctionMode):
    """Tags every floating-point result with the node of its input-derived operands."""

    def __init__(self, graph: _Graph, tags: WeakTensorKeyDictionary) -> None:
        super().__init__()
        self.graph = graph
        self.tags = tags
        self.inside_unit = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside_unit or func in _VALUE_FREE:
            return out
        name = getattr(func, "__name__", "")
        operands = (args[:1], {}) if name in _TEMPLATE_OPS else (args, kwargs)  # x.to(y): y gives only a dtype
        parents = [self.tags[t] for t in tree_leaves(operands) if isinstance(t, torch.Tensor) and t in self.tags]
        if parents:
            node = self.graph.combine(parents, func in _ADD_TARGETS)
            if func is torch.Tensor.__setitem__:  # x[i] = y writes into x and returns None
                out = args[0]
            layout = name in _LAYOUT_OPS
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()
                                                    or (layout and t.dtype != torch.bool)):
                    self.tags[t] = node
        return out


def _record(model: nn.Module, example_inputs: Any, srcs: list[torch.Tensor], graph: _Graph) -> _Node:
    tags = WeakTensorKeyDictionary()
    mode = _ProvenanceMode(graph, tags)
    pending: dict[int, list] = {}

    def pre_hook(module: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        pending.setdefault(id(module), []).append(tags.get(x) if isinstance(x, torch.Tensor) else None)
        mode.inside_unit += 1

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        mode.inside_unit -= 1
        parent = pending[id(module)].pop()
        if parent is not None:
            tags[output] = graph.unit(parent, module)

    handles = []
    for _, unit in units(model):
        handles.append(unit.register_forward_pre_hook(pre_hook))
        handles.append(unit.register_forward_hook(hook))
    for s in srcs:
        tags[s] = _SOURCE
    try:
        with torch.no_grad(), mode:
            with inputs_fit(example_inputs):
                out = call_model(model, example_inputs)
    finally:
        for h in handles:
            h.remove()
    for leaf in _output_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf in tags:
            return tags[leaf]
    raise ValueError("no output tensor of the model derives from the source inputs: check `sources`")


# ----------------------------------------------------------------------------- fx


# one trace at a time: a trace restores the nn.Module methods it found, so two overlapping traces would leave the
# first one's patch in place for good
_TRACE_LOCK = threading.Lock()


class _UnitLeafTracer(torch.fx.Tracer):
    """Traces with every unit as a leaf. ``Tracer.trace`` patches ``nn.Module.__call__`` and ``__getattr__`` for
    the whole process while it runs: the module calls and attribute reads of other threads pass through unchanged
    (without this, a forward on another thread fails with "module is not installed as a submodule")."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, LinearizableActivation) or super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        if threading.get_ident() != self.thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if threading.get_ident() != self.thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)


def _fx(model: nn.Module, example_inputs: Any, sources: Sequence[str | int] | None, graph: _Graph) -> _Node:
    """Walk a ``torch.fx`` trace of ``model``; raises if it cannot trace or misses a unit."""
    with _TRACE_LOCK:
        fx_graph = _UnitLeafTracer().trace(model)
    placeholders = [n for n in fx_graph.nodes if n.op == "placeholder"]
    if isinstance(example_inputs, Mapping):
        keys = list(sources) if sources is not None else [_main_key(example_inputs, model)]
        starts = {n for n in placeholders if n.target in keys}
    elif isinstance(example_inputs, (tuple, list)):
        idx = list(sources) if sources is not None else [0]
        starts = {placeholders[i] for i in idx}
    else:
        starts = {placeholders[0]}
    modules = dict(model.named_modules())
    seen_units: set[str] = set()
    node_of: dict[torch.fx.Node, _Node] = {n: _SOURCE for n in starts}
    result = None
    for n in fx_graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        parents = [node_of[a] for a in tree_leaves((n.args, n.kwargs)) if isinstance(a, torch.fx.Node) and a in node_of]
        if n.op == "output":
            result = parents[0] if parents else None
            break
        if not parents:
            continue
        if n.op == "call_module" and isinstance(modules[n.target], LinearizableActivation):
            seen_units.add(n.target)
            node_of[n] = graph.unit(parents[0], modules[n.target])
        elif n.op == "call_function" and n.target in _VALUE_FREE:
            continue
        else:
            is_add = (n.op == "call_function" and n.target in _ADD_TARGETS) or (
                n.op == "call_method" and n.target in _ADD_METHODS
            )
            node_of[n] = graph.combine(parents, is_add)
    missing = {name for name, _ in units(model)} - seen_units
    if missing:
        raise RuntimeError(f"the fx trace does not reach units {sorted(missing)[:3]}")
    if result is None:
        raise ValueError("no output of the traced graph derives from the source inputs: check `sources`")
    return result


# ----------------------------------------------------------------------------- public


def average_path_length(
    model: nn.Module,
    example_inputs: Any,
    normalized: bool = True,
    tol: float = 0.0,
    *,
    method: str = "auto",
    sources: Sequence[str | int] | None = None,
    detailed: bool = False,
) -> float | PathLengthResult:
    """Average number of nonlinear units met on a path from the input to the output.

    Args:
        model: a model with :class:`~linearize.LinearizableActivation` units (``linearize.convert``).
        example_inputs: what the model is called with: a tensor, a tuple of positional args or a
            dict of keyword args (Hugging Face). Only shapes matter for ``"fx"``; ``"record"``
            runs one forward pass (eval mode, no grad), so a batch of 1-2 samples suffices.
        normalized: ``True`` for the equal-split random walk, ``False`` for every channel-level
            path equally likely (see the module docstring for both definitions).
        tol: in ``[0, 1)``: a channel is nonlinear when its slope ``a < 1 - tol``
            (:func:`linearize.unit.linear_masks`; NaN/inf slopes raise ``NonFiniteSlopeError``).
        method: ``"auto"``, ``"fx"`` (torch.fx trace) or ``"record"`` (tensor provenance during a
            real forward).
        sources: which inputs start paths: dict keys or tuple positions. Default: the main
            input (``model.main_input_name``, ``input_ids``, ``pixel_values`` ..., or position 0).
        detailed: return a :class:`PathLengthResult` with both variants instead of one float.

    Returns:
        The APL in units (0 when every unit is linear), or a :class:`PathLengthResult`.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> model = linearize.convert(mlp, example_inputs=torch.randn(2, 4))
        >>> before = average_path_length(model, torch.randn(2, 4))  # every path meets 2 nonlinear units
        >>> _ = model[1].slope.data.fill_(1.0)  # the first site becomes linear
        >>> before, average_path_length(model, torch.randn(2, 4))
        (2.0, 1.0)
    """
    if method not in ("auto", "fx", "record"):
        raise ValueError(f"method must be 'auto', 'fx' or 'record', got {method!r}")
    tol = check_tol(tol)
    check_finite_slopes(require_units(model, what="average_path_length"), "average_path_length")
    srcs = _sources(example_inputs, model, sources)
    with eval_mode(model):
        node, used = None, method
        if method in ("auto", "fx"):
            graph = _Graph(tol)
            try:
                node, used = _fx(model, example_inputs, sources, graph), "fx"
            except Exception:
                if method == "fx":
                    raise
        if node is None:
            graph = _Graph(tol)
            node, used = _record(model, example_inputs, srcs, graph), "record"
    result = PathLengthResult(
        normalized=node.mean_normalized,
        unnormalized=node.mean_unnormalized,
        log10_paths=node.log_paths / math.log(10),
        unit_calls=graph.unit_calls,
        merges=graph.merges,
        method=used,
    )
    if detailed:
        return result
    return result.normalized if normalized else result.unnormalized
