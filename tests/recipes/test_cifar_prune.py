"""``recipes/cifar.py --linearize none --prune magnitude|taylor --target-latency R --init-from RUN/model``: the trained
network's sites pruned at step 0 to the largest keep fraction whose BN-folded CPU latency is at most R of the
original's, then trained on.

Tiny synthetic data built in tmp_path (``test_resume.write_images``), ResNet-20 at 8x8. Wall-clock latency on a
shared CPU is noise at this size, so the runs here price each candidate by its folded FLOPs over the original's
(:func:`flops_ratio`, also in the killed subprocess): the search is then checked against independent prunes of
the neighbouring fractions, and a run killed after the prune (SIGKILL), resumed, against the uninterrupted run,
bit for bit. The saved model is checked by loading it the way the speed analysis does and re-evaluating it.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import linearize

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cifar  # noqa: E402
import common  # noqa: E402
from test_resume import (CIFAR_CLASSES, assert_resumed_as_uninterrupted, env, kernel,  # noqa: E402,F401
                         kill_and_resume, write_images)

pytestmark = pytest.mark.usefixtures("one_thread")

TARGET = 0.6


def flops_ratio(original: torch.nn.Module, candidate: torch.nn.Module, image: torch.Tensor) -> float:
    """The FLOPs of ``candidate`` over ``original`` on ``image``: a deterministic stand-in for the latency ratio."""
    return linearize.count_flops(candidate, image) / linearize.count_flops(original, image)


WRAPPER = f"""import sys
sys.path.insert(0, {str(REPO / 'recipes')!r})
import cifar
import linearize
cifar.latency_ratio = lambda a, b, x: linearize.count_flops(b, x) / linearize.count_flops(a, x)
cifar.main()
"""


@pytest.fixture(scope="module")
def data_args(tmp_path_factory) -> list[str]:
    data = write_images(tmp_path_factory.mktemp("cifar-data"),
                        {"train": {c: 16 for c in CIFAR_CLASSES}, "test": {c: 4 for c in CIFAR_CLASSES}})
    return ["--data-dir", str(data), "--cache-dir", str(tmp_path_factory.mktemp("cifar-cache")), "--image-size", "8",
            "--arch", "resnet20", "--batch-size", "8", "--eval-batch-size", "12", "--lr", "0.05"]


@pytest.fixture(scope="module")
def baseline(data_args, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("baseline")
    cifar.main(data_args + ["--linearize", "none", "--epochs", "1", "--output_dir", str(out)])
    return out / "model"


@pytest.fixture(scope="module")
def prune_args(data_args, baseline) -> list[str]:
    return data_args + ["--linearize", "none", "--prune", "taylor", "--target-latency", str(TARGET), "--init-from",
                        str(baseline), "--distill", "0.5", "--epochs", "4", "--checkpointing_steps", "1",
                        "--keep_checkpoints", "3", "--log_every", "1"]


@pytest.fixture(scope="module")
def prune_runs(prune_args, env, tmp_path_factory):
    """Uninterrupted; killed once a checkpoint of epoch 2 exists (long after the prune at step 0), resumed;
    ``searched``: the candidates each in-process run priced (the resumed one prices none)."""
    root = tmp_path_factory.mktemp("prune-runs")
    (root / "wrapper.py").write_text(WRAPPER)
    searched: list[int] = []

    def main(argv: list[str]) -> dict:
        calls = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cifar, "latency_ratio", lambda *a: calls.append(1) or flops_ratio(*a))
            out = cifar.main(argv)
        searched.append(len(calls))
        return out

    runs = kill_and_resume(str(root / "wrapper.py"), main, prune_args, root, env)
    runs.searched = searched
    return runs


def test_the_search_keeps_the_largest_fraction_under_the_budget(prune_runs, baseline, data_args):
    """Against independent prunes of the original: the kept fraction is under the budget, the next one of the
    search's grid (1/128 more) is over it; every site keeps that fraction of its channels."""
    m = json.loads((prune_runs.full / "metrics.json").read_text())["prune"]
    kept = common.read_kept(prune_runs.full)
    assert m["latency_ratio"] <= TARGET and m["keep"] == kept["keep"] and m["importance"] == "taylor"
    assert m["kept_indices"] == str(prune_runs.full / common.KEPT_FILE)
    assert len(kept["tried"]) == cifar.PRUNE_SEARCH_STEPS and kept["keep"] * 2 ** cifar.PRUNE_SEARCH_STEPS % 1 == 0
    original = cifar.load_model(baseline)
    image = torch.randn(1, 3, 8, 8)

    def ratio(fraction: float) -> float:
        pruned = linearize.prune(copy.deepcopy(original), fraction, example_inputs=image)
        return flops_ratio(cifar.bn_folded(original, image), cifar.bn_folded(pruned, image), image)

    assert ratio(kept["keep"]) == pytest.approx(m["latency_ratio"]) and ratio(kept["keep"] + 2 ** -7) > TARGET
    sizes = {n: original.get_submodule(n).out_channels for n in kept["sites"]}
    assert sorted(sizes) == sorted(f"layer{i}.{b}.conv1" for i in (1, 2, 3) for b in range(3))
    assert all(len(kept["sites"][n]) == max(1, round(kept["keep"] * c)) for n, c in sizes.items())


