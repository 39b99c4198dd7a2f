"""Multiplicative gates: squeeze-excitation and other gates are not converted by default, are listed with
the reason, and are not counted; ``gates="include"`` converts them.

The truth is enumerated here from each model's own modules (the gate activation of every SE
module), never from what ``convert`` reports.
"""

import warnings

import pytest
import timm
import torch
import torchvision
from torch import nn

import linearize
from linearize.injection import CallSites
from linearize.reporting import MEASURES

GATE_TYPES = (nn.Sigmoid, nn.Hardsigmoid)


def se_gates(model: nn.Module) -> set[str]:
    """The gate activation of every squeeze-excitation module (torchvision and timm), by name.

    A gate is an activation module (torch's, or timm's own ``Sigmoid`` / ``HardSigmoid``): a call
    site named like the module.
    """
    found = set()
    for name, m in model.named_modules():
        if isinstance(m, torchvision.ops.SqueezeExcitation):
            found.add(f"{name}.scale_activation")
        elif type(m).__name__ in ("SqueezeExcite", "SEModule", "EffectiveSEModule"):
            found.add(f"{name}.gate")
    return found


def activation_channels(model: nn.Module, x: torch.Tensor, skip: set[str]) -> int:
    """Channels of every torch activation module call outside ``skip`` (forward hooks)."""
    total = []
    acts = (nn.ReLU, nn.ReLU6, nn.SiLU, nn.Hardswish, nn.Sigmoid, nn.Hardsigmoid, nn.GELU)
    hooks = [m.register_forward_hook(lambda m, a, o: total.append(a[0].shape[1]))
             for n, m in model.named_modules() if isinstance(m, acts) and n not in skip]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return sum(total)


