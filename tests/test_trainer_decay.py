"""A plain ``transformers.Trainer`` with the callback decays the unit slopes: the callback warns, with the fix."""

from __future__ import annotations

import warnings

import pytest
import torch

import linearize
from linearize import schedules as S

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

from linearize.integrations import LinearizeCallback, LinearizeTrainerMixin  # noqa: E402


class LinearizeTrainer(LinearizeTrainerMixin, Trainer):
    pass


def _run(trainer_class: type, weight_decay: float, tmp_path, optimizers=None) -> list[str]:
    """Two steps of a 1-layer BERT built from a config; the linearize warnings raised."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    ids = torch.randint(0, 50, (8, 6))
    data = [{"input_ids": i, "attention_mask": torch.ones(6, dtype=torch.long), "labels": torch.tensor(k % 2)}
            for k, i in enumerate(ids)]
    linearize.convert(model, example_inputs={"input_ids": ids[:1]})
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                             weight_decay=weight_decay, report_to="none", use_cpu=True, disable_tqdm=True,
                             save_strategy="no", logging_strategy="no", dataloader_num_workers=0)
    callback = LinearizeCallback(schedule=S.target(0.5), lam=1.0)
    kwargs = {"optimizers": optimizers(model)} if optimizers else {}
    trainer = trainer_class(model=model, args=args, train_dataset=data, callbacks=[callback], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return [str(w.message) for w in caught if "weight decay" in str(w.message) and "linearize" in str(w.message)]


def test_plain_trainer_with_weight_decay_warns_once_naming_the_fix(tmp_path):
    messages = _run(Trainer, 0.01, tmp_path)
    assert len(messages) == 1, messages
    assert "LinearizeTrainerMixin" in messages[0] and "linearize.param_groups" in messages[0]


@pytest.mark.parametrize("case", ["mixin", "no decay", "param_groups"])
def test_no_warning_when_the_slopes_are_not_decayed(case, tmp_path):
    if case == "mixin":
        messages = _run(LinearizeTrainer, 0.01, tmp_path)
    elif case == "no decay":
        messages = _run(Trainer, 0.0, tmp_path)
    else:
        messages = _run(Trainer, 0.01, tmp_path, optimizers=lambda m: (
            torch.optim.AdamW(linearize.param_groups(m, weight_decay=0.01), lr=1e-3), None))
    assert messages == []
