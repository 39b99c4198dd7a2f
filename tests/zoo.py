"""The shared zoo of small models for the tests: each entry builds a fresh model (same weights every
call) and its example inputs.

``ZOO`` holds an MLP, a CNN with BatchNorm, torchvision's ResNet-18 at 32x32, timm's ResNet-10t, tiny
BERT and GPT-2 (two layers, hidden 16) and a model whose activations are functional ``F.relu`` /
``F.gelu`` calls in ``forward``. Entries needing an optional package (timm, transformers) skip with
the reason when it is missing (:func:`build`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn


def randomize_batchnorm(model: nn.Module, seed: int = 1) -> nn.Module:
    """Non-trivial eval statistics and affine parameters for every BatchNorm, so that a wrong fold or
    a BatchNorm left in the wrong mode cannot pass."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.2)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.randn(n, generator=g) * 0.2)
    return model


def random_slopes(model: nn.Module, seed: int = 0) -> None:
    """Every unit's slopes drawn uniformly from [0, 1) (a generator of its own: the global seed stays)."""
    import linearize

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.copy_(torch.rand(unit.slope.shape, generator=g))


def tiny_bert() -> nn.Module:
    """``BertModel`` of 2 layers, hidden 16, vocabulary 60 (GELU FFNs)."""
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32, max_position_embeddings=32))


def tiny_gpt2() -> nn.Module:
    """``GPT2LMHeadModel`` of 2 layers, hidden 16, vocabulary 60 (``gelu_new`` FFNs)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=60, n_embd=16, n_layer=2, n_head=2, n_positions=32))


class FunctionalNet(nn.Module):
    """Activations only as functional calls in ``forward``: ``F.relu`` after a conv + BatchNorm,
    ``F.gelu`` and ``F.relu`` in the head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 12)
        self.out = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.out(F.relu(self.fc2(F.gelu(self.fc1(h)))))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


def _resnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(weights=None, num_classes=10)


def _timm_resnet10t() -> nn.Module:
    import timm

    return timm.create_model("resnet10t", pretrained=False, num_classes=10)


def _ids(generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 60, (4, 9), generator=generator)}


@dataclass(frozen=True)
class Entry:
    """One zoo model: ``make()`` builds it (seeded: the same weights every call), ``inputs()`` its example
    inputs (a tensor, or a dict of keyword inputs), ``requires`` the optional package it needs, and
    ``gated`` whether ``convert(mode="dgn")`` gates it (only ReLU-family *modules* are gated)."""

    name: str
    make: Callable[[], nn.Module]
    make_inputs: Callable[[torch.Generator], Any]
    requires: str | None = None
    gated: bool = True

    def build(self) -> nn.Module:
        """A fresh model in eval mode (BatchNorm with random statistics); skips if ``requires`` is missing."""
        if self.requires is not None and importlib.util.find_spec(self.requires) is None:
            pytest.skip(f"{self.name} needs {self.requires}, which is not installed")
        torch.manual_seed(0)
        return randomize_batchnorm(self.make()).eval()

    def inputs(self, seed: int = 0) -> Any:
        """The example inputs (4 samples), the same for the same ``seed``."""
        return self.make_inputs(torch.Generator().manual_seed(seed))


ZOO: dict[str, Entry] = {e.name: e for e in [
    Entry("mlp", _mlp, lambda g: torch.randn(4, 8, generator=g)),
    Entry("cnn_bn", _cnn, lambda g: torch.randn(4, 3, 8, 8, generator=g)),
    Entry("resnet18", _resnet18, lambda g: torch.randn(4, 3, 32, 32, generator=g)),
    Entry("timm_resnet10t", _timm_resnet10t, lambda g: torch.randn(4, 3, 32, 32, generator=g), requires="timm"),
    Entry("bert", tiny_bert, _ids, requires="transformers", gated=False),
    Entry("gpt2", tiny_gpt2, _ids, requires="transformers", gated=False),
    Entry("functional", FunctionalNet, lambda g: torch.randn(4, 3, 8, 8, generator=g), gated=False),
]}


def call(model: nn.Module, inputs: Any) -> torch.Tensor:
    """The model's main output tensor (logits, else the last hidden state) on ``inputs``, without grad."""
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return getattr(out, key)
    return out[0]


def to_double(inputs: Any) -> Any:
    """Floating tensors of ``inputs`` in float64 (token ids stay integers)."""
    if isinstance(inputs, dict):
        return {k: to_double(v) for k, v in inputs.items()}
    return inputs.double() if inputs.is_floating_point() else inputs


def save_folded_functional(directory) -> tuple[nn.Module, torch.Tensor]:
    """``FunctionalNet`` converted, half of every unit's channels linear (odd ones), frozen, folded and
    written with ``linearize.save_folded`` into ``directory``; returns the converted model (the truth a
    load is compared with) and its probe input."""
    import linearize

    torch.manual_seed(0)
    model = FunctionalNet().eval()
    x = torch.randn(4, 3, 8, 8)
    linearize.convert(model, example_inputs=x)
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.copy_((torch.arange(unit.num_channels) % 2).float())
    linearize.freeze(model)
    linearize.save_folded(linearize.fold(model, x), directory)
    return model, x
