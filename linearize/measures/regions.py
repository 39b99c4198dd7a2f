"""Linear regions and absolute deviation along input segments (seed 001, Gamba et al.).

A network built from affine layers (Linear, Conv (any stride / padding / groups), BatchNorm in
eval, average pooling, flatten, residual adds) and piecewise-linear units (ReLU, LeakyReLU,
PReLU, prelu-kind :class:`~linearize.LinearizableActivation`) is affine on each cell of a
partition of its input space. Along a segment ``x(t) = x0 + t (x1 - x0)``, ``t`` in ``[0, 1]``,
the cells cut ``[0, 1]`` into intervals (regions) on which ``f(x(t))`` is affine in ``t``.

:func:`linear_regions` finds every boundary exactly with the adaptive algorithm of seed 001:
forward the point ``x(t)`` and the direction ``x1 - x0`` together (forward-mode AD, float64),
so every pre-activation on the current region is ``p + tau * d``; a unit with kink at 0 is
crossed at ``tau = -p / d``; the smallest positive such step over all units is the next
breakpoint (until it, every affine map upstream of every unit is unchanged). Move there and
repeat until ``t >= 1``. Steps ``|tau| <= eps`` (in units of ``t``) count as "on the boundary":
such a unit takes the side the segment is heading to, so regions shorter than ``eps`` of the
segment are merged with the next one. Many segments are processed in one batch, each at its own
``t``; finished segments are replaced by new ones from the queue.

The walk along one segment is sequential (one forward per region), so a single segment with many
regions does not fill a batch. ``pieces=P`` cuts every segment into ``P`` equal sub-segments
``[j / P, (j + 1) / P]`` that are walked in parallel in the same batches (still in the segment's
own ``t`` and direction), then stitched: at a piece boundary ``b`` the last region of piece ``j - 1``
and the first region of piece ``j`` are one region unless the activation pattern of the kinked
units differs between them (patterns taken as above: a unit within ``eps`` of its kink takes the
side the segment is heading to). A real boundary is put at the crossing the left piece sees next
when that lies within ``eps`` after ``b`` (else at ``b``). The stitched result is the unsplit one:
the same breakpoints, counts, affine maps and deviation (chord of the whole segment); only
breakpoints closer than ``eps`` to a piece boundary may be resolved differently, as with the
``eps`` merging itself.

A unit's negative-side slope ``w`` (0 for ReLU, ``negative_slope`` for LeakyReLU, the weight of
PReLU, ``a + (1 - a) * leak`` for a unit) makes its channel linear when ``w == 1``: such a
channel has no breakpoint and does not enter the activation pattern.

Anything else that depends on the input nonlinearly is refused with an error naming the module
that called it: max pooling, smooth activations (GELU, tanh, a smooth-kind unit...), norms with
input statistics, products and quotients of two input-dependent tensors.

:func:`absolute_deviation` integrates ``|f(x(t)) - g(t)|`` exactly, region by region, where
``g`` interpolates ``f(x0)`` and ``f(x1)`` linearly; a region on which ``f - g`` changes sign is
split at the root. Convention: the integral is the line integral along the segment, i.e. over
arc length ``||x1 - x0||_2 * dt`` (``arc_length=True``, the default), which for a
one-dimensional input is the integral over ``x``: ``f(x) = relu(x) - 2 relu(x - 1) + relu(x - 2)``
on ``-1 -> 3`` gives ``0 + .5 + .5 + 0 = 1.0`` (3 breakpoints) and on ``-0.5 -> 1.5`` gives
``0.4583``. ``arc_length=False`` integrates over ``t`` instead (those become ``0.25``, ``0.2292``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from tqdm.auto import tqdm

__all__ = [
    "RegionsResult",
    "linear_regions",
    "absolute_deviation",
    "activation_patterns",
    "translation_loops",
]

# Functions (by __name__) handled as piecewise-linear units with a kink at 0.
_UNITS = {"relu", "relu_", "leaky_relu", "leaky_relu_", "prelu"}
# Nonlinear in any input-dependent argument.
_REFUSED = {
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices", "max_pool2d_with_indices",
    "max_pool3d_with_indices", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "adaptive_max_pool1d_with_indices", "adaptive_max_pool2d_with_indices",
    "adaptive_max_pool3d_with_indices", "fractional_max_pool2d", "fractional_max_pool3d",
    "lp_pool1d", "lp_pool2d", "max_unpool2d",
    "gelu", "tanh", "tanh_", "sigmoid", "sigmoid_", "silu", "elu", "elu_", "selu", "celu", "mish",
    "softplus", "softsign", "softmax", "log_softmax", "softmin", "logsigmoid", "hardswish",
    "hardsigmoid", "hardtanh", "hardtanh_", "relu6", "rrelu", "glu", "tanhshrink", "softshrink",
    "hardshrink", "threshold", "threshold_", "exp", "log", "sqrt", "rsqrt", "pow", "__pow__",
    "reciprocal", "erf", "sin", "cos", "abs", "sign", "clamp", "clamp_", "clip", "max", "min",
    "amax", "amin", "maximum", "minimum", "sort", "topk", "where", "layer_norm", "group_norm",
    "instance_norm", "rms_norm", "local_response_norm", "normalize", "var", "std",
}
# Bilinear: refused when two or more arguments depend on the input.
_PRODUCTS = {
    "mul", "mul_", "__mul__", "__rmul__", "__imul__", "matmul", "__matmul__", "__rmatmul__", "mm",
    "bmm", "einsum", "bilinear", "addcmul", "addcmul_", "baddbmm", "addmm", "addbmm", "outer",
    "dot", "tensordot", "scaled_dot_product_attention",
}
# Refused when the divisor depends on the input.
_DIVISIONS = {"div", "div_", "true_divide", "__truediv__", "__itruediv__", "floor_divide", "__floordiv__"}


def _tangent(x: Any) -> torch.Tensor | None:
    return fwAD.unpack_dual(x).tangent if isinstance(x, torch.Tensor) else None


def _flat_args(args: Sequence[Any], kwargs: dict) -> list[Any]:
    out = []
    for a in list(args) + list(kwargs.values()):
        out.extend(a if isinstance(a, (list, tuple)) else [a])
    return out


class _Tracer(TorchFunctionMode):
    """Runs a float64 copy of the model on dual tensors ``(x(t), x1 - x0)``.

    Every piecewise-linear unit applies the activation pattern of the region ahead, records
    the smallest step ``tau > eps`` to its nearest kink per segment (``self.step``, ``[S]``)
    and optionally its pattern. Other nonlinear calls raise ``ValueError`` naming the module.
    """

    def __init__(self, net: nn.Module, eps: float) -> None:
        super().__init__()
        self.net, self.eps = net, eps
        self.stack: list[tuple[str, nn.Module]] = []
        self.step: torch.Tensor | None = None
        self.patterns: list[torch.Tensor] | None = None
        self.output_shape: tuple[int, ...] = ()

    # -- module-name bookkeeping for error messages
    def _hooks(self) -> list:
        def enter(name: str, mod: nn.Module) -> None:
            self.stack.append((name, mod))

        def leave(*_: Any) -> None:
            self.stack.pop()

        handles = []
        for name, mod in self.net.named_modules():
            handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: enter(n, m)))
            handles.append(mod.register_forward_hook(leave, always_call=True))
        return handles

    def _refuse(self, what: str) -> None:
        name, mod = self.stack[-1] if self.stack else ("<top level>", self.net)
        where = f"module '{name or '<root>'}' ({type(mod).__name__})"
        if self.stack and len(self.stack) > 1 and self.stack[-2][0]:
            parent = self.stack[-2]
            where += f" inside '{parent[0]}' ({type(parent[1]).__name__})"
        raise ValueError(
            f"linear_regions needs a piecewise-linear network, but {what} is called in {where}. "
            "Supported: Linear, Conv, BatchNorm (eval), average pooling, flatten, adds, and "
            "ReLU / LeakyReLU / PReLU / prelu-kind LinearizableActivation units. Replace max "
            "pooling by average pooling and smooth activations by ReLU-like ones."
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _UNITS:
            return self._unit(name, args, kwargs)
        if name in _REFUSED or name in _PRODUCTS or name in _DIVISIONS or name == "batch_norm":
            self._check(name, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, name: str, args: Sequence[Any], kwargs: dict) -> None:
        if name == "batch_norm":
            if kwargs.get("training", args[5] if len(args) > 5 else False):
                self._refuse("batch_norm with batch statistics (training mode)")
            return
        dual = [_tangent(a) is not None for a in _flat_args(args, kwargs)]
        if name in _REFUSED and any(dual):
            self._refuse(name)
        if name in _PRODUCTS and sum(dual) >= 2:
            self._refuse(f"{name} of two input-dependent tensors")
        if name in _DIVISIONS:
            divisor = args[0] if name.startswith("__r") else (args[1] if len(args) > 1 else None)
            if _tangent(divisor) is not None:
                self._refuse(f"{name} by an input-dependent tensor")

    def _unit(self, name: str, args: Sequence[Any], kwargs: dict) -> torch.Tensor:
        x = args[0]
        if name == "prelu":
            w = args[1] if len(args) > 1 else kwargs["weight"]
        elif name.startswith("leaky_relu"):
            w = args[1] if len(args) > 1 else kwargs.get("negative_slope", 0.01)
        else:
            w = 0.0
        inplace = name.endswith("_") or bool(kwargs.get("inplace", False)) or (
            name == "leaky_relu" and len(args) > 2 and bool(args[2])
        )
        p, d = fwAD.unpack_dual(x)
        w = torch.as_tensor(w, dtype=p.dtype, device=p.device).detach()
        if w.numel() > 1:  # per-channel weight along dim 1 (dim 0 for a 1-d input)
            shape = [1] * p.ndim
            shape[1 if p.ndim >= 2 else 0] = w.numel()
            w = w.view(shape)
        kinked = w != 1
        if d is None:  # does not depend on the input: no breakpoint
            ahead = p > 0
        else:
            tau = -p / d  # +-inf where d == 0, nan where p == d == 0
            on_kink = tau.abs() <= self.eps
            ahead = torch.where(on_kink, d > 0, p > 0)
            cross = kinked & ~on_kink & (tau > 0) & torch.isfinite(tau)
            cand = torch.where(cross, tau, torch.full_like(tau, math.inf))
            self.step = torch.minimum(self.step, cand.reshape(self.step.shape[0], -1).amin(1))
        if self.patterns is not None:
            self.patterns.append((ahead & kinked).expand(p.shape).reshape(self.step.shape[0], -1))
        m = torch.where(ahead, torch.ones_like(w), w)
        if d is None:
            return x.mul_(m) if inplace else x * m
        out = fwAD.make_dual(p * m, d * m)  # cheaper than a dual multiply
        return x.copy_(out) if inplace else out

    def run(self, x: torch.Tensor, direction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Output value ``[B, K]``, derivative w.r.t. ``t`` ``[B, K]`` and next step ``[B]``."""
        self.step = torch.full((x.shape[0],), math.inf, dtype=x.dtype, device=x.device)
        self.stack.clear()
        handles = self._hooks()
        try:
            with fwAD.dual_level(), self:
                y = self.net(fwAD.make_dual(x, direction))
                value, grad = fwAD.unpack_dual(_output_tensor(y))
                self.output_shape = tuple(value.shape[1:])
        finally:
            for h in handles:
                h.remove()
        if grad is None:
            grad = torch.zeros_like(value)
        return value.reshape(x.shape[0], -1), grad.reshape(x.shape[0], -1), self.step


