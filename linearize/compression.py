"""Lossless compression on a domain (seed 004: Serra, Kumar, Ramalingam), from :func:`linearize.stable_units`.

:func:`compress` then builds a smaller plain model computing the same function on the domain. In
the MLP part, stably inactive ReLU units are removed, the stably linear ones are reduced to a
linearly independent subset (the others are re-expressed in the next layer), and a layer whose
units are all linear is folded into the next one (``W2 diag(c) W1``). In a conv part, channels
that are stably inactive at every position are dropped from the producing and consuming layers.
The result is verified by sampling the box and on data.

Supported models: those of :mod:`linearize.stability`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ._optional import require
from .checks import FoldVerificationError, check_positive, check_positive_int
from .inputs import Batches, eval_mode, inputs_fit, model_device, to_device
from .stability import BOX_FIX, MLP_TYPES, StabilityResult, as_box, build_network, stable_units

__all__ = ["compress", "CompressionReport"]


@dataclass
class CompressionReport:
    """What :func:`compress` did (attached to the returned model as ``.compression_report``).

    Counts are neurons (units) of the hidden activation sites. ``removed_inactive``: stably
    inactive ReLU units dropped; ``removed_linear``: stably linear units re-expressed through a
    linearly independent subset of their layer; ``folded``: units of layers whose units were all
    linear, folded with the next layer (``folded_sites`` names them). ``max_error`` is the largest
    absolute output difference seen on ``verified_samples`` inputs, ``output_scale`` the largest
    absolute output there.
    """

    method: str
    units_before: int
    units_after: int
    removed_inactive: int
    removed_linear: int
    folded: int
    folded_sites: list[str]
    sites: dict[str, dict]
    max_error: float
    output_scale: float
    verified_samples: int
    stability: StabilityResult = field(repr=False)

    @property
    def removed(self) -> int:
        return self.units_before - self.units_after

    @property
    def removed_fraction(self) -> float:
        return self.removed / max(self.units_before, 1)


def _independent_rows(A: torch.Tensor, rank_tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the rows of ``A`` [s, n] into a linearly independent subset ``R`` (indices) and a
    matrix ``T`` [s, |R|] with ``A = T @ A[R]`` (checked; rows that do not fit stay independent)."""
    require("scipy", what="compress")
    import scipy.linalg

    if A.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, 0, dtype=A.dtype)
    _, R, piv = scipy.linalg.qr(A.T.numpy(), mode="economic", pivoting=True)
    diag = np.abs(np.diag(R))
    scale = max(float(np.abs(A).max()), 1e-300)
    rank = int((diag > rank_tol * scale * max(A.shape)).sum())
    keep = torch.from_numpy(np.sort(piv[:rank])).long()
    if rank == 0:
        T = torch.zeros(A.shape[0], 0, dtype=A.dtype)
    else:
        T = torch.linalg.lstsq(A[keep].T, A.T).solution.T  # [s, r]
    misfit = (T @ A[keep] - A).abs().amax(dim=1) > rank_tol * scale * 10
    if misfit.any():  # numerically doubtful: keep those rows too and refit
        keep = torch.unique(torch.cat([keep, misfit.nonzero().flatten()]))
        T = torch.linalg.lstsq(A[keep].T, A.T).solution.T
    T[keep] = torch.eye(keep.numel(), dtype=A.dtype)
    return keep, T


