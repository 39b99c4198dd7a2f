"""Stable units over a domain and lossless compression (seed 004: Serra, Kumar, Ramalingam).

A ReLU/PReLU unit is *stably inactive* on a domain when its pre-activation is ``<= 0`` for every
input of the domain, and *stably active* when it is ``>= 0``. Either way the unit is linear there:
an active unit outputs ``z``, an inactive PReLU unit with negative slope ``w`` outputs ``w * z``
(exactly ``0`` for a ReLU, ``w = 0``). :func:`stable_units` finds them over an input box with
interval bound propagation (``"ibp"``), a CROWN-style linear relaxation with back-substitution
(``"crown"``), or exact per-neuron mixed-integer programs (``"milp"``, ``scipy.optimize.milp``,
small MLPs), or over data (``"data"``). The box methods are sound: a unit they call stable is
stable for every input of the box (bounds are computed in float64).

:func:`compress` then builds a smaller plain model computing the same function on the domain. In
the MLP part, stably inactive ReLU units are removed, the stably linear ones are reduced to a
linearly independent subset (the others are re-expressed in the next layer), and a layer whose
units are all linear is folded into the next one (``W2 diag(c) W1``). In a conv part, channels
that are stably inactive at every position are dropped from the producing and consuming layers.
The result is verified by sampling the box and on data.

Supported models: ``nn.Sequential`` chains (nested ones too) of ``Linear``, ``Conv1d``/``Conv2d``,
``BatchNorm1d``/``BatchNorm2d`` (eval), ``AvgPool``, ``Flatten``/``Unflatten``, ``Dropout`` (eval),
``Identity`` and the activation sites: PReLU-kind ``LinearizableActivation`` units, ``nn.ReLU``,
``nn.LeakyReLU``, ``nn.PReLU`` (negative slopes in ``[0, 1]``). Affine parts between activation
sites are handled as dense float64 matrices, so conv nets must be small (a few thousand neurons).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ._optional import require
from .checks import FoldVerificationError, NonFiniteSlopeError, check_positive, check_positive_int
from .inputs import Batches, eval_mode, model_device, record_preactivations, site_channel_dim, to_device
from .unit import LinearizableActivation, check_finite_slopes

__all__ = [
    "stable_units",
    "compress",
    "StabilityResult",
    "SiteStability",
    "CompressionReport",
    "record_preactivations",
]

METHODS = ("ibp", "crown", "milp", "data")
_AFFINE_TYPES = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d, nn.Flatten, nn.Unflatten,
    nn.Identity, nn.Dropout, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
)
_MLP_TYPES = (nn.Linear, nn.BatchNorm1d, nn.Flatten, nn.Identity, nn.Dropout)
_SITE_TYPES = (LinearizableActivation, nn.ReLU, nn.LeakyReLU, nn.PReLU)
_MAX_DENSE = 20_000_000  # entries of one dense affine block (160 MB in float64)
_MILP_SLACK = 1e-7  # relative widening of MILP bounds, above HiGHS feasibility tolerances


# ----------------------------------------------------------------------------- sites


def _site_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Units and ReLU-like modules, except the activation held inside a unit."""
    found, inside = [], ()
    for name, m in model.named_modules():
        if isinstance(m, _SITE_TYPES) and not (inside and name.startswith(inside)):
            found.append((name, m))
            if isinstance(m, LinearizableActivation):
                inside = inside + (f"{name}.",)
    return found


# ----------------------------------------------------------------------------- the network


@dataclass
class _Site:
    name: str
    module: nn.Module
    shape: tuple[int, ...]  # input shape without the batch dim
    w: torch.Tensor  # float64 [n]: negative slope of every neuron (flattened)
    channel_dim: int  # channel dim of ``shape``


@dataclass
class _Affine:
    modules: list[tuple[str, nn.Module]]
    W: torch.Tensor  # float64 [out, in]
    b: torch.Tensor  # float64 [out]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


