"""Border-exact Conv o Conv merges (``BorderExactConv``) and residual blocks under objective="depth".

Every reference is the unfolded computation itself (two convs, or the original block / model),
in float64, so a 1e-10 match means the algebra is exact, the border included.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import linearize
from linearize.folding import BorderExactConv, FoldVerificationError, count_flops
from linearize.folding.conv import border_flops, ConvDesc
from zoo import randomize_batchnorm  # tests/ is on sys.path under pytest

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}

# name: (first conv kwargs, second conv kwargs); channels 4 -> 8 -> 6
CASES = {
    "3x3 pad o 3x3 pad (BasicBlock)": (dict(kernel_size=3, padding=1), dict(kernel_size=3, padding=1)),
    "3x3 stride 2 o 3x3 pad (downsampling block)": (dict(kernel_size=3, stride=2, padding=1),
                                                    dict(kernel_size=3, padding=1)),
    "3x3 pad o 3x3 stride 2": (dict(kernel_size=3, padding=1), dict(kernel_size=3, stride=2, padding=1)),
    "5x5 pad 2 o 3x3 pad 2 dilation 2": (dict(kernel_size=5, padding=2), dict(kernel_size=3, padding=2, dilation=2)),
    "dilated 3x3 o 5x5 pad 1 (narrow padding)": (dict(kernel_size=3, padding=2, dilation=2),
                                                 dict(kernel_size=5, padding=1)),
    "even 2x2 stride 2 o even 4x4 pad 3 stride 2": (dict(kernel_size=2, stride=2, padding=1),
                                                    dict(kernel_size=4, stride=2, padding=3)),
    "valid 3x3 o 3x3 pad": (dict(kernel_size=3), dict(kernel_size=3, padding=1)),
    "grouped o grouped": (dict(kernel_size=3, padding=1, groups=2), dict(kernel_size=3, padding=1, groups=2)),
    "grouped o dense": (dict(kernel_size=3, padding=1, groups=4), dict(kernel_size=3, padding=1)),
    "rectangular kernel": (dict(kernel_size=(3, 1), padding=(1, 0)), dict(kernel_size=(1, 3), padding=(2, 1))),
}
SIZES = [(5, 5), (7, 6), (8, 8), (4, 11)]


def _pair(case: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    k1, k2 = CASES[case]
    c1, c2 = nn.Conv2d(4, 8, **k1).double(), nn.Conv2d(8, 6, **k2).double()
    with torch.no_grad():
        c1.bias.uniform_(0.5, 1.5)  # a large bias through the padding ring: a wrong border shows
    return c1, c2


@pytest.mark.parametrize("case", sorted(CASES))
def test_border_exact_conv_equals_the_two_convs_everywhere(case):
    c1, c2 = _pair(case)
    merged = BorderExactConv.merge(c1, c2)
    assert merged.conv.kernel_size == tuple(
        (a - 1) * c1.stride[i] * c2.dilation[i] + c1.dilation[i] * (b - 1) + 1
        for i, (a, b) in enumerate(zip(c2.kernel_size, c1.kernel_size))
    )
    assert merged.conv.stride == tuple(a * b for a, b in zip(c1.stride, c2.stride))
    # one module, input sizes changing between calls (odd, even, rectangular, batch 1 and 3)
    for batch in (1, 3):
        for size in SIZES:
            x = torch.randn(batch, 4, *size, dtype=torch.float64)
            ref = c2(c1(x))
            out = merged(x)
            assert out.shape == ref.shape
            assert (out - ref).abs().max() <= 1e-10 * ref.abs().max()


@pytest.mark.parametrize("dim", [1, 3])
def test_border_exact_conv_other_dims(dim):
    torch.manual_seed(0)
    c1 = CONV[dim](3, 5, 3, stride=2, padding=1).double()
    c2 = CONV[dim](5, 2, 3, padding=1).double()
    merged = BorderExactConv.merge(c1, c2)
    for size in ((9,), (12,)) if dim == 1 else ((5, 6, 7), (4, 4, 4)):
        x = torch.randn(2, 3, *size, dtype=torch.float64)
        ref = c2(c1(x))
        assert (merged(x) - ref).abs().max() <= 1e-10 * ref.abs().max()


def test_plain_merged_conv_without_correction_is_wrong_at_the_border_only():
    """The counterexample: the 5x5 pad-2 merge alone is exact inside, not on the border band."""
    c1, c2 = _pair("3x3 pad o 3x3 pad (BasicBlock)")
    merged = BorderExactConv.merge(c1, c2)
    x = torch.randn(2, 4, 8, 7, dtype=torch.float64)
    with torch.no_grad():
        diff = (merged.conv(x) - c2(c1(x))).abs()
    assert diff[:, :, 1:-1, 1:-1].max() < 1e-10  # interior: the plain merge is right
    for edge in (diff[:, :, 0], diff[:, :, -1], diff[:, :, :, 0], diff[:, :, :, -1]):
        assert edge.max() > 1e-2  # every side of the one-pixel output band is wrong without the fix
    # the correction reaches exactly that band (one piece of the padding ring per side)
    hits = torch.zeros(8, 7, dtype=torch.bool)
    pieces = merged.correction(x)
    for where, corr in pieces:
        hits[where] = True
        assert corr.shape[2:] == hits[where].shape
    band = torch.ones(8, 7, dtype=torch.bool)
    band[1:-1, 1:-1] = False
    assert len(pieces) == 4 and torch.equal(hits, band)


def test_correction_is_computed_on_strips_and_planned_flops_match():
    c1, c2 = _pair("3x3 stride 2 o 3x3 pad (downsampling block)")
    merged = BorderExactConv.merge(c1, c2)
    x = torch.randn(3, 4, 64, 61, dtype=torch.float64)
    out = merged(x)
    corr = count_flops(merged, x) - 2 * out.numel() * 4 * 7 * 7
    assert corr == border_flops((64, 61), 3, ConvDesc.of(c1), ConvDesc.of(c2))
    assert 0 < corr < 0.2 * count_flops(nn.Sequential(c1, c2), x)  # thin strips, not a second full pass


def test_border_exact_conv_float32_and_gradients():
    c1, c2 = _pair("3x3 stride 2 o 3x3 pad (downsampling block)")
    merged = BorderExactConv.merge(c1, c2)
    x = torch.randn(2, 4, 9, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(c2(c1(x)))
    (gx_ref,) = torch.autograd.grad((c2(c1(x)) * g).sum(), x)
    (gx,) = torch.autograd.grad((merged(x) * g).sum(), x)
    assert (gx - gx_ref).abs().max() < 1e-10
    m32, x32 = copy.deepcopy(merged).float(), x.detach().float()
    ref = c2(c1(x.detach()))
    assert (m32(x32).double() - ref).abs().max() < 1e-5 * ref.abs().max()


def test_merge_refuses_mismatched_convs():
    with pytest.raises(ValueError, match="channel mismatch"):
        BorderExactConv.merge(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(5, 2, 3, padding=1))
    with pytest.raises(ValueError, match="plain zero-padded"):
        BorderExactConv.merge(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.Conv2d(4, 2, 3, padding=1))


# ----------------------------------------------------------------------------- fold


def _linear_unit(channels: int) -> linearize.LinearizableActivation:
    unit = linearize.LinearizableActivation("relu", channels, 1)
    with torch.no_grad():
        unit.slope.fill_(1.0)
    return unit


def _max_rel_diff(model: nn.Module, folded: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        ref, out = model(x), folded(x)
    assert ref.shape == out.shape
    return ((ref - out).abs().max() / ref.abs().max()).item()


def _inner_sites_linear(model: nn.Module) -> None:
    """Slope 1 on the first call of every block's ``relu`` (inside the body, before the add)."""
    with torch.no_grad():
        for name, unit in linearize.units(model):
            if name.endswith("relu.calls.0"):
                unit.slope.fill_(1.0)


