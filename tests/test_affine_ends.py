"""Affine linear ends (a unit at a = 1 computes alpha * x + beta), their least-squares fit, the one-shot
linearization, and their save / freeze / fold, each against an independent truth: the blend's definition
in float64, numpy's lstsq, a brute-force per-channel output error, the unfolded model."""

from __future__ import annotations

import copy
import doctest

import numpy as np
import pytest
import torch
from torch import nn

import linearize
from linearize.unit import LinearizableActivation

pytestmark = pytest.mark.usefixtures("one_thread")

ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "leaky": lambda: nn.LeakyReLU(0.1), "silu": nn.SiLU}


def _set_random_ends(model: nn.Module, seed: int = 1, removed: bool = True) -> None:
    """Every unit: half its channels at 1, two at 0.5, the rest at 0, random ends (channel 0 removed: alpha 0)."""
    g = torch.Generator().manual_seed(seed)
    for _, u in linearize.units(model):
        c = u.num_channels
        a = torch.zeros(c, dtype=u.slope.dtype)
        a[: c // 2] = 1.0
        a[c // 2: c // 2 + 2] = 0.5
        u.slope.data.copy_(a[torch.randperm(c, generator=g)])
        alpha = torch.randn(c, generator=g, dtype=torch.float64).to(u.slope.dtype)
        if removed:
            alpha[u.slope.detach() == 1] = alpha[u.slope.detach() == 1].clone().index_fill_(0, torch.tensor([0]), 0.0)
        u.set_linear_end(alpha, torch.randn(c, generator=g, dtype=torch.float64).to(u.slope.dtype))


# ----------------------------------------------------------------------------- the unit


@pytest.mark.parametrize("kind", sorted(ACTS))
@pytest.mark.parametrize("channel_dim, shape", [(1, (3, 5, 4, 4)), (-1, (3, 7, 5))])
def test_affine_end_matches_the_blend_definition_and_its_gradients(kind, channel_dim, shape):
    act = ACTS[kind]()
    unit = LinearizableActivation(act, 5, channel_dim=channel_dim).double()
    unit.slope.data.copy_(torch.tensor([0.0, 0.25, 0.5, 1.0, 1.0], dtype=torch.float64))
    alpha, beta = torch.tensor([2.0, -1.0, 0.3, 0.7, 0.0]), torch.tensor([0.5, 1.0, -2.0, 0.1, 3.0])
    unit.set_linear_end(alpha, beta)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    view = [1] * len(shape)
    view[channel_dim] = 5
    a, al, be = (t.detach().clone().double().view(view).requires_grad_() for t in (unit.slope, unit.alpha, unit.beta))
    ref = (1 - a) * act(x) + a * (al * x + be)
    y = unit(x)
    assert (y - ref).abs().max() < 1e-12
    ch = [slice(None)] * len(shape)
    ch[channel_dim] = 0
    assert torch.equal(y[tuple(ch)], act(x)[tuple(ch)])  # a = 0: the activation, bit for bit
    ch[channel_dim] = 3
    assert torch.equal(y[tuple(ch)], torch.addcmul(unit.beta[3], unit.alpha[3], x[tuple(ch)]))  # a = 1: the end
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, unit.slope, unit.alpha, unit.beta], g)
    want = torch.autograd.grad(ref, [x, a, al, be], g)
    for gg, ww in zip(got, want):
        assert (gg.reshape(-1) - ww.reshape(-1)).abs().max() < 1e-10


def test_converted_model_has_no_end_until_one_is_set():
    net = linearize.convert(nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 2)), example_inputs=torch.randn(2, 3))
    unit = net[1]
    assert unit.linear_end is None and "1.alpha" not in net.state_dict()
    assert len(list(net.parameters())) == 5  # two layers' weight and bias, the slopes
    unit.set_linear_end(torch.ones(4), 0.0)
    assert set(net.state_dict()) >= {"1.alpha", "1.beta"} and bool(unit.identity_end_mask().all())
    with pytest.raises(ValueError, match=r"\[4\] tensor"):
        unit.set_linear_end(torch.ones(3), 0.0)
    with pytest.raises(ValueError, match="finite"):
        unit.set_linear_end(torch.ones(4), float("nan"))
    unit.set_linear_end(None)
    assert unit.linear_end is None and "1.alpha" not in net.state_dict()


