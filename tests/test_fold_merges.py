"""Folds that pay (for the speed study, ``recipes/reproduce/speed.py``): per-block merges of inverted
residuals (torchvision MobileNet-V2/V3, timm), Bottleneck pieces and conv-BN-(linear)-conv chains, decided
by FLOPs and optionally by a batch-1 latency probe, recorded per merge. Truth: the unfolded model in
float64, FLOPs counted by hand from the layer shapes."""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
from torch import nn

import linearize
import linearize.folding.rules as fold_rules_module
from linearize.folding import BorderBiasConv, count_flops
from linearize.unit import LinearizableActivation as LA
from test_fold import _same  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def _calibrated(model: nn.Module, shape: tuple[int, ...]) -> nn.Module:
    """Random BN affine parameters and running statistics from random inputs (a well-scaled network
    whose output varies with its input, so a wrong merge shows at the output)."""
    g = torch.Generator().manual_seed(1)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
        m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.2)
        m.momentum = None  # cumulative average
    model.train()
    with torch.no_grad():
        model(torch.randn(8, *shape[1:], generator=g))
    return model.eval()


def _convert(model: nn.Module, x: torch.Tensor, linear: list[str]) -> nn.Module:
    """Convert, then set the units whose names start with one of ``linear`` to slope 1 (others 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize.convert(model, example_inputs=x)
    with torch.no_grad():
        for name, u in linearize.units(model):
            u.slope.fill_(1.0 if any(name == p or name.startswith(p + ".") for p in linear) else 0.0)
    return model


def _fold_without_merges(model: nn.Module, x: torch.Tensor) -> int:
    """FLOPs of the model folded with every site nonlinear (BatchNorm folding only)."""
    import copy

    plain = copy.deepcopy(model)
    with torch.no_grad():
        for _, u in linearize.units(plain):
            u.slope.fill_(0.0)
    return linearize.fold(plain, x, latency=False).linearize_fold_summary.flops_after


def _ir_flops(n: int, hw_in: int, hw_out: int, cin: int, cexp: int, cout: int, k: int = 3) -> tuple[int, int]:
    """FLOPs of expand 1x1 -> depthwise kxk -> project 1x1 and of the one merged dense kxk conv."""
    before = 2 * n * (hw_in * cin * cexp + hw_out * k * k * cexp + hw_out * cexp * cout)
    return before, 2 * n * hw_out * k * k * cin * cout


# ----------------------------------------------------------------------------- inverted residuals


def _spatial(model: nn.Module, x: torch.Tensor, layers: list[nn.Module]) -> dict[int, tuple[int, int]]:
    """``id(layer) -> (input pixels, output pixels)`` of each layer in one forward of ``model``."""
    seen: dict[int, tuple[int, int]] = {}
    hooks = [m.register_forward_hook(lambda m, a, y: seen.__setitem__(id(m), (a[0][0, 0].numel(), y[0, 0].numel())))
             for m in layers]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def test_mobilenet_v2_chosen_blocks_merge_exactly_and_records_match_hand_flops():
    from torchvision.models import mobilenet_v2
    from torchvision.models.mobilenetv2 import InvertedResidual

    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    model = _calibrated(mobilenet_v2(width_mult=0.25, num_classes=10), x.shape)
    chosen = ["features.3", "features.4", "features.6", "features.8"]  # features.4 has stride 2, no skip
    model = _convert(model, x, chosen)
    blocks = dict(model.named_modules())
    pieces = {n: (blocks[n].conv[0][0], blocks[n].conv[1][0], blocks[n].conv[2]) for n in chosen}
    pixels = _spatial(model, x, [c for p in pieces.values() for c in p])
    folded = linearize.fold(model, x, latency=False)
    summary = folded.linearize_fold_summary
    _same(model, folded, x, atol=1e-4)  # float32 rounding of merged weights through 17 blocks: ~1e-5

    records = {r.site.split(".conv")[0]: r for r in summary.merges}
    assert sorted(records, key=lambda s: int(s.split(".")[1])) == chosen
    for name in chosen:
        expand, dw, project = pieces[name]
        before, after = _ir_flops(2, pixels[id(expand)][0], pixels[id(dw)][1], expand.in_channels,
                                  expand.out_channels, project.out_channels)
        record = records[name]
        assert (record.flops_before, record.flops_after) == (before, after) and after < before
        assert record.rule == "sequential" and record.kept and record.latency_ms_before is None
        assert "3x3 conv (groups=1) with exact border bias" in record.result
    # every chosen block became one conv (no InvertedResidual left there), the skips in its centre tap
    left = {n for n, m in folded.named_modules() if isinstance(m, InvertedResidual)}
    assert not left & set(chosen) and len(left) == 17 - len(chosen)
    skips = sorted(m.split(":")[0] for m in summary.merged if "skip folded into the centre tap" in m)
    assert skips == ["features.3", "features.6", "features.8"]
    assert isinstance(folded.features[4], BorderBiasConv)
    assert summary.flops_after == _fold_without_merges(model, x) - sum(r.flops_before - r.flops_after for r in summary.merges)
    assert "merge: features.3.conv.2 o features.3.conv.1.0 o features.3.conv.0.0 [sequential]" in str(summary)


def test_inverted_residual_is_not_merged_where_it_costs_more():
    """Expansion 2: 1x1 (16->32) + dw 3x3 + 1x1 (32->16) is 2*(512+288+512) per pixel, the merged
    3x3 (16->16) 2*2304: refused; so are expand + depthwise alone (a wide dense 3x3: 2*(512+288) ->
    2*4608) and depthwise + project."""
    from torchvision.models.mobilenetv2 import InvertedResidual

    x = torch.randn(2, 16, 8, 8)
    model = nn.Sequential(InvertedResidual(16, 16, 1, expand_ratio=2), nn.Flatten(), nn.Linear(16 * 64, 4))
    model = _convert(_calibrated(model, x.shape), x, ["0"])
    folded = linearize.fold(model, x, latency=False)
    summary = folded.linearize_fold_summary
    assert summary.merges == [] and isinstance(folded[0], InvertedResidual)
    assert "0.conv.0.0 + 0.conv.1.0: not merged (merging would not lower the flops (FLOPs 204,800 -> 1,179,648))" \
        in summary.skipped
    assert summary.flops_after == _fold_without_merges(model, x) == 2 * 2 * 64 * (512 + 288 + 512) + 2 * 2 * 1024 * 4
    _same(model, folded, x)


def test_mobilenet_v3_block_without_se_merges_and_folds_its_skip():
    from torchvision.models.mobilenetv3 import InvertedResidual, InvertedResidualConfig

    cnf = InvertedResidualConfig(16, 3, 64, 16, use_se=False, activation="HS", stride=1, dilation=1, width_mult=1.0)
    x = torch.randn(2, 16, 8, 8)
    model = nn.Sequential(InvertedResidual(cnf, partial(nn.BatchNorm2d, eps=0.001)), nn.Flatten(), nn.Linear(1024, 4))
    model = _convert(_calibrated(model, x.shape), x, ["0"])
    folded = linearize.fold(model, x, latency=False)
    (record,) = folded.linearize_fold_summary.merges
    assert (record.flops_before, record.flops_after) == _ir_flops(2, 64, 64, 16, 64, 16)
    assert isinstance(folded[0], BorderBiasConv)  # block -> one conv, skip in the centre tap
    assert any(m.startswith("0: inverted residual became one conv, skip folded") for m in folded.linearize_fold_summary.merged)
    _same(model, folded, x)


def test_timm_inverted_residual_merges_through_its_rule_and_depthwise_separable_is_refused():
    blocks = pytest.importorskip("timm.models._efficientnet_blocks")
    x = torch.randn(2, 16, 8, 8)
    model = nn.Sequential(blocks.InvertedResidual(16, 16, exp_ratio=6.0), blocks.DepthwiseSeparableConv(16, 24),
                          nn.Flatten(), nn.Linear(24 * 64, 4))
    model = _convert(_calibrated(model, x.shape), x, ["0", "1"])
    folded = linearize.fold(model, x, latency=False)
    summary = folded.linearize_fold_summary
    (record,) = summary.merges
    assert record.rule == "timm-inverted-residual" and record.site == "0.conv_pwl o 0.conv_dw o 0.conv_pw"
    assert (record.flops_before, record.flops_after) == _ir_flops(2, 64, 64, 16, 96, 16)
    assert isinstance(folded[0], BorderBiasConv)
    # dw 3x3 (16) + 1x1 (16->24) as one dense 3x3 (16->24) would cost 2*3456 instead of 2*(144+384) per pixel
    assert any(s.startswith("1.conv_dw + 1.conv_pw: not merged") for s in summary.skipped)
    assert type(folded[1]).__name__ == "Sequential"  # BN folded, plain activation left
    _same(model, folded, x)


# ----------------------------------------------------------------------------- bottleneck and chains


def _bottleneck_net() -> nn.Sequential:
    from torchvision.models.resnet import Bottleneck

    down = nn.Sequential(nn.Conv2d(8, 32, 1, stride=2, bias=False), nn.BatchNorm2d(32))
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         Bottleneck(8, 8, stride=2, downsample=down), Bottleneck(32, 8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))


def test_bottleneck_pieces_merge_only_where_cheaper():
    """Block 3 (stride 2, width 8 = input 8): conv1 1x1 (16x16) + conv2 3x3 s2 -> one 3x3 s2 saves the
    1x1; block 4 (32 -> 8 -> 32): every piece and the whole body cost more, nothing merges."""
    from torchvision.models.resnet import Bottleneck

    x = torch.randn(2, 3, 16, 16)
    model = _convert(_calibrated(_bottleneck_net(), x.shape), x, ["3.relu.calls.0", "4.relu.calls.0", "4.relu.calls.1"])
    folded = linearize.fold(model, x, latency=False)
    summary = folded.linearize_fold_summary
    (record,) = summary.merges
    assert record.rule == "torchvision-resnet-block" and record.site == "3.conv2 o 3.conv1"
    assert (record.flops_before, record.flops_after) == (2 * 2 * (256 * 64 + 64 * 9 * 64), 2 * 2 * 64 * 9 * 64)
    first, second = [m for m in folded.modules() if isinstance(m, Bottleneck)]
    assert isinstance(first.conv1, BorderBiasConv) and isinstance(first.conv2, nn.Identity)
    assert first.conv1.conv.stride == (2, 2) and isinstance(second.conv2, nn.Conv2d)
    assert any(s.startswith("4.conv1 + 4.conv2: not merged") for s in summary.skipped)
    assert any(s.startswith("4.conv2 + 4.conv3: not merged") for s in summary.skipped)
    assert summary.flops_after == _fold_without_merges(model, x) - (record.flops_before - record.flops_after)
    _same(model, folded, x)


def test_bottleneck_with_all_sites_linear_under_depth_is_one_conv_with_the_projection_skip():
    x = torch.randn(2, 3, 16, 16)
    model = _convert(_calibrated(_bottleneck_net(), x.shape), x, ["3.relu.calls.0", "3.relu.calls.1"])
    folded = linearize.fold(model, x, latency=False, objective="depth")
    records = folded.linearize_fold_summary.merges
    assert [r.site for r in records][:1] == ["3"] and records[0].result.startswith("linear body conv1..conv3")
    (merged,) = [m for m in folded.modules() if isinstance(m, BorderBiasConv)]
    assert merged.conv.stride == (2, 2) and merged.conv.kernel_size == (3, 3)
    _same(model, folded, x)


def test_sequential_conv_bn_linear_act_conv_chain_merges_and_a_wide_expansion_does_not():
    unit, wide = LA("relu", 16, 1), LA("relu", 64, 1)
    with torch.no_grad():
        unit.slope.fill_(1.0)
        wide.slope.fill_(1.0)
    model = nn.Sequential(
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), unit, nn.Conv2d(16, 4, 1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 64, 1), nn.BatchNorm2d(64), wide, nn.Conv2d(64, 64, 3, padding=1, groups=64),  # 1x1 -> dw
        nn.BatchNorm2d(64), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 36, 4),
    )
    x = torch.randn(2, 8, 6, 6)
    model = _calibrated(model, x.shape)
    folded = linearize.fold(model, x, latency=False)
    summary = folded.linearize_fold_summary
    (record,) = summary.merges
    assert record.rule == "sequential" and record.site == "3 o 0"
    assert (record.flops_before, record.flops_after) == (2 * 2 * 36 * (9 * 8 * 16 + 16 * 4), 2 * 2 * 36 * 9 * 8 * 4)
    assert type(folded[0]) is nn.Conv2d and folded[0].kernel_size == (3, 3)  # 1x1 after: exact, no border fix
    # 1x1 (4 -> 64) + dw 3x3 as one dense 3x3 (4 -> 64): 2304 instead of 256 + 576 multiply-adds per pixel
    assert any(s.startswith("6 + 9: not merged (merging would not lower the flops") for s in summary.skipped)
    assert summary.flops_after == count_flops(folded, x) == count_flops(model, x) - record.flops_before \
        + record.flops_after - 2 * 2 * 36 * (16 + 4 + 64 + 64)  # and the BatchNorms
    _same(model, folded, x)


# ----------------------------------------------------------------------------- latency probe


def _chain() -> tuple[nn.Module, torch.Tensor]:
    unit = LA("relu", 16, 1)
    with torch.no_grad():
        unit.slope.fill_(1.0)
    model = nn.Sequential(nn.Conv2d(4, 16, 1), nn.BatchNorm2d(16), unit, nn.Conv2d(16, 16, 3, padding=1, groups=16),
                          nn.BatchNorm2d(16), nn.Conv2d(16, 4, 1), nn.Flatten(), nn.Linear(4 * 64, 3))
    x = torch.randn(2, 4, 8, 8)
    return _calibrated(model, x.shape), x


@pytest.mark.parametrize("slower", [True, False])
def test_latency_probe_refuses_a_merge_that_measures_slower(monkeypatch, slower):
    model, x = _chain()
    timed = []

    def fake(models, inputs, budget_s, threads):
        timed.append((len(models), tuple(inputs.shape), threads))
        return [1.0, 2.0] if slower else [2.0, 1.0]

    monkeypatch.setattr(fold_rules_module, "median_latency_ms", fake)
    folded = linearize.fold(model, x, latency=False, merge_latency=True)
    summary = folded.linearize_fold_summary
    assert timed == [(2, (1, 4, 8, 8), 1)]  # pieces vs merged, batch 1, one thread
    (record,) = summary.merges
    assert (record.latency_ms_before, record.latency_ms_after, record.kept) == ((1.0, 2.0, False) if slower else (2.0, 1.0, True))
    convs = [m for m in folded.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == (3 if slower else 1)
    if slower:
        assert any("but slower" in s for s in summary.skipped) and "(slower: not merged)" in str(summary)
        assert summary.flops_after == record.flops_before + 2 * 2 * 4 * 64 * 3  # the pieces and the head
    _same(model, folded, x)


def test_latency_probe_measures_real_times():
    model, x = _chain()
    folded = linearize.fold(model, x, latency=False, merge_latency=True)
    (record,) = folded.linearize_fold_summary.merges
    assert record.latency_ms_before > 0 and record.latency_ms_after > 0
    assert record.kept == (record.latency_ms_after < record.latency_ms_before)
    _same(model, folded, x)
