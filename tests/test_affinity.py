"""Affinity score and non-linearity signature (seed 002), checked against reference values and POT."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.linalg import sqrtm as scipy_sqrtm
from torch import nn

import linearize
from linearize import LinearizableActivation
from linearize.measures import affinity_score, affinity_signature
from linearize.measures.affinity import (
    _float32_certificate,
    _pairing_is_optimal,
    _Recorder,
    _rows,
    exact_w2_squared,
    gaussian_ot_matrix,
)

ot = pytest.importorskip("ot", reason="POT (pip install pot) is the independent reference")


@pytest.fixture(autouse=True, scope="module")
def _one_blas_thread():
    """Multi-threaded OpenBLAS eigh slows down ~20x on a shared, oversubscribed CPU."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        yield


# ---------------------------------------------------------------------------- reference values


@pytest.mark.parametrize(
    "k, expected",
    [(1, 1.0), (3, 0.7112), (5, 0.5767), (7, 0.4956), (11, 0.3995), (21, 0.2889), (31, 0.2366), (41, 0.2048)],
)
def test_polynomials_match_reference_values(k, expected):
    x = torch.linspace(-1, 1, 1000, dtype=torch.float64)
    assert affinity_score(x, x**k) == pytest.approx(expected, abs=1e-3)


ACTIVATIONS = {
    "sigmoid": (torch.sigmoid, 0.911),
    "tanh": (torch.tanh, 0.813),
    "hardtanh": (F.hardtanh, 0.779),
    "hardswish": (F.hardswish, 0.696),
    "silu": (F.silu, 0.675),
    "leaky_relu": (F.leaky_relu, 0.628),
    "relu": (F.relu, 0.622),
    "gelu": (F.gelu, 0.614),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activations_on_gaussian_inputs_match_reference_values(name):
    fn, expected = ACTIVATIONS[name]
    x = torch.randn(2048, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert affinity_score(x, fn(x)) == pytest.approx(expected, abs=0.01)


# ---------------------------------------------------------------------------- properties


def _spd(d: int, rng: np.random.Generator) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return (q * rng.uniform(0.5, 2.0, d)) @ q.T


def test_spd_affine_map_scores_one():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 8)) * rng.uniform(0.5, 3, 8) + 5
    y = x @ _spd(8, rng) + rng.standard_normal(8) * 10
    assert abs(affinity_score(x, y) - 1.0) < 1e-6


def test_non_psd_linear_map_scores_below_one():
    # y = -x is linear but not the gradient of a convex function: not an OT map, rho < 1.
    x = np.random.default_rng(1).standard_normal((400, 3)) ** 3
    assert affinity_score(x, -x) < 0.9


def test_the_affine_maps_docs_measures_says_score_below_one():
    """The examples of docs/measures.md: only a positive semi-definite affine image scores 1."""
    torch.manual_seed(0)
    e = torch.empty(2000, 1, dtype=torch.float64).exponential_()
    x = torch.randn(2000, 4, dtype=torch.float64)
    rotation = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64))[0]
    assert affinity_score(e, 3 * e + 1) == pytest.approx(1.0, abs=1e-6)
    assert round(affinity_score(e, -e), 3) == round(affinity_score(e, 2 - 3 * e), 3) == 0.384
    assert round(affinity_score(x, x @ rotation.T), 3) == 0.815
    assert round(affinity_score(x, x.relu()), 3) == 0.614
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    with torch.no_grad():
        model[0].bias.fill_(1.0)
        model[1].set_linear_end(torch.full((8,), -0.5), torch.zeros(8))
        model[1].slope.fill_(1.0)  # every channel exactly linear: y = -0.5 x
    (site, score), = affinity_signature(model, torch.randn(2000, 4), progress=False)
    assert site == "1" and round(score, 3) == 0.836


def test_row_permutation_of_y_leaves_score_unchanged():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((700, 6))
    y = np.tanh(x @ rng.standard_normal((6, 6)))
    perm = rng.permutation(len(y))
    assert affinity_score(x, y[perm]) == pytest.approx(affinity_score(x, y), abs=1e-12)


