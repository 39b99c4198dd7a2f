"""Affinity score and non-linearity signature (seed 002: affine optimal transport).

The affinity score of a map ``x -> y`` sampled as paired point clouds ``x, y: [n, d]`` is

    rho(x, y) = 1 - W2(T_aff x, y) / sqrt(2 tr Cov(y))

- ``T_aff(x) = A x + b`` is the closed-form optimal transport map between the Gaussian
  approximations ``N(mu_x, Sx)`` and ``N(mu_y, Sy)``:
  ``A = Sy^(1/2) (Sy^(1/2) Sx Sy^(1/2))^(-1/2) Sy^(1/2)`` (symmetric positive definite),
  ``b = mu_y - A mu_x``;
- ``W2`` is the exact 2-Wasserstein distance (**not** its square) between the two uniform point
  clouds ``{T_aff x_i}`` and ``{y_j}``. For two clouds of equal size with uniform weights an
  optimal plan is a permutation (Birkhoff), so ``W2^2 = min_sigma (1/n) sum_i |T x_i - y_sigma(i)|^2``,
  an assignment problem solved exactly by :func:`scipy.optimize.linear_sum_assignment`;
- ``Cov`` are the maximum-likelihood (``1/n``) covariances. With them ``2 tr Cov(y)`` is the
  cost of the independent coupling of the centred clouds (``Cov(T_aff x) = Sy``), an upper bound
  of ``W2^2``, so ``0 <= rho <= 1``; ``rho = 1`` iff ``y`` is a positive semi-definite affine
  image of ``x``.

This is the definition that reproduces the reference values of the seed paper and those that
``tests/test_affinity.py`` checks, e.g.
``x = linspace(-1, 1, 1000)``: ``rho(x, x**3) = .7112`` (with ``W2^2`` it would be .9166), and
``x ~ N(0, I_64)``, ``n = 2048``: ``rho(x, relu(x)) = .622``.

Scale: ``rho`` is invariant to translations and to positive scalings of ``x`` and of ``y``
(``rho(a x + b, c y + e) = rho(x, y)`` for scalars ``a, c > 0``: ``A`` scales by ``c / a``, ``W2`` and
the denominator by ``c``). The computation keeps that invariance (to rounding): ``x`` and ``y`` are each
scaled by a power of two to ``max |.| <= 1`` (exact, so neither ``1e-300`` nor ``1e300`` under- or
overflows), centred, and divided by their RMS ``sqrt(tr Cov / d)`` (unit average variance) before
anything else. The ridge is added to these standardised covariances, so it is **relative**:
``ridge * tr(Cov) / d`` in the units of the data (a fixed ridge ``1e-6 I`` on the raw covariances
dominated activations at scale ``1e-3`` and below: ReLU on ``N(0, 1)`` scored .47 at scale ``1e-3``
instead of .62, and ``-1210`` with only ``y`` scaled by ``1e-6``). A constant ``y`` scores 1 (the
affine image ``0 x + c``); a constant ``x`` with a varying ``y`` scores ``1 - 1 / sqrt 2`` (any affine
map sends ``x`` to one point, ``W2^2 = tr Cov(y)``). The regularisation (ridge, shrinkage) perturbs
the bound ``W2^2 <= 2 tr Cov(y)`` by ``O(ridge)`` (or by the shrinkage), so the score is clipped to
``[0, 1]``.

Numerics: float64 throughout (the one float32 step, a bound that proves the given pairing
optimal, carries a rigorous rounding margin, see :func:`_float32_certificate`); the clouds are centred before any distance (``T_aff x - mu_y``
against ``y - mu_y``), so large means cannot swamp float precision (``relu(x + 100)`` scores 1);
a ridge ``1e-6 I`` is added to both standardised covariances (or Ledoit-Wolf shrinkage plus the ridge); ``A``
from one Cholesky factor and one symmetric eigendecomposition (``eigh``, never ``sqrtm``), see
:func:`gaussian_ot_matrix`. The assignment costs ``O(n^2)`` memory (``8 n^2`` bytes: 32 MiB at
``n = 2048``) and typically well under a second at that size.
"""

from __future__ import annotations