def _sequential_convs(model: nn.Module) -> int:
    """Convs on the main path: a BorderExactConv counts once (its strips run beside it)."""
    inside = {id(m.conv) for m in model.modules() if isinstance(m, BorderExactConv)}
    return sum(isinstance(m, BorderExactConv) or (isinstance(m, nn.Conv2d) and id(m) not in inside)
               for m in model.modules())


def test_fold_verification_catches_a_merge_without_the_correction(monkeypatch):
    c1, c2 = _pair("3x3 pad o 3x3 pad (BasicBlock)")
    model = nn.Sequential(c1, _linear_unit(8), c2).eval().double()
    x = torch.randn(2, 4, 7, 6, dtype=torch.float64)
    assert isinstance(linearize.fold(model, x, objective="depth", latency=False)[0], BorderExactConv)
    monkeypatch.setattr(BorderExactConv, "correction", lambda self, x: [])
    with pytest.raises(FoldVerificationError, match="differs by"):
        linearize.fold(model, x, objective="depth", latency=False)


def test_fold_sequential_chain_depth_vs_flops():
    model = nn.Sequential(nn.Conv2d(4, 8, 3, stride=2, padding=1), _linear_unit(8), nn.Conv2d(8, 6, 3, padding=1),
                          _linear_unit(6), nn.Conv2d(6, 6, 3, padding=1)).eval().double()
    x = torch.randn(3, 4, 11, 10, dtype=torch.float64)
    by_flops = linearize.fold(model, x, latency=False)
    assert len(by_flops) == 3
    assert sum("not exact at the border" in s for s in by_flops.linearize_fold_summary.skipped) == 2
    by_depth = linearize.fold(model, x, objective="depth", latency=False)
    # three padded convs: one border-corrected pair (two convs at most) plus one conv
    assert [type(m) for m in by_depth] in ([BorderExactConv, nn.Conv2d], [nn.Conv2d, BorderExactConv])
    summary = by_depth.linearize_fold_summary
    assert any("exact border correction" in s for s in summary.merged)
    assert any("not merged" in s for s in summary.skipped)
    for size in [(11, 10), (5, 5), (8, 8)]:
        assert _max_rel_diff(model, by_depth, torch.randn(1, 4, *size, dtype=torch.float64)) < 1e-10


