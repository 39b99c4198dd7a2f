"""The full-scale sweep of ``recipes/reproduce`` (the late-vs-early study of ResNet-20,
``recipes/reproduce/full.py``), run as its ``tiny`` miniature: the same plan, 1-2 epochs on a fake
image-folder tree of 8x8 images (no real data, a few minutes of CPU).

Checked against what the test itself sets up or reads from the files: a late run waits for its
baseline without blocking the other slot; a failed run is reported with its log and not retried; a
runner killed with SIGKILL leaves its child running, and a restarted runner waits for that child
instead of starting the run again; a run with a checkpoint but no ``metrics.json`` is resumed;
adoption of a run started by hand (finished or running) checks its arguments; collect copies
exactly the small files and ``cifar.load_model`` loads them; analyze writes the table and plots
with the seed mean and spread of the accuracies in the metrics files, with and without the data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
sys.path.insert(0, str(RECIPES))

from reproduce import sweep  # noqa: E402

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
SMALL = {"metrics.json", "model/recipe.json", "model/model.safetensors"}


def small_linearized(run: Path) -> set[str]:
    """SMALL plus the history and the sidecar (its tensor file is named by its checksum)."""
    units = sorted(p.name for p in (run / "model").glob("linearize_units-*.safetensors"))
    assert len(units) == 1, units
    return SMALL | {"sparsifier_history.json", "model/linearize_config.json", f"model/{units[0]}"}


def _has_classes_option() -> bool:
    import cifar

    try:
        cifar.parse_args(["--output_dir", "x", "--classes", "airplane,automobile"])
    except SystemExit:  # argparse: unrecognized arguments
        return False
    return True


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict:
    """A fake CIFAR-10 image-folder tree (2 train and 1 test image per class, 8x8 PNG), run and
    results folders, and the environment of the subprocesses."""
    from PIL import Image

    root = tmp_path_factory.mktemp("reproduce")
    rng = np.random.default_rng(0)
    for split, n in (("train", 2), ("test", 1)):
        for c in CLASSES:
            (root / "data" / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / "data" / split / c / f"{i}.png")
    env = {k: v for k, v in os.environ.items() if k != "LINEARIZE_CIFAR10"}
    env.update(PYTHONPATH=str(REPO), LINEARIZE_CPU_KERNEL="0", LINEARIZE_CACHE=str(root / "cache"), TQDM_DISABLE="1")
    return {"root": root, "data": root / "data", "runs": root / "runs" / "tiny", "results": root / "results", "env": env}


def reproduce(tree: dict, *args: str, check: bool = True, data: bool = True, results: Path | None = None):
    """Run ``python recipes/reproduce --scale tiny`` to the end; fail with its output unless ``check`` is False."""
    cmd = [sys.executable, str(RECIPES / "reproduce"), "--scale", "tiny", "--runs-dir", str(tree["root"] / "runs"),
           "--results-dir", str(results or tree["results"]), "--poll", "0.5", "--latency-reps", "2"]
    cmd += ["--cifar", str(tree["data"])] if data else []
    proc = subprocess.run(cmd + list(args), env=tree["env"], capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd + list(args))} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-4000:]}")
    return proc


def jobs_json(tree: dict) -> dict:
    return json.loads((tree["runs"] / "jobs.json").read_text())


def files_under(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


SWEEP = ["r20_late_10_s0", "r20_base_s0", "r20_early_10_s0", "r20_late_25_s0"]


@pytest.fixture(scope="module")
def swept(tree) -> dict:
    """Baseline seed 0, late 10% (listed first: it must wait for the baseline), early 10% and a late 25%
    run whose only checkpoint is unusable (a foreign, unverifiable stub: it must fail), two at a time, under a runner that is
    killed with SIGKILL once it has started the first two, and then started again."""
    import common

    bad = common.checkpoint_dir(tree["runs"] / "r20_late_25_s0", 1)
    bad.mkdir(parents=True)
    (bad / common.STATE_FILE).write_text(json.dumps({"step": 1, "fingerprint": "another model", "recipe": "cifar"}))
    cmd = [sys.executable, str(RECIPES / "reproduce"), "--scale", "tiny", "--stage", "train", "--jobs", "2",
           "--only", ",".join(SWEEP), "--cifar", str(tree["data"]), "--runs-dir", str(tree["root"] / "runs"),
           "--results-dir", str(tree["results"]), "--poll", "0.5"]
    runner = subprocess.Popen(cmd, env=tree["env"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    for _ in range(600):  # the runner records "started" right after launching a child
        started = jobs_json(tree) if (tree["runs"] / "jobs.json").exists() else {}
        if all(started.get(n, {}).get("started") for n in ("r20_base_s0", "r20_early_10_s0")):
            break
        time.sleep(0.2)
    else:
        runner.kill()
        pytest.fail("the runner did not start r20_base_s0 and r20_early_10_s0 within 2 minutes")
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait(timeout=30)
    orphans = [sweep._locked(tree["runs"] / f"{n}.lock") for n in ("r20_base_s0", "r20_early_10_s0")]
    restarted = reproduce(tree, "--stage", "train", "--jobs", "2", "--only", ",".join(SWEEP), check=False)
    return {"orphans_running": orphans, "restarted": restarted}


def test_killed_runner_restarts_without_starting_runs_twice(tree, swept):
    assert swept["orphans_running"] == [True, True], "the children of the killed runner should hold their locks"
    out = swept["restarted"].stdout
    for name in ("r20_base_s0", "r20_early_10_s0"):
        assert f"start {name}" not in out and f"{name} runs in another process" in out
        assert (tree["runs"] / f"{name}.log").read_text().count("=== reproduce.py") == 1
        assert jobs_json(tree)[name]["attempts"] == 1
        assert sweep.is_done(tree["runs"] / name) and (tree["results"] / name / "metrics.json").exists()


def test_late_waits_for_its_baseline_without_blocking_the_other_slot(tree, swept):
    j = jobs_json(tree)
    base_done = (tree["runs"] / "r20_base_s0" / "metrics.json").stat().st_mtime
    assert j["r20_late_10_s0"]["started"] >= base_done
    assert j["r20_early_10_s0"]["started"] < base_done  # started beside the baseline, not after it
    assert j["r20_late_10_s0"]["returncode"] == 0 and j["r20_late_10_s0"]["attempts"] == 1
    for name in ("r20_base_s0", "r20_late_10_s0", "r20_early_10_s0"):
        m = json.loads((tree["runs"] / name / "metrics.json").read_text())
        assert m["steps"] == m["total_steps"] == (10 if "early" in name else 5)  # 20 images / batch 4, 1 or 2 epochs
    late_args = json.loads((tree["runs"] / "r20_late_10_s0" / "metrics.json").read_text())["args"]
    assert Path(late_args["init_from"]) == tree["runs"] / "r20_base_s0" / "model"
    assert (late_args["schedule"], late_args["target"], late_args["lr"]) == ("late", 0.1, 0.02)


def test_failed_run_is_reported_and_not_retried(tree, swept):
    out = swept["restarted"]
    assert out.returncode == 1
    log = tree["runs"] / "r20_late_25_s0.log"
    assert f"FAILED r20_late_25_s0: exit code 1, see {log}" in out.stdout
    assert jobs_json(tree)["r20_late_25_s0"]["attempts"] == 1
    assert "no intact checkpoint to resume from" in log.read_text()  # the recipe's own verdict, named
    assert not (tree["results"] / "r20_late_25_s0").exists()


def test_run_with_checkpoint_but_no_metrics_is_resumed(tree, swept):
    run = tree["runs"] / "r20_base_s0"
    before = load_file(str(run / "model" / "model.safetensors"))
    (run / "metrics.json").unlink()
    out = reproduce(tree, "--stage", "train", "--only", "r20_base_s0")
    assert "resume r20_base_s0" in out.stdout
    assert "--resume_from_checkpoint latest" in jobs_json(tree)["r20_base_s0"]["command"]
    assert "resumed from" in (tree["runs"] / "r20_base_s0.log").read_text()
    m = json.loads((run / "metrics.json").read_text())
    assert m["steps"] == m["total_steps"] == 5
    after = load_file(str(run / "model" / "model.safetensors"))
    for k in before:  # resumed at the end: the same weights, not a new training
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)


def test_collect_copies_exactly_the_small_files(tree, swept):
    import cifar

    for name, linearized in (("r20_base_s0", False), ("r20_late_10_s0", True), ("r20_early_10_s0", True)):
        expected = small_linearized(tree["runs"] / name) if linearized else SMALL
        got = tree["results"] / name
        assert files_under(got) - {"analysis.json"} == expected, name
        for rel in expected:
            assert (got / rel).read_bytes() == (tree["runs"] / name / rel).read_bytes(), (name, rel)
        model = cifar.load_model(got / "model")
        ref = load_file(str(tree["runs"] / name / "model" / "model.safetensors"))
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, ref[k], rtol=0, atol=0, equal_nan=True)  # NaN: a channel not frozen
    assert not [p for p in tree["results"].iterdir() if p.name.startswith(".")]  # no temporary folders left


def test_adopt_checks_the_arguments_of_finished_and_running_runs(tree, swept, tmp_path):
    from reproduce import cli as reproduce

    src = tree["runs"] / "r20_base_s0"
    runs2 = tmp_path / "runs"
    base = ["--scale", "tiny", "--stage", "collect", "--runs-dir", str(runs2), "--results-dir", str(tmp_path / "results")]
    assert reproduce.main(base + ["--adopt", f"r20_base_s0={src}"]) == 0
    assert (runs2 / "tiny" / "r20_base_s0").resolve() == src.resolve()
    assert files_under(tmp_path / "results" / "r20_base_s0") == SMALL
    with pytest.raises(SystemExit, match=r"seed \(0, planned 1\)"):
        reproduce.main(base + ["--adopt", f"r20_base_s1={src}"])

    # a run still in progress, started by hand: its command line is checked, and the runner waits for it
    from reproduce import full as reproduce_full

    job = {j.name: j for j in reproduce_full.plan("tiny", str(tree["data"]), runs2 / "tiny")}["r20_late_2_s0"]
    outside = tmp_path / "by_hand"
    outside.mkdir()
    argv = [a if a != str(runs2 / "tiny" / "r20_late_2_s0") else str(outside) for a in job.argv]
    bad = argv[:-1] + [str(tmp_path)]
    bad[bad.index("--target") + 1] = "0.3"
    fakes = [started_by_hand(argv), started_by_hand(bad)]
    try:
        with pytest.raises(SystemExit, match=r"target \(0.3, planned 0.02\)"):
            sweep.adopt(job, runs2 / "tiny", tmp_path)
        sweep.adopt(job, runs2 / "tiny", outside)
        # its dependency (adopted above) is done: only the process working on it keeps the runner from starting it
        t0 = time.time()
        sweep.train([job], runs2 / "tiny", n_jobs=1, threads=1, poll_s=0.2, max_hours=2 / 3600)
        assert time.time() - t0 >= 2 and fakes[0].poll() is None
        assert not (runs2 / "tiny" / "jobs.json").exists()  # nothing was started
    finally:
        for p in fakes:
            p.kill()
            p.wait()


def test_a_finished_run_whose_plan_was_edited_is_not_counted_done(tree, swept, capsys):
    from reproduce import full as reproduce_full

    job = {j.name: j for j in reproduce_full.plan("tiny", str(tree["data"]), tree["runs"])}["r20_late_10_s0"]
    assert sweep.is_done(tree["runs"] / job.name) and not sweep.plan_changed(job, tree["runs"] / job.name)
    argv = list(job.argv)
    argv[argv.index("--target") + 1] = "0.3"  # the plan edited after the run finished
    edited = sweep.Job(job.name, argv, job.deps, job.meta)
    before = jobs_json(tree)
    collected: list[str] = []
    failures = sweep.train([edited], tree["runs"], n_jobs=1, threads=1, poll_s=0.1, max_hours=1 / 3600,
                           on_done=collected.append)
    out = capsys.readouterr().out
    assert failures == 1 and collected == [], out  # the old result is neither collected nor counted
    assert "0 of 1 runs already done" in out and "FAILED r20_late_10_s0" in out
    assert "finished with other arguments than planned now: target (0.1, planned 0.3)" in out
    assert jobs_json(tree) == before  # and not started again over it


FAKE_RUN = """import json, os, sys
out = sys.argv[sys.argv.index("--output_dir") + 1]
os.makedirs(os.path.join(out, "model"), exist_ok=True)
open(os.path.join(out, "model", "recipe.json"), "w").write("{}")
open(os.path.join(out, "metrics.json"), "w").write(json.dumps({"steps": 1, "total_steps": 1}))
"""


KILLED_AT_FOLD = """import os, signal, sys
marker = os.environ["KILLED_AT_FOLD_MARKER"]
sys.path.insert(0, {recipes!r})
import cifar, linearize
real = linearize.save_folded
def save_folded(*args, **kwargs):
    if not os.path.exists(marker):  # the first attempt: SIGKILLed after model/ is saved, before folded/
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
linearize.save_folded = save_folded
cifar.main(sys.argv[1:])
"""


def test_a_run_killed_before_its_fold_is_resumed_and_ends_as_an_uninterrupted_one(tree, tmp_path, monkeypatch):
    """A run with ``--fold`` SIGKILLed after its ``model/`` is saved and before ``folded/`` is written is not
    done (the harness must not count it finished without folded/); the runner resumes it from its
    checkpoint, and it ends with the model, folded model and metrics of the same run never interrupted
    (truth: that run, in another folder). Observed before: metrics.json of the whole schedule was written
    before the fold, is_done said True and the run was never resumed: folded/ missing for good."""
    from safetensors.torch import load_file as load

    monkeypatch.setenv("LINEARIZE_CACHE", str(tree["root"] / "cache"))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.delenv("LINEARIZE_CIFAR10", raising=False)
    script = tmp_path / "wrapper" / "cifar.py"  # named as the recipe: the harness reads its arguments with cifar's
    script.parent.mkdir()
    script.write_text(KILLED_AT_FOLD.format(recipes=str(RECIPES)))
    args = ["--data-dir", str(tree["data"]), "--arch", "resnet20", "--cpu", "--image-size", "8", "--batch-size", "4",
            "--eval-batch-size", "10", "--checkpointing_steps", "390", "--linearize", "prelu", "--target", "0.5",
            "--schedule", "early", "--epochs", "1", "--freeze", "--fold", "--seed", "0"]
    runs, ref = tmp_path / "runs", tmp_path / "uninterrupted"
    runs.mkdir()
    done = tmp_path / "no kill"
    done.touch()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", KILLED_AT_FOLD_MARKER=str(done))  # the runner's
    subprocess.run([sys.executable, str(script), *args, "--output_dir", str(ref)], check=True, capture_output=True,
                   timeout=600, env=env)
    monkeypatch.setenv("KILLED_AT_FOLD_MARKER", str(tmp_path / "killed once"))
    job = sweep.Job("killed", [str(script), *args, "--output_dir", str(runs / "killed")])
    assert sweep.train([job], runs, n_jobs=1, threads=1, poll_s=0.1, max_hours=1 / 60) == 1  # the SIGKILLed attempt
    assert (runs / "killed" / "model" / "recipe.json").is_file() and not (runs / "killed" / "folded").exists()
    assert not sweep.is_done(runs / "killed")
    assert sweep.train([job], runs, n_jobs=1, threads=1, poll_s=0.1, max_hours=1 / 60) == 0
    assert "--resume_from_checkpoint latest" in json.loads((runs / "jobs.json").read_text())["killed"]["command"]
    assert sweep.is_done(runs / "killed")
    folded = [f"folded/{p.name}" for p in (ref / "folded").glob("*.safetensors")]
    assert len(folded) == 1 and (runs / "killed" / "folded" / "folded.json").is_file()
    for rel in ("model/model.safetensors", *folded):
        got, want = load(str(runs / "killed" / rel)), load(str(ref / rel))
        assert got.keys() == want.keys(), rel
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, equal_nan=True, msg=f"{rel}: {k}")

    def metrics(out: Path) -> dict:
        m = json.loads((out / "metrics.json").read_text().replace(str(out), "OUT"))
        return {k: v for k, v in m.items() if k not in ("wall_time_s", "wall_time_this_process_s", "command", "args")}

    assert metrics(runs / "killed") == metrics(ref)


@pytest.mark.parametrize("damage", {
    "not UTF-8": lambda p: p.write_bytes(b"\xff\xfe{\x00}\x00"),
    "a folder": lambda p: p.mkdir(),
    "nested too deep": lambda p: p.write_text("[" * 100_000 + "]" * 100_000),
    "a JSON list": lambda p: p.write_text('[{"epoch": 1}]'),
    "a number too long": lambda p: p.write_text('{"steps": ' + "1" * 5000 + ', "total_steps": 12}'),
    "steps a string": lambda p: p.write_text('{"steps": "10", "total_steps": 12}'),
}.items(), ids=lambda d: d[0])
def test_a_damaged_metrics_json_of_one_run_never_stops_the_sweep(tmp_path, damage, capsys):
    """The runner reads every run's metrics.json at every poll: a damaged one (of run "bad") is named in a
    warning and taken as a run not done; the sweep goes on and the other run ("good", after it) ends done."""
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    runs = tmp_path / "runs"
    jobs = [sweep.Job(name, [str(script), "--output_dir", str(runs / name)]) for name in ("bad", "good")]
    (runs / "bad" / "model").mkdir(parents=True)
    (runs / "bad" / "model" / "recipe.json").write_text("{}")
    damage[1](runs / "bad" / "metrics.json")
    with pytest.warns(RuntimeWarning, match=re.escape(str(runs / "bad" / "metrics.json"))):
        failures = sweep.train(jobs, runs, n_jobs=1, threads=1, poll_s=0.1, max_hours=1 / 60)
    out = capsys.readouterr().out
    assert sweep.is_done(runs / "good") and "done good: rc 0" in out, out
    # "bad" was started again: it rewrote its metrics.json, or failed (a folder in the way) with its log named
    assert failures == (damage[0] == "a folder") and sweep.is_done(runs / "bad") == (damage[0] != "a folder"), out


@pytest.mark.parametrize("damage", [
    lambda raw: raw.replace(b"run3", b"\xffun3"), lambda raw: b"[" + raw + b"]", lambda raw: raw[:-7],
    lambda raw: raw.replace(b'"run3"', b"run3"), lambda raw: b""],
    ids=["not UTF-8", "a JSON list", "cut short", "invalid JSON", "empty"])
def test_a_damaged_jobs_json_stops_the_runner_and_keeps_every_record(tmp_path, damage):
    """RUNS/jobs.json (every run's launches and exit codes, shared by all runners) with one damaged byte, a
    JSON list, cut short, invalid JSON, or empty: recording a run stops with an error naming the file and the
    fix, and the file keeps its bytes (invalid JSON was read as no records, and rewritten without them)."""
    records = {f"run{i}": {"attempts": 2, "returncode": 0} for i in range(1, 6)}
    damaged = damage(json.dumps(records).encode())
    (tmp_path / "jobs.json").write_bytes(damaged)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "jobs.json")) + r".*repair it, or move it aside"):
        sweep._record(tmp_path, "run5", {"returncode": 0, "ended": 1.0})
    assert (tmp_path / "jobs.json").read_bytes() == damaged


def test_an_invalid_jobs_json_stops_the_sweep_before_any_run_starts(tmp_path):
    """A jobs.json that is not valid JSON (it was read as no records, and rewritten without them once a run
    started): the sweep stops with an error naming the file and the fix, starts no run, and the file keeps its
    bytes."""
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    runs = tmp_path / "runs"
    runs.mkdir()
    damaged = b'{"run1": {"attempts": 2, "returncode": 0}, "run2": {"attempts": 1, '
    (runs / "jobs.json").write_bytes(damaged)
    jobs = [sweep.Job("a", [str(script), "--output_dir", str(runs / "a")])]
    with pytest.raises(ValueError, match=re.escape(str(runs / "jobs.json")) + r".*repair it, or move it aside"):
        sweep.train(jobs, runs, n_jobs=1, threads=1, poll_s=0.1, max_hours=1 / 60)
    assert (runs / "jobs.json").read_bytes() == damaged
    assert sorted(p.name for p in runs.iterdir()) == ["jobs.json"]  # no run started, no log, no lock


RECORDER = """import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from reproduce import sweep
runs, tag, n = Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
(runs / f"ready-{tag}").touch()
while len(list(runs.glob("ready-*"))) < 2:  # both runners record at the same time
    time.sleep(0.01)
for i in range(n):
    sweep._record(runs, f"{tag}{i}", {"started": time.time(), "attempts": 1})
"""


def test_two_runners_recording_at_once_keep_every_record(tmp_path):
    """Two runners sharing RUNS/jobs.json record 100 runs each at the same time: every record of both is
    there after (each read jobs.json, merged its entry and wrote it back unlocked, erasing the entries the
    other wrote meanwhile). Truth: the names each process was told to record."""
    n = 100
    procs = [subprocess.Popen([sys.executable, "-c", RECORDER, str(RECIPES), str(tmp_path), tag, str(n)],
                              env=dict(os.environ, PYTHONPATH=str(REPO))) for tag in ("a", "b")]
    for p in procs:
        assert p.wait(timeout=300) == 0
    recorded = json.loads((tmp_path / "jobs.json").read_text())
    assert sorted(recorded) == sorted(f"{tag}{i}" for tag in ("a", "b") for i in range(n))
    assert all(r["attempts"] == 1 for r in recorded.values())


def test_a_runs_folder_that_cannot_lock_still_records_with_a_warning(tmp_path, monkeypatch):
    """Where the filesystem cannot lock files (flock fails: NFS without its lock manager), recording a run goes
    on unlocked with a warning naming the folder, and the record is written."""
    import errno

    from linearize import _files

    monkeypatch.setattr(_files, "flock_error", lambda path: OSError(errno.ENOLCK, "No locks available"))
    with pytest.warns(RuntimeWarning, match=re.escape(str(tmp_path)) + ".*cannot lock files"):
        sweep._record(tmp_path, "run1", {"attempts": 1})
    assert json.loads((tmp_path / "jobs.json").read_text()) == {"run1": {"attempts": 1}}


FIFO_READER = """import sys, warnings
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from reproduce import sweep
run, runs = Path(sys.argv[2]), Path(sys.argv[3])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    print("done:", sweep.is_done(run))
for w in caught:
    print("warning:", w.message)
try:
    sweep.train([], runs, n_jobs=1, threads=1)
except ValueError as e:
    print("refused:", e)
"""


def test_a_fifo_metrics_json_or_jobs_json_never_hangs_the_runner(tmp_path):
    """A FIFO named metrics.json in a run folder (left by a logging tool, a crafted runs folder) or RUNS/jobs.json:
    reading it waited for a writer forever, and the runner reads them at every start and poll. The metrics.json
    is named in a warning and the run taken as not done (it has no metrics), and the jobs.json stops the runner
    at once with an error naming it; the FIFO is left as it was. Run in a child process with a timeout, so that a
    hang fails the test instead of stopping it."""
    runs = tmp_path / "runs"
    (runs / "late" / "model").mkdir(parents=True)
    (runs / "late" / "model" / "recipe.json").write_text("{}")
    os.mkfifo(runs / "late" / "metrics.json")
    os.mkfifo(runs / "jobs.json")
    try:
        proc = subprocess.run([sys.executable, "-c", FIFO_READER, str(RECIPES), str(runs / "late"), str(runs)],
                              env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("reading a FIFO metrics.json or jobs.json hung (no answer in 120 s)")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and "done: False" in lines, proc.stdout + proc.stderr
    warned = f"warning: {runs / 'late' / 'metrics.json'}"
    assert any(line.startswith(warned) and "FIFO" in line for line in lines), lines
    assert any(line.startswith(f"refused: {runs / 'jobs.json'}") and "FIFO" in line
               and "repair it, or move it aside" in line for line in lines), lines
    assert stat.S_ISFIFO(os.stat(runs / "jobs.json").st_mode)


def started_by_hand(argv: list[str]) -> subprocess.Popen:
    """A process whose command line is that of a recipe run (it only sleeps), once ``/proc`` shows it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"] + argv)
    out = os.path.realpath(argv[argv.index("--output_dir") + 1])
    for _ in range(100):
        if out in sweep.recipe_processes():
            return proc
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"no process with --output_dir {out} in /proc")