import math
import numbers
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._optional import require

require("scipy", "threadpoolctl", what="the affinity measure")
from scipy.linalg.blas import dsyrk, dtrmm, dtrsm
from scipy.linalg.lapack import dpotrf, dsyevd
from scipy.optimize import linear_sum_assignment
from threadpoolctl import threadpool_limits
from torch import nn
from tqdm.auto import tqdm

from ..activations import MODULE_KINDS, OTHER_ELEMENTWISE
from ..inputs import Batches, call_model, eval_mode, inputs_fit, model_device
from ..unit import LinearizableActivation, sites as unit_sites

__all__ = ["affinity_score", "affinity_signature"]

SHRINKAGE = (None, "ledoit-wolf")

# Elementwise activation modules measured on models that were not converted (and on activations
# a converted model left alone). Softmax / GLU are not elementwise maps and are left out.
STANDARD_ACTIVATIONS: tuple[type[nn.Module], ...] = tuple(cls for cls, _ in MODULE_KINDS) + OTHER_ELEMENTWISE


# --------------------------------------------------------------------------------------------
# affinity score


def affinity_score(
    x: torch.Tensor | np.ndarray,
    y: torch.Tensor | np.ndarray,
    shrinkage: str | None = None,
    ridge: float = 1e-6,
) -> float:
    """Affinity score ``rho in [0, 1]`` of the paired samples ``x -> y`` (seed 002).

    ``rho = 1 - W2(T_aff x, y) / sqrt(2 tr Cov(y))``, see the module docstring: 1 when ``y`` is a
    (positive semi-definite) affine function of ``x``, lower the more non-linear the map is.

    Args:
        x: inputs ``[n, d]`` (or ``[n]`` for ``d = 1``), torch tensor or numpy array, any float dtype
            (computed in float64).
        y: outputs ``[n, d]``, row ``i`` paired with row ``i`` of ``x`` (the pairing does not enter
            the score: only the two clouds do). The affine map ``A`` is square, so ``y`` needs the
            same ``d`` as ``x``.
        shrinkage: ``None`` (sample covariance) or ``"ledoit-wolf"`` (sklearn's Ledoit-Wolf
            estimate, more stable when ``n`` is not much larger than ``d``).
        ridge: relative ridge, added to the diagonal of both covariances after ``x`` and ``y`` are
            standardised to unit average variance, i.e. ``ridge * tr(Cov) / d`` in the data's units
            (keeps the Cholesky factor and root defined for rank-deficient clouds, e.g. ReLU
            channels that are always 0, or ``n <= d``, without making the score depend on scale).

    Returns:
        the score as a Python float in ``[0, 1]``, the same for ``a x + b, c y + e`` (scalars
        ``a, c > 0``) at any finite scale. A constant ``y`` scores 1 (it is the affine image
        ``0 x + c``).

    Example:
        >>> x = torch.linspace(-1, 1, 1000, dtype=torch.float64)
        >>> round(affinity_score(x, x**3), 4), round(affinity_score(1e-9 * x, 1e7 * x**3), 4)
        (0.7111, 0.7111)

    Raises:
        ValueError: fewer than 2 samples, different ``n`` or ``d``, NaN/inf values, bad options;
            ``numpy.linalg.LinAlgError`` (a ``ValueError``) for ``ridge = 0`` with a singular ``Cov(x)``.

    Cost: ``O(n d^2 + d^3)`` for the map, ``O(n^2)`` memory and up to ``O(n^3)`` time for the exact
    assignment (fast in practice: the given pairing is proved optimal first, see
    :func:`exact_w2_squared`).
    """
    if shrinkage not in SHRINKAGE:
        raise ValueError(f"shrinkage must be one of {SHRINKAGE}, got {shrinkage!r}")
    if not (isinstance(ridge, numbers.Real) and 0 <= ridge < math.inf):
        raise ValueError(f"ridge must be a finite number >= 0 (a fraction of the average variance), got {ridge!r}")
    xs, ys = _as_samples(x, "x"), _as_samples(y, "y")
    if xs.shape[0] != ys.shape[0]:
        raise ValueError(f"x and y need the same number of samples (paired rows), got {xs.shape[0]} and {ys.shape[0]}")
    if xs.shape[1] != ys.shape[1]:
        raise ValueError(
            f"x and y need the same number of features: the affine OT map A is square, got "
            f"d_x = {xs.shape[1]} and d_y = {ys.shape[1]}"
        )
    xc, yc = _standardised(xs), _standardised(ys)
    if not yc.any():  # a constant y: the affine image 0 x + c
        return 1.0
    sx, sy = _covariance(xc, shrinkage), _covariance(yc, shrinkage)
    total_var = float(np.trace(sy))
    a = gaussian_ot_matrix(sx, sy, ridge)
    w2 = np.sqrt(exact_w2_squared(xc @ a, yc))  # A symmetric: (A x_i)^T = x_i^T A
    # 0 <= rho holds for the exact definition; the ridge / shrinkage can move it below by O(ridge)
    return float(min(1.0, max(0.0, 1.0 - w2 / np.sqrt(2.0 * total_var))))


