"""Tests of linearize.fold: every merge kind against the unfolded model, HF FFNs, FLOPs, errors."""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from torch import nn

import linearize
from linearize.folding import (
    BorderBiasConv,
    BorderExactConv,
    ChannelBlend,
    ChannelPReLU,
    FoldRule,
    FoldVerificationError,
    LinearWithPassthrough,
    count_flops,
    fold_rules,
)
from linearize.unit import LinearizableActivation as LA
from zoo import randomize_batchnorm
from test_user_hooks_on_activations import Plain


def _set_linear(model: nn.Module, fraction: float, rest: float = 0.3, seed: int = 0) -> None:
    """Make ``fraction`` of every unit's channels linear (slope 1), the others slope ``rest``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.fill_(rest)
            idx = torch.randperm(u.num_channels, generator=g)[: round(fraction * u.num_channels)]
            u.slope[idx] = 1.0


def _same(model: nn.Module, folded: nn.Module, x, atol: float = 1e-5) -> None:
    """Max abs difference (in float64 copies) below ``atol`` times the output scale.

    Folded float32 weights carry ~1e-7 relative rounding; a wrong merge (border, bias, BN)
    is off by ~1e-1. Models built in float64 are compared at 1e-10 (the algebra itself).
    """
    import copy

    a = copy.deepcopy(model).double().eval()
    b = copy.deepcopy(folded).double().eval()
    xs = x.double() if isinstance(x, torch.Tensor) else x
    with torch.no_grad():
        ya, yb = (a(xs), b(xs)) if isinstance(xs, torch.Tensor) else (a(**xs), b(**xs))
    ya = ya if isinstance(ya, torch.Tensor) else ya[0]
    yb = yb if isinstance(yb, torch.Tensor) else yb[0]
    assert ya.shape == yb.shape
    assert (ya - yb).abs().max().item() <= atol * max(1.0, ya.abs().max().item())


def _no_units(model: nn.Module) -> None:
    assert not any(isinstance(m, LA) for m in model.modules())


# ----------------------------------------------------------------------------- basics


def test_linear_linear_merge_and_bn_fold_match_hand_algebra():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), LA("relu", 7, -1), nn.Linear(7, 3))
    randomize_batchnorm(model).eval()
    with torch.no_grad():
        model[2].slope.fill_(1.0)
    x = torch.randn(16, 5)
    folded = linearize.fold(model, x, latency=False)
    assert len(folded) == 1 and type(folded[0]) is nn.Linear
    bn = model[1]
    s = model[1].weight / torch.sqrt(bn.running_var + bn.eps)
    w1 = model[0].weight * s[:, None]
    b1 = (model[0].bias - bn.running_mean) * s + bn.bias
    w = model[3].weight @ w1
    b = model[3].weight @ b1 + model[3].bias
    torch.testing.assert_close(folded[0].weight, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(folded[0].bias, b, atol=1e-5, rtol=1e-5)
    _same(model, folded, x)
    summary = folded.linearize_fold_summary
    assert any("BatchNorm folded" in m for m in summary.merged)
    assert summary.params_after == 5 * 3 + 3
    assert summary.max_abs_error < 1e-5
    assert model[2].slope.requires_grad and isinstance(model[2], LA)  # input untouched


def test_linear_chain_across_eval_dropout_merges_to_one_layer():
    u1, u2 = LA("relu", 12, -1), LA(nn.GELU(), 12, -1)
    with torch.no_grad():
        u1.slope.fill_(1.0)
        u2.slope.fill_(1.0)
    model = nn.Sequential(nn.Linear(6, 12), u1, nn.Dropout(0.5), nn.Linear(12, 12), u2, nn.Linear(12, 2)).eval()
    model = model.double()
    x = torch.randn(9, 6, dtype=torch.float64)
    folded = linearize.fold(model, x, latency=False)
    assert len(folded) == 1 and folded[0].weight.shape == (2, 6)
    torch.testing.assert_close(folded[0].weight, model[5].weight @ model[3].weight @ model[0].weight)
    _same(model, folded, x, atol=1e-10)
    assert folded.linearize_fold_summary.flops_after == 2 * 9 * 6 * 2


def test_unit_replacements_are_plain_and_exact():
    torch.manual_seed(0)
    zero, mixed_relu, mixed_gelu = LA("relu", 6, 1), LA("relu", 6, 1), LA(nn.GELU(), 6, 1)
    leaky = LA(nn.LeakyReLU(0.1), 6, 1)
    with torch.no_grad():
        mixed_relu.slope.copy_(torch.tensor([0.0, 0.2, 1.0, 0.5, 0.0, 0.7]))
        mixed_gelu.slope.copy_(torch.tensor([0.0, 0.2, 1.0, 0.5, 0.0, 0.7]))
        leaky.slope.copy_(torch.tensor([0.0, 0.2, 1.0, 0.5, 0.0, 0.7]))
    model = nn.Sequential(nn.Conv2d(3, 6, 3), zero, nn.Conv2d(6, 6, 1), mixed_relu,
                          nn.Conv2d(6, 6, 1), mixed_gelu, nn.Conv2d(6, 6, 1), leaky).eval()
    x = torch.randn(2, 3, 7, 7)
    folded = linearize.fold(model, x, latency=False)
    kinds = [type(m) for m in folded]
    assert kinds == [nn.Conv2d, nn.ReLU, nn.Conv2d, ChannelPReLU, nn.Conv2d, ChannelBlend, nn.Conv2d, ChannelPReLU]
    torch.testing.assert_close(folded[7].weight, torch.tensor([0.1, 0.28, 1.0, 0.55, 0.1, 0.73]))
    _no_units(folded)
    _same(model, folded, x)


def test_channel_prelu_channels_last():
    w = torch.tensor([0.0, 0.5, 1.0])
    x = torch.randn(2, 4, 3)
    ref = torch.where(x > 0, x, x * w)
    torch.testing.assert_close(ChannelPReLU(w, channel_dim=-1)(x), ref)
    torch.testing.assert_close(ChannelPReLU(w, channel_dim=2)(x), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", [nn.ReLU(), nn.LeakyReLU(0.1)], ids=["relu", "leaky_relu"])
@pytest.mark.parametrize("granularity", ["channel", "element"])
def test_folded_prelu_gives_the_original_zero_at_minus_inf_where_its_weight_is_0(dtype, act, granularity):
    """A partly linear ReLU-family site folds to a ChannelPReLU / ElementPReLU. A Linear overflowing to -inf fed
    it -inf: at weight 0 (a ReLU channel at slope 0) it gave NaN (F.prelu's 0 * -inf) where the original ReLU and
    the unfolded unit give 0. The folded model must give the unfolded model's values (-inf stays -inf at a
    weight above 0, NaN stays NaN, +inf and finite values unchanged), and the original's in the slope-0 channel;
    a weight set to 0 after the fold applies at the next call."""
    original = nn.Sequential(nn.Linear(3, 3), act)
    with torch.no_grad():
        original[0].weight.copy_(2 * torch.eye(3))
        original[0].bias.zero_()
    model = linearize.convert(copy.deepcopy(original), example_inputs=torch.randn(4, 3), granularity=granularity)
    with torch.no_grad():
        linearize.units(model)[0][1].slope.copy_(torch.tensor([0.0, 0.5, 1.0]))
    folded = linearize.fold(model, torch.randn(4, 3), latency=False)
    prelu = folded[1]
    assert type(prelu).__name__ == ("ChannelPReLU" if granularity == "channel" else "ElementPReLU")
    big = 0.9 * torch.finfo(dtype).max  # doubled by the Linear: -inf / +inf at the activation
    x = torch.tensor([[-big] * 3, [math.nan] * 3, [big] * 3, [-1.0] * 3, [2.0] * 3, [0.0] * 3]).to(dtype)
    original, model, folded = (m.to(dtype) for m in (original, model, folded))
    with torch.no_grad():
        want, got = model(x), folded(x)
        assert want[0].isneginf().tolist() == [isinstance(act, nn.LeakyReLU), True, True] and got[1].isnan().all()
        torch.testing.assert_close(got, want, equal_nan=True)
        torch.testing.assert_close(got[:, 0], original(x)[:, 0], equal_nan=True)
        prelu.weight.view(-1)[1] = 0.0  # the PReLU's own weight, changed after the fold
        torch.testing.assert_close(folded(x)[:, 1], torch.relu(original[0](x))[:, 1], equal_nan=True)


@pytest.mark.parametrize("plain", [lambda w: ChannelPReLU(w), lambda w: ChannelBlend(nn.GELU(), w),
                                   lambda w: ChannelPReLU(w, channel_dim=-1), lambda w: ChannelBlend(nn.GELU(), w, -1)])
@pytest.mark.parametrize("shape", [(), (5,), (2, 4), (2, 4, 6, 2)])
def test_plain_forms_refuse_an_input_without_their_width_at_their_channel_dim(plain, shape):
    """Broadcasting a [3] slope over width 1 or reshaping 4 channels into 3 would mix channels silently; a 0-d
    input has no channel dim (it failed with Python's modulo error)."""
    with pytest.raises(ValueError, match=r"built for 3 channels at dim -?1, got an input of shape"):
        plain(torch.tensor([0.0, 0.5, 1.0]))(torch.randn(shape))


def test_single_slope_prelu_takes_any_shape():
    w, x = torch.tensor([0.25]), torch.randn(2, 4, 3)
    for t in (x, x[0, 0, 0]):
        torch.testing.assert_close(ChannelPReLU(w)(t), torch.where(t > 0, t, 0.25 * t))


def test_ffn_split_in_sequential_matches_formula():
    torch.manual_seed(0)
    d, m = 8, 32
    unit = LA(nn.GELU(), m, -1)
    model = nn.Sequential(nn.Linear(d, m), unit, nn.Linear(m, d)).eval().double()
    lin = torch.zeros(m, dtype=torch.bool)
    lin[torch.randperm(m)[:24]] = True
    with torch.no_grad():
        unit.slope.copy_(torch.where(lin, 1.0, 0.25))
    x = torch.randn(3, 5, d, dtype=torch.float64)
    folded = linearize.fold(model, x, latency=False)
    first, act, second = folded
    assert isinstance(first, LinearWithPassthrough) and first.out_features == 8
    assert isinstance(act, ChannelBlend) and act.slope.numel() == 8 + d
    w1, w2 = model[0].weight, model[2].weight
    torch.testing.assert_close(second.weight[:, 8:], w2[:, lin] @ w1[lin])
    torch.testing.assert_close(second.bias, model[2].bias + w2[:, lin] @ model[0].bias[lin])
    _same(model, folded, x, atol=1e-10)
    s = folded.linearize_fold_summary
    assert s.flops_after == 2 * 15 * (d * 8 + (8 + d) * d) and s.flops_before == 2 * 15 * 2 * d * m


def test_ffn_split_refused_when_it_costs_more():
    d, m = 16, 32
    unit = LA("relu", m, -1)
    with torch.no_grad():
        unit.slope[:4] = 1.0  # 4 linear of 32: d x d path (256) + narrow FFN costs more
    model = nn.Sequential(nn.Linear(d, m), unit, nn.Linear(m, d)).eval()
    folded = linearize.fold(model, torch.randn(4, d), latency=False)
    assert isinstance(folded[1], ChannelPReLU) and folded[0].out_features == m
    assert any("would not lower" in s for s in folded.linearize_fold_summary.skipped)


# ----------------------------------------------------------------------------- convolutions


CONV_CASES = {
    # name: (first conv kwargs, second conv kwargs, input size, expected kernel)
    "3x3 valid o 3x3 valid": (dict(kernel_size=3), dict(kernel_size=3), 11, 5),
    "3x3 pad o 1x1": (dict(kernel_size=3, padding=1), dict(kernel_size=1), 9, 3),
    "1x1 biased o 3x3 pad (border bias)": (dict(kernel_size=1), dict(kernel_size=3, padding=1), 9, 3),
    "1x1 stride 2 o 3x3 pad": (dict(kernel_size=1, stride=2), dict(kernel_size=3, padding=1), 11, 5),
    "3x3 stride 2 pad o 3x3 valid": (dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=3), 13, 7),
    "dilated 3x3 o strided 3x3": (dict(kernel_size=3, dilation=2, padding=2), dict(kernel_size=3, stride=2), 12, 7),
    "grouped o grouped": (dict(kernel_size=3, groups=2, padding=1), dict(kernel_size=1, groups=2), 8, 3),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_conv_merge_exact_including_border(case):
    torch.manual_seed(0)
    k1, k2, size, kernel = CONV_CASES[case]
    c1, c2 = nn.Conv2d(4, 6, **k1), nn.Conv2d(6, 5 if "group" not in case else 6, **k2)
    with torch.no_grad():
        c1.bias.uniform_(0.5, 1.0)  # a large bias: a wrong border would show
    unit = LA("relu", 6, 1)
    with torch.no_grad():
        unit.slope.fill_(1.0)
    model = nn.Sequential(c1, unit, c2).eval().double()
    x = torch.randn(2, 4, size, size + 1, dtype=torch.float64)
    folded = linearize.fold(model, x, objective="depth", latency=False)
    assert len(folded) == 1
    conv = folded[0].conv if isinstance(folded[0], BorderBiasConv) else folded[0]
    assert conv.kernel_size == (kernel, kernel)
    if "group" in case:
        assert conv.groups == 2
    # border pixels included: the whole map, float64 model so only the algebra counts
    _same(model, folded, x, atol=1e-10)
    if "border bias" in case:
        assert isinstance(folded[0], BorderBiasConv)
        with torch.no_grad():  # a plain merged conv with the interior bias is wrong on the border only
            y, y0 = model(x), conv(x) + folded[0].bias_map(tuple(x.shape[2:]), x)[:, :, 4:5, 4:5]
        assert (y - y0)[:, :, 1:-1, 1:-1].abs().max() < 1e-4
        assert (y - y0)[:, :, 0].abs().max() > 1e-2


def test_padded_3x3_o_3x3_needs_depth_objective_and_a_border_correction():
    unit = LA("relu", 6, 1)
    with torch.no_grad():
        unit.slope.fill_(1.0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), unit, nn.Conv2d(6, 4, 3, padding=1)).eval()
    x = torch.randn(1, 3, 8, 8)
    by_flops = linearize.fold(model, x, latency=False)
    assert len(by_flops) == 2
    assert any("not exact at the border" in s for s in by_flops.linearize_fold_summary.skipped)
    _same(model, by_flops, x)
    by_depth = linearize.fold(model, x, objective="depth", latency=False)  # more in test_fold_border.py
    assert len(by_depth) == 1 and isinstance(by_depth[0], BorderExactConv)
    assert any("exact border correction" in s for s in by_depth.linearize_fold_summary.merged)
    _same(model, by_depth, x)