def test_state_dict_of_an_affine_unit_loads_into_a_fresh_unit():
    unit = LinearizableActivation(nn.GELU(), 3, channel_dim=-1)
    unit.slope.data.fill_(1.0)
    unit.set_linear_end(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([1.0, 2.0, 3.0]))
    fresh = LinearizableActivation(nn.GELU(), 3, channel_dim=-1)
    fresh.load_state_dict(unit.state_dict())
    x = torch.randn(4, 3)
    assert torch.equal(fresh(x), unit(x))


@pytest.mark.parametrize("kind", sorted(ACTS))
def test_end_gradients_take_nothing_from_infinite_inputs_or_from_channels_at_slope_0(kind):
    """d/dalpha and d/dbeta of ``a * (alpha * x + beta)`` over the finite inputs only, as the slope's gradient:
    an infinite input gave alpha a NaN gradient (-0 * inf), also in a channel at slope 0, whose output does not
    use its end; that channel's end gradients are exactly 0."""
    unit = LinearizableActivation(ACTS[kind](), 3, channel_dim=-1).double()
    unit.slope.data.copy_(torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64))
    unit.set_linear_end(torch.tensor([0.5, 2.0, -1.0]), torch.tensor([0.1, 0.2, 0.3]))
    x = torch.randn(6, 3, dtype=torch.float64)
    x[0], x[1] = float("inf"), float("-inf")
    g = torch.randn(6, 3, dtype=torch.float64)
    got_alpha, got_beta = torch.autograd.grad(unit(x), [unit.alpha, unit.beta], g)
    a, finite = unit.slope.detach(), x.isfinite()
    want_alpha, want_beta = torch.where(finite, g * a * x, 0.0).sum(0), torch.where(finite, g * a, 0.0).sum(0)
    assert got_alpha[0] == 0 and got_beta[0] == 0
    torch.testing.assert_close(got_alpha, want_alpha, rtol=1e-12, atol=0)
    torch.testing.assert_close(got_beta, want_beta, rtol=1e-12, atol=0)


@pytest.mark.parametrize("trainable", [True, False])
def test_ends_load_as_they_were_saved_learnable_or_fixed(tmp_path, trainable):
    """Learnable ends (one_shot's) load as parameters, fixed ones (``trainable=False``, the Sparsifier's) as
    buffers that no optimizer holds: through load_state_dict into a fresh unit or one whose ends are of the other
    kind, and through linearize.save_pretrained / from_pretrained. So an optimizer built after the load holds the
    parameters the saved one did (fixed ends loaded as parameters: its load_state_dict failed on the count)."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 2))

    x = torch.randn(32, 4)
    net = linearize.convert(build(), example_inputs=x[:2])
    linearize.one_shot(net, x, target=0.5)
    if not trainable:
        net[1].set_linear_end(*net[1].linear_end, trainable=False)
    saved = {name for name, _ in net.named_parameters()}
    assert ("1.alpha" in saved) == trainable
    fresh = linearize.convert(build(), example_inputs=x[:2])
    fresh.load_state_dict(net.state_dict())
    other = linearize.convert(build(), example_inputs=x[:2])
    other[1].set_linear_end(1.0, 0.0, trainable=not trainable)
    other.load_state_dict(net.state_dict())
    linearize.save_pretrained(net, tmp_path)
    loaded = linearize.from_pretrained(build(), tmp_path, example_inputs=x[:2])
    for model in (fresh, other, loaded):
        assert {name for name, _ in model.named_parameters()} == saved
        assert torch.equal(model(x), net(x)) and torch.equal(model[1].alpha, net[1].alpha)


# ----------------------------------------------------------------------------- the fit


def _lstsq(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    coef, *_ = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1), y, rcond=None)
    return float(coef[0]), float(coef[1])


class _MaskedFFN(nn.Module):
    """An FFN called with keyword arguments (as a Hugging Face encoder is): ``x [B, T, D]`` and a padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x))) * attention_mask.unsqueeze(-1)