def gaussian_ot_matrix(sx: np.ndarray, sy: np.ndarray, ridge: float = 1e-6) -> np.ndarray:
    """``A = Sy^(1/2) (Sy^(1/2) Sx Sy^(1/2))^(-1/2) Sy^(1/2)`` for ``Sx + ridge I``, ``Sy + ridge I``.

    ``sx, sy``: symmetric PSD ``[d, d]`` float64. Returns the symmetric positive definite
    ``[d, d]`` matrix of the optimal transport map ``x -> A (x - mu_x) + mu_y`` between the two
    Gaussians: the unique SPD solution of ``A Sx A = Sy``. Computed with one Cholesky factor
    ``Sx = L L^T`` and one eigendecomposition ``L^T Sy L = V W V^T`` as ``A = B B^T`` with
    ``B = L^-T V W^(1/4)`` (the same matrix: it is SPD and ``A Sx A = L^-T (L^T Sy L) L^-1 = Sy``),
    half the cost of two matrix roots and without inverting a root of the often rank-deficient
    ``Sy``. BLAS / LAPACK are called directly, in place: the triangular products (``trmm``, ``trsm``)
    and ``B B^T`` (``syrk``) take half the flops of general products. Raises ``LinAlgError`` if
    ``Sx + ridge I`` is not positive definite (``ridge = 0`` on a singular ``Sx``). The ridge is
    absolute here: :func:`affinity_score` passes covariances standardised to unit average variance.
    """
    diagonal = np.diag_indices(sx.shape[0])
    sx, sy = np.array(sx, order="F"), np.array(sy, order="F")  # Fortran order: LAPACK works in place
    sx[diagonal] += ridge
    sy[diagonal] += ridge
    chol, info = dpotrf(sx, lower=1, clean=1, overwrite_a=1)
    if info != 0:
        raise np.linalg.LinAlgError(f"Sx + {ridge} I is not positive definite (Cholesky failed at column {info}); use ridge > 0")
    m = dtrmm(1.0, chol, dtrmm(1.0, chol, sy, side=1, lower=1, overwrite_b=1), lower=1, trans_a=1, overwrite_b=1)
    w, v, info = dsyevd(m, compute_v=1, lower=1, overwrite_a=1)  # L^T Sy L = V W V^T, lower triangle
    if info != 0:
        raise np.linalg.LinAlgError(f"eigendecomposition did not converge (LAPACK dsyevd info {info})")
    v *= np.sqrt(np.sqrt(np.clip(w, 0.0, None)))  # V W^(1/4)
    b = dtrsm(1.0, chol, v, lower=1, trans_a=1, overwrite_b=1)  # L^-T V W^(1/4)
    a = dsyrk(1.0, b)  # upper triangle of B B^T, zeros below
    a += np.triu(a, 1).T
    return a


