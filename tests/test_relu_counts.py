"""linearize.measures.count_relus: activation elements per sample, against counts made without linearize."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

import linearize
from linearize.measures import count_relus


def _plain_count(model: nn.Module, x: torch.Tensor) -> int:
    """ReLU elements per sample of the unconverted model: every call of every ReLU module, by forward hooks."""
    seen = []
    handles = [m.register_forward_hook(lambda m, a, out: seen.append(out.numel() // x.shape[0]))
               for m in model.modules() if isinstance(m, nn.ReLU)]
    with torch.no_grad():
        model.eval()(x)
    for h in handles:
        h.remove()
    return sum(seen)


def test_resnet18_counts_every_call_of_its_reused_relus():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    expected = _plain_count(model, x)
    linearize.convert(model, example_inputs=x)
    counts = count_relus(model, x)
    assert counts["total"] == expected == counts["nonlinear"]
    assert counts["linear"] == 0


def test_a_resnet20_has_the_published_188416_relus():
    blocks = []
    for width, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(3):
            blocks += [nn.Conv2d(width if i else max(16, width // 2), width, 3, stride if i == 0 else 1, 1), nn.ReLU(),
                       nn.Conv2d(width, width, 3, 1, 1), nn.ReLU()]
    model = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.ReLU(), *blocks)  # ResNet-20's maps, without the shortcuts
    counts = count_relus(linearize.convert(model), torch.zeros(1, 3, 32, 32))
    assert counts["total"] == 188_416  # the count SNL and AutoReP report for ResNet-20 on CIFAR


def test_linear_channels_leave_the_nonlinear_count_by_their_map_size():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.GELU())
    linearize.convert(model)
    (_, first), (_, second) = linearize.units(model)
    with torch.no_grad():
        first.slope[1] = 1.0
        second.slope[[0, 2, 5]] = 0.9995
    counts = count_relus(model, torch.randn(3, 3, 8, 8))
    assert counts["total"] == 4 * 64 + 6 * 16
    assert counts["nonlinear"] == 3 * 64 + 6 * 16  # 0.9995 is below 1: nonlinear at tol 0
    assert count_relus(model, torch.randn(3, 3, 8, 8), tol=1e-3)["nonlinear"] == 3 * 64 + 3 * 16
    assert counts["sites"]["1"]["positions"] == 64 and counts["sites"]["3"]["positions"] == 16


def test_sequences_count_one_element_per_token_and_channel():
    model = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
    x = torch.randn(2, 5, 8)
    linearize.convert(model, example_inputs=x)
    counts = count_relus(model, x)
    assert counts["total"] == 5 * 12
    assert counts["sites"]["1"]["positions"] == 5


def test_refusals_name_the_input_and_the_fix():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="linearize.convert"):
        count_relus(model, torch.zeros(1, 4))  # not converted
    linearize.convert(model)
    with pytest.raises(ValueError, match="no sample"):
        count_relus(model, torch.zeros(0, 4))
    branchy = nn.ModuleDict({"a": nn.Sequential(nn.Linear(4, 4), nn.ReLU())})
    branchy.forward = lambda x: x  # its unit is never called
    linearize.convert(branchy["a"])
    with pytest.raises(ValueError, match="not called"):
        count_relus(branchy, torch.zeros(2, 4))


def test_a_gated_network_is_refused_naming_its_mode():
    gated = linearize.convert(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), mode="dgn")
    with pytest.raises(ValueError, match="count_relus.*DGN"):
        count_relus(gated, torch.zeros(2, 4))