@pytest.mark.parametrize("form", ["tensor", "pair", "list"])
def test_fit_is_numpy_lstsq_per_channel(form):
    net = nn.Sequential(nn.Linear(5, 6), nn.GELU(), nn.Linear(6, 2))
    with torch.no_grad():
        net[0].weight[2] = 0.0  # channel 2 is constant: act(bias) everywhere
    net = linearize.convert(net, example_inputs=torch.randn(2, 5))
    x = torch.randn(300, 5) * 2
    data = {"tensor": x, "pair": (x, torch.zeros(300)), "list": [x[:100], (x[100:250], None), x[250:]]}[form]
    fits = linearize.fit_linear_ends(net, data)
    h = net[0](x).detach().double().numpy()
    act = torch.nn.functional.gelu(net[0](x)).detach().double().numpy()
    unit = net[1]
    for c in range(6):
        if c == 2:
            assert unit.alpha.detach()[c] == 0 and abs(float(unit.beta.detach()[c]) - act[0, c]) < 1e-6
            continue
        alpha, beta = _lstsq(h[:, c], act[:, c])
        assert abs(float(fits["1"].alpha[c]) - alpha) < 1e-9 and abs(float(fits["1"].beta[c]) - beta) < 1e-9
        assert abs(float(unit.alpha.detach()[c]) - alpha) < 1e-6  # set on the unit (float32)
        res = act[:, c] - (alpha * h[:, c] + beta)
        assert abs(float(fits["1"].residual[c]) - np.mean(res ** 2)) < 1e-9 * max(1.0, np.mean(act[:, c] ** 2))
        assert abs(float(fits["1"].identity_residual[c]) - np.mean((act[:, c] - h[:, c]) ** 2)) < 1e-8


def test_fit_leaves_out_padding_of_keyword_batches():
    net = linearize.convert(_MaskedFFN(), example_inputs={"x": torch.randn(2, 3, 4), "attention_mask": torch.ones(2, 3)})
    x = torch.randn(4, 6, 4)
    mask = torch.ones(4, 6)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    x[mask == 0] = 50.0  # padding far off: it would dominate a fit that counted it
    linearize.fit_linear_ends(net, {"x": x, "attention_mask": mask})
    h = net.up(x[mask.bool()]).detach()
    act = torch.nn.functional.gelu(h)
    for c in range(6):
        alpha, beta = _lstsq(h[:, c].double().numpy(), act[:, c].double().numpy())
        assert abs(float(net.act.alpha[c]) - alpha) < 1e-5 and abs(float(net.act.beta[c]) - beta) < 1e-5