def exact_w2_squared(p: np.ndarray, q: np.ndarray) -> float:
    """Exact squared 2-Wasserstein distance between uniform clouds ``p, q: [n, d]`` (float64).

    Solves the assignment problem on squared Euclidean costs (exact for equal-size uniform clouds)
    and evaluates the optimal pairs' costs from the coordinates. Pass centred clouds (the inner
    products are then well scaled). The given pairing ``p_i <-> q_i`` is tried first, as it is
    usually optimal for activation sites and proving it is several times cheaper than solving:
    from float32 lower bounds (:func:`_float32_certificate`), then, where those are too loose (ties,
    near-duplicate rows), from the float64 products (:func:`_pairing_is_optimal`); otherwise
    :func:`scipy.optimize.linear_sum_assignment` solves it. In 1-d the sorted (monotone) matching is
    optimal and used instead.
    """
    if p.shape[1] == 1:
        return float(np.mean((np.sort(p[:, 0]) - np.sort(q[:, 0])) ** 2))
    matched = q  # q[s(i)] for an optimal assignment s
    if not _float32_certificate(p, q):
        gain = p @ q.T
        if not _pairing_is_optimal(np.diag(gain)[:, None] - gain):
            # squared distances |p|^2 + |q|^2 - 2 p.q: the solver is ~2x faster on them than on -gain
            gain *= -2.0
            gain += np.einsum("ij,ij->i", p, p)[:, None]
            gain += np.einsum("ij,ij->i", q, q)[None, :]
            matched = q[linear_sum_assignment(gain)[1]]
    return float(np.mean(np.sum((p - matched) ** 2, axis=1)))


# unit roundoff of float32, and a floor under the row norms whose square covers float32 underflow
_U32, _TINY = 2.0**-24, 2.0**-60


def _float32_certificate(p: np.ndarray, q: np.ndarray) -> bool:
    """True if the pairing ``p_i <-> q_i`` is an optimal assignment (a proof), False if undecided.

    Maximizing ``sum_i p_i . q_s(i)`` is the same problem as minimizing squared distances, so the
    exchange costs are ``W[i, j] = D_i - p_i . q_j`` with ``D_i = p_i . q_i`` (float64). A lower
    bound ``W_lb <= W`` without a negative cycle (:func:`_pairing_is_optimal`) proves that ``W`` has
    none. ``W_lb`` costs one float32 product (half the time of float64) and one float32 pass: with
    ``p, q`` scaled to unit largest row norm (``a_i = |p_i|``, ``b_j = |q_j| <= 1``), the product of
    ``[p_i, c (a_i + t), e |D_i|]`` and ``[q_j, b_j + t, 1]`` (``c = 2 (d + 6) u``, ``e = 4 u``,
    ``u = 2^-24``, ``t = 2^-60``) exceeds ``p_i . q_j`` by more than all rounding errors: of the
    inputs (``2 u a_i b_j``), of a length-``d + 2`` dot product (``(d + 2) u a_i b_j``), of ``D_i`` and
    of ``fl(D_i) - G[i, j]`` (``u |D_i|`` and ``u (a_i b_j + |D_i|)``), to first order and with ample
    room; ``t^2`` covers underflow. The diagonal is exact: 0. The bound is loose by ``~d u |p_i| |q_j|``,
    far below the exchange costs of distinct points: the certificate fails where a solver is needed
    anyway and on ties (zero-cost exchanges, e.g. rows of ``q`` that a ReLU mapped to one point).
    """
    n, d = p.shape
    p_norm, q_norm = np.sqrt(np.einsum("ij,ij->i", p, p)), np.sqrt(np.einsum("ij,ij->i", q, q))
    p_scale, q_scale = max(p_norm.max(), _TINY), max(q_norm.max(), _TINY)
    diag = np.einsum("ij,ij->i", p, q) / (p_scale * q_scale)
    pa, qa = np.empty((n, d + 2), np.float32), np.empty((n, d + 2), np.float32)
    np.divide(p, p_scale, out=pa[:, :d], casting="same_kind")
    np.divide(q, q_scale, out=qa[:, :d], casting="same_kind")
    pa[:, d] = 2.0 * (d + 6) * _U32 * (p_norm / p_scale + _TINY)
    qa[:, d] = q_norm / q_scale + _TINY
    pa[:, d + 1] = 4.0 * _U32 * np.abs(diag)
    qa[:, d + 1] = 1.0
    weights = pa @ qa.T  # float32 [n, n] >= p_i . q_j / (p_scale q_scale)
    np.subtract(diag.astype(np.float32)[:, None], weights, out=weights)
    np.fill_diagonal(weights, 0.0)
    return _pairing_is_optimal(weights)