def test_flops_objective_refuses_3x3_o_3x3_depth_objective_merges():
    unit = LA("relu", 8, 1)
    with torch.no_grad():
        unit.slope.fill_(1.0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3), unit, nn.Conv2d(8, 8, 3)).eval()
    x = torch.randn(1, 8, 12, 12)
    by_flops = linearize.fold(model, x, latency=False)
    assert len(by_flops) == 2
    assert any("would not lower the flops" in s for s in by_flops.linearize_fold_summary.skipped)
    by_depth = linearize.fold(model, x, objective="depth", latency=False)
    assert len(by_depth) == 1 and by_depth[0].kernel_size == (5, 5)
    assert by_depth.linearize_fold_summary.flops_after > by_flops.linearize_fold_summary.flops_after
    _same(model, by_depth, x, atol=1e-5)


def test_depthwise_pointwise_chain_merges_to_cheaper_dense_conv():
    unit = LA("relu", 16, 1)
    with torch.no_grad():
        unit.slope.fill_(1.0)
    # 1x1 expand (4->16), depthwise 3x3, 1x1 project (16->4): 9*4*4 per pixel beats 64+144+64
    model = nn.Sequential(nn.Conv2d(4, 16, 1), nn.BatchNorm2d(16), unit, nn.Conv2d(16, 16, 3, padding=1, groups=16),
                          nn.BatchNorm2d(16), nn.Conv2d(16, 4, 1), nn.BatchNorm2d(4))
    randomize_batchnorm(model).eval()
    x = torch.randn(2, 4, 10, 10)
    folded = linearize.fold(model, x, latency=False)
    assert len(folded) == 1 and isinstance(folded[0], BorderBiasConv)
    assert folded.linearize_fold_summary.flop_ratio < 0.5
    _same(model, folded, x)


