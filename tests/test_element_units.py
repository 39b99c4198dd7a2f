"""Element-level units (``convert(..., granularity="element")``): one slope per position of a fixed-shape map.

Every check compares with an independent truth: a float64 element-wise formula ``(1 - a) * act(x) + a * x``
written here, the unconverted model (bit for bit), or counts made by brute force (hooks on the original
ReLUs; a unit probed with ``-1`` at every position is nonlinear exactly where its output is not ``-1``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import linearize
from linearize import schedules
from linearize.unit import ElementActivation, ElementBlend, ElementPReLU
from test_unit_exactness import DTYPES, UPSTREAM, outputs_and_input_grads
from test_unit_exactness import path  # noqa: F401  (the fixture: compiled kernels, counted, or PyTorch ops)

torchvision = pytest.importorskip("torchvision")

RESNET18_RELUS_32 = 47_104  # 64x16x16 stem + 2 relus per block: 4x64x8x8 + 4x128x4x4 + 4x256x2x2 + 4x512x1x1


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 6, 1), nn.GELU(),
        nn.Conv2d(6, 4, 1), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 8 * 8, 5), nn.ReLU(), nn.Linear(5, 3),
    ).eval()


def resnet18() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).eval()


def relus_per_image(model: nn.Module, x: torch.Tensor) -> int:
    """Brute force on the unconverted model: the elements every ReLU call sees, per image."""
    seen = []
    handles = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0][0].numel()))
               for m in model.modules() if isinstance(m, nn.ReLU)]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return sum(seen)


def nonlinear_positions(unit: ElementActivation) -> int:
    """Brute force: positions where the ReLU unit, fed -1 everywhere, does not return -1 (its slope is below 1)."""
    with torch.no_grad():
        out = unit(torch.full((1, *unit.map_shape), -1.0))
    return int((out != -1).sum())


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32))


ACTS = [("relu", nn.ReLU()), ("leaky_relu", nn.LeakyReLU(0.1)), ("gelu", nn.GELU()), ("tanh", nn.Tanh())]


@pytest.mark.parametrize("name,act", ACTS, ids=[n for n, _ in ACTS])
def test_element_unit_is_the_float64_elementwise_blend_with_its_gradients(name, act, path):
    torch.manual_seed(1)
    shape = (3, 4, 5)
    unit = ElementActivation(copy.deepcopy(act), shape)
    a = torch.rand(shape, dtype=torch.float64)
    a[0], a[1, :2] = 0.0, 1.0  # whole channel 0 original, some positions exactly linear
    with torch.no_grad():
        unit.slope.copy_(a.reshape(-1))
    x = torch.randn(2, *shape, requires_grad=True)
    y = unit(x)
    g = torch.randn_like(y)
    y.backward(g)
    # the truth: the element-wise formula in float64, slope map broadcast over the batch
    x64, a64 = x.detach().double().requires_grad_(True), a.clone().requires_grad_(True)
    want = (1 - a64) * act.double()(x64) + a64 * x64
    want.backward(g.double())
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unit.slope.grad.double().view(shape), a64.grad, rtol=1e-5, atol=1e-5)
    # the two ends exactly: a = 0 is act(x), a = 1 is x, bit for bit
    with torch.no_grad():
        ref = act(x)
        assert same_bits(y[:, 0].detach(), ref[:, 0])
        assert same_bits(y[:, 1, :2].detach(), x[:, 1, :2].detach())
    if path:  # the compiled kernels computed it
        assert path["prelu" if unit.is_prelu else "blend"] > 0


def test_element_unit_with_affine_end_is_the_formula():
    shape = (2, 3)
    unit = ElementActivation(nn.ReLU(), shape, init_slope=1.0)
    alpha, beta = torch.linspace(0.5, 1.5, 6), torch.linspace(-1.0, 1.0, 6)
    unit.set_linear_end(alpha, beta)
    with torch.no_grad():
        unit.slope[:2] = 0.0
    x = torch.randn(4, *shape)
    a = unit.slope.detach().double().view(shape)
    want = (1 - a) * x.double().relu() + a * (alpha.double().view(shape) * x.double() + beta.double().view(shape))
    torch.testing.assert_close(unit(x).double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("build,size", [(small_cnn, 8), (resnet18, 32)], ids=["small_cnn", "resnet18"])
def test_converted_model_is_the_original_bit_for_bit_and_exactly_linear_at_slope_1(build, size, path):
    x = torch.randn(3, 3, size, size)
    original = build()
    with torch.no_grad():
        ref = original(x)
    model = linearize.convert(build(), example_inputs=x, granularity="element")
    assert all(isinstance(u, ElementActivation) for _, u in linearize.units(model))
    with torch.no_grad():
        assert same_bits(model(x), ref)
        for _, unit in linearize.units(model):
            unit.slope.fill_(1.0)
    # every unit the identity: the model is the original with the activations removed
    plain = build()
    for name, m in list(plain.named_modules()):
        if isinstance(m, (nn.ReLU, nn.GELU)):
            parent, _, attr = name.rpartition(".")
            setattr(plain.get_submodule(parent) if parent else plain, attr, nn.Identity())
    with torch.no_grad():
        assert same_bits(model(x), plain(x))
    if path:  # the compiled kernels computed it
        assert path["prelu"] > 0


def test_an_input_of_another_map_shape_is_refused_naming_both_shapes_and_the_fix():
    model = linearize.convert(small_cnn(), example_inputs=torch.randn(2, 3, 8, 8), granularity="element")
    with pytest.raises(ValueError, match=r"\[4, 8, 8\] map.*shape \(2, 4, 16, 16\).*granularity='channel'"):
        model(torch.randn(2, 3, 16, 16))
    with pytest.raises(ValueError, match=r"\[3, 2\] map"):
        ElementPReLU(torch.zeros(3, 2))(torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match=r"\[2\] map"):
        ElementBlend(nn.GELU(), torch.zeros(2))(torch.zeros(1, 3))


def test_granularity_is_checked_and_is_an_option_of_prelu_mode_only():
    with pytest.raises(ValueError, match="granularity must be one of"):
        linearize.convert(small_cnn(), example_inputs=torch.randn(1, 3, 8, 8), granularity="pixel")
    with pytest.raises(TypeError, match="granularity"):
        linearize.LinearizeConfig(mode="dgn", granularity="element")
    cfg = linearize.LinearizeConfig(granularity="element")
    assert linearize.LinearizeConfig.from_dict(cfg.to_dict()) == cfg


def test_resnet18_counts_are_relus_per_image_by_brute_force():
    x = torch.randn(2, 3, 32, 32)
    total = relus_per_image(resnet18(), x)
    assert total == RESNET18_RELUS_32
    model = linearize.convert(resnet18(), example_inputs=x, granularity="element")
    assert linearize.count_units(model)["total"] == total
    assert linearize.measures.count_relus(model, x)["total"] == total
    # 10% of the ReLUs nonlinear (4,710: the "18.8K = 10%" kind of number), spread at random over the sites
    named = linearize.units(model)
    sizes = [u.num_channels for _, u in named]
    keep = torch.zeros(total, dtype=torch.bool)
    keep[torch.randperm(total, generator=torch.Generator().manual_seed(0))[: round(0.1 * total)]] = True
    with torch.no_grad():
        for (_, unit), part in zip(named, torch.split(keep, sizes)):
            unit.slope.copy_(torch.where(part, torch.rand(part.shape) * 0.99, torch.ones(part.shape)))
    by_hand = sum(nonlinear_positions(u) for _, u in named)
    assert by_hand == 4_710
    relus = linearize.measures.count_relus(model, x)
    assert relus["nonlinear"] == by_hand and relus["linear"] == total - by_hand
    assert linearize.count_units(model)["nonlinear"] == by_hand
    assert linearize.nonlinear_fraction(model) == by_hand / total
    stem = relus["sites"]["relu"]
    assert (stem["total"], stem["nonlinear"]) == (64 * 16 * 16, nonlinear_positions(model.relu))


def test_sparsifier_fraction_target_is_a_fraction_of_relus():
    torch.manual_seed(0)
    x, y = torch.randn(32, 3, 8, 8), torch.randint(0, 3, (32,))
    model = linearize.convert(small_cnn().train(), example_inputs=x[:2], granularity="element")
    total = relus_per_image(small_cnn(), x[:1]) + 6 * 8 * 8  # the ReLUs, and the GELU's positions
    assert linearize.count_units(model)["total"] == total
    steps = 20
    optimizer = torch.optim.SGD(linearize.param_groups(model), lr=0.05)
    sparsifier = linearize.Sparsifier(model, schedules.target(0.1, start=0.1, end=0.6), total_steps=steps)
    sparsifier.attach(optimizer)
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(), loss.backward(), optimizer.step()
    relu_units = [u for _, u in linearize.units(model) if u.is_prelu]
    gelu_unit = next(u for _, u in linearize.units(model) if not u.is_prelu)
    nonlinear = sum(nonlinear_positions(u) for u in relu_units) + int((gelu_unit.slope < 1).sum())
    assert nonlinear == round(0.1 * total)


def test_freeze_snaps_positions_to_exactly_linear_and_keeps_them_there():
    x = torch.randn(4, 3, 8, 8)
    model = linearize.convert(small_cnn(), example_inputs=x, granularity="element")
    unit = model[2]
    with torch.no_grad():
        unit.slope.fill_(0.5)
        unit.slope[:10] = 1 - 1e-4
    summary = linearize.freeze(model, tol=1e-3)
    assert summary.sites["2"]["snapped_one"] == 10
    assert torch.equal(unit.slope[:10].detach(), torch.ones(10)) and torch.equal(unit.frozen[:10], torch.ones(10))
    assert bool(unit.frozen[10:].isnan().all())
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9, weight_decay=0.1)
    for _ in range(2):
        model(x).square().sum().backward()
        optimizer.step()
    assert torch.equal(unit.slope[:10].detach(), torch.ones(10))
    probe = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        assert same_bits(unit(probe).reshape(2, -1)[:, :10], probe.reshape(2, -1)[:, :10])


def test_freeze_with_data_freezes_the_stably_active_positions():
    x = torch.randn(16, 3, 8, 8)
    net = small_cnn()
    with torch.no_grad():
        net[0].bias[0] = 2.0  # channel 0 positive at most positions on every sample
    model = linearize.convert(net, example_inputs=x, granularity="element")
    seen = []
    handle = model[2].register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(x)
    handle.remove()
    active = (seen[0] > 0).all(0).reshape(-1)  # brute force: positive on every sample
    assert 0 < int(active.sum()) < active.numel()
    summary = linearize.freeze(model, data=x)
    assert summary.sites["2"]["stably_active"] == int(active.sum())
    assert torch.equal(model[2].frozen == 1, active)


def test_save_and_load_roundtrip_and_a_load_at_another_size_names_both_shapes(tmp_path):
    x = torch.randn(2, 3, 32, 32)
    model = linearize.convert(resnet18(), example_inputs=x, granularity="element")
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.copy_(torch.rand(unit.num_channels))
    unit = model.layer1[0].relu.calls[1]
    unit.freeze_(torch.arange(unit.num_channels) < 7, 1.0)
    linearize.save_pretrained(model, tmp_path)
    loaded = linearize.from_pretrained(torchvision.models.resnet18(num_classes=10), tmp_path, example_inputs=x).eval()
    for (name, a), (name_b, b) in zip(linearize.units(model), linearize.units(loaded)):
        assert name == name_b and a.map_shape == b.map_shape
        assert torch.equal(a.slope, b.slope) and torch.equal(a.frozen.nan_to_num(-1), b.frozen.nan_to_num(-1))
    with torch.no_grad():
        assert same_bits(loaded(x), model(x))
    with pytest.raises(ValueError, match=r"saved for a \[64, 16, 16\] map.*a \[64, 32, 32\] map.*example_inputs"):
        linearize.from_pretrained(torchvision.models.resnet18(num_classes=10), tmp_path,
                                  example_inputs=torch.randn(1, 3, 64, 64))


def test_fold_keeps_partly_linear_element_sites_and_merges_a_whole_linear_site():
    x = torch.randn(8, 3, 8, 8)
    model = linearize.convert(small_cnn(), example_inputs=x, granularity="element")
    with torch.no_grad():
        model[2].slope.copy_((torch.arange(256) % 3 == 0).float())  # a third of the positions linear
        model[4].slope.fill_(1.0)  # the whole GELU site linear: the 1x1 convs around it merge
        model[6].slope.copy_(torch.linspace(0, 1, 256))
    folded = linearize.fold(model, x, latency=False)
    summary = folded.linearize_fold_summary
    kinds = [type(m).__name__ for m in folded.modules()]
    assert kinds.count("ElementPReLU") == 2 and "GELU" not in kinds  # sites 2 and 6 kept; site 4 gone
    assert kinds.count("ReLU") == 1  # site 9, every position at slope 0: the original ReLU
    assert any(line.startswith("2: element-level unit kept as ElementPReLU (86 of 256 positions linear)")
               for line in summary.skipped)
    assert "4: fully linear unit removed (identity)" in summary.merged
    assert kinds.count("Conv2d") == 2 and summary.flops_after < summary.flops_before  # 3 convs -> 2
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), rtol=1e-4, atol=1e-5)


def test_folded_element_modules_save_and_load_without_the_base(tmp_path):
    x = torch.randn(8, 3, 8, 8)
    model = linearize.convert(small_cnn(), example_inputs=x, granularity="element")
    with torch.no_grad():
        model[2].slope.copy_((torch.arange(256) % 2 == 0).float())
        model[4].slope.copy_(torch.linspace(0, 1, 384))
    model[4].set_linear_end(torch.linspace(0.5, 2.0, 384), torch.linspace(-1.0, 1.0, 384))
    folded = linearize.fold(model, x, latency=False)
    linearize.save_folded(folded, tmp_path, example_inputs=x)
    loaded = linearize.load_folded(tmp_path)
    assert [type(m).__name__ for m in loaded] == [type(m).__name__ for m in folded]
    with torch.no_grad():
        assert same_bits(loaded(x), folded(x))


def test_fold_resnet18_with_some_positions_and_a_whole_site_linear():
    x = torch.randn(2, 3, 32, 32)
    model = linearize.convert(resnet18(), example_inputs=x, granularity="element")
    torch.manual_seed(0)
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.copy_((torch.rand(unit.num_channels) < 0.5).float())
        model.layer4[1].relu.calls[0].slope.fill_(1.0)
    folded = linearize.fold(model, x, latency=False, dtype=torch.float64)
    kinds = [type(m).__name__ for m in folded.modules()]
    assert kinds.count("ElementPReLU") == 16 and "LinearizableActivation" not in str(kinds)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), rtol=1e-4, atol=1e-4)


def test_bound_propagation_refuses_element_units_naming_the_fix():
    model = linearize.convert(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)),
                              example_inputs=torch.randn(2, 4), granularity="element")
    box = linearize.Box(-torch.ones(1, 4), torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"element-level.*method='data'"):
        linearize.stable_units(model, box, method="ibp")


def test_element_units_on_flat_features_count_one_relu_per_feature():
    model = linearize.convert(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)),
                              example_inputs=torch.randn(2, 4), granularity="element")
    assert model[1].map_shape == (6,) and math.prod(model[1].map_shape) == model[1].num_channels
    assert linearize.measures.count_relus(model, torch.randn(5, 4))["total"] == 6


@pytest.mark.parametrize("granularity", ["channel", "element"])
def test_an_empty_batch_gives_the_originals_empty_output_and_gradients(granularity, path):
    """resnet18 at 32x32 has 4x4 and 2x2 maps (2..16 positions per channel, which the ReLU path views flat): a
    batch of 0 (no proposals, an expert with no tokens) crashed reshaping to ``[0, -1]``. Truth: the
    unconverted model's output and parameter gradients on that batch."""
    original, x = resnet18(), torch.randn(2, 3, 32, 32)
    model = linearize.convert(copy.deepcopy(original), example_inputs=x, granularity=granularity)
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.uniform_(0, 1)
    slopes = {id(unit.slope) for _, unit in linearize.units(model)}
    outs = []
    for net in (original, model):
        empty = x[:0].clone().requires_grad_()
        out = net(empty)
        out.sum().backward()
        outs.append((out, empty.grad, [p.grad for p in net.parameters() if id(p) not in slopes]))
    (ref, ref_gx, ref_gp), (got, got_gx, got_gp) = outs
    assert got.shape == ref.shape == (0, 10) and got.dtype == ref.dtype
    assert got_gx.shape == ref_gx.shape == (0, 3, 32, 32)
    assert len(got_gp) == len(ref_gp) and all(torch.equal(a, b) for a, b in zip(got_gp, ref_gp))
    assert all(torch.equal(u.slope.grad, torch.zeros_like(u.slope)) for _, u in linearize.units(model))