def _pairing_is_optimal(weights: np.ndarray, budget: float = 16.0) -> bool:
    """True if the graph with edge weights ``weights[i, j]`` (``[n, n]``, zero diagonal) has no negative cycle.

    With ``weights[i, j] = gain[i, i] - gain[i, j]`` (or a lower bound of it) this proves that the
    identity permutation maximizes ``sum_i gain[i, s(i)]``: it is optimal iff no cyclic exchange
    (row ``i`` takes column ``j``, ...) gains. Bellman-Ford from a virtual source (``d = 0``),
    relaxing only the edges of nodes whose ``d`` dropped in the previous round, settles to potentials
    with ``d[j] <= d[i] + W[i, j]`` for all ``i, j`` exactly when there is no negative cycle; such
    potentials bound every cycle's weight below by 0. ``n`` rounds without settling prove a
    negative cycle. Gives up (False, undecided) after relaxing ``budget * n`` rows of ``W``.
    Non-finite weights count as undecided. ``weights``: float64, or float32 (sums in float64).
    """
    n = len(weights)
    dist = weights.min(axis=0).astype(np.float64)  # first round: min(0, min_i W[i, j]), as W[j, j] = 0
    if not np.isfinite(dist).all():
        return False
    changed = np.flatnonzero(dist < 0)
    work, rounds = n, 1
    while changed.size:
        work += changed.size
        rounds += 1
        if work > budget * n or rounds > n:
            return False
        relaxed = (dist[changed, None] + weights[changed]).min(axis=0)
        improved = np.flatnonzero(relaxed < dist)
        dist[improved] = relaxed[improved]
        changed = improved
    return True


