"""The recipes' cost-target flags are refused at parse time when they cannot work, naming the real fix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
if str(RECIPES) not in sys.path:
    sys.path.insert(0, str(RECIPES))


def test_wmt14_cost_target_error_names_the_real_fix(tmp_path, capsys):
    import wmt14

    with pytest.raises((SystemExit, ValueError)) as err:
        wmt14.parse_args(["--output_dir", str(tmp_path), "--target-flops", "0.5"])
    message = str(err.value) + capsys.readouterr().err.strip().splitlines()[-1]  # the error, not the usage
    assert "granularity" not in message and "--target" in message


@pytest.mark.parametrize("extra", [["--schedule", "none"], ["--linearize", "none"]])
def test_cifar_cost_target_without_pressure_is_refused(tmp_path, extra):
    import cifar

    with pytest.raises((SystemExit, ValueError)):
        cifar.parse_args(["--output_dir", str(tmp_path), "--target-flops", "0.5", "--granularity", "site"] + extra)
