"""fold keeps the names of the Sequential children it keeps, and leaves alone a Sequential whose
children another forward reads by name (timm MetaFormer heads): checked against hand-built
references in float64."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import linearize
from linearize.unit import LinearizableActivation as LA


class _NamedHead(nn.Module):
    """Like timm ``MetaFormer.forward_head``: the forward reads ``self.head.<name>``, never ``self.head(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), LA("relu", 8, -1))
        self.head = nn.Sequential(collections.OrderedDict(
            norm=nn.LayerNorm(8), drop=nn.Dropout(0.0), fc=nn.Identity(), out=nn.Linear(8, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head.out(self.head.fc(self.head.drop(self.head.norm(self.body(x)))))


def _slopes(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.fill_(value)


def test_a_head_read_by_name_is_kept_and_the_folded_model_matches_the_formula():
    torch.manual_seed(0)
    model = _NamedHead().double().eval()
    _slopes(model, 0.25)
    x = torch.randn(16, 4, dtype=torch.float64)
    folded = linearize.fold(model, x, latency=False)
    lin, norm, out = model.body[0], model.head.norm, model.head.out
    h = F.leaky_relu(x @ lin.weight.T + lin.bias, 0.25)
    ref = F.layer_norm(h, (8,), norm.weight, norm.bias, norm.eps) @ out.weight.T + out.bias
    torch.testing.assert_close(folded(x), ref.detach(), atol=1e-12, rtol=1e-12)
    assert list(dict(folded.head.named_children())) == ["norm", "drop", "fc", "out"]
    assert any("head.norm is called by name" in s for s in folded.linearize_fold_summary.skipped)


class _NamedMlp(nn.Module):
    """A forward that calls the layers of a linear MLP one by one, by name: merging them would break it."""

    def __init__(self) -> None:
        super().__init__()
        layers = collections.OrderedDict(fc1=nn.Linear(4, 6), act=LA("relu", 6, -1), fc2=nn.Linear(6, 2))
        self.mlp = nn.Sequential(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.fc2(self.mlp.act(self.mlp.fc1(x)))


def test_layers_read_by_name_are_not_merged_away():
    torch.manual_seed(0)
    model = _NamedMlp().double().eval()
    _slopes(model, 1.0)  # fully linear: a chain would merge fc1 o fc2 and drop the unit
    x = torch.randn(8, 4, dtype=torch.float64)
    folded = linearize.fold(model, x, latency=False)
    fc1, fc2 = model.mlp.fc1, model.mlp.fc2
    ref = (x @ fc1.weight.T + fc1.bias) @ fc2.weight.T + fc2.bias
    torch.testing.assert_close(folded(x), ref.detach(), atol=1e-12, rtol=1e-12)
    assert type(folded.mlp.fc1) is nn.Linear and type(folded.mlp.fc2) is nn.Linear


def test_a_folded_chain_keeps_its_names_and_nesting_and_a_merge_takes_the_first_name():
    torch.manual_seed(0)
    inner = nn.Sequential(collections.OrderedDict(fc1=nn.Linear(4, 6), act=LA("relu", 6, -1)))
    model = nn.Sequential(collections.OrderedDict(
        block=inner, fc2=nn.Linear(6, 5), act=LA("relu", 5, -1), out=nn.Linear(5, 2))).double().eval()
    with torch.no_grad():
        inner.act.slope.fill_(1.0)  # fc1 o fc2 merge into one Linear at block.fc1
        model.act.slope.fill_(0.5)
    x = torch.randn(8, 4, dtype=torch.float64)
    folded = linearize.fold(model, x, latency=False)
    w1, b1, w2, b2 = inner.fc1.weight, inner.fc1.bias, model.fc2.weight, model.fc2.bias
    assert list(dict(folded.named_children())) == ["block", "act", "out"]
    assert list(dict(folded.block.named_children())) == ["fc1"]
    torch.testing.assert_close(folded.block.fc1.weight, (w2 @ w1).detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(folded.block.fc1.bias, (w2 @ b1 + b2).detach(), atol=1e-12, rtol=1e-12)
    ref = F.leaky_relu((x @ w1.T + b1) @ w2.T + b2, 0.5) @ model.out.weight.T + model.out.bias
    torch.testing.assert_close(folded(x), ref.detach(), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["poolformer_s12", "caformer_s18"])
def test_timm_metaformer_without_classifier_folds_and_matches_the_unfolded_model(name):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=0).eval()
    linearize.convert(model)
    x = torch.randn(1, 3, 32, 32)
    folded = linearize.fold(model, x, latency=False)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), atol=1e-4, rtol=1e-4)
    assert isinstance(folded.head.fc, nn.Identity)
