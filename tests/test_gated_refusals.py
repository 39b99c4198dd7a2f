"""Functions that work on PReLU units (fold, freeze, average_path_length) refuse a gated (DGN /
DLGN) network up front, naming its mode and what to use instead."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

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

