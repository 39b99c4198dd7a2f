"""stable_units and compress: reference cases with bounds worked out by hand, soundness against MILP and
dense sampling, and lossless compression checked on fresh samples of the box."""

import warnings

import pytest
import torch
from torch import nn

import linearize
from linearize import LinearizableActivation

BOX_METHODS = ["ibp", "crown", "milp"]


def reference_net():
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.ReLU(), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, -1.0], [2.0, -1.0]]))
        model[2].weight.copy_(torch.tensor([[1.0, -1.0]]))
    return model


REF_PAIR = (torch.tensor([-1.0, -2.0]), torch.tensor([2.0, 1.0]))
REF_BOX = linearize.Box(*REF_PAIR)


@pytest.mark.parametrize("method,out", [("ibp", (-6, 4)), ("crown", (-3, 3)), ("milp", (-2, 1))])
def test_reference_bounds(method, out):
    result = linearize.stable_units(reference_net(), REF_BOX, method=method)
    site = result.sites["1"]
    assert site.lower.tolist() == [-2.0, -3.0] and site.upper.tolist() == [4.0, 6.0]
    assert result.output_lower.item() == pytest.approx(out[0], abs=1e-5)
    assert result.output_upper.item() == pytest.approx(out[1], abs=1e-5)
    assert site.unstable.all()


def test_reference_true_range_by_sampling_matches_milp():
    x = torch.cartesian_prod(torch.linspace(-1, 2, 301), torch.linspace(-2, 1, 301))
    y = reference_net()(x)
    assert (y.min().item(), y.max().item()) == pytest.approx((-2.0, 1.0), abs=1e-6)


@pytest.mark.parametrize("method", BOX_METHODS)
def test_single_neuron_cases(method):
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, -1.0]]))
        model[0].bias.copy_(torch.tensor([-5.0, 1.0, 0.0]))
    site = linearize.stable_units(model, linearize.Box(torch.zeros(2), torch.ones(2)), method=method).sites["1"]
    assert site.inactive.tolist() == [True, False, False]
    assert site.active.tolist() == [False, True, False]
    assert site.unstable.tolist() == [False, False, True]


