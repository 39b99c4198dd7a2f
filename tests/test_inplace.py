"""In-place activations whose input the model reads again (``out = relu_(h) + h``): gated splits keep
that semantics, plain in-place units train, and the shared output comparison (``max_difference``)
against its definition."""

from __future__ import annotations

import copy
import math
import threading
import warnings

import pytest
import torch
from torch import nn

import linearize
from linearize.config import GatedConfig
from linearize.gated import convert_gated, gate_statistics
from linearize.inputs import max_difference
from linearize.unit import ChannelBlend, ChannelPReLU
from linearize.unit import LinearizableActivation
from test_unit_exactness import path  # noqa: F401  (the fixture: compiled kernels, counted, or PyTorch ops)
from zoo import random_slopes


class _Aliased(nn.Module):
    """``head(relu_(h) + h)``: after the in-place call ``h`` holds ``relu(h)``, so the head sees ``2 relu(h)``."""

    def __init__(self, act: nn.Module | None = None) -> None:
        super().__init__()
        self.lin, self.act, self.head = nn.Linear(8, 8), act or nn.ReLU(inplace=True), nn.Linear(8, 3)

    def forward(self, x):
        h = self.lin(x)
        out = self.act(h)
        return self.head(out + h)


@pytest.mark.parametrize("act", [nn.ReLU(inplace=True), nn.LeakyReLU(0.1, inplace=True), nn.ReLU6(inplace=True)],
                         ids=["relu", "leaky_relu", "relu6"])
def test_dgn_with_hard_gates_keeps_an_in_place_activation_read_again(act):
    """DGN with hard gates and copied weights computes the original network: for an in-place activation
    whose input is read again too (the truth: the original module's output and input gradient)."""
    torch.manual_seed(0)
    original = _Aliased(act).double()
    x = torch.randn(32, 8, dtype=torch.float64, requires_grad=True) * 3
    gated = convert_gated(original, GatedConfig(mode="dgn", init="copy", hard_gates=True), x.detach())
    ref = original(x)
    gx_ref, = torch.autograd.grad(ref.sum(), x)
    out = gated(x)
    gx, = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-12)
    assert all(g.inplace for _, g in gated.gates())
    # and the gates are those of h itself, not of the value written over it
    stats = gate_statistics(gated, x.detach())
    with torch.no_grad():
        h = original.lin(x.detach())
    (site, stat), = stats.items()
    assert stat["fraction_on"] == pytest.approx(float((h > 0).double().mean()), abs=1e-12)


