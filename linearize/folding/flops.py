"""The one FLOP counter: :func:`count_flops` (fold's summary, the reports) and :func:`module_flops`
(fold's planner, the sparsifier's ``weights="flops"``). 2 FLOPs per multiply-add of every linear,
conv (transposed too), matmul, einsum (pairwise, left to right) and attention op, plus 2 per BatchNorm
element; other element-wise ops count 0."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..inputs import call_model
from .layers import CONVS, is_hf_conv1d

__all__ = ["count_flops", "module_flops", "is_counted_layer", "FlopCounter", "FlopCounterError"]


CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CONV_OPS = {1: torch.conv1d, 2: torch.conv2d, 3: torch.conv3d}
_CONV_T_OPS = {1: torch.conv_transpose1d, 2: torch.conv_transpose2d, 3: torch.conv_transpose3d}


def is_counted_layer(m: nn.Module) -> bool:
    """Whether :func:`module_flops` counts ``m``: a conv (transposed too), ``nn.Linear`` or HF ``Conv1D``."""
    return isinstance(m, (nn.Linear, *CONVS, *CONV_TRANSPOSES)) or is_hf_conv1d(m)


def module_flops(m: nn.Module, inp: tuple, out: Any) -> int:
    """FLOPs of one call of a linear layer (conv, transposed conv, ``nn.Linear``, HF ``Conv1D``) from its
    input and output shapes (tensors, or meta tensors of those shapes); 0 for any other module. Counted by
    the op the layer runs, as :func:`count_flops` counts it, so the two cannot disagree.

    Example:
        >>> module_flops(nn.Linear(4, 6), (torch.empty(5, 4),), torch.empty(5, 6))
        240
    """
    if not isinstance(out, torch.Tensor) or not is_counted_layer(m):
        return 0
    x = inp[0]
    if isinstance(m, (*CONVS, *CONV_TRANSPOSES)):  # a passthrough conv's output also holds its input channels
        dims = len(m.kernel_size)
        op = (_CONV_T_OPS if isinstance(m, CONV_TRANSPOSES) else _CONV_OPS)[dims]
        return _op_flops(op, (x, m.weight), {}, out.narrow(out.ndim - dims - 1, 0, m.out_channels))
    if isinstance(m, nn.Linear):  # LinearWithPassthrough: only its matmul's outputs
        return _op_flops(F.linear, (x, m.weight), {}, out.narrow(-1, 0, m.out_features))
    # HF Conv1D: addmm(bias, x [-1, in], weight [in, out])
    return _op_flops(torch.addmm, (m.bias, x.reshape(-1, x.shape[-1]), m.weight), {}, out.reshape(-1, m.nf))


def _op_flops(func: Callable, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one torch op (2 per multiply-add; 2 per element for batch norm), else 0. Operands are
    read by position or keyword (``F.linear(x, weight=w)``), as the op itself binds them."""
    op = _FLOP_OPS.get(func)
    if op is None or not isinstance(out, torch.Tensor):
        return 0
    kind, names = op
    a = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    if kind == "linear":  # F.linear(x, W[out, in] or W[in])
        return 2 * out.numel() * a["weight"].shape[-1]
    if kind == "conv":  # conv(x, W[out, in / groups, *k])
        return 2 * out.numel() * math.prod(a["weight"].shape[1:])
    if kind == "conv_transpose":  # every input element meets out / groups * k weights: W[in, out / groups, *k]
        return 2 * a["input"].numel() * math.prod(a["weight"].shape[1:])
    if kind == "einsum":
        return _einsum_flops(a["equation"], args[1:])
    if kind == "matmul":  # a @ b, contracted over a's last dim
        return 2 * out.numel() * a["input"].shape[-1]
    if kind == "addmm":  # addmm(bias, a, b) / baddbmm(input, a, b)
        return 2 * out.numel() * a[names[1]].shape[-1]
    if kind == "sdpa":  # softmax(q k^T) v: q [.., T, D], k [.., S, D], v [.., S, Dv]
        q, k = a["query"], a["key"]
        return 2 * (q.numel() // q.shape[-1]) * k.shape[-2] * (q.shape[-1] + out.shape[-1])
    return 2 * out.numel()  # batch_norm


def _einsum_flops(equation: str, operands: tuple) -> int:
    """2 x the product of every index size of each pairwise contraction, in the order PyTorch runs them
    without ``opt_einsum``: first each index that one operand alone has and the output drops is summed out
    (a reduction: 0), then the operands are contracted left to right, an index leaving as soon as no later
    operand and not the output has it; 0 for one operand (a transpose, trace or sum). With ``opt_einsum``
    on, PyTorch may take another order."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])  # einsum(eq, [a, b, ...])
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    specs = lhs.split(",")
    if len(operands) < 2 or len(specs) != len(operands):
        return 0
    sizes: dict[str, int] = {}
    named: list[set[str]] = []
    for spec, t in zip(specs, operands):
        before, dots, after = spec.partition("...")
        span = t.ndim - len(before) - len(after)  # dims under "...", named from the right (they broadcast so)
        names = [*before, *(f".{span - 1 - i}" for i in range(span if dots else 0)), *after]
        for name, size in zip(names, t.shape):
            sizes[name] = size if sizes.get(name, 1) == 1 else sizes[name]  # broadcasting: a 1 takes the other size
        named.append(set(names))
    letters = [c for spec in specs for c in spec if c.isalpha()]
    kept = set(rhs) if arrow else {c for c in letters if letters.count(c) == 1}  # implicit: the indices used once
    if not arrow or "..." in rhs:
        kept |= {n for n in sizes if n.startswith(".")}

    def needed(name: str, others: list[set[str]]) -> bool:  # by the output or by an operand still to come
        return name in kept or any(name in other for other in others)

    # a private index the output drops is summed out first
    named = [{n for n in own if needed(n, named[:i] + named[i + 1:])} for i, own in enumerate(named)]
    total, acc = 0, named[0]
    for i, nxt in enumerate(named[1:], start=2):
        pair = acc | nxt
        total += 2 * math.prod(sizes[n] for n in pair)
        acc = {n for n in pair if needed(n, named[i:])}
    return total


_CONV = ("conv", ("input", "weight"))
_CONV_T = ("conv_transpose", ("input", "weight"))
_MATMUL = ("matmul", ("input",))
# op -> (kind, its parameter names in order, as far as the count reads them; a Tensor method's self is "input")
_FLOP_OPS: dict[Callable, tuple[str, tuple[str, ...]]] = {
    F.linear: ("linear", ("input", "weight")), torch.conv1d: _CONV, torch.conv2d: _CONV, torch.conv3d: _CONV,
    torch.matmul: _MATMUL, torch.Tensor.matmul: _MATMUL, torch.Tensor.__matmul__: _MATMUL,
    torch.mm: _MATMUL, torch.Tensor.mm: _MATMUL, torch.bmm: _MATMUL, torch.Tensor.bmm: _MATMUL,
    torch.conv_transpose1d: _CONV_T, torch.conv_transpose2d: _CONV_T, torch.conv_transpose3d: _CONV_T,
    torch.addmm: ("addmm", ("input", "mat1")), torch.baddbmm: ("addmm", ("input", "batch1")),
    torch.Tensor.addmm: ("addmm", ("input", "mat1")), torch.Tensor.baddbmm: ("addmm", ("input", "batch1")),
    torch.einsum: ("einsum", ("equation",)),
    F.scaled_dot_product_attention: ("sdpa", ("query", "key")), F.batch_norm: ("batch_norm", ()),
}


class FlopCounterError(RuntimeError):
    """The FLOP counter itself failed on an op the model ran (a linearize bug, not the model's inputs)."""


@contextmanager
def counter_failure(what: str) -> Iterator[None]:
    """Re-raise any error of the counter's own code (on ``what``) as :class:`FlopCounterError`."""
    try:
        yield
    except Exception as exc:
        raise FlopCounterError(
            f"linearize's FLOP counter failed on {what} ({type(exc).__name__}: {exc}); the model itself "
            "ran it: please report this to linearize with the model"
        ) from exc


class FlopCounter(TorchFunctionMode):
    """Adds up the FLOPs of every op run under it (``total``); subclasses may also watch the ops
    (:meth:`on_op`)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def on_op(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        """Called after every op (nothing here)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        with counter_failure(getattr(func, "__qualname__", None) or repr(func)):
            self.total += _op_flops(func, args, kwargs, out)
            self.on_op(func, args, kwargs, out)
        return out


@torch.no_grad()
def count_flops(model: nn.Module, example_inputs: Any) -> int:
    """FLOPs of one forward on ``example_inputs`` (whole batch): 2 per multiply-add of every
    linear / conv / matmul / attention op (nn.Linear, HF Conv1D, attention scores...) plus 2 per
    BatchNorm element; other element-wise ops are not counted.

    Example:
        >>> count_flops(nn.Linear(4, 6), torch.randn(5, 4))
        240
    """
    with FlopCounter() as counter:
        call_model(model, example_inputs)
    return counter.total