def random_mlp(seed, widths=(2, 7, 7, 6, 2), prelu=False, batchnorm=False):
    """Small MLP with shifted biases (so that some units are stable) and optionally PReLU slopes."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        lin = nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=g))
            lin.bias.copy_(2.5 * torch.randn(b, generator=g))
        layers.append(lin)
        if i < len(widths) - 2:
            if batchnorm:
                bn = nn.BatchNorm1d(b).eval()
                with torch.no_grad():
                    bn.running_mean.copy_(torch.randn(b, generator=g))
                    bn.running_var.copy_(torch.rand(b, generator=g) + 0.5)
                    bn.weight.copy_(torch.randn(b, generator=g))
                layers.append(bn)
            unit = LinearizableActivation("relu", b, -1)
            if prelu:
                with torch.no_grad():
                    unit.slope.copy_(torch.rand(b, generator=g) * (torch.rand(b, generator=g) < 0.5))
            layers.append(unit)
    return nn.Sequential(*layers).eval()


def sampled_preactivations(model, x):
    """{site: [n, C] pre-activations} in float64 by hooks (independent of the bound code)."""
    model = model.double()
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.__setitem__(n, a[0]))
             for n, m in model.named_modules() if isinstance(m, (LinearizableActivation, nn.ReLU))]
    with torch.no_grad():
        out = model(x.double())
    for h in hooks:
        h.remove()
    return seen, out


@pytest.mark.parametrize("seed,prelu,batchnorm", [(0, False, False), (1, True, False), (2, False, True)])
def test_soundness_against_sampling_and_nesting(seed, prelu, batchnorm):
    model = random_mlp(seed, prelu=prelu, batchnorm=batchnorm)
    box = linearize.Box(torch.tensor([-1.0, 0.0]), torch.tensor([1.0, 0.5]))
    results = {m: linearize.stable_units(model, box, method=m) for m in BOX_METHODS}
    grid = torch.cartesian_prod(torch.linspace(-1, 1, 201), torch.linspace(0, 0.5, 101))
    pre, out = sampled_preactivations(model, grid)
    eps = 1e-9
    stable_total = unstable_total = 0
    for name, z in pre.items():
        zmin, zmax = z.amin(0), z.amax(0)
        for r in results.values():
            s = r.sites[name]
            assert (s.lower <= zmin + eps).all() and (s.upper >= zmax - eps).all()
            assert (zmax[s.inactive] <= eps).all(), "a unit called stably inactive is active somewhere"
            assert (zmin[s.active] >= -eps).all(), "a unit called stably active is negative somewhere"
        ibp, crown, milp = (results[m].sites[name] for m in BOX_METHODS)
        assert (ibp.lower <= crown.lower + eps).all() and (crown.lower <= milp.lower + eps).all()
        assert (milp.upper <= crown.upper + eps).all() and (crown.upper <= ibp.upper + eps).all()
        # MILP solved the neurons it leaves unstable exactly: its bounds are attained up to the grid
        span = (zmax - zmin).clamp(min=1e-6)
        solved = milp.unstable
        assert (((milp.upper - zmax) / span)[solved] < 0.05).all()
        assert (((zmin - milp.lower) / span)[solved] < 0.05).all()
        unstable_total += int(solved.sum())
        assert (milp.inactive.sum() + milp.active.sum()) >= (ibp.inactive.sum() + ibp.active.sum())
        stable_total += int(milp.inactive.sum() + milp.active.sum())
    assert stable_total > 0 and unstable_total > 0  # the case exercises both
    assert (results["milp"].output_lower <= out.amin(0) + eps).all()
    assert (results["milp"].output_upper >= out.amax(0) - eps).all()


def test_conv_network_is_sound():
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), LinearizableActivation("relu", 3, 1),
        nn.Conv2d(3, 2, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 2),
    ).eval()
    with torch.no_grad():
        model[1].running_mean.copy_(torch.tensor([0.5, -2.0, 0.0]))
    box = linearize.Box(torch.zeros(1, 5, 5), torch.ones(1, 5, 5))
    ibp = linearize.stable_units(model, box, method="ibp")
    crown = linearize.stable_units(model, box, method="crown")
    x = torch.rand(4000, 1, 5, 5)
    x[:500] = x[:500].round()  # vertices of the box
    pre, _ = sampled_preactivations(model, x)
    for r in (ibp, crown):
        for name, z in pre.items():
            s = r.sites[name]
            assert s.active.shape == z.shape[1:]
            assert (z.amax(0)[s.inactive] <= 1e-9).all() and (z.amin(0)[s.active] >= -1e-9).all()
    assert crown.counts["active"] + crown.counts["inactive"] >= ibp.counts["active"] + ibp.counts["inactive"] > 0
    active_c, inactive_c = crown.sites["2"].channel_masks()
    assert active_c.shape == (3,)
    assert torch.equal(inactive_c, crown.sites["2"].inactive.flatten(1).all(1))


def test_data_method_matches_brute_force():
    model = random_mlp(4)
    x = torch.rand(300, 2)
    result = linearize.stable_units(model, x)
    assert result.method == "data"
    pre, _ = sampled_preactivations(model, x)
    for name, z in pre.items():
        s = result.sites[name]
        assert torch.equal(s.inactive, z.amax(0) <= 0)
        assert torch.equal(s.active, (z.amin(0) >= 0) & (z.amax(0) > 0))


def test_a_pair_of_same_shaped_tensors_is_data_not_a_box():
    """``(x, y)`` with ``y`` shaped like ``x`` (an autoencoder's batch) is an ``(inputs, targets)`` batch:
    bounds are the min / max of the pre-activations over ``x``, by hand; ``compress`` reads it the same way.
    (It was read as an input box: wrong bounds, or "lower > upper" even with method="data".)"""
    torch.manual_seed(0)
    model = random_mlp(2, widths=(3, 6, 3))
    x, y = torch.randn(16, 3), torch.randn(16, 3)
    with torch.no_grad():
        z = (x.double() @ model[0].weight.double().T + model[0].bias.double())
    for method in (None, "data"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = linearize.stable_units(model, (x, y), method=method)
        assert result.method == "data"
        assert [issubclass(w.category, FutureWarning) for w in caught] == ([True] if method is None else [])
        torch.testing.assert_close(result.sites["1"].lower, z.amin(0), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(result.sites["1"].upper, z.amax(0), rtol=1e-6, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        small = linearize.compress(model, (x, y))
    assert small.compression_report.method == "data"
    torch.testing.assert_close(small(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_box_is_a_box_and_the_old_tuple_form_warns_with_an_explicit_method():
    box = REF_BOX
    assert box.lower.dtype == torch.float64 and torch.equal(box.upper, REF_PAIR[1].double())
    new = linearize.stable_units(reference_net(), box)
    assert new.method == "crown" and new.sites["1"].lower.tolist() == [-2.0, -3.0]
    with pytest.warns(FutureWarning, match=r"pass linearize\.Box\(lower, upper\) for method='crown'"):
        old = linearize.stable_units(reference_net(), REF_PAIR, method="crown")
    assert torch.equal(old.output_lower, new.output_lower) and torch.equal(old.output_upper, new.output_upper)
    with pytest.warns(FutureWarning, match="deprecated"):
        linearize.compress(reference_net(), REF_PAIR, method="ibp", samples=16)
    with pytest.raises(ValueError, match="needs data .* not a Box"):
        linearize.stable_units(reference_net(), box, method="data")
    with pytest.raises(ValueError, match=r"needs an input box: pass domain=linearize\.Box"):
        linearize.stable_units(reference_net(), torch.randn(4, 2), method="ibp")
    for lower, upper, words in ((torch.zeros(2), torch.tensor([1.0, float("nan")]), "NaN"),
                                (torch.tensor(0.0), torch.tensor(1.0), "not scalars"),
                                (torch.zeros(2), torch.ones(3), "one input's shape")):
        with pytest.raises(ValueError, match=words):
            linearize.Box(lower, upper)


def test_bad_domains_and_models():
    model = random_mlp(0)
    with pytest.raises(ValueError, match="lower > upper"):
        linearize.stable_units(model, linearize.Box(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])))
    with pytest.raises(ValueError, match="method"):
        linearize.stable_units(model, linearize.Box(torch.zeros(2), torch.ones(2)), method="lp")
    with pytest.raises(ValueError, match="needs data"):
        linearize.stable_units(model, linearize.Box(torch.zeros(2), torch.ones(2)), method="data")
    with pytest.raises(ValueError, match="no ReLU"):
        linearize.stable_units(nn.Sequential(nn.Linear(2, 2)), linearize.Box(torch.zeros(2), torch.ones(2)))
    with pytest.raises(TypeError, match="MaxPool"):
        linearize.stable_units(nn.Sequential(nn.MaxPool1d(2), nn.ReLU()), linearize.Box(torch.zeros(1, 4), torch.ones(1, 4)))
    with pytest.raises(TypeError, match="gelu"):
        linearize.stable_units(nn.Sequential(nn.Linear(2, 2), LinearizableActivation(nn.GELU(), 2, -1)),
                               linearize.Box(torch.zeros(2), torch.ones(2)))
    bn = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.ReLU()).train()
    with pytest.raises(ValueError, match="eval"):
        linearize.stable_units(bn, linearize.Box(torch.zeros(2), torch.ones(2)))


def box_samples(box, n=3000, seed=7):
    lower, upper = box.lower.float(), box.upper.float()
    g = torch.Generator().manual_seed(seed)
    return lower + (upper - lower) * torch.rand(n, *lower.shape, generator=g)


@pytest.mark.parametrize("seed,prelu,batchnorm", [(0, False, False), (1, True, False), (5, False, True)])
def test_compress_is_lossless_on_the_box(seed, prelu, batchnorm):
    model = random_mlp(seed, widths=(3, 12, 12, 12, 2), prelu=prelu, batchnorm=batchnorm)
    box = linearize.Box(torch.full((3,), -0.5), torch.full((3,), 0.5))
    small = linearize.compress(model, box)
    rep = small.compression_report
    assert all(isinstance(m, (nn.Linear, nn.ReLU, nn.PReLU)) for m in small)
    x = box_samples(box)
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)
    units_after = sum(m.out_features for m in small if isinstance(m, nn.Linear)) - 2
    assert rep.units_after == units_after < rep.units_before == 36
    dead = sum(int((rep.stability.sites[n].inactive & (u.slope == 0)).sum())
               for n, u in linearize.units(model) if n not in rep.folded_sites)
    assert rep.removed_inactive == dead  # every dead ReLU outside folded layers is dropped
    assert rep.max_error <= 1e-4 * rep.output_scale


def test_compress_one_hidden_layer_counts_match_rank():
    """Units kept = unstable + rank of the linear rows; dead ReLUs are all dropped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 10), nn.ReLU(), nn.Linear(10, 2))
    with torch.no_grad():
        model[0].bias.copy_(torch.tensor([-9.0, -9, -9, 9, 9, 9, 9, 9, 0, 0]))
        model[0].weight[8:] = torch.tensor([[1.0, -1.0, 0.0], [0.0, 1.0, -1.0]])  # unstable
    box = linearize.Box(torch.zeros(3), torch.ones(3))
    stab = linearize.stable_units(model, box).sites["1"]
    assert stab.inactive[:3].all() and stab.active[3:8].all()
    small = linearize.compress(model, box)
    W = model[0].weight.detach()
    expected = int(stab.unstable.sum()) + int(torch.linalg.matrix_rank(W[stab.active]))
    assert small[0].out_features == expected == 2 + 3
    assert small.compression_report.removed_inactive == 3
    assert small.compression_report.removed_linear == 2


