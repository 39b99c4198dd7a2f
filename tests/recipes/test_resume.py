"""Kill -9 and resume of the Accelerate recipes across an epoch boundary, and what a checkpoint folder
may hold (damaged files, pickles that run code, non-finite tensors, the ``accelerator.save_state``
layout of earlier versions); the one class list of ``recipes/cifar.py``.

Tiny synthetic data built in tmp_path (no real data needed). Each recipe is killed with SIGKILL in a
subprocess once a checkpoint of its third epoch (epoch index 2) exists, resumed with
``--resume_from_checkpoint latest``, and compared bit for bit with an uninterrupted run of the same
seed: every tensor of the final model, the slopes, the sparsifier state and history, the optimizer
and LR-scheduler state, the metrics (wall time, command and arguments aside) and the TensorBoard
scalars. The uninterrupted and resumed runs run in this process (``main(argv)``), on one thread like
the subprocess, to keep the file fast.
"""

from __future__ import annotations

import argparse
import errno
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

import linearize

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
sys.path.insert(0, str(RECIPES))

import common  # noqa: E402

CIFAR_CLASSES = ("airplane", "bird", "cat")
EPOCHS = 4  # killed in the third (epoch 2), with steps to spare for the kill to land


# ----------------------------------------------------------------------------- environment and data


@pytest.fixture(scope="module", autouse=True)
def kernel() -> bool:
    """The units' code path of every run here: the PyTorch ops (no kernel build inside a test), unless
    this process loaded the compiled kernel before; subprocesses get the same."""
    import linearize.kernels as kernels

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.ENV_SWITCH, "0")
        return kernels.cpu_prelu() is not None


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(kernel) -> dict[str, str]:
    """Subprocess environment: this worktree's package, one thread, the unit kernel as in this process."""
    import linearize.kernels as kernels

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TQDM_DISABLE": "1",
            "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false",
            kernels.ENV_SWITCH: "1" if kernel else "0"}


def write_images(root: Path, counts: dict[str, dict[str, int]], size: int = 8) -> Path:
    """``root/<split>/<class>/<i>.png``: noise images whose brightness depends on the class."""
    from torchvision.io import write_png

    g = torch.Generator().manual_seed(0)
    for split, per_class in counts.items():
        for c, n in per_class.items():
            folder = root / split / c
            folder.mkdir(parents=True, exist_ok=True)
            shift = 40 * (sorted(per_class).index(c) if c not in CIFAR_CLASSES else CIFAR_CLASSES.index(c))
            for i in range(n):
                img = (torch.rand(3, size, size, generator=g) * 128 + shift).clamp(0, 255).to(torch.uint8)
                write_png(img, str(folder / f"{i:03d}.png"))
    return root