def test_fit_refuses_a_unit_the_data_never_reaches():
    class TwoPaths(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.l = nn.ReLU(), nn.GELU(), nn.Linear(3, 3)

        def forward(self, x):  # b runs on batches of more than 3 rows only
            return self.b(self.a(self.l(x))) if x.shape[0] > 3 else self.a(self.l(x))

    net = linearize.convert(TwoPaths(), example_inputs=torch.randn(4, 3))
    assert [n for n, _ in linearize.units(net)] == ["a", "b"]
    with pytest.raises(ValueError, match="'b' saw no data position"):
        linearize.fit_linear_ends(net, torch.randn(2, 3))
    with pytest.raises(ValueError, match="no unit named"):
        linearize.fit_linear_ends(net, torch.randn(2, 3), units=["c"])
    assert net.a.linear_end is None  # nothing was set


@pytest.mark.parametrize("call", [
    lambda net, data: linearize.fit_linear_ends(net, data),
    lambda net, data: linearize.one_shot(net, data, target=0.25),
    lambda net, data: linearize.one_shot(net, data, end="hybrid", flops=0.5),
], ids=["fit_linear_ends", "one_shot", "hybrid"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_calibration_data_with_nan_or_inf_names_the_unit_the_batch_and_the_fix(call, bad):
    torch.manual_seed(0)
    net = linearize.convert(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)))
    original = copy.deepcopy(net.state_dict())
    data = [torch.randn(64, 8) for _ in range(3)]
    data[2][17, 3] = bad
    with pytest.raises(ValueError, match=r"calibration data holds NaN/inf.*unit '1'.*batch 2 of data.*drop or repair"):
        call(net, data)
    assert net[1].linear_end is None  # nothing was changed
    for k, v in net.state_dict().items():  # `frozen` holds NaN (free channels)
        torch.testing.assert_close(v, original[k], rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------- one-shot


def _brute_force_errors(net: nn.Sequential, x: torch.Tensor, unit_index: int, end: str) -> torch.Tensor:
    """Per channel: mean over samples of the squared change of the next layer's output when that channel
    alone (slope 1) computes its end (a copy fitted on ``x``), measured by running the model."""
    errors = []
    channels = net[unit_index].num_channels
    base = copy.deepcopy(net)
    if end == "affine":
        linearize.fit_linear_ends(base, x)
    with torch.no_grad():
        ref = base[: unit_index + 2](x).double()
        for c in range(channels):
            m = copy.deepcopy(base)
            m[unit_index].slope.zero_()
            m[unit_index].slope[c] = 1.0
            errors.append(float(((m[: unit_index + 2](x).double() - ref) ** 2).sum(-1).mean()))
    return torch.tensor(errors, dtype=torch.float64)


@pytest.mark.parametrize("end", ["affine", "identity"])
def test_one_shot_keeps_the_channels_a_brute_force_output_error_ranks_first(end):
    net = nn.Sequential(nn.Linear(6, 24), nn.GELU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    net = linearize.convert(net, example_inputs=torch.randn(2, 6, dtype=torch.float64))
    x = torch.randn(400, 6, dtype=torch.float64)
    truth = {"1": _brute_force_errors(net, x, 1, end), "3": _brute_force_errors(net, x, 3, end)}
    sites = linearize.one_shot(net, x, target=0.25, end=end)
    for name, errors in truth.items():
        c = len(errors)
        keep = round(0.25 * c)
        assert set(torch.nonzero(~sites[name].linear).flatten().tolist()) == set(errors.argsort(descending=True)[:keep].tolist())
        assert torch.allclose(sites[name].score, errors, rtol=1e-8, atol=1e-12)
        unit = net[int(name)]
        assert int((unit.slope == 1).sum()) == c - keep and bool((unit.frozen[sites[name].linear] == 1).all())
        assert (unit.linear_end is not None) == (end == "affine")
    assert linearize.nonlinear_fraction(net) == 0.25


def test_one_shot_affine_changes_the_output_less_than_identity():
    torch.manual_seed(3)
    base = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 4))
    with torch.no_grad():
        base[0].bias.fill_(-1.5)  # mostly inactive channels, as in trained FFNs
    x = torch.randn(512, 8)
    ref = base(x)
    errors = {}
    for end in ("identity", "affine"):
        net = linearize.convert(copy.deepcopy(base), example_inputs=x[:2])
        linearize.one_shot(net, x, target=0.25, end=end, refit=False)  # the ends alone (the refit evens them out)
        errors[end] = float(((net(x) - ref) ** 2).mean())
    assert errors["affine"] < 0.2 * errors["identity"]


def test_one_shot_refuses_a_unit_that_feeds_no_layer_with_the_fix():
    net = linearize.convert(nn.Sequential(nn.Linear(3, 4), nn.GELU()), example_inputs=torch.randn(2, 3))
    with pytest.raises(ValueError, match="outgoing="):
        linearize.one_shot(net, torch.randn(16, 3))
    sites = linearize.one_shot(net, torch.randn(16, 3), target=0.5, outgoing={"1": torch.ones(4)})
    assert sites["1"].nonlinear == 2
    with pytest.raises(ValueError, match="target"):
        linearize.one_shot(net, torch.randn(16, 3), target=1.5)
    with pytest.raises(ValueError, match="end"):
        linearize.one_shot(net, torch.randn(16, 3), end="zero")


# ----------------------------------------------------------------------------- freeze and save


def test_freeze_makes_a_linear_channel_exactly_its_affine_end():
    net = linearize.convert(nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 2)), example_inputs=torch.randn(2, 3))
    unit = net[1]
    unit.slope.data.copy_(torch.tensor([1 - 1e-4, 0.5, 0.0, 1.0]))
    unit.set_linear_end(torch.tensor([0.3, 0.4, 0.5, 0.6]), torch.tensor([-1.0, 1.0, 2.0, 0.5]))
    linearize.freeze(net, tol=1e-3)
    h = torch.randn(10, 4)
    y = unit(h)
    assert torch.equal(y[:, 0], torch.addcmul(torch.tensor(-1.0), torch.tensor(0.3), h[:, 0]))
    assert torch.equal(y[:, 2], torch.nn.functional.gelu(h)[:, 2])


