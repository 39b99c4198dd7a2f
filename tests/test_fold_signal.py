"""fold's verification is never vacuous: when the model's output is zero or the same for every sample (a
zero-initialised head), fold verifies the input of the last layer it left untouched (the features before the
head), says so, and catches a broken fold there."""

import copy
import warnings

import pytest
import timm
import torch
import torchvision
from torch import nn

import linearize
import linearize.folding.core as folding
from linearize.folding import FoldVerificationError
from linearize.unit import LinearizableActivation as LA


def zero_head_vit() -> nn.Module:
    """timm ViT with ``weight_init="jax"``: its classifier starts at zero, so is its output."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, depth=2,
                              weight_init="jax")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return linearize.convert(model, example_inputs=torch.randn(2, 3, 32, 32)).eval()


def head_name(model: nn.Module, head: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is head)


def perturb(monkeypatch, path: str) -> None:
    """Break fold on purpose: scale the weights of the folded model's layer at ``path`` by 1.05."""
    original = folding._replace_units

    def broken(model, tol, summary):
        model = original(model, tol, summary)
        with torch.no_grad():
            model.get_submodule(path).weight.mul_(1.05)
        return model

    monkeypatch.setattr(folding, "_replace_units", broken)


def test_zero_head_is_verified_on_the_features_before_it():
    model = zero_head_vit()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert model(x).abs().max() == 0  # the premise: the output says nothing
    summary = linearize.fold(model, x, latency=False).linearize_fold_summary
    assert summary.verified_on == f"input of {head_name(model, model.get_classifier())!r}"
    assert "output is zero" in summary.verified_why
    assert summary.signal_scale > 0 and summary.signal_error <= summary.signal_tolerance
    assert "verified on the input of 'head'" in str(summary)


def test_broken_fold_behind_a_zero_head_is_caught(monkeypatch):
    model = zero_head_vit()
    x = torch.randn(2, 3, 32, 32)
    perturb(monkeypatch, "blocks.0.mlp.fc2")
    with pytest.raises(FoldVerificationError, match="at the input of 'head'"):
        linearize.fold(model, x, latency=False)
    with torch.no_grad():  # the same break with a head that is not zero is caught at the output
        model.get_classifier().weight.normal_()
    with pytest.raises(FoldVerificationError, match="folded model differs"):
        linearize.fold(model, x, latency=False)


def test_constant_output_resnet_is_verified_before_the_head_and_a_broken_merge_caught(monkeypatch):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    nn.init.zeros_(model.fc.weight)  # output = fc.bias for every sample
    x = torch.randn(2, 3, 32, 32)
    linearize.convert(model, example_inputs=x).eval()
    with torch.no_grad():
        for name, unit in linearize.units(model):
            if name.startswith("layer2"):
                unit.slope.fill_(1.0)
    folded = linearize.fold(model, x, latency=False, objective="depth")  # merges the layer2 blocks
    summary = folded.linearize_fold_summary
    assert summary.verified_on == "input of 'fc'"
    assert "same for every sample" in summary.verified_why
    merged = next(n for n, m in folded.named_modules() if isinstance(m, nn.Conv2d) and n.startswith("layer2")
                  and n not in dict(model.named_modules()))  # a conv that fold built
    perturb(monkeypatch, merged)
    with pytest.raises(FoldVerificationError, match="at the input of 'fc'"):
        linearize.fold(model, x, latency=False, objective="depth")


def test_no_signal_that_varies_raises_instead_of_passing():
    first = nn.Linear(4, 8)
    nn.init.zeros_(first.weight)  # everything after it is the same for every sample
    model = nn.Sequential(first, LA("relu", 8, -1), nn.Linear(8, 3)).eval()
    with pytest.raises(FoldVerificationError, match="cannot verify"):
        linearize.fold(model, torch.randn(5, 4), latency=False)


def test_identical_samples_and_a_varying_output_still_verify_on_the_output():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), LA("relu", 8, -1), nn.Linear(8, 3)).eval()
    for x in (torch.randn(1, 4).repeat(3, 1), torch.randn(1, 4), torch.randn(6, 4)):
        summary = linearize.fold(model, x, latency=False).linearize_fold_summary
        assert summary.verified_on == "output" and summary.signal_error is None


def test_compress_refuses_to_verify_on_a_zero_output():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    box = linearize.Box(torch.full((3,), -0.5), torch.full((3,), 0.5))
    linearize.compress(model, box, samples=64)  # verifiable: fine
    nn.init.zeros_(model[2].weight)
    nn.init.zeros_(model[2].bias)
    with pytest.raises(FoldVerificationError, match="output is zero"):
        linearize.compress(model, box, samples=64)