def _accuracy_stats(results: Path, names: list[str]) -> tuple[float, float, float]:
    acc = [json.loads((results / n / "metrics.json").read_text())["test_accuracy"] for n in names]
    return sum(acc) / len(acc), min(acc), max(acc)


def analyze(tree: dict, results: Path, data: bool = True) -> None:
    from reproduce import cli as reproduce

    args = ["--scale", "tiny", "--stage", "analyze", "--runs-dir", str(tree["root"] / "runs"), "--results-dir",
            str(results), "--latency-reps", "2"]
    assert reproduce.main(args + (["--cifar", str(tree["data"])] if data else [])) == 0


def test_analyze_table_and_plots(tree, swept, tmp_path, monkeypatch):
    monkeypatch.delenv("LINEARIZE_CIFAR10", raising=False)
    results = tmp_path / "results"
    shutil.copytree(tree["results"], results)
    # second seeds (copies of seed 0) and accuracies the test chooses
    for name in ("r20_base", "r20_late_10"):
        shutil.copytree(results / f"{name}_s0", results / f"{name}_s1")
    for name, acc in (("r20_base_s0", 0.30), ("r20_base_s1", 0.42), ("r20_late_10_s0", 0.35),
                      ("r20_late_10_s1", 0.39), ("r20_early_10_s0", 0.25)):
        m = json.loads((results / name / "metrics.json").read_text())
        m["test_accuracy"] = acc
        (results / name / "metrics.json").write_text(json.dumps(m))
    analyze(tree, results)
    out = results / "tiny"
    res = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    for key, names in (("base", ["r20_base_s0", "r20_base_s1"]), ("late_10", ["r20_late_10_s0", "r20_late_10_s1"])):
        mean, lo, hi = _accuracy_stats(results, names)
        a = res["configs"][key]["accuracy"]
        assert (a["n"], a["mean"], a["min"], a["max"]) == (2, pytest.approx(mean), lo, hi)
        assert f"{100 * mean:.2f} [{100 * lo:.2f}, {100 * hi:.2f}] (n=2)" in md
    assert res["configs"]["late_10"]["vs_baseline_points"] == pytest.approx(100 * (0.37 - 0.36))
    assert res["configs"]["late_25"]["accuracy"] is None and "| late 25% | missing |" in md
    assert "r20_late_25_s0" in res["missing"] and res["skipped"] == []
    # the goal sentences come from these numbers: +1.00 point (reproduces), late - early at 10% +12.00
    # points, [+10.00, +14.00] over the pairs of seeds, early with one seed only
    assert "+1.00 points" in md and "**reproduces**" in md
    assert "+12.00 points" in md and "[+10.00, +14.00]" in md and "one seed on a side" in md
    assert "**Late - early at 2%**: not measured yet" in md
    for png in ("accuracy_vs_fraction.png", "path_length_vs_accuracy.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # per-run measurements: the path lengths of a fresh library call, the fold error small
    import cifar
    import linearize

    model = cifar.load_model(results / "r20_late_10_s0" / "model")
    apl = linearize.measures.average_path_length(model, torch.zeros(2, 3, 8, 8), tol=1e-3, detailed=True)
    run = res["runs"]["r20_late_10_s0"]
    assert run["apl"]["normalized"] == pytest.approx(apl.normalized)
    assert run["apl"]["unnormalized"] == pytest.approx(apl.unnormalized)
    assert sum(s["nonlinear"] for s in run["sites"].values()) == linearize.count_units(model, 1e-3)["nonlinear"]
    assert run["fold"]["max_abs_error"] <= 1e-4 * run["fold"]["output_scale"]
    # parameters after fold: the baseline folded here, counted by hand, is the table's baseline cell
    base = linearize.fold(cifar.load_model(results / "r20_base_s0" / "model").eval(), torch.zeros(2, 3, 8, 8),
                          latency=False)
    assert res["runs"]["r20_base_s0"]["fold"]["params_after"] == sum(p.numel() for p in base.parameters())
    late, b = res["configs"]["late_10"], res["configs"]["base"]
    assert f"{late['params_after_fold']:,.0f} ({late['params_after_fold'] / b['params_after_fold']:.3f}x)" in md
    assert set(res["latency"]["ms"]) >= {"r20_late_10_s0/folded", "r20_base_s0/folded", "r20_base_s0/as trained"}

    # without the data: the table from the committed metrics and caches; a run not measured yet is named
    for name in ("r20_base_s0", "r20_base_s1", "r20_late_10_s0", "r20_late_10_s1", "r20_early_10_s0"):
        m = json.loads((results / name / "metrics.json").read_text())
        m["args"]["data_dir"] = str(tmp_path / "gone")
        (results / name / "metrics.json").write_text(json.dumps(m))
    (results / "r20_early_10_s0" / "analysis.json").unlink()
    analyze(tree, results, data=False)
    res2 = json.loads((out / "results.json").read_text())
    md2 = (out / "results.md").read_text()
    assert res2["configs"]["base"]["accuracy"] == res["configs"]["base"]["accuracy"]
    assert res2["runs"]["r20_late_10_s0"]["fold"] == res["runs"]["r20_late_10_s0"]["fold"]  # from the cache
    assert res2["skipped"] == ["fold of r20_early_10_s0"]
    assert res2["latency"] == res["latency"]  # the same models: the measurements of the first analysis
    assert "Skipped for want of the CIFAR-10 test images" in md2
    assert res2["runs"]["r20_early_10_s0"]["apl"] == res["runs"]["r20_early_10_s0"]["apl"]  # needs no data


@pytest.mark.skipif(not _has_classes_option(), reason="recipes/cifar.py has no --classes option yet (the class-subset "
                    "runs r20_c2_*/r20_c5_* need it)")
def test_help_and_report_title_say_what_each_sweep_studies(capsys):
    """``--help`` and the title of the full sweep's page name the studies in words, never an internal issue."""
    from reproduce import cli
    from reproduce import full as F

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "full (late vs early linearization of ResNet-20), speed (linearize MobileNet-V2 for speed)" in out
    assert "issue" not in out.lower()
    md = F._report({"configs": {}, "runs": {}, "latency": {}, "scale": "tiny", "claims": [], "missing": [],
                    "skipped": []}, [])
    assert md[0] == "# Late vs early linearization of ResNet-20 on CIFAR-10 (tiny)"
    assert "issue" not in "\n".join(md).lower()


def test_class_subset_runs(tree, swept):
    reproduce(tree, "--stage", "all", "--only", "r20_c2_late_5_s0,r20_c2_base_s0")
    recipe = json.loads((tree["results"] / "r20_c2_late_5_s0" / "model" / "recipe.json").read_text())
    assert recipe["num_classes"] == 2
    m = json.loads((tree["results"] / "r20_c2_base_s0" / "metrics.json").read_text())
    assert m["train_images"] == 4 and m["test_images"] == 2  # airplane + automobile: 2 train, 1 test image each
    res = json.loads((tree["results"] / "tiny" / "results.json").read_text())
    import cifar
    import linearize

    model = cifar.load_model(tree["results"] / "r20_c2_late_5_s0" / "model")
    sites = linearize.count_units(model, 1e-3)["sites"]
    assert {k: v["nonlinear"] for k, v in res["runs"]["r20_c2_late_5_s0"]["sites"].items()} == \
        {k: v["nonlinear"] for k, v in sites.items()}
    md = (tree["results"] / "tiny" / "results.md").read_text()
    assert "| 2 classes |" in md and (tree["results"] / "tiny" / "nonlinear_sites.png").exists()


def test_late_10_variants_start_from_the_same_baselines_with_their_own_arguments(tmp_path):
    import cifar
    from reproduce import full as F

    jobs = {j.name: j for j in F.plan("full", "data.tar.gz", tmp_path)}
    plain = vars(cifar.parse_args(jobs["r20_late_10_s1"].argv[1:]))
    for name, (extra, want) in {"r20_late_10_sal_s1": ({"select": "saliency"}, "--select saliency"),
                                "r20_late_10_kd_s1": ({"distill": 0.9},
                                                      "distilled from the baseline"),
                                "r20_late_10_long_s1": ({"epochs": 20, "ramp_end": 0.4},
                                                        "20 epochs, target at 40%")}.items():
        job = jobs[name]
        args = vars(cifar.parse_args(job.argv[1:]))
        assert job.deps == ("r20_base_s1",) and args["init_from"] == str(tmp_path / "r20_base_s1" / "model")
        assert {k: v for k, v in args.items() if plain[k] != v and k != "channels_last"} == {
            **extra, "output_dir": str(tmp_path / name)}
        assert job.meta["config"] == name[4:-3] and F._label({**job.meta}) == f"late 10% ({want})"
    assert F.run_name("c10", "late", 0.1, 0, "kd") == "r20_late_10_kd_s0"
    # runs started before --channels-last resume without it (their checkpoints' fingerprint); all others use it
    assert F.STARTED_CONTIGUOUS < set(jobs)
    for name, job in jobs.items():
        assert vars(cifar.parse_args(job.argv[1:]))["channels_last"] == (name not in F.STARTED_CONTIGUOUS), name


def test_park_and_unpark_carry_an_unfinished_run_to_a_fresh_machine(tree, tmp_path):
    import common
    from reproduce import full as F

    runs, results = tmp_path / "runs", tmp_path / "results"
    job = {j.name: j for j in F.plan("tiny", str(tree["data"]), runs)}["r20_base_s0"]

    def recipe(*extra: str) -> None:
        proc = subprocess.run([sys.executable, *job.argv, *extra], env=tree["env"], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    recipe("--stop-after", "2")  # unfinished, with the checkpoint of step 2
    src = common.checkpoint_dir(runs / job.name, 2)
    parked = F.park(runs, results, job.name)
    assert parked == results / "inflight" / job.name / src.name
    assert {f.name: f.read_bytes() for f in parked.iterdir()} == {f.name: f.read_bytes() for f in src.iterdir()}
    assert not [p for p in parked.parent.iterdir() if p != parked]  # no temporary folder left
    shutil.rmtree(runs)  # a fresh machine: the git-ignored run folders are gone, the committed results are not
    assert F.unpark(runs, results, job.name) == src
    assert common.find_checkpoint("latest", runs / job.name)[0].step == 2
    assert F.unpark(runs, results, job.name) is None  # the run has a checkpoint of its own now
    recipe("--resume_from_checkpoint", "latest")
    assert json.loads((runs / job.name / "metrics.json").read_text())["steps"] == 5
    assert F.park(runs, results, job.name) is None  # finished: nothing to park
    assert F.collect(runs, results, job.name) and not (results / "inflight" / job.name).exists()


def test_interleaved_latency_reports_per_call_times_against_a_sleeping_model():
    """A model that sleeps 3 ms per call: the batch-1 input is timed over 10 calls per repetition, yet
    both inputs report about 3 ms per call (the clock, not the code, is the truth)."""
    from reproduce import measure as reproduce

    class Sleeper(torch.nn.Module):
        def forward(self, x):
            time.sleep(0.003)
            return x

    got = reproduce.interleaved_latency({"m": Sleeper()}, {"b1": torch.zeros(1, 2), "b4": torch.zeros(4, 2)}, reps=5)
    assert set(got) == {"m"} and set(got["m"]) == {"b1", "b4"}
    for ms in got["m"].values():
        assert 3.0 <= ms < 6.0, got