def test_freeze_with_data_keeps_the_outputs_of_stably_active_affine_channels():
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        net[0].bias.copy_(torch.tensor([50.0, 0.0, 50.0, 0.0], dtype=torch.float64))  # channels 0, 2 stably active
    net = linearize.convert(net, example_inputs=torch.randn(2, 3, dtype=torch.float64))
    net[1].slope.data.fill_(0.4)
    net[1].set_linear_end(torch.tensor([0.5, 2.0, -1.0, 1.5]), torch.tensor([1.0, -1.0, 0.5, 2.0]))
    x = torch.randn(64, 3, dtype=torch.float64)
    before = net(x)
    summary = linearize.freeze(net, data=x)
    assert summary.stably_active == 2
    assert (net(x) - before).abs().max() < 1e-12


def test_save_and_load_keep_the_affine_ends_and_old_saves_load_as_identity(tmp_path):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 2))

    x = torch.randn(32, 4)
    net = linearize.convert(build(), example_inputs=x[:2])
    linearize.save_pretrained(net, tmp_path / "old")  # no ends: today's format
    linearize.one_shot(net, x, target=0.5)
    linearize.save_pretrained(net, tmp_path / "new")
    loaded = linearize.from_pretrained(build(), tmp_path / "new", example_inputs=x[:2])
    assert torch.equal(loaded(x), net(x)) and torch.equal(loaded[1].alpha, net[1].alpha)
    old = linearize.from_pretrained(build(), tmp_path / "old", example_inputs=x[:2])
    assert old[1].linear_end is None
    net[1].alpha.data[0] = float("inf")
    with pytest.raises(ValueError, match="alpha"):
        linearize.save_pretrained(net, tmp_path / "bad")


