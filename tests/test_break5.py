"""Break tests for the in-place write-back (unit.write_into), gated in-place sites and max_difference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from linearize.config import GatedConfig
from linearize.gated import convert_gated
from linearize.inputs import max_difference
from linearize.unit import LinearizableActivation


class _InputInPlace(nn.Module):
    """An in-place LeakyReLU of the model input itself, then ``head(act(h) + h)`` (an input read again)."""

    def __init__(self) -> None:
        super().__init__()
        self.act0 = nn.LeakyReLU(0.1, inplace=True)
        self.lin, self.act, self.head = nn.Linear(4, 4), nn.LeakyReLU(0.1, inplace=True), nn.Linear(4, 2)

    def forward(self, x):
        x = self.act0(x)
        h = self.lin(x)
        return self.head(self.act(h) + h)


def test_dgn_in_place_tap_on_the_model_input_does_not_change_the_value_networks_input():
    """DGN: the feature network's in-place tap wrote into the caller's input, so the value network applied the leaky ReLU twice."""
    torch.manual_seed(0)
    model = _InputInPlace().double().eval()
    x = torch.randn(16, 4, dtype=torch.float64)
    x_orig = x.clone()
    ref = model(x_orig)  # the original writes leaky_relu(x) into x_orig
    gated = convert_gated(model, GatedConfig(mode="dgn", init="copy", hard_gates=True), x.clone()).eval()
    assert all(g.inplace for _, g in gated.gates())
    xg = x.clone()
    out = gated(xg)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(xg, x_orig, rtol=0, atol=0)  # the caller's input is written once, as by the original


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


@pytest.mark.parametrize("ref,new", [(torch.zeros(3), torch.zeros(1)), (torch.zeros(0), torch.ones(2)),
                                     (torch.zeros(2, 1), torch.ones(2))], ids=["broadcast", "empty-ref", "2d-1d"])
def test_max_difference_refuses_tensors_of_other_shapes(ref, new):
    """max_difference broadcast tensors of other shapes (or skipped an empty ref) and reported a small or zero error."""
    with pytest.raises(ValueError, match="one shape"):
        max_difference([ref], [new])
