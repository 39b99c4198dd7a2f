"""``--max-steps`` defines a recipe run's length (as HF's ``max_steps``): the schedules span the steps
actually trained, so a short run reaches its target; ``--stop-after`` interrupts without changing them.

Before, ``--max-steps 12`` of a 120-step run stopped at step 12 with the sparsity ramp planned over 120
steps: nonlinear fraction 1.0, nothing to fold.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from test_resume import CIFAR_CLASSES, write_images, write_pairs  # the recipes' fake data (also puts recipes/ on sys.path)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """The PyTorch-ops path of the units (no kernel build here) and one thread: same bits run to run."""
    import linearize.kernels as kernels

    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    monkeypatch.setattr(kernels, "_state", dict(kernels._state))  # the "off" stays in this test
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cifar_args(tmp_path_factory) -> list[str]:
    """3 classes x 16 images, batch 8: 6 steps per epoch; 20 epochs would be 120 steps."""
    data = write_images(tmp_path_factory.mktemp("cifar-data"),
                        {"train": {c: 16 for c in CIFAR_CLASSES}, "test": {c: 4 for c in CIFAR_CLASSES}})
    return ["--data-dir", str(data), "--cache-dir", str(tmp_path_factory.mktemp("cifar-cache")), "--image-size", "8",
            "--arch", "resnet20", "--batch-size", "8", "--eval-batch-size", "12", "--epochs", "20", "--lr", "0.05",
            "--schedule", "late", "--late-start", "0.25", "--ramp-end", "0.75", "--target", "0.34", "--lam", "0.01",
            "--log_every", "1"]


def _target_reached(m: dict, target: float) -> None:
    # the target schedule holds exactly round(target * C) nonlinear channels from --ramp-end on
    assert m["units_nonlinear"] == round(target * m["units_total"]), m


def test_a_short_max_steps_run_of_cifar_reaches_its_target(cifar_args, tmp_path):
    import cifar

    m = cifar.main(cifar_args + ["--max-steps", "12", "--output_dir", str(tmp_path / "run")])
    assert m["steps"] == m["total_steps"] == 12
    _target_reached(m, 0.34)
    history = json.loads((tmp_path / "run" / "sparsifier_history.json").read_text())
    assert history, "no sparsifier history"
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["total_steps"] == 12


def test_max_steps_beyond_the_epochs_trains_further_epochs(cifar_args, tmp_path):
    import cifar

    m = cifar.main([*cifar_args[:cifar_args.index("--epochs")], "--epochs", "1",
                    *cifar_args[cifar_args.index("--epochs") + 2:], "--max-steps", "14",
                    "--output_dir", str(tmp_path / "run")])
    assert m["steps"] == m["total_steps"] == 14  # 6 steps per epoch: into the third epoch
    _target_reached(m, 0.34)


def test_stop_after_then_resume_matches_the_uninterrupted_run(cifar_args, tmp_path):
    import cifar

    args = cifar_args + ["--max-steps", "8", "--checkpointing_steps", "1"]
    full = cifar.main(args + ["--output_dir", str(tmp_path / "full")])
    part = tmp_path / "part"
    stopped = cifar.main(args + ["--stop-after", "3", "--output_dir", str(part)])
    assert stopped["steps"] == 3 and stopped["total_steps"] == 8
    with pytest.raises(ValueError, match="run of 8 optimizer steps, this one has 9"):
        cifar.main(cifar_args + ["--max-steps", "9", "--output_dir", str(part), "--resume_from_checkpoint", "latest"])
    resumed = cifar.main(args + ["--output_dir", str(part), "--resume_from_checkpoint", "latest"])
    assert resumed["steps"] == full["steps"] == 8
    a = load_file(str(part / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "full" / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:  # frozen-unit buffers hold NaN for "not frozen": compare NaN as equal
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{k}: {m}")


def test_a_short_max_steps_run_of_wmt14_reaches_its_target(tmp_path):
    import wmt14

    data = write_pairs(tmp_path / "pairs.jsonl.gz", 96)
    m = wmt14.main(["--train-file", str(data), "--test-file", str(data), "--max-eval-samples", "4", "--model-size",
                    "tiny", "--vocab-size", "120", "--max-tokens", "80", "--epochs", "50", "--num-beams", "1",
                    "--warmup-steps", "3", "--schedule", "late", "--late-start", "0.2", "--ramp-end", "0.7",
                    "--target", "0.34", "--log_every", "1", "--max-steps", "10", "--output_dir", str(tmp_path / "run")])
    assert m["steps"] == m["total_steps"] == 10
    _target_reached(m, 0.34)