def _plain_activation(w: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    if (w == 0).all():
        return nn.ReLU()
    act = nn.PReLU(w.numel())
    with torch.no_grad():
        act.weight.copy_(w.to(dtype))
    return act


def _plain_linear(W: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> nn.Linear:
    lin = nn.Linear(W.shape[1], W.shape[0], dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(W)
        lin.bias.copy_(b)
    return lin


def _verification_batches(box, datasets, samples: int, seed: int, batch: int = 1024):
    if box is not None and samples > 0:
        lower, upper = box
        gen = torch.Generator().manual_seed(seed)
        corners = torch.stack([lower, upper, (lower + upper) / 2])
        yield corners
        for start in range(0, samples, batch):
            n = min(batch, samples - start)
            yield lower + (upper - lower) * torch.rand(n, *lower.shape, generator=gen, dtype=torch.float64)
    for data in datasets:
        yield from data


def _max_error(original: nn.Module, small: nn.Module, batches) -> tuple[float, float, int]:
    err, scale, count = 0.0, 0.0, 0
    dtype = next(small.parameters()).dtype
    device = model_device(original)
    with eval_mode(original), torch.no_grad():
        for x in batches:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"compress verifies on tensor inputs, got {type(x).__name__}")
            if x.shape[0] == 0:
                continue
            x = x.to(dtype)
            y0 = original(to_device(x, device)).double().cpu()
            y1 = small(x.cpu()).double()
            if not bool(torch.isfinite(y0).all()):  # a NaN difference would be dropped by max() below
                raise ValueError("compress: the model's own output has NaN/inf values on the verification "
                                 "inputs, so nothing can be verified; check its weights and the domain")
            if not bool(torch.isfinite(y1).all()):
                raise FoldVerificationError("compress: the compressed model outputs NaN/inf where the model's "
                                            "outputs are finite; please report this model")
            err = max(err, float((y0 - y1).abs().max()))
            scale = max(scale, float(y0.abs().max()))
            count += x.shape[0]
    return err, scale, count


def _mlp_part(affines, sites, stability, start, in_cols, rank_tol, dtype):
    """Compressed layers for the MLP suffix ``affine_start, site_start, ..., affine_L`` (dense).

    ``in_cols`` (bool) selects the input columns of ``affine_start`` that survive (channels
    removed before). Returns ``(layers, stats, folded_sites)``."""
    Ws, bs, kept_w = [affines[start].W[:, in_cols]], [affines[start].b], []
    stats, folded_sites = {}, []
    for k in range(start, len(sites)):
        site = sites[k]
        st = stability.sites[site.name]
        act, ina, w = st.active.reshape(-1), st.inactive.reshape(-1), site.w
        W_in, b_in = Ws[-1], bs[-1]
        W_out, b_out = affines[k + 1].W.clone(), affines[k + 1].b.clone()
        linear = act | ina | (w == 1)
        coef = torch.where(ina, w, torch.ones_like(w))  # output = coef * z on the domain
        m = w.numel()
        if linear.all():
            Ws[-1] = W_out @ (coef[:, None] * W_in)
            bs[-1] = W_out @ (coef * b_in) + b_out
            folded_sites.append(site.name)
            stats[site.name] = {"before": m, "after": 0, "removed_inactive": 0, "removed_linear": 0, "folded": m}
            continue
        drop = ina & (w == 0)
        lin = (linear & ~drop).nonzero().flatten()
        keep_rows, T = _independent_rows(W_in[lin], rank_tol)
        dep = torch.ones(lin.numel(), dtype=torch.bool)
        dep[keep_rows] = False
        R, D = lin[keep_rows], lin[dep]
        if D.numel():
            # h_D = c_D (T_D W_R h + b_D) = c_D T_D (h_R / c_R - b_R) + c_D b_D on the domain
            T_D = T[dep]
            b_out = b_out + W_out[:, D] @ (coef[D] * (b_in[D] - T_D @ b_in[R]))
            W_out[:, R] += W_out[:, D] @ (coef[D, None] * T_D / coef[None, R])
        keep = ~drop
        keep[D] = False
        Ws[-1], bs[-1] = W_in[keep], b_in[keep]
        kept_w.append(w[keep])
        Ws.append(W_out[:, keep])
        bs.append(b_out)
        stats[site.name] = {"before": m, "after": int(keep.sum()), "removed_inactive": int(drop.sum()),
                            "removed_linear": int(D.numel()), "folded": 0}
    layers: list[nn.Module] = [nn.Flatten()] if len(affines[start].in_shape) > 1 else []
    for i, (W, b) in enumerate(zip(Ws, bs)):
        layers.append(_plain_linear(W, b, dtype))
        if i < len(kept_w):
            layers.append(_plain_activation(kept_w[i], dtype))
    out_shape = affines[-1].out_shape
    if len(out_shape) > 1:
        layers.append(nn.Unflatten(1, out_shape))
    return layers, stats, folded_sites


_PER_CHANNEL = (nn.Identity, nn.Dropout, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d)


def _conv_producer(block: list[nn.Module]) -> tuple[int, list[int]] | None:
    """Index of the conv producing a site's channels (last conv of the block) and the indices of
    the batch norms between it and the site; ``None`` if the channels cannot be traced."""
    norms = []
    for i in range(len(block) - 1, -1, -1):
        m = block[i]
        if isinstance(m, (nn.Conv1d, nn.Conv2d)):
            return (i, norms) if m.groups == 1 else None
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            norms.append(i)
        elif not isinstance(m, _PER_CHANNEL):
            return None
    return None


def _conv_consumer(block: list[nn.Module]) -> int | None:
    """Index of the conv consuming a site's channels, if only zero-preserving per-channel ops
    (pooling by averages, dropout) come before it."""
    for i, m in enumerate(block):
        if isinstance(m, (nn.Conv1d, nn.Conv2d)):
            return i if m.groups == 1 else None
        if not isinstance(m, _PER_CHANNEL):
            return None
    return None


def _slice_channels(m: nn.Module, keep: torch.Tensor, dim: int) -> None:
    """Keep channels ``keep`` of a conv (``dim`` 0 = outputs, 1 = inputs) or batch norm, in place."""
    with torch.no_grad():
        for pname in ("weight",) if dim == 1 else ("weight", "bias", "running_mean", "running_var"):
            t = getattr(m, pname, None)
            if t is None:
                continue
            sliced = t.index_select(dim if t.ndim > 1 else 0, keep.to(t.device))
            if isinstance(t, nn.Parameter):
                setattr(m, pname, nn.Parameter(sliced, requires_grad=t.requires_grad))
            else:
                setattr(m, pname, sliced)
    if isinstance(m, (nn.Conv1d, nn.Conv2d)):
        if dim == 0:
            m.out_channels = keep.numel()
        else:
            m.in_channels = keep.numel()
    else:
        m.num_features = keep.numel()


def _conv_part(affines, sites, stability, stop, dense_tail, dtype):
    """Copies of the conv prefix ``affine_0, site_0, ..., site_{stop-1}`` (and ``affine_stop``
    unless ``dense_tail``: then the dense MLP part consumes the last site) with dead channels
    (stably inactive at every position, ReLU) dropped from their producer and consumer convs.

    Returns ``(layers, stats, keep)``: ``keep`` (bool ``[C]``) marks the surviving channels of the
    last prefix site."""
    blocks = [[copy.deepcopy(m) for _, m in aff.modules] for aff in affines[:stop + 1]]
    site_w = [s.w.view(s.shape).movedim(s.channel_dim, 0).reshape(s.shape[s.channel_dim], -1)[:, 0]
              for s in sites[:stop]]
    stats, keeps = {}, []
    for k in range(stop):
        site = sites[k]
        _, inactive = stability.sites[site.name].channel_masks()
        dead = inactive & (site_w[k] == 0)
        keep = ~dead
        producer = _conv_producer(blocks[k])
        consumer = -1 if dense_tail and k + 1 == stop else _conv_consumer(blocks[k + 1])  # -1: dense
        if not dead.any() or keep.sum() == 0 or producer is None or consumer is None or site.channel_dim != 0:
            keep = torch.ones_like(keep)
        else:
            idx = keep.nonzero().flatten()
            conv_i, norm_is = producer
            _slice_channels(blocks[k][conv_i], idx, 0)
            for i in norm_is:
                _slice_channels(blocks[k][i], idx, 0)
            if consumer >= 0:
                _slice_channels(blocks[k + 1][consumer], idx, 1)
            site_w[k] = site_w[k][keep]
        keeps.append(keep)
        stats[site.name] = {"before": keep.numel(), "after": int(keep.sum()),
                            "removed_inactive": int((~keep).sum()), "removed_linear": 0, "folded": 0}
    layers = []
    for k in range(stop):
        layers += blocks[k]
        layers.append(_plain_activation(site_w[k], dtype))
    if not dense_tail:
        layers += blocks[stop]
    return layers, stats, keeps[-1]


def compress(
    model: nn.Module,
    domain: Any,
    method: str | None = None,
    *,
    data: Any = None,
    samples: int = 4096,
    rtol: float = 1e-4,
    rank_tol: float = 1e-9,
    seed: int = 0,
    progress: bool = False,
) -> nn.Sequential:
    """A smaller plain model (new; ``model`` is untouched) equal to ``model`` on ``domain``.

    MLP layers: stably inactive ReLU units (``w = 0``) are dropped from the producing and the
    consuming layer; stably linear units (active, or inactive with PReLU slope ``w > 0``) of a
    layer are reduced to a linearly independent subset, the others re-expressed in the next layer
    (when ``rank W[S] < |S|``); a layer whose units are all linear is folded with the next one
    (``W2 diag(c) W1``). Conv layers (before the MLP head): channels stably inactive at every
    position are dropped from the producing conv (and batch norm) and the consuming conv or linear
    layer. Units that stay become ``nn.ReLU`` (or ``nn.PReLU`` with their slopes).

    Args:
        model: an ``nn.Sequential`` as for :func:`stable_units`.
        domain: an input :class:`~linearize.Box` or data whose inputs are tensors (a tuple is
            data; see :func:`stable_units`).
        method: how to find stable units (see :func:`stable_units`; ``"crown"`` for a box).
        data: extra data to verify on (any form of :mod:`linearize.inputs`, tensor inputs).
        samples: uniform samples of the box (plus its two extreme corners and centre) to verify on.
        rtol: allowed max abs output difference, relative to the largest abs output seen.
        rank_tol: relative tolerance of the rank of a layer's linear rows.
        progress: tqdm progress bars.

    Returns: the compressed ``nn.Sequential`` with a ``.compression_report``
    (:class:`CompressionReport`; conv sites count channels, MLP sites neurons). Raises
    :class:`~linearize.folding.FoldVerificationError` (a ``RuntimeError``, as :func:`linearize.fold`)
    if verification finds a difference, ``ValueError`` when nothing could be verified.

    Example:
        >>> net = nn.Sequential(nn.Linear(1, 2), nn.ReLU(), nn.Linear(2, 1)).eval()
        >>> _ = net[0].weight.data.fill_(1.0), net[0].bias.data.copy_(torch.tensor([2.0, -2.0]))
        >>> from linearize import Box
        >>> small = compress(net, Box(torch.tensor([-1.0]), torch.tensor([1.0])))  # on [-1, 1]: one ReLU on, one off
        >>> small, small.compression_report.units_after
        (Sequential(
          (0): Linear(in_features=1, out_features=1, bias=True)
        ), 0)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    rtol = check_positive(rtol, "rtol")
    rank_tol = check_positive(rank_tol, "rank_tol")
    samples = check_positive_int(samples, "samples")
    box = as_box(domain, method, "compress")
    if box is not None:
        domain, in_shape = box, tuple(box.lower.shape)
    else:
        domain = Batches.of(domain, "domain")
        first = next(iter(domain))
        if not isinstance(first, torch.Tensor):
            raise TypeError(f"compress runs an nn.Sequential on one input tensor: give data whose inputs are "
                            f"tensors (a tensor batch, (x, y) pairs, a loader of them), got {type(first).__name__}")
        in_shape = tuple(first.shape[1:])
    with inputs_fit(box.lower, "Box bounds", BOX_FIX) if box is not None else inputs_fit(first, "data batch"):
        affines, sites = build_network(model, in_shape)
    stability = stable_units(model, domain, method, progress=progress)
    dtype = next(model.parameters()).dtype
    # the MLP head: the affine blocks from `start` on hold only Linear/BatchNorm1d/Flatten/...
    start = len(affines)
    while start > 0 and all(isinstance(m, MLP_TYPES) for _, m in affines[start - 1].modules):
        start -= 1
    if start == 0:
        layers, stats, folded = _mlp_part(affines, sites, stability, 0, slice(None), rank_tol, dtype)
    else:
        dense_tail = start < len(affines)
        stop = start if dense_tail else len(sites)
        layers, stats, keep = _conv_part(affines, sites, stability, stop, dense_tail, dtype)
        folded = []
        if dense_tail:
            cols = keep.view([-1] + [1] * (len(sites[stop - 1].shape) - 1)).expand(sites[stop - 1].shape)
            mlp_layers, mlp_stats, folded = _mlp_part(affines, sites, stability, start, cols.reshape(-1),
                                                      rank_tol, dtype)
            layers += mlp_layers
            stats.update(mlp_stats)
    small = nn.Sequential(*layers).eval()
    datasets = ([] if box is not None else [domain]) + ([] if data is None else [Batches.of(data)])
    err, scale, count = _max_error(model, small, _verification_batches(box, datasets, samples, seed))
    if count == 0:
        raise ValueError("compress: the verification data holds no sample (empty batches); pass data with samples")
    zero = torch.finfo(dtype).tiny  # the smallest normal number: below it an output has no relative precision
    if scale <= zero:  # every output is zero: any compressed model would pass, so nothing is verified
        raise FoldVerificationError(
            f"compress cannot verify the compressed model: the model's output is zero on all {count} samples (its "
            f"largest magnitude {scale:.3g} is at most {zero:.3g}, the smallest normal {dtype}). If it is meant to "
            "be 0 (a zero-initialised last layer), give it a last layer that is not zero to compress it; if its "
            "values are merely that small, scale its inputs (the domain) or its last layer up"
        )
    if err > rtol * scale:
        raise FoldVerificationError(
            f"compression is not lossless: max abs output difference {err:.3g} at output scale {scale:.3g} "
            f"on {count} samples (rtol {rtol}); please report this model"
        )
    total = lambda key: sum(s[key] for s in stats.values())  # noqa: E731
    small.compression_report = CompressionReport(
        method=stability.method, units_before=total("before"), units_after=total("after"),
        removed_inactive=total("removed_inactive"), removed_linear=total("removed_linear"),
        folded=total("folded"), folded_sites=folded, sites=stats, max_error=err,
        output_scale=scale, verified_samples=count, stability=stability,
    )
    return small
