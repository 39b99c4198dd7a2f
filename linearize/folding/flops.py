"""The one FLOP counter: :func:`count_flops` (fold's summary, the reports) and :func:`module_flops`
(fold's planner, the sparsifier's ``weights="flops"``). 2 FLOPs per multiply-add of every linear,
conv, matmul and attention op, plus 2 per BatchNorm element; other element-wise ops count 0."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..inputs import call_model
from .layers import CONVS, is_hf_conv1d

__all__ = ["count_flops", "module_flops", "FlopCounter"]


def module_flops(m: nn.Module, inp: tuple, out: Any) -> int:
    """FLOPs of one call of a linear layer (conv / ``nn.Linear`` / HF ``Conv1D``) from its input and
    output shapes (tensors, or meta tensors of those shapes); 0 for any other module.

    Example:
        >>> module_flops(nn.Linear(4, 6), (torch.empty(5, 4),), torch.empty(5, 6))
        240
    """
    if not isinstance(out, torch.Tensor):
        return 0
    if isinstance(m, CONVS):
        k = math.prod(m.kernel_size)
        return 2 * out.numel() * (m.in_channels // m.groups) * k
    if isinstance(m, nn.Linear):  # LinearWithPassthrough counts only its matmul
        return 2 * m.in_features * m.out_features * (inp[0].numel() // m.in_features)
    if is_hf_conv1d(m):
        return 2 * m.weight.shape[0] * m.weight.shape[1] * (inp[0].numel() // m.weight.shape[0])
    return 0


def _op_flops(func: Callable, args: tuple, out: Any) -> int:
    """FLOPs of one torch op (2 per multiply-add; 2 per element for batch norm), else 0."""
    kind = _FLOP_OPS.get(func)
    if kind is None or not isinstance(out, torch.Tensor):
        return 0
    if kind == "linear":  # F.linear(x, W[out, in])
        return 2 * out.numel() * args[1].shape[-1]
    if kind == "conv":  # conv(x, W[out, in / groups, *k])
        return 2 * out.numel() * math.prod(args[1].shape[1:])
    if kind == "matmul":  # a @ b, contracted over a's last dim
        return 2 * out.numel() * args[0].shape[-1]
    if kind == "addmm":  # addmm(bias, a, b) / baddbmm(input, a, b)
        return 2 * out.numel() * args[1].shape[-1]
    if kind == "sdpa":  # softmax(q k^T) v: q [.., T, D], k [.., S, D], v [.., S, Dv]
        q, k = args[0], args[1]
        return 2 * (q.numel() // q.shape[-1]) * k.shape[-2] * (q.shape[-1] + out.shape[-1])
    return 2 * out.numel()  # batch_norm


_FLOP_OPS = {
    F.linear: "linear", torch.conv1d: "conv", torch.conv2d: "conv", torch.conv3d: "conv",
    torch.matmul: "matmul", torch.Tensor.matmul: "matmul", torch.Tensor.__matmul__: "matmul",
    torch.mm: "matmul", torch.Tensor.mm: "matmul", torch.bmm: "matmul", torch.Tensor.bmm: "matmul",
    torch.addmm: "addmm", torch.baddbmm: "addmm", F.scaled_dot_product_attention: "sdpa",
    F.batch_norm: "batch_norm",
}


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
        self.total += _op_flops(func, args, out)
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
