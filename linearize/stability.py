"""Stable units over a domain (seed 004: Serra, Kumar, Ramalingam); :mod:`linearize.compression` uses them.

A ReLU/PReLU unit is *stably inactive* on a domain when its pre-activation is ``<= 0`` for every
input of the domain, and *stably active* when it is ``>= 0``. Either way the unit is linear there:
an active unit outputs ``z``, an inactive PReLU unit with negative slope ``w`` outputs ``w * z``
(exactly ``0`` for a ReLU, ``w = 0``). :func:`stable_units` finds them over an input box with
interval bound propagation (``"ibp"``), a CROWN-style linear relaxation with back-substitution
(``"crown"``), or exact per-neuron mixed-integer programs (``"milp"``, ``scipy.optimize.milp``,
small MLPs), or over data (``"data"``). The box methods are sound: a unit they call stable is
stable for every input of the box (bounds are computed in float64).

An input box is a :class:`Box`; a tuple is data (an ``(inputs, *targets)`` batch), whatever its
shapes. A ``(lower, upper)`` tuple is still read as a box when a box method is named explicitly
(``method="ibp"``, ``"crown"`` or ``"milp"``), with a ``FutureWarning``, for one deprecation period.

Supported models: ``nn.Sequential`` chains (nested ones too) of ``Linear``, ``Conv1d``/``Conv2d``,
``BatchNorm1d``/``BatchNorm2d`` (eval), ``AvgPool``, ``Flatten``/``Unflatten``, ``Dropout`` (eval),
``Identity`` and the activation sites: PReLU-kind ``LinearizableActivation`` units, ``nn.ReLU``,
``nn.LeakyReLU``, ``nn.PReLU`` (negative slopes in ``[0, 1]``). Affine parts between activation
sites are handled as dense float64 matrices, so conv nets must be small (a few thousand neurons).
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ._optional import require
from .activations import negative_slope
from .checks import NonFiniteSlopeError
from .inputs import Batches, inputs_fit, record_preactivations, site_channel_dim
from .unit import LinearizableActivation, check_finite_slopes, refuse_element_units, sites as unit_sites

__all__ = ["stable_units", "Box", "StabilityResult", "SiteStability", "record_preactivations"]

METHODS = ("ibp", "crown", "milp", "data")
BOX_METHODS = ("ibp", "crown", "milp")
_AFFINE_TYPES = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d, nn.Flatten, nn.Unflatten,
    nn.Identity, nn.Dropout, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
)
MLP_TYPES = (nn.Linear, nn.BatchNorm1d, nn.Flatten, nn.Identity, nn.Dropout)
_SITE_TYPES = (LinearizableActivation, nn.ReLU, nn.LeakyReLU, nn.PReLU)
_MAX_DENSE = 20_000_000  # entries of one dense affine block (160 MB in float64)
_MILP_SLACK = 1e-7  # relative widening of MILP bounds, above HiGHS feasibility tolerances


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
        refuse_element_units([(name, module)], "bound propagation (stable_units with a Box, compress)",
                             "Use stable_units(..., method='data'), or linearize.fold for a plain model")
        if not bool(module.identity_end_mask().all()):
            raise ValueError(
                f"site {name!r} has affine linear ends (alpha * x + beta at a = 1, set by fit_linear_ends / one_shot): "
                "bound propagation and compress model a unit as a PReLU. Fold it instead (linearize.fold), or use "
                "stable_units(..., method='data')")
        w = module.prelu_weight(module.slope.detach().double().cpu())
    elif isinstance(module, (nn.ReLU, nn.LeakyReLU)):
        w = torch.tensor([negative_slope(module)], dtype=torch.float64)
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


# what to do when a Box's bounds do not fit the model
BOX_FIX = "pass Box(lower, upper) shaped like one real input, without the batch dim"


def build_network(model: nn.Module, in_shape: tuple[int, ...]) -> tuple[list[_Affine], list[_Site]]:
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


@dataclass(frozen=True, init=False)
class Box:
    """An input box ``lower <= x <= upper`` (tensors of one input's shape, no batch dim) for
    :func:`stable_units` and :func:`linearize.compress`; kept as float64 CPU tensors.

    Example:
        >>> box = Box(torch.zeros(3), torch.ones(3))
        >>> box.lower.dtype, tuple(box.upper.shape)
        (torch.float64, (3,))
        >>> Box(torch.ones(2), torch.zeros(2))
        Traceback (most recent call last):
        ...
        ValueError: Box has lower > upper in 2 coordinate(s): pass Box(lower, upper) with lower <= upper
    """

    lower: torch.Tensor
    upper: torch.Tensor

    def __init__(self, lower: Any, upper: Any) -> None:
        try:
            lo, hi = (torch.as_tensor(t, dtype=torch.float64).detach().cpu() for t in (lower, upper))
            lo, hi = torch.broadcast_tensors(lo, hi)
        except (TypeError, RuntimeError, ValueError) as err:
            raise ValueError(f"Box(lower, upper) takes tensors of one input's shape: {err}") from None
        if lo.ndim == 0:
            raise ValueError("Box(lower, upper) bounds must have the input's shape (no batch dim), not scalars")
        if torch.isnan(lo).any() or torch.isnan(hi).any():
            raise ValueError("Box bounds contain NaN")
        if (lo > hi).any():
            raise ValueError(f"Box has lower > upper in {int((lo > hi).sum())} coordinate(s): pass "
                             "Box(lower, upper) with lower <= upper")
        object.__setattr__(self, "lower", lo.contiguous())
        object.__setattr__(self, "upper", hi.contiguous())

    def __iter__(self):
        return iter((self.lower, self.upper))


def as_box(domain: Any, method: str | None, caller: str = "stable_units") -> Box | None:
    """``domain`` as a :class:`Box`, or ``None`` when it is data. A tuple is data, except (deprecated,
    with a ``FutureWarning``) a ``(lower, upper)`` pair given with an explicit box ``method``.

    Example:
        >>> x, y = torch.randn(8, 3), torch.randn(8, 3)
        >>> as_box((x, y), "data") is None  # an (inputs, targets) batch
        True
    """
    if isinstance(domain, Box):
        return domain
    pair = isinstance(domain, tuple) and len(domain) == 2
    if pair and method in BOX_METHODS:
        warnings.warn(
            f"{caller}: a (lower, upper) tuple as an input box is deprecated (a tuple is data, an "
            f"(inputs, targets) batch); pass linearize.Box(lower, upper) for method={method!r}",
            FutureWarning, stacklevel=3,
        )
        return Box(*domain)
    if pair and method is None and all(isinstance(t, torch.Tensor) for t in domain) and (
        domain[0].shape == domain[1].shape
    ):
        warnings.warn(
            f"{caller}: the tuple of two tensors of one shape {tuple(domain[0].shape)} is read as data (an "
            "(inputs, targets) batch), no longer as an input box: pass linearize.Box(lower, upper) for a box, "
            "or method='data' to keep reading it as data without this warning",
            FutureWarning, stacklevel=3,
        )
    return None


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
    """Find the stably active and stably inactive units of ``model`` over ``domain`` (``model`` is not
    modified; :func:`linearize.compress` builds the smaller model, :func:`linearize.freeze` freezes in place).

    Args:
        model: a feedforward ``nn.Sequential`` ReLU/PReLU network (see the module docstring) in
            eval mode, for the box methods; any model with units or ReLU modules for ``"data"``.
        domain: an input :class:`Box` ``(lower, upper)``, or data (:mod:`linearize.inputs`): a
            tensor batch, a mapping of keyword arguments, an ``(inputs, *targets)`` tuple or an
            iterable of batches (a ``DataLoader``). A tuple is always data, except that a
            ``(lower, upper)`` tuple with an explicit box ``method`` is still read as a box
            (deprecated: a ``FutureWarning`` says to pass a :class:`Box`).
        method: ``"crown"`` (default for a box), ``"ibp"``, ``"milp"`` (exact bounds by two MILPs
            per neuron that CROWN leaves unstable, and per output; stable neurons keep their CROWN
            bounds; small MLPs: ~2 s per solve at 64 inputs and 25 binaries) or ``"data"``
            (default for data: stable on every sample seen, not a proof).
        per_channel: ``"data"`` only: reduce over positions, masks of shape ``[C]``.
        time_limit: seconds per MILP solve (the bound stays sound when it stops early).
        progress: show tqdm progress bars.

    Returns: a :class:`StabilityResult` (``.sites[name].active/.inactive/.lower/.upper``,
    ``.counts``, ``.output_lower/.output_upper`` for boxes).

    Example:
        >>> net = nn.Sequential(nn.Linear(1, 2), nn.ReLU(), nn.Linear(2, 1)).eval()
        >>> _ = net[0].weight.data.fill_(1.0), net[0].bias.data.copy_(torch.tensor([2.0, -2.0]))
        >>> site = stable_units(net, Box(torch.tensor([-1.0]), torch.tensor([1.0]))).sites["1"]
        >>> site.active.tolist(), site.inactive.tolist()  # on [-1, 1]: x + 2 > 0 and x - 2 < 0
        ([True, False], [False, True])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    if method is not None and method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    box = as_box(domain, method)
    if method is None:
        method = "crown" if box is not None else "data"
    if method == "data":
        if box is not None:
            raise ValueError("method='data' needs data (a tensor batch or a loader), not a Box: pass a box "
                             f"method {BOX_METHODS} for it")
        sites = unit_sites(model, also=lambda m: isinstance(m, _SITE_TYPES))
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
        raise ValueError(f"method={method!r} needs an input box: pass domain=linearize.Box(lower, upper); got "
                         "data (a tuple is data, an (inputs, targets) batch)")
    xl, xu = box
    with inputs_fit(xl, "Box bounds", BOX_FIX):
        affines, sites = build_network(model, tuple(xl.shape))
    bounds = _box_bounds(affines, sites, xl, xu, method, time_limit, progress)
    result = {
        s.name: _site_result(s.name, s.module, l.reshape(s.shape), u.reshape(s.shape), s.channel_dim)
        for s, (l, u) in zip(sites, bounds)
    }
    out_shape = affines[-1].out_shape
    return StabilityResult(method, result, bounds[-1][0].reshape(out_shape), bounds[-1][1].reshape(out_shape))
