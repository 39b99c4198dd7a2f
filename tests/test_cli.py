"""The console script: --help lists the subcommands, inspect prints the conversion plan."""

import subprocess
import sys

import pytest

from linearize.cli import main


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "linearize.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("demo", "inspect", "report"):
        assert command in out.stdout


def test_inspect_prints_the_sites_of_a_torchvision_model(capsys):
    assert main(["inspect", "resnet18"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("17 sites, 3904 channels converted")  # 64 + 4 * (64 + 128 + 256 + 512)
    assert "layer4.1.relu.calls.1" in out


def test_inspect_rejects_an_unknown_model():
    with pytest.raises(ValueError, match="neither a Hugging Face model directory"):
        main(["inspect", "no_such_model"])
