"""In-place activations whose input the model reads again (``out = relu_(h) + h``): gated splits keep
that semantics, plain in-place units train, and the shared output comparison (``max_difference``)
against its definition."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import linearize
from linearize.config import GatedConfig
from linearize.gated import convert_gated, gate_statistics
from linearize.inputs import max_difference
from linearize.unit import ChannelBlend, ChannelPReLU


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


def test_dgn_of_in_place_activations_not_read_again_makes_no_copies():
    """torchvision's ReLU(inplace=True), no input read again: the gated sites stay out of place."""
    torchvision = pytest.importorskip("torchvision")
    gated = convert_gated(torchvision.models.resnet18(num_classes=3), GatedConfig(mode="dgn"), torch.randn(2, 3, 32, 32))
    assert not any(g.inplace for _, g in gated.gates())


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
