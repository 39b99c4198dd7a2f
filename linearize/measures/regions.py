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

Each region costs one forward, and a segment through an untrained CIFAR ResNet-20 holds thousands
to tens of thousands of them, so the walk has a budget: ``max_regions`` per segment (default
100,000) and ``max_seconds`` for the call (default none). A segment stopped by it keeps exactly the
first regions of the complete result and is marked: ``RegionsResult.covered[s] < 1`` (the fraction
of the segment walked), ``complete`` False, ``stopped`` naming the budget, and a
:class:`PartialResultWarning`.

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
channel has no breakpoint and does not enter the activation pattern. So does a unit's channel at
slope ``a = 1`` with an affine linear end (``alpha * x + beta``, :meth:`set_linear_end`), whose
activation runs but does not reach the output; channels at ``a < 1`` keep the kink.

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
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from tqdm.auto import tqdm

from ..activations import FUNCTIONAL_SPECS, activation_module, call_arg, in_place, negative_slope
from ..checks import check_positive, check_positive_int
from ..inputs import output_tensors
from ..module_stack import ModuleStack
from ..unit import LinearizableActivation

__all__ = [
    "PartialResultWarning",
    "RegionsResult",
    "linear_regions",
    "absolute_deviation",
    "activation_patterns",
    "translation_loops",
]

# Functions (by __name__) handled as piecewise-linear units with a kink at 0.
_UNITS = {"relu", "relu_", "leaky_relu", "leaky_relu_", "prelu"}
# Linear (or affine) in each input-dependent argument, by __name__: layers, pooling by averages, sums,
# layout, indexing and copies. Any other call on an input-dependent tensor is refused, so that a nonlinear
# op nobody listed (x.square(), 1 / x, x > 0, x.item()) can never pass as linear.
_LINEAR = {
    "linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "pad", "interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "pixel_shuffle", "pixel_unshuffle",
    "channel_shuffle", "native_channel_shuffle", "fold", "unfold",
    "add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "subtract", "__sub__", "__rsub__", "__isub__",
    "rsub", "neg", "neg_", "negative", "__neg__", "positive", "__pos__", "sum", "nansum", "mean", "cumsum", "trace",
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "ravel", "permute", "transpose",
    "transpose_", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "squeeze", "squeeze_", "unsqueeze",
    "unsqueeze_", "expand", "expand_as", "broadcast_to", "repeat", "repeat_interleave", "tile", "contiguous",
    "clone", "detach", "to", "type", "type_as", "float", "double", "cpu", "cat", "concat", "concatenate", "stack",
    "hstack", "vstack", "dstack", "split", "split_with_sizes", "chunk", "tensor_split", "unbind", "narrow",
    "select", "index_select", "gather", "take_along_dim", "__getitem__", "__setitem__", "roll", "flip", "fliplr",
    "flipud", "rot90", "diagonal", "diag", "diag_embed", "tril", "triu", "masked_fill", "masked_fill_", "fill_",
    "zero_", "copy_", "scatter", "scatter_", "scatter_add", "scatter_add_", "index_add", "index_add_",
    "index_copy", "index_copy_", "index_put", "index_put_", "as_strided", "requires_grad_", "zeros_like",
    "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor",
    "__get__", "__len__", "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
    "is_contiguous", "is_floating_point", "is_complex", "element_size", "data_ptr", "__iter__", "__format__",
    "__repr__", "__hash__", "_unpack_dual", "_make_dual", "where", "constant_pad_nd", "sum_to_size", "diff",
    "masked_scatter", "masked_scatter_", "get_device", "bfloat16", "half",
}
# Make tensors of constants shaped like their input-dependent argument (no tangent, and rightly so).
_CONSTANT_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
                  "new_full", "_unpack_dual", "_make_dual"}