@pytest.mark.parametrize("shrinkage", [None, "ledoit-wolf"])
def test_agrees_with_independent_pot_computation(shrinkage):
    from sklearn.covariance import LedoitWolf

    rng = np.random.default_rng(3)
    n, d, ridge = 400, 5, 1e-6
    x = rng.standard_normal((n, d)) @ rng.standard_normal((d, d)) + 3
    y = np.maximum(x @ rng.standard_normal((d, d)) - 1, 0) + 0.1 * rng.standard_normal((n, d))

    def cov(a):
        return LedoitWolf().fit(a).covariance_ if shrinkage else np.cov(a, rowvar=False, bias=True)

    cx, cy = cov(x), cov(y)
    a, b = ot.gaussian.bures_wasserstein_mapping(x.mean(0), y.mean(0), cx + ridge * np.eye(d), cy + ridge * np.eye(d))
    w = np.full(n, 1.0 / n)
    w2 = np.sqrt(ot.emd2(w, w, ot.dist(x @ a + b, y)))
    expected = 1 - w2 / np.sqrt(2 * np.trace(cy))
    assert 0.2 < expected < 0.95  # a genuinely non-linear case
    assert affinity_score(x, y, shrinkage=shrinkage, ridge=ridge) == pytest.approx(expected, abs=1e-4)


def test_pairing_certificate_agrees_with_brute_force():
    rng = np.random.default_rng(7)
    perms = np.array(list(itertools.permutations(range(6))))
    decided = {True: 0, False: 0}
    for trial in range(300):
        gain = rng.integers(-3, 4, (6, 6)).astype(float)  # small integers: many ties
        gain += np.eye(6) * rng.integers(0, 5)  # identity optimal more or less often
        best = gain[np.arange(6), perms].sum(axis=1).max()
        optimal = gain.trace() >= best
        weights = np.diag(gain)[:, None] - gain
        assert _pairing_is_optimal(weights, budget=100.0) == optimal  # enough to always decide
        decided[optimal] += 1
    assert min(decided.values()) > 30  # both answers were exercised


def _brute_force_identity_optimal(p: np.ndarray, q: np.ndarray) -> bool:
    perms = np.array(list(itertools.permutations(range(len(p)))))
    gain = p @ q.T
    return bool(gain.trace() >= gain[np.arange(len(p)), perms].sum(axis=1).max())


def test_float32_certificate_is_sound_and_usually_decides():
    rng = np.random.default_rng(9)
    proved = 0
    for trial in range(200):
        p = rng.standard_normal((6, 3))
        q = p + 0.3 * p**3 + rng.uniform(0, 1.5) * rng.standard_normal((6, 3))  # monotone map + noise
        if _float32_certificate(p, q):
            assert _brute_force_identity_optimal(p, q)
            proved += 1
    assert proved > 40
    p = rng.standard_normal((50, 4))
    assert _float32_certificate(1e30 * p, 1e-30 * (p + 0.3 * p**3))  # scales float32 cannot hold


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])  # float32 under- and overflows without rescaling
@pytest.mark.parametrize("margin", [-1e-9, 1e-9])
def test_float32_certificate_leaves_near_ties_to_float64(margin, scale):
    # rows 0 and 1: a close pair at c (|c| = 3) that q maps almost to one point, exchanging them
    # gains -margin (far below float32 resolution at this scale); other exchanges cost ~|c - p_j|^2 >= 1
    rng = np.random.default_rng(10)
    p = rng.standard_normal((6, 3))
    p *= 2.0 / np.linalg.norm(p, axis=1, keepdims=True)
    c = 1.5 * p[0]
    v = 0.05 * p[1]
    p[0], p[1] = c + v / 2, c - v / 2
    q = p.copy()
    q[0], q[1] = c + margin * v / (v @ v) / 2, c - margin * v / (v @ v) / 2
    p, q = p * scale, q * scale
    assert _brute_force_identity_optimal(p, q) is (margin > 0)
    assert not _float32_certificate(p, q)
    gain = p @ q.T
    assert _pairing_is_optimal(np.diag(gain)[:, None] - gain) is (margin > 0)


