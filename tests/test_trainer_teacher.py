"""``LinearizeCallback(teacher=...)`` in a Hugging Face Trainer: a classifier still learns its labels, the
predictions keep their standard shape, the teacher is never modified, and the student is refused as its own
teacher. A tiny BERT built from a config (no downloads) on a separable synthetic task."""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import linearize
from linearize import schedules as S

transformers = pytest.importorskip("transformers")
from linearize.integrations import LinearizeCallback, LinearizeTrainerMixin  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, LENGTH = 100, 8


class LinearizeTrainer(LinearizeTrainerMixin, transformers.Trainer):
    pass


def tiny_bert() -> torch.nn.Module:
    """A fresh ``BertForSequenceClassification`` (2 labels), dropout off so that the loss is a function of the batch."""
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=VOCAB, num_labels=2, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def separable(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Label 1: every token in [50, 100); label 0: every token in [1, 50). Half of each, so chance is 0.5."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        label = i % 2
        ids = torch.randint(1 + 49 * label, 50 + 50 * label, (LENGTH,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones(LENGTH, dtype=torch.long),
                     "labels": torch.tensor(label)})
    return rows


def batch_of(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def convert(model: torch.nn.Module) -> torch.nn.Module:
    example = {k: v for k, v in batch_of(separable(2, 9)).items() if k != "labels"}
    return linearize.convert(model, example_inputs=example)


def trainer_for(model, callback, tmp_path, trainer_cls=LinearizeTrainer, max_steps=200, compute_metrics=None):
    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=16, per_device_eval_batch_size=32, max_steps=max_steps,
        learning_rate=1e-3, weight_decay=0.0, logging_steps=50, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0, dataloader_num_workers=0)
    return trainer_cls(model=model, args=args, train_dataset=separable(128, 0), eval_dataset=separable(64, 1),
                       callbacks=[callback], compute_metrics=compute_metrics)


def test_with_a_teacher_a_classifier_learns_its_labels_and_metrics_get_the_logits(tmp_path):
    """The README's setup: a fresh head, the original model as teacher, labelled batches. The loss dropped the
    labels (only the hidden states' distance to the teacher's, which the head does not change: accuracy 0.5,
    chance) and the predictions were (logits, hidden_states), a tuple; now the loss is the model's own plus
    the distillation term, the head learns, and compute_metrics gets the [n, num_labels] logits."""
    model = tiny_bert()
    original = copy.deepcopy(model)
    model = convert(model)
    seen = []

    def compute_metrics(p) -> dict[str, float]:
        seen.append(p.predictions)
        return {"accuracy": float((np.argmax(p.predictions, -1) == p.label_ids).mean())}

    callback = LinearizeCallback(schedule=S.target(0.5, start=0, end=0.5), teacher=original)
    trainer = trainer_for(model, callback, tmp_path, compute_metrics=compute_metrics)
    batch = batch_of(separable(16, 2))
    with torch.no_grad():  # slopes 0: the student is the teacher, the distillation term is 0
        assert trainer.compute_loss(model, batch).item() == model(**batch).loss.item()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing in this setup is wrong
        trainer.train()
    metrics = trainer.evaluate()
    assert isinstance(seen[-1], np.ndarray) and seen[-1].shape == (64, 2)
    assert metrics["eval_accuracy"] >= 0.85  # chance is 0.5 (it was 0.375; 0.95 measured here)
    assert linearize.nonlinear_fraction(model) == pytest.approx(0.5)
    # the loss: the model's own cross-entropy plus 1.0 x the relative squared error of the last hidden states
    model.eval()
    with torch.no_grad():
        features = {k: v for k, v in batch.items() if k != "labels"}
        student = model(**batch, output_hidden_states=True)
        teacher = original(**features, output_hidden_states=True)
        expected = student.loss + linearize.distill_loss(student, teacher, "hidden", batch["attention_mask"])
        loss, outputs = trainer.compute_loss(model, batch, return_outputs=True)
    assert float(expected - student.loss) > 0  # the student has moved off the teacher
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    assert outputs.hidden_states is None and outputs.logits.shape == (16, 2)


def test_the_teacher_is_not_modified_and_a_module_it_shares_with_the_student_still_trains(tmp_path):
    """The callback set requires_grad=False on every teacher parameter: an embedding shared with the student
    (tied) stopped training in the student. The teacher now runs under no_grad, its flags and weights stay."""
    model = tiny_bert()
    original = copy.deepcopy(model)
    model = convert(model)
    original.bert.embeddings = model.bert.embeddings  # shared, as tied embeddings are
    own = {n: p.detach().clone() for n, p in original.named_parameters() if not n.startswith("bert.embeddings")}
    before = model.bert.embeddings.word_embeddings.weight.detach().clone()
    original.train()
    trainer = trainer_for(model, LinearizeCallback(schedule=S.target(0.5, start=0, end=0.5), teacher=original),
                          tmp_path, max_steps=5)
    trainer.train()
    assert all(p.requires_grad for p in original.parameters()) and original.training  # as they were given
    assert model.bert.embeddings.word_embeddings.weight.requires_grad
    assert not torch.equal(model.bert.embeddings.word_embeddings.weight, before)  # the shared embedding trained
    assert all(torch.equal(p, own[n]) for n, p in original.named_parameters() if n in own)  # the rest did not


def test_the_student_as_its_own_teacher_is_refused_with_the_fix(tmp_path):
    """convert works in place, so ``teacher=original`` after ``model = convert(original)`` is the student: it died
    deep in autograd ("does not require grad"); now train() refuses it and names copy.deepcopy. A model that
    holds the student's units (a shallow copy) is refused too."""
    original = tiny_bert()
    model = convert(original)
    callback = LinearizeCallback(schedule=S.target(0.5, start=0, end=0.5), teacher=original)
    with pytest.raises(ValueError, match=r"got the model being trained.*copy.deepcopy\(model\)"):
        trainer_for(model, callback, tmp_path, max_steps=2).train()
    callback = LinearizeCallback(schedule=S.target(0.5, start=0, end=0.5), teacher=copy.copy(model))
    with pytest.raises(ValueError, match=r"holds \d+ unit slopes of the model being trained"):
        trainer_for(model, callback, tmp_path, max_steps=2).train()


def test_a_teacher_in_a_plain_trainer_warns_that_it_is_ignored(tmp_path):
    """Only LinearizeTrainerMixin's compute_loss reads the teacher: a plain Trainer trained without it, silently."""
    model = tiny_bert()
    original = copy.deepcopy(model)
    model = convert(model)
    callback = LinearizeCallback(schedule=S.target(0.5, start=0, end=0.5), teacher=original)
    trainer = trainer_for(model, callback, tmp_path, trainer_cls=transformers.Trainer, max_steps=1)
    with pytest.warns(UserWarning, match="distils only in a Trainer built from LinearizeTrainerMixin"):
        trainer.train()


def test_distilling_hidden_states_without_labels_warns_that_the_head_does_not_train(tmp_path):
    model = tiny_bert()
    original = copy.deepcopy(model)
    model = convert(model)
    callback = LinearizeCallback(schedule=S.target(0.5, start=0, end=0.5), teacher=original)
    trainer = trainer_for(model, callback, tmp_path)
    features = {k: v for k, v in batch_of(separable(4, 3)).items() if k != "labels"}
    with pytest.warns(UserWarning, match="the head does not train"):
        trainer.compute_loss(model, features)
    with pytest.raises(ValueError, match="distill_weight must be a finite number above 0"):
        LinearizeCallback(schedule=S.target(0.5), teacher=original, distill_weight=0.0)


def test_the_docs_trainer_example_runs_as_written(tmp_path, monkeypatch):
    """The Trainer block of docs/sparsity.md, executed verbatim with its two inputs (``path``: a saved tiny BERT,
    ``ds``: rows with labels): ``original`` was undefined. Its run is cut to 3 steps."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "sparsity.md").read_text(encoding="utf-8")
    section = page[page.index("## Hugging Face Trainer"):]
    start = section.index("```python\nimport copy") + len("```python\n")
    block = section[start:section.index("\n```", start)]
    setup, _, rest = block.partition("\ntrainer.train()")
    assert rest.startswith("   # logs"), "the block should end with trainer.train()"
    tiny_bert().save_pretrained(tmp_path / "checkpoint")
    monkeypatch.chdir(tmp_path)
    names = {"path": str(tmp_path / "checkpoint"), "ds": separable(32, 0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(setup, "docs/sparsity.md", "exec"), names)  # noqa: S102
        trainer = names["trainer"]
        trainer.args.max_steps = 3
        trainer.train()
    assert names["original"] is not names["model"] and not linearize.units(names["original"])
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])
