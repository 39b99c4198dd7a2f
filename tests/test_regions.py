"""Linear regions and absolute deviation (seed 001) against independent computations.

Independent references: activation patterns recorded by plain forward hooks on a dense grid, closed-form
breakpoints of one-hidden-layer networks, the hand-derived reference function
``f(x) = relu(x) - 2 relu(x - 1) + relu(x - 2)``, and dense trapezoid quadrature of the plain model output.
"""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from linearize.measures import regions as regions_module
from linearize.measures.regions import PartialResultWarning, linear_regions, absolute_deviation, translation_loops
from linearize.unit import ElementActivation, LinearizableActivation

_ACTS = (nn.ReLU, nn.LeakyReLU, nn.PReLU, LinearizableActivation)


pytestmark = pytest.mark.usefixtures("one_thread")


def _hook_patterns(model: nn.Module, xs: torch.Tensor) -> torch.Tensor:
    """Bool [G, U]: sign of every kinked unit input, recorded by forward hooks (float64)."""
    net = copy.deepcopy(model).double().eval()
    found: list[torch.Tensor] = []

    def hook(mod, inputs, _out):
        x = inputs[0]
        if isinstance(mod, nn.PReLU):
            w = mod.weight.detach()
        elif isinstance(mod, LinearizableActivation):
            w = mod.slope.detach() + (1 - mod.slope.detach()) * mod.leak
        else:
            w = torch.tensor([getattr(mod, "negative_slope", 0.0)], dtype=x.dtype)
        shape = [1] * x.ndim
        shape[1] = -1
        kinked = (w != 1).view(shape) if w.numel() > 1 else (w != 1)
        found.append(((x > 0) & kinked).flatten(1))

    for m in net.modules():
        if isinstance(m, _ACTS):
            m.register_forward_hook(hook)
    with torch.no_grad():
        for chunk in xs.double().split(2048):
            net(chunk)
    per_chunk = len(found) // math.ceil(xs.shape[0] / 2048)
    return torch.cat([torch.cat(found[i : i + per_chunk], 1) for i in range(0, len(found), per_chunk)])


def _plain(model: nn.Module, xs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).double().eval()(xs.double()).flatten(1)


def _check_against_dense(model, x0, x1, grid=4001, max_grid=100_001):
    """Every found breakpoint changes the hook pattern, no pattern change inside a region, and
    the per-region affine maps reproduce the plain forward on the grid."""
    result = linear_regions(model, x0, x1, batch_size=5)
    assert result.complete and result.stopped is None and torch.equal(result.covered, torch.ones(x0.shape[0], dtype=torch.float64))
    ts = torch.linspace(0, 1, grid, dtype=torch.float64)
    matched = 0
    for s in range(x0.shape[0]):
        d = (x1[s].double() - x0[s].double())
        path = lambda t: x0[s].double() + t.view(-1, *([1] * d.ndim)) * d  # noqa: E731
        reg = result.regions(s)
        assert reg["start"][0] == 0 and torch.all(reg["end"] > reg["start"])
        # consecutive regions have different patterns (each breakpoint is real)
        mids = _hook_patterns(model, path((reg["start"] + reg["end"]) / 2))
        assert torch.all((mids[1:] != mids[:-1]).any(1))
        # every grid point strictly inside a region has that region's pattern (nothing missed)
        k = torch.searchsorted(reg["end"], ts, right=True).clamp(max=len(reg["end"]) - 1)
        inside = ((ts - reg["start"][k]) > 1e-9) & ((reg["end"][k] - ts) > 1e-9)
        dense = _hook_patterns(model, path(ts))
        assert torch.equal(dense[inside], mids[k[inside]])
        # dense sampling fine enough to put 2 points in the shortest region counts as many
        # regions (runs of equal patterns)
        fine = math.ceil(2 / (reg["end"] - reg["start"]).min().item()) + 1
        if fine <= max_grid:
            fine_patterns = _hook_patterns(model, path(torch.linspace(0, 1, fine, dtype=torch.float64)))
            runs = int((fine_patterns[1:] != fine_patterns[:-1]).any(1).sum()) + 1
            assert runs == int(result.count[s])
            matched += 1
        # affine maps: f(x(t)) = value + (t - start) * slope
        f = _plain(model, path(ts))
        pred = reg["value"][k] + (ts - reg["start"][k])[:, None] * reg["slope"][k]
        torch.testing.assert_close(pred, f, rtol=1e-9, atol=1e-9)
    assert matched >= x0.shape[0] // 2, "max_grid too coarse to test the counts"
    assert result.count.sum() > 3 * x0.shape[0], "too few regions for a meaningful test"
    return result


