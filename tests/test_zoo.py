"""Models nobody tuned for: every torchvision classification family and 17 timm architectures, converted
with NO example inputs, then checked against independent truths (recipes/reproduce/zoo_table.py's ``check``:
equal to a deep copy of the original at init, equal to the original with its activations replaced by
the identity at slope 1, bit-exact save/load into a fresh copy, fold within its tolerance).

``test_no_skipped_calls`` asserts that the conversion report lists no skipped activation call
(functional ``F.relu`` / ``F.gelu`` / ``torch.sigmoid`` calls are units too).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes" / "reproduce"))
from zoo_table import FOLD_TOL, INIT_TOL, LEFT_OUT, LINEAR_TOL, MODELS, TIMM, TV_NAMES, check  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SKIPPED_CALLS: dict[str, str] = {}

ROWS: dict[str, dict] = {}


def params(marked: dict[str, str]) -> list:
    return [pytest.param(n, id=n, marks=[pytest.mark.xfail(strict=True, reason=marked[n])] if n in marked else [])
            for n in MODELS]


@pytest.mark.parametrize("model_id", params({}))
def test_convert_exact_linear_save_fold(model_id, tmp_path):
    row = ROWS[model_id] = check(model_id, str(tmp_path), {})
    assert row["sites"] > 0
    assert row["init_error"] <= INIT_TOL
    assert row["activations_matter"] > 5 * LINEAR_TOL  # the slope-1 check below can fail
    assert row["linear_error"] <= LINEAR_TOL
    assert row["roundtrip"]
    assert row["fold_error"] <= FOLD_TOL  # fold's own verification tolerance (it raises beyond it)


@pytest.mark.parametrize("model_id", params(SKIPPED_CALLS))
def test_no_skipped_calls(model_id, tmp_path):
    row = ROWS.get(model_id) or check(model_id, str(tmp_path), {})  # run alone: measure here
    assert row["skipped"] == 0


def test_the_zoo_covers_every_torchvision_family():
    """At least 15 timm architectures; every torchvision classification builder is tested or left out for
    a tested variant built by the same module."""
    assert len(TIMM) >= 15
    builder = torchvision.models.get_model_builder
    for name, tested in LEFT_OUT.items():
        assert tested in TV_NAMES and builder(name).__module__ == builder(tested).__module__, name
    assert set(TV_NAMES) | set(LEFT_OUT) == set(torchvision.models.list_models(module=torchvision.models))