def test_a_border_bias_conv_folded_under_inference_mode_runs_there():
    """Its bias map was cached on the bias buffer's version, which an inference tensor lacks: torch's error."""
    unit = LA("relu", 16, 1)
    with torch.no_grad():
        unit.slope.fill_(1.0)
    x = torch.randn(2, 4, 10, 10)
    with torch.inference_mode():  # 1x1 expand, depthwise 3x3, 1x1 project: one cheaper dense conv
        model = nn.Sequential(nn.Conv2d(4, 16, 1), unit, nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.Conv2d(16, 4, 1))
        folded = linearize.fold(model.eval(), x, latency=False)
        assert isinstance(folded[0], BorderBiasConv)
        _same(model, folded, x)


# ----------------------------------------------------------------------------- residual blocks


def test_torchvision_bottleneck_and_basicblock_with_convert():
    from torchvision.models.resnet import BasicBlock, Bottleneck

    torch.manual_seed(0)
    down = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2, bias=False), nn.BatchNorm2d(16))
    for block, expect_merge in [(Bottleneck(16, 4), True), (Bottleneck(8, 4, stride=2, downsample=down), True),
                                (BasicBlock(8, 8), False)]:  # BasicBlock: objective="depth" in test_fold_border.py
        block = randomize_batchnorm(block).eval().double()
        x = torch.randn(2, block.conv1.in_channels, 9, 9, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            linearize.convert(block, example_inputs=x)
        _set_linear(block, 1.0)
        folded = linearize.fold(block, x, objective="depth" if expect_merge else "flops", latency=False)
        _no_units(folded)
        convs = [m for m in folded.modules() if isinstance(m, nn.Conv2d)]
        assert (len(convs) == 1) == expect_merge
        _same(block, folded, x, atol=1e-10)
        if not expect_merge:
            assert any("border" in s for s in folded.linearize_fold_summary.skipped)


def test_mobilenet_v2_inverted_residuals_fold_with_skip():
    from torchvision.models import mobilenet_v2
    from torchvision.models.mobilenetv2 import InvertedResidual

    torch.manual_seed(0)
    model = randomize_batchnorm(mobilenet_v2(width_mult=0.25, num_classes=10)).eval()
    x = torch.randn(1, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize.convert(model, example_inputs=x)
    _set_linear(model, 1.0)
    folded = linearize.fold(model, x, latency=False)
    _no_units(folded)
    left = sum(isinstance(m, InvertedResidual) for m in folded.modules())
    assert left < sum(isinstance(m, InvertedResidual) for m in model.modules()) / 2
    assert any("skip folded into the centre tap" in s for s in folded.linearize_fold_summary.merged)
    assert folded.linearize_fold_summary.flop_ratio < 0.9
    _same(model, folded, x)


def test_resnet18_half_linear_with_convert_is_exact():
    from torchvision.models import resnet18

    model = randomize_batchnorm(resnet18(num_classes=10)).eval()
    x = torch.randn(1, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize.convert(model, example_inputs=x)
    _set_linear(model, 0.5)
    folded = linearize.fold(model, x, latency=False)
    _no_units(folded)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    # float32 folded weights: ~1e-7 relative rounding; a wrong fold is off by far more
    assert folded.linearize_fold_summary.max_abs_error < 1e-5 * folded.linearize_fold_summary.output_scale
    _same(model, folded, x)


# ----------------------------------------------------------------------------- Hugging Face FFNs


def _hf_models():
    from transformers import (BertConfig, BertModel, GPT2Config, GPT2Model, MarianConfig, MarianMTModel,
                              T5Config, T5Model)

    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    enc_dec = {"input_ids": ids, "decoder_input_ids": ids}
    return {
        "bert": (lambda: BertModel(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=64)), {"input_ids": ids}),
        "gpt2": (lambda: GPT2Model(GPT2Config(vocab_size=100, n_embd=16, n_layer=1, n_head=2, n_positions=16)),
                 {"input_ids": ids}),
        "t5": (lambda: T5Model(T5Config(vocab_size=100, d_model=16, d_ff=64, d_kv=8, num_layers=1, num_heads=2)),
               enc_dec),
        "marian": (lambda: MarianMTModel(MarianConfig(vocab_size=100, d_model=16, encoder_layers=1, decoder_layers=1,
                                                      encoder_attention_heads=2, decoder_attention_heads=2,
                                                      encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=0,
                                                      decoder_start_token_id=0)), enc_dec),
    }


@pytest.mark.parametrize("name", ["bert", "gpt2", "t5", "marian"])
def test_hf_ffn_folding(name):
    torch.manual_seed(0)
    build, inputs = _hf_models()[name]
    model = build().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize.convert(model, example_inputs=inputs)
    for fraction in (0.75, 1.0):
        _set_linear(model, fraction)
        folded = linearize.fold(model, inputs, dtype=torch.float64, latency=False)
        _no_units(folded)
        s = folded.linearize_fold_summary
        ffn = [m for m in s.merged if "FFN" in m]
        assert ffn, s
        if fraction == 1.0:
            assert all("fully linear FFN merged into one Linear(16, 16)" in m for m in ffn)
        else:
            assert all("48/64 linear channels" in m for m in ffn)
            assert any(isinstance(m, LinearWithPassthrough) for m in folded.modules())
        assert s.flops_after < s.flops_before and s.params_after < s.params_before
        # float64 verification; folded float32 weights carry ~1e-7 relative rounding only
        assert s.max_abs_error <= 1e-6 * s.output_scale
        assert type(folded) is type(model)


def test_t5_gated_ffn_is_reported_not_folded():
    from transformers import T5Config, T5Model

    model = T5Model(T5Config(vocab_size=100, d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2,
                             feed_forward_proj="gated-gelu")).eval()
    ids = torch.randint(0, 100, (1, 5))
    inputs = {"input_ids": ids, "decoder_input_ids": ids}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize.convert(model, example_inputs=inputs)
    _set_linear(model, 0.5)
    folded = linearize.fold(model, inputs, latency=False)
    assert any("gated FFN" in s for s in folded.linearize_fold_summary.skipped)
    _no_units(folded)


def test_llama_gated_ffn_is_reported_not_folded():
    from transformers import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)).eval()
    inputs = {"input_ids": torch.randint(0, 100, (2, 5))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize.convert(model, example_inputs=inputs)
    _set_linear(model, 0.5)
    folded = linearize.fold(model, inputs, latency=False)
    assert any("layers.0.mlp: gated FFN act_fn(gate_proj x) * (up_proj x)" in s
               for s in folded.linearize_fold_summary.skipped)
    _no_units(folded)


# ----------------------------------------------------------------------------- FLOPs, latency, errors


def test_count_flops_matches_hand_count():
    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)).eval()
    assert count_flops(conv, torch.randn(2, 3, 5, 5)) == 2 * (2 * 8 * 25) * 3 * 9 + 2 * (2 * 8 * 25)
    grouped = nn.Conv2d(8, 8, 3, groups=4)
    assert count_flops(grouped, torch.randn(1, 8, 5, 5)) == 2 * (8 * 9) * 2 * 9
    assert count_flops(nn.Linear(4, 6), torch.randn(5, 3, 4)) == 2 * 4 * 6 * 15
    from transformers.pytorch_utils import Conv1D

    assert count_flops(Conv1D(6, 4), torch.randn(5, 4)) == 2 * 4 * 6 * 5

    class Attention(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            scores = q @ q.transpose(-1, -2)  # [1, 2, 5, 5]: 25 dots of length 4 per head
            return torch.nn.functional.scaled_dot_product_attention(q, q, q) + scores.sum(-1, keepdim=True)

    q = torch.randn(1, 2, 5, 4)
    assert count_flops(Attention(), q) == 2 * (2 * 25 * 4) + 2 * (2 * 25 * 4 + 2 * 25 * 4)


def test_latency_is_measured_and_summary_prints():
    unit = LA("relu", 64, -1)
    with torch.no_grad():
        unit.slope.fill_(1.0)
    model = nn.Sequential(nn.Linear(32, 64), unit, nn.Linear(64, 32)).eval()
    folded = linearize.fold(model, torch.randn(8, 32))
    s = folded.linearize_fold_summary
    assert s.latency_ms_before > 0 and s.latency_ms_after > 0 and s.latency_ratio is not None
    assert "FLOPs" in str(s) and "merged:" in str(s)


def test_never_converted_model_folds_bn_and_says_so():
    model = randomize_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())).eval()
    x = torch.randn(1, 3, 6, 6)
    with pytest.warns(UserWarning, match="never converted"):
        folded = linearize.fold(model, x, latency=False)
    assert [type(m) for m in folded] == [nn.Conv2d, nn.ReLU]
    assert any("never converted" in s for s in folded.linearize_fold_summary.skipped)
    _same(model, folded, x)