def _reference_net() -> nn.Module:
    """f(x) = relu(x) - 2 relu(x - 1) + relu(x - 2)."""
    net = nn.Sequential(nn.Linear(1, 3), nn.ReLU(), nn.Linear(3, 1))
    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[0].bias.copy_(torch.tensor([0.0, -1.0, -2.0]))
        net[2].weight.copy_(torch.tensor([[1.0, -2.0, 1.0]]))
        net[2].bias.zero_()
    return net


def test_reference_function_hand_values():
    net = _reference_net()
    res = linear_regions(net, torch.tensor([[-1.0], [-0.5]]), torch.tensor([[3.0], [1.5]]))
    assert res.count.tolist() == [4, 3]
    torch.testing.assert_close(res.breakpoints[0], torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    torch.testing.assert_close(res.breakpoints[1], torch.tensor([0.25, 0.75], dtype=torch.float64))
    # integral over x (arc length): 1.0 split 0, .5, .5, 0; and 11/24 = 0.4583
    per_region = res.deviation(per_region=True)[:, 0]
    torch.testing.assert_close(per_region[:4], torch.tensor([0.0, 0.5, 0.5, 0.0], dtype=torch.float64))
    dev = absolute_deviation(net, torch.tensor([[-1.0], [-0.5]]), torch.tensor([[3.0], [1.5]]))
    torch.testing.assert_close(dev[:, 0], torch.tensor([1.0, 11 / 24], dtype=torch.float64))
    # over t instead: divided by the segment lengths 4 and 2
    torch.testing.assert_close(res.deviation(arc_length=False)[:, 0], torch.tensor([0.25, 11 / 48], dtype=torch.float64))
    # f(x1) from the last region's map
    torch.testing.assert_close(res.end_value[:, 0], torch.tensor([0.0, 0.5], dtype=torch.float64))


def test_hand_values_hold_under_inference_mode():
    """inference_mode turned forward AD off silently: 1 region and deviation 0 for every segment."""
    net = _reference_net()
    with torch.inference_mode():
        x0, x1 = torch.tensor([[-1.0], [-0.5]]), torch.tensor([[3.0], [1.5]])
        assert linear_regions(net, x0, x1).count.tolist() == [4, 3]
        dev = absolute_deviation(net, x0, x1)
    torch.testing.assert_close(dev[:, 0], torch.tensor([1.0, 11 / 24], dtype=torch.float64))
    assert torch.is_grad_enabled()


def test_mlp_matches_dense_sampling():
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(4, 12), nn.ReLU(), nn.Linear(12, 12), nn.LeakyReLU(0.1),
        nn.Linear(12, 12), nn.PReLU(12), nn.Linear(12, 3),
    )
    x0, x1 = torch.randn(6, 4) * 2, torch.randn(6, 4) * 2
    _check_against_dense(mlp, x0, x1)


class _Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, groups=2), nn.BatchNorm2d(c), nn.ReLU(inplace=True), nn.Conv2d(c, c, 1)
        )

    def forward(self, x):
        return x + self.body(x)


def test_cnn_with_residual_bn_pooling_matches_dense_sampling():
    torch.manual_seed(1)
    cnn = nn.Sequential(
        nn.Conv2d(2, 6, 3, stride=2, padding=1), LinearizableActivation("relu", 6),
        _Residual(6), nn.PReLU(6), nn.AvgPool2d(2),
        nn.Conv2d(6, 6, 3, padding=1), nn.LeakyReLU(0.2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3),
    )
    with torch.no_grad():
        bn = cnn[2].body[1]
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        cnn[1].slope.uniform_(0.0, 0.5)
    cnn.train()  # must be evaluated in eval mode and left as it was
    x0 = torch.randn(4, 2, 8, 8)
    x1 = x0 + 0.5 * torch.randn(4, 2, 8, 8)
    _check_against_dense(cnn, x0, x1, grid=3001)
    assert cnn.training