def test_hf_save_pretrained_keeps_the_affine_ends(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    torch.manual_seed(0)
    model = linearize.convert(transformers.BertModel(config).eval(), target_modules=[r".*intermediate.*"])
    ids = torch.randint(0, 50, (4, 7))
    linearize.one_shot(model, {"input_ids": ids}, target=0.25)
    model.save_pretrained(tmp_path)
    loaded = linearize.from_pretrained(transformers.BertModel, tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)


# ----------------------------------------------------------------------------- fold


def _check_fold(model: nn.Module, x, dtype=None):
    model.eval()
    folded = linearize.fold(model, x, latency=False, dtype=dtype)
    call = (lambda m: m(**x)) if isinstance(x, dict) else (lambda m: m(x))
    with torch.no_grad():
        out, ref = call(folded), call(model)
    out, ref = (getattr(o, "last_hidden_state", o) for o in (out, ref))
    assert not any(isinstance(m, LinearizableActivation) for m in folded.modules())
    return folded, float((out - ref).abs().max()), float(ref.abs().max())


def _fold_mixed_then_fully_linear(net: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """Fold ``net`` with random affine ends at mixed slopes, then with every slope 1, checking both against
    ``net``; returns the fully linear fold."""
    _set_random_ends(net)
    for step in ("mixed", "linear"):
        if step == "linear":
            for _, u in linearize.units(net):
                u.slope.data.fill_(1.0)
        folded, err, scale = _check_fold(net, x)
        assert err <= (1e-5 if dtype == torch.float32 else 1e-12) * scale, step
    return folded


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fold_of_an_mlp_with_affine_ends_is_exact(dtype):
    net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)
    net = linearize.convert(net, example_inputs=torch.randn(2, 6, dtype=dtype))
    folded = _fold_mixed_then_fully_linear(net, torch.randn(64, 6, dtype=dtype), dtype)
    # fully linear with affine ends (and removed channels): the whole MLP is one affine layer
    assert [type(m) for m in folded.modules() if not isinstance(m, nn.Sequential)] == [nn.Linear]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fold_of_a_conv_net_with_batchnorm_and_affine_ends_is_exact(dtype):
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                        nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 8, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 4)).to(dtype)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    net = linearize.convert(net.eval(), example_inputs=torch.randn(2, 3, 8, 8, dtype=dtype))
    folded = _fold_mixed_then_fully_linear(net, torch.randn(8, 3, 8, 8, dtype=dtype), dtype)
    convs = [m for m in folded.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) < 3  # the affine ends moved into the convs, so they merged


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fold_of_a_bert_ffn_with_affine_ends_is_exact(dtype):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.BertModel(config).to(dtype).eval()
    model = linearize.convert(model, target_modules=[r".*intermediate.*"])
    ids = {"input_ids": torch.randint(0, 50, (4, 9))}
    linearize.one_shot(model, ids, target=0.25)
    folded, err, scale = _check_fold(model, ids)
    assert err <= (1e-5 if dtype == torch.float32 else 1e-12) * scale
    summary = folded.linearize_fold_summary
    assert summary.flops_after < summary.flops_before
    assert any("linear channels folded" in m for m in summary.merged)
    _, err64, scale64 = _check_fold(model, ids, dtype=torch.float64)  # fold's own float64 verification passes
    assert err64 <= 1e-5 * scale64


def test_doctests_of_the_affine_end_functions():
    from linearize import calibration, unit

    globs = {"torch": torch, "nn": nn, "linearize": linearize, "LinearizableActivation": LinearizableActivation}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for obj in (calibration.fit_linear_ends, calibration.one_shot, unit.LinearizableActivation.set_linear_end):
        for test in doctest.DocTestFinder().find(obj, globs=globs):
            assert test.examples and runner.run(test).failed == 0, obj.__name__


def test_save_folded_keeps_a_blend_with_affine_ends(tmp_path):
    net = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)), example_inputs=torch.randn(2, 4))
    x = torch.randn(64, 4)
    net[1].slope.data.copy_(torch.tensor([0.0, 0.5, 1.0, 1.0, 0.25, 0.0, 1.0, 0.0]))
    linearize.fit_linear_ends(net, x)
    folded = linearize.fold(net.eval(), x, latency=False)
    blend = next(m for m in folded.modules() if isinstance(m, linearize.folding.ChannelBlend))
    assert blend.alpha is not None  # channels at 0.5 and 0.25 use their fitted ends
    linearize.save_folded(folded, tmp_path)
    loaded = linearize.load_folded(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x), folded(x)) and (folded(x) - net(x)).abs().max() < 1e-5


def test_bound_propagation_refuses_affine_ends_with_the_fix():
    net = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), example_inputs=torch.randn(2, 4))
    box = linearize.Box(-torch.ones(4), torch.ones(4))
    linearize.stable_units(net, box)  # the identity end: a PReLU
    net[1].set_linear_end(torch.full((8,), 0.5), 0.0)
    with pytest.raises(ValueError, match="affine linear ends.*linearize.fold"):
        linearize.stable_units(net, box)
    with pytest.raises(ValueError, match="affine linear ends"):
        linearize.compress(net, box)