class _HiddenOnRequest(nn.Module):
    """``forward(x, return_hidden=True)`` also returns ``h``, which the in-place activation overwrote with
    ``relu(h)``; in training a running feature mean is read from ``h`` after the call. The probe (plain
    ``forward(x)``, eval) takes neither path."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)
        self.register_buffer("feat_mean", torch.zeros(8))

    def forward(self, x, return_hidden=False):
        h = self.fc1(x)
        out = self.fc2(self.act(h))
        if self.training:
            with torch.no_grad():
                self.feat_mean.mul_(0.9).add_(0.1 * h.mean(0))
        return (out, h) if return_hidden else out


def _other_paths(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """What the other paths read of an in-place activation's input: a forward keyword, a feature hook on the
    layer before (registered before convert), a buffer updated in training, and the input gradient."""
    model.eval()
    out, hidden = model(x.clone(), return_hidden=True)
    model.train()
    xg = x.clone().requires_grad_()
    for _ in range(3):
        y = model(xg)
    (gx,) = torch.autograd.grad(y.sum(), xg)
    return [out, hidden, model.hooked[-1], model.feat_mean.clone(), gx]


@pytest.mark.parametrize("how", ["units", "dgn"])
def test_in_place_activation_modules_keep_their_write_on_paths_the_probe_did_not_take(how):
    """An nn.ReLU(inplace=True) became an out-of-place unit (or gate) unless convert's probe saw its input read
    again: a forward keyword returning ``h``, a hook on the layer before and a buffer read from ``h`` in
    training then saw the pre-activation where the original gives ``relu(h)``. Truth: the unconverted model
    (units at slope 0; DGN with copied weights and hard gates), bit for bit on every path."""
    torch.manual_seed(0)
    original, x = _HiddenOnRequest(), torch.randn(6, 4)
    model = copy.deepcopy(original)
    for net in (original, model):
        net.hooked = []
        net.fc1.register_forward_hook(lambda m, i, o, net=net: net.hooked.append(o))
    if how == "units":
        linearize.convert(model, example_inputs=x)
    else:
        hooked = model.hooked  # the hook's closure appends here, in the feature (first) and the value network
        model = convert_gated(model, GatedConfig(mode="dgn", init="copy", hard_gates=True), x)
        model.hooked = hooked
        model.feat_mean = model.value.feat_mean
    want = _other_paths(original, x)
    got = _other_paths(model, x)
    assert (want[1] >= 0).all() and (want[2] >= 0).all()  # the paths do read the in-place write
    for name, a, b in zip(["out", "hidden", "hook on fc1", "buffer", "input gradient"], got, want):
        assert torch.equal(a, b), name


def test_dlgn_feature_identity_is_unchanged_by_in_place_semantics():
    """DLGN's feature network is linear: an identity written in place leaves h as it is, so the feature
    network of the aliased model computes head(2 h) (its definition, float64)."""
    torch.manual_seed(0)
    original = _Aliased().double()
    x = torch.randn(16, 8, dtype=torch.float64)
    gated = convert_gated(original, GatedConfig(mode="dlgn", init="copy"), x)
    with torch.no_grad():
        feature_out = gated.feature(x)
        torch.testing.assert_close(feature_out, original.head(2 * original.lin(x)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("plain", ["prelu", "blend"])
def test_plain_in_place_form_trains_with_the_gradients_of_its_definition(plain):
    """A folded in-place unit (ChannelPReLU / ChannelBlend with inplace=True) in a training step: the
    gradients of the weights and the input equal those of ``head(2 f(h))`` computed out of place."""
    torch.manual_seed(0)
    slope = torch.rand(8, dtype=torch.float64)
    if plain == "prelu":
        act = ChannelPReLU(slope, channel_dim=1, inplace=True)
        f = lambda m, h: torch.where(h > 0, h, m.act.weight * h)  # noqa: E731 (the slope is a parameter)
    else:
        act = ChannelBlend(nn.GELU(), slope, channel_dim=1, inplace=True)
        f = lambda m, h: (1 - slope) * nn.functional.gelu(h) + slope * h  # noqa: E731
    model = _Aliased(act).double()
    truth = copy.deepcopy(model)
    x = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    out = model(x)
    out.square().sum().backward()
    want = truth.head(2 * f(truth, truth.lin(x)))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    grads = torch.autograd.grad(want.square().sum(), [x, *truth.parameters()])
    x_grad_model = torch.autograd.grad(model(x).square().sum(), x)[0]
    torch.testing.assert_close(x_grad_model, grads[0], rtol=0, atol=1e-10)
    for (name, p), g in zip(model.named_parameters(), grads[1:]):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-10, msg=name)


def test_max_difference_against_its_definition():
    nan, inf = math.nan, math.inf
    a = torch.tensor([1.0, -4.0, nan, inf, 2.0])
    assert max_difference([a], [a.clone()]) == (0.0, 4.0)  # NaN and inf equal to themselves
    assert max_difference([a], [torch.tensor([1.0, -4.0, 0.0, inf, 2.0])]) == (inf, 4.0)  # NaN on one side
    assert max_difference([a], [torch.tensor([1.0, -4.0, nan, -inf, 2.0])]) == (inf, 4.0)
    assert max_difference([a, torch.ones(3)], [a.clone(), torch.tensor([1.0, 1.25, 1.0])]) == (0.25, 4.0)
    assert max_difference([], []) == (0.0, 0.0)
    assert max_difference([torch.ones(0)], [torch.ones(0)]) == (0.0, 0.0)
    big = torch.tensor([1e300], dtype=torch.float64)  # float64 differences, no float32 overflow
    assert max_difference([big], [-big]) == (2e300, 1e300)
    with pytest.raises(ValueError):
        max_difference([a], [])


class _Learnable(nn.Module):
    """A learnable activation ``tanh(w x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def forward(self, x):
        return torch.tanh(self.w * x)


def test_in_place_unit_with_a_learnable_act_and_fixed_slopes_has_the_acts_gradient():
    """unit.inplace with frozen slopes and an act module holding parameters: write_into skipped the copy, the backward crashed."""
    torch.manual_seed(0)
    unit = LinearizableActivation(_Learnable(), 3, kind="learnable").double()
    with torch.no_grad():
        unit.slope.fill_(0.3)
    unit.slope.requires_grad_(False)
    x = torch.randn(2, 3, dtype=torch.float64)
    a = torch.tensor(0.3, dtype=torch.float64)
    want = (1 - a) * torch.tanh(unit.act.w * x) + a * x  # the definition, out of place
    g_want, = torch.autograd.grad(want.sum(), unit.act.w)
    unit.inplace = True
    xi = x.clone()
    out = unit(xi)
    assert out is xi
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-12)
    g, = torch.autograd.grad(out.sum(), unit.act.w)
    torch.testing.assert_close(g, g_want, rtol=0, atol=1e-12)