def test_torchvision_basic_and_bottleneck_blocks_match_dense_sampling():
    """torchvision blocks: reused in-place ReLU modules, BN (eval), downsampling shortcuts."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    torch.manual_seed(2)

    def shortcut(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=2, bias=False), nn.BatchNorm2d(cout))

    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        BasicBlock(8, 8), BasicBlock(8, 8, stride=2, downsample=shortcut(8, 8)),
        Bottleneck(8, 4, stride=2, downsample=shortcut(8, 16), base_width=64),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3),
    )
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
    x0 = torch.randn(3, 3, 8, 8)
    x1 = x0 + 0.3 * torch.randn(3, 3, 8, 8)
    _check_against_dense(net, x0, x1, grid=2001)


def test_one_hidden_layer_closed_form_and_linear_channels():
    """One hidden layer: breakpoints are the roots -a_j / b_j in (0, 1) of kinked channels only;
    channels with slope 1 (LinearizableActivation) or weight 1 (PReLU) contribute none."""
    torch.manual_seed(3)
    for act in (LinearizableActivation("relu", 16, -1), nn.PReLU(16)):
        net = nn.Sequential(nn.Linear(3, 16), act, nn.Linear(16, 2))
        linear = torch.zeros(16, dtype=torch.bool)
        linear[::3] = True
        with torch.no_grad():
            (act.slope if isinstance(act, LinearizableActivation) else act.weight)[linear] = 1.0
        x0, x1 = torch.randn(5, 3) * 3, torch.randn(5, 3) * 3
        res = linear_regions(net, x0, x1)
        a = (x0.double() @ net[0].weight.double().T + net[0].bias.double())
        b = (x1.double() - x0.double()) @ net[0].weight.double().T
        roots = -a / b
        for s in range(5):
            keep = (roots[s] > 0) & (roots[s] < 1) & ~linear
            torch.testing.assert_close(res.breakpoints[s], roots[s][keep].sort().values)
            assert res.count[s] == keep.sum() + 1
        assert ((roots > 0) & (roots < 1) & linear).any(), "no linear channel would have crossed"


def _units_mlp(granularity: str, end: str, slopes: torch.Tensor) -> nn.Module:
    """3-16-16-2 MLP with a ReLU unit and a LeakyReLU(0.1) unit of ``slopes``, identity or random affine ends."""
    def unit(act: nn.Module) -> LinearizableActivation:
        return ElementActivation(act, (16,)) if granularity == "element" else LinearizableActivation(act, 16)

    net = nn.Sequential(nn.Linear(3, 16), unit(nn.ReLU()), nn.Linear(16, 16), unit(nn.LeakyReLU(0.1)), nn.Linear(16, 2))
    g = torch.Generator().manual_seed(1)
    for u in (net[1], net[3]):
        with torch.no_grad():
            u.slope.copy_(slopes)
        if end == "affine":
            u.set_linear_end(torch.rand(16, generator=g) + 0.5, torch.randn(16, generator=g))
    return net


@pytest.mark.parametrize("granularity", ["channel", "element"])
@pytest.mark.parametrize("end", ["identity", "affine"])
def test_unit_channels_at_slope_one_have_no_kink_with_identity_or_affine_ends(granularity, end):
    """A unit's channel at ``a = 1`` computes its linear end alone (``x``, or ``alpha * x + beta``): no breakpoint,
    while channels at ``a = 0`` and ``0.5`` keep theirs, as the activation patterns of those channels on a dense
    float64 grid say; with every slope 1 the network is affine: one region, whose map is the plain forward's."""
    torch.manual_seed(4)
    net = _units_mlp(granularity, end, torch.tensor([0.0, 0.5, 1.0, 1.0] * 4))
    x0, x1 = torch.randn(4, 3) * 3, torch.randn(4, 3) * 3
    _check_against_dense(net, x0, x1)
    affine = _units_mlp(granularity, end, torch.ones(16))
    result = linear_regions(affine, x0, x1)
    assert result.count.tolist() == [1] * 4
    ts = torch.linspace(0, 1, 101, dtype=torch.float64)
    for s in range(4):
        f = _plain(affine, x0[s].double() + ts[:, None] * (x1[s].double() - x0[s].double()))
        torch.testing.assert_close(result.value[s] + ts[:, None] * result.slope[s], f, rtol=1e-9, atol=1e-9)


def test_deviation_matches_quadrature():
    torch.manual_seed(4)
    mlp = nn.Sequential(nn.Linear(3, 10), nn.ReLU(), nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 2))
    x0, x1 = torch.randn(4, 3) * 2, torch.randn(4, 3) * 2
    dev = absolute_deviation(mlp, x0, x1)
    ts = torch.linspace(0, 1, 200_001, dtype=torch.float64)
    for s in range(4):
        d = (x1[s].double() - x0[s].double())
        f = _plain(mlp, x0[s].double() + ts[:, None] * d)
        chord = f[:1] + ts[:, None] * (f[-1:] - f[:1])
        quad = torch.trapezoid((f - chord).abs(), ts, dim=0) * d.norm()
        torch.testing.assert_close(dev[s], quad, rtol=1e-6, atol=1e-9)
    assert (dev > 1e-3).sum() >= 6, "too few segments with a visible deviation"