@pytest.mark.parametrize("case", ["float32 proof", "float64 proof (ties)", "solver"])
def test_exact_w2_matches_pot_on_every_path(case):
    rng = np.random.default_rng(8)
    p = rng.standard_normal((300, 4))
    if case == "float32 proof":
        q = p + 0.3 * p**3  # gradient of a strictly convex function: the pairing is optimal
    else:
        q = np.maximum(p, 0)  # monotone, but rows with p < 0 all map to 0: zero-cost exchanges
    q = q - q.mean(0)
    if case == "solver":
        q = q[rng.permutation(300)]
    gain = p @ q.T
    assert _float32_certificate(p, q) is (case == "float32 proof")
    assert _pairing_is_optimal(np.diag(gain)[:, None] - gain) is (case != "solver")
    w = np.full(300, 1 / 300)
    assert exact_w2_squared(p, q) == pytest.approx(ot.emd2(w, w, ot.dist(p, q)), rel=1e-10)


def test_gaussian_ot_matrix_is_the_spd_solution_of_a_sx_a_equals_sy():
    rng = np.random.default_rng(11)
    sx, sy = _spd(7, rng), _spd(7, rng)
    a = gaussian_ot_matrix(sx, sy, ridge=0.0)
    assert np.array_equal(a, a.T)
    assert np.linalg.eigvalsh(a).min() > 0
    np.testing.assert_allclose(a @ sx @ a, sy, atol=1e-12)
    sx_half = scipy_sqrtm(sx)  # the textbook formula with two matrix roots
    expected = np.linalg.inv(sx_half) @ scipy_sqrtm(sx_half @ sy @ sx_half) @ np.linalg.inv(sx_half)
    np.testing.assert_allclose(a, expected, atol=1e-10)
    with pytest.raises(np.linalg.LinAlgError, match="ridge > 0"):
        gaussian_ot_matrix(np.zeros((3, 3)), np.eye(3), ridge=0.0)  # singular Sx without a ridge


def test_scores_lie_in_unit_interval():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((300, 4))
    for y in (np.sign(x), rng.standard_normal((300, 4)), np.sin(5 * x), x**2):
        assert 0.0 <= affinity_score(x, y) <= 1.0


def test_relu_of_large_mean_float32_scores_one():
    # The precision pitfall: float32 distances between uncentred clouds give ~0.987 here.
    x = torch.randn(1000, 16, generator=torch.Generator().manual_seed(5)) + 100
    assert x.dtype == torch.float32
    assert affinity_score(x, torch.relu(x)) > 1 - 1e-6


def test_constant_output_scores_one():
    x = np.random.default_rng(6).standard_normal((50, 3))
    assert affinity_score(x, np.full((50, 3), 0.1)) == 1.0


# ---------------------------------------------------------------------------- scale


def _paper_score(x: np.ndarray, y: np.ndarray) -> float:
    """The seed's definition without any regularisation, textbook formulas in float64:
    ``A = Sy^1/2 (Sy^1/2 Sx Sy^1/2)^-1/2 Sy^1/2`` with scipy's ``sqrtm``, ``W2`` by POT's exact ``emd2``."""
    n = len(x)
    sx, sy = np.cov(x, rowvar=False, bias=True), np.cov(y, rowvar=False, bias=True)
    sy_half = np.real(scipy_sqrtm(sy))
    a = np.real(sy_half @ np.linalg.inv(scipy_sqrtm(sy_half @ sx @ sy_half)) @ sy_half)
    mapped = (x - x.mean(0)) @ a.T + y.mean(0)
    w = np.full(n, 1.0 / n)
    return 1.0 - np.sqrt(ot.emd2(w, w, ot.dist(mapped, y))) / np.sqrt(2.0 * np.trace(sy))


