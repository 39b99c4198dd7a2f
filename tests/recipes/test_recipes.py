"""End-to-end smoke runs of the Accelerate recipes on the real data (tiny subsets, this CPU).

Each recipe runs as a subprocess, with plain ``python`` and with ``accelerate launch --multi_gpu
--num_processes 2`` (real DDP over gloo on the CPU). Checked: metrics.json contents, the saved model loads
back, an interrupted + resumed run ends with the same slopes (and weights) as an uninterrupted
one (also under 2 processes), 1 and 2 processes reach the same nonlinear fraction, and bad input fails
with a clear error. Kill -9 and resume across epochs, and damaged checkpoints: ``tests/recipes/test_resume.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import linearize

from linearize.serialization import load_unit_tensors

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
sys.path.insert(0, str(RECIPES))

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared beside the checkout
CIFAR = Path(os.environ.get("LINEARIZE_CIFAR10", SHARED_DATA / "cifar10-jpeg.tar.gz"))
MULTI30K = Path(os.environ.get("LINEARIZE_MULTI30K", SHARED_DATA / "multi30k"))
needs_cifar = pytest.mark.skipif(not CIFAR.exists(), reason=f"real CIFAR-10 images not found at {CIFAR} "
                                 "(set LINEARIZE_CIFAR10 to the .tar.gz or image folder)")
needs_multi30k = pytest.mark.skipif(not (MULTI30K / "train.jsonl.gz").exists(),
                                    reason=f"Multi30k JSONL not found under {MULTI30K} (set LINEARIZE_MULTI30K)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipe(script: str, args: list[str], processes: int = 1) -> None:
    """Run a recipe in a subprocess (``accelerate launch`` for several processes); fail with its log."""
    if processes == 1:
        cmd = [sys.executable, str(RECIPES / script)]
    else:
        # `accelerate launch --cpu --num_processes N` starts ONE process unless mpirun is set up
        # (accelerate 1.x); --multi_gpu goes through torchrun and gives N gloo processes on a CPU.
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(_free_port()), str(RECIPES / script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run(cmd + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd + args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def slopes(run: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_unit_tensors(run / "model").items() if k.endswith(".slope")}


def assert_same_tensors(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, equal_nan=True, msg=lambda m: f"{k}: {m}")


# ----------------------------------------------------------------------------- CIFAR


@pytest.fixture(scope="module")
def cifar_args(tmp_path_factory) -> list[str]:
    cache = tmp_path_factory.mktemp("cifar-cache")
    return ["--data-dir", str(CIFAR), "--cache-dir", str(cache), "--subset", "256", "--eval-subset", "128",
            "--image-size", "16", "--arch", "resnet20", "--batch-size", "32", "--eval-batch-size", "64",
            "--epochs", "1", "--lr", "0.05", "--schedule", "early", "--target", "0.25", "--ramp-end", "0.75",
            "--log-every", "2"]


@pytest.fixture(scope="module")
def cifar_full(cifar_args, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cifar-full")
    run_recipe("cifar.py", cifar_args + ["--output_dir", str(out), "--fold", "--report"])
    return out


@needs_cifar
def test_cifar_metrics_and_model(cifar_full):
    m = metrics(cifar_full)
    assert m["steps"] == m["total_steps"] == 8  # 256 images / batch 32, one epoch
    assert m["train_images"] == 256 and m["test_images"] == 128
    assert 0.0 <= m["test_accuracy"] <= 1.0 and m["test_loss"] > 0
    # the target schedule holds exactly round(0.25 * C) nonlinear channels after --ramp-end
    assert m["units_nonlinear"] == round(0.25 * m["units_total"])
    assert m["nonlinear_fraction"] == pytest.approx(0.25, abs=1 / m["units_total"])
    assert "cifar.py" in m["command"] and m["versions"]["torch"] == torch.__version__
    assert m["wall_time_s"] > 0 and m["num_processes"] == 1

    import cifar

    model = cifar.load_model(cifar_full / "model")

    loaded = {f"{n}.slope": u.slope.detach() for n, u in linearize.units(model)}
    assert_same_tensors(loaded, slopes(cifar_full), atol=0)
    assert linearize.nonlinear_fraction(model) == pytest.approx(m["nonlinear_fraction"])

    # --fold: a plain model with the same function; --report: the report files
    meta = json.loads((cifar_full / "model" / "recipe.json").read_text())
    assert not (cifar_full / "folded.pt").exists()  # no pickle: safetensors + JSON, rebuilt on the recipe's base
    folded = linearize.load_folded(cifar_full / "folded", base=cifar.build_model(meta["arch"], meta["num_classes"]))
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model.eval()(x), rtol=1e-4, atol=1e-4)
    assert m["fold"]["params_after"] <= m["fold"]["params_before"]
    assert json.loads((cifar_full / "report" / "report.json").read_text())


@needs_cifar
def test_cifar_resume_matches_uninterrupted(cifar_args, cifar_full, tmp_path):
    out = tmp_path / "run"
    run_recipe("cifar.py", cifar_args + ["--output_dir", str(out), "--stop-after", "3"])
    assert metrics(out)["steps"] == 3
    run_recipe("cifar.py", cifar_args + ["--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert metrics(out)["steps"] == 8
    assert_same_tensors(slopes(out), slopes(cifar_full), atol=0)
    assert_same_tensors(load_file(str(out / "model" / "model.safetensors")),
                        load_file(str(cifar_full / "model" / "model.safetensors")), atol=0)


@needs_cifar
def test_cifar_two_processes(cifar_args, cifar_full, tmp_path):
    run_recipe("cifar.py", cifar_args + ["--output_dir", str(tmp_path), "--checkpointing_steps", "3",
                                         "--keep_checkpoints", "0"], processes=2)
    one, two = metrics(cifar_full), metrics(tmp_path)
    assert two["num_processes"] == 2 and two["steps"] == one["steps"]
    assert two["test_images"] == one["test_images"] == 128  # gather_for_metrics drops no / adds no image
    assert two["nonlinear_fraction"] == pytest.approx(one["nonlinear_fraction"], abs=0.02)
    # the main process wrote step 3, both processes load it: the run ends as the uninterrupted one
    resumed = tmp_path / "resumed"
    run_recipe("cifar.py", cifar_args + ["--output_dir", str(resumed), "--resume_from_checkpoint",
                                         str(tmp_path / "checkpoints" / "step_00000003")], processes=2)
    assert_same_tensors(load_file(str(resumed / "model" / "model.safetensors")),
                        load_file(str(tmp_path / "model" / "model.safetensors")), atol=0)
    assert_same_tensors(load_unit_tensors(resumed / "model"), load_unit_tensors(tmp_path / "model"), atol=0)


# ----------------------------------------------------------------------------- WMT (Multi30k)


@pytest.fixture(scope="module")
def wmt_args() -> list[str]:
    return ["--train-file", str(MULTI30K / "train.jsonl.gz"), "--test-file", str(MULTI30K / "test.jsonl.gz"),
            "--max-train-samples", "200", "--max-eval-samples", "8", "--model-size", "tiny", "--vocab-size", "400",
            "--max-tokens", "800", "--epochs", "1", "--num-beams", "2", "--schedule", "early",
            "--target", "0.25", "--ramp-end", "0.6", "--log-every", "2"]


@pytest.fixture(scope="module")
def wmt_full(wmt_args, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wmt-full")
    run_recipe("wmt14.py", wmt_args + ["--output_dir", str(out), "--freeze", "--fold"])
    return out


@needs_multi30k
def test_wmt_metrics_and_model(wmt_full):
    m = metrics(wmt_full)
    assert m["eval_pairs"] == 8 and m["train_pairs"] == 200 and m["steps"] == m["total_steps"] > 3
    assert 0.0 <= m["bleu"] <= 100.0
    assert m["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert m["units_nonlinear"] == round(0.25 * m["units_total"])
    assert len((wmt_full / "test_hypotheses.txt").read_text().splitlines()) == 8
    # tiny preset: one encoder and one decoder FFN, d = 64 -> 128 -> 64. After fold each FFN keeps its k
    # nonlinear channels plus a d-wide linear passthrough: d k + (k + d) d MACs per token.
    fold = m["fold"]
    assert fold["ffn_macs_per_token"]["before"] == 2 * (64 * 128 + 128 * 64)
    assert fold["ffn_macs_per_token"]["after"] == 2 * 64 * m["units_nonlinear"] + 2 * 64 * 64
    assert fold["flops_after"] < fold["flops_before"] and fold["max_abs_error"] <= 1e-4 * fold["output_scale"]

    import wmt14

    model, tokenizer = wmt14.load_model(wmt_full / "model"), wmt14.load_tokenizer(wmt_full / "model")
    loaded = {f"{n}.slope": u.slope.detach() for n, u in linearize.units(model)}
    assert_same_tensors(loaded, slopes(wmt_full), atol=0)
    assert tokenizer("a dog").input_ids[-1] == wmt14.EOS


@needs_multi30k
def test_wmt_resume_and_two_processes(wmt_args, wmt_full, tmp_path):
    out = tmp_path / "run"
    run_recipe("wmt14.py", wmt_args + ["--output_dir", str(out), "--stop-after", "2"])
    run_recipe("wmt14.py", wmt_args + ["--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert metrics(out)["steps"] == metrics(wmt_full)["steps"]
    assert_same_tensors(slopes(out), slopes(wmt_full))

    two = tmp_path / "two"
    run_recipe("wmt14.py", wmt_args + ["--output_dir", str(two)], processes=2)
    m2 = metrics(two)
    assert m2["num_processes"] == 2 and m2["eval_pairs"] == 8
    assert m2["nonlinear_fraction"] == pytest.approx(metrics(wmt_full)["nonlinear_fraction"], abs=0.02)


# ----------------------------------------------------------------------------- bad input


def test_target_outside_range(tmp_path):
    import cifar

    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ValueError, match=r"--target .* \(0, 1\]"):
            cifar.parse_args(["--output_dir", str(tmp_path), "--target", bad])


def test_image_size_above_its_bound_is_refused(tmp_path, capsys):
    """--image-size is bounded as recipe.json's image_size is on load (cifar.load_model), so every run's model
    loads: more is refused at the command line, naming the flag and the bound."""
    import cifar

    with pytest.raises(SystemExit):
        cifar.parse_args(["--output_dir", str(tmp_path), "--image-size", "1025"])
    assert "--image-size 1025 is more than 1024" in capsys.readouterr().err
    assert cifar.parse_args(["--output_dir", str(tmp_path), "--image-size", "1024"]).image_size == 1024


def test_default_pressure_matches_each_recipes_optimizer(tmp_path):
    """Both recipes default to the scale-free pressure (no per-optimizer lam); --lam stays the legacy knob."""
    import cifar
    import wmt14

    for recipe in (wmt14, cifar):
        args = recipe.parse_args(["--output_dir", str(tmp_path)])
        assert args.lam is None and args.rate is None
    # --lam pushes every slope, which wmt14.py's default --select saliency does not: it needs --select slope
    assert wmt14.parse_args(["--output_dir", str(tmp_path), "--select", "slope", "--lam", "0.001"]).lam == 1e-3
    assert cifar.parse_args(["--output_dir", str(tmp_path), "--rate", "1e-4"]).rate == 1e-4


def test_missing_cifar_data_hints(tmp_path):
    import cifar

    with pytest.raises(FileNotFoundError, match="--download"):
        cifar.main(["--output_dir", str(tmp_path / "o"), "--data-dir", str(tmp_path / "nope"),
                    "--cache-dir", str(tmp_path / "c")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"train/<class>/\*\.jpg"):
        cifar.main(["--output_dir", str(tmp_path / "o"), "--data-dir", str(tmp_path / "empty"),
                    "--cache-dir", str(tmp_path / "c")])


@needs_multi30k
def test_language_pair_not_in_data(tmp_path):
    import wmt14

    with pytest.raises(ValueError, match=r"language pair en-fr .* \['de', 'en'\]"):
        wmt14.main(["--output_dir", str(tmp_path), "--train-file", str(MULTI30K / "validation.jsonl.gz"),
                    "--target-lang", "fr"])


@needs_cifar
def test_checkpoint_from_another_model(cifar_args, cifar_full, tmp_path):
    import cifar

    args = [a if a != "resnet20" else "resnet56" for a in cifar_args]
    with pytest.raises(ValueError, match="written by another model"):
        cifar.main(args + ["--output_dir", str(tmp_path), "--resume_from_checkpoint", str(cifar_full)])


@needs_cifar
def test_init_from_a_trained_baseline(cifar_args, cifar_full, tmp_path):
    import cifar

    base = tmp_path / "base"
    pressure = {"--schedule", "--target", "--ramp-end"}  # no-ops (refused) without units
    plain = [a for i, a in enumerate(cifar_args) if a not in pressure and cifar_args[i - 1] not in pressure]
    run_recipe("cifar.py", plain + ["--linearize", "none", "--max-steps", "2", "--output_dir", str(base)])
    late = tmp_path / "late"  # lr 0: the weights must stay those of the baseline
    run_recipe("cifar.py", cifar_args + ["--init-from", str(base / "model"), "--lr", "0", "--max-steps", "2",
                                         "--output_dir", str(late)])
    trained, started = cifar.load_model(base / "model"), cifar.load_model(late / "model")
    for name, weight in trained.named_parameters():
        torch.testing.assert_close(dict(started.named_parameters())[name], weight, rtol=0, atol=0)
    kd = tmp_path / "kd"  # distillation from the --init-from network: runs, and is recorded
    run_recipe("cifar.py", cifar_args + ["--init-from", str(base / "model"), "--distill", "0.5", "--max-steps", "2",
                                         "--output_dir", str(kd)])
    assert metrics(kd)["args"]["distill"] == 0.5 and metrics(kd)["args"]["distill_temperature"] == 4.0
    with pytest.raises(ValueError, match="holds a --linearize prelu model"):
        cifar.main(cifar_args + ["--init-from", str(cifar_full / "model"), "--output_dir", str(tmp_path / "x")])
    with pytest.raises(FileNotFoundError, match="no recipe.json"):
        cifar.main(cifar_args + ["--init-from", str(tmp_path), "--output_dir", str(tmp_path / "y")])


@pytest.mark.parametrize("bad, match", [(["--distill", "0.5"], "needs a teacher"),
                                        (["--distill", "1.5", "--init-from", "x"], "weight in"),
                                        (["--distill", "nan", "--init-from", "x"], "weight in"),
                                        (["--distill-temperature", "2"], "add --distill"),
                                        (["--distill", "0.5", "--init-from", "x", "--distill-temperature", "0"],
                                         "(0, 1e4)"),
                                        (["--distill", "0.5", "--init-from", "x", "--distill-temperature", "inf"],
                                         "(0, 1e4)")])
def test_distill_arguments_refused(bad, match, capsys, tmp_path):
    import cifar

    with pytest.raises(SystemExit):
        cifar.parse_args(["--output_dir", str(tmp_path)] + bad)
    assert match in capsys.readouterr().err


@needs_cifar
def test_cifar_mobilenet_cost_target(cifar_args, tmp_path):
    """--target-flops on MobileNet-V2 (whole blocks linear): the folded model's FLOPs, counted here by
    folding the saved model and the same model with every slope at 0, meet the budget."""
    import cifar
    from linearize.folding import count_flops

    args = [a if a != "resnet20" else "mobilenet_v2_x0_35" for a in cifar_args]
    i = args.index("--target")
    args = args[:i] + args[i + 2:]  # a cost target instead of the nonlinear fraction
    # 0.85, not 0.7: fewer blocks to add, and the plan folds every remaining block once per block it adds
    run_recipe("cifar.py", args + ["--granularity", "block", "--target-flops", "0.85", "--freeze", "--fold",
                                   "--output_dir", str(tmp_path)])
    model = cifar.load_model(tmp_path / "model").eval()
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    nonlinear = cifar.load_model(tmp_path / "model").eval()
    with torch.no_grad():
        for _, u in linearize.units(nonlinear):
            u.slope.zero_()
    flops = [count_flops(linearize.fold(m, x, latency=False), x) for m in (model, nonlinear)]
    assert flops[0] <= 0.85 * flops[1] and metrics(tmp_path)["nonlinear_fraction"] < 1.0
    assert metrics(tmp_path)["args"]["target_flops"] == 0.85


@pytest.mark.parametrize("bad, match", [(["--target-flops", "0.5"], "granularity site"),
                                        (["--target-flops", "0.5", "--target-latency", "0.5",
                                          "--granularity", "block"], "give one target"),
                                        (["--target-flops", "0.5", "--target", "0.3", "--granularity", "block"],
                                         "give one target"),
                                        (["--target-latency", "1.5", "--granularity", "site"], r"\(0, 1\]")])
def test_cost_target_arguments_refused(bad, match, tmp_path):
    import cifar

    with pytest.raises(ValueError, match=match):
        cifar.parse_args(["--output_dir", str(tmp_path)] + bad)


@needs_cifar
def test_channels_last_run_resumes_exactly_and_only_with_its_flag(cifar_args, cifar_full, tmp_path):
    """--channels-last: an interrupted + resumed run ends where the uninterrupted one does (bit for bit), a
    resume without the flag is refused, and the saved model is the contiguous recipe model (load_model)
    computing what the run's own float64 copy in contiguous memory computes."""
    import cifar

    full, cut = tmp_path / "full", tmp_path / "cut"
    run_recipe("cifar.py", cifar_args + ["--channels-last", "--output_dir", str(full)])
    run_recipe("cifar.py", cifar_args + ["--channels-last", "--output_dir", str(cut), "--stop-after", "3"])
    with pytest.raises(ValueError, match="channels-last"):
        cifar.main(cifar_args + ["--output_dir", str(cut), "--resume_from_checkpoint", "latest"])
    run_recipe("cifar.py", cifar_args + ["--channels-last", "--output_dir", str(cut), "--resume_from_checkpoint",
                                         "latest"])
    assert_same_tensors(slopes(cut), slopes(full), atol=0)
    assert_same_tensors(load_file(str(cut / "model" / "model.safetensors")),
                        load_file(str(full / "model" / "model.safetensors")), atol=0)
    assert metrics(full)["args"]["channels_last"] is True
    model = cifar.load_model(full / "model").eval()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    fast = model.to(memory_format=torch.channels_last)
    with torch.no_grad():
        got = fast(x.contiguous(memory_format=torch.channels_last))
        want = cifar.load_model(full / "model").double().eval()(x.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