@pytest.mark.parametrize(
    "layer, what",
    [
        (nn.MaxPool1d(2), "max_pool1d"),
        (nn.GELU(), "gelu"),
        (nn.Tanh(), "tanh"),
        (LinearizableActivation(nn.GELU(), 8, -1), "gelu"),
    ],
)
def test_refuses_non_piecewise_linear(layer, what):
    net = nn.Sequential(nn.Linear(4, 8), nn.Unflatten(1, (1, 8)), layer, nn.Flatten(), nn.Linear(8 // (2 if "pool" in what else 1), 1))
    with pytest.raises(ValueError, match=rf"{what}.*module '2"):
        linear_regions(net, torch.randn(2, 4), torch.randn(2, 4))


def test_refuses_functional_max_pool_and_products():
    class Functional(nn.Module):
        def __init__(self, square: bool) -> None:
            super().__init__()
            self.conv, self.square = nn.Conv2d(1, 2, 3, padding=1), square

        def forward(self, x):
            y = self.conv(x)
            return (y * y if self.square else F.max_pool2d(y, 2)).flatten(1)

    x0, x1 = torch.randn(2, 1, 4, 4), torch.randn(2, 1, 4, 4)
    with pytest.raises(ValueError, match="max_pool2d.*<root>"):
        linear_regions(Functional(False), x0, x1)
    with pytest.raises(ValueError, match="two input-dependent"):
        linear_regions(Functional(True), x0, x1)


def test_refuses_a_torch_function_without_a_name():
    """A ``__torch_function__`` call whose function has no ``__name__`` (a ``functools.partial``) is
    refused like any unknown op, named by its repr and its module (it raised NameError before)."""
    import functools

    from torch.overrides import handle_torch_function, has_torch_function

    def sine(x):
        if has_torch_function((x,)):
            return handle_torch_function(nameless, (x,), x)
        return torch.sin(x)

    nameless = functools.partial(sine)
    assert not hasattr(nameless, "__name__")

    class Sine(nn.Module):
        def forward(self, x):
            return nameless(x)

    net = nn.Sequential(nn.Linear(2, 2), Sine())
    with pytest.raises(ValueError, match=r"functools\.partial.*not known to be linear.*module '1'"):
        linear_regions(net, torch.zeros(1, 2), torch.ones(1, 2))


def test_bad_inputs():
    net = _reference_net()
    with pytest.raises(ValueError, match="same shape"):
        linear_regions(net, torch.zeros(2, 1), torch.zeros(3, 1))
    with pytest.raises(ValueError, match="NaN"):
        linear_regions(net, torch.full((1, 1), math.nan), torch.zeros(1, 1))
    with pytest.raises(TypeError):
        linear_regions(lambda x: x, torch.zeros(1, 1), torch.ones(1, 1))


def test_batching_does_not_change_results():
    torch.manual_seed(5)
    mlp = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    x0, x1 = torch.randn(9, 3) * 3, torch.randn(9, 3) * 3
    a, b = linear_regions(mlp, x0, x1, batch_size=2), linear_regions(mlp, x0, x1, batch_size=64)
    assert torch.equal(a.count, b.count) and torch.equal(a.segment, b.segment)
    torch.testing.assert_close(a.start, b.start)
    torch.testing.assert_close(a.value, b.value)


def test_translation_loops():
    torch.manual_seed(6)
    images = torch.rand(2, 3, 16, 20, dtype=torch.float64)
    x0, x1 = translation_loops(images, n_anchors=8, radius=4)
    assert x0.shape == (16, 3, 16, 20)
    # closed loop: each segment ends where the next starts, the last returns to the first
    assert torch.equal(x1[:7], x0[1:8]) and torch.equal(x1[7], x0[0])
    # anchor 0: integer shift by 4 px to the right (interior exact)
    torch.testing.assert_close(x0[0][..., 4:], images[0][..., :-4])
    # anchor 2: 4 px down
    torch.testing.assert_close(x0[2][:, 4:, :], images[0][:, :-4, :])
    # sub-pixel anchor 1 of a horizontal ramp: bilinear is exact, value = col - 4 cos(pi/4)
    ramp = torch.arange(20, dtype=torch.float64).expand(1, 1, 16, 20).clone()
    a1 = translation_loops(ramp)[0][1, 0]
    torch.testing.assert_close(a1[6:-6, 6:-6], ramp[0, 0, 6:-6, 6:-6] - 4 * math.cos(math.pi / 4))
    with pytest.raises(ValueError):
        translation_loops(torch.rand(3, 16, 16))


def _assert_same_regions(a, b):
    """Same counts, breakpoints and affine maps (1e-9), deviation and end values (1e-9)."""
    assert torch.equal(a.count, b.count) and torch.equal(a.segment, b.segment)
    for p, q in zip(a.breakpoints, b.breakpoints):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9)
    for field in ("value", "slope", "end_value", "length"):
        torch.testing.assert_close(getattr(a, field), getattr(b, field), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(a.deviation(), b.deviation(), rtol=0, atol=1e-9)


def _cnn() -> nn.Module:
    """Small CNN: residual block, BN in eval with non-trivial statistics, average pooling."""
    cnn = nn.Sequential(
        nn.Conv2d(2, 6, 3, stride=2, padding=1), nn.ReLU(), _Residual(6), nn.PReLU(6), nn.AvgPool2d(2),
        nn.Conv2d(6, 6, 3, padding=1), nn.LeakyReLU(0.2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3),
    )
    with torch.no_grad():
        cnn[2].body[1].running_mean.uniform_(-0.5, 0.5)
        cnn[2].body[1].running_var.uniform_(0.5, 2.0)
    return cnn.eval()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pieces_give_the_unsplit_result_mlp(seed):
    torch.manual_seed(10 + seed)
    width = (8, 16, 24)[seed]
    mlp = nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, width), nn.LeakyReLU(0.1), nn.Linear(width, 2))
    x0, x1 = torch.randn(4, 3) * 3, torch.randn(4, 3) * 3
    whole = linear_regions(mlp, x0, x1)
    assert whole.count.min() > 3, "too few regions for a meaningful test"
    for pieces, batch in ((7, 5), (32, 256), (32, 3)):
        split = linear_regions(mlp, x0, x1, pieces=pieces, batch_size=batch)
        _assert_same_regions(whole, split)
    assert (whole.count < 32).any(), "32 pieces must have been stitched inside regions"


