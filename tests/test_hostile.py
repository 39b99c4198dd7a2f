"""Hostile tests of the reliability claims of issue 16: checkpoint pruning and tampered checkpoint
state (recipes/common.py), atomic final saves and validated loads of recipes/cifar.py, the decode
cache, metrics.json. Small models and synthetic files only; each test states its own truth."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))

import common  # noqa: E402

import linearize  # noqa: E402


def tiny_run(out: Path, keep: int) -> common.Run:
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), linearize.LinearizableActivation("relu", 4, -1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return common.Run(Accelerator(cpu=True), argparse.Namespace(keep_checkpoints=keep), model, optimizer,
                      scheduler, None, out, "f", "test")


def steps_of(out: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*"))


# ----------------------------------------------------------------------------- checkpoint pruning


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path):
    """A run resumed from an earlier checkpoint (here: steps 20 and 30 are left from before) writes
    step 15 with --keep_checkpoints 2: step 15 must survive, and with it the step before."""
    run = tiny_run(tmp_path, keep=5)
    for step in (10, 20, 30):
        common.save_checkpoint(run, step)
    run.args.keep_checkpoints = 2
    common.save_checkpoint(run, 15)
    assert 15 in steps_of(tmp_path) and 10 in steps_of(tmp_path)
    common.save_checkpoint(run, 16)
    assert {15, 16} <= set(steps_of(tmp_path)) and 10 not in steps_of(tmp_path)
    run.args.keep_checkpoints = 1
    common.save_checkpoint(run, 17)
    assert 17 in steps_of(tmp_path) and not {15, 16} & set(steps_of(tmp_path))


def test_rewrite_of_a_step_killed_between_the_renames_keeps_it(tmp_path, monkeypatch):
    """--keep_checkpoints 1, the final step written again (a finished run resumed): interrupted after
    the old folder was removed and before the new one was renamed into place, the next start must
    still find an intact checkpoint of that step."""
    run = tiny_run(tmp_path, keep=1)
    common.save_checkpoint(run, 3)
    real = Path.rename

    def killed(self, target):
        if self.name.startswith(common.TMP_PREFIX) and "-removed-" not in self.name:
            raise KeyboardInterrupt  # stands for SIGKILL at this point
        return real(self, target)

    monkeypatch.setattr(Path, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        common.save_checkpoint(run, 3)
    monkeypatch.setattr(Path, "rename", real)
    common.remove_partial_checkpoints(tmp_path)
    ckpt, skipped = common.find_checkpoint("latest", tmp_path)
    assert ckpt.step == 3 and not skipped
    assert not list((tmp_path / "checkpoints").glob(".*"))


# ----------------------------------------------------------------------------- tampered state JSON


def _mutate_files(value):
    def f(s):
        s["files"] = value(s["files"])
        return s
    return f


TAMPER = {
    "files is a list": _mutate_files(lambda f: []),
    "files entry a string": _mutate_files(lambda f: {**f, common.MODEL_FILE: "x"}),
    "files entry lacks size": _mutate_files(lambda f: {**f, common.MODEL_FILE: {"sha256": "0" * 64}}),
    "files empty (nothing verified)": _mutate_files(lambda f: {}),
    "files names a path outside": _mutate_files(lambda f: {"../x": f[common.MODEL_FILE]}),
    "no scheduler": lambda s: {k: v for k, v in s.items() if k != "scheduler"},
    "scheduler a string": lambda s: {**s, "scheduler": "x"},
    "step negative": lambda s: {**s, "step": -5},
    "step a float": lambda s: {**s, "step": 2.5},
    "step a bool": lambda s: {**s, "step": True},
    "step not the folder's": lambda s: {**s, "step": 7},
}


@pytest.mark.parametrize("tamper", list(TAMPER))
def test_latest_skips_a_tampered_state_json(tmp_path, tamper):
    """The newest checkpoint's recipe_state.json is edited: `latest` must skip it with a
    CheckpointError reason and resume from the previous step (never crash, never use it)."""
    run = tiny_run(tmp_path, keep=5)
    common.save_checkpoint(run, 1)
    newest = common.save_checkpoint(run, 2)
    state = json.loads((newest / common.STATE_FILE).read_text())
    (newest / common.STATE_FILE).write_text(json.dumps(TAMPER[tamper](state)))
    ckpt, skipped = common.find_checkpoint("latest", tmp_path)
    assert ckpt.step == 1
    assert len(skipped) == 1 and "step_00000002" in skipped[0]
    with pytest.raises(common.CheckpointError):
        common.read_checkpoint(newest)