def _nonlinear_pair(seed: int = 12, n: int = 300, d: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """A full-rank cloud and a non-linear function of it (full-rank covariances: the paper's A exists)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) @ _spd(d, rng) + 2.0  # condition number <= 16: the ridge barely acts
    y = np.maximum(x @ rng.standard_normal((d, d)) - 0.5, 0.0) + 0.1 * x**2
    return x, y


@pytest.fixture(scope="module")
def paper_reference() -> float:
    value = _paper_score(*_nonlinear_pair())
    assert 0.3 < value < 0.95  # a genuinely non-linear case
    return value


SCALES = [(1.0, 1.0), (1e-8, 1e-8), (1e8, 1e8), (1e-4, 1e-4), (1e-8, 1.0), (1.0, 1e-8), (1e8, 1.0), (1.0, 1e8),
          (1e-8, 1e8), (1e8, 1e-8), (1e-200, 1e-200), (1e200, 1e200), (1e-300, 1e300), (1e300, 1e-300)]


@pytest.mark.parametrize("shrinkage", [None, "ledoit-wolf"])
@pytest.mark.parametrize("sx, sy", SCALES)
def test_score_is_invariant_to_common_and_separate_scales(sx, sy, shrinkage, paper_reference):
    """rho(a x, c y) = rho(x, y) (the definition is scale-free), equal to the paper's
    unregularised value computed at scale 1, from 1e-300 to 1e300. Before the relative ridge:
    .47 for ReLU at 1e-3, -1210 with y alone at 1e-6, NaN at 1e-200."""
    x, y = _nonlinear_pair()
    got = affinity_score(x * sx, y * sy, shrinkage=shrinkage)
    if shrinkage is None:
        assert got == pytest.approx(paper_reference, abs=1e-6)
    else:  # Ledoit-Wolf shrinks the covariances: near, not equal to, the unregularised value
        assert got == pytest.approx(affinity_score(x, y, shrinkage=shrinkage), abs=1e-12)
        assert got == pytest.approx(paper_reference, abs=0.01)


@pytest.mark.parametrize("scale", [1e-8, 1e-3, 1e8, 1e-200, 1e200])
def test_relu_and_affine_maps_at_any_scale(scale):
    """ReLU of N(0, I) keeps its score (.62 at scale 1) at every scale; an SPD affine map of a tiny
    or huge cloud scores 1; a constant y at any scale scores 1."""
    g = np.random.default_rng(13).standard_normal((512, 8))
    assert affinity_score(g * scale, np.maximum(g * scale, 0)) == pytest.approx(affinity_score(g, np.maximum(g, 0)), abs=1e-12)
    assert affinity_score(g, np.maximum(g, 0)) == pytest.approx(0.62, abs=0.02)
    rng = np.random.default_rng(14)
    y = (g @ _spd(8, rng) + rng.standard_normal(8)) * scale
    assert affinity_score(g / scale, y) == pytest.approx(1.0, abs=1e-6)
    assert affinity_score(g, np.full((512, 8), 3.0 * scale)) == 1.0


def test_degenerate_clouds_give_the_definitions_value():
    """Constant x with a varying y: every affine map sends x to one point, W2^2 = tr Cov(y), so
    rho = 1 - 1 / sqrt(2) at any scale; all-zero x and y: y is constant, rho = 1; constant columns
    (zero variance) of x and y leave the score of the other columns unchanged."""
    rng = np.random.default_rng(15)
    y = rng.standard_normal((200, 3))
    for scale in (1.0, 1e-300, 1e300):
        assert affinity_score(np.full((200, 3), 5.0 * scale), y * scale) == pytest.approx(1 - 1 / np.sqrt(2), abs=1e-9)
    assert affinity_score(np.zeros((200, 3)), np.zeros((200, 3))) == 1.0
    x, y = _nonlinear_pair()
    padded = lambda a, c: np.hstack([a, np.full((len(a), 2), c)])  # noqa: E731
    assert affinity_score(padded(x, 7.0) * 1e-6, padded(y, -1.0) * 1e-6) == pytest.approx(_paper_score(x, y), abs=1e-6)


def _adversarial_pairs() -> list[tuple[str, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(16)
    x = rng.standard_normal((120, 6))
    cauchy = rng.standard_cauchy((120, 6))
    two_point = np.repeat(np.eye(2, 6), 60, axis=0)
    few = rng.standard_normal((5, 6))  # n < d
    return [
        ("y tiny", x, 1e-6 * np.maximum(x, 0)),
        ("x tiny", 1e-6 * x, np.maximum(x, 0)),
        ("y of mixed scales", x, np.maximum(x, 0) * np.logspace(-12, 12, 6)),
        ("heavy tails", cauchy, np.tanh(cauchy)),
        ("two points to noise", two_point, rng.standard_normal((120, 6))),
        ("noise to two points", rng.standard_normal((120, 6)), two_point),
        ("n < d", few, np.maximum(few, 0)),
        ("two samples", x[:2], x[:2] ** 2),
        ("one outlier", np.vstack([x[:-1], 1e6 * np.ones((1, 6))]), np.sign(x)),
        ("sign", x, np.sign(x) * 1e-9),
        ("dead and live channels", x, np.maximum(x - np.array([0, 0, 0, 50, 50, 50]), 0)),
    ]


@pytest.mark.parametrize("shrinkage", [None, "ledoit-wolf"])
def test_scores_stay_in_unit_interval_on_adversarial_inputs(shrinkage):
    rng = np.random.default_rng(17)
    pairs = _adversarial_pairs() + [
        (f"random {i}", a, b) for i in range(20)
        for a, b in [(rng.standard_normal((50, 3)) * 10.0 ** rng.uniform(-10, 10),
                      rng.standard_normal((50, 3)) * 10.0 ** rng.uniform(-10, 10))]
    ]
    for name, x, y in pairs:
        score = affinity_score(x, y, shrinkage=shrinkage)
        assert 0.0 <= score <= 1.0, (name, score)


def test_signature_of_a_model_with_tiny_activations_matches_the_unscaled_one():
    """A network whose pre-activations are 1e-5 of another's (ReLU is positively homogeneous)
    has the same signature."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
    tiny = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU()).double()
    tiny.load_state_dict(model.state_dict())
    with torch.no_grad():
        tiny[0].weight.mul_(1e-5)
        tiny[0].bias.mul_(1e-5)
        tiny[2].bias.mul_(1e-5)  # every pre-activation is then 1e-5 of the original's
    x = torch.randn(400, 6, dtype=torch.float64)
    base = affinity_signature(model.double(), x, progress=False)
    assert affinity_signature(tiny, x, progress=False) == [(n, pytest.approx(v, abs=1e-9)) for n, v in base]