def _same_pattern(
    tracer: _Tracer, x0: torch.Tensor, direction: torch.Tensor, t_left: torch.Tensor, t_right: torch.Tensor
) -> torch.Tensor:
    """``[B]`` bool: whether the kinked units have the same activation pattern at ``x0 + t_left
    direction`` and ``x0 + t_right direction`` (both heading along ``direction``), ``x0`` ``[B, ...]``."""
    view = (-1,) + (1,) * (x0.ndim - 1)
    t = torch.cat([t_left, t_right]).view(view)
    tracer.patterns = []
    try:
        tracer.run(torch.cat([x0, x0]) + t * torch.cat([direction, direction]), torch.cat([direction, direction]))
        pattern = torch.cat(tracer.patterns + [torch.zeros(len(t), 0, dtype=torch.bool, device=x0.device)], 1)
    finally:
        tracer.patterns = None
    return (pattern[: len(x0)] == pattern[len(x0):]).all(1)


def _output_tensor(y: Any) -> torch.Tensor:
    if isinstance(y, torch.Tensor):
        return y
    if hasattr(y, "logits"):  # HF-style outputs
        return y.logits
    raise TypeError(f"linear_regions needs a model returning a tensor, got {type(y).__name__}")


def _float64_copy(model: nn.Module) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    return copy.deepcopy(model).to(torch.float64).eval()