def test_an_empty_batch_in_a_fit_sparsifier_loop_leaves_the_run_as_without_it():
    """The Sparsifier's running fit (``select="fit"``, AdamW's default) records element units' inputs per
    sample: an empty batch crashed it reshaping to ``[0, -1]``. Truth: the same loop without the empty batches
    (an empty batch's loss has no gradient, so AdamW's moments and the fit must not move)."""
    torch.manual_seed(0)
    original = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    x = torch.randn(8, 3, 4, 4)
    slopes = []
    for with_empty in (False, True):
        model = linearize.convert(copy.deepcopy(original), granularity="element", example_inputs=x)
        opt = torch.optim.AdamW(model.parameters(), 1e-2)
        linearize.Sparsifier(model, linearize.schedules.target(0.5), total_steps=4).attach(opt)
        for _ in range(4):
            model(x).square().mean().backward()
            if with_empty:
                model(x[:0]).sum().backward()
            opt.step()
            opt.zero_grad()
        slopes.append(torch.cat([u.slope.detach().flatten() for _, u in linearize.units(model)]))
    assert torch.equal(slopes[0], slopes[1]) and 0 < (slopes[1] == 1).float().mean() < 1


STRIDED = [("GELU", nn.GELU()), ("GELU(tanh)", nn.GELU(approximate="tanh")), ("SiLU", nn.SiLU()), ("Mish", nn.Mish()),
           ("Tanh", nn.Tanh()), ("ELU", nn.ELU()), ("Hardswish", nn.Hardswish()), ("ReLU", nn.ReLU())]


