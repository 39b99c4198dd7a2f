"""Functions that work on PReLU units (fold, freeze, average_path_length) refuse a gated (DGN /
DLGN) network up front, naming its mode and what to use instead; gradient checkpointing inside a gated
split is refused in backward, naming checkpointing and how to turn it off."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import linearize


def _gated(mode: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(16, 4)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    return linearize.convert(model, mode=mode, example_inputs=x).eval(), x


@pytest.mark.parametrize("mode", ["dgn", "dlgn"])
def test_fold_refuses_a_gated_network_naming_its_mode(mode):
    gated, x = _gated(mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "never converted" warning first
        with pytest.raises(ValueError, match=rf"fold works on PReLU units.*{mode.upper()} gated network.*"
                                             rf"mode='{mode}'.*mode='prelu'"):
            linearize.fold(gated, x, latency=False)


@pytest.mark.parametrize("name", ["freeze", "average_path_length"])
def test_freeze_and_path_length_name_the_gated_mode_not_a_missing_convert(name):
    gated, x = _gated("dlgn")
    call = {"freeze": lambda: linearize.freeze(gated, data=x),
            "average_path_length": lambda: linearize.measures.average_path_length(gated, x)}[name]
    with pytest.raises(ValueError, match=rf"{name} works on PReLU units.*DLGN gated network") as info:
        call()
    assert "convert(model) first" not in str(info.value)



class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(8, 8), nn.ReLU()

    def forward(self, x):
        return self.act(self.lin(x)) + x


class _Checkpointed(nn.Module):
    """Two residual blocks, each under ``torch.utils.checkpoint`` in training when ``reentrant`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.b1, self.b2, self.out = nn.Linear(4, 8), _Block(), _Block(), nn.Linear(8, 2)
        self.reentrant: bool | None = None

    def forward(self, x):
        h = self.inp(x)
        for block in (self.b1, self.b2):
            use = self.reentrant is not None and self.training
            h = checkpoint(block, h, use_reentrant=self.reentrant) if use else block(h)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_in_a_gated_split_names_checkpointing_not_the_value_network(reentrant):
    torch.manual_seed(0)
    x = torch.randn(16, 4, requires_grad=True)
    gated = linearize.convert(_Checkpointed(), mode="dgn", example_inputs=x).train()
    gated.value.reentrant = gated.feature.reentrant = reentrant
    with pytest.raises(RuntimeError, match=r"gradient checkpointing.*gated\.value\.gradient_checkpointing_disable") \
            as info:
        gated(x).sum().backward()
    assert "not its .value network" not in str(info.value)
    gated.value.reentrant = gated.feature.reentrant = None  # the fix it names: no checkpointing
    gated(x).sum().backward()
    assert gated.value.b2.lin.weight.grad is not None


def test_hugging_face_gradient_checkpointing_in_a_gated_split_is_refused_in_backward():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=32, hidden_act="relu", num_labels=3)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    gated = linearize.convert(BertForSequenceClassification(config), mode="dgn",
                              example_inputs={"input_ids": ids}).train()
    for net in (gated.value, gated.feature):
        net.activation_checkpointing_enable()  # gradient_checkpointing_enable before v5
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        gated(input_ids=ids).logits.sum().backward()
    for net in (gated.value, gated.feature):
        net.activation_checkpointing_disable()
    gated(input_ids=ids).logits.sum().backward()