def test_bad_inputs_raise_clear_errors():
    model = nn.Sequential(nn.Linear(4, 8), LA("relu", 8, -1), nn.Linear(8, 2)).eval()
    with pytest.raises(ValueError, match="do not fit the model"):
        linearize.fold(model, torch.randn(3, 5))
    with pytest.raises(ValueError, match="objective"):
        linearize.fold(model, torch.randn(3, 4), objective="speed")
    with pytest.raises(TypeError):
        linearize.fold("not a model", torch.randn(3, 4))
    bn_model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)).train()
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        linearize.fold(bn_model, torch.randn(3, 4))


def test_tolerance_snaps_and_verification_catches_large_error():
    unit = LA("relu", 8, -1)
    with torch.no_grad():
        unit.slope.fill_(0.5)  # tol=0.6 calls these linear: a large, detected approximation
    model = nn.Sequential(nn.Linear(4, 8), unit, nn.Linear(8, 2)).eval()
    with pytest.raises(FoldVerificationError, match="differs"):
        linearize.fold(model, torch.randn(64, 4), tol=0.6, latency=False)
    folded = linearize.fold(model, torch.randn(64, 4), tol=0.6, atol=1e3, latency=False)
    assert len(folded) == 1


def _ill_conditioned() -> nn.Sequential:
    """Linear(16->16) with rows ``r`` and ``r + d`` (``|r|`` ~ 1e4, ``|d|`` ~ 1), a linear unit, and a
    head that subtracts the pairs: outputs ~ ``d . x`` computed from values ~1e4, so float32
    rounds them by ~1e-3 of their scale (10x the default rtol) while float64 is exact to ~1e-12."""
    g = torch.Generator().manual_seed(0)
    r, d = torch.randn(8, 16, generator=g) * 1e4, torch.randn(8, 16, generator=g)
    head = torch.cat([-torch.ones(8), torch.ones(8)])
    model = linearize.convert(nn.Sequential(nn.Linear(16, 16, bias=False), nn.ReLU(), nn.Linear(16, 2, bias=False)))
    with torch.no_grad():
        model[0].weight.copy_(torch.cat([r, r + d]))
        model[2].weight.copy_(torch.stack([head, 0.5 * head]))
        model[1].slope.fill_(1.0)
    return model.eval()