def test_in_place_activation_read_again_keeps_its_function_through_training_fold_and_save(tmp_path):
    torch.manual_seed(0)
    original = _Aliased()
    x = torch.randn(16, 8, requires_grad=True)
    model = linearize.convert(copy.deepcopy(original), example_inputs=x.detach())
    # the truth at init: the original module, forward and input gradient (2 relu(h) feeds the head)
    ref = original(x)
    gx_ref, = torch.autograd.grad(ref.sum(), x)
    out = model(x)
    gx, = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=1e-6)
    # partly linear: the definition (2 * blend(h)) in float64, and the folded model and its save
    random_slopes(model)
    a = next(u for _, u in linearize.units(model)).slope.detach().double()
    with torch.no_grad():
        h = model.lin.double()(x.detach().double())
        want = model.head.double()(2 * ((1 - a) * h.relu() + a * h))
        model.float()
        torch.testing.assert_close(model(x.detach()).double(), want, rtol=1e-5, atol=1e-5)
        folded = linearize.fold(model, x.detach())
        torch.testing.assert_close(folded(x.detach()).double(), want, rtol=1e-5, atol=1e-5)
        linearize.save_folded(folded, tmp_path)
        loaded = linearize.load_folded(tmp_path, base=_Aliased())
        torch.testing.assert_close(loaded(x.detach()).double(), want, rtol=1e-5, atol=1e-5)


def test_in_place_check_with_init_slope_the_model_input_and_integer_outputs():
    class OnInput(nn.Module):  # the activation works in place on the model's own input
        def __init__(self, argmax=False):
            super().__init__()
            self.act, self.fc, self.argmax = nn.ReLU(inplace=True), nn.Linear(4, 3), argmax

        def forward(self, x):
            out = self.fc(self.act(x) + x)
            return out.argmax(1) if self.argmax else out

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    for argmax, init_slope in ((False, 0.0), (False, 0.5), (True, 0.0)):
        original = OnInput(argmax)
        given = x.clone()
        model = linearize.convert(copy.deepcopy(original), example_inputs=given, init_slope=init_slope)
        assert torch.equal(given, x)  # convert leaves the caller's inputs as they were
        assert all(u.inplace for _, u in linearize.units(model))
        assert all(bool((u.slope == init_slope).all()) for _, u in linearize.units(model))
        for _, unit in linearize.units(model):
            with torch.no_grad():
                unit.slope.zero_()
        with torch.no_grad():
            assert torch.equal(model(x.clone()), original(x.clone()))


class _ReadAgainInTraining(nn.Module):
    """An auxiliary head on ``h`` in training only: there it sees ``relu(h)`` (the in-place call wrote it);
    BatchNorm statistics and dropout masks that the check's training forward must leave as they were."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.act = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True)
        self.drop, self.out, self.aux = nn.Dropout(0.3), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x):
        h = self.bn(self.lin(x))
        y = self.out(self.drop(self.act(h)))
        return y + self.aux(h) if self.training else y


def test_in_place_activation_read_again_only_in_training_keeps_its_function_in_both_modes():
    """The check compared the modes' outputs in eval mode only: the unit stayed out of place and the training
    forward's auxiliary head saw the unrectified ``h``. Truth: the unconverted model in both modes (the same
    dropout masks); convert leaves the BatchNorm statistics and the random generator as they were."""
    torch.manual_seed(0)
    original, x = _ReadAgainInTraining(), torch.randn(16, 6)
    model = copy.deepcopy(original)
    rng = torch.get_rng_state()
    linearize.convert(model, example_inputs=x)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(model.bn.buffers(), original.bn.buffers()))
    assert [n for n, u in linearize.units(model) if u.inplace] == ["act"]
    for training in (True, False):
        outs = []
        for net in (original, model):
            torch.manual_seed(1)
            outs.append(net.train(training)(x))
        assert torch.equal(outs[1], outs[0])


class _EmaInTraining(nn.Module):
    """A training forward that changes the model: an EMA codebook updated in place (a Parameter without
    gradients) and a step counter; the output reads the in-place activation's input ``h`` again."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.act = nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True)
        self.codebook = nn.Parameter(torch.randn(4), requires_grad=False)
        self.steps = 0

    def forward(self, x):
        h = self.conv(x)
        a = self.act(h)
        if self.training:
            with torch.no_grad():
                self.codebook.mul_(0.9).add_(0.1 * a.mean((0, 2, 3)))
            self.steps += 1
        return a + h * self.codebook[None, :, None, None]