def test_compress_folds_a_fully_active_layer_and_a_dead_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 1))
    with torch.no_grad():
        model[0].bias.fill_(20.0)  # every unit of layer 1 stably active
        centre = model[0](torch.full((1, 2), 0.5))
        model[2].bias.copy_(-(centre @ model[2].weight.T)[0])  # layer 2 crosses 0 at the centre
    box = linearize.Box(torch.zeros(2), torch.ones(2))
    small = linearize.compress(model, box)
    assert small.compression_report.folded_sites == ["1"]
    assert len([m for m in small if isinstance(m, nn.Linear)]) == 2
    x = box_samples(box)
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        model[2].bias.fill_(-1000.0)  # layer 2 dead: the network is constant on the box
    small = linearize.compress(model, box)
    assert small.compression_report.units_after == 0
    torch.testing.assert_close(small(x), model(x).expand(len(x), 1), atol=1e-5, rtol=1e-5)


def test_compress_milp_removes_at_least_as_much_as_crown():
    model = random_mlp(2, widths=(2, 8, 8, 1))
    box = linearize.Box(torch.zeros(2), torch.ones(2))
    crown = linearize.compress(model, box, method="crown").compression_report
    milp = linearize.compress(model, box, method="milp").compression_report
    assert milp.units_after <= crown.units_after