# Bilinear: refused when two or more arguments depend on the input.
_PRODUCTS = {
    "mul", "mul_", "__mul__", "__rmul__", "__imul__", "matmul", "__matmul__", "__rmatmul__", "mm",
    "bmm", "einsum", "bilinear", "baddbmm", "addmm", "addbmm", "outer",
    "dot", "tensordot", "scaled_dot_product_attention",
}
# Refused when the divisor depends on the input.
_DIVISIONS = {"div", "div_", "divide", "true_divide", "__truediv__", "__itruediv__", "__rtruediv__", "__rdiv__"}


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
        self.running = ModuleStack(net)  # for error messages
        self.step: torch.Tensor | None = None
        self.patterns: list[torch.Tensor] | None = None
        self.output_shape: tuple[int, ...] = ()

    def _refuse(self, what: str) -> None:
        stack, names = self.running.stack, self.running.names
        mod = stack[-1] if stack else self.net
        where = f"module '{(names[id(mod)] or '<root>') if stack else '<top level>'}' ({type(mod).__name__})"
        if len(stack) > 1 and names[id(stack[-2])]:
            where += f" inside '{names[id(stack[-2])]}' ({type(stack[-2]).__name__})"
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
            return self._unit(func, name, args, kwargs)
        if name not in _LINEAR:
            self._check(name or repr(func), args, kwargs)
        dual = any(_tangent(a) is not None for a in _flat_args(args, kwargs))
        try:
            out = func(*args, **kwargs)
        except NotImplementedError as err:  # no forward-mode derivative: not an op this tracer can follow
            if not dual:
                raise
            self._refuse(f"{name} (no forward-mode derivative: {str(err).splitlines()[0]})")
        if dual and name not in _CONSTANT_LIKE:
            for t in output_tensors(out):
                if not t.is_floating_point():
                    self._refuse(f"{name}, which turns input-dependent values into {t.dtype} values,")
                if _tangent(t) is None:
                    self._refuse(f"{name}, which cuts the output's dependence on the input (detach, .data, a copy),")
        return out

    def _check(self, name: str, args: Sequence[Any], kwargs: dict) -> None:
        if name == "batch_norm":
            if kwargs.get("training", args[5] if len(args) > 5 else False):
                self._refuse("batch_norm with batch statistics (training mode)")
            return
        dual = [_tangent(a) is not None for a in _flat_args(args, kwargs)]
        if name in ("addcmul", "addcmul_"):  # input + value * tensor1 * tensor2: a product of the last two
            factors = [kwargs.get(k, args[i] if len(args) > i else None) for i, k in ((1, "tensor1"), (2, "tensor2"))]
            if all(_tangent(f) is not None for f in factors):
                self._refuse(f"{name} of two input-dependent tensors")
        elif name in _PRODUCTS:
            if sum(dual) >= 2:
                self._refuse(f"{name} of two input-dependent tensors")
        elif name in _DIVISIONS:
            divisor = args[0] if name.startswith("__r") else (args[1] if len(args) > 1 else kwargs.get("other"))
            if _tangent(divisor) is not None:
                self._refuse(f"{name} by an input-dependent tensor")
            if kwargs.get("rounding_mode") is not None and any(dual):
                self._refuse(f"{name} with rounding_mode={kwargs['rounding_mode']!r} (piecewise constant)")
        elif name in ("lerp", "lerp_"):  # linear in start and end, a product in the weight
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            if _tangent(weight) is not None and sum(dual) >= 2:
                self._refuse(f"{name} with an input-dependent weight")
        elif any(dual):
            self._refuse(f"{name}, which is not known to be linear,")

    def _unit(self, func: Any, name: str, args: Sequence[Any], kwargs: dict) -> torch.Tensor:
        x = args[0]
        if name == "prelu":
            w, inplace = call_arg(args, kwargs, 1, "weight", None), False
        elif func in FUNCTIONAL_SPECS:  # relu, leaky_relu (and their in-place forms)
            w, inplace = negative_slope(activation_module(func, args, kwargs)), in_place(func, args, kwargs)
        else:
            self._refuse(f"{name} called as {func!r} (call it through torch or torch.nn.functional)")
        p, d = fwAD.unpack_dual(x)
        w = torch.as_tensor(w, dtype=p.dtype, device=p.device).detach()
        if w.numel() > 1:  # per-channel weight along dim 1 (dim 0 for a 1-d input)
            shape = [1] * p.ndim
            shape[1 if p.ndim >= 2 else 0] = w.numel()
            w = w.view(shape)
        kinked = w != 1
        if name != "prelu":  # a unit's activation (a unit's PReLU has w = 1 at a = 1 already)
            linear = self._linear_in_unit(p)
            if linear is not None:
                kinked = kinked & ~linear
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

    def _linear_in_unit(self, p: torch.Tensor) -> torch.Tensor | None:
        """Bool mask broadcast to ``p``, the input of an activation a unit blends (``(1 - a) * act(x) + a * end``,
        an affine end ``alpha * x + beta`` included): the unit's channels at slope ``a = 1``, whose output is the
        linear end alone, without the activation's kink. ``None`` for an activation outside a unit."""
        unit = next((m for m in reversed(self.running.stack) if isinstance(m, LinearizableActivation)), None)
        if unit is None:
            return None
        # the act sees the unit's input as it comes (a ReLU-family element unit's: its [N, P] view)
        return (unit.slope.detach() == 1).view(unit.broadcast_shape(p.ndim))

    def run(self, x: torch.Tensor, direction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Output value ``[B, K]``, derivative w.r.t. ``t`` ``[B, K]`` and next step ``[B]``."""
        self.step = torch.full((x.shape[0],), math.inf, dtype=x.dtype, device=x.device)
        grad_mode = torch.is_grad_enabled()
        # inference_mode turns forward AD off without a word (no tangents: 1 region); leave it here
        # (grad mode as it was), with the caller's inference tensors copied into normal ones
        with self.running, torch.inference_mode(False), torch.set_grad_enabled(grad_mode), fwAD.dual_level(), self:
            x, direction = (t.clone() if t.is_inference() else t for t in (x, direction))
            y = self.net(fwAD.make_dual(x, direction))
            value, grad = fwAD.unpack_dual(_output_tensor(y))
            self.output_shape = tuple(value.shape[1:])
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


class PartialResultWarning(UserWarning):
    """:func:`linear_regions` stopped at its budget (``max_regions`` / ``max_seconds``) before the end
    of some segment: the result is partial (``result.complete`` is False)."""


@dataclass
class RegionsResult:
    """Linear regions of ``f`` along ``S`` segments, stored flat (one row per region).

    A budget (``max_regions``, ``max_seconds`` of :func:`linear_regions`) can stop the walk of a
    segment before its end: the segment is then covered on ``[0, covered[s]]`` only, and its rows
    are exactly the first regions of the complete result (the last one cut at ``covered[s]``).

    Attributes:
        count: ``[S]`` int64, regions per segment (breakpoints + 1); for a truncated segment the
            regions found on ``[0, covered]``, a lower bound.
        segment: ``[N]`` int64, the segment of each region (sorted, ``N = count.sum()``).
        start: ``[N]`` float64, region start ``t_k`` (0 for a segment's first region).
        value: ``[N, K]`` float64, ``f(x(t_k))``, outputs flattened to ``K``.
        slope: ``[N, K]`` float64, ``df/dt`` on the region: ``f(x(t)) = value + (t - t_k) * slope``.
        end_value: ``[S, K]`` float64, ``f(x1)``.
        length: ``[S]`` float64, ``||x1 - x0||_2``.
        output_shape: shape of one output of the model.
        covered: ``[S]`` float64, the fraction ``t`` of each segment walked: 1 where complete.
        stopped: ``None`` for a complete result, else which budget stopped the walk
            (``"max_regions=..."``, ``"max_seconds=..."``).
    """

    count: torch.Tensor
    segment: torch.Tensor
    start: torch.Tensor
    value: torch.Tensor
    slope: torch.Tensor
    end_value: torch.Tensor
    length: torch.Tensor
    output_shape: tuple[int, ...]
    covered: torch.Tensor | None = None
    stopped: str | None = None

    def __post_init__(self) -> None:
        if self.covered is None:
            self.covered = torch.ones(len(self.count), dtype=torch.float64, device=self.start.device)

    @property
    def complete(self) -> bool:
        """True when every segment was walked to its end (no budget stopped the walk)."""
        return bool((self.covered >= 1).all())

    @property
    def end(self) -> torch.Tensor:
        """``[N]`` float64, region end ``t`` (the next region's start; ``covered``, i.e. 1 when
        complete, for a segment's last region)."""
        end = self.covered[self.segment].clone()
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
        ``arc_length`` the measure is ``||x1 - x0|| dt`` (the line integral), else ``dt``. A
        truncated segment (``covered < 1``) gets the integral over ``[0, covered]``, a lower bound.
        """
        first = torch.cumsum(self.count, 0) - self.count  # row of each segment's first region
        f0, f1 = self.value[first[self.segment]], self.end_value[self.segment]
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
    max_regions: int | None = 100_000,
    max_seconds: float | None = None,
) -> RegionsResult:
    """Every linear region of ``model`` along the segments ``x0[s] -> x1[s]``, exactly.

    Each region costs one forward (float64, forward-mode AD); a segment through a large untrained
    network can hold 10^4 to 10^5 of them. The walk therefore has a budget: a segment stops after
    ``max_regions`` regions, every segment stops once ``max_seconds`` have passed. A stopped
    segment is marked (``result.covered[s] < 1``, ``result.complete`` is False, ``result.stopped``
    names the budget, and a :class:`PartialResultWarning` is issued); its regions are exactly the
    first ones of the complete result, on ``[0, covered[s]]``.

    Args:
        model: a piecewise-linear network (see the module docstring); it is copied to float64
            and run in eval mode, the model itself is left untouched.
        x0, x1: ``[S, ...]`` segment starts and ends (one model input per row).
        eps: steps ``<= eps`` (as a fraction of the segment) count as "on the boundary";
            regions shorter than that are merged with the next one.
        batch_size: (sub-)segments forwarded together.
        progress: show a tqdm bar of the distance covered (in segments, pieces summed) and the
            regions found so far.
        pieces: walk every segment as this many equal sub-segments in parallel and stitch them
            (see the module docstring); the same result, faster for few segments with many
            regions per piece (set ``pieces * S`` near ``batch_size``; measured on one CPU thread
            on a trained ResNet-20 segment: 1.18x faster with 32 pieces, since float64
            convolutions gain little from larger batches there). When a budget stops a segment,
            only its pieces before the first unfinished one (and that one's regions) are kept.
        max_regions: at most this many regions per segment (a segment with that many or fewer
            is always complete); ``None``: no limit (the walk still ends: every step advances ``t``).
        max_seconds: stop every segment once this many seconds of wall-clock time have passed
            since the call: no forward is started that would end later (predicted from the last
            one), so the overshoot is about one forward, plus one plain forward for ``f(x1)`` of
            the stopped segments and, with ``pieces > 1``, the stitching. ``None``: no limit.
            Where it stops a walk, the result depends on the machine.

    Returns:
        :class:`RegionsResult` with breakpoints, counts and the affine map on every region, and
        ``covered`` / ``complete`` / ``stopped`` marking a partial result.

    Raises:
        ValueError: for a model that is not piecewise linear (names the module), bad shapes,
            NaN/inf inputs, a budget out of range (``TypeError``: not a number).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> net = nn.Sequential(nn.Linear(1, 3), nn.ReLU(), nn.Linear(3, 1))  # 3 kinks at most
        >>> x0, x1 = torch.tensor([[-5.0]]), torch.tensor([[5.0]])
        >>> full = linear_regions(net, x0, x1)
        >>> part = linear_regions(net, x0, x1, max_regions=1)  # warns: PartialResultWarning
        >>> full.count.item(), part.complete, part.count.item(), part.covered.item() == full.end[0].item()
        (3, False, 1, True)
    """
    _check_segments(x0, x1)
    if batch_size < 1 or not 0 <= eps < 1:
        raise ValueError(f"need batch_size >= 1 and 0 <= eps < 1, got {batch_size}, {eps}")
    if not isinstance(pieces, int) or pieces < 1:
        raise ValueError(f"pieces must be an int >= 1, got {pieces!r}")
    max_regions = None if max_regions is None else check_positive_int(max_regions, "max_regions")
    max_seconds = None if max_seconds is None else check_positive(max_seconds, "max_seconds")
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
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
    t_begin, t_stop = t.clone(), (j + 1).to(torch.float64) / pieces
    reached = t.clone()  # the regions of sub-segment q are known on [t_begin[q], reached[q]]
    last_start, crossing = torch.empty_like(t), torch.empty_like(t)  # of each piece's last region
    # regions found per segment; a piece's first region may continue its left neighbour's last
    # one and is not counted, so a segment with at most max_regions regions always completes
    found = torch.zeros(n, dtype=torch.int64, device=device)
    queue = iter(range(n_sub))

    def take(k: int) -> list[int]:
        """The next ``k`` queued sub-segments of segments still under ``max_regions``."""
        out: list[int] = []
        capped = [] if max_regions is None else (found >= max_regions).tolist()
        for q in queue if k > 0 else ():
            if not (capped and capped[q // pieces]):
                out.append(q)
                if len(out) == k:
                    break
        return out

    active = torch.tensor(take(batch_size), dtype=torch.int64, device=device)
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    end_value = None
    timed_out = False
    bar = tqdm(total=n, desc="linear regions", unit="seg", disable=not progress,
               bar_format="{l_bar}{bar}| {n:.3g}/{total_fmt} segments [{elapsed}<{remaining}{postfix}]")
    view = (-1,) + (1,) * (x0.ndim - 1)
    tick = time.monotonic()
    while active.numel():
        seg = owner[active]
        value, grad, step = tracer.run(x0[seg] + t[active].view(view) * direction[seg], direction[seg])
        if end_value is None:
            end_value = value.new_empty((n, value.shape[1]))
        rows.append((active, t[active], value, grad))
        new = (j[active] == 0) | (t[active] > t_begin[active])
        # a step below float64 resolution at t (possible for eps < 1e-16) still moves on by one ulp
        t_next = torch.maximum(t[active] + step, torch.nextafter(t[active], t.new_tensor(math.inf)))
        done = t_next >= t_stop[active]
        moved = torch.minimum(t_next, t_stop[active])
        bar.update(float((moved - reached[active]).sum()))
        reached[active] = moved
        last_start[active[done]], crossing[active[done]] = t[active[done]], t_next[done]
        ends = (done & (j[active] == pieces - 1)).nonzero().squeeze(1)
        end_value[seg[ends]] = value[ends] + (1 - t[active[ends]])[:, None] * grad[ends]
        t[active[~done]] = t_next[~done]
        found += torch.bincount(seg[new], minlength=n)
        bar.set_postfix_str(f"{int(found.sum()):,} regions", refresh=False)
        go_on = ~done if max_regions is None else ~done & (found[seg] < max_regions)
        if deadline is not None:
            now = time.monotonic()
            if now + (now - tick) > deadline:  # the next forward, as long as this one, would end past it
                timed_out = True
                break
            tick = now
        refill = take(active.numel() - int(go_on.sum()))
        active = torch.cat([active[go_on], torch.tensor(refill, dtype=active.dtype, device=device)])
    bar.close()
    # each segment keeps its pieces up to the first unfinished one, J (J = pieces: all finished)
    unfinished = (reached < t_stop).view(n, pieces)
    first_open = torch.where(unfinished.any(1), unfinished.to(torch.int64).argmax(1), pieces)
    covered = torch.where(
        first_open < pieces,
        reached.view(n, pieces).gather(1, first_open.clamp(max=pieces - 1)[:, None]).squeeze(1),
        torch.ones_like(reached[:n]),
    )
    sub, start, value, grad = (torch.cat(c) for c in zip(*rows))
    order = torch.sort(sub, stable=True).indices  # rows of a sub-segment come in increasing t
    sub, start, value, grad = sub[order], start[order], value[order], grad[order]
    kept = j[sub] <= first_open[owner[sub]]
    sub, start, value, grad = sub[kept], start[kept], value[kept], grad[kept]
    open_end = unfinished[:, -1].nonzero().squeeze(1)  # f(x1) not reached by the walk: a plain forward
    for chunk in open_end.split(batch_size) if open_end.numel() else ():
        end_value[chunk] = _output_tensor(net(x0[chunk] + direction[chunk])).reshape(len(chunk), -1)
    per_sub = torch.bincount(sub, minlength=n_sub)
    right = ((j > 0) & (per_sub > 0)).nonzero().squeeze(1)
    if right.numel():  # stitch each kept piece q with j > 0 to its left neighbour q - 1 (finished)
        first = (torch.cumsum(per_sub, 0) - per_sub)[right]  # row of q's first region
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
    count = torch.bincount(segment, minlength=n)
    if max_regions is not None and bool((count > max_regions).any()):  # pieces overshot: cut to the first ones
        rank = torch.arange(len(segment), device=device) - (torch.cumsum(count, 0) - count)[segment]
        cut = rank == max_regions
        covered[segment[cut]] = start[cut]
        keep = rank < max_regions
        segment, start, value, grad = segment[keep], start[keep], value[keep], grad[keep]
        count = count.clamp(max=max_regions)
    stopped = None
    if bool((covered < 1).any()):
        capped = max_regions is not None and bool(((found >= max_regions) & (covered < 1)).any())
        stopped = ", ".join(([f"max_seconds={max_seconds:g}"] if timed_out else [])
                            + ([f"max_regions={max_regions}"] if capped else []))
        warnings.warn(PartialResultWarning(
            f"linear_regions stopped at {stopped}: {int((covered < 1).sum())} of {n} segments are incomplete "
            f"(covered {float(covered.mean()):.1%} of the distance on average); the result is partial "
            "(result.complete is False, result.covered per segment). Raise the budget, or pass None for no limit."
        ), stacklevel=3)
    return RegionsResult(
        count=count,
        segment=segment,
        start=start,
        value=value,
        slope=grad,
        end_value=end_value,
        length=direction.flatten(1).norm(dim=1),
        output_shape=tracer.output_shape,
        covered=covered,
        stopped=stopped,
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
    max_regions: int | None = 100_000,
    max_seconds: float | None = None,
) -> torch.Tensor:
    """Exact absolute deviation ``[S, K]`` of ``model`` from its chord along each segment.

    ``int_0^1 |f(x(t)) - ((1 - t) f(x0) + t f(x1))| * ||x1 - x0|| dt`` per output (flattened to
    ``K``); ``arc_length=False`` drops the ``||x1 - x0||`` factor. Regions on which the
    difference changes sign are split at the root, and every region (the last included)
    counts. Arguments as in :func:`linear_regions`; where its budget stops a segment, the
    integral covers ``[0, covered]`` only (a lower bound) and a :class:`PartialResultWarning` says
    so: call ``linear_regions(...).deviation()`` to get the marked result.

    Example:
        >>> net = nn.Sequential(nn.Linear(1, 1), nn.ReLU())  # relu(w x + b)
        >>> absolute_deviation(net, torch.tensor([[-1.0]]), torch.tensor([[1.0]])).shape
        torch.Size([1, 1])
    """
    result = linear_regions(model, x0, x1, eps=eps, batch_size=batch_size, progress=progress, pieces=pieces,
                            max_regions=max_regions, max_seconds=max_seconds)
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