def test_a_badly_conditioned_float32_model_is_refused_naming_its_own_rounding_and_float64_verifies_it():
    model, x = _ill_conditioned(), torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = x.double() @ (model[2].weight.double() @ model[0].weight.double()).T  # the function, by hand
        own = float((model(x).double() - exact).abs().max())
    assert own > 2e-4 * float(exact.abs().max())  # the premise: the model's own float32 output misses rtol 1e-4
    with pytest.raises(FoldVerificationError, match=r"own torch.float32 output is .* from its float64 output, so "
                       r"rounding alone can fail .*dtype=torch.float64") as err:
        linearize.fold(model, x, latency=False)
    assert f"{own:.3g}" in str(err.value) and "lower tol" not in str(err.value)  # tol=0 snapped nothing
    folded = linearize.fold(model, x, latency=False, dtype=torch.float64)
    (merged,) = [m for m in folded.modules() if isinstance(m, nn.Linear)]  # the two layers merged into one
    torch.testing.assert_close(merged.weight.double(), model[2].weight.double() @ model[0].weight.double(),
                               rtol=1e-6, atol=0)


def _off_by(factor: float, outputs: int = 2) -> FoldRule:
    """A wrong rule: the weights of the Linear with ``outputs`` outputs scaled by ``factor``."""

    def apply(m: nn.Module, ctx) -> nn.Module:
        with torch.no_grad():
            m.weight.mul_(factor)
        return m

    return FoldRule("wrong", lambda m, ctx: isinstance(m, nn.Linear) and m.out_features == outputs, apply)