def _flatten_chain(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    if isinstance(model, nn.Sequential):
        out = []
        for name, child in model.named_children():
            out += _flatten_chain(child, f"{prefix}.{name}" if prefix else name)
        return out
    if isinstance(model, _SITE_TYPES + _AFFINE_TYPES):
        return [(prefix, model)]
    raise TypeError(
        f"stable_units/compress support nn.Sequential chains of Linear, Conv, BatchNorm (eval), "
        f"Flatten, pooling by averages, Dropout and ReLU/PReLU sites; got {type(model).__name__} "
        f"at {prefix or 'the top level'!r}. Use method='data' (any model) instead."
    )


def _negative_slopes(module: nn.Module, name: str) -> torch.Tensor:
    """Per-channel negative slope ``w`` (float64 [C] or [1]) of a ReLU/PReLU site."""
    if isinstance(module, LinearizableActivation):
        if not module.is_prelu:
            raise TypeError(
                f"site {name!r} is a {module.kind} unit: bound propagation needs ReLU/PReLU units "
                "(use method='data' for other activations)"
            )
        check_finite_slopes([(name, module)], "stable_units")
        a = module.slope.detach().double().cpu()
        w = module.leak + a * (1.0 - module.leak)
    elif isinstance(module, nn.ReLU):
        w = torch.zeros(1, dtype=torch.float64)
    elif isinstance(module, nn.LeakyReLU):
        w = torch.tensor([module.negative_slope], dtype=torch.float64)
    else:  # nn.PReLU
        w = module.weight.detach().double().cpu()
        if not bool(torch.isfinite(w).all()):
            raise NonFiniteSlopeError(f"stable_units: site {name!r} (nn.PReLU) has NaN/inf negative slopes")
    if (w < 0).any() or (w > 1).any():
        raise ValueError(f"site {name!r} has negative slopes outside [0, 1]: not supported")
    return w


def _site_slopes(module: nn.Module, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    w = _negative_slopes(module, name)
    full = (1, *shape)
    dim = site_channel_dim(module, len(full))
    view = [1] * len(full)
    view[dim] = w.numel()
    try:
        return w.view(view).expand(full).reshape(-1).clone(), dim - 1
    except RuntimeError:
        raise ValueError(
            f"site {name!r} has {w.numel()} slopes but its input has shape {shape} "
            f"(channel dim {dim - 1})"
        ) from None


def _dense(modules: list[tuple[str, nn.Module]], in_shape: tuple[int, ...]) -> _Affine:
    """Dense float64 matrix of a run of affine modules, by pushing the unit basis through them."""
    for name, m in modules:
        if m.training and isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.Dropout)):
            raise ValueError(
                f"{type(m).__name__} {name!r} is in training mode: call model.eval() first "
                "(bounds need the eval statistics)"
            )
    n = math.prod(in_shape)
    with torch.no_grad():
        mods = [copy.deepcopy(m).double().cpu().eval() for _, m in modules]

        def f(x: torch.Tensor) -> torch.Tensor:
            for m in mods:
                x = m(x)
            return x

        b = f(torch.zeros(1, *in_shape, dtype=torch.float64))
        out_shape = tuple(b.shape[1:])
        if n * b.numel() > _MAX_DENSE:
            raise ValueError(
                f"the affine block {[nm for nm, _ in modules]} maps {n} to {b.numel()} values: too large "
                "for dense bound propagation; use a smaller input box or method='data'"
            )
        W = (f(torch.eye(n, dtype=torch.float64).reshape(n, *in_shape)) - b).reshape(n, -1).T
    return _Affine(modules, W.contiguous(), b.reshape(-1), in_shape, out_shape)


def _build(model: nn.Module, in_shape: tuple[int, ...]) -> tuple[list[_Affine], list[_Site]]:
    """Split the chain into ``affine_0, site_0, affine_1, site_1, ..., affine_L`` (affines may be
    identities)."""
    chain = _flatten_chain(model)
    if not any(isinstance(m, _SITE_TYPES) for _, m in chain):
        raise ValueError(
            "the model has no ReLU/PReLU units: call linearize.convert(model) first or use a ReLU network"
        )
    affines, sites, run, shape = [], [], [], in_shape
    for name, m in chain:
        if isinstance(m, _SITE_TYPES):
            aff = _dense(run, shape)
            affines.append(aff)
            shape = aff.out_shape
            w, cdim = _site_slopes(m, name, shape)
            sites.append(_Site(name, m, shape, w, cdim))
            run = []
        else:
            run.append((name, m))
    affines.append(_dense(run, shape))
    return affines, sites


# ----------------------------------------------------------------------------- bounds


