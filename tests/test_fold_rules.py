"""fold's rule registry and fold by shape: users' blocks fold through registered rules; FFN-shaped blocks of
any model (timm Mlp in ViT / ConvNeXt / MLP-Mixer, torchvision MLPBlock, a user's Linear -> ReLU -> Linear)
fold without a rule naming their class. Truths: the unfolded model in float64, hand-counted multiply-adds,
hand-built expected weights."""

from __future__ import annotations

import math
import warnings

import pytest
import timm
import torch
from torch import nn

import linearize
from linearize.folding import FoldRule, Objective, count_flops, fold_rules, register_fold_rule, unregister_fold_rule

pytestmark = pytest.mark.usefixtures("one_thread")


def _convert(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """Converted, in float64 (slopes included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return linearize.convert(model.float(), example_inputs=x.float()).double().eval()


def _fold(model: nn.Module, x: torch.Tensor, **kwargs) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return linearize.fold(model, x, latency=False, **kwargs)


# ----------------------------------------------------------------------------- a user's own block


class AddLinear(nn.Module):
    """``x + act(lin(x))``: no built-in rule folds it (not a Sequential, not an FFN)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.lin(x))


def _as_linear(block: AddLinear) -> nn.Linear:
    """``x + W x + b`` (the unit linear) as one Linear with weight ``W + I``."""
    new = nn.Linear(block.lin.in_features, block.lin.out_features).to(block.lin.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(block.lin.weight + torch.eye(block.lin.in_features, dtype=block.lin.weight.dtype))
        new.bias.copy_(block.lin.bias)
    return new


def _fold_add_linear(block: nn.Module, ctx) -> nn.Module | None:
    if not ctx.is_linear(block.act):
        return None
    ctx.merged("x + lin(x) merged into one Linear")
    return _as_linear(block)


ADD_LINEAR = FoldRule("add-linear", lambda m, ctx: isinstance(m, AddLinear), _fold_add_linear)


def _user_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(AddLinear(6), nn.Linear(6, 3)).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    return _convert(model, x), x


def _set_slopes(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.fill_(value)


def test_registered_rule_folds_a_user_block():
    model, x = _user_model()
    _set_slopes(model, 1.0)
    lin, head = model[0].lin, model[1]
    truth = head(x + x @ lin.weight.T + lin.bias)  # the block's definition, by hand
    register_fold_rule(ADD_LINEAR)
    try:
        folded = _fold(model, x)
    finally:
        unregister_fold_rule("add-linear")
    # AddLinear became a Linear, then the Sequential rule merged it with the head: one Linear(6, 3)
    assert [type(m) for m in folded.children()] == [nn.Linear]
    torch.testing.assert_close(folded(x), truth, rtol=0, atol=1e-12)
    merged = folded.linearize_fold_summary.merged
    assert "0: x + lin(x) merged into one Linear" in merged
    assert "add-linear" not in [r.name for r in fold_rules()]


def test_declined_rule_leaves_the_block_and_says_so():
    model, x = _user_model()
    _set_slopes(model, 0.5)  # nonlinear: the rule declines
    truth = model(x)
    register_fold_rule(ADD_LINEAR)
    try:
        folded = _fold(model, x)
    finally:
        unregister_fold_rule("add-linear")
    assert type(folded[0]) is AddLinear and isinstance(folded[0].act, nn.PReLU)  # unit made plain only
    torch.testing.assert_close(folded(x), truth, rtol=0, atol=1e-12)
    assert "0: fold rule 'add-linear' matched AddLinear but declined; left as is" in folded.linearize_fold_summary.skipped


def test_rules_per_call_replace_the_registry_for_that_call():
    model, x = _user_model()
    _set_slopes(model, 1.0)
    before = [r.name for r in fold_rules()]
    only_mine = _fold(model, x, rules=[ADD_LINEAR])  # no Sequential rule: the two Linears stay apart
    assert [type(m) for m in only_mine.children()] == [nn.Linear, nn.Linear]
    none = _fold(model, x, rules=[])
    assert type(none[0]) is AddLinear
    with_defaults = _fold(model, x, rules=[ADD_LINEAR, *fold_rules()])
    assert [type(m) for m in with_defaults.children()] == [nn.Linear]
    assert [r.name for r in fold_rules()] == before  # nothing registered
    for folded in (only_mine, none, with_defaults):
        torch.testing.assert_close(folded(x), model(x), rtol=0, atol=1e-12)


def test_a_rule_that_does_not_report_is_reported_for_it():
    model, x = _user_model()
    _set_slopes(model, 1.0)
    silent = FoldRule("silent", lambda m, ctx: isinstance(m, AddLinear), lambda m, ctx: _as_linear(m))
    folded = _fold(model, x, rules=[silent])
    assert "0: fold rule 'silent' replaced AddLinear by Linear" in folded.linearize_fold_summary.merged


def test_registry_order_before_and_first_match_wins():
    def rule(name: str, result: str | None) -> FoldRule:
        def apply(m, ctx):
            calls.append(name)
            return None if result is None else m

        return FoldRule(name, lambda m, ctx: isinstance(m, AddLinear), apply)

    builtin = [r.name for r in fold_rules()]
    calls: list[str] = []
    try:
        register_fold_rule(rule("a", None))
        register_fold_rule(rule("b", "apply"))
        register_fold_rule(rule("c", "apply"), before="sequential")
        register_fold_rule(rule("d", None), before="a")
        assert [r.name for r in fold_rules()] == ["d", "a", "b", "c", *builtin]
        with pytest.raises(ValueError, match="registered already"):
            register_fold_rule(rule("a", None))
        with pytest.raises(ValueError, match="no fold rule named 'nope'"):
            register_fold_rule(rule("e", None), before="nope")
        model, x = _user_model()
        _fold(model, x)
        assert calls == ["d", "a", "b"]  # d and a declined, b applied: c never asked
    finally:
        for name in ("a", "b", "c", "d"):
            if name in [r.name for r in fold_rules()]:
                unregister_fold_rule(name)
    assert [r.name for r in fold_rules()] == builtin


class _NoApply:
    name = "half"

    def matches(self, m, ctx):
        return False


def test_bad_rules_raise_type_error_naming_what_is_missing():
    with pytest.raises(TypeError, match=r"lacks name .*matches .*apply"):
        register_fold_rule(object())
    with pytest.raises(TypeError, match="lacks apply") as err:
        register_fold_rule(_NoApply())
    assert "matches" not in str(err.value).split("lacks")[1].split(";")[0]
    model, x = _user_model()
    with pytest.raises(TypeError, match="lacks name"):
        _fold(model, x, rules=[lambda m, ctx: m])
    with pytest.raises(TypeError, match="rules must be a list"):
        _fold(model, x, rules="sequential")
    bad = FoldRule("bad", lambda m, ctx: isinstance(m, AddLinear), lambda m, ctx: "folded")
    with pytest.raises(TypeError, match="fold rule 'bad' returned str"):
        _fold(model, x, rules=[bad])
    assert "half" not in [r.name for r in fold_rules()]


def test_objective_object_and_string_agree_and_params_differs_from_flops():
    # 3x3 o 3x3 (no padding) on a 6x6 map: a 5x5 merge lowers FLOPs (9*16 + 9*4 = 180 > 25*4 = 100
    # multiply-adds per channel pair) but raises parameters (25 > 9 + 9 per channel pair)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3)).double().eval()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    by_flops = _fold(model, x, objective=Objective("flops"))
    assert [type(m) for m in by_flops.children()] == [nn.Conv2d] and by_flops[0].kernel_size == (5, 5)
    by_string = _fold(model, x, objective="flops")
    assert str(by_string) == str(by_flops) and by_string.linearize_fold_summary.objective == "flops"
    by_params = _fold(model, x, objective="params")
    assert [m.kernel_size for m in by_params.children()] == [(3, 3), (3, 3)]
    assert any("would not lower the params" in s for s in by_params.linearize_fold_summary.skipped)
    with pytest.raises(ValueError, match="objective must be one of"):
        _fold(model, x, objective="latency")


# ----------------------------------------------------------------------------- fold by shape


class UserFFN(nn.Module):
    """A user's own FFN: ``fc2(relu(fc1(x)))`` in a forward (not a Sequential)."""

    def __init__(self, d: int = 16, m: int = 64) -> None:
        super().__init__()
        self.up, self.down, self.nonlin = nn.Linear(d, m), nn.Linear(m, d), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.nonlin(self.up(x)))


class LeakyFFN(UserFFN):
    """fc1's output is also used outside the FFN: splitting it would change that use."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(self.nonlin(h)) + h.mean(-1, keepdim=True)


class ActReusedFFN(UserFFN):
    """The activation's output is used twice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.nonlin(self.up(x))
        return self.down(a) + a.sum(-1, keepdim=True)


def _set_90(model: nn.Module, seed: int = 0) -> None:
    """90% of every unit's channels exactly linear (slope 1), the others uniform in [0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, u in linearize.units(model):
            c = u.slope.numel()
            a = torch.rand(c, generator=g, dtype=u.slope.dtype)
            a[torch.randperm(c, generator=g)[: round(0.9 * c)]] = 1.0
            u.slope.copy_(a)


def _ffn_inputs(model: nn.Module, paths: list[str], x: torch.Tensor) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    hooks = [model.get_submodule(p).register_forward_pre_hook(
        lambda m, args, p=p: seen.setdefault(p, args[0].detach().clone())) for p in paths]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _hand_macs(ffn: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Multiply-adds of the FFN before and after the split, from its weights and the slopes."""
    layers = [m for m in ffn.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    first, second = layers[0], layers[-1]
    unit = next(u for _, u in linearize.units(ffn))
    d = first.weight.shape[1]
    m, d_out = first.weight.shape[0], second.weight.shape[0]
    n = int((unit.slope != 1).sum())
    rows = x.numel() // d
    return rows * (d * m + m * d_out), rows * (d * n + (n + d) * d_out)


def _timm_mlp():
    from timm.layers import Mlp

    return Mlp(32, 128), torch.randn(2, 5, 32), [""]


def _timm_vit():
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              num_classes=10)
    return model, torch.randn(2, 3, 32, 32), ["blocks.0.mlp", "blocks.1.mlp"]


def _convnext(conv_mlp: bool):
    def build():
        model = timm.create_model("convnext_atto", pretrained=False, num_classes=10, conv_mlp=conv_mlp,
                                  depths=(1, 1, 1, 1))  # timm's own GELU module: a module site
        return model, torch.randn(2, 3, 32, 32), [f"stages.{i}.blocks.0.mlp" for i in range(4)]

    return build


def _mixer():
    from timm.models.mlp_mixer import MlpMixer

    model = MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=2, embed_dim=64)
    paths = [f"blocks.{i}.{p}" for i in range(2) for p in ("mlp_tokens", "mlp_channels")]
    return model, torch.randn(2, 3, 32, 32), paths