ZOO = {
    "tv_mobilenet_v3_small": lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
    "tv_efficientnet_b0": lambda: torchvision.models.efficientnet_b0(num_classes=10),
    "timm_ghostnet_100": lambda: timm.create_model("ghostnet_100", pretrained=False, num_classes=10),
    "timm_rexnet_100": lambda: timm.create_model("rexnet_100", pretrained=False, num_classes=10),
    "timm_efficientnet_b0": lambda: timm.create_model("efficientnet_b0", pretrained=False, num_classes=10),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_squeeze_excitation_gates_are_excluded_listed_and_not_counted(name):
    torch.manual_seed(0)
    model = ZOO[name]().eval()
    x = torch.randn(2, 3, 64, 64)
    truth = se_gates(model)
    assert truth, "the model has SE modules"
    with torch.no_grad():
        before = model(x)
    expected_channels = activation_channels(model, x, truth)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot be swapped" warning for timm's functional gates
        linearize.convert(model, example_inputs=x)
    report = model.linearize_report
    assert set(report.gates) == truth
    assert all("gate" in why for why in report.gates.values())
    assert not report.functional_calls
    names = [n for n, _ in linearize.units(model)]
    assert not truth & set(names)
    counts = linearize.count_units(model)
    assert counts["total"] == expected_channels  # gates are not counted
    with torch.no_grad():
        assert torch.equal(model(x), before)  # exact at init
    assert "multiplicative gate(s) left as they are" in str(report)
    assert report.excluded_sites() == report.gates


@pytest.mark.parametrize("name", ["tv_mobilenet_v3_small", "timm_rexnet_100"])
def test_gates_include_restores_converting_them(name):
    torch.manual_seed(0)
    model = ZOO[name]().eval()
    x = torch.randn(2, 3, 64, 64)
    truth = se_gates(model)
    module_gates = {g for g in truth if ": " not in g}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        linearize.convert(model, example_inputs=x, gates="include")
    report = model.linearize_report
    assert not report.gates
    names = {n for n, _ in linearize.units(model)}
    assert module_gates <= names
    functional = truth - module_gates  # timm's Sigmoid: reported as before, with the warning
    assert set(report.functional_calls) == functional
    assert bool(functional) == any("cannot be swapped" in str(w.message) for w in caught)


class Probe(nn.Module):
    """One of each case of the gate rule, with the truth by construction."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.squeeze = nn.Conv2d(8, 8, 1)
        self.se_gate = nn.Sigmoid()  # SE gate, reshaped before the product: a gate
        self.relu_gate = nn.ReLU()  # broadcast [N, C, 1, 1] scale of any kind: a gate
        self.swish_sig = nn.Sigmoid()  # x * sigmoid(x): a gate (a linear sigmoid leaves x * x)
        self.plain_sig = nn.Sigmoid()  # a hidden activation: converted
        self.scaled_sig = nn.Sigmoid()  # times a learnt constant: converted
        self.scale = nn.Parameter(torch.rand(8, 1, 1))
        self.glu_act = nn.SiLU()  # SwiGLU-style silu(a) * b, same shapes: converted
        self.up = nn.Conv2d(8, 8, 1)
        self.shared = nn.Sigmoid()  # called twice: as a gate, then as an activation

    def forward(self, x):
        x = self.conv(x)
        n, c = x.shape[:2]
        s = self.squeeze(x.mean((2, 3), keepdim=True))
        x = x * self.se_gate(s.flatten(1)).view(n, c, 1, 1)
        x = self.relu_gate(s) * x
        x = x * self.swish_sig(x)
        x = self.up(self.plain_sig(x))
        x = self.scaled_sig(x) * self.scale
        x = self.glu_act(x) * self.up(x)
        x = x * self.shared(s)
        x = x + torch.sigmoid(s) * x  # a functional gate: excluded, not a "cannot be swapped" problem
        return self.shared(x)


def converted_quietly(build) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """``build()`` (seed 0) converted in place with no warning allowed, its example batch and its output before."""
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        before = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linearize.convert(model, example_inputs=x)
    return model, x, before


def test_gate_rule_case_by_case():
    model, x, before = converted_quietly(Probe)
    report = model.linearize_report
    assert set(report.gates) == {"se_gate", "relu_gate", "swish_sig", "shared.calls.0", "linearize_functional.sigmoid_0"}
    assert not report.functional_calls
    assert [n for n, _ in linearize.units(model)] == ["plain_sig", "scaled_sig", "glu_act", "shared.calls.1"]
    assert isinstance(model.shared, CallSites) and model.shared.calls[0] is not model.shared.calls[1]
    assert type(model.shared.calls[0]) is nn.Sigmoid and type(model.se_gate) is nn.Sigmoid
    with torch.no_grad():
        assert torch.equal(model(x), before)
        assert torch.equal(model(x), before)  # the dispatcher resets per forward

    included = linearize.convert(Probe().eval(), example_inputs=x, gates="include")
    units = [n for n, _ in linearize.units(included)]
    assert units == ["se_gate", "relu_gate", "swish_sig", "plain_sig", "scaled_sig", "glu_act",
                     "shared.calls.0", "shared.calls.1", "linearize_functional.sigmoid_0"]


def test_gates_option_is_validated_and_round_trips():
    with pytest.raises(ValueError, match="gates must be one of"):
        linearize.LinearizeConfig(gates="drop")
    cfg = linearize.LinearizeConfig(gates="include")
    assert linearize.LinearizeConfig.from_dict(cfg.to_dict()) == cfg
    assert linearize.LinearizeConfig().gates == "exclude"


def test_report_lists_the_excluded_gates():
    torch.manual_seed(0)
    model = Probe().eval()
    x = torch.randn(4, 3, 6, 6)
    linearize.convert(model, example_inputs=x)
    skip = [m for m in MEASURES if m != "units"]
    rep = linearize.report(model, x, skip=skip, progress=False)
    assert set(rep.excluded) == {"se_gate", "relu_gate", "swish_sig", "shared.calls.0", "linearize_functional.sigmoid_0"}
    assert rep.units["total"] == sum(u.num_channels for _, u in linearize.units(model))
    assert "swish_sig" in rep.to_html({}) and "Not converted on purpose" in rep.to_html({})


class ScaledGates(nn.Module):
    """Gates with scalar arithmetic before their product, or applied through einsum, and hidden activations
    with scalar arithmetic or an einsum contraction after them; the truth by construction."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1, self.fc2, self.fc3, self.fc4 = (nn.Linear(8, 8) for _ in range(4))
        self.h_sigmoid = nn.ReLU6(inplace=True)  # ReLU6(x + 3) / 6 broadcast over a map (MobileNetV3 SE): a gate
        self.hidden = nn.ReLU()  # 2 * relu(t) + 1 into a layer: converted
        self.mix = nn.GELU()  # contracted by einsum ("bc,cd->bd"): converted
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        h = self.conv(x)
        n, c = h.shape[:2]
        s = h.mean((2, 3))
        h = h * (self.h_sigmoid(self.fc1(s) + 3) / 6).view(n, c, 1, 1)
        h = h * (2 * torch.sigmoid(self.fc2(s)))[..., None, None]  # functional sigmoid_0: a gate
        h = torch.einsum("bchw,bc->bchw", h, torch.sigmoid(self.fc3(s)))  # functional sigmoid_1: a gate
        t = self.fc4(2 * self.hidden(h.mean((2, 3))) + 1)
        return torch.einsum("bc,cd->bd", self.mix(t), self.w)


def test_gates_behind_scalar_arithmetic_or_einsum_are_excluded_and_not_counted():
    """A hand-written hard sigmoid (ReLU6(x + 3) / 6), a scaled sigmoid (2 * sigmoid(s)) and a sigmoid applied by
    torch.einsum were converted and counted as channels: the probe lost the activation's output at the scalar op
    and did not watch einsum. They are gates now, left as they are and out of the counts; activations whose
    outputs only meet scalars or an einsum contraction stay units. Truth: by construction, and the unconverted
    model's output, bit for bit."""
    model, x, before = converted_quietly(ScaledGates)
    assert set(model.linearize_report.gates) == {"h_sigmoid", "linearize_functional.sigmoid_0",
                                                 "linearize_functional.sigmoid_1"}
    assert [n for n, _ in linearize.units(model)] == ["hidden", "mix"]
    assert type(model.h_sigmoid) is nn.ReLU6
    counts = linearize.count_units(model)
    assert counts["total"] == 16 and set(counts["sites"]) == {"hidden", "mix"}
    with torch.no_grad():
        assert torch.equal(model(x), before)
        model.hidden.slope.fill_(1.0)
    assert linearize.nonlinear_fraction(model) == 0.5


def test_an_einsum_scaling_by_a_weight_leaves_the_activation_a_unit():
    """``einsum("bc,cd->bcd", relu(h), W)`` with ``W`` a Parameter is a scale by a weight, as ``relu(h) * W`` is: the
    activation stays a unit (the einsum rule took it for a gate and left it unconverted). Truth: by construction,
    and the unconverted model's output at slope 0, bit for bit."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.w = nn.Parameter(torch.randn(3, 2))
            self.v = nn.Parameter(torch.randn(3))

        def forward(self, x):
            h = self.fc(x)
            return torch.einsum("bc,cd->bcd", torch.relu(h), self.w).sum(-1) + torch.einsum(
                "bc,c->bc", torch.sigmoid(h), self.v)

    torch.manual_seed(0)
    model, x = Scaled().eval(), torch.randn(5, 4)
    with torch.no_grad():
        before = model(x)
    linearize.convert(model, example_inputs=x)
    assert not model.linearize_report.gates
    assert linearize.count_units(model)["total"] == 6
    with torch.no_grad():
        assert torch.equal(model(x), before)