def _prelu(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.where(z >= 0, z, w * z)


def _relaxation(l: torch.Tensor, u: torch.Tensor, w: torch.Tensor):
    """Linear bounds ``aL z + bL <= max(z, w z) <= aU z + bU`` valid for ``z`` in ``[l, u]``."""
    linear = (l >= 0) | (w == 1)
    inactive = (u <= 0) & ~linear
    unstable = ~(linear | inactive)
    one, zero = torch.ones_like(l), torch.zeros_like(l)
    aU = torch.where(linear, one, torch.where(inactive, w, zero))
    bU = zero.clone()
    aL = aU.clone()
    bL = zero.clone()
    if unstable.any():
        lu, uu, wu = l[unstable], u[unstable], w[unstable]
        chord = (uu - wu * lu) / (uu - lu)  # line through (l, w l) and (u, u)
        aU[unstable] = chord
        bU[unstable] = lu * (wu - chord)
        aL[unstable] = torch.where(uu >= -lu, torch.ones_like(uu), wu)  # adaptive lower slope
    return aL, bL, aU, bU


def _crown(affines, sites, bounds, k, xl, xu):
    """Bounds on the output of affine ``k`` by back-substitution to the input box."""
    A_u, c_u = affines[k].W.clone(), affines[k].b.clone()
    A_l, c_l = A_u.clone(), c_u.clone()
    for j in range(k - 1, -1, -1):
        aL, bL, aU, bU = _relaxation(*bounds[j], sites[j].w)
        pos, neg = A_u.clamp(min=0), A_u.clamp(max=0)
        c_u = c_u + pos @ bU + neg @ bL
        A_u = pos * aU + neg * aL
        pos, neg = A_l.clamp(min=0), A_l.clamp(max=0)
        c_l = c_l + pos @ bL + neg @ bU
        A_l = pos * aL + neg * aU
        W, b = affines[j].W, affines[j].b
        c_u, A_u = c_u + A_u @ b, A_u @ W
        c_l, A_l = c_l + A_l @ b, A_l @ W
    upper = c_u + A_u.clamp(min=0) @ xu + A_u.clamp(max=0) @ xl
    lower = c_l + A_l.clamp(min=0) @ xl + A_l.clamp(max=0) @ xu
    return lower, upper


def _ibp_step(aff: _Affine, hl: torch.Tensor, hu: torch.Tensor):
    mid, rad = (hu + hl) / 2, (hu - hl) / 2
    c = aff.W @ mid + aff.b
    r = aff.W.abs() @ rad
    return c - r, c + r


def _milp_bounds(affines, sites, bounds, k, rows, xl, xu, time_limit):
    """Exact bounds of outputs ``rows`` of affine ``k``: one MILP per bound (big-M from ``bounds``).

    Variables: the input ``x``, then per earlier site ``z`` (pre-activation), ``h`` (output) and a
    binary ``d`` (1 = active). The bound is the solver's dual bound, so a solve stopped by
    ``time_limit`` (seconds) still gives a sound, looser bound."""
    require("scipy", what="compress's exact bounds")
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    lb, ub, integ = [xl.numpy()], [xu.numpy()], [np.zeros(xl.numel())]
    data, ri, ci, lo_rhs, hi_rhs = [], [], [], [], []
    nvar, nrow, prev = xl.numel(), 0, 0  # prev: offset of h_{j-1} (x for j = 0)

    def add(rows_data, rows_idx, cols_idx, lo, hi):
        nonlocal nrow
        data.append(rows_data)
        ri.append(rows_idx + nrow)
        ci.append(cols_idx)
        lo_rhs.append(lo)
        hi_rhs.append(hi)
        nrow += lo.size

    for j in range(k):
        (l_t, u_t), w_t = bounds[j], sites[j].w
        l, u, w = l_t.numpy(), u_t.numpy(), w_t.numpy()
        m = l.size
        z0, h0, d0 = nvar, nvar + m, nvar + 2 * m
        nvar += 3 * m
        linear = (l >= 0) | (w == 1)
        inactive = (u <= 0) & ~linear
        unstable = ~(linear | inactive)
        lb += [l, _prelu(l_t, w_t).numpy(), linear.astype(float)]
        ub += [u, _prelu(u_t, w_t).numpy(), (~inactive).astype(float)]
        integ += [np.zeros(m), np.zeros(m), np.ones(m)]
        r = np.arange(m)
        # z - W h_prev = b
        W = coo_matrix(affines[j].W.numpy())
        b = affines[j].b.numpy()
        add(np.concatenate([np.ones(m), -W.data]), np.concatenate([r, W.row]),
            np.concatenate([z0 + r, prev + W.col]), b, b)
        # stable neurons: h - c z = 0 (c = 1 linear, w inactive)
        st = np.flatnonzero(~unstable)
        c = np.where(linear, 1.0, w)[st]
        rs = np.arange(st.size)
        add(np.concatenate([np.ones(st.size), -c]), np.concatenate([rs, rs]),
            np.concatenate([h0 + st, z0 + st]), np.zeros(st.size), np.zeros(st.size))
        us = np.flatnonzero(unstable)
        q = us.size
        if q:
            wu, lu, uu, one, rq = w[us], l[us], u[us], np.ones(q), np.arange(q)
            # h - z >= 0;  h - w z >= 0
            add(np.concatenate([one, -one, one, -wu]), np.concatenate([rq, rq, q + rq, q + rq]),
                np.concatenate([h0 + us, z0 + us, h0 + us, z0 + us]),
                np.zeros(2 * q), np.full(2 * q, np.inf))
            # h - w z - (1 - w) u d <= 0;  h - z - (1 - w) l d <= -(1 - w) l
            add(np.concatenate([one, -wu, -(1 - wu) * uu, one, -one, -(1 - wu) * lu]),
                np.concatenate([rq, rq, rq, q + rq, q + rq, q + rq]),
                np.concatenate([h0 + us, z0 + us, d0 + us, h0 + us, z0 + us, d0 + us]),
                np.full(2 * q, -np.inf), np.concatenate([np.zeros(q), -(1 - wu) * lu]))
        prev = h0
    constraints = []
    if nrow:
        A = coo_matrix((np.concatenate(data), (np.concatenate(ri), np.concatenate(ci))),
                       shape=(nrow, nvar)).tocsr()
        constraints = [LinearConstraint(A, np.concatenate(lo_rhs), np.concatenate(hi_rhs))]
    var_bounds = Bounds(np.concatenate(lb), np.concatenate(ub))
    integrality = np.concatenate(integ)
    W, b = affines[k].W[rows].numpy(), affines[k].b[rows].numpy()
    lower, upper = np.empty(W.shape[0]), np.empty(W.shape[0])
    options = {"time_limit": time_limit} if time_limit else {}
    for i in range(W.shape[0]):
        for sign, out in ((1.0, lower), (-1.0, upper)):
            cost = np.zeros(nvar)
            cost[prev:prev + W.shape[1]] = sign * W[i]
            res = milp(cost, constraints=constraints, integrality=integrality, bounds=var_bounds,
                       options=options)
            dual = getattr(res, "mip_dual_bound", None)
            if dual is None or not np.isfinite(dual):
                dual = res.fun if res.status == 0 else None  # a pure LP reports no dual bound
            if res.status not in (0, 1) or dual is None:
                raise RuntimeError(f"MILP for neuron {int(rows[i])} of layer {k} failed: {res.message}")
            value = sign * dual + b[i]
            out[i] = value - sign * _MILP_SLACK * (1 + abs(value))  # solver feasibility tolerance
    return torch.from_numpy(lower), torch.from_numpy(upper)


# ----------------------------------------------------------------------------- stable_units


@dataclass
class SiteStability:
    """Stability of the neurons of one activation site.

    ``lower``/``upper`` (float64) bound the pre-activation of every neuron, ``active``/``inactive``
    (bool) mark the stable ones; all have the site's input shape without the batch dim (``[C]`` for
    an MLP, ``[C, H, W]`` for a conv map; ``[C]`` with ``per_channel`` data). A neuron whose upper
    bound is ``<= 0`` is inactive, else one whose lower bound is ``>= 0`` is active.
    """

    name: str
    kind: str
    channel_dim: int
    lower: torch.Tensor
    upper: torch.Tensor
    active: torch.Tensor
    inactive: torch.Tensor

    @property
    def unstable(self) -> torch.Tensor:
        return ~(self.active | self.inactive)

    def channel_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(active, inactive)`` bool ``[C]``: channels whose every position is stable that way."""
        dims = [d for d in range(self.active.ndim) if d != self.channel_dim]
        if not dims:
            return self.active.clone(), self.inactive.clone()
        return self.active.all(dim=dims), self.inactive.all(dim=dims)

    def counts(self) -> dict:
        return {
            "kind": self.kind,
            "total": self.active.numel(),
            "active": int(self.active.sum()),
            "inactive": int(self.inactive.sum()),
            "unstable": int(self.unstable.sum()),
        }


@dataclass
class StabilityResult:
    """What :func:`stable_units` found: per-site masks and bounds, and the output bounds."""

    method: str
    sites: dict[str, SiteStability]
    output_lower: torch.Tensor | None = None  # float64, output shape without batch (box methods)
    output_upper: torch.Tensor | None = None

    @property
    def counts(self) -> dict:
        """``{"total", "active", "inactive", "unstable", "stable_fraction", "sites": {name: {...}}}``."""
        sites = {n: s.counts() for n, s in self.sites.items()}
        tot = {k: sum(s[k] for s in sites.values()) for k in ("total", "active", "inactive", "unstable")}
        tot["stable_fraction"] = (tot["active"] + tot["inactive"]) / max(tot["total"], 1)
        return {**tot, "sites": sites}

    def __str__(self) -> str:
        lines = [f"stable units ({self.method}): {self.counts['active']} active, "
                 f"{self.counts['inactive']} inactive, {self.counts['unstable']} unstable"]
        for name, c in self.counts["sites"].items():
            lines.append(f"  {name:<30} {c['total']:>6} total {c['active']:>6} active "
                         f"{c['inactive']:>6} inactive {c['unstable']:>6} unstable")
        return "\n".join(lines)


def _as_box(domain: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(lower, upper)`` float64 tensors if ``domain`` is a box, ``None`` if it is data.

    A box is a tuple of exactly two tensors (or nested lists) of the same shape; a tuple of two
    tensors of different shapes is an ``(inputs, targets)`` batch."""
    if not (isinstance(domain, tuple) and len(domain) == 2):
        return None
    if all(isinstance(t, torch.Tensor) for t in domain) and domain[0].shape != domain[1].shape:
        return None
    try:
        lower, upper = (torch.as_tensor(t, dtype=torch.float64).cpu() for t in domain)
        lower, upper = torch.broadcast_tensors(lower, upper)
    except (TypeError, RuntimeError, ValueError) as err:
        raise ValueError(f"domain must be (lower, upper) tensors of one input's shape: {err}") from None
    if lower.ndim == 0:
        raise ValueError("domain (lower, upper) must have the input's shape (no batch dim), not scalars")
    if torch.isnan(lower).any() or torch.isnan(upper).any():
        raise ValueError("domain bounds contain NaN")
    if (lower > upper).any():
        bad = int((lower > upper).sum())
        raise ValueError(f"domain has lower > upper in {bad} coordinate(s): pass (lower, upper) with lower <= upper")
    return lower.contiguous(), upper.contiguous()


def _box_bounds(affines, sites, xl, xu, method, time_limit, progress):
    """Pre-activation bounds of every site and of the output, layer by layer."""
    bounds = []
    hl, hu = xl.reshape(-1), xu.reshape(-1)
    layers = range(len(affines))
    if progress:
        from tqdm.auto import tqdm

        layers = tqdm(layers, desc=f"bounds ({method})", leave=False)
    for k in layers:
        l, u = _ibp_step(affines[k], hl, hu)  # exact for k = 0
        if k > 0 and method in ("crown", "milp"):
            cl, cu = _crown(affines, sites, bounds, k, xl.reshape(-1), xu.reshape(-1))
            l, u = torch.maximum(l, cl), torch.minimum(u, cu)
            if method == "milp":  # neurons CROWN leaves unstable (hidden layers), every output
                rows = ((l < 0) & (u > 0)).nonzero().flatten() if k < len(sites) else torch.arange(l.numel())
                if rows.numel():
                    ml, mu = _milp_bounds(affines, sites, bounds, k, rows, xl.reshape(-1), xu.reshape(-1),
                                          time_limit)
                    l[rows], u[rows] = torch.maximum(l[rows], ml), torch.minimum(u[rows], mu)
        bounds.append((l, u))
        if k < len(sites):
            hl, hu = _prelu(l, sites[k].w), _prelu(u, sites[k].w)
    return bounds


def _site_result(name, module, lower, upper, channel_dim) -> SiteStability:
    inactive = upper <= 0
    kind = module.kind if isinstance(module, LinearizableActivation) else type(module).__name__.lower()
    return SiteStability(name, kind, channel_dim, lower, upper, (lower >= 0) & ~inactive, inactive)


def stable_units(
    model: nn.Module,
    domain: Any,
    method: str | None = None,
    *,
    per_channel: bool = False,
    time_limit: float | None = 10.0,
    progress: bool = False,
) -> StabilityResult:
    """Find the stably active and stably inactive units of ``model`` over ``domain``.

    Args:
        model: a feedforward ``nn.Sequential`` ReLU/PReLU network (see the module docstring) in
            eval mode, for the box methods; any model with units or ReLU modules for ``"data"``.
        domain: an input box ``(lower, upper)`` (tensors of one input's shape, no batch dim), or
            data (:mod:`linearize.inputs`): a tensor batch, a mapping of keyword arguments, an
            ``(inputs, *targets)`` tuple or an iterable of batches (a ``DataLoader``). A pair of
            two tensors of the same shape is read as a box.
        method: ``"crown"`` (default for a box), ``"ibp"``, ``"milp"`` (exact bounds by two MILPs
            per neuron that CROWN leaves unstable, and per output; stable neurons keep their CROWN
            bounds; small MLPs: ~2 s per solve at 64 inputs and 25 binaries) or ``"data"``
            (default for data: stable on every sample seen, not a proof).
        per_channel: ``"data"`` only: reduce over positions, masks of shape ``[C]``.
        time_limit: seconds per MILP solve (the bound stays sound when it stops early).
        progress: show tqdm progress bars.

    Returns: a :class:`StabilityResult` (``.sites[name].active/.inactive/.lower/.upper``,
    ``.counts``, ``.output_lower/.output_upper`` for boxes).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    box = _as_box(domain)
    if method is None:
        method = "crown" if box is not None else "data"
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "data":
        if box is not None:
            raise ValueError("method='data' needs data (a tensor batch or a loader), not a (lower, upper) box")
        sites = _site_modules(model)
        if not sites:
            raise ValueError("the model has no units or ReLU modules: call linearize.convert(model) first")
        check_finite_slopes([(n, m) for n, m in sites if isinstance(m, LinearizableActivation)], "stable_units")
        ranges = record_preactivations(model, Batches.of(domain, "domain"), sites, per_channel, progress)
        result = {}
        for name, module in sites:
            lo, hi = (t.double() for t in ranges[name])
            cdim = 0 if per_channel else site_channel_dim(module, lo.ndim + 1) - 1
            result[name] = _site_result(name, module, lo, hi, cdim)
        return StabilityResult("data", result)
    if box is None:
        raise ValueError(f"method={method!r} needs an input box domain=(lower, upper); got data")
    xl, xu = box
    affines, sites = _build(model, tuple(xl.shape))
    bounds = _box_bounds(affines, sites, xl, xu, method, time_limit, progress)
    result = {
        s.name: _site_result(s.name, s.module, l.reshape(s.shape), u.reshape(s.shape), s.channel_dim)
        for s, (l, u) in zip(sites, bounds)
    }
    out_shape = affines[-1].out_shape
    return StabilityResult(method, result, bounds[-1][0].reshape(out_shape), bounds[-1][1].reshape(out_shape))


# ----------------------------------------------------------------------------- compress


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
        domain: an input box ``(lower, upper)`` (tensors of one input's shape) or data whose
            inputs are tensors (see :func:`stable_units`).
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
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    rtol = check_positive(rtol, "rtol")
    rank_tol = check_positive(rank_tol, "rank_tol")
    samples = check_positive_int(samples, "samples")
    box = _as_box(domain)
    if box is not None:
        in_shape = tuple(box[0].shape)
    else:
        domain = Batches.of(domain, "domain")
        first = next(iter(domain))
        if not isinstance(first, torch.Tensor):
            raise TypeError(f"compress runs an nn.Sequential on one input tensor: give data whose inputs are "
                            f"tensors (a tensor batch, (x, y) pairs, a loader of them), got {type(first).__name__}")
        in_shape = tuple(first.shape[1:])
    affines, sites = _build(model, in_shape)
    stability = stable_units(model, domain, method, progress=progress)
    dtype = next(model.parameters()).dtype
    # the MLP head: the affine blocks from `start` on hold only Linear/BatchNorm1d/Flatten/...
    start = len(affines)
    while start > 0 and all(isinstance(m, _MLP_TYPES) for _, m in affines[start - 1].modules):
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
    if scale <= 1e-12:  # every output is zero: any compressed model would pass, so nothing is verified
        raise FoldVerificationError(
            f"compress cannot verify the compressed model: the model's output is zero on all {count} samples "
            "(a zero-initialised last layer?); give it a last layer that is not zero to compress it"
        )
    if err > rtol * max(scale, 1e-12) + 1e-7:
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