def test_compress_on_data_raises_when_not_lossless_elsewhere():
    model = random_mlp(3, widths=(2, 16, 2))
    narrow = torch.rand(200, 2) * 0.1
    small = linearize.compress(model, narrow)  # stable on that data: lossless there
    torch.testing.assert_close(small(narrow), model(narrow), atol=1e-5, rtol=1e-5)
    assert small.compression_report.removed > 0
    with pytest.raises(RuntimeError, match="not lossless"):
        linearize.compress(model, narrow, data=torch.randn(200, 2) * 5)


def conv_net(head: bool):
    torch.manual_seed(4)
    layers = [nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), LinearizableActivation("relu", 4, 1),
              nn.Conv2d(4, 3, 3), nn.ReLU()]
    layers += [nn.Flatten(), nn.Linear(27, 6), nn.ReLU(), nn.Linear(6, 2)] if head else [nn.Conv2d(3, 2, 1)]
    model = nn.Sequential(*layers).eval()
    with torch.no_grad():
        model[1].bias.copy_(torch.tensor([0.0, -50.0, 0.0, -50.0]))  # channels 1 and 3 dead
        model[3].bias[0] = -50.0  # channel 0 of the second conv dead
    return model


@pytest.mark.parametrize("head", [True, False])
def test_compress_drops_dead_conv_channels(head):
    model = conv_net(head)
    box = linearize.Box(torch.zeros(1, 5, 5), torch.ones(1, 5, 5))
    small = linearize.compress(model, box)
    rep = small.compression_report
    convs = [m for m in small if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs[:2]] == [2, 2] and convs[1].in_channels == 2
    assert small[1].num_features == 2
    assert rep.sites["2"]["removed_inactive"] == 2 and rep.sites["4"]["removed_inactive"] == 1
    if head:
        assert small[6].in_features == 18  # 2 channels x 3 x 3 columns left
    x = box_samples(box)
    torch.testing.assert_close(small(x), model(x), atol=1e-5, rtol=1e-5)