@pytest.mark.parametrize("name,act", STRIDED, ids=[n for n, _ in STRIDED])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_at_slope_0_an_element_unit_on_a_strided_input_is_the_original_bit_for_bit(name, act, dtype, path):
    """An element unit at slope 0 on the ``x.permute(0, 2, 3, 1)`` view of a map (a ConvNeXt / Swin MLP's input), on a
    channels_last map, on a transposed sequence and on a contiguous map, with upstream gradients of every layout:
    the output (its strides too) and the input gradient are the original activation's on the same tensor, bit for
    bit. A strided input copied to a contiguous ``[N, P]`` made torch's CPU GELU round otherwise (348 of 2048
    outputs), and the activation's backward get a gradient in another layout."""
    torch.manual_seed(0)
    base = (torch.randn(2, 16, 8, 8) * 3).to(dtype)
    inputs = {"permuted": base.permute(0, 2, 3, 1), "channels_last": base.contiguous(memory_format=torch.channels_last),
              "transposed": base.flatten(2).transpose(1, 2), "contiguous": base}
    for layout, x in inputs.items():
        unit = ElementActivation(copy.deepcopy(act), tuple(x.shape[1:]))
        for what, loss in UPSTREAM.items():
            (y_want, g_want), (y_got, g_got) = outputs_and_input_grads(act, unit, x, loss)
            assert torch.equal(y_got, y_want), f"{layout} {what}: {int((y_got != y_want).sum())} outputs differ"
            if name != "ReLU":  # a ReLU unit is a PReLU on the [N, P] view: a contiguous output
                assert y_got.stride() == y_want.stride(), f"{layout} {what}"
            assert torch.equal(g_got, g_want), f"{layout} {what}: {int((g_got != g_want).sum())} input gradients differ"
    if path:
        assert path["prelu" if name == "ReLU" else "blend"] > 0
