"""The plain modules a folded model is made of (besides ``torch.nn`` layers and the border-exact
convs of :mod:`.conv`), and how a unit becomes one: ``nn.ReLU``-style activations (slopes all 0),
:class:`ChannelPReLU` (mixed ReLU family), :class:`ChannelBlend` (mixed smooth units), the first layer
of a split FFN (:class:`LinearWithPassthrough`, :class:`ConvWithPassthrough`) and ``_Residual``."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..activations import FunctionalActivation
from ..injection import CallSites
from ..unit import LinearizableActivation

__all__ = ["ChannelPReLU", "ChannelBlend", "LinearWithPassthrough", "ConvWithPassthrough", "plain_unit"]


class ChannelPReLU(nn.PReLU):
    """``nn.PReLU`` whose channels sit at ``channel_dim`` (``nn.PReLU`` assumes dim 1).

    ``weight`` ``[C]`` is the slope for negative inputs. Input ``[..., C, ...]`` with ``C`` at
    ``channel_dim``; output has the same shape.
    """

    def __init__(self, weight: torch.Tensor, channel_dim: int = 1) -> None:
        super().__init__(num_parameters=weight.numel(), device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.weight.copy_(weight.reshape(-1))
        self.channel_dim = channel_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = self.channel_dim % x.ndim
        if dim == 1:
            return F.prelu(x, self.weight)
        if dim == x.ndim - 1:
            return F.prelu(x.reshape(-1, self.num_parameters), self.weight).reshape(x.shape)
        return F.prelu(x.movedim(dim, 1), self.weight).movedim(1, dim)

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}, channel_dim={self.channel_dim}"


class ChannelBlend(nn.Module):
    """Fixed per-channel blend ``(1 - a) * act(x) + a * x`` (a frozen smooth unit).

    ``slope`` ``[C]`` (a buffer) broadcast along ``channel_dim``.
    """

    def __init__(self, act: nn.Module, slope: torch.Tensor, channel_dim: int = 1) -> None:
        super().__init__()
        self.act = act
        self.channel_dim = channel_dim
        self.register_buffer("slope", slope.detach().clone().reshape(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = [1] * x.ndim
        shape[self.channel_dim] = self.slope.numel()
        return torch.lerp(self.act(x), x, self.slope.to(x.dtype).view(shape))

    def extra_repr(self) -> str:
        return f"channels={self.slope.numel()}, channel_dim={self.channel_dim}"


class LinearWithPassthrough(nn.Linear):
    """``cat([x W^T + b, x], -1)``: the first layer of a split FFN (``[..., d] -> [..., n + d]``).

    The ``d`` passed-through features feed the folded ``d x d`` linear path, which sits in the
    columns ``n:`` of the next layer's weight.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().forward(x), x], dim=-1)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", passthrough=True"

class ConvWithPassthrough(nn.Conv2d):
    """``cat([conv(x), x], 1)``: the first layer of a split FFN made of 1x1 convs
    (``[N, d, H, W] -> [N, n + d, H, W]``), :class:`LinearWithPassthrough` with channels in dim 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().forward(x), x], dim=1)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", passthrough=True"


class _Residual(nn.Module):
    """``body(x) + shortcut(x)`` (identity shortcut when ``shortcut`` is ``None``)."""

    def __init__(self, body: nn.Module, shortcut: nn.Module | None) -> None:
        super().__init__()
        self.body = body
        self.shortcut = shortcut if shortcut is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.shortcut(x)


def units_of(m: nn.Module) -> list[LinearizableActivation]:
    """Units behind an activation attribute, one per call (a reused unit appears once per call)."""
    if isinstance(m, LinearizableActivation):
        return [m]
    if isinstance(m, CallSites) and all(isinstance(u, LinearizableActivation) for u in m.calls):
        return list(m.calls)
    return []


def linear_unit(u: nn.Module, tol: float) -> bool:
    return isinstance(u, LinearizableActivation) and bool(u.linear_mask(tol).all())


def snapped_slopes(unit: LinearizableActivation, tol: float) -> torch.Tensor:
    """Slopes with the linear channels (:meth:`~LinearizableActivation.linear_mask`) at 1, then ``a <= tol`` at 0."""
    a = unit.slope.detach().clone()
    a[unit.linear_mask(tol)] = 1.0
    a[a <= tol] = 0.0
    return a


def act_module(unit: LinearizableActivation) -> nn.Module:
    if unit.is_prelu:
        return nn.LeakyReLU(unit.leak) if unit.leak else nn.ReLU()
    if "act" in unit._modules:
        return copy.deepcopy(unit.act)
    return FunctionalActivation(unit.act_fn, unit.kind)


def plain_from_slopes(unit: LinearizableActivation, a: torch.Tensor) -> nn.Module:
    """Plain module computing the blend of ``unit``'s activation with slopes ``a`` (``[C']``)."""
    if bool((a >= 1).all()):
        return nn.Identity()
    if bool((a <= 0).all()):
        return act_module(unit)
    if unit.is_prelu:
        w = a + (1 - a) * unit.leak if unit.leak else a
        return ChannelPReLU(w.to(unit.slope.dtype), unit.channel_dim)
    return ChannelBlend(act_module(unit), a.to(unit.slope.dtype), unit.channel_dim)


def plain_unit(unit: LinearizableActivation, tol: float) -> nn.Module:
    """The plain module equivalent to ``unit`` (linear channels snapped to 1, small ones to 0)."""
    return plain_from_slopes(unit, snapped_slopes(unit, tol))