def test_float64_verification_catches_a_wrong_fold_hidden_in_float32_rounding():
    model, x = _ill_conditioned(), torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    # 0.05% off: less than the model's own float32 rounding (~0.2% of the scale), plain in float64
    with pytest.raises(FoldVerificationError, match="differs by"):
        linearize.fold(model, x, latency=False, dtype=torch.float64, rules=[_off_by(1.0005), *fold_rules()])
    well_conditioned = linearize.convert(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))).eval()
    with pytest.raises(FoldVerificationError, match=r"own torch.float32 output is .* from its float64 output; ") as err:
        linearize.fold(well_conditioned, x, latency=False, rules=[_off_by(1.01), *fold_rules()])
    assert "rounding alone" not in str(err.value)  # its own rounding (~1e-7) explains nothing


def test_rounding_on_one_output_never_passes_an_error_on_another():
    """Output 0 is exact in float32 (x1 - x2, then times 1e4) but not once merged ([1e4, -1e4] on inputs ~1e3);
    output 1 rounds in the model itself (inputs ~1e6). The merged float32 model is ~3% of the scale off: refused,
    although the model's own rounding (on output 1) is near the tolerance."""
    model = linearize.convert(nn.Sequential(nn.Linear(4, 2, bias=False), nn.ReLU(), nn.Linear(2, 2, bias=False)))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, -1, 0, 0], [0, 0, 0.1, -0.1]]))
        model[2].weight.copy_(torch.tensor([[1e4, 0], [0, 1.0]]))
        model[1].slope.fill_(1.0)
    g = torch.Generator().manual_seed(0)
    base = 1000 + torch.rand(64, 1, generator=g)
    x = torch.cat([base, base + 1e-3 * torch.randn(64, 1, generator=g), 1e6 + torch.randn(64, 2, generator=g)], 1)
    with torch.no_grad():
        exact = x.double() @ (model[2].weight.double() @ model[0].weight.double()).T
        own = float((model.eval()(x).double() - exact).abs().max())
    assert 0 < own < 1e-3 * float(exact.abs().max())  # the premise: the model itself rounds, but little
    with pytest.raises(FoldVerificationError, match=r"differs by .* own torch.float32 output is") as err:
        linearize.fold(model, x, latency=False)
    # the error's digits depend on the CPU's float32 summation order (0.845 on one machine, 0.498 on another):
    # assert its size, far beyond the tolerance and the model's own rounding, not one machine's value
    numbers = r"([0-9.e+-]+)"
    found = re.search(rf"differs by {numbers} \(output scale {numbers}, tolerance {numbers}\); the model's own "
                      rf"torch.float32 output is {numbers} from", str(err.value))
    assert found is not None, str(err.value)
    diff, scale, tolerance, own_rounding = map(float, found.groups())
    assert diff > 10 * tolerance and diff > 10 * own_rounding and diff > 5e-3 * scale


