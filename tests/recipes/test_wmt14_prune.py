"""``recipes/wmt14.py --linearize none --prune magnitude|taylor``: structured pruning of the FFN channels at the
step where the late schedule would start, to the FFN cost of the model linearized to ``--target`` and folded.

Tiny synthetic data built in tmp_path (``test_resume.tiny_late_start_args``). Checked against independent truths: the
budget against the folded FFN MACs the linearize run on Multi30k measured; the kept channels against the
magnitudes read from the checkpoint before the prune; a run killed after the prune point (SIGKILL) and one
stopped at it, each resumed, against uninterrupted runs, bit for bit; the Marian FFN behind its functional
dropout against the unpruned model's outputs.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import linearize

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import wmt14  # noqa: E402
from test_resume import (assert_resumed_as_uninterrupted, assert_same_tree, env, kernel,  # noqa: E402,F401
                         kill_and_resume, tiny_late_start_args)

pytestmark = pytest.mark.usefixtures("one_thread")

D, FFN, FFNS = 64, 128, 2  # the tiny preset: one encoder and one decoder layer
TARGET = 0.25  # folded: 2 d^2 + 2 d round(0.25 * 256) = 16,384 MACs per token; pruned: 64 channels per FFN


@pytest.fixture(scope="module")
def prune_args(tmp_path_factory) -> list[str]:
    return tiny_late_start_args(tmp_path_factory.mktemp("mt-data"), TARGET) + ["--linearize", "none"]


@pytest.fixture(scope="module")
def magnitude_runs(prune_args, env, tmp_path_factory):
    """Uninterrupted; killed once a checkpoint of epoch 2 exists (after the prune at the end of epoch 0), resumed."""
    return kill_and_resume("wmt14.py", wmt14.main, prune_args + ["--prune", "magnitude"],
                           tmp_path_factory.mktemp("prune-runs"), env)


def prune_step(run: Path) -> int:
    return json.loads((run / "metrics.json").read_text())["prune"]["step"]


def fc1_rows(ckpt: common.Checkpoint) -> dict[str, int]:
    return {k: v.shape[0] for k, v in ckpt.model.items() if k.endswith("fc1.weight")}


def test_budget_is_the_folded_ffn_cost_the_linearize_run_measured():
    """Multi30k, small preset, target 0.1: the linearized model folded to 707,584 FFN MACs per token
    (recipes/results); pruning keeps 230 of 1,024 channels per FFN, within half a channel of it."""
    measured = json.loads((REPO / "recipes/results/mt30_late_0.1_saliency/metrics.json").read_text())
    keep, budget = wmt14.prune_budget("small", measured["args"]["target"])
    assert budget == measured["fold"]["ffn_macs_per_token"]["after"] == 707_584
    assert keep == 230 and abs(6 * 2 * 256 * keep - budget) <= 6 * 256


def test_pruned_ffns_meet_the_budget_and_load_back(magnitude_runs):
    m = json.loads((magnitude_runs.full / "metrics.json").read_text())
    folded = FFNS * D * D + 2 * D * round(TARGET * FFNS * FFN)  # each FFN folds to its nonlinear channels + d x d
    macs = m["prune"]["ffn_macs_per_token"]
    assert macs == {"before": FFNS * 2 * D * FFN, "after": folded, "linearized_folded_at_target": folded}
    assert m["prune"]["kept_channels"] == {"model.encoder.layers.0.fc1": 64, "model.decoder.layers.0.fc1": 64}
    assert m["prune"]["flops_after"] < m["prune"]["flops_before"]
    assert m["steps"] == m["total_steps"] and 0.0 <= m["bleu"] <= 100.0
    model = wmt14.load_model(magnitude_runs.full / "model")
    assert wmt14.ffn_macs_per_token(model) == folded
    weights = load_file(str(magnitude_runs.full / "model" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_magnitude_keeps_the_largest_channels_and_training_goes_on(magnitude_runs):
    run = magnitude_runs.full
    at = prune_step(run)
    before, after = (common.read_checkpoint(common.checkpoint_dir(run, s)) for s in (at, at + 1))
    assert set(fc1_rows(before).values()) == {FFN} and set(fc1_rows(after).values()) == {64}
    kept = json.loads((run / wmt14.KEPT_FILE).read_text())
    for site, indices in kept.items():
        fc1, fc2 = before.model[f"{site}.weight"].double(), before.model[f"{site[:-1]}2.weight"].double()
        norm = (fc1.square().sum(1) + fc2.square().sum(0)).sqrt()
        assert indices == sorted(norm.topk(64).indices.tolist())
        moved = after.model[f"{site}.weight"] - before.model[f"{site}.weight"][indices]
        assert 0 < moved.abs().max() < 0.1  # one optimizer step on from the kept rows
    trained_on = [c for c in (run / "checkpoints").glob("step_*") if int(c.name[5:]) > at]
    assert len(trained_on) == json.loads((run / "metrics.json").read_text())["total_steps"] - at


def test_killed_after_the_prune_point_resumes_bit_exact(magnitude_runs):
    runs = magnitude_runs
    latest = max(int(p.name[5:]) for p in runs.snapshot.glob("step_*"))
    assert prune_step(runs.full) < latest < runs.total  # the resumed process starts from a pruned checkpoint
    assert set(fc1_rows(common.read_checkpoint(runs.snapshot / f"step_{latest:08d}")).values()) == {64}
    assert_resumed_as_uninterrupted(runs.full, runs.resumed, runs.total, wmt14.KEPT_FILE, (("prune", "kept_indices"),))


def test_stopped_at_the_prune_point_prunes_as_the_uninterrupted_run(prune_args, tmp_path):
    """Taylor importance: the resumed process ranks the channels on the same batches and prunes the same."""
    args = prune_args + ["--prune", "taylor"]
    full = wmt14.main(args + ["--output_dir", str(tmp_path / "full")])
    at = full["prune"]["step"]
    wmt14.main(args + ["--output_dir", str(tmp_path / "part"), "--stop-after", str(at)])
    assert set(fc1_rows(common.read_checkpoint(common.checkpoint_dir(tmp_path / "part", at))).values()) == {FFN}
    wmt14.main(args + ["--output_dir", str(tmp_path / "part"), "--resume_from_checkpoint", "latest"])
    assert (tmp_path / "full" / wmt14.KEPT_FILE).read_text() == (tmp_path / "part" / wmt14.KEPT_FILE).read_text()
    assert_same_tree(load_file(str(tmp_path / "full" / "model" / "model.safetensors")),
                     load_file(str(tmp_path / "part" / "model" / "model.safetensors")), "final weights")


def test_latest_before_the_first_checkpoint_prunes_as_the_uninterrupted_run(prune_args, tmp_path, capsys):
    """A --prune run killed in its first step (no checkpoint yet), started again with the same command and
    ``--resume_from_checkpoint latest`` (a requeue script's form): it starts at step 0, saying so, prunes the
    same channels and ends with the uninterrupted run's weights. Observed before: FileNotFoundError."""
    args = prune_args + ["--prune", "magnitude"]
    wmt14.main(args + ["--output_dir", str(tmp_path / "full")])
    (tmp_path / "part" / "checkpoints").mkdir(parents=True)  # what a kill in the first step leaves
    wmt14.main(args + ["--output_dir", str(tmp_path / "part"), "--resume_from_checkpoint", "latest"])
    assert f"no checkpoint under {tmp_path / 'part' / 'checkpoints'} yet: starting at step 0" in capsys.readouterr().out
    assert (tmp_path / "full" / wmt14.KEPT_FILE).read_text() == (tmp_path / "part" / wmt14.KEPT_FILE).read_text()
    assert_same_tree(load_file(str(tmp_path / "full" / "model" / "model.safetensors")),
                     load_file(str(tmp_path / "part" / "model" / "model.safetensors")), "final weights")


def test_marian_ffns_are_prune_sites_behind_their_functional_dropout():
    """Marian calls ``F.dropout`` between the activation and ``fc2`` (the input itself in eval mode): the FFNs
    are still sites. Channels whose ``fc2`` columns are zero are removed with no change of the output."""
    torch.manual_seed(0)
    model = wmt14.build_model("tiny", 50).eval()
    for layer in (model.model.encoder.layers[0], model.model.decoder.layers[0]):
        with torch.no_grad():
            layer.fc2.weight[:, 40:] = 0
            layer.fc1.weight[:40] *= 10  # the largest magnitudes: these 40 are kept
    batch = wmt14.collate([([5, 6, 7, 1], [8, 9, 1]), ([5, 6, 1], [8, 9, 10, 11, 1])])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        expected = model(**inputs).logits
    linearize.prune(model, keep=40, example_inputs=inputs)
    assert sorted(model.linearize_prune_summary.sites) == ["model.decoder.layers.0.fc1", "model.encoder.layers.0.fc1"]
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("flags, message", [
    (["--prune", "magnitude"], "add --linearize none"),
    (["--prune", "taylor", "--linearize", "dgn", "--schedule", "none"], "add --linearize none"),
    (["--prune", "magnitude", "--linearize", "none", "--fsdp"], "drop --fsdp"),
    (["--prune", "magnitude", "--linearize", "none", "--target", "0"], r"--target 0.0: .* \(0, 1\]"),
    (["--prune", "magnitude", "--linearize", "none", "--model-size", "tiny", "--target", "1"], "1 to 128"),
    (["--prune", "magnitude", "--linearize", "none", "--late-start", "-1"], "--late-start -1.0"),
])
def test_bad_prune_flags_name_the_fix(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        wmt14.parse_args(["--output_dir", str(tmp_path), *flags])
    assert re.search(message, capsys.readouterr().err)


def test_linearize_only_flags_are_refused_with_prune(tmp_path):
    for extra in (["--select", "slope"], ["--freeze"], ["--schedule", "late"]):
        with pytest.raises(ValueError, match=r"--linearize none|drop"):
            wmt14.parse_args(["--output_dir", str(tmp_path), "--prune", "magnitude", "--linearize", "none", *extra])


def test_prune_past_the_last_step_is_refused(prune_args, tmp_path):
    with pytest.raises(ValueError, match="prunes at step 500, but the run has"):
        wmt14.main(prune_args + ["--prune", "magnitude", "--late-start", "500", "--output_dir", str(tmp_path)])