def test_kept_channels_rank_as_prune_does(baseline):
    model, image = cifar.load_model(baseline), torch.randn(4, 3, 8, 8)
    scored = linearize.prune(copy.deepcopy(model), 1.0, "taylor", data=image).linearize_prune_summary.sites
    for fraction in (0.3, 0.5):
        ranked = linearize.prune(copy.deepcopy(model), fraction, "taylor", data=image).linearize_prune_summary.sites
        assert cifar.kept_channels(scored, fraction) == {n: s.kept.tolist() for n, s in ranked.items()}


def test_killed_after_the_prune_resumes_bit_exact_from_the_kept_channels(prune_runs):
    runs = prune_runs
    assert runs.searched[0] == cifar.PRUNE_SEARCH_STEPS and runs.searched[1] == 0  # rebuilt, not searched again
    snapshot = common.read_checkpoint(max(runs.snapshot.glob("step_*")))
    kept = common.read_kept(runs.full)
    assert all(snapshot.model[f"{n}.weight"].shape[0] == len(k) for n, k in kept["sites"].items())
    assert_resumed_as_uninterrupted(runs.full, runs.resumed, runs.total, common.KEPT_FILE, (("prune", "kept_indices"),))


def test_the_saved_model_loads_as_the_speed_analysis_loads_it_and_evaluates_as_trained(prune_runs):
    """``reproduce.measure.run_model`` (what the speed analysis folds and times) gives the pruned model: its
    test accuracy is the run's, and folded (BatchNorm only) it gives the same outputs."""
    from reproduce import full as F
    from reproduce import measure as M

    run = prune_runs.full
    model = M.run_model(run)
    assert (run / "model" / common.KEPT_FILE).read_text() == (run / common.KEPT_FILE).read_text()
    x, y = M.cifar_inputs(run, None, 100)
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).double().mean().item()
    metrics = json.loads((run / "metrics.json").read_text())
    assert accuracy == pytest.approx(metrics["test_accuracy"]) and len(y) == metrics["test_images"]
    folded = cifar.bn_folded(model, x)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), atol=1e-4, rtol=1e-4)
    runs = {run.name: {"model_digest": "d", "schedule": "late"}}
    lat = F.measure_latency(run.parent, [run.name], runs, None, {}, 3, False, [])
    assert lat["ms"][f"{run.name}/folded"]["b1"] > 0


def test_a_pruned_model_is_no_init_from_and_a_damaged_kept_file_is_named(prune_runs, data_args, tmp_path):
    with pytest.raises(ValueError, match="holds a pruned"):
        cifar.trained_weights(prune_runs.full / "model", "resnet20", list(CIFAR_CLASSES))
    import shutil

    damaged = shutil.copytree(prune_runs.full / "model", tmp_path / "model")
    kept = json.loads((damaged / common.KEPT_FILE).read_text())
    kept["sites"]["layer1.0.conv1"] = [99]
    (damaged / common.KEPT_FILE).write_text(json.dumps(kept))
    with pytest.raises(linearize.LoadError, match=common.KEPT_FILE):
        cifar.load_model(damaged)


@pytest.mark.parametrize("flags, message", [
    (["--prune", "taylor", "--target-latency", "0.7", "--init-from", "m"], "add --linearize none"),
    (["--prune", "taylor", "--linearize", "none", "--target-latency", "0.7"], "give it with --init-from"),
    (["--prune", "taylor", "--linearize", "none", "--init-from", "m"], r"add --target-latency R with R in \(0, 1\)"),
    (["--prune", "magnitude", "--linearize", "none", "--init-from", "m", "--target-latency", "1"], r"got 1.0"),
])
def test_bad_prune_flags_name_the_fix(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cifar.parse_args(["--output_dir", str(tmp_path), *flags])
    assert re.search(message, capsys.readouterr().err)


def test_linearize_only_flags_are_refused_with_prune(tmp_path):
    flags = ["--output_dir", str(tmp_path), "--prune", "taylor", "--linearize", "none", "--init-from", "m",
             "--target-latency", "0.7"]
    args = cifar.parse_args(flags)
    assert (args.prune, args.target_latency, args.target) == ("taylor", 0.7, None)
    for extra in (["--granularity", "block"], ["--freeze"], ["--schedule", "late"]):
        with pytest.raises(ValueError, match=r"--linearize none|drop"):
            cifar.parse_args(flags + extra)