def _tv_mlp_block():
    from torchvision.models.vision_transformer import MLPBlock

    return MLPBlock(32, 128, 0.1), torch.randn(2, 5, 32), [""]


FFN_CASES = {
    "timm_mlp": _timm_mlp,
    "timm_vit": _timm_vit,
    "convnext_conv_mlp": _convnext(True),
    "convnext_channels_last": _convnext(False),
    "mixer": _mixer,
    "torchvision_mlp_block": _tv_mlp_block,
    "user_ffn": lambda: (UserFFN(), torch.randn(3, 16), [""]),
}


@pytest.mark.parametrize("name", list(FFN_CASES))
def test_ffn_by_shape_folds_to_a_third_of_its_flops(name):
    torch.manual_seed(0)
    model, x, paths = FFN_CASES[name]()
    model, x = _convert(model.eval(), x), x.double()
    _set_90(model)
    folded = _fold(model, x)
    summary = folded.linearize_fold_summary
    assert summary.max_abs_error <= 1e-6 * summary.output_scale, summary
    inputs = _ffn_inputs(model, paths, x)
    for path in paths:
        ffn, new, h = model.get_submodule(path), folded.get_submodule(path), inputs[path]
        with torch.no_grad():
            ref, out = ffn(h), new(h)
        assert (out - ref).abs().max() <= 1e-6 * ref.abs().max(), (name, path)  # float64 definition
        before, after = _hand_macs(ffn, h)
        counted_before, counted_after = count_flops(ffn, h), count_flops(new, h)
        assert (counted_before, counted_after) == (2 * before, 2 * after), (name, path)
        assert after <= 0.35 * before, (name, path, after / before)
        assert any(f"{path + '.' if path else ''}" in s and "linear channels folded" in s for s in summary.merged)