def test_convert_leaves_a_model_its_training_forward_changes_as_given():
    """The training-mode comparison ran the model's own training forward, putting back only buffers, module
    flags and the random state: convert moved the EMA codebook and the step counter and warned that the
    converted model differs. Truth: an unconverted deep copy (same parameters, counter 0, same outputs in
    both modes at slope 0, the same training update)."""
    torch.manual_seed(0)
    original, x = _EmaInTraining().eval(), torch.randn(2, 3, 8, 8)
    model = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linearize.convert(model, example_inputs=x)
    assert model.steps == 0 and torch.equal(model.codebook, original.codebook)
    assert torch.equal(model.conv.weight, original.conv.weight)
    for training in (True, False):
        with torch.no_grad():
            assert torch.equal(model.train(training)(x.clone()), original.train(training)(x.clone()))
    assert model.steps == original.steps == 1 and torch.equal(model.codebook, original.codebook)


class _NoCopy(nn.Module):
    """A model that cannot be deep-copied (it holds a lock) and reads its in-place activation's input again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act, self.lock = nn.Linear(4, 4), nn.ReLU(inplace=True), threading.Lock()

    def forward(self, x):
        h = self.lin(x)
        return self.act(h) + h


def test_model_that_cannot_be_deep_copied_is_compared_in_eval_mode_only():
    """The training-mode comparison runs on deep copies; a model without one is still converted, its unit in
    place as the eval comparison decides. Truth: the unconverted model, at slope 0."""
    torch.manual_seed(0)
    model, x = _NoCopy(), torch.randn(3, 4)
    with torch.no_grad():
        truth = model(x.clone())
    linearize.convert(model, example_inputs=x, init_slope=0.0)
    assert [n for n, u in linearize.units(model) if u.inplace] == ["act"]
    with torch.no_grad():
        assert torch.equal(model(x.clone()), truth)


def test_convert_leaves_every_random_generator_as_it_was(monkeypatch):
    """The in-place check runs the model with dropout at a fixed seed: the CPU generator must be put back, and
    no CUDA generator seeded (torch.manual_seed seeds, or queues a seed for, every CUDA device: a user's seeded
    CUDA dropout would restart from 0). Truth: the CPU state before convert; no CUDA seed call at all."""
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seeded.append(seed))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(8, 2))
    torch.manual_seed(123)
    x = torch.randn(3, 4)
    seeded.clear()
    before = torch.get_rng_state()
    linearize.convert(model, example_inputs=x)
    assert torch.equal(torch.get_rng_state(), before) and seeded == []


@pytest.mark.parametrize("act", [nn.ELU(inplace=True), nn.ELU(0.5, inplace=True), nn.CELU(0.7, inplace=True),
                                 nn.SELU(inplace=True)], ids=["elu", "elu(0.5)", "celu(0.7)", "selu"])
@pytest.mark.parametrize("granularity", ["channel", "element"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_at_slope_0_an_in_place_elu_family_unit_has_the_originals_gradients_bit_for_bit(act, granularity, dtype,
                                                                                          path):
    """A converted model whose ELU / CELU / SELU module works in place: at slope 0 its output, input gradient and
    parameter gradients are the unconverted model's bit for bit. Torch's in-place ELU differentiates from its
    result (``elu_backward(is_result=True)``), which rounds otherwise than the out-of-place form's (input-based)
    backward: 1e-8 apart in float32, so the unit runs that in-place form too."""
    torch.manual_seed(0)
    original = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), act, nn.Conv2d(8, 4, 1)).to(dtype)
    model = copy.deepcopy(original)
    x = torch.randn(2, 3, 6, 6, dtype=dtype) * 2
    linearize.convert(model, example_inputs=x, granularity=granularity)
    assert model[1].inplace
    results = []
    for m in (model, original):
        xi = x.clone().requires_grad_()
        out = m(xi)
        (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum().backward()
        results.append([out, xi.grad] + [p.grad for n, p in m.named_parameters() if "slope" not in n])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