@pytest.mark.parametrize(
    "x, y, match",
    [
        (np.ones((1, 3)), np.ones((1, 3)), "at least 2"),
        (np.zeros((5, 3)), np.zeros((4, 3)), "same number of samples"),
        (np.zeros((5, 3)), np.zeros((5, 2)), "same number of features"),
        (np.array([[0.0, 1], [np.nan, 2]]), np.zeros((2, 2)), "x contains NaN or inf.*row 1, column 0"),
        (np.zeros((2, 2)), np.array([[0.0, np.inf], [1, 2]]), "y contains NaN or inf.*row 0, column 1"),
        (np.zeros((2, 2, 2)), np.zeros((2, 2, 2)), r"shape \[n, d\]"),
    ],
)
def test_bad_input_raises(x, y, match):
    with pytest.raises(ValueError, match=match):
        affinity_score(x, y)


def test_bad_shrinkage_raises():
    with pytest.raises(ValueError, match="shrinkage"):
        affinity_score(np.eye(3), np.eye(3), shrinkage="oas")


@pytest.mark.parametrize("ridge", [-1e-6, math.inf, math.nan, "1e-6"])
def test_bad_ridge_raises(ridge):
    with pytest.raises(ValueError, match="ridge must be a finite number"):
        affinity_score(np.eye(3), np.eye(3), ridge=ridge)


# ---------------------------------------------------------------------------- signature

# float32 forwards of different batch sizes may round differently in the last bit
TOL = 1e-6