@pytest.mark.parametrize("downsample", [False, True])
def test_basic_block_becomes_one_border_exact_conv_with_the_skip_in_its_centre_tap(downsample):
    from torchvision.models.resnet import BasicBlock

    torch.manual_seed(0)
    down = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2, bias=False), nn.BatchNorm2d(16)) if downsample else None
    block = BasicBlock(8, 16 if downsample else 8, stride=2 if downsample else 1, downsample=down)
    block = randomize_batchnorm(block).eval().double()
    x = torch.randn(3, 8, 8, 7, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize.convert(block, example_inputs=x)
    _inner_sites_linear(block)  # the activation after the add stays a ReLU

    by_flops = linearize.fold(block, x, latency=False)
    assert _sequential_convs(by_flops) == (3 if downsample else 2)
    assert any("not exact at the border" in s for s in by_flops.linearize_fold_summary.skipped)

    folded = linearize.fold(block, x, objective="depth", latency=False)
    body, act = folded
    assert isinstance(body, BorderExactConv) and isinstance(act, nn.ReLU)
    assert body.conv.kernel_size == ((7, 7) if downsample else (5, 5))
    merged = folded.linearize_fold_summary.merged
    assert any("exact border correction" in s for s in merged)
    assert any("skip folded into the centre tap" in s for s in merged)
    for batch, size in [(1, (5, 5)), (3, (7, 6)), (1, (8, 8)), (2, (12, 9))]:
        assert _max_rel_diff(block, folded, torch.randn(batch, 8, *size, dtype=torch.float64)) < 1e-10


def test_resnet18_depth_objective_cuts_sequential_convs_exactly():
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = randomize_batchnorm(resnet18(weights=None, num_classes=10)).eval().double()
    x = torch.randn(3, 3, 64, 64, dtype=torch.float64)  # stage maps 16, 8, 4, 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize.convert(model, example_inputs=x)
    _inner_sites_linear(model)
    folded = linearize.fold(model, x, objective="depth", latency=False)
    summary = folded.linearize_fold_summary
    # layer1..layer3: one conv per block (downsample skips in the centre tap); layer4 works on
    # 4x4 -> 2x2 maps, nearly all border: its correction would cost more than its two convs
    assert sum(isinstance(m, BorderExactConv) for m in folded.modules()) == 6
    assert sum("skip folded into the centre tap" in s for s in summary.merged) == 6
    assert sum("nearly all border" in s for s in summary.skipped) == 2
    assert _sequential_convs(model) == 20
    assert _sequential_convs(folded) == 1 + 6 + 2 * 2 + 1
    assert summary.max_abs_error <= 1e-10 * summary.output_scale
    for batch, size in [(1, (32, 32)), (3, (19, 24)), (1, (96, 80))]:  # sizes differ from example_inputs
        assert _max_rel_diff(model, folded, torch.randn(batch, 3, *size, dtype=torch.float64)) < 1e-10