def _check_segments(x0: torch.Tensor, x1: torch.Tensor) -> None:
    if not isinstance(x0, torch.Tensor) or not isinstance(x1, torch.Tensor):
        raise TypeError("x0 and x1 must be tensors of shape [S, ...] (one row per segment)")
    if x0.shape != x1.shape or x0.ndim < 2 or x0.shape[0] < 1:
        raise ValueError(
            f"x0 and x1 must have the same shape [S, ...] with S >= 1 segments, got "
            f"{tuple(x0.shape)} and {tuple(x1.shape)} (add a batch dimension for one segment)"
        )
    if not (torch.isfinite(x0).all() and torch.isfinite(x1).all()):
        raise ValueError("x0 and x1 contain NaN or inf")


@dataclass
class RegionsResult:
    """Linear regions of ``f`` along ``S`` segments, stored flat (one row per region).

    Attributes:
        count: ``[S]`` int64, regions per segment (breakpoints + 1).
        segment: ``[N]`` int64, the segment of each region (sorted, ``N = count.sum()``).
        start: ``[N]`` float64, region start ``t_k`` (0 for a segment's first region).
        value: ``[N, K]`` float64, ``f(x(t_k))``, outputs flattened to ``K``.
        slope: ``[N, K]`` float64, ``df/dt`` on the region: ``f(x(t)) = value + (t - t_k) * slope``.
        end_value: ``[S, K]`` float64, ``f(x1)``.
        length: ``[S]`` float64, ``||x1 - x0||_2``.
        output_shape: shape of one output of the model.
    """

    count: torch.Tensor
    segment: torch.Tensor
    start: torch.Tensor
    value: torch.Tensor
    slope: torch.Tensor
    end_value: torch.Tensor
    length: torch.Tensor
    output_shape: tuple[int, ...]

    @property
    def end(self) -> torch.Tensor:
        """``[N]`` float64, region end ``t`` (the next region's start, 1 for the last)."""
        end = torch.ones_like(self.start)
        same = self.segment[1:] == self.segment[:-1]
        end[:-1] = torch.where(same, self.start[1:], end[:-1])
        return end

    @property
    def breakpoints(self) -> list[torch.Tensor]:
        """Per segment, the sorted breakpoints ``t`` in ``(0, 1)`` (``count - 1`` of them)."""
        return [s[1:] for s in self.start.split(self.count.tolist())]

    def regions(self, s: int) -> dict[str, torch.Tensor]:
        """Segment ``s``'s regions: ``{"start", "end", "value", "slope"}`` (``[R]``, ``[R, K]``)."""
        rows = self.segment == s
        return {"start": self.start[rows], "end": self.end[rows], "value": self.value[rows], "slope": self.slope[rows]}

    def deviation(self, per_region: bool = False, arc_length: bool = True) -> torch.Tensor:
        """Exact ``int |f(x(t)) - g(t)|`` with ``g`` the chord from ``f(x0)`` to ``f(x1)``.

        Returns ``[S, K]`` (or ``[N, K]`` per region with ``per_region=True``). With
        ``arc_length`` the measure is ``||x1 - x0|| dt`` (the line integral), else ``dt``.
        """
        first = torch.cumsum(self.count, 0) - self.count  # row of each segment's first region
        f0, f1 = self.value[first][self.segment], self.end_value[self.segment]
        a, b = self.start[:, None], self.end[:, None]
        ha = self.value - (f0 + a * (f1 - f0))
        hb = self.value + (b - a) * self.slope - (f0 + b * (f1 - f0))
        width = b - a
        same_sign = ha * hb >= 0
        denom = torch.where(same_sign, torch.ones_like(ha), ha.abs() + hb.abs())
        area = torch.where(
            same_sign, width * (ha.abs() + hb.abs()) / 2, width * (ha**2 + hb**2) / (2 * denom)
        )
        if arc_length:
            area = area * self.length[self.segment][:, None]
        if per_region:
            return area
        out = torch.zeros_like(self.end_value)
        return out.index_add_(0, self.segment, area)


