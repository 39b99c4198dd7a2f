"""``LinearizeTrainerMixin`` under gradient accumulation: the distillation term and the ``mode="loss"`` penalty
weigh the same as in one large batch, whether the Trainer takes the model's loss as already divided for the
accumulation (a model whose ``forward`` takes ``**kwargs`` normalizes by ``num_items_in_batch``) or divides it itself
(a model without). A tiny GPT-2 built from a config (no downloads)."""

from __future__ import annotations

import copy

import pytest
import torch

import linearize
from linearize import schedules as S

transformers = pytest.importorskip("transformers")
from linearize.integrations import LinearizeCallback, LinearizeTrainerMixin  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class LinearizeTrainer(LinearizeTrainerMixin, transformers.Trainer):
    pass


class WithoutLossKwargs(torch.nn.Module):
    """A language model behind a ``forward`` without ``**kwargs``: the Trainer passes it no ``num_items_in_batch``
    and divides the loss by the accumulation steps itself."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels=None, output_hidden_states=None):
        return self.lm(input_ids=input_ids, labels=labels, output_hidden_states=output_hidden_states)


def one_step_update(tmp_path, batch: int, accumulate: int, loss_kwargs: bool, term: str | None) -> dict:
    """The change of every parameter in one SGD step (lr 1) on the same 8 sequences, every token a label.

    ``term``: ``"distillation"`` (a teacher, ``distill="logits"``), ``"penalty"`` (``mode="loss"``) or ``None``."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    lm = transformers.GPT2LMHeadModel(config)
    model = lm if loss_kwargs else WithoutLossKwargs(lm)
    teacher = copy.deepcopy(model)
    model = linearize.convert(model)
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.fill_(0.5)  # mid-run: the student differs from the teacher
    ids = torch.randint(50, (8, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    if term == "distillation":
        callback = LinearizeCallback(schedule=S.constant(0.0), teacher=teacher, distill="logits",
                                     distill_weight=100.0)  # to weigh as much as the task loss
    elif term == "penalty":
        callback = LinearizeCallback(schedule=S.constant(0.1), mode="loss")
    else:
        callback = LinearizeCallback(schedule=S.constant(0.0))
    args = transformers.TrainingArguments(
        str(tmp_path), max_steps=1, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulate,
        learning_rate=1.0, lr_scheduler_type="constant", max_grad_norm=0, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = LinearizeTrainer(model=model, args=args, train_dataset=data, callbacks=[callback],
                               optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None))
    assert trainer.model_accepts_loss_kwargs is loss_kwargs  # the two ways the Trainer scales the loss
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_kwargs", [True, False], ids=["model-divides", "trainer-divides"])
@pytest.mark.parametrize("term", ["distillation", "penalty"])
def test_two_accumulated_half_batches_step_as_one_full_batch(tmp_path, loss_kwargs, term):
    full = one_step_update(tmp_path, 8, 1, loss_kwargs, term)
    accumulated = one_step_update(tmp_path, 4, 2, loss_kwargs, term)
    for name, update in full.items():
        torch.testing.assert_close(accumulated[name], update, rtol=1e-4, atol=1e-6, msg=name)
    # the term is there: without it the step differs (the slopes most of all)
    task_only = one_step_update(tmp_path, 8, 1, loss_kwargs, None)
    slope_names = [n for n in full if n.endswith("slope")]
    moved = sum(float((full[n] - task_only[n]).abs().sum()) for n in slope_names)
    assert moved > 0.1 * sum(float(task_only[n].abs().sum()) for n in slope_names)