class _ZeroHead(nn.Module):
    """``body`` then a zero head: the output verifies nothing, the head's input does (in eval mode, as the
    outputs: dropout left in train mode must not blur it)."""

    def __init__(self, body: nn.Module, width: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(width, 3)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_the_inner_signal_names_the_rounding_and_is_verified_in_eval_mode():
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    # dropout on: the outputs and the inner signal are both taken in eval mode
    model = _ZeroHead(nn.Sequential(*_ill_conditioned(), nn.ReLU(), nn.Dropout(0.5)), 2).train()
    with pytest.raises(FoldVerificationError, match=r"at the input of 'head' .*own torch.float32 output is .*rounding alone"):
        linearize.fold(model, x, latency=False)
    s = linearize.fold(model, x, latency=False, dtype=torch.float64).linearize_fold_summary
    assert s.verified_on == "input of 'head'" and s.signal_error <= 1e-4 * s.signal_scale
    assert model.training and model.body[3].training  # the caller's modes are left as they were


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_refusal_names_its_rounding_and_a_wrong_fold_fails_any_honest_tolerance(dtype):
    """Merged half-precision weights round by ~1e-3 themselves: the default rtol 1e-4 refuses the fold and
    says why; rtol=2e-2 (a few of the dtype's ulps) accepts it, and a 10%-off rule stays refused there."""
    torch.manual_seed(0)

    def model() -> nn.Module:
        m = linearize.convert(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))).eval()
        with torch.no_grad():
            m[1].slope.fill_(1.0)
        return m.to(dtype)

    x = torch.randn(64, 16).to(dtype)
    with pytest.raises(FoldVerificationError, match=rf"own {dtype} output is .* rounding alone"):
        linearize.fold(model(), x, latency=False)
    folded = linearize.fold(model(), x, latency=False, rtol=2e-2)
    assert folded.linearize_fold_summary.max_abs_error <= 2e-2 * folded.linearize_fold_summary.output_scale
    with pytest.raises(FoldVerificationError, match="differs by"):
        linearize.fold(model(), x, latency=False, rtol=2e-2, rules=[_off_by(1.1, outputs=4), *fold_rules()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("verify_dtype", [None, torch.float64])
def test_half_precision_refusal_of_affine_ends_names_an_rtol_that_accepts_the_fold(dtype, verify_dtype):
    """A one_shot model (affine ends, merged into a d x d path and biases) cast to bfloat16 / float16: the refusal
    advised dtype=torch.float64, which refused again (the merged weights keep the dtype's rounding). It now names
    an rtol, from the model's own rounding, under which the fold passes; a 10%-off rule stays refused there."""
    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(),
                                            nn.Linear(64, 4)))
    x = torch.randn(64, 16)
    linearize.one_shot(model, x, target=0.25)
    model, x = model.to(dtype).eval(), x[:8].to(dtype)
    with pytest.raises(FoldVerificationError, match="rounding alone can fail") as err:
        linearize.fold(model, x, latency=False, dtype=verify_dtype)
    assert "verify the fold's algebra with dtype=torch.float64" not in str(err.value)
    rtol = float(re.search(r"rtol=([0-9.e-]+) \(twice that rounding", str(err.value)).group(1))
    assert rtol <= 50 * torch.finfo(dtype).eps  # a few of the dtype's ulps, not any tolerance
    for verified_in in (None, torch.float64):
        folded = linearize.fold(model, x, latency=False, dtype=verified_in, rtol=rtol)
        assert folded.linearize_fold_summary.max_abs_error <= rtol * folded.linearize_fold_summary.output_scale
        with pytest.raises(FoldVerificationError, match="differs by"):
            linearize.fold(model, x, latency=False, dtype=verified_in, rtol=rtol,
                           rules=[_off_by(1.1, outputs=4), *fold_rules()])


