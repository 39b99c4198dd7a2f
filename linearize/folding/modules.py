"""The plain modules a folded model is made of (besides ``torch.nn`` layers and the border-exact
convs of :mod:`.conv`): the first layer of a split FFN (:class:`LinearWithPassthrough`,
:class:`ConvWithPassthrough`) and ``Residual``; a unit becomes ``nn.ReLU``-style activations (slopes
all 0), :class:`~linearize.unit.ChannelPReLU` (mixed ReLU family) or :class:`~linearize.unit.ChannelBlend`
(mixed smooth units) by :func:`plain_unit` (``LinearizableActivation.plain_activation``)."""

from __future__ import annotations

import torch
from torch import nn

from ..injection import CallSites
from ..unit import ChannelBlend, ChannelPReLU, LinearizableActivation

__all__ = ["ChannelPReLU", "ChannelBlend", "LinearWithPassthrough", "ConvWithPassthrough", "Residual", "plain_unit"]


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


class Residual(nn.Module):
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
    """Whether ``u`` is a unit computing the identity: every channel linear, with the identity linear end."""
    return isinstance(u, LinearizableActivation) and bool(u.linear_mask(tol).all()) and bool(u.identity_end_mask().all())


def linear_end(unit: LinearizableActivation, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(alpha, beta)`` of ``unit``'s linear end in ``like``'s dtype and device (ones and zeros for the identity)."""
    end = unit.linear_end
    if end is None:
        return like.new_ones(unit.num_channels), like.new_zeros(unit.num_channels)
    return tuple(t.detach().to(like.device, like.dtype) for t in end)


def snapped_slopes(unit: LinearizableActivation, tol: float) -> torch.Tensor:
    """Slopes with the linear channels (:meth:`~LinearizableActivation.linear_mask`) at 1, then ``a <= tol`` at 0."""
    a = unit.slope.detach().clone()
    a[unit.linear_mask(tol)] = 1.0
    a[a <= tol] = 0.0
    return a


def plain_unit(unit: LinearizableActivation, tol: float) -> nn.Module:
    """The plain module equivalent to ``unit`` (linear channels snapped to 1, small ones to 0; see
    :meth:`~linearize.unit.LinearizableActivation.plain_activation`)."""
    return unit.plain_activation(snapped_slopes(unit, tol))