def write_pairs(path: Path, n: int) -> Path:
    """A toy en-de corpus in the WMT JSONL layout (word-for-word translations)."""
    en = "a the dog cat man woman runs sits red blue big small park street ball water".split()
    de = "ein der hund katze mann frau läuft sitzt rot blau groß klein park straße ball wasser".split()
    g = torch.Generator().manual_seed(0)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for _ in range(n):
            idx = torch.randint(0, len(en), (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            row = {"translation": {"en": " ".join(en[i] for i in idx), "de": " ".join(de[i] for i in idx)}}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def tiny_late_start_args(folder: Path, target: float) -> list[str]:
    """``recipes/wmt14.py`` on 96 pairs of :func:`write_pairs` in ``folder``, the tiny preset, ``EPOCHS`` epochs,
    a checkpoint every step, its late start (a one-shot or a prune) at a quarter of the run for ``target``."""
    data = write_pairs(folder / "pairs.jsonl.gz", 96)
    return ["--train-file", str(data), "--test-file", str(data), "--max-eval-samples", "4", "--model-size", "tiny",
            "--vocab-size", "120", "--max-tokens", "80", "--epochs", str(EPOCHS), "--num-beams", "1",
            "--warmup-steps", "3", "--target", str(target), "--late-start", "0.25",
            "--checkpointing_steps", "1", "--keep_checkpoints", "0", "--log_every", "1"]


@pytest.fixture(scope="module")
def cifar_args(tmp_path_factory) -> list[str]:
    data = write_images(tmp_path_factory.mktemp("cifar-data"),
                        {"train": {c: 16 for c in CIFAR_CLASSES}, "test": {c: 4 for c in CIFAR_CLASSES}})
    return ["--data-dir", str(data), "--cache-dir", str(tmp_path_factory.mktemp("cifar-cache")), "--image-size", "8",
            "--arch", "resnet20", "--batch-size", "8", "--eval-batch-size", "12", "--epochs", str(EPOCHS),
            "--lr", "0.05", "--warmup-epochs", "1", "--schedule", "late", "--late-start", "0.2", "--ramp-end", "0.9",
            "--target", "0.34", "--lam", "0.01", "--checkpointing_steps", "1", "--keep_checkpoints", "3",
            "--log_every", "1", "--with_tracking"]


@pytest.fixture(scope="module")
def wmt_args(tmp_path_factory) -> list[str]:
    data = write_pairs(tmp_path_factory.mktemp("mt-data") / "pairs.jsonl.gz", 96)
    return ["--train-file", str(data), "--test-file", str(data), "--max-eval-samples", "4", "--model-size", "tiny",
            "--vocab-size", "120", "--max-tokens", "80", "--epochs", str(EPOCHS), "--num-beams", "1",
            "--warmup-steps", "3", "--schedule", "late", "--late-start", "0.2", "--ramp-end", "0.9",
            "--target", "0.34", "--checkpointing_steps", "1", "--keep_checkpoints", "3", "--log_every", "1"]


# ----------------------------------------------------------------------------- kill and resume


@dataclass
class Runs:
    full: Path  # the uninterrupted run
    resumed: Path  # killed, then resumed with `latest`
    snapshot: Path  # the resumed run's checkpoints folder right after the kill
    total: int  # optimizer steps of the whole run


def steps_of(checkpoints: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in checkpoints.glob("step_*"))


def kill_and_resume(script: str, main: Callable[[list[str]], dict], args: list[str], root: Path,
                    env: dict[str, str]) -> Runs:
    """Run uninterrupted; run again in a subprocess, SIGKILL it once a checkpoint of epoch 2 exists,
    resume with ``latest``."""
    full = root / "full"
    total = main(args + ["--output_dir", str(full)])["total_steps"]
    per_epoch = total // EPOCHS
    kill_at = 2 * per_epoch + 1  # the state after the first step of epoch 2
    part = root / "part"
    log = open(root / "killed.log", "w")
    proc = subprocess.Popen([sys.executable, str(RECIPES / script), *args, "--output_dir", str(part)], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not common.checkpoint_dir(part, kill_at).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{script} ended ({proc.returncode}) before step {kill_at}:\n"
                            f"{(root / 'killed.log').read_text()[-3000:]}")
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)  # only the process this test started
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL
    steps = steps_of(part / "checkpoints")
    assert not (part / "metrics.json").exists()
    if steps[-1] >= total:
        pytest.fail(f"{script} reached its last step before the kill landed; give it more steps per epoch")
    assert 2 * per_epoch < steps[-1] < total  # resuming inside epoch 2, not at its start
    snapshot = shutil.copytree(part / "checkpoints", root / "snapshot")
    main(args + ["--output_dir", str(part), "--resume_from_checkpoint", "latest"])
    return Runs(full, part, Path(snapshot), total)


@pytest.fixture(scope="module")
def cifar_runs(cifar_args, env, tmp_path_factory) -> Runs:
    import cifar

    return kill_and_resume("cifar.py", cifar.main, cifar_args, tmp_path_factory.mktemp("cifar-runs"), env)


@pytest.fixture(scope="module")
def wmt_runs(wmt_args, env, tmp_path_factory) -> Runs:
    import wmt14

    return kill_and_resume("wmt14.py", wmt14.main, wmt_args, tmp_path_factory.mktemp("wmt-runs"), env)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equality (``torch.equal`` of the raw bytes, so NaN sentinels compare equal to themselves)."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{what} differs"


def assert_same_tree(a, b, what: str) -> None:
    """Nested dicts/lists of tensors and plain values: tensors bit for bit, the rest with ``==``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), what
        assert_same_bits(a, b, what)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{what}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same_tree(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def assert_resumed_as_uninterrupted(full: Path, resumed: Path, total: int, record: str,
                                    paths: tuple[tuple[str, str], ...]) -> None:
    """The run ``resumed`` (killed and resumed) ends as the uninterrupted ``full`` one: final metrics equal but for
    the output paths ``paths`` (``(section, key)`` pairs, which must differ), the step's record file ``record``
    equal, the final weights and the final checkpoint's model, optimizer and scheduler equal bit for bit."""
    a, b = final_metrics(full), final_metrics(resumed)
    for section, key in paths:
        assert a[section].pop(key) != b[section].pop(key), f"{section}.{key}: each run's own path"
    assert a == b
    assert (full / record).read_text() == (resumed / record).read_text()
    assert_same_tree(load_file(str(full / "model" / "model.safetensors")),
                     load_file(str(resumed / "model" / "model.safetensors")), "final weights")
    a, b = (common.read_checkpoint(common.checkpoint_dir(r, total)) for r in (full, resumed))
    for field in ("model", "optimizer", "scheduler"):
        assert_same_tree(getattr(a, field), getattr(b, field), f"final checkpoint {field}")


def final_metrics(run: Path) -> dict:
    m = json.loads((run / "metrics.json").read_text())
    for k in ("wall_time_s", "wall_time_this_process_s", "command", "args"):  # times; --resume_from_checkpoint
        m.pop(k)
    return m


def scalars(run: Path) -> dict[str, dict[int, float]]:
    """TensorBoard scalars, ``{tag: {step: value}}``; a step logged twice (before a kill and after the
    resume) keeps its last value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted((run / "logs").rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def assert_same_run(a: Path, b: Path, total: int, logged_from: int = 1) -> None:
    """Same metrics, final model (slopes included), sparsifier history, final checkpoint and TensorBoard
    scalars (``b`` logged steps ``logged_from``..``total``), bit for bit."""
    assert final_metrics(a) == final_metrics(b)
    for f in sorted(p.name for p in (a / "model").glob("*.safetensors")):
        ta, tb = load_file(str(a / "model" / f)), load_file(str(b / "model" / f))
        assert_same_tree(ta, tb, f"model/{f}")
    slopes = [k for k in linearize.serialization.load_unit_tensors(a / "model") if k.endswith(".slope")]
    assert slopes
    if (a / "sparsifier_history.json").exists() or (b / "sparsifier_history.json").exists():
        assert json.loads((a / "sparsifier_history.json").read_text()) == \
            json.loads((b / "sparsifier_history.json").read_text())
    ca, cb = (common.read_checkpoint(common.checkpoint_dir(run, total)) for run in (a, b))
    assert ca.sparsifier is not None
    for field in ("step", "model", "optimizer", "scheduler", "sparsifier", "scaler"):
        assert_same_tree(getattr(ca, field), getattr(cb, field), f"final checkpoint {field}")
    if (a / "logs").exists():
        sa, sb = scalars(a), scalars(b)
        assert sa.keys() == sb.keys() and sa["train_loss"].keys() == set(range(1, total + 1))
        assert sb["train_loss"].keys() == set(range(logged_from, total + 1))
        assert sb == {tag: {s: v for s, v in values.items() if s >= logged_from} for tag, values in sa.items()}


def test_cifar_kill_and_resume_across_epochs(cifar_runs):
    assert_same_run(cifar_runs.full, cifar_runs.resumed, cifar_runs.total)
    assert not list((cifar_runs.resumed / "checkpoints").glob(".*"))  # no temp folder left


def test_wmt_kill_and_resume_across_epochs(wmt_runs):
    assert_same_run(wmt_runs.full, wmt_runs.resumed, wmt_runs.total)
    assert not list((wmt_runs.resumed / "checkpoints").glob(".*"))


def test_a_second_run_into_a_training_runs_folder_is_refused(cifar_runs, cifar_args, env, tmp_path):
    """The same command launched twice: the second run (in this process), started while the first (a
    subprocess) writes checkpoints into the folder, stops at its start naming the folder and the first
    process, and removes nothing: the first ends exactly like the uninterrupted run."""
    import cifar

    out = tmp_path / "run"
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen([sys.executable, str(RECIPES / "cifar.py"), *cifar_args, "--output_dir", str(out)],
                             cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not common.checkpoint_dir(out, 1).exists():
            if first.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"cifar.py ended ({first.returncode}) before step 1:\n"
                            f"{(tmp_path / 'first.log').read_text()[-3000:]}")
            time.sleep(0.005)
        with pytest.raises(RuntimeError, match=rf"{out}: another run is training into this --output_dir \(process "
                                               rf"{first.pid} on .*give this run another --output_dir"):
            cifar.main(cifar_args + ["--output_dir", str(out)])
        assert first.poll() is None  # refused while the first run was still training
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()  # only the process this test started
        first.wait()
        log.close()
    assert_same_run(cifar_runs.full, out, cifar_runs.total)


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.ENOSYS], ids=["ENOLCK", "ENOSYS"])
def test_a_folder_that_cannot_be_locked_trains_unprotected_with_a_warning(tmp_path, monkeypatch, err):
    """flock() failing as on NFS without its lock manager (ENOLCK) or Lustre without -o flock (ENOSYS): taking
    the run lock warns, naming the folder, that a second run is not kept out, leaves no lock behind (no soft
    marker that a run dying on another node would leave), and a second run into the folder may then start."""
    import fcntl

    def flock(fd, op):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", flock)
    out = tmp_path / "nfs" / "run"
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match=rf"{out}: this filesystem cannot lock files .*not protected"):
            common.hold_output_dir(out)
    assert os.path.realpath(out / common.RUN_LOCK) not in common.files._HELD_RUNS
    common.release_output_dir(out)


def test_a_refused_run_says_how_to_remove_the_lock_of_an_ended_holder(tmp_path):
    """Refused because another process holds the run lock: the error names the holder, and also the files to
    remove when that holder has ended (on another host the refusal cannot tell)."""
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", f"import sys, time; sys.path.insert(0, {str(RECIPES)!r}); "
                               f"import common; common.hold_output_dir({str(out)!r}); print('held', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=rf"process {holder.pid} on .*if that process has ended \(on another "
                                               rf"host: check there\), remove {out / '.run.lock'} and "
                                               rf"{out / '.run.owner'}"):
            common.hold_output_dir(out)
    finally:
        holder.kill()  # only the process this test started
        holder.wait()
        holder.stdout.close()


# ----------------------------------------------------------------------------- the accelerate layout


class Stored:
    """Stands in for a registered object of ``accelerator.save_state``: pickles ``state``."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def write_accelerate_layout(ckpt: Path, dest: Path, num_classes: int) -> Path:
    """Re-write a cifar checkpoint the way the recipes did before format 2: ``accelerator.save_state``
    with the LR scheduler and the sparsifier registered (custom_checkpoint_0/1.pkl), then
    ``recipe_state.json`` with step, fingerprint and recipe."""
    import cifar
    from accelerate import Accelerator

    import linearize

    state = common.read_checkpoint(ckpt)
    model = linearize.convert(cifar.build_model("resnet20", num_classes), mode="prelu",
                              example_inputs=torch.zeros(2, 3, 8, 8))
    model.load_state_dict(state.model)
    optimizer = torch.optim.SGD(linearize.param_groups(model, weight_decay=5e-4), lr=0.05, momentum=0.9, nesterov=True)
    optimizer.load_state_dict(state.optimizer)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(Stored(state.scheduler))
    accelerator.register_for_checkpointing(Stored(state.sparsifier))
    accelerator.save_state(str(dest))
    (dest / common.STATE_FILE).write_text(json.dumps({"step": state.step, "fingerprint": state.fingerprint,
                                                      "recipe": state.recipe}))
    return dest


def test_resume_from_the_accelerate_layout(cifar_runs, cifar_args, tmp_path):
    """Checkpoints of runs started before format 2 resume exactly, read with weights_only=True."""
    import cifar

    step = steps_of(cifar_runs.snapshot)[0]
    old = write_accelerate_layout(cifar_runs.snapshot / f"step_{step:08d}", common.checkpoint_dir(tmp_path, step),
                                  len(CIFAR_CLASSES))
    assert {"optimizer.bin", "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl", "random_states_0.pkl"} <= \
        {p.name for p in old.iterdir()}
    cifar.main(cifar_args + ["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])
    assert_same_run(cifar_runs.full, tmp_path, cifar_runs.total, logged_from=step + 1)


class WritesMarker:
    """Unpickling this creates the file ``marker`` (``open(marker, "w")``): code run by a pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_checkpoint_files_never_execute_code(cifar_runs, cifar_args, tmp_path):
    """A pickle that runs code, in the accelerate layout (a registered object) and in format 2 (the
    optimizer file, with the state JSON's hashes updated to match), is refused and never runs."""
    import cifar

    step = steps_of(cifar_runs.snapshot)[0]
    marker = tmp_path / "pwned"
    old = write_accelerate_layout(cifar_runs.snapshot / f"step_{step:08d}", tmp_path / "old" / f"step_{step:08d}",
                                  len(CIFAR_CLASSES))
    torch.save(WritesMarker(marker), old / "custom_checkpoint_0.pkl")
    new = Path(shutil.copytree(cifar_runs.snapshot / f"step_{step:08d}", tmp_path / "new" / f"step_{step:08d}"))
    torch.save({"state": {}, "param_groups": [WritesMarker(marker)]}, new / common.OPTIMIZER_FILE)
    state = json.loads((new / common.STATE_FILE).read_text())
    state["files"][common.OPTIMIZER_FILE] = {"size": (new / common.OPTIMIZER_FILE).stat().st_size,
                                             "sha256": common.file_sha256(new / common.OPTIMIZER_FILE)}
    state["state_sha256"] = common.state_digest(state)  # the JSON's own hash too: only the pickle is wrong
    (new / common.STATE_FILE).write_text(json.dumps(state))
    for folder, bad in ((old, "custom_checkpoint_0.pkl"), (new, common.OPTIMIZER_FILE)):
        with pytest.raises(common.CheckpointError, match=rf"{folder.name}: {bad} .* cannot be read safely"):
            cifar.main(cifar_args + ["--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", str(folder)])
        assert not marker.exists()


# ----------------------------------------------------------------------------- damaged checkpoints


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-9] ^= 0xFF
    path.write_bytes(bytes(data))


def put_nan(folder: Path) -> None:
    """A NaN in the weights, with the state JSON's hashes updated: only the finiteness check can tell."""
    tensors = load_file(str(folder / common.MODEL_FILE))
    name = next(k for k in sorted(tensors) if k.endswith("conv1.weight"))
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(folder / common.MODEL_FILE))
    state = json.loads((folder / common.STATE_FILE).read_text())
    state["files"][common.MODEL_FILE] = {"size": (folder / common.MODEL_FILE).stat().st_size,
                                         "sha256": common.file_sha256(folder / common.MODEL_FILE)}
    state["state_sha256"] = common.state_digest(state)
    (folder / common.STATE_FILE).write_text(json.dumps(state))


DAMAGE = {
    "model truncated": (lambda d: truncate(d / common.MODEL_FILE), "truncated"),
    "optimizer truncated": (lambda d: truncate(d / common.OPTIMIZER_FILE), "truncated"),
    "state JSON empty": (lambda d: (d / common.STATE_FILE).write_text(""), "empty or damaged"),
    "state JSON missing": (lambda d: (d / common.STATE_FILE).unlink(), "no recipe_state.json"),
    "state JSON nested too deep": (lambda d: (d / common.STATE_FILE).write_text("[" * 100_000 + "]" * 100_000),
                                   "empty or damaged"),
    "model modified": (lambda d: flip_byte(d / common.MODEL_FILE), "sha256"),
    "model file missing": (lambda d: (d / common.MODEL_FILE).unlink(), "missing"),
    "non-finite weights": (put_nan, "conv1.weight holds inf or NaN"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_latest_skips_a_damaged_checkpoint(cifar_runs, tmp_path, damage):
    damage_fn, reason = DAMAGE[damage]
    ckpts = Path(shutil.copytree(cifar_runs.snapshot, tmp_path / "checkpoints"))
    newest, previous = steps_of(ckpts)[-1], steps_of(ckpts)[-2]
    damage_fn(ckpts / f"step_{newest:08d}")
    ckpt, skipped = common.find_checkpoint("latest", tmp_path)
    assert ckpt.step == previous
    assert len(skipped) == 1 and f"step_{newest:08d}" in skipped[0] and reason in skipped[0]
    with pytest.raises(common.CheckpointError, match=f"step_{newest:08d}: .*{reason}"):
        common.find_checkpoint(str(ckpts / f"step_{newest:08d}"), tmp_path)


def test_no_intact_checkpoint_is_refused(cifar_runs, tmp_path):
    ckpts = Path(shutil.copytree(cifar_runs.snapshot, tmp_path / "checkpoints"))
    for step in steps_of(ckpts):
        truncate(ckpts / f"step_{step:08d}" / common.OPTIMIZER_FILE)
    with pytest.raises(common.CheckpointError, match=r"no intact checkpoint(.|\n)*truncated(.|\n)*start again"):
        common.find_checkpoint("latest", tmp_path)


def test_accelerate_layout_damage_is_detected(cifar_runs, tmp_path):
    step = steps_of(cifar_runs.snapshot)[0]
    old = write_accelerate_layout(cifar_runs.snapshot / f"step_{step:08d}", tmp_path / f"step_{step:08d}",
                                  len(CIFAR_CLASSES))
    truncate(old / "model.safetensors")
    with pytest.raises(common.CheckpointError, match=r"model.safetensors \(model weights\) cannot be read safely"):
        common.read_checkpoint(old)


def test_resume_falls_back_past_a_damaged_newest_checkpoint(cifar_runs, cifar_args, tmp_path, dead_pid):
    """End to end: the newest checkpoint's weights are truncated and an interrupted write left a temp
    folder; the run warns naming the folder, resumes from the previous one, removes the temp folder
    and still ends bit for bit like the uninterrupted run."""
    import cifar

    ckpts = Path(shutil.copytree(cifar_runs.snapshot, tmp_path / "checkpoints"))
    newest = steps_of(ckpts)[-1]
    truncate(ckpts / f"step_{newest:08d}" / "model.safetensors")
    leftover = ckpts / f".tmp-step_{newest + 1:08d}-{dead_pid}"
    shutil.copytree(ckpts / f"step_{newest - 1:08d}", leftover)
    with pytest.warns(RuntimeWarning, match=rf"step_{newest:08d}: model.safetensors has \d+ bytes"):
        cifar.main(cifar_args + ["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])
    assert not leftover.exists()
    assert_same_run(cifar_runs.full, tmp_path, cifar_runs.total, logged_from=newest)


def test_latest_before_the_first_checkpoint_starts_at_step_0(cifar_runs, cifar_args, tmp_path, dead_pid, capsys):
    """A run killed while writing its first checkpoint (only a half-written ``.tmp-step_00000001-<pid>``; a kill
    in the first steps leaves no checkpoint either) started again with the same command and
    ``--resume_from_checkpoint latest`` (a requeue script's form) starts at step 0, saying so, and ends bit for
    bit like the uninterrupted run. Observed before: FileNotFoundError "no checkpoint under ...", no run."""
    import cifar

    partial = tmp_path / "checkpoints" / f".tmp-step_00000001-{dead_pid}"
    partial.mkdir(parents=True)
    (partial / common.MODEL_FILE).write_bytes(b"\0" * 10)
    cifar.main(cifar_args + ["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])
    assert f"no checkpoint under {tmp_path / 'checkpoints'} yet: starting at step 0" in capsys.readouterr().out
    assert not partial.exists()
    assert_same_run(cifar_runs.full, tmp_path, cifar_runs.total)


# ----------------------------------------------------------------------------- non-finite training


def test_nonfinite_loss_stops_before_any_nonfinite_checkpoint(cifar_args, tmp_path):
    import cifar

    args = [a for a in cifar_args if a != "--with_tracking"]
    args[args.index("--lr") + 1] = "1e30"
    args[args.index("--log_every") + 1] = "50"
    with pytest.raises(FloatingPointError, match=r"optimizer step (\d+);.*Lower --lr") as err:
        cifar.main(args + ["--output_dir", str(tmp_path)])
    bad_step = int(str(err.value).split("optimizer step ")[1].split(";")[0])
    written = steps_of(tmp_path / "checkpoints")
    assert written and max(written) < bad_step
    for step in written:  # every checkpoint written holds finite tensors only
        common.read_checkpoint(common.checkpoint_dir(tmp_path, step))


def test_loss_watch_on_an_accelerator_reports_the_first_bad_step():
    """Off the CPU the loss is not read back every step; the first bad step is still the one named."""
    watch = common.LossWatch(torch.device("cuda"))
    for step, loss in enumerate([1.0, 2.0, float("nan"), float("inf"), 1.0], start=1):
        watch.update(torch.tensor(loss), step)
    with pytest.raises(FloatingPointError, match="became inf or NaN at optimizer step 3"):
        watch.check()


def test_no_checkpoint_of_nonfinite_weights(tmp_path):
    from accelerate import Accelerator

    import linearize

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), linearize.LinearizableActivation("relu", 4, -1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    args = argparse.Namespace(keep_checkpoints=2)
    run = common.Run(Accelerator(cpu=True), args, model, optimizer, scheduler, None, tmp_path, "f", "test")
    common.save_checkpoint(run, 1)  # the NaN of the unit's `frozen` buffer marks free channels: allowed
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"0.weight holds inf or NaN after optimizer step 2"):
        common.save_checkpoint(run, 2)
    assert steps_of(tmp_path / "checkpoints") == [1] and not list((tmp_path / "checkpoints").glob(".*"))


# ----------------------------------------------------------------------------- class lists (cifar)


@pytest.fixture
def cifar_tree(tmp_path) -> Callable[..., list[str]]:
    """Arguments for a tree with train classes airplane, bird, cat (5, 6, 7 images) and the given
    test classes (3, 4, 5... images each)."""

    def make(test_classes: tuple[str, ...], tar: bool = False) -> list[str]:
        root = write_images(tmp_path / "data", {"train": {"airplane": 5, "bird": 6, "cat": 7},
                                                "test": {c: 3 + i for i, c in enumerate(test_classes)}})
        data = root
        if tar:
            data = tmp_path / "data.tar.gz"
            with tarfile.open(data, "w:gz") as t:
                t.add(root / "train", "train")
                t.add(root / "test", "test")
        return ["--data-dir", str(data), "--cache-dir", str(tmp_path / "cache"), "--image-size", "8",
                "--output_dir", str(tmp_path / "out")]

    return make


def label_counts(split: dict) -> dict[str, int]:
    return {c: int((split["y"] == i).sum()) for i, c in enumerate(split["classes"])}


@pytest.mark.parametrize("tar", [False, True], ids=["folder", "tar"])
def test_test_split_lacking_a_class_keeps_the_training_labels(cifar_tree, tar):
    import cifar

    train, test = cifar.load_data(cifar.parse_args(cifar_tree(("bird", "cat"), tar)), show=False)
    assert train["classes"] == test["classes"] == ["airplane", "bird", "cat"]
    assert label_counts(train) == {"airplane": 5, "bird": 6, "cat": 7}
    assert label_counts(test) == {"airplane": 0, "bird": 3, "cat": 4}  # the folders' own counts


def test_test_class_unknown_to_training_is_refused(cifar_tree):
    import cifar

    with pytest.raises(ValueError, match=r"test/ has images of class\(es\) \['dog'\] that train/ lacks"):
        cifar.load_data(cifar.parse_args(cifar_tree(("bird", "dog"))), show=False)


def test_classes_option(cifar_tree, tmp_path):
    import cifar

    args = cifar_tree(("airplane", "bird", "cat"))
    train, test = cifar.load_data(cifar.parse_args(args + ["--classes", "cat,airplane"]), show=False)
    assert train["classes"] == test["classes"] == ["cat", "airplane"]
    assert label_counts(train) == {"cat": 7, "airplane": 5} and label_counts(test) == {"cat": 5, "airplane": 3}
    assert sorted(train["y"].tolist()) == [0] * 7 + [1] * 5
    # the cache of one class list is not served for another, nor for none
    train, test = cifar.load_data(cifar.parse_args(args), show=False)
    assert label_counts(train) == {"airplane": 5, "bird": 6, "cat": 7}
    assert label_counts(test) == {"airplane": 3, "bird": 4, "cat": 5}
    train, _ = cifar.load_data(cifar.parse_args(args + ["--classes", "bird,cat"]), show=False)
    assert label_counts(train) == {"bird": 6, "cat": 7}
    with pytest.raises(ValueError, match=r"--classes cat,dog: no training images of \['dog'\]"):
        cifar.load_data(cifar.parse_args(args + ["--classes", "cat,dog"]), show=False)
    with pytest.raises(SystemExit):
        cifar.parse_args(args + ["--classes", "cat,cat"])

    cifar.main(args + ["--classes", "cat,airplane", "--arch", "resnet20", "--batch-size", "4", "--epochs", "1",
                       "--max-steps", "1", "--schedule", "none"])
    meta = json.loads((tmp_path / "out" / "model" / "recipe.json").read_text())
    assert meta["classes"] == ["cat", "airplane"] and meta["num_classes"] == 2
    assert cifar.load_model(tmp_path / "out" / "model").fc.out_features == 2