@torch.no_grad()
def linear_regions(
    model: nn.Module,
    x0: torch.Tensor,
    x1: torch.Tensor,
    eps: float = 1e-6,
    batch_size: int = 256,
    progress: bool = False,
    pieces: int = 1,
) -> RegionsResult:
    """Every linear region of ``model`` along the segments ``x0[s] -> x1[s]``, exactly.

    Args:
        model: a piecewise-linear network (see the module docstring); it is copied to float64
            and run in eval mode, the model itself is left untouched.
        x0, x1: ``[S, ...]`` segment starts and ends (one model input per row).
        eps: steps ``<= eps`` (as a fraction of the segment) count as "on the boundary";
            regions shorter than that are merged with the next one.
        batch_size: (sub-)segments forwarded together.
        progress: show a tqdm bar over (sub-)segments.
        pieces: walk every segment as this many equal sub-segments in parallel and stitch them
            (see the module docstring); the same result, faster for few segments with many
            regions per piece (set ``pieces * S`` near ``batch_size``; measured on one CPU thread
            on a trained ResNet-20 segment: 1.18x faster with 32 pieces, since float64
            convolutions gain little from larger batches there).

    Returns:
        :class:`RegionsResult` with breakpoints, counts and the affine map on every region.

    Raises:
        ValueError: for a model that is not piecewise linear (names the module), bad shapes,
            NaN/inf inputs.
    """
    _check_segments(x0, x1)
    if batch_size < 1 or not 0 <= eps < 1:
        raise ValueError(f"need batch_size >= 1 and 0 <= eps < 1, got {batch_size}, {eps}")
    if not isinstance(pieces, int) or pieces < 1:
        raise ValueError(f"pieces must be an int >= 1, got {pieces!r}")
    net = _float64_copy(model)
    device = next((p.device for p in net.parameters()), x0.device)
    x0 = x0.to(device=device, dtype=torch.float64)
    direction = x1.to(device=device, dtype=torch.float64) - x0
    tracer = _Tracer(net, eps)
    n, n_sub = x0.shape[0], x0.shape[0] * pieces
    # sub-segment q walks segment q // pieces from t = j / pieces to (j + 1) / pieces, j = q % pieces
    j = torch.arange(n_sub, device=device) % pieces
    owner = torch.arange(n_sub, device=device) // pieces
    t = j.to(torch.float64) / pieces
    t_stop = (j + 1).to(torch.float64) / pieces
    last_start, crossing = torch.empty_like(t), torch.empty_like(t)  # of each piece's last region
    queue = iter(range(n_sub))
    active = torch.tensor([q for _, q in zip(range(batch_size), queue)], device=device)
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    end_value = None
    bar = tqdm(total=n_sub, desc="linear regions", unit="seg" if pieces == 1 else "piece", disable=not progress)
    view = (-1,) + (1,) * (x0.ndim - 1)
    while active.numel():
        seg = owner[active]
        value, grad, step = tracer.run(x0[seg] + t[active].view(view) * direction[seg], direction[seg])
        if end_value is None:
            end_value = value.new_empty((n, value.shape[1]))
        rows.append((active, t[active], value, grad))
        t_next = t[active] + step
        done = t_next >= t_stop[active]
        last_start[active[done]], crossing[active[done]] = t[active[done]], t_next[done]
        ends = (done & (j[active] == pieces - 1)).nonzero().squeeze(1)
        end_value[seg[ends]] = value[ends] + (1 - t[active[ends]])[:, None] * grad[ends]
        t[active[~done]] = t_next[~done]
        refill = [q for _, q in zip(range(int(done.sum())), queue)]
        active = torch.cat([active[~done], torch.tensor(refill, dtype=active.dtype, device=device)])
        bar.update(int(done.sum()))
    bar.close()
    sub, start, value, grad = (torch.cat(c) for c in zip(*rows))
    order = torch.sort(sub, stable=True).indices  # rows of a sub-segment come in increasing t
    sub, start, value, grad = sub[order], start[order], value[order], grad[order]
    if pieces > 1:  # stitch each piece q with j > 0 to its left neighbour q - 1
        right = (j > 0).nonzero().squeeze(1)
        first = torch.cumsum(torch.bincount(sub, minlength=n_sub), 0)[right - 1]  # row of q's first region
        half = max(1, batch_size // 2)  # boundaries per forward (a left and a right point each)
        same = torch.cat([_same_pattern(tracer, x0[owner[q]], direction[owner[q]], last_start[q - 1], start[f])
                          for q, f in zip(right.split(half), first.split(half))])
        # a real boundary moves to the crossing that ended the left piece when that is within eps
        gap = crossing[right - 1] - start[first]
        near = ~same & (gap <= eps)
        move, shift = first[near], gap[near]
        value[move] += shift[:, None] * grad[move]
        start[move] += shift
        keep = torch.ones_like(sub, dtype=torch.bool)
        keep[first[same]] = False
        sub, start, value, grad = sub[keep], start[keep], value[keep], grad[keep]
    segment = sub // pieces
    return RegionsResult(
        count=torch.bincount(segment, minlength=n),
        segment=segment,
        start=start,
        value=value,
        slope=grad,
        end_value=end_value,
        length=direction.flatten(1).norm(dim=1),
        output_shape=tracer.output_shape,
    )


def absolute_deviation(
    model: nn.Module,
    x0: torch.Tensor,
    x1: torch.Tensor,
    eps: float = 1e-6,
    batch_size: int = 256,
    arc_length: bool = True,
    progress: bool = False,
    pieces: int = 1,
) -> torch.Tensor:
    """Exact absolute deviation ``[S, K]`` of ``model`` from its chord along each segment.

    ``int_0^1 |f(x(t)) - ((1 - t) f(x0) + t f(x1))| * ||x1 - x0|| dt`` per output (flattened to
    ``K``); ``arc_length=False`` drops the ``||x1 - x0||`` factor. Regions on which the
    difference changes sign are split at the root, and every region (the last included)
    counts. Arguments as in :func:`linear_regions`.
    """
    result = linear_regions(model, x0, x1, eps=eps, batch_size=batch_size, progress=progress, pieces=pieces)
    return result.deviation(arc_length=arc_length)


@torch.no_grad()
def activation_patterns(model: nn.Module, x: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
    """Bool ``[N, U]``: which kinked units are on the positive side at each input row ``x[n]``.

    Same float64 evaluation and unit handling as :func:`linear_regions` (linear channels,
    ``w == 1``, are always False); used for dense-sampling baselines.
    """
    net = _float64_copy(model)
    device = next((p.device for p in net.parameters()), x.device)
    tracer = _Tracer(net, 0.0)
    out = []
    for chunk in x.to(device=device, dtype=torch.float64).split(batch_size):
        tracer.patterns = []
        tracer.run(chunk, torch.zeros_like(chunk))
        out.append(torch.cat(tracer.patterns, 1))
    return torch.cat(out)


def translation_loops(
    images: torch.Tensor, n_anchors: int = 8, radius: float = 4.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed translation loops of seed 001 as segment batches ``(x0, x1)``.

    Anchor ``k`` of image ``n`` is the image translated by ``radius * (cos, sin)(2 pi k /
    n_anchors)`` pixels (x to the right, y down): reflect-padded, shifted with bilinear
    interpolation (exact for integer shifts), cropped back, so no black borders enter the
    loop. Segment ``n * n_anchors + k`` runs from anchor ``k`` to anchor ``k + 1`` (mod
    ``n_anchors``), closing the loop.

    Args:
        images: ``[N, C, H, W]`` float images.
    Returns:
        ``x0, x1``: ``[N * n_anchors, C, H, W]`` each.
    """
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or not images.is_floating_point():
        raise ValueError(f"images must be a float tensor [N, C, H, W], got {getattr(images, 'shape', type(images))}")
    if n_anchors < 2 or radius <= 0:
        raise ValueError(f"need n_anchors >= 2 and radius > 0, got {n_anchors}, {radius}")
    n, c, h, w = images.shape
    pad = math.ceil(radius) + 1
    if pad >= min(h, w):
        raise ValueError(f"radius {radius} is too large for {h}x{w} images (reflect padding)")
    padded = F.pad(images, (pad, pad, pad, pad), mode="reflect")
    angles = torch.arange(n_anchors, dtype=torch.float64) * (2 * math.pi / n_anchors)
    shifts = torch.stack([radius * angles.cos(), radius * angles.sin()], 1)  # [A, (dx, dy)]
    rows = torch.arange(h, dtype=torch.float64)
    cols = torch.arange(w, dtype=torch.float64)
    anchors = []
    for dx, dy in shifts.tolist():
        # output pixel (i, j) reads padded pixel (i + pad - dy, j + pad - dx)
        gy = (rows + pad - dy) * (2 / (h + 2 * pad - 1)) - 1
        gx = (cols + pad - dx) * (2 / (w + 2 * pad - 1)) - 1
        grid = torch.stack(torch.meshgrid(gx, gy, indexing="xy"), -1)  # [H, W, (x, y)]
        grid = grid.to(images.dtype).expand(n, h, w, 2)
        anchors.append(F.grid_sample(padded, grid, mode="bilinear", align_corners=True))
    stacked = torch.stack(anchors, 1)  # [N, A, C, H, W]
    x0 = stacked.reshape(n * n_anchors, c, h, w)
    x1 = stacked.roll(-1, dims=1).reshape(n * n_anchors, c, h, w)
    return x0, x1