@pytest.mark.parametrize("cls", [LeakyFFN, ActReusedFFN])
def test_ffn_by_shape_declines_when_an_inner_value_is_used_elsewhere(cls):
    torch.manual_seed(0)
    model = cls().double().eval()
    x = torch.randn(3, 16, dtype=torch.float64)
    _convert(model, x)
    _set_90(model)
    truth = model(x)
    folded = _fold(model, x)
    assert type(folded.up) is nn.Linear and folded.up.out_features == 64  # not split
    assert not any("FFN" in s or "linear channels" in s for s in folded.linearize_fold_summary.merged)
    torch.testing.assert_close(folded(x), truth, rtol=0, atol=1e-12)


def test_fully_linear_conv_ffn_becomes_one_1x1_conv():
    from timm.layers import Mlp

    torch.manual_seed(0)
    mlp = Mlp(8, 32, use_conv=True).double().eval()
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    _convert(mlp, x)
    _set_slopes(mlp, 1.0)
    folded = _fold(mlp, x)
    convs = [m for m in folded.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 1 and convs[0].kernel_size == (1, 1) and convs[0].in_channels == 8
    w1, w2 = mlp.fc1.weight.flatten(1), mlp.fc2.weight.flatten(1)  # the definition: W2 W1, W2 b1 + b2
    torch.testing.assert_close(convs[0].weight.flatten(1), w2 @ w1)
    torch.testing.assert_close(convs[0].bias, w2 @ mlp.fc1.bias + mlp.fc2.bias)
    assert count_flops(folded, x) == 2 * 2 * 25 * 8 * 8 == math.prod(x.shape) * 2 * 8


def test_folded_files_naming_the_old_module_still_load(tmp_path):
    """Files written before fold became a package name its classes ``linearize.folding.<name>``."""
    import json

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    model = _convert(model, x).float()
    with torch.no_grad():
        model[1].slope.copy_(torch.tensor([0.0, 0.5, 1.0, 1.0, 0.2, 1.0, 1.0, 1.0]))
    folded = _fold(model, x)
    linearize.save_folded(folded, tmp_path)
    meta = json.loads((tmp_path / "folded.json").read_text())
    renamed = 0
    for entry in meta["modules"]:
        if entry["class"].rsplit(".", 1)[1] in ("LinearWithPassthrough", "ChannelPReLU"):
            entry["class"] = "linearize.folding." + entry["class"].rsplit(".", 1)[1]
            renamed += 1
    assert renamed == 2  # LinearWithPassthrough and ChannelPReLU
    (tmp_path / "folded.json").write_text(json.dumps(meta))
    loaded = linearize.load_folded(tmp_path)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=1e-6)


def test_fold_of_a_timm_condconv_block_equals_its_source():
    """Truth: fold returns a model computing the source's function (or leaves a block it cannot fold as
    it is). timm's ``CondConvResidual`` subclasses ``InvertedResidual`` but its forward computes
    routing weights and calls ``conv_pw(x, routing_weights)``; the timm inverted-residual rule matches it
    by ``isinstance`` and lays its layers out as a plain chain. Observed: ``TypeError: CondConv2d.forward()
    missing 1 required positional argument: 'routing_weights'`` from deep inside torch."""
    timm_blocks = pytest.importorskip("timm.models._efficientnet_blocks")
    torch.manual_seed(0)
    block = timm_blocks.CondConvResidual(8, 8, exp_ratio=2.0, num_experts=2)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), block, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)).eval()
    x = torch.randn(2, 3, 6, 6)
    model = linearize.convert(model, example_inputs=x)
    folded = linearize.fold(model, x, latency=False)
    with torch.no_grad():
        ref = model(x)
        assert (folded(x) - ref).abs().max() <= 1e-4 * ref.abs().max()