def test_a_model_that_does_not_run_in_float64_is_refused_saying_its_rounding_is_unknown():
    class Float32Only(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float32:
                raise TypeError("float32 only")
            return x

    model = nn.Sequential(*_ill_conditioned(), Float32Only())
    with pytest.raises(FoldVerificationError, match=r"own rounding is unknown \(its float64 run failed: TypeError\)"):
        linearize.fold(model, torch.randn(64, 16, generator=torch.Generator().manual_seed(1)), latency=False)


def test_dropout_left_in_train_mode_does_not_blur_the_inner_signal():
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8), nn.Dropout(0.5), nn.ReLU())
    model = linearize.convert(_ZeroHead(body, 8))
    with torch.no_grad():
        model.body[1].slope.fill_(1.0)  # body 0 o 2 merge; the head's input verifies it
    s = linearize.fold(model.train(), torch.randn(64, 16), latency=False).linearize_fold_summary
    assert s.verified_on == "input of 'head'" and s.signal_error <= 1e-4 * s.signal_scale
    assert model.training


def test_a_refusal_on_cuda_with_tf32_names_it():
    from types import SimpleNamespace

    from linearize.folding.verify import tf32_hint

    cuda_out = [SimpleNamespace(device=torch.device("cuda"))]
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        assert tf32_hint([torch.zeros(2)]) == ""  # on the CPU TF32 plays no part
        assert "TF32 is on" in tf32_hint(cuda_out) and "dtype=torch.float64" in tf32_hint(cuda_out)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        assert tf32_hint(cuda_out) == ""
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_fold_names_a_merged_module_whose_hook_changes_its_output_and_gives_no_tolerance_advice():
    """A forward hook returning ``relu`` of a Linear's output is part of the function; merging that Linear with
    the next (its unit at slope 1) drops the hook: the refusal names the hooked module, not 'raise rtol/atol'."""

    torch.manual_seed(0)
    model, x = Plain(), torch.randn(5, 4)
    model.a.register_forward_hook(lambda m, args, out: torch.relu(out))
    with pytest.warns(UserWarning, match="forward hook"):
        linearize.convert(model, example_inputs=x)
    with torch.no_grad():
        model.act.slope.fill_(1.0)
    with pytest.raises(FoldVerificationError, match="fold merged away 'a', which had forward hooks") as err:
        linearize.fold(model.eval(), x)
    assert "rtol/atol" not in str(err.value)


def test_a_bfloat16_fold_failing_from_rounding_gets_the_rounding_diagnosis_despite_a_monitoring_hook():
    """A hook that returns None changes nothing: a bfloat16 model that fails the default rtol from rounding alone
    gets the same refusal with such a hook on a merged layer as without it (the truth), not the hook message."""
    messages = []
    for hooked in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))
        model = model.to(torch.bfloat16)
        seen = []
        if hooked:
            model[0].register_forward_hook(lambda m, args, out: seen.append(out.float().mean()))
        x = torch.randn(32, 64, dtype=torch.bfloat16)
        linearize.convert(model, example_inputs=x)
        with torch.no_grad():
            for _, unit in linearize.units(model):
                unit.slope.fill_(1.0)
        with pytest.raises(FoldVerificationError, match="rounding alone can fail this tolerance") as err:
            linearize.fold(model.eval(), x)
        messages.append(str(err.value))
        assert bool(seen) == hooked
    assert messages[1] == messages[0] and "forward hooks" not in messages[1]


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
@pytest.mark.parametrize("act, affine", [(nn.ReLU, False), (nn.LeakyReLU, False), (nn.GELU, False), (nn.GELU, True)],
                         ids=["relu", "leaky_relu", "gelu", "gelu-affine-end"])
def test_a_folded_model_takes_the_nested_batches_the_converted_model_takes(layout, act, affine):
    """The converted model runs nested tensors (torch.nested) through its units, but its folded model crashed on
    them deep in torch where a site kept mixed slopes (ChannelPReLU: "view(): cannot view shape (2, j1, 16)",
    ChannelBlend: "aten.lerp.Tensor"). Truth: each sequence run dense through the folded model, and the
    converted model on the same nested batch. Element-level plain forms are refused by name, as element units."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    converted = linearize.convert(nn.Sequential(nn.Linear(8, 16), act(), nn.Linear(16, 4)), example_inputs=x).eval()
    unit = converted[1]
    with torch.no_grad():
        unit.slope.copy_(torch.linspace(0, 1, 16))  # a partly linear site
    if affine:
        unit.set_linear_end(torch.linspace(0.5, 1.5, 16), torch.linspace(-0.2, 0.2, 16))
    folded = linearize.fold(converted, x, latency=False).eval()
    assert isinstance(folded[1], ChannelPReLU if act is not nn.GELU else ChannelBlend)
    seqs = [torch.randn(3, 8), torch.randn(5, 8)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: the strided layout is a prototype
        nested = torch.nested.as_nested_tensor(seqs, layout=layout)
        got, want = folded(nested), converted(nested)
        for g, w, s in zip(got.unbind(), want.unbind(), seqs, strict=True):
            torch.testing.assert_close(g, folded(s.unsqueeze(0))[0], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        element = linearize.unit.ElementBlend(nn.GELU(), torch.zeros(5, 8))
        with pytest.raises(ValueError, match=r"ElementBlend\(map_shape=\[5, 8\]\) cannot run on a nested tensor.*"
                                             r"one slope per position.*to_padded_tensor\(0\.0\)"):
            element(nested)