def test_pieces_give_the_unsplit_result_cnn():
    torch.manual_seed(13)
    cnn = _cnn()
    x0 = torch.randn(2, 2, 8, 8)
    x1 = x0 + 0.5 * torch.randn(2, 2, 8, 8)
    whole = linear_regions(cnn, x0, x1)
    assert whole.count.min() > 5
    for pieces in (7, 32):
        _assert_same_regions(whole, linear_regions(cnn, x0, x1, pieces=pieces, batch_size=16))


def test_pieces_reference_function_and_boundaries_on_breakpoints():
    """The reference function on -1 -> 3 has kinks at t = 1/4, 1/2, 3/4: with 2 and 4 pieces every
    piece boundary is a breakpoint, with 3, 7, 8 pieces some are not."""
    net = _reference_net()
    for pieces in (1, 2, 3, 4, 7, 8):
        res = linear_regions(net, torch.tensor([[-1.0]]), torch.tensor([[3.0]]), pieces=pieces)
        assert res.count.tolist() == [4]
        torch.testing.assert_close(res.breakpoints[0], torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64),
                                   rtol=0, atol=1e-12)
        torch.testing.assert_close(res.deviation()[0, 0], torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-12)
        # per region: f = 0, rising to 1, falling to 0, 0 (values at the region starts, slopes in t)
        torch.testing.assert_close(res.value[:, 0], torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64))
        torch.testing.assert_close(res.slope[:, 0], torch.tensor([0.0, 4.0, -4.0, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("kink", [0.5, 0.5 - 1e-8, 0.5 + 1e-8, 0.5 - 3e-6, 0.5 + 3e-6])
def test_pieces_kink_at_or_near_a_piece_boundary(kink):
    """f(x) = relu(x - 0.3) + relu(x - kink) on 0 -> 1 (float64): breakpoints 0.3 and ``kink``,
    found at the same place whether the piece boundary 1/2 lies exactly on, just before or just
    after the kink (closer than eps = 1e-6, or farther)."""
    net = nn.Sequential(nn.Linear(1, 2), nn.ReLU(), nn.Linear(2, 1)).double()
    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[0].bias.copy_(torch.tensor([-0.3, -kink], dtype=torch.float64))
        net[2].weight.fill_(1.0)
        net[2].bias.zero_()
    x0, x1 = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    expected = torch.tensor([0.3, kink], dtype=torch.float64)
    # |f - chord| by quadrature of the closed form (the chord runs from f(0) = 0 to f(1) = 1.7 - kink)
    ts = torch.linspace(0, 1, 2_000_001, dtype=torch.float64)
    f = (ts - 0.3).clamp(min=0) + (ts - kink).clamp(min=0)
    quad = torch.trapezoid((f - (1.7 - kink) * ts).abs(), ts)
    for pieces in (1, 2, 4, 6):
        res = linear_regions(net, x0, x1, pieces=pieces)
        assert res.count.tolist() == [3]
        torch.testing.assert_close(res.breakpoints[0], expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(res.slope[:, 0], torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64))
        torch.testing.assert_close(res.deviation()[0, 0], quad, rtol=0, atol=1e-9)


def test_pieces_bad_values():
    net = _reference_net()
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="pieces"):
            linear_regions(net, torch.zeros(1, 1), torch.ones(1, 1), pieces=bad)


# ---------------------------------------------------------------------------- budgets


def _kinks_net(kinks: torch.Tensor) -> nn.Module:
    """f(x) = sum_k c_k relu(x - b_k), x scalar: its kinks are exactly ``kinks`` (c_k = +-1, +-2 never 0)."""
    k = len(kinks)
    net = nn.Sequential(nn.Linear(1, k), nn.ReLU(), nn.Linear(k, 1)).double()
    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[0].bias.copy_(-kinks)
        net[2].weight.copy_(torch.tensor([(-1.0) ** i * (1 + i % 2) for i in range(k)], dtype=torch.float64)[None])
        net[2].bias.zero_()
    return net


def _kinks() -> torch.Tensor:
    """30 kinks in (0, 1), at least 1e-3 apart (far above eps)."""
    gen = torch.Generator().manual_seed(20)
    b = torch.sort(torch.rand(30, generator=gen, dtype=torch.float64) * 0.96 + 0.02).values
    return b[torch.cat([torch.tensor([True]), b.diff() > 1e-3])]


# segments 0 -> 1, 1 -> 0 and 0.2 -> 0.7: the breakpoints in t are b, 1 - b and (b - 0.2) / 0.5
_X0 = torch.tensor([[0.0], [1.0], [0.2]], dtype=torch.float64)
_X1 = torch.tensor([[1.0], [0.0], [0.7]], dtype=torch.float64)


def _known_breakpoints(kinks: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for a, b in zip(_X0[:, 0].tolist(), _X1[:, 0].tolist()):
        t = (kinks - a) / (b - a)
        out.append(torch.sort(t[(t > 0) & (t < 1)]).values)
    return out


def _quadrature_deviation(net: nn.Module, s: int, upto: float) -> float:
    """int_0^upto |f(x(t)) - chord(t)| ||x1 - x0|| dt by the trapezoid rule on a dense grid (plain forward)."""
    a, b = _X0[s], _X1[s]
    with torch.no_grad():
        f0, f1 = net(a[None])[0, 0], net(b[None])[0, 0]
        ts = torch.linspace(0, upto, 400_001, dtype=torch.float64)
        f = net(a + ts[:, None] * (b - a))[:, 0]
    return float(torch.trapezoid((f - (f0 + ts * (f1 - f0))).abs(), ts) * (b - a).norm())


def _assert_prefix(part, full) -> None:
    """Every segment of ``part`` holds exactly the first ``part.count[s]`` regions of ``full``, the
    last one cut at ``part.covered[s]``, which lies inside the full result's region."""
    for s in range(len(full.count)):
        got, ref = part.regions(s), full.regions(s)
        m = int(part.count[s])
        torch.testing.assert_close(got["start"], ref["start"][:m], rtol=0, atol=1e-12)
        torch.testing.assert_close(got["value"], ref["value"][:m], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["slope"], ref["slope"][:m], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["end"][:-1], ref["end"][: max(m - 1, 0)], rtol=0, atol=1e-12)
        if m:
            assert ref["start"][m - 1] < part.covered[s] <= ref["end"][m - 1] + 1e-12
    torch.testing.assert_close(part.end_value, full.end_value, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pieces", [1, 4])
def test_complete_walk_finds_the_known_breakpoints(pieces):
    kinks = _kinks()
    full = linear_regions(_kinks_net(kinks), _X0, _X1, pieces=pieces, max_regions=None)
    assert full.complete and full.stopped is None and full.covered.tolist() == [1.0, 1.0, 1.0]
    for got, expected in zip(full.breakpoints, _known_breakpoints(kinks)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("m", [1, 2, 7, 16])
def test_max_regions_stops_with_the_first_regions_marked_partial(m):
    kinks = _kinks()
    net = _kinks_net(kinks)
    known = _known_breakpoints(kinks)
    full = linear_regions(net, _X0, _X1)
    assert [len(k) + 1 for k in known] == full.count.tolist() and min(full.count.tolist()) > 16
    with pytest.warns(PartialResultWarning, match=f"max_regions={m}.*3 of 3 segments are incomplete"):
        part = linear_regions(net, _X0, _X1, max_regions=m, batch_size=2)
    assert not part.complete and part.stopped == f"max_regions={m}"
    assert part.count.tolist() == [m, m, m]
    for s, k in enumerate(known):
        torch.testing.assert_close(part.breakpoints[s], k[: m - 1], rtol=0, atol=1e-12)
        # the walk knows region m up to its true end: the m-th known breakpoint
        assert part.covered[s].item() == pytest.approx(k[m - 1].item(), abs=1e-12)
        # deviation: the integral over the covered part only
        assert part.deviation()[s, 0].item() == pytest.approx(_quadrature_deviation(net, s, part.covered[s].item()), rel=1e-6, abs=1e-12)
    _assert_prefix(part, full)
    # a budget the walk does not reach changes nothing
    roomy = linear_regions(net, _X0, _X1, max_regions=int(full.count.max()))
    assert roomy.complete and torch.equal(roomy.count, full.count) and torch.equal(roomy.start, full.start)


@pytest.mark.parametrize("pieces, m", [(4, 5), (4, 12), (8, 29), (3, 1)])
def test_max_regions_with_pieces_keeps_a_prefix(pieces, m):
    """Pieces are walked in parallel: a stopped segment keeps its finished pieces up to the first
    unfinished one, so its rows are still the full result's first ones; a segment with at most
    ``m`` regions completes."""
    net = _kinks_net(_kinks())
    full = linear_regions(net, _X0, _X1)
    with pytest.warns(PartialResultWarning, match=f"max_regions={m}"):
        part = linear_regions(net, _X0, _X1, pieces=pieces, max_regions=m, batch_size=64)
    assert not part.complete and part.stopped == f"max_regions={m}"
    assert torch.equal(part.covered < 1, full.count > m) and (part.count <= m).all()
    _assert_prefix(part, full)
    for s in range(3):
        assert part.deviation()[s, 0].item() == pytest.approx(_quadrature_deviation(net, s, part.covered[s].item()), rel=1e-6, abs=1e-12)
    exact = linear_regions(net, _X0, _X1, pieces=pieces, max_regions=int(full.count.max()), batch_size=64)
    assert exact.complete and torch.equal(exact.count, full.count)


def test_max_seconds_stops_every_segment_and_marks_unstarted_ones(monkeypatch):
    """A fake clock advancing one second per reading (one before the walk, one after each forward):
    at 4 s the next forward would end past 4.5 s, so the walk stops after its third forward. Two
    segments per batch: segments 0 and 1 have 3 regions each, segment 2 never started."""
    readings = iter(range(1000))
    monkeypatch.setattr(regions_module, "time", types.SimpleNamespace(monotonic=lambda: float(next(readings))))
    net = _kinks_net(_kinks())
    full = linear_regions(net, _X0, _X1)
    with pytest.warns(PartialResultWarning, match="max_seconds=4.5"):
        part = linear_regions(net, _X0, _X1, batch_size=2, max_seconds=4.5)
    assert part.stopped == "max_seconds=4.5" and not part.complete
    assert part.count.tolist() == [3, 3, 0] and part.covered[2].item() == 0.0
    assert part.deviation()[2, 0].item() == 0.0 and part.breakpoints[2].numel() == 0
    _assert_prefix(part, full)


def test_absolute_deviation_passes_the_budget_on():
    net = _kinks_net(_kinks())
    with pytest.warns(PartialResultWarning):
        dev = absolute_deviation(net, _X0, _X1, max_regions=3)
    part = linear_regions(net, _X0, _X1, max_regions=None)
    assert (dev[:, 0] < part.deviation()[:, 0]).all()
    assert dev[0, 0].item() == pytest.approx(_quadrature_deviation(net, 0, _known_breakpoints(_kinks())[0][2].item()), rel=1e-6)


def test_progress_bar_shows_regions_and_distance(capsys):
    net = _kinks_net(_kinks())
    full = linear_regions(net, _X0[:1], _X1[:1], progress=True)
    err = capsys.readouterr().err
    assert f"{int(full.count[0])} regions" in err and "1/1 segments" in err
    with pytest.warns(PartialResultWarning):
        part = linear_regions(net, _X0[:1], _X1[:1], progress=True, max_regions=5)
    err = capsys.readouterr().err
    assert f"{part.covered.item():.3g}/1 segments" in err and "5 regions" in err


def test_eps_zero_terminates_on_kinks_closer_than_float64_resolution():
    """relu(relu(x - 1/2) - 1e-18) on 0 -> 1: kinks at 1/2 and 1/2 + 1e-18, closer than float64 can
    tell apart at 1/2. With eps = 0 the step 1e-18 used to leave t unchanged, forever."""
    net = nn.Sequential(nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1), nn.ReLU()).double()
    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[0].bias.fill_(-0.5)
        net[2].weight.fill_(1.0)
        net[2].bias.fill_(-1e-18)
    x0, x1 = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    res = linear_regions(net, x0, x1, eps=0.0, max_regions=1000)
    assert res.complete and res.count.tolist() == [3]
    torch.testing.assert_close(res.breakpoints[0], torch.tensor([0.5, 0.5], dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(res.slope[:, 0], torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))


@pytest.mark.parametrize("kwargs, match", [
    ({"max_regions": 0}, "max_regions"), ({"max_regions": 2.5}, "max_regions"), ({"max_regions": True}, "max_regions"),
    ({"max_seconds": 0}, "max_seconds"), ({"max_seconds": -1.0}, "max_seconds"), ({"max_seconds": math.nan}, "max_seconds"),
])
def test_bad_budgets(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        linear_regions(_reference_net(), torch.zeros(1, 1), torch.ones(1, 1), **kwargs)


@pytest.mark.parametrize("op", [lambda t: 1 / t, lambda t: t.square(), lambda t: t.clamp_min(3.0), lambda t: 2 ** t,
                                torch.log1p, torch.floor, lambda t: t * (t > 3.0), lambda t: t.norm(dim=1, keepdim=True),
                                lambda t: t.prod(1, keepdim=True), lambda t: torch.div(t, 2, rounding_mode="floor"),
                                lambda t: t // 2, lambda t: torch.special.expit(t), lambda t: t * t.sum().item()],
                         ids=["rdiv", "square", "clamp_min", "rpow", "log1p", "floor", "mask_by_compare", "norm",
                              "prod", "div_floor", "floordiv", "expit", "item"])
def test_ops_not_known_to_be_linear_are_refused(op):
    """Only listed linear ops pass the tracer: each of these bends or breaks a line through input space
    (a brute-force sample of f along x0 -> x1 is not affine), so counting 1 region would be wrong."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return op(self.lin(x) + 3.0)

    net = Net().double()
    x0, x1 = torch.tensor([[0.5, -1.0]], dtype=torch.float64), torch.tensor([[3.0, 2.0]], dtype=torch.float64)
    ts = torch.linspace(0, 1, 201, dtype=torch.float64)[:, None]
    with torch.no_grad():
        f = torch.cat([net(x0 + t * (x1 - x0)) for t in ts]).reshape(len(ts), -1)
    assert (f - (f[:1] + ts * (f[-1:] - f[:1]))).abs().max() > 1e-6  # the truth: not affine along the segment
    with pytest.raises(ValueError, match="not known to be linear|input-dependent|rounding_mode"):
        linear_regions(net, x0, x1)


def test_linear_layout_ops_pass_the_tracer():
    """A network of only listed linear ops and ReLUs: one region per ReLU pattern, the same count as dense sampling."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 1)

        def forward(self, x):
            h = self.a(x).view(-1, 2, 3).transpose(1, 2).flatten(1)
            h = torch.cat([h[:, :3], -h[:, 3:] / 2.0], 1).relu()
            return self.b(torch.lerp(h, h.flip(1), 0.25) - h.mean(1, keepdim=True))

    torch.manual_seed(0)
    net = Net().double()
    x0, x1 = torch.randn(1, 4, dtype=torch.float64), torch.randn(1, 4, dtype=torch.float64)
    ts = torch.linspace(0, 1, 200001, dtype=torch.float64)[:, None]
    with torch.no_grad():
        pattern = (torch.cat([x0 + t * (x1 - x0) for t in ts[::1]]) @ net.a.weight.T + net.a.bias)  # pre-ReLU
    h = pattern.view(-1, 2, 3).transpose(1, 2).flatten(1)
    h = torch.cat([h[:, :3], -h[:, 3:] / 2.0], 1) > 0
    changes = int((h[1:] != h[:-1]).any(1).sum())
    assert int(linear_regions(net, x0, x1).count.reshape(-1)[0]) == changes + 1


@pytest.mark.parametrize("op", [lambda t: t.detach(), lambda t: t.data, lambda t: t.to(torch.long).to(t.dtype),
                                lambda t: t.new_tensor(t), lambda t: t * t.to(torch.bool)],
                         ids=["detach", "data", "to_long", "new_tensor", "to_bool"])
def test_regions_refuse_ops_that_cut_or_quantize_the_input(op):
    from linearize.measures.regions import linear_regions

    net = nn.Sequential(nn.Linear(1, 1)).double()
    with torch.no_grad():
        net[0].weight.fill_(3.0)

    class Net(nn.Module):
        def forward(self, x):
            return torch.relu(op(net(x)) - 1.0) + net(x)  # a kink (or steps) the tracer would not see

    with pytest.raises(ValueError, match="cuts the output's dependence|into torch"):
        linear_regions(Net(), torch.tensor([[-1.0]], dtype=torch.float64), torch.tensor([[2.0]], dtype=torch.float64))


def test_regions_accept_where_with_a_constant_mask_and_addcmul_with_one_input_factor():
    from linearize.measures.regions import linear_regions

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(1, 3)

        def forward(self, x):
            h = self.lin(x)
            mask = torch.tensor([True, False, True])
            return torch.where(mask, torch.relu(h), 0.0).addcmul(h, torch.full((3,), 2.0)).sum(1, keepdim=True)

    torch.manual_seed(0)
    net = Net().double()
    x0, x1 = torch.tensor([[-3.0]], dtype=torch.float64), torch.tensor([[3.0]], dtype=torch.float64)
    ts = torch.linspace(0, 1, 100001, dtype=torch.float64)[:, None]
    with torch.no_grad():
        h = net.lin(x0 + ts * (x1 - x0)) > 0  # regions: activation patterns of the ReLU (seed 001), all 3 channels
    assert int(linear_regions(net, x0, x1).count.reshape(-1)[0]) == int((h[1:] != h[:-1]).any(1).sum()) + 1
