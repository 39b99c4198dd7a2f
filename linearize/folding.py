"""``linearize.fold``: turn a linearized model into a smaller plain PyTorch model.

The returned model is a new module (the input is never changed), like PEFT's
``merge_and_unload``: use the return value. Folding rewrites modules in place of the copy
(no ``torch.fx`` GraphModule), so ``generate`` / ``save_pretrained`` of Hugging Face models
keep working. What it does, in order, on every ``nn.Sequential`` (flattened), every known
block and every known feed-forward module:

1. drops units whose channels are all linear (slope ``a >= 1 - tol``: the unit is the identity);
2. folds BatchNorm (eval statistics) into the preceding conv / linear layer;
3. merges runs of adjacent linear maps (``Linear o Linear``, ``Conv o Conv``, grouped and
   depthwise convs, 1x1 convs into neighbours) where that is exact and, with
   ``objective="flops"``, lowers the FLOPs (a small dynamic program over each run); with
   ``objective="depth"`` it minimizes the number of sequential layers;
4. folds a residual skip (identity, or a 1x1 downsample conv with the merged stride) into the
   centre tap of a merged conv (MobileNet-V2 inverted residuals, DepthShrinker-style;
   torchvision Bottleneck, and BasicBlock with ``objective="depth"``);
5. splits Transformer FFNs ``W2 act(W1 x + b1) + b2`` with ``k`` linear channels out of ``m``
   into a narrower FFN plus one ``d x d`` linear path ``W2[:, L] W1[L, :]`` (Hugging Face BERT,
   GPT-2, T5, Marian/BART-style modules), and a fully linear FFN into one ``Linear(d, d)``;
6. replaces every remaining unit by a plain module: ``nn.ReLU``-style activation (slopes all
   0), :class:`ChannelPReLU` (mixed ReLU family) or :class:`ChannelBlend` (mixed smooth units).

Border exactness of ``Conv o Conv``: the second conv zero-pads the *intermediate* map, the
merged conv pads the *input*. The merge is exact when the second conv has no padding, or when
the first conv is pointwise (1x1, no padding): then the padded intermediate is the first conv's
bias only, and :class:`BorderBiasConv` adds the exact position-dependent bias. Any other pair
across zero padding (e.g. 3x3 pad 1 o 3x3 pad 1, a torchvision BasicBlock) merges only with
``objective="depth"``, into a :class:`BorderExactConv` (the merged conv minus an exact
correction computed on thin border strips); with ``objective="flops"`` it is refused with that
reason (a 5x5 costs more than two 3x3), as is a longer chain with such a step.

Then it verifies: ``example_inputs`` run through both models and the max abs difference must
stay below ``rtol * max|output|`` (or ``atol``); the summary holds the error, params, FLOPs and
measured latency before and after. When that check is vacuous (the output is zero, or the same
for every sample although the samples differ: a zero-initialised head), it also verifies the
input of the last layer that fold left untouched and that does vary (the features before the
head), and ``summary.verified_on`` names it; if no such signal exists, fold raises.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from torchvision.models.mobilenetv2 import InvertedResidual
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from .checks import FoldVerificationError, check_positive, check_tol
from .conversion import CallSites, FunctionalActivation, _reset_call_sites, call_model
from .unit import LinearizableActivation, check_finite_slopes, units

__all__ = [
    "fold",
    "FoldSummary",
    "FoldVerificationError",
    "ChannelPReLU",
    "ChannelBlend",
    "LinearWithPassthrough",
    "BorderBiasConv",
    "BorderExactConv",
    "count_flops",
]

OBJECTIVES = ("flops", "depth")
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_BY_DIM = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
# Feed-forward modules of known model families: (first linear, activation, second linear),
# attribute paths inside one module whose forward computes second(act(first(x))) (eval dropout
# in between is the identity).
FFN_PATTERNS = (
    ("intermediate.dense", "intermediate.intermediate_act_fn", "output.dense"),  # BERT family
    ("c_fc", "act", "c_proj"),  # GPT-2 (HF Conv1D, weight [in, out])
    ("wi", "act", "wo"),  # T5DenseActDense
    ("fc1", "activation_fn", "fc2"),  # Marian, BART, mBART, Pegasus, CLIP, ViT-MAE...
)
GATED_FFN_ATTRS = ("wi_0", "wi_1")  # T5DenseGatedActDense: act on the gate branch only


@dataclass
class FoldSummary:
    """What :func:`fold` did, attached to the result as ``folded.linearize_fold_summary``.

    ``merged`` and ``skipped`` hold one line per decision (``"site: what (why)"``). FLOPs count
    2 per multiply-add of every linear, conv, matmul and attention op plus 2 per BatchNorm
    element, over the whole ``example_inputs`` batch (other element-wise ops not counted).
    Latencies are medians in milliseconds of interleaved repetitions on ``example_inputs``
    (``None`` with ``latency=False``). ``max_abs_error`` is the largest absolute difference
    between the outputs; ``output_scale`` the largest absolute reference output.

    ``verified_on`` is ``"output"``, or, when the output cannot tell a wrong fold from a right one
    (zero, or constant over samples that differ), ``"input of '<layer>'"``: that signal was
    verified too, with ``signal_error`` / ``signal_scale`` / ``signal_tolerance`` (``rtol`` times
    its scale), and the reason in ``verified_why``.
    """

    objective: str
    tol: float
    merged: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    units_before: int = 0
    units_left: int = 0
    params_before: int = 0
    params_after: int = 0
    flops_before: int = 0
    flops_after: int = 0
    latency_ms_before: float | None = None
    latency_ms_after: float | None = None
    max_abs_error: float = 0.0
    output_scale: float = 0.0
    tolerance: float = 0.0
    verify_dtype: str = ""
    verified_on: str = "output"
    verified_why: str = ""
    signal_error: float | None = None
    signal_scale: float | None = None
    signal_tolerance: float | None = None

    @property
    def flop_ratio(self) -> float:
        """FLOPs after / before."""
        return self.flops_after / max(self.flops_before, 1)

    @property
    def param_ratio(self) -> float:
        """Parameters after / before."""
        return self.params_after / max(self.params_before, 1)

    @property
    def latency_ratio(self) -> float | None:
        """Measured latency after / before (``None`` when latency was not measured)."""
        if self.latency_ms_before is None or self.latency_ms_after is None:
            return None
        return self.latency_ms_after / self.latency_ms_before

    def __str__(self) -> str:
        lines = [
            f"fold(objective={self.objective!r}, tol={self.tol}): "
            f"params {self.params_before:,} -> {self.params_after:,} ({self.param_ratio:.3f}x), "
            f"FLOPs {self.flops_before:,} -> {self.flops_after:,} ({self.flop_ratio:.3f}x)",
        ]
        if self.latency_ratio is not None:
            lines.append(
                f"latency {self.latency_ms_before:.3f} ms -> {self.latency_ms_after:.3f} ms "
                f"({self.latency_ratio:.3f}x, median of interleaved runs)"
            )
        lines.append(
            f"max abs error {self.max_abs_error:.3g} (output scale {self.output_scale:.3g}, "
            f"tolerance {self.tolerance:.3g}, {self.verify_dtype})"
        )
        if self.verified_on != "output":
            lines.append(
                f"verified on the {self.verified_on} ({self.verified_why}): max abs error "
                f"{self.signal_error:.3g} (scale {self.signal_scale:.3g}, tolerance {self.signal_tolerance:.3g})"
            )
        lines += [f"merged: {m}" for m in self.merged] + [f"skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- plain modules


class ChannelPReLU(nn.PReLU):
    """``nn.PReLU`` whose channels sit at ``channel_dim`` (``nn.PReLU`` assumes dim 1).

    ``weight`` ``[C]`` is the slope for negative inputs. Input ``[..., C, ...]`` with ``C`` at
    ``channel_dim``; output has the same shape.
    """

    def __init__(self, weight: torch.Tensor, channel_dim: int = 1) -> None:
        super().__init__(num_parameters=weight.numel())
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


class BorderBiasConv(nn.Module):
    """A merged conv whose bias depends on the position near the border.

    ``y = conv(x) + bias_map``: ``conv`` is the merged kernel (bias = the last conv's bias) and
    ``bias_map[o, t] = sum_v tap_bias[o, v]`` over the taps ``v`` of the second conv that read
    inside the intermediate map at output position ``t`` (the first conv's bias seen through
    the second conv; padded taps read zeros). Computed once per input size and cached.
    """

    def __init__(
        self,
        conv: nn.Module,
        tap_bias: torch.Tensor,
        inner_stride: tuple[int, ...],
        stride: tuple[int, ...],
        padding: tuple[int, ...],
        dilation: tuple[int, ...],
    ) -> None:
        super().__init__()
        self.conv = conv
        self.register_buffer("tap_bias", tap_bias.unsqueeze(1))  # [C_out, 1, *k]
        self.inner_stride, self.stride, self.padding, self.dilation = inner_stride, stride, padding, dilation
        self._cache: dict[tuple, torch.Tensor] = {}

    def bias_map(self, spatial: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """``[1, C_out, *out_spatial]`` bias for an input of spatial size ``spatial``."""
        key = (spatial, like.dtype, like.device, self.tap_bias._version)
        if key not in self._cache:
            inner = [(n - 1) // s + 1 for n, s in zip(spatial, self.inner_stride)]
            ones = torch.ones(1, 1, *inner, dtype=like.dtype, device=like.device)
            fn = _CONV_FN[len(spatial)]
            self._cache = {key: fn(ones, self.tap_bias.to(like.dtype), None, self.stride, self.padding, self.dilation)}
        return self._cache[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y + self.bias_map(tuple(x.shape[2:]), y)


class BorderExactConv(nn.Module):
    """``second o first`` of two zero-padded convs as one merged conv plus an exact border fix.

    ``conv`` is the merged conv (kernel ``s1 * d2 * (k2 - 1) + d1 * (k1 - 1) + 1``, stride
    ``s1 * s2``, padding ``p1 + s1 * p2``, dilation 1, bias ``b2 + sum_v W2[v] b1``). It equals
    ``second(first(x))`` in the interior, but at the border it sees ``u_ext``, ``first``
    evaluated on the grid extended by ``p2`` (where ``second`` sees its zero padding). So

        y = conv(x) - second_valid(ring * u_ext)

    with ``ring`` the ``p2``-wide padding ring of ``second``'s input. The correction is nonzero
    only on an output band of width about ``p2 / s2`` per side. It is computed per piece of the
    ring (two per spatial dim, see :func:`_border_bands`): ``first`` on the piece only (a thin
    zero-padded strip of ``x``), then ``second`` with only the taps that reach the piece, on
    the band: no full-size pass of ``first`` or ``second`` (for a 3x3 o 3x3 pair on a 32x32
    map, 6% of the merged conv's FLOPs). Bands follow the actual input size of each call.
    Input ``[N, C_in, *spatial]`` -> output ``[N, C_out, *spatial_out]``, the shapes of
    ``second(first(x))``; any conv dimension, stride, dilation, groups and padding.

    ``first_weight`` / ``first_bias`` / ``second_weight`` are copies of the original convs
    (frozen parameters: the correction is tied to them, so fine-tuning ``conv`` alone would
    break the identity). The strip convs read ``x`` only, not ``conv``'s output.
    """

    def __init__(self, conv: nn.Module, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self._check(first, second)
        self.conv = conv
        like = conv.weight
        self.first_weight = nn.Parameter(first.weight.detach().to(like).clone(), requires_grad=False)
        b1 = first.bias.detach().to(like).clone() if first.bias is not None else None
        self.first_bias = None if b1 is None else nn.Parameter(b1, requires_grad=False)
        self.second_weight = nn.Parameter(second.weight.detach().to(like).clone(), requires_grad=False)
        self.first_geometry = (tuple(first.stride), tuple(first.dilation), first.groups)
        self.second_geometry = (tuple(second.stride), tuple(second.dilation), second.groups)
        # per spatial dim: (k1, s1, p1, d1, k2, s2, p2, d2)
        self.geometry = tuple(
            zip(first.kernel_size, first.stride, first.padding, first.dilation,
                second.kernel_size, second.stride, second.padding, second.dilation)
        )

    @staticmethod
    def _check(first: nn.Module, second: nn.Module) -> None:
        if not (_is_plain_conv(first) and _is_plain_conv(second) and type(first) is type(second)):
            raise ValueError("BorderExactConv merges two plain zero-padded convs of the same dimension")
        if first.out_channels != second.in_channels:
            raise ValueError(f"channel mismatch: {first.out_channels} -> {second.in_channels}")

    @classmethod
    def merge(cls, first: nn.Module, second: nn.Module) -> "BorderExactConv":
        """Build the merged conv of ``second o first`` (float64 algebra) and wrap it."""
        cls._check(first, second)
        desc, _ = _compose_convs(_ConvDesc.of(first), _ConvDesc.of(second), extended=True)
        return cls(_build_conv(desc, second), first, second)

    def correction(self, x: torch.Tensor) -> list[tuple[tuple[slice, ...], torch.Tensor]]:
        """``second_valid(ring * u_ext)`` of ``x``, as ``(output slices, values)`` per ring piece
        (pieces reach overlapping outputs at the corners: the values add up)."""
        fn = _CONV_FN[x.ndim - 2]
        (s1, d1, g1), (s2, d2, g2) = self.first_geometry, self.second_geometry
        every = (slice(None), slice(None))
        out = []
        for group in _border_bands(tuple(x.shape[2:]), self.geometry):
            # pieces of one shape run as one batch through first, and side by side (as groups,
            # each with its own taps) through second: two conv calls per group
            strips = [x[(*every, *band.x_slices)] for band in group]
            strips = [F.pad(t, band.x_pad) if any(band.x_pad) else t for t, band in zip(strips, group)]
            u = fn(torch.cat(strips), self.first_weight, self.first_bias, s1, 0, d1, g1)  # u_ext on the pieces
            u = [F.pad(t, band.u_pad) if any(band.u_pad) else t for t, band in zip(u.chunk(len(group)), group)]
            w = torch.cat([self.second_weight[(*every, *band.taps)] for band in group])
            corr = fn(torch.cat(u, 1), w, None, s2, 0, d2, g2 * len(group))
            out += [(band.out_slices, c) for band, c in zip(group, corr.chunk(len(group), 1))]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        for where, corr in self.correction(x):
            y[(slice(None), slice(None), *where)] -= corr
        return y

    def extra_repr(self) -> str:
        return f"border correction: first stride/dilation/groups {self.first_geometry}, second {self.second_geometry}"


@dataclass(frozen=True)
class _Band:
    """One piece of the padding ring of a :class:`BorderExactConv` and the outputs it reaches.

    Per spatial dim: ``x_slices`` + ``x_pad`` (``F.pad`` order) give the zero-padded input strip
    whose valid ``first`` conv is ``u_ext`` on the piece (``u_shape``); ``u_pad`` zero-pads the
    piece to the window that ``second`` reads for ``out_slices``, using the kernel taps ``taps``
    (the others never reach this piece)."""

    out_slices: tuple[slice, ...]
    x_slices: tuple[slice, ...]
    x_pad: tuple[int, ...]
    u_shape: tuple[int, ...]
    u_pad: tuple[int, ...]
    taps: tuple[slice, ...]


@functools.lru_cache(maxsize=256)
def _border_bands(
    spatial: tuple[int, ...], geometry: tuple[tuple[int, ...], ...]
) -> tuple[tuple[_Band, ...], ...]:
    """The padding ring of ``second``'s input, cut into disjoint pieces, for an input of size
    ``spatial`` (``geometry``: per dim ``(k1, s1, p1, d1, k2, s2, p2, d2)``); pieces of equal
    shapes (strip, padded piece, taps: e.g. top and bottom) come grouped.

    Dim ``i`` gives a low piece (intermediate rows ``[-p2, 0)``) and a high one (``[n1, n1 + p2)``),
    spanning the inside range of dims ``< i`` and the extended range of dims ``> i``. A piece
    reaches the outputs whose ``second`` window touches it: a band ``~p2 / s2`` wide in dim
    ``i``, every output in the other dims (bands overlap at corners; their corrections add up).
    """
    dims = []
    for n, (k1, s1, p1, d1, k2, s2, p2, d2) in zip(spatial, geometry):
        n1 = (n + 2 * p1 - d1 * (k1 - 1) - 1) // s1 + 1
        n2 = (n1 + 2 * p2 - d2 * (k2 - 1) - 1) // s2 + 1
        if n1 < 1 or n2 < 1:
            raise ValueError(f"input size {spatial} is too small for the convs (intermediate {n1}, output {n2})")
        dims.append((n1, n2, s2 * (n2 - 1) - p2 + d2 * (k2 - 1) + 1))  # e: end of the rows second reads

    def x_range(j: int, u0: int, u1: int) -> tuple[slice, tuple[int, int]]:
        """Input slice and zero padding whose valid ``first`` conv gives ``u_ext[u0:u1]`` in dim ``j``."""
        k1, s1, p1, d1 = geometry[j][:4]
        x0, x1 = s1 * u0 - p1, s1 * (u1 - 1) - p1 + d1 * (k1 - 1) + 1
        a, b = min(max(x0, 0), spatial[j]), max(min(x1, spatial[j]), 0)
        return (slice(a, b), (a - x0, x1 - b)) if a < b else (slice(a, a), (x1 - x0, 0))

    bands = []
    for i, (k1, s1, p1, d1, k2, s2, p2, d2) in enumerate(geometry):
        n1, n2, _ = dims[i]
        low_taps = min(k2, -(-p2 // d2))  # taps v >= this never read rows < 0
        high_tap = max(0, -(-(n1 + p2 - s2 * (n2 - 1)) // d2))  # taps v < this never read rows >= n1
        first_high = min(max(0, -(-(n1 + p2 - d2 * (k2 - 1)) // s2)), n2)  # outputs t >= this read rows >= n1
        sides = [  # (outputs reached, taps used, ring rows) of the low and the high piece
            ((0, min(-(-p2 // s2), n2)), (0, low_taps), (-p2, 0)),
            ((first_high, n2), (high_tap, k2), (n1, n1 + p2)),
        ]
        for (t0, t1), (v0, v1), (r0, r1) in sides:
            if t0 >= t1 or v0 >= v1:
                continue
            read = (s2 * t0 - p2 + d2 * v0, s2 * (t1 - 1) - p2 + d2 * (v1 - 1) + 1)
            # per dim: outputs reached, piece of the ring, intermediate rows read, kernel taps used
            per_dim = [
                ((t0, t1), (max(r0, read[0]), min(r1, read[1])), read, (v0, v1)) if j == i else
                ((0, nj2), (0, min(nj1, ej)) if j < i else (-geometry[j][6], ej), (-geometry[j][6], ej),
                 (0, geometry[j][4]))
                for j, (nj1, nj2, ej) in enumerate(dims)
            ]
            if any(a >= b for _, (a, b), _, _ in per_dim):
                continue
            xs = [x_range(j, *piece) for j, (_, piece, _, _) in enumerate(per_dim)]
            bands.append(_Band(
                out_slices=tuple(slice(*out) for out, _, _, _ in per_dim),
                x_slices=tuple(sl for sl, _ in xs),
                x_pad=tuple(p for _, pad in reversed(xs) for p in pad),
                u_shape=tuple(b - a for _, (a, b), _, _ in per_dim),
                u_pad=tuple(p for _, (a, b), (ra, rb), _ in reversed(per_dim) for p in (a - ra, rb - b)),
                taps=tuple(slice(*taps) for _, _, _, taps in per_dim),
            ))
    groups: dict[tuple, list[_Band]] = {}
    for band in bands:
        padded = tuple(n + band.u_pad[-2 * j - 2] + band.u_pad[-2 * j - 1] for j, n in enumerate(band.u_shape))
        groups.setdefault((band.u_shape, padded, tuple(t.stop - t.start for t in band.taps)), []).append(band)
    return tuple(tuple(g) for g in groups.values())


def _border_flops(spatial: tuple[int, ...], batch: int, first: _ConvDesc, second: _ConvDesc) -> int:
    """FLOPs of the :class:`BorderExactConv` correction on one input (both strip convs)."""
    geometry = tuple(
        zip(first.kernel, first.stride, first.padding, first.dilation,
            second.kernel, second.stride, second.padding, second.dilation)
    )
    per_u = 2 * first.out_channels * first.weight.shape[1] * math.prod(first.kernel)
    per_out = 2 * second.out_channels * second.weight.shape[1]
    total = 0
    for band in itertools.chain.from_iterable(_border_bands(spatial, geometry)):
        taps = math.prod(t.stop - t.start for t in band.taps)
        n_out = math.prod(s.stop - s.start for s in band.out_slices)
        total += batch * (math.prod(band.u_shape) * per_u + n_out * per_out * taps)
    return total

# ----------------------------------------------------------------------------- helpers


def _is_hf_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None


def _is_dense(m: nn.Module) -> bool:
    return type(m) is nn.Linear or _is_hf_conv1d(m)


def _dense_shape(m: nn.Module) -> tuple[int, int]:
    """``(out_features, in_features)`` of nn.Linear / HF Conv1D."""
    out, inp = m.weight.shape
    return (inp, out) if _is_hf_conv1d(m) else (out, inp)


def _dense_wb(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight ``[out, in]`` and bias of nn.Linear / HF Conv1D, in float64."""
    w = m.weight.detach().double()
    if _is_hf_conv1d(m):
        w = w.t()
    b = None if m.bias is None else m.bias.detach().double()
    return w, b


def _make_linear(w: torch.Tensor, b: torch.Tensor | None, like: nn.Module, cls: type = nn.Linear) -> nn.Linear:
    p = like.weight
    lin = cls(w.shape[1], w.shape[0], bias=b is not None, device=p.device, dtype=p.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return lin


def _is_plain_conv(m: nn.Module) -> bool:
    return (
        type(m) in _CONVS
        and m.padding_mode == "zeros"
        and not isinstance(m.padding, str)
    )


def _units_of(m: nn.Module) -> list[LinearizableActivation]:
    """Units behind an activation attribute, one per call (a reused unit appears once per call)."""
    if isinstance(m, LinearizableActivation):
        return [m]
    if isinstance(m, CallSites) and all(isinstance(u, LinearizableActivation) for u in m.calls):
        return list(m.calls)
    return []


def _linear_unit(u: nn.Module, tol: float) -> bool:
    return isinstance(u, LinearizableActivation) and bool(u.linear_mask(tol).all())


def _snapped_slopes(unit: LinearizableActivation, tol: float) -> torch.Tensor:
    """Slopes with the linear channels (:meth:`~LinearizableActivation.linear_mask`) at 1, then ``a <= tol`` at 0."""
    a = unit.slope.detach().clone()
    a[unit.linear_mask(tol)] = 1.0
    a[a <= tol] = 0.0
    return a


def _act_module(unit: LinearizableActivation) -> nn.Module:
    if unit.is_prelu:
        return nn.LeakyReLU(unit.leak) if unit.leak else nn.ReLU()
    if "act" in unit._modules:
        return copy.deepcopy(unit.act)
    return FunctionalActivation(unit.act_fn, unit.kind)


def _plain_from_slopes(unit: LinearizableActivation, a: torch.Tensor) -> nn.Module:
    """Plain module computing the blend of ``unit``'s activation with slopes ``a`` (``[C']``)."""
    if bool((a >= 1).all()):
        return nn.Identity()
    if bool((a <= 0).all()):
        return _act_module(unit)
    if unit.is_prelu:
        w = a + (1 - a) * unit.leak if unit.leak else a
        return ChannelPReLU(w.to(unit.slope.dtype), unit.channel_dim)
    return ChannelBlend(_act_module(unit), a.to(unit.slope.dtype), unit.channel_dim)


def _plain_unit(unit: LinearizableActivation, tol: float) -> nn.Module:
    """The plain module equivalent to ``unit`` (linear channels snapped to 1, small ones to 0)."""
    return _plain_from_slopes(unit, _snapped_slopes(unit, tol))


def _get(root: nn.Module, path: str) -> nn.Module | None:
    m = root
    for part in path.split("."):
        m = m._modules.get(part) if isinstance(m, nn.Module) else None
        if m is None:
            return None
    return m


def _set(root: nn.Module, path: str, value: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, name, value)


def _flatten_outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        return [t for v in out.values() for t in _flatten_outputs(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _flatten_outputs(v)]
    return []


def _cast_inputs(inputs: Any, dtype: torch.dtype) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(dtype) if inputs.is_floating_point() else inputs
    if isinstance(inputs, dict):
        return {k: _cast_inputs(v, dtype) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_cast_inputs(v, dtype) for v in inputs)
    return inputs


def _is_empty_batch(inputs: Any) -> bool:
    """Whether a tensor of ``inputs`` has no rows (batch dim 0)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.ndim > 0 and inputs.shape[0] == 0
    if isinstance(inputs, dict):
        return any(_is_empty_batch(v) for v in inputs.values())
    if isinstance(inputs, (tuple, list)):
        return any(_is_empty_batch(v) for v in inputs)
    return False


def _check_reference(ref_out: list[torch.Tensor], inputs: Any) -> None:
    """The model's own outputs must be non-empty and finite, or no tolerance can verify a fold."""
    if any(t.numel() == 0 for t in ref_out):
        raise ValueError(
            f"the model's output on example_inputs {_describe_inputs(inputs)} is empty: pass at least one sample"
        )
    if not all(bool(torch.isfinite(t).all()) for t in ref_out):
        raise ValueError(
            f"the model's own output on example_inputs {_describe_inputs(inputs)} has NaN/inf values: fold "
            "cannot verify against it (no tolerance helps); check the model's weights and the inputs"
        )


def _describe_inputs(inputs: Any) -> str:
    if isinstance(inputs, torch.Tensor):
        return f"Tensor{tuple(inputs.shape)}"
    if isinstance(inputs, dict):
        return "{" + ", ".join(f"{k}: {_describe_inputs(v)}" for k, v in inputs.items()) + "}"
    if isinstance(inputs, (tuple, list)):
        return "(" + ", ".join(_describe_inputs(v) for v in inputs) + ")"
    return type(inputs).__name__


# ----------------------------------------------------------------------------- FLOPs


def _module_flops(m: nn.Module, inp: tuple, out: Any) -> int:
    """FLOPs of one call of a linear map (conv / Linear / HF Conv1D) from its shapes, for the planner."""
    if not isinstance(out, torch.Tensor):
        return 0
    if isinstance(m, _CONVS):
        k = math.prod(m.kernel_size)
        return 2 * out.numel() * (m.in_channels // m.groups) * k
    if isinstance(m, nn.Linear):  # LinearWithPassthrough counts only its matmul
        return 2 * m.in_features * m.out_features * (inp[0].numel() // m.in_features)
    if _is_hf_conv1d(m):
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


class _FlopCounter(TorchFunctionMode):
    """Adds up :func:`_op_flops` of every op run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.total += _op_flops(func, args, out)
        return out


@torch.no_grad()
def _run_counting(model: nn.Module, inputs: Any, record: "_Probe | None" = None) -> tuple[int, Any]:
    """One forward: ``(FLOPs, output)``; fills ``record`` with call counts and shapes."""

    def hook(m: nn.Module, inp: tuple, out: Any) -> None:
        record.calls[id(m)] = record.calls.get(id(m), 0) + 1
        if isinstance(out, torch.Tensor):
            record.out_shape[id(m)] = tuple(out.shape)
        if inp and isinstance(inp[0], torch.Tensor):
            record.in_shape[id(m)] = tuple(inp[0].shape)

    handles = [m.register_forward_hook(hook) for m in model.modules()] if record is not None else []
    try:
        with _FlopCounter() as counter:
            out = call_model(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return counter.total, out


def count_flops(model: nn.Module, example_inputs: Any) -> int:
    """FLOPs of one forward on ``example_inputs`` (whole batch): 2 per multiply-add of every
    linear / conv / matmul / attention op (nn.Linear, HF Conv1D, attention scores...) plus 2 per
    BatchNorm element; other element-wise ops are not counted."""
    return _run_counting(model, example_inputs)[0]


@dataclass
class _Probe:
    """Per-module call counts and the output shape of the (single) call, by module id."""

    calls: dict[int, int]
    out_shape: dict[int, tuple[int, ...]]
    in_shape: dict[int, tuple[int, ...]]
    keep: list[nn.Module]  # keeps ids valid while folding

    def once(self, m: nn.Module) -> bool:
        return self.calls.get(id(m), 0) == 1


# ----------------------------------------------------------------------------- BatchNorm


def _bn_foldable(layer: nn.Module, bn: nn.Module) -> str | None:
    """``None`` if ``bn`` can fold into ``layer``, else the reason."""
    if not bn.track_running_stats or bn.running_mean is None:
        return "BatchNorm without running statistics uses batch statistics"
    if isinstance(layer, _CONVS):
        dims = {nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3}.get(type(bn))
        ok = layer.out_channels == bn.num_features and dims == len(layer.kernel_size)
        return None if ok else "shape mismatch"
    if type(layer) is nn.Linear and type(bn) is nn.BatchNorm1d:
        return None if layer.out_features == bn.num_features else "shape mismatch"
    return "not after a conv or linear layer"


@torch.no_grad()
def _fold_bn(layer: nn.Module, bn: _BatchNorm) -> None:
    """Fold eval-mode ``bn`` into ``layer`` (in place): ``W' = W s``, ``b' = (b - mean) s + beta``."""
    scale = (bn.running_var.double() + bn.eps).rsqrt()
    if bn.affine:
        scale = scale * bn.weight.double()
    shift = -bn.running_mean.double() * scale + (bn.bias.double() if bn.affine else 0.0)
    w = layer.weight.double()
    b = layer.bias.double() if layer.bias is not None else torch.zeros_like(shift)
    layer.weight.copy_(w * scale.view(-1, *([1] * (w.ndim - 1))))
    new_b = b * scale + shift
    if layer.bias is None:
        layer.bias = nn.Parameter(new_b.to(layer.weight.dtype))
    else:
        layer.bias.copy_(new_b)


# ----------------------------------------------------------------------------- conv algebra


@dataclass
class _ConvDesc:
    """A conv as tensors (float64): weight ``[C_out, C_in / groups, *k]``, bias, geometry."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    @classmethod
    def of(cls, conv: nn.Module) -> "_ConvDesc":
        return cls(
            conv.weight.detach().double(),
            None if conv.bias is None else conv.bias.detach().double(),
            tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation), conv.groups,
        )

    @property
    def out_channels(self) -> int:
        return self.weight.shape[0]

    @property
    def in_channels(self) -> int:
        return self.weight.shape[1] * self.groups

    @property
    def kernel(self) -> tuple[int, ...]:
        return tuple(self.weight.shape[2:])

    @property
    def pointwise(self) -> bool:
        return all(k == 1 for k in self.kernel) and not any(self.padding)

    def dense(self) -> torch.Tensor:
        """Weight ``[C_out, C_in, *k]`` with the group structure expanded (zeros off-block)."""
        g = self.groups
        if g == 1:
            return self.weight
        co, ci_g = self.weight.shape[:2]
        out = self.weight.new_zeros(co, ci_g * g, *self.kernel)
        for j in range(g):
            rows = slice(j * co // g, (j + 1) * co // g)
            out[rows, j * ci_g:(j + 1) * ci_g] = self.weight[rows]
        return out

    def grouped(self, g: int) -> torch.Tensor:
        """Weight as ``[g, C_out / g, C_in / g, *k]`` (requires ``self.groups == g``)."""
        co, ci_g = self.weight.shape[:2]
        return self.weight.reshape(g, co // g, ci_g, *self.kernel)


def _conv_geometry(first: _ConvDesc, second: _ConvDesc) -> tuple[tuple[int, ...], tuple, tuple, int]:
    """Kernel, stride, padding and groups of ``second o first`` (dilation 1)."""
    kernel = tuple(
        s1 * d2 * (k2 - 1) + d1 * (k1 - 1) + 1
        for k1, s1, d1, k2, d2 in zip(first.kernel, first.stride, first.dilation, second.kernel, second.dilation)
    )
    stride = tuple(s1 * s2 for s1, s2 in zip(first.stride, second.stride))
    padding = tuple(s1 * p2 + p1 for s1, p1, p2 in zip(first.stride, first.padding, second.padding))
    groups = first.groups if first.groups == second.groups else 1
    return kernel, stride, padding, groups


def _compose_convs(
    first: _ConvDesc, second: _ConvDesc, extended: bool = False
) -> tuple[_ConvDesc, torch.Tensor | None]:
    """``second o first`` as one conv, exact in the interior.

    Returns the merged conv and, when ``second`` zero-pads the intermediate map and ``first``
    has a bias, the per-tap bias ``[C_out, *k2]`` that :class:`BorderBiasConv` needs (the merged
    bias then holds only ``second``'s bias). With ``extended`` the merged conv is ``second``
    applied to ``first`` on the extended grid (``first``'s bias through every tap, no tap bias),
    as :class:`BorderExactConv` needs. The caller checks border exactness.
    """
    kernel, stride, padding, g = _conv_geometry(first, second)
    g1 = first.groups
    if g > 1 or (g1 > 1 and second.groups == 1):
        # grouped o grouped (same groups), or grouped/depthwise first then dense: contract within
        # the first conv's groups, never expanding it to a dense kernel
        w1 = first.grouped(g1)  # [g1, m, i, *k1]
        w2 = second.grouped(g) if g > 1 else second.weight.reshape(second.out_channels, g1, -1, *second.kernel)
        a, r = ("gom", "goi") if g > 1 else ("ogm", "ogi")
    else:
        w1, w2, (a, r) = first.dense().unsqueeze(0), second.dense().unsqueeze(0), ("gom", "goi")
    k2s, k1s = "pqr"[: len(kernel)], "stu"[: len(kernel)]
    full = torch.einsum(f"{a}{k2s},gmi{k1s}->{r}{k2s}{k1s}", w2, w1)  # every tap pair at once
    out = w2.new_zeros(*full.shape[:3], *kernel)
    for v in itertools.product(*(range(k) for k in second.kernel)):
        start = [s1 * d2 * vi for s1, d2, vi in zip(first.stride, second.dilation, v)]
        idx = tuple(slice(st, st + d1 * (k1 - 1) + 1, d1) for st, d1, k1 in zip(start, first.dilation, first.kernel))
        out[(slice(None),) * 3 + idx] += full[(slice(None),) * 3 + v]
    weight = out.reshape(second.out_channels, first.in_channels // g, *kernel)
    bias, tap_bias = second.bias, None
    if first.bias is not None:
        b1 = first.bias.reshape(w1.shape[0], w1.shape[1])
        taps = torch.einsum(f"{a}{k2s},gm->{'go' if a == 'gom' else 'o'}{k2s}", w2, b1).reshape(weight.shape[0], *second.kernel)
        if any(second.padding) and not extended:
            if bool(b1.abs().gt(0).any()):  # else the padded intermediate is exactly zero
                tap_bias = taps
        else:
            through = taps.flatten(1).sum(1)
            bias = through if bias is None else bias + through
    merged = _ConvDesc(weight, bias, stride, padding, (1,) * len(kernel), g)
    return merged, tap_bias


def _needs_border_correction(convs: list[_ConvDesc]) -> bool:
    """Two convs whose merge crosses zero padding after a non-pointwise conv (:class:`BorderExactConv`)."""
    return len(convs) == 2 and any(convs[1].padding) and not convs[0].pointwise


def _chain_plan(convs: list[_ConvDesc], border_exact: bool = False) -> tuple[_ConvDesc | None, str]:
    """Geometry-only check that ``convs`` (applied in order) merge exactly into one conv.

    Composes right to left; a step across zero padding is exact only when the left conv is
    pointwise, and it may carry a bias only at the leftmost step (a :class:`BorderBiasConv`).
    With ``border_exact``, two convs of any geometry also merge (a :class:`BorderExactConv`).
    Returns a weightless descriptor of the result (weight shape only) or ``None`` and why.
    """
    right = convs[-1]
    for i in range(len(convs) - 2, -1, -1):
        left = convs[i]
        if left.out_channels != right.in_channels:
            return None, "channel mismatch"
        if any(right.padding):
            if not left.pointwise and not (border_exact and len(convs) == 2):
                how = (
                    "a border-corrected merge joins two convs only" if border_exact
                    else "objective='depth' merges it with an exact border correction"
                )
                return None, (
                    "not exact at the border: the second conv zero-pads the intermediate map "
                    f"(padding {right.padding}) after a {'x'.join(map(str, left.kernel))} conv; {how}"
                )
            if i > 0 and left.bias is not None and bool(left.bias.abs().gt(0).any()):
                return None, "a biased 1x1 conv before zero padding is exact only as the first conv"
        kernel, stride, padding, g = _conv_geometry(left, right)
        shape = (right.out_channels, left.in_channels // g, *kernel)
        right = _ConvDesc(torch.empty(shape, device="meta"), right.bias, stride, padding, (1,) * len(kernel), g)
    return right, ""


def _build_conv(desc: _ConvDesc, like: nn.Module) -> nn.Module:
    dim = desc.weight.ndim - 2
    conv = _CONV_BY_DIM[dim](
        desc.in_channels, desc.out_channels, desc.kernel, stride=desc.stride, padding=desc.padding,
        dilation=desc.dilation, groups=desc.groups, bias=desc.bias is not None,
        device=like.weight.device, dtype=like.weight.dtype,
    )
    with torch.no_grad():
        conv.weight.copy_(desc.weight)
        if desc.bias is not None:
            conv.bias.copy_(desc.bias)
    return conv


def _merge_convs(convs: list[nn.Module], in_shape: tuple | None) -> tuple[nn.Module, str]:
    """Merge real convs (right to left, planned by :func:`_chain_plan`) into one module.

    Returns the module and its description: a conv; a :class:`BorderBiasConv` (its bias map
    precomputed for ``in_shape``, a one-time cost kept out of the FLOP count); or a
    :class:`BorderExactConv` for two convs across zero padding.
    """
    descs = [_ConvDesc.of(c) for c in convs]
    if _needs_border_correction(descs):
        new = BorderExactConv.merge(*convs)
        kernel = "x".join(map(str, new.conv.kernel_size))
        return new, f"{kernel} conv (groups={new.conv.groups}) with exact border correction"
    right, border = descs[-1], None
    for left in reversed(descs[:-1]):
        right_geom = right
        right, tap_bias = _compose_convs(left, right)
        if tap_bias is not None:
            border = (tap_bias, left.stride, right_geom.stride, right_geom.padding, right_geom.dilation)
    conv = _build_conv(right, convs[-1])
    kind = f"{'x'.join(map(str, right.kernel))} conv (groups={right.groups})"
    if border is None:
        return conv, kind
    tap_bias, inner_stride, stride, padding, dilation = border
    new = BorderBiasConv(conv, tap_bias.to(conv.weight.dtype), inner_stride, stride, padding, dilation)
    if in_shape is not None:
        new.bias_map(tuple(in_shape[2:]), conv.weight)
    return new, kind + " with exact border bias"


# ----------------------------------------------------------------------------- the folder


class _Folder:
    def __init__(self, objective: str, tol: float, probe: _Probe, summary: FoldSummary) -> None:
        self.objective, self.tol, self.probe, self.summary = objective, tol, probe, summary

    # ---- costs
    def _better(self, a: tuple[float, int], b: tuple[float, int]) -> bool:
        """Is plan cost ``a`` = (flops, layers) better than ``b`` under the objective?"""
        ka = a if self.objective == "flops" else (a[1], a[0])
        kb = b if self.objective == "flops" else (b[1], b[0])
        return ka < kb

    def _map_flops(self, m: nn.Module) -> int:
        out = self.probe.out_shape.get(id(m))
        inp = self.probe.in_shape.get(id(m))
        if out is None or inp is None:
            return 0
        return _module_flops(m, (torch.empty(inp, device="meta"),), torch.empty(out, device="meta"))

    # ---- traversal
    def run(self, module: nn.Module, name: str = "") -> nn.Module:
        for child_name, child in list(module.named_children()):
            new = self.run(child, f"{name}.{child_name}" if name else child_name)
            if new is not child:
                setattr(module, child_name, new)
        if type(module).forward is nn.Sequential.forward and isinstance(module, nn.Sequential):
            return self.fold_sequential(module, name)
        if isinstance(module, InvertedResidual):
            return self.fold_inverted_residual(module, name)
        if isinstance(module, (BasicBlock, Bottleneck)):
            return self.fold_resnet_block(module, name)
        if isinstance(module, ResNet):
            self.fold_bn_attr(module, name, "conv1", "bn1")
        for pattern in FFN_PATTERNS:
            if all(_get(module, p) is not None for p in pattern):
                self.fold_ffn(module, name, pattern)
        if all(hasattr(module, a) for a in GATED_FFN_ATTRS) and _units_of(getattr(module, "act", nn.Identity())):
            self.summary.skipped.append(
                f"{name}: gated FFN act(wi_0 x) * (wi_1 x): a linear gate channel is still a "
                "product of two linear maps (quadratic), nothing to fold; units made plain"
            )
        return module

    # ---- BatchNorm in attribute pairs (torchvision ResNet stem and blocks)
    def fold_bn_attr(self, module: nn.Module, name: str, conv_attr: str, bn_attr: str) -> None:
        """Fold ``module.<bn_attr>`` into ``module.<conv_attr>`` (replaced by nn.Identity)."""
        conv, bn = getattr(module, conv_attr), getattr(module, bn_attr)
        if not isinstance(bn, _BatchNorm):
            return
        reason = _bn_foldable(conv, bn)
        if reason is None and not (self.probe.once(conv) and self.probe.once(bn)):
            reason = "layer called more than once"
        if reason:
            self.summary.skipped.append(f"{name}.{bn_attr}: BatchNorm kept ({reason})")
            return
        _fold_bn(conv, bn)
        setattr(module, bn_attr, nn.Identity())
        self.summary.merged.append(f"{name}.{bn_attr}: BatchNorm folded into {name}.{conv_attr}")

    # ---- nn.Sequential chains
    def fold_sequential(self, seq: nn.Sequential, name: str) -> nn.Module:
        items = list(_flatten_sequential(seq, name))
        if not items:
            return seq
        changed = False
        kept: list[tuple[str, nn.Module]] = []
        for n, m in items:
            if _linear_unit(m, self.tol) and self.probe.once(m) or type(m) is nn.Identity:
                if isinstance(m, LinearizableActivation):
                    self.summary.merged.append(f"{n}: fully linear unit removed (identity)")
                changed = True
                continue
            if isinstance(m, _BatchNorm) and kept:
                prev_name, prev = kept[-1]
                reason = _bn_foldable(prev, m)
                if reason is None and not (self.probe.once(prev) and self.probe.once(m)):
                    reason = "layer called more than once"
                if reason is None and type(prev) is nn.Linear and len(self.probe.out_shape[id(prev)]) != 2:
                    reason = "BatchNorm1d over a sequence normalizes a different dim than Linear"
                if reason is None:
                    _fold_bn(prev, m)
                    self.summary.merged.append(f"{n}: BatchNorm folded into {prev_name}")
                    changed = True
                    continue
                self.summary.skipped.append(f"{n}: BatchNorm kept ({reason})")
            kept.append((n, m))
        kept, merged_any = self._merge_runs(kept)
        split_any = self._split_ffns_in_chain(kept)
        if not (changed or merged_any or split_any):
            return seq
        return nn.Sequential(*(m for _, m in kept))

    def _is_map(self, m: nn.Module) -> bool:
        return (_is_plain_conv(m) or _is_dense(m)) and self.probe.once(m)

    def _merge_runs(self, items: list[tuple[str, nn.Module]]) -> tuple[list[tuple[str, nn.Module]], bool]:
        """Merge runs of adjacent linear maps (eval Dropout between them is transparent)."""
        out: list[tuple[str, nn.Module]] = []
        changed = False
        i = 0
        while i < len(items):
            if not self._is_map(items[i][1]):
                out.append(items[i])
                i += 1
                continue
            run = [i]
            j = i + 1
            while j < len(items):
                if isinstance(items[j][1], nn.Dropout):
                    j += 1
                    continue
                if self._is_map(items[j][1]) and _same_family(items[run[-1]][1], items[j][1]):
                    run.append(j)
                    j += 1
                    continue
                break
            segments = self._plan_run([items[k] for k in run])
            for seg in segments:
                if len(seg) == 1:
                    out.append(items[run[seg[0]]])
                else:
                    out.append(self._merge_segment([items[run[k]] for k in seg]))
                    changed = True
                # dropouts inside a merged segment go; those between segments stay
                nxt = run[seg[-1] + 1] if seg[-1] + 1 < len(run) else j
                out.extend(items[run[seg[-1]] + 1:nxt])
            i = j
        return out, changed

    def _segment_cost(self, maps: list[nn.Module]) -> tuple[float, str]:
        """FLOPs of ``maps`` merged into one layer, or ``inf`` and why it cannot merge."""
        last = maps[-1]
        out = self.probe.out_shape.get(id(last))
        if out is None:
            return math.inf, "no shape recorded"
        if _is_dense(maps[0]):
            first_in = _dense_shape(maps[0])[1]
            last_out = _dense_shape(last)[0]
            rows = math.prod(out) // last_out
            return 2.0 * first_in * last_out * rows, ""
        descs = [_ConvDesc.of(m) for m in maps]
        plan, reason = _chain_plan(descs, border_exact=self.objective == "depth")
        if plan is None:
            return math.inf, reason
        cost = 2.0 * math.prod(out) * plan.weight.shape[1] * math.prod(plan.kernel)
        if _needs_border_correction(descs):
            inp = self.probe.in_shape.get(id(maps[0]))
            if inp is None:
                return math.inf, "no shape recorded"
            border = _border_flops(tuple(inp[2:]), inp[0], *descs)
            two = sum(self._map_flops(m) for m in maps)
            if border >= two:  # the strips' first -> second path would be the whole pair again
                return math.inf, (
                    f"the {'x'.join(map(str, inp[2:]))} map is nearly all border: the border correction "
                    f"({border:,} FLOPs) would cost at least as much as the two convs ({two:,})"
                )
            cost += border
        return cost, ""

    def _plan_run(self, run: list[tuple[str, nn.Module]]) -> list[list[int]]:
        """Best split of a run of maps into merged segments (dynamic program over segments)."""
        maps = [m for _, m in run]
        r = len(maps)
        best: list[tuple[tuple[float, int], list[list[int]]]] = [((0.0, 0), [])]
        reasons: dict[tuple[int, int], str] = {}
        for j in range(1, r + 1):
            cand = None
            for i in range(j):
                if j - i == 1:
                    cost = float(self._map_flops(maps[i]))
                else:
                    cost, why = self._segment_cost(maps[i:j])
                    if why:
                        reasons[(i, j)] = why
                    if math.isinf(cost):
                        continue
                prev_cost, prev_plan = best[i]
                total = (prev_cost[0] + cost, prev_cost[1] + 1)
                if cand is None or self._better(total, cand[0]):
                    cand = (total, prev_plan + [list(range(i, j))])
            best.append(cand)
        plan = best[r][1]
        names = [n for n, _ in run]
        for seg_a, seg_b in zip(plan, plan[1:]):
            i, j = seg_a[-1], seg_b[0]
            why = reasons.get((i, j + 1)) or (
                f"merging would not lower the {self.objective} "
                f"(FLOPs {self._map_flops(maps[i]) + self._map_flops(maps[j]):,.0f} -> "
                f"{self._segment_cost(maps[i:j + 1])[0]:,.0f})"
            )
            self.summary.skipped.append(f"{names[i]} + {names[j]}: not merged ({why})")
        return plan

    def _merge_segment(self, seg: list[tuple[str, nn.Module]]) -> tuple[str, nn.Module]:
        names = [n for n, _ in seg]
        maps = [m for _, m in seg]
        before = sum(self._map_flops(m) for m in maps)
        after = self._segment_cost(maps)[0]
        if _is_dense(maps[0]):
            w, b = _dense_wb(maps[0])
            for m in maps[1:]:
                w2, b2 = _dense_wb(m)
                b = (w2 @ b if b is not None else None)
                b = b2 if b is None else (b if b2 is None else b + b2)
                w = w2 @ w
            new = _make_linear(w, b, maps[-1])
            kind = f"Linear({w.shape[1]}, {w.shape[0]})"
        else:
            new, kind = _merge_convs(maps, self.probe.in_shape.get(id(maps[0])))
        self.summary.merged.append(
            f"{' o '.join(reversed(names))}: merged into one {kind} (FLOPs {before:,.0f} -> {after:,.0f})"
        )
        self.probe.out_shape[id(new)] = self.probe.out_shape[id(maps[-1])]
        self.probe.in_shape[id(new)] = self.probe.in_shape[id(maps[0])]
        self.probe.calls[id(new)] = 1
        self.probe.keep.append(new)
        return names[0], new

    def _split_ffns_in_chain(self, items: list[tuple[str, nn.Module]]) -> bool:
        """(Linear, mixed unit, Linear) triples in a flattened Sequential: split linear channels."""
        changed = False
        for k in range(len(items) - 2):
            (n1, a), (nu, u), (n2, b) = items[k:k + 3]
            if (_is_dense(a) and isinstance(u, LinearizableActivation) and _is_dense(b) and u.channel_dim in (-1, 1)
                    and all(self.probe.once(x) for x in (a, u, b))):
                if u.channel_dim == 1 and len(self.probe.out_shape.get(id(a), ())) != 2:
                    continue
                new = self._split_ffn(a, u, b, nu)
                if new is not None:
                    items[k:k + 3] = [(n1, new[0]), (nu, new[1]), (n2, new[2])]
                    changed = True
        return changed

    # ---- Transformer FFN
    def fold_ffn(self, module: nn.Module, name: str, pattern: tuple[str, str, str]) -> None:
        first, unit, second = (_get(module, p) for p in pattern)
        site = f"{name}.{pattern[1]}" if name else pattern[1]
        if not isinstance(unit, LinearizableActivation):
            return
        if not (_is_dense(first) and _is_dense(second)):
            self.summary.skipped.append(f"{site}: FFN layers are not Linear/Conv1D, units made plain")
            return
        if not all(self.probe.once(m) for m in (first, unit, second)):
            self.summary.skipped.append(f"{site}: FFN not called exactly once on example_inputs")
            return
        new = self._split_ffn(first, unit, second, site)
        if new is not None:
            for path, m in zip(pattern, new):
                _set(module, path, m)

    def _split_ffn(
        self, first: nn.Module, unit: LinearizableActivation, second: nn.Module, site: str
    ) -> tuple[nn.Module, nn.Module, nn.Module] | None:
        """Fold the linear channels ``L`` of ``second(unit(first(x)))``.

        ``W2 act(W1 x + b1) + b2 = W2[:, N] act(W1[N] x + b1[N]) + (W2[:, L] W1[L]) x
        + W2[:, L] b1[L] + b2``: returns (first', unit', second') with first' a
        :class:`LinearWithPassthrough` (or Identity when fully linear), or ``None`` if the
        split would not lower the cost (the unit is then left for the plain replacement).
        """
        w1, b1 = _dense_wb(first)
        w2, b2 = _dense_wb(second)
        m, d = w1.shape
        d_out = w2.shape[0]
        if unit.num_channels != m or w2.shape[1] != m:
            self.summary.skipped.append(f"{site}: unit width does not match the FFN, not folded")
            return None
        a = _snapped_slopes(unit, self.tol)
        lin = unit.linear_mask(self.tol)
        k = int(lin.sum())
        if k == 0:
            return None
        n = m - k
        rows = math.prod(self.probe.out_shape.get(id(first), (1, m))) // m
        before = 2 * rows * (d * m + m * d_out)
        after = 2 * rows * (d * d_out if n == 0 else d * n + (n + d) * d_out)
        layers_before, layers_after = 2, (1 if n == 0 else 2)
        if not self._better((after, layers_after), (before, layers_before)):
            self.summary.skipped.append(
                f"{site}: {k}/{m} linear channels not folded (FLOPs {before:,} -> {after:,} "
                f"would not lower the {self.objective})"
            )
            return None
        b1 = b1 if b1 is not None else w1.new_zeros(m)
        w_lin = w2[:, lin] @ w1[lin]
        b_lin = w2[:, lin] @ b1[lin] + (b2 if b2 is not None else 0.0)
        if n == 0:
            self.summary.merged.append(
                f"{site}: fully linear FFN merged into one Linear({d}, {d_out}) (FLOPs {before:,} -> {after:,})"
            )
            return nn.Identity(), nn.Identity(), _make_linear(w_lin, b_lin, second)
        keep = ~lin
        new_first = _make_linear(w1[keep], b1[keep], first, cls=LinearWithPassthrough)
        new_second = _make_linear(torch.cat([w2[:, keep], w_lin], 1), b_lin, second)
        ones = a.new_ones(d)
        new_unit = _plain_from_slopes(unit, torch.cat([a[keep], ones]))  # identity on the d
        new_unit.channel_dim = -1  # ChannelPReLU / ChannelBlend: features last
        self.summary.merged.append(
            f"{site}: {k}/{m} linear channels folded into a parallel Linear({d}, {d_out}); "
            f"FFN narrowed to {n} channels (FLOPs {before:,} -> {after:,})"
        )
        return new_first, new_unit, new_second

    # ---- residual blocks
    def fold_inverted_residual(self, block: nn.Module, name: str) -> nn.Module:
        """MobileNet-V2 block whose body merged into one conv: ``x + conv(x)`` -> one conv."""
        body = block.conv
        mods = list(body) if isinstance(body, nn.Sequential) else [body]
        if len(mods) != 1 or not isinstance(mods[0], (*_CONVS, BorderBiasConv, BorderExactConv)):
            return block
        if getattr(block, "use_res_connect", False):
            return self._fold_skip(mods[0], None, name, "inverted residual")
        self.summary.merged.append(f"{name}: inverted residual became one conv (DepthShrinker)")
        return mods[0]

    def _fold_skip(self, conv: nn.Module, shortcut: nn.Module | None, name: str, what: str) -> nn.Module:
        """Add the skip (identity or a 1x1 conv) into ``conv``'s centre tap, if shapes allow."""
        inner = conv.conv if isinstance(conv, (BorderBiasConv, BorderExactConv)) else conv
        reason = _centre_tap_reason(inner, shortcut)
        if reason:
            self.summary.skipped.append(f"{name}: skip of the {what} not folded ({reason})")
            return _Residual(conv, shortcut)
        centre = tuple(k // 2 for k in inner.kernel_size)
        with torch.no_grad():
            g, co = inner.groups, inner.out_channels
            ci_g = inner.in_channels // g
            if shortcut is None:
                skip = torch.eye(co, dtype=torch.float64)
            else:
                skip = shortcut.weight.detach().double().reshape(co, -1)
                if shortcut.bias is not None:
                    inner.bias.add_(shortcut.bias.to(inner.bias.dtype))
            for o in range(co):
                grp = o // (co // g)
                cols = slice(grp * ci_g, (grp + 1) * ci_g)
                inner.weight[(o, slice(None)) + centre] += skip[o, cols].to(inner.weight.dtype)
        self.summary.merged.append(f"{name}: {what} became one conv, skip folded into the centre tap")
        return conv

    def fold_resnet_block(self, block: nn.Module, name: str) -> nn.Module:
        """torchvision BasicBlock / Bottleneck: fold BNs; merge the body if its sites are linear."""
        n_convs = 3 if hasattr(block, "conv3") else 2
        for i in range(1, n_convs + 1):
            self.fold_bn_attr(block, name, f"conv{i}", f"bn{i}")
        if any(isinstance(getattr(block, f"bn{i}"), _BatchNorm) for i in range(1, n_convs + 1)):
            return block  # a BatchNorm that could not fold sits in the body (reason reported)
        calls = _units_of(block.relu)
        # a unit reused for every call (built by hand) shares its slopes between all sites
        inner = calls if len(calls) == 1 else calls[: n_convs - 1]
        if not inner or not all(_linear_unit(u, self.tol) for u in inner):
            return block
        shortcut = None
        if block.downsample is not None:
            mods = list(block.downsample) if isinstance(block.downsample, nn.Sequential) else [block.downsample]
            if len(mods) != 1 or not _is_plain_conv(mods[0]):
                self.summary.skipped.append(f"{name}: linear body not merged (downsample is not one conv)")
                return block
            shortcut = mods[0]
        convs = [getattr(block, f"conv{i}") for i in range(1, n_convs + 1)]
        before = sum(self._map_flops(c) for c in convs)
        after, reason = self._segment_cost(convs)
        if reason:
            self.summary.skipped.append(f"{name}: linear body not merged ({reason})")
            return block
        if not self._better((after, 1), (before, n_convs)):
            self.summary.skipped.append(
                f"{name}: linear body not merged (FLOPs {before:,} -> {after:,.0f} would not lower the {self.objective})"
            )
            return block
        conv, kind = _merge_convs(convs, self.probe.in_shape.get(id(convs[0])))
        self.summary.merged.append(
            f"{name}: linear body conv1..conv{n_convs} merged into one {kind} (FLOPs {before:,} -> {after:,.0f})"
        )
        last_call = calls[-1] if calls else block.relu
        act = _plain_unit(last_call, self.tol) if calls else copy.deepcopy(last_call)
        body = self._fold_skip(conv, shortcut, name, type(block).__name__)
        return nn.Sequential(body, act) if not isinstance(act, nn.Identity) else body


class _Residual(nn.Module):
    """``body(x) + shortcut(x)`` (identity shortcut when ``shortcut`` is ``None``)."""

    def __init__(self, body: nn.Module, shortcut: nn.Module | None) -> None:
        super().__init__()
        self.body = body
        self.shortcut = shortcut if shortcut is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.shortcut(x)


def _centre_tap_reason(conv: nn.Module, shortcut: nn.Module | None) -> str:
    if not isinstance(conv, _CONVS):
        return "not a conv"
    k, p = conv.kernel_size, conv.padding
    if any(ki % 2 == 0 or pi != ki // 2 for ki, pi in zip(k, p)) or any(d != 1 for d in conv.dilation):
        return "the kernel has no centre tap aligned with the input"
    if shortcut is None:
        if conv.in_channels != conv.out_channels or any(s != 1 for s in conv.stride):
            return "shapes change and there is no projection shortcut"
        return ""
    if not (_is_plain_conv(shortcut) and all(kk == 1 for kk in shortcut.kernel_size) and not any(shortcut.padding)
            and shortcut.groups == 1 and tuple(shortcut.stride) == tuple(conv.stride)
            and shortcut.out_channels == conv.out_channels and conv.groups == 1):
        return "the shortcut is not a plain 1x1 conv with the same stride"
    if conv.bias is None:
        return "merged conv has no bias"
    return ""


def _same_family(a: nn.Module, b: nn.Module) -> bool:
    if _is_dense(a) and _is_dense(b):
        return True
    return _is_plain_conv(a) and _is_plain_conv(b) and type(a) is type(b)


def _flatten_sequential(seq: nn.Sequential, prefix: str):
    for child_name, m in seq.named_children():
        full = f"{prefix}.{child_name}" if prefix else child_name
        if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward:
            yield from _flatten_sequential(m, full)
        else:
            yield full, m


def _replace_units(model: nn.Module, tol: float, summary: FoldSummary) -> nn.Module:
    """Swap every remaining unit for its plain module; collapse per-call dispatchers.

    A ``CallSites`` dispatcher (one unit per call of a reused activation) whose calls all
    became the same stateless module (e.g. all ``nn.ReLU``) is replaced by that module, and its
    owner's reset hook is removed; otherwise it stays, holding plain modules only.
    """
    for name, unit in [(n, m) for n, m in model.named_modules() if isinstance(m, LinearizableActivation)]:
        plain = _plain_unit(unit, tol)
        if name == "":
            return plain
        _set(model, name, plain)
        what = "identity (fully linear)" if isinstance(plain, nn.Identity) else type(plain).__name__
        summary.merged.append(f"{name}: unit replaced by {what}")
    for name, m in list(model.named_modules()):
        if name and isinstance(m, CallSites):
            first = m.calls[0]
            stateless = all(
                type(c) is type(first) and repr(c) == repr(first) and not list(c.parameters()) and not list(c.buffers())
                for c in m.calls
            )
            if stateless:
                _set(model, name, first)
    for m in model.modules():
        if any(isinstance(c, CallSites) for c in m.children()):
            continue
        for key, hook in list(m._forward_pre_hooks.items()):
            if hook is _reset_call_sites:
                del m._forward_pre_hooks[key]
        m.__dict__.pop("_linearize_reset_hook", None)
    return model


# ----------------------------------------------------------------------------- public entry


@torch.no_grad()
def _latency(models: list[nn.Module], inputs: Any, budget_s: float = 2.0) -> list[float]:
    """Median wall time (ms) of each model, repetitions interleaved (a, b, a, b, ...)."""
    for m in models:  # warm-up
        call_model(m, inputs)
    t0 = time.perf_counter()
    call_model(models[0], inputs)
    one = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max(budget_s / (len(models) * one), 5), 200))
    times: list[list[float]] = [[] for _ in models]
    for _ in range(reps):
        for i, m in enumerate(models):
            t = time.perf_counter()
            call_model(m, inputs)
            times[i].append(time.perf_counter() - t)
    return [1e3 * statistics.median(t) for t in times]


def fold(
    model: nn.Module,
    example_inputs: Any,
    objective: str = "flops",
    tol: float = 0.0,
    atol: float | None = None,
    rtol: float = 1e-4,
    dtype: torch.dtype | None = None,
    latency: bool = True,
) -> nn.Module:
    """Return a new plain PyTorch model computing ``model``'s function with linear parts folded.

    Args:
        model: a (linearized) model in eval mode; never modified.
        example_inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs, as
            the model's forward takes them (a small real batch); used to record shapes, count
            FLOPs, time both models and verify the result.
        objective: ``"flops"`` merges only where FLOPs drop; ``"depth"`` minimizes the number
            of sequential layers (FLOPs break ties), and also merges two zero-padded convs
            (e.g. a BasicBlock body) into a :class:`BorderExactConv`, unless the map is so
            small that its border correction would cost as much as the two convs.
        tol: in ``[0, 1)``: channels with slope ``a >= 1 - tol`` count as linear, the others with
            ``a <= tol`` as the plain activation (0 keeps the function exact; larger values
            approximate, and the verification tells by how much).
        atol: absolute tolerance of the verification (finite, > 0); default ``rtol * max|reference output|``.
        rtol: relative tolerance (finite, > 0; to the output scale) used when ``atol`` is ``None``.
        dtype: verify in this dtype instead (e.g. ``torch.float64``: copies of both models
            and the inputs are cast, so activation rounding does not blur the comparison; the
            folded weights keep the rounding of the model's own dtype); ``None`` verifies in the
            model's dtype.
        latency: measure CPU latency before and after (median of interleaved repetitions).

    Returns:
        The folded model (eval mode) with ``folded.linearize_fold_summary`` (:class:`FoldSummary`).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: bad ``objective`` / ``tol`` / ``rtol`` / ``atol``, BatchNorm in training mode,
            ``example_inputs`` that the model cannot run, an empty batch, or NaN/inf outputs of
            the model itself (:class:`~linearize.unit.NonFiniteSlopeError` for NaN/inf slopes).
        FoldVerificationError: the folded model differs by more than the tolerance (at the output,
            or at the verified inner signal when the output is zero or the same for every sample;
            see ``FoldSummary.verified_on``), or no signal that varies can be verified.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fold expects an nn.Module, got {type(model).__name__}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    tol = check_tol(tol)
    rtol = check_positive(rtol, "rtol")
    atol = None if atol is None else check_positive(atol, "atol")
    training_bn = [n for n, m in model.named_modules() if isinstance(m, _BatchNorm) and m.training]
    if training_bn:
        raise ValueError(
            f"fold needs BatchNorm eval statistics, but {training_bn[0]!r} (and {len(training_bn) - 1} "
            "more) is in training mode: call model.eval() before linearize.fold"
        )
    if example_inputs is None:
        raise ValueError("fold needs example_inputs (a batch shaped like the model's real inputs)")
    if _is_empty_batch(example_inputs):
        raise ValueError(
            f"example_inputs {_describe_inputs(example_inputs)} is an empty batch: fold verifies the "
            "folded model on it, so pass at least one sample"
        )
    check_finite_slopes(units(model), "fold")

    summary = FoldSummary(objective=objective, tol=tol)
    folded = copy.deepcopy(model).eval()
    probe = _Probe({}, {}, {}, list(folded.modules()))
    before_fold = dict(folded.named_modules())  # path -> layer, to find the layers fold left alone
    try:  # the untouched eval copy gives the reference output, shapes and FLOPs in one forward
        summary.flops_before, reference = _run_counting(folded, example_inputs, probe)
    except Exception as exc:  # the model's own error, re-raised with what to do
        raise ValueError(
            f"example_inputs {_describe_inputs(example_inputs)} do not fit the model "
            f"({type(exc).__name__}: {exc}); pass a batch shaped like its real inputs"
        ) from exc
    ref_out = _flatten_outputs(reference)
    if not ref_out:
        raise ValueError("the model returned no floating-point tensor to verify against")
    _check_reference(ref_out, example_inputs)
    summary.units_before = sum(isinstance(m, LinearizableActivation) for m in folded.modules())
    summary.params_before = sum(p.numel() for p in model.parameters())
    if summary.units_before == 0:
        msg = "the model has no linearize units (never converted): folded BatchNorm only"
        summary.skipped.append(msg)
        warnings.warn(msg + "; call linearize.convert(model) and train it to fold more", stacklevel=2)

    folded = _Folder(objective, tol, probe, summary).run(folded)
    folded = _replace_units(folded, tol, summary)
    summary.skipped = list(dict.fromkeys(summary.skipped))
    folded.eval()
    for attr in ("linearize_config", "linearize_report"):  # the result has no units
        folded.__dict__.pop(attr, None)
    summary.units_left = sum(isinstance(m, LinearizableActivation) for m in folded.modules())
    summary.params_after = sum(p.numel() for p in folded.parameters())
    summary.flops_after, output = _run_counting(folded, example_inputs)

    untouched = functools.partial(_untouched_layers, model, folded, before_fold, probe)
    _verify(model, folded, example_inputs, ref_out, _flatten_outputs(output), summary, atol, rtol, dtype, untouched)
    if latency:
        was_training = model.training
        try:
            model.eval()
            summary.latency_ms_before, summary.latency_ms_after = _latency([model, folded], example_inputs)
        finally:
            model.train(was_training)
    folded.linearize_fold_summary = summary
    return folded


@torch.no_grad()
def _verify(
    model: nn.Module,
    folded: nn.Module,
    inputs: Any,
    ref_out: list[torch.Tensor],
    new_out: list[torch.Tensor],
    summary: FoldSummary,
    atol: float | None,
    rtol: float,
    dtype: torch.dtype | None,
    untouched: Callable[[], list[str]] = list,
) -> None:
    """Compare the outputs (raise :class:`FoldVerificationError` beyond the tolerance); when they
    cannot tell a wrong fold from a right one, compare an inner signal too (:func:`_verify_signal`)."""
    model_v, folded_v = model, folded
    if dtype is not None:
        model_v, folded_v = copy.deepcopy(model).to(dtype).eval(), copy.deepcopy(folded).to(dtype).eval()
        inputs = _cast_inputs(inputs, dtype)
        ref_out = _flatten_outputs(call_model(model_v, inputs))
        new_out = _flatten_outputs(call_model(folded_v, inputs))
    summary.verify_dtype = str(dtype or ref_out[0].dtype)
    _check_reference(ref_out, inputs)
    if len(new_out) != len(ref_out) or any(a.shape != b.shape for a, b in zip(ref_out, new_out)):
        raise FoldVerificationError(
            f"folded model returns shapes {[tuple(t.shape) for t in new_out]}, expected "
            f"{[tuple(t.shape) for t in ref_out]}"
        )
    if not all(bool(torch.isfinite(t).all()) for t in new_out):
        raise FoldVerificationError(
            f"the folded model outputs NaN/inf where the model's outputs are finite (verified in "
            f"{summary.verify_dtype}): not a tolerance problem but an overflow of merged weights in this "
            "dtype (try dtype=torch.float64) or a wrong fold rule (please report this model). "
            "Decisions:\n" + "\n".join(summary.merged)
        )
    err = max(float((a.double() - b.double()).abs().max()) for a, b in zip(ref_out, new_out))
    scale = max(float(a.double().abs().max()) for a in ref_out)
    summary.max_abs_error, summary.output_scale = err, scale
    summary.tolerance = atol if atol is not None else rtol * max(scale, _ZERO)
    if not err <= summary.tolerance:
        raise FoldVerificationError(
            f"folded model differs by {err:.3g} (output scale {scale:.3g}, tolerance "
            f"{summary.tolerance:.3g}); with tol={summary.tol} near-linear channels were snapped, "
            "lower tol or raise rtol/atol. Decisions:\n" + "\n".join(summary.merged)
        )
    why = _vacuous(ref_out, rtol, inputs)
    if why:
        _verify_signal(model_v, folded_v, inputs, untouched(), summary, rtol, why)


_ZERO = 1e-12  # an output scale at or below this is zero: it verifies nothing (the tolerance floor)


def _row_spread(t: torch.Tensor) -> float:
    """Largest difference between a sample (row) of ``t`` and the first one (0 for one row)."""
    if t.ndim == 0 or t.shape[0] < 2:
        return 0.0
    return float((t.double() - t[:1].double()).abs().max())


def _samples_differ(inputs: Any) -> bool:
    """Whether some input tensor has two different samples (rows)."""
    tensors = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, (tuple, list)) else [inputs]
    return any(isinstance(t, torch.Tensor) and _row_spread(t) > 0 for t in tensors)


def _vacuous(signal: list[torch.Tensor], rtol: float, inputs: Any) -> str:
    """Why ``signal`` cannot tell a wrong fold from a right one ("" if it can): it is zero (below
    ``_ZERO``), or every sample gives the same values (within ``rtol`` times the scale) although the
    samples of ``inputs`` differ: the model ignores its input there (a zero-weight head)."""
    scale = max(float(t.double().abs().max()) for t in signal)
    if scale <= _ZERO:
        return "zero"
    if _samples_differ(inputs) and max(_row_spread(t) for t in signal) <= rtol * scale:
        return "the same for every sample of example_inputs"
    return ""


def _untouched_layers(model: nn.Module, folded: nn.Module, before: dict[str, nn.Module], probe: _Probe) -> list[str]:
    """Paths of the leaf layers that fold left alone: the same layer object at the same path, called
    once, with the same parameters and buffers as in ``model`` (their input is the same signal)."""
    original = dict(model.named_modules())
    paths = []
    for path, m in folded.named_modules():
        if next(m.children(), None) is not None or before.get(path) is not m or not probe.once(m):
            continue
        mine, theirs = m.state_dict(), original[path].state_dict() if path in original else None
        if theirs is not None and mine.keys() == theirs.keys() and all(
            mine[k].shape == theirs[k].shape and torch.equal(mine[k], theirs[k].to(mine[k].device)) for k in mine
        ):
            paths.append(path)
    return paths


def _layer_inputs(model: nn.Module, paths: list[str], inputs: Any) -> dict[str, torch.Tensor]:
    """The first floating-point input of each layer at ``paths`` in one forward, in call order; a
    layer fed one of ``inputs`` itself is left out (that signal verifies nothing)."""
    seen: dict[str, torch.Tensor] = {}
    given = {id(t) for t in _flatten_outputs(inputs)}

    def hook_for(path: str):
        def hook(m: nn.Module, args: tuple) -> None:
            x = args[0] if args else None
            if path not in seen and isinstance(x, torch.Tensor) and x.is_floating_point() and id(x) not in given:
                seen[path] = x.detach().clone()
        return hook

    handles = [model.get_submodule(p).register_forward_pre_hook(hook_for(p)) for p in paths]
    try:
        call_model(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def _verify_signal(
    model: nn.Module, folded: nn.Module, inputs: Any, paths: list[str], summary: FoldSummary, rtol: float, why: str
) -> None:
    """Verify the input of the last untouched layer (``paths``) whose input is not vacuous either
    (:func:`_vacuous` with ``rtol`` times its scale); raise :class:`FoldVerificationError` if none is."""
    ref, new = _layer_inputs(model, paths, inputs), _layer_inputs(folded, paths, inputs)
    for path in reversed(list(ref)):
        a, b = ref[path], new.get(path)
        scale = float(a.double().abs().max())
        if b is None or b.shape != a.shape or _vacuous([a], rtol, inputs):
            continue
        err = float((a.double() - b.double()).abs().max()) if bool(torch.isfinite(b).all()) else math.inf
        summary.verified_on, summary.verified_why = f"input of {path!r}", f"the output is {why}"
        summary.signal_error, summary.signal_scale, summary.signal_tolerance = err, scale, rtol * scale
        if not err <= rtol * scale:
            raise FoldVerificationError(
                f"folded model differs by {err:.3g} at the input of {path!r} (scale {scale:.3g}, tolerance "
                f"{rtol * scale:.3g}), verified there because the output is {why} and cannot show it. "
                "Decisions:\n" + "\n".join(summary.merged)
            )
        return
    raise FoldVerificationError(
        f"fold cannot verify the folded model: its output on example_inputs {_describe_inputs(inputs)} is {why}, "
        "and no layer input that fold left untouched varies either. Pass example_inputs with at least 2 "
        "different samples, or give the model a head that is not zero (e.g. a random one) to verify the fold"
    )