def _as_samples(a: torch.Tensor | np.ndarray, name: str) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().to("cpu", torch.float64).numpy()
    try:
        a = np.asarray(a, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be a tensor or array of numbers [n, d], got {type(a).__name__}") from err
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2:
        raise ValueError(f"{name} must have shape [n, d] (or [n]), got {a.shape}; pool or flatten the extra dims first")
    if a.shape[0] < 2:
        raise ValueError(f"{name} has {a.shape[0]} sample(s): the affinity score needs at least 2")
    if a.shape[1] < 1:
        raise ValueError(f"{name} has no features (shape {a.shape})")
    finite = np.isfinite(a)
    if not finite.all():
        row, col = np.argwhere(~finite)[0]
        raise ValueError(
            f"{name} contains NaN or inf values ({int((~finite).sum())} of them, the first at row {row}, "
            f"column {col}): drop or repair those samples first"
        )
    return a


def _standardised(a: np.ndarray) -> np.ndarray:
    """``a`` centred and divided by its RMS ``sqrt(tr Cov(a) / d)``; all zeros for a constant ``a``.

    ``a`` is first scaled by a power of two to ``max |a| <= 1`` (exact), so that neither the mean
    nor the squares under- or overflow at any finite scale (``1e-300`` to ``1e300``).
    """
    peak = float(np.abs(a).max())
    if peak == 0.0:
        return np.zeros_like(a)
    constant = (a == a[0]).all(axis=0)
    a = np.ldexp(a, -np.frexp(peak)[1])
    a -= a.mean(axis=0)
    a[:, constant] = 0.0  # exactly: the rounded mean of equal values may differ from them in the last bit
    rms = np.sqrt(np.einsum("ij,ij->", a, a) / a.size)
    if rms == 0.0:
        return np.zeros_like(a)
    a /= rms
    return a


def _covariance(centred: np.ndarray, shrinkage: str | None) -> np.ndarray:
    if shrinkage == "ledoit-wolf":
        ledoit_wolf = require("sklearn.covariance", what="shrinkage='ledoit-wolf'").ledoit_wolf

        return ledoit_wolf(centred, assume_centered=True)[0]
    return centred.T @ centred / centred.shape[0]


# --------------------------------------------------------------------------------------------
# non-linearity signature


def affinity_signature(
    model: nn.Module,
    inputs: Any,
    batch_size: int = 256,
    max_samples: int = 2048,
    progress: bool = True,
    shrinkage: str | None = None,
    ridge: float = 1e-6,
) -> list[tuple[str, float]]:
    """Non-linearity signature: the affinity score of every activation call site, in forward order.

    Sites: every ``LinearizableActivation`` unit of ``model`` (scored on its actual output, slopes
    included) and every standard activation module (``nn.ReLU``, ``nn.GELU``, ``nn.SiLU``...,
    ``transformers.activations``) not inside a unit, so an unconverted baseline works too. A module
    called several times per forward (torchvision ``BasicBlock.relu``) gives one site per call,
    named ``"<module>.calls.<i>"`` like the units of ``linearize.convert``. Activations called as
    functions (``F.relu`` inside ``forward``) cannot be hooked and are not measured.

    Samples and features of a site (input and output alike):

    - ``[N, D]``: as is;
    - ``[B, T, D]`` (channels last: Transformer hidden states): every token of every sequence is a
      sample (``B * T`` rows, padding tokens included), ``D`` features;
    - feature maps ``[N, C, H, W]`` (or ``[N, C, L]``, ``[N, C, D, H, W]``, or channels-last maps of a
      unit with ``channel_dim=-1``): averaged over the spatial dims to ``[N, C]`` (the seed shows the
      score is robust to this pooling). Without a unit to say where channels are, 3-d tensors are
      read as ``[B, T, D]`` and 4+-d tensors as channels-first. Pooling accumulates in float32
      (float64 for float64 models).

    At most ``max_samples`` rows per site are kept: a uniform random subset drawn with a fixed seed
    (random keys, smallest kept), the same rows of input and output.

    The sites are scored ``torch.get_num_threads()`` at a time, each on one thread with one BLAS
    thread (BLAS is limited to one thread process-wide meanwhile), see :func:`_score_sites`.

    Args:
        model: any ``nn.Module``; run in eval mode under ``torch.no_grad`` (the train/eval flags of
            all its modules are restored afterwards), on the device of its first parameter.
        inputs: data (:mod:`linearize.inputs`): a tensor or array (samples along dim 0), a mapping
            of tensors (``model(**batch)``, e.g. tokenizer output), an ``(inputs, *targets)`` tuple
            (only ``inputs`` is fed), or an iterable of such batches (a ``DataLoader``).
        batch_size: batches larger than this are split.
        max_samples: rows kept per site (the assignment costs ``O(max_samples^2)`` memory).
        progress: show tqdm progress bars.
        shrinkage, ridge: passed to :func:`affinity_score`.

    Returns:
        ``[(site_name, score)]`` ordered by the first call of each site in the forward pass.

    Raises:
        ValueError: no activation sites, no batches, fewer than 2 rows at a site, NaN/inf
            activations (the error names the site), an output of another shape than its input.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not (isinstance(max_samples, int) and max_samples >= 2):
        raise ValueError(f"max_samples must be an int >= 2, got {max_samples!r}")
    if shrinkage not in SHRINKAGE:
        raise ValueError(f"shrinkage must be one of {SHRINKAGE}, got {shrinkage!r}")
    modules = activation_sites(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no activation sites: no linearize units and no standard "
            "activation modules (nn.ReLU, nn.GELU, ...). Activations called as functions inside "
            "forward cannot be measured; linearize.convert reports them."
        )
    batches = Batches.of(inputs, "inputs").split(batch_size).to(model_device(model))
    recorder = _Recorder(modules, max_samples)
    try:
        with eval_mode(model), torch.no_grad():
            for batch in tqdm(batches, desc="affinity: forward", disable=not progress):
                recorder.start_forward()
                with inputs_fit(batch, "inputs batch"):
                    call_model(model, batch)
                recorder.end_forward()
    finally:
        recorder.remove()
    sites = recorder.named_sites()
    if not sites:
        raise ValueError(f"none of the {len(modules)} activation modules was called by the forward pass")
    samples = [(name, site.x, site.y) for name, site in sites]
    for name, x, _ in samples:
        if x.shape[0] < 2:
            raise ValueError(f"activation site {name!r} has {x.shape[0]} sample row(s), the affinity score needs at least 2: pass more inputs")
        if x.shape[0] <= x.shape[1] and shrinkage is None:
            warnings.warn(
                f"activation site {name!r}: {x.shape[0]} samples for {x.shape[1]} features, "
                "the sample covariance is singular; pass more inputs or shrinkage='ledoit-wolf'",
                stacklevel=2,
            )
    return _score_sites(samples, shrinkage, ridge, progress)


def _score_sites(
    sites: list[tuple[str, torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]],
    shrinkage: str | None,
    ridge: float,
    progress: bool,
) -> list[tuple[str, float]]:
    """Scores of the ``(name, x, y)`` sites in order, on ``torch.get_num_threads()`` threads (one BLAS thread each).

    Sites are independent and numpy / scipy release the GIL in the BLAS / LAPACK calls and the
    assignment solver (two threads do the work of one in 0.50-0.55 of the time for ``eigh``, GEMM
    and ``linear_sum_assignment`` on an idle 2-core machine), so threads use the cores the user
    gave torch: one site per thread scales
    better than multi-threaded BLAS on these small ``[d, d]`` / ``[n, n]`` problems. The widest sites
    are started first (shortest total time when their costs differ). BLAS is limited to one thread
    process-wide while they run.
    """

    def score(name: str, x: torch.Tensor | np.ndarray, y: torch.Tensor | np.ndarray) -> float:
        try:
            return affinity_score(x, y, shrinkage, ridge)
        except ValueError as err:
            raise ValueError(f"activation site {name!r}: {err}") from err

    workers = min(torch.get_num_threads(), len(sites))
    order = sorted(range(len(sites)), key=lambda i: -sites[i][1].shape[1])
    bar = tqdm(total=len(sites), desc="affinity: scores", disable=not progress)
    with threadpool_limits(1), ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(score, *sites[i]): i for i in order}
        try:
            for future in as_completed(futures):
                future.result()  # the first error stops the run
                bar.update()
        finally:
            for future in futures:
                future.cancel()
            bar.close()
    done = {i: future.result() for future, i in futures.items()}
    return [(sites[i][0], done[i]) for i in range(len(sites))]


def activation_sites(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules measured by :func:`affinity_signature`: units, and standard activations outside units."""
    return unit_sites(model, also=_is_standard_activation)


def _is_standard_activation(module: nn.Module) -> bool:
    cls = type(module)
    return isinstance(module, STANDARD_ACTIVATIONS) or (
        cls.__module__ == "transformers.activations" and cls.__name__ != "LinearActivation"
    )


@dataclass
class _Site:
    """Reservoir of at most ``max_samples`` paired (input, output) rows of one call site.

    Rows are kept per call as chunks (in the activations' dtype) and joined only when the reservoir
    overflows or is read: no re-copying of the kept rows at every batch.
    """

    channel_dim: int | None
    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (keys, x, y)
    rows: int = 0
    pending: tuple | None = None  # (keys, row index or None, input rows, input row count) of the running call

    def add(self, keys: torch.Tensor, x: torch.Tensor, y: torch.Tensor, max_samples: int) -> None:
        self.chunks.append((keys, x, y))
        self.rows += len(keys)
        if self.rows > max_samples:
            keys, x, y = self._joined()
            best = keys.topk(max_samples, largest=False).indices
            self.chunks, self.rows = [(keys[best], x[best], y[best])], max_samples

    def _joined(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if len(self.chunks) > 1:
            self.chunks = [tuple(torch.cat(parts) for parts in zip(*self.chunks))]
        return self.chunks[0]

    @property
    def x(self) -> torch.Tensor:
        """Kept input rows ``[rows, features]``, float64."""
        return self._joined()[1].to(torch.float64)

    @property
    def y(self) -> torch.Tensor:
        """Kept output rows ``[rows, features]``, float64, paired with :attr:`x`."""
        return self._joined()[2].to(torch.float64)


class _Recorder:
    """Forward pre-hooks take the input rows (before an in-place activation overwrites them),
    forward hooks the same rows of the output; a random key per row keeps a uniform subset."""

    def __init__(self, modules: list[tuple[str, nn.Module]], max_samples: int) -> None:
        self.max_samples = max_samples
        self.generator = torch.Generator().manual_seed(0)
        self.sites: dict[tuple[str, int], _Site] = {}  # (module name, call index), in call order
        self.calls: dict[str, int] = {}
        self.calls_per_forward: dict[str, int] | None = None
        self.handles = []
        for name, module in modules:
            channel_dim = module.channel_dim if isinstance(module, LinearizableActivation) else None
            label = name or type(module).__name__
            self.handles.append(module.register_forward_pre_hook(self._pre_hook(label, channel_dim)))
            self.handles.append(module.register_forward_hook(self._post_hook(label)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def start_forward(self) -> None:
        self.calls = {}

    def end_forward(self) -> None:
        if self.calls_per_forward is None:
            self.calls_per_forward = dict(self.calls)
        elif self.calls != self.calls_per_forward:
            raise RuntimeError(
                f"activation modules were called {self.calls} times in one forward pass and "
                f"{self.calls_per_forward} in another: the signature needs the same call sites in "
                "every batch (no data-dependent control flow)"
            )

    def named_sites(self) -> list[tuple[str, _Site]]:
        counts = self.calls_per_forward or {}
        return [
            (f"{name}.calls.{call}" if counts.get(name, 0) > 1 else name, site)
            for (name, call), site in self.sites.items()
        ]

    def _pre_hook(self, name: str, channel_dim: int | None):
        def hook(module: nn.Module, args: tuple) -> None:
            call = self.calls.get(name, 0)
            self.calls[name] = call + 1
            site = self.sites.setdefault((name, call), _Site(channel_dim))
            rows = _rows(args[0] if args else None, site.channel_dim, name, "input")
            keys = torch.rand(rows.shape[0], generator=self.generator)
            keep = None
            if len(keys) > self.max_samples:
                keep = keys.topk(self.max_samples, largest=False).indices
                keys = keys[keep]
            # a copy: an in-place activation cannot overwrite the kept rows
            site.pending = (keys, keep, _kept(rows, keep), rows.shape)

        return hook

    def _post_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            site = self.sites[(name, self.calls[name] - 1)]
            keys, keep, x, in_shape = site.pending
            site.pending = None
            rows = _rows(output, site.channel_dim, name, "output")
            if rows.shape != in_shape:
                raise ValueError(
                    f"activation site {name!r}: output rows {tuple(rows.shape)} differ from input rows "
                    f"{tuple(in_shape)}; the affinity score needs an elementwise activation"
                )
            site.add(keys, x, _kept(rows, keep), self.max_samples)

        return hook


def _kept(rows: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """A CPU copy of ``rows[keep]`` (all rows for ``keep=None``)."""
    if keep is None:
        return rows.to("cpu", copy=True)
    return rows[keep.to(rows.device)].to("cpu")


def _rows(t: object, channel_dim: int | None, name: str, what: str) -> torch.Tensor:
    """Sample rows ``[n, features]`` of one activation tensor (see :func:`affinity_signature`)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"activation site {name!r}: expected a tensor {what}, got {type(t).__name__}")
    t = t.detach()
    last = channel_dim is not None and channel_dim in (-1, t.ndim - 1)
    if t.ndim == 2 or (t.ndim == 3 and (channel_dim is None or last)):
        rows = t.reshape(-1, t.shape[-1])
    elif t.ndim >= 3:
        keep = t.ndim - 1 if last else 1
        # float32 accumulation (float64 for float64 models): a float64 copy of the whole map
        # would cost ~10x the pooling time; the score itself is computed in float64.
        dtype = torch.promote_types(t.dtype, torch.float32)
        rows = t.mean(dim=[d for d in range(1, t.ndim) if d != keep], dtype=dtype)
    else:
        raise ValueError(f"activation site {name!r}: cannot read samples from a {what} of shape {tuple(t.shape)}")
    if (rows - rows).sum() != 0:  # NaN iff a value is NaN or inf; one fused pass, unlike isfinite().all()
        raise ValueError(f"activation site {name!r} has NaN or inf values in its {what}")
    return rows