def test_signature_of_baseline_mlp_with_inplace_relu_matches_manual_scores():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.Tanh())
    x = torch.randn(300, 6)
    with torch.no_grad():
        h1 = model[0](x)
        h2 = model[2](torch.relu(h1))
    got = affinity_signature(model, x, batch_size=64, progress=False)
    assert [name for name, _ in got] == ["1", "3"]
    # a hook after the in-place ReLU would see relu(h1) and score 1.0
    assert got[0][1] == pytest.approx(affinity_score(h1, torch.relu(h1)), abs=TOL)
    assert got[0][1] < 0.9
    assert got[1][1] == pytest.approx(affinity_score(h2, torch.tanh(h2)), abs=TOL)


class _Reuse(nn.Module):
    """One ReLU module called twice on different widths, like torchvision's BasicBlock."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.act = nn.Linear(4, 8), nn.Linear(8, 3), nn.ReLU()

    def forward(self, x):
        return self.act(self.b(self.act(self.a(x))))


def test_reused_module_gives_one_site_per_call_in_forward_order():
    torch.manual_seed(1)
    model, x = _Reuse(), torch.randn(200, 4)
    got = affinity_signature(model, x, progress=False)
    with torch.no_grad():
        h1 = model.a(x)
        h2 = model.b(torch.relu(h1))
    assert [n for n, _ in got] == ["act.calls.0", "act.calls.1"]
    assert got[0][1] == pytest.approx(affinity_score(h1, torch.relu(h1)), abs=TOL)
    assert got[1][1] == pytest.approx(affinity_score(h2, torch.relu(h2)), abs=TOL)


def test_conv_sites_are_pooled_over_space_and_unit_slopes_count():
    torch.manual_seed(2)
    unit = LinearizableActivation("relu", 8, channel_dim=1)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), unit, nn.Conv2d(8, 8, 3), nn.GELU())
    x = torch.randn(120, 3, 10, 10)
    with torch.no_grad():
        h = model[0](x)
        g = model[2](torch.relu(h))
    got = dict(affinity_signature(model, x, progress=False))
    assert list(got) == ["1", "3"]  # the unit's inner act is not a separate site
    pool = lambda t: t.mean((2, 3))  # noqa: E731
    assert got["1"] == pytest.approx(affinity_score(pool(h), pool(torch.relu(h))), abs=TOL)
    assert got["3"] == pytest.approx(affinity_score(pool(g), pool(F.gelu(g))), abs=TOL)
    with torch.no_grad():
        unit.slope.fill_(1.0)  # identity unit
    assert dict(affinity_signature(model, x, progress=False))["1"] == pytest.approx(1.0, abs=1e-6)


def test_token_sites_use_every_token_as_a_sample_and_loader_batches_agree():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6), nn.GELU())
    x = torch.randn(40, 7, 5)  # [B, T, D]
    with torch.no_grad():
        h = model[0](x).reshape(-1, 6)
    expected = affinity_score(h, F.gelu(h))
    assert affinity_signature(model, x, batch_size=16, progress=False) == [("1", pytest.approx(expected, abs=TOL))]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(40)), batch_size=9)
    assert affinity_signature(model, loader, progress=False)[0][1] == pytest.approx(expected, abs=TOL)


def test_mapping_inputs_are_passed_as_keywords():
    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = nn.Linear(3, 3), nn.SiLU()

        def forward(self, features, scale=1.0):
            return self.act(self.lin(features) * scale)

    torch.manual_seed(4)
    model, x = Keyword(), torch.randn(64, 3)
    with torch.no_grad():
        h = model.lin(x) * 2.0
    got = affinity_signature(model, {"features": x, "scale": 2.0}, batch_size=10, progress=False)
    assert got[0][1] == pytest.approx(affinity_score(h, F.silu(h)), abs=TOL)


def test_subsample_keeps_paired_rows_uniformly_and_deterministically():
    act = nn.Tanh()
    rec = _Recorder([("act", act)], max_samples=50)
    data = torch.randn(4, 30, 2, generator=torch.Generator().manual_seed(5))
    for batch in data:
        rec.start_forward()
        act(batch)
        rec.end_forward()
    (_, site), = rec.named_sites()
    rows = data.reshape(-1, 2).double()
    assert site.x.shape == (50, 2)
    assert torch.equal(site.y, torch.tanh(site.x.float()).double())  # rows stay paired
    assert all((rows == r).all(1).any() for r in site.x)  # and come from the data
    assert len({tuple(r.tolist()) for r in site.x}) == 50  # without replacement
    rec.remove()

    counts = torch.zeros(120)
    for seed in range(200):  # every row equally likely to be kept: 50 / 120
        rec = _Recorder([("act", act)], max_samples=50)
        rec.generator.manual_seed(seed)
        for batch in torch.arange(120.0).reshape(4, 30, 1):
            rec.start_forward()
            act(batch)
            rec.end_forward()
        counts[rec.sites[("act", 0)].x.long().flatten()] += 1
        rec.remove()
    assert (counts / 200 - 50 / 120).abs().max() < 0.15


def test_hugging_face_activation_modules_are_sites():
    activations = pytest.importorskip("transformers.activations")
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(4, 4), activations.ACT2FN["gelu_new"], nn.Linear(4, 4), activations.ACT2FN["linear"])
    x = torch.randn(100, 4)
    with torch.no_grad():
        h = model[0](x)
    got = affinity_signature(model, x, progress=False)
    assert got == [("1", pytest.approx(affinity_score(h, model[1](h)), abs=TOL))]  # identity "linear" is no site


def test_signature_restores_modes_and_runs_in_eval():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Dropout(0.5)).train()
    model[3].eval()
    before = model[1].running_mean.clone()
    affinity_signature(model, torch.randn(50, 3), progress=False)
    assert torch.equal(model[1].running_mean, before)
    assert [m.training for m in model] == [True, True, True, False]


def test_resnet18_has_17_sites_and_converted_model_agrees():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(7)
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    x = torch.randn(24, 3, 32, 32)
    with pytest.warns(UserWarning, match="singular"):
        base = affinity_signature(model, x, progress=False)
    assert len(base) == 17
    assert base[0][0] == "relu" and base[-1][0] == "layer4.1.relu.calls.1"
    linearize.convert(model, example_inputs=x[:2])
    with pytest.warns(UserWarning, match="singular"):
        converted = affinity_signature(model, x, progress=False)
    assert converted == base  # units with slope 0 compute the same function at the same sites


def test_signature_errors_name_the_problem():
    with pytest.raises(ValueError, match="no activation sites"):
        affinity_signature(nn.Linear(3, 3), torch.randn(10, 3), progress=False)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), nn.Sigmoid())
    with pytest.raises(ValueError, match="at least 2"):
        affinity_signature(model, torch.randn(1, 3), progress=False)
    with pytest.raises(ValueError, match="no batches"):
        affinity_signature(model, [], progress=False)
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="'3' has NaN or inf"):
        affinity_signature(model, torch.randn(10, 3), progress=False)
    assert not model[1]._forward_hooks and not model[1]._forward_pre_hooks  # hooks removed


def test_sites_scored_on_several_threads_give_the_same_signature():
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 7), nn.GELU())
    x = torch.randn(400, 5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = affinity_signature(model, x, progress=False)
        torch.set_num_threads(3)  # more threads than the machine may have: still exact and ordered
        three = affinity_signature(model, x, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert [name for name, _ in three] == ["1", "3", "5"]
    assert three == one
    with torch.no_grad():
        h = model[0](x)
    assert one[0][1] == pytest.approx(affinity_score(h, torch.relu(h)), abs=TOL)


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("shape", [(4, 3), (4, 3, 2, 2)])
def test_non_finite_activations_are_found_in_any_single_entry(bad, shape):
    t = torch.randn(*shape)
    assert _rows(t, None, "s", "input").shape == (4, 3)
    t.view(-1)[5] = bad
    with pytest.raises(ValueError, match="'s' has NaN or inf values in its input"):
        _rows(t, None, "s", "input")
