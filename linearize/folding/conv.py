"""Conv algebra: two convs as one (float64, grouped and depthwise kept grouped), which merges are
exact at the zero-padded border, and the border-exact family that makes the others exact:
:class:`BorderBiasConv` (a biased 1x1 conv before zero padding) and :class:`BorderExactConv` (any two
zero-padded convs: the merged conv minus an exact correction computed on thin border strips).

Border exactness of ``Conv o Conv``: the second conv zero-pads the *intermediate* map, the merged
conv pads the *input*. The merge is exact when the second conv has no padding, or when the first
conv is pointwise (1x1, no padding): then the padded intermediate is the first conv's bias only,
and :class:`BorderBiasConv` adds the exact position-dependent bias. Any other pair across zero
padding (e.g. 3x3 pad 1 o 3x3 pad 1, a torchvision BasicBlock) needs a :class:`BorderExactConv`.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import CONV_BY_DIM, is_plain_conv

__all__ = ["BorderBiasConv", "BorderExactConv", "ConvDesc", "border_flops", "merge_convs", "chain_plan",
           "needs_border_correction"]

_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


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
        """``[1, C_out, *out_spatial]`` bias for an input of spatial size ``spatial`` (cached on the bias's
        identity and version; not for an inference tensor, which has no version)."""
        bias = self.tap_bias
        key = None if bias.is_inference() else (spatial, like.dtype, like.device, id(bias), bias._version)
        if key is None or key not in self._cache:
            inner = [(n - 1) // s + 1 for n, s in zip(spatial, self.inner_stride)]
            ones = torch.ones(1, 1, *inner, dtype=like.dtype, device=like.device)
            out = _CONV_FN[len(spatial)](ones, bias.to(like.dtype), None, self.stride, self.padding, self.dilation)
            if key is None:
                return out
            self._cache = {key: out}
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
        if not (is_plain_conv(first) and is_plain_conv(second) and type(first) is type(second)):
            raise ValueError("BorderExactConv merges two plain zero-padded convs of the same dimension")
        if first.out_channels != second.in_channels:
            raise ValueError(f"channel mismatch: {first.out_channels} -> {second.in_channels}")

    @classmethod
    def merge(cls, first: nn.Module, second: nn.Module) -> "BorderExactConv":
        """Build the merged conv of ``second o first`` (float64 algebra) and wrap it."""
        cls._check(first, second)
        desc, _ = _compose_convs(ConvDesc.of(first), ConvDesc.of(second), extended=True)
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


def border_flops(spatial: tuple[int, ...], batch: int, first: ConvDesc, second: ConvDesc) -> int:
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

@dataclass
class ConvDesc:
    """A conv as tensors (float64): weight ``[C_out, C_in / groups, *k]``, bias, geometry."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    @classmethod
    def of(cls, conv: nn.Module) -> "ConvDesc":
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


def _conv_geometry(first: ConvDesc, second: ConvDesc) -> tuple[tuple[int, ...], tuple, tuple, int]:
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
    first: ConvDesc, second: ConvDesc, extended: bool = False
) -> tuple[ConvDesc, torch.Tensor | None]:
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
    merged = ConvDesc(weight, bias, stride, padding, (1,) * len(kernel), g)
    return merged, tap_bias


def needs_border_correction(convs: list[ConvDesc]) -> bool:
    """Two convs whose merge crosses zero padding after a non-pointwise conv (:class:`BorderExactConv`)."""
    return len(convs) == 2 and any(convs[1].padding) and not convs[0].pointwise


def chain_plan(convs: list[ConvDesc], border_exact: bool = False) -> tuple[ConvDesc | None, str]:
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
        right = ConvDesc(torch.empty(shape, device="meta"), right.bias, stride, padding, (1,) * len(kernel), g)
    return right, ""


def _build_conv(desc: ConvDesc, like: nn.Module) -> nn.Module:
    dim = desc.weight.ndim - 2
    conv = CONV_BY_DIM[dim](
        desc.in_channels, desc.out_channels, desc.kernel, stride=desc.stride, padding=desc.padding,
        dilation=desc.dilation, groups=desc.groups, bias=desc.bias is not None,
        device=like.weight.device, dtype=like.weight.dtype,
    )
    with torch.no_grad():
        conv.weight.copy_(desc.weight)
        if desc.bias is not None:
            conv.bias.copy_(desc.bias)
    return conv


def merge_convs(convs: list[nn.Module], in_shape: tuple | None) -> tuple[nn.Module, str]:
    """Merge real convs (right to left, planned by :func:`chain_plan`) into one module.

    Returns the module and its description: a conv; a :class:`BorderBiasConv` (its bias map
    precomputed for ``in_shape``, a one-time cost kept out of the FLOP count); or a
    :class:`BorderExactConv` for two convs across zero padding.
    """
    descs = [ConvDesc.of(c) for c in convs]
    if needs_border_correction(descs):
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