class _Keywords(nn.Module):
    """Takes its input as a keyword (as Hugging Face models take a tokenizer's ``BatchEncoding``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), LA("relu", 8, -1))
        self.head = nn.Linear(8, 3)
        nn.init.zeros_(self.head.weight)  # the output is head.bias for every sample: verified before it

    def forward(self, x):
        return self.head(self.body(x))


def test_a_user_dict_input_is_verified_as_a_dict():
    """A ``UserDict`` (a tokenizer's ``BatchEncoding`` is one) is a mapping of keyword arguments: fold
    verifies it as strongly as a ``dict`` (the features before a constant head, an empty batch refused
    naming its tensors), not as one opaque object whose samples cannot differ."""
    from collections import UserDict

    torch.manual_seed(0)
    model = _Keywords().eval()
    x = torch.randn(5, 4)
    for inputs in ({"x": x}, UserDict({"x": x})):
        summary = linearize.fold(model, inputs, latency=False).linearize_fold_summary
        assert summary.verified_on == "input of 'head'", type(inputs).__name__
        assert "same for every sample" in summary.verified_why
        with pytest.raises(ValueError, match=r"example_inputs \{x: Tensor\(0, 4\)\} is an empty batch"):
            linearize.fold(model, type(inputs)({"x": x[:0]}), latency=False)


def _tiny_net() -> nn.Module:
    """A bias-free ReLU net (positively homogeneous), half of its first site linear."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 16, bias=False), nn.ReLU(),
                        nn.Linear(16, 3, bias=False))
    model = linearize.convert(net).eval()
    with torch.no_grad():
        model[1].slope[:8] = 1.0
    return model


@pytest.mark.parametrize("kwargs", [{}, {"atol": 1e-22}, {"dtype": torch.float64}, {"rtol": 1e-2}])
def test_outputs_far_below_1e_12_are_verified_relative_to_their_scale(kwargs):
    """Inputs of scale 1e-15 (SI units) give outputs near 4e-16, ordinary float32 numbers: fold refused them as a
    "zero" output (an absolute floor of 1e-12), whatever atol / dtype / rtol was given. Truth: the model run in
    float64 on fresh inputs, which the folded model must match relative to the output scale."""
    model = _tiny_net()
    x, fresh = torch.randn(16, 8) * 1e-15, torch.randn(32, 8) * 1e-15
    folded = linearize.fold(model, x, latency=False, **kwargs)
    assert folded.linearize_fold_summary.verified_on == "output"
    with torch.no_grad():
        truth = copy.deepcopy(model).double()(fresh.double())
        assert 1e-17 < float(truth.abs().max()) < 1e-14
        torch.testing.assert_close(folded(fresh).double(), truth, rtol=0, atol=1e-5 * float(truth.abs().max()))


def test_a_broken_fold_of_tiny_outputs_is_caught(monkeypatch):
    """At a 1e-15 input scale a 5% error in a merged layer is far below any absolute tolerance: it must still fail
    the relative check."""
    model = _tiny_net()
    perturb(monkeypatch, "0")
    with pytest.raises(FoldVerificationError, match="folded model differs"):
        linearize.fold(model, torch.randn(16, 8) * 1e-15, latency=False)


def test_compress_verifies_tiny_outputs_relative_to_their_scale(monkeypatch):
    """compress refused a box of side 1e-13 as a "zero" output, and its check added an absolute 1e-7, which passed
    any compressed model whose outputs are below about 1e-3. Truth: the model itself on samples of the box, and a
    compressed model broken on purpose, which must be refused."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(2, 16, bias=False), nn.ReLU(), nn.Linear(16, 1, bias=False)).eval()
    box = linearize.Box(torch.zeros(2), torch.full((2,), 1e-13))
    small = linearize.compress(mlp, box, samples=64)
    x = torch.rand(64, 2) * 1e-13
    with torch.no_grad():
        scale = float(mlp(x).abs().max())
        assert scale < 1e-12
        torch.testing.assert_close(small(x), mlp(x), rtol=0, atol=1e-4 * scale)
    import linearize.compression as compression
    original = compression._mlp_part

    def broken(*args, **kwargs):
        layers, stats, folded = original(*args, **kwargs)
        with torch.no_grad():
            layers[0].weight.mul_(1.05)
        return layers, stats, folded

    monkeypatch.setattr(compression, "_mlp_part", broken)
    with pytest.raises(FoldVerificationError, match="not lossless"):
        linearize.compress(mlp, box, samples=64)
