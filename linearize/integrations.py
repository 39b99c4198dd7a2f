"""Hugging Face Trainer integration: scheduled sparsity pressure as a callback (+ an optional mixin).

Convert **before** building the Trainer: the Trainer builds its optimizer from the model's
parameters, so the unit slopes must exist by then::

    model = AutoModelForSequenceClassification.from_pretrained(path)
    original = copy.deepcopy(model)  # an optional teacher: a copy made before convert (which works in place)
    model = linearize.convert(model)
    callback = LinearizeCallback(schedule=linearize.schedules.target(0.10, end=0.8), teacher=original)
    trainer = LinearizeTrainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.train()          # or trainer.train(resume_from_checkpoint=True)

``LinearizeTrainer = type("LinearizeTrainer", (LinearizeTrainerMixin, Trainer), {})`` (or your own
subclass). The mixin excludes slopes from weight decay, adds :meth:`Sparsifier.penalty` to the loss
when ``mode="loss"``, and puts the callback first so reporting integrations (TensorBoard, W&B)
see its values. A plain ``Trainer`` with the callback works too: the proximal step acts on the
parameters after each optimizer step (no callback event can change the loss), but then exclude
the slopes from weight decay yourself and note that reporters listed before the callback log
without its values (``trainer.state.log_history`` gets them either way).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ._optional import require

require("transformers", what="linearize.integrations")
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .distill import KINDS, distill_loss
from .distributed import is_sharded, refuse_unsupported
from .sparsifier import Sparsifier, torch_optimizer
from .unit import units

__all__ = ["LinearizeCallback", "LinearizeTrainerMixin"]


_SAME_LENGTH = ("resume with the run's own length (the same max_steps, or num_train_epochs, batch size and "
                "gradient_accumulation_steps), or start a new run from the checkpoint's weights")


class LinearizeCallback(TrainerCallback, ExportableState):
    """Applies a :class:`~linearize.Sparsifier` at every optimizer step of a ``Trainer``.

    Args:
        sparsifier: a ready :class:`~linearize.Sparsifier` whose ``total_steps`` is the Trainer's
            ``max_steps`` (optimizer steps: batches divided by ``gradient_accumulation_steps``; another is
            refused); or leave it ``None`` and give
        schedule: a :mod:`linearize.schedules` schedule; a Sparsifier is then built at every
            ``on_train_begin`` with ``total_steps = state.max_steps`` (one per ``train()``: a model
            from ``model_init``, each trial of a hyperparameter search).
        teacher: the original model, a copy made before ``linearize.convert`` (which converts in
            place), e.g. ``copy.deepcopy(model)``: with :class:`LinearizeTrainerMixin` the loss becomes
            the model's own loss on the batch's labels plus ``distill_weight`` times
            :func:`linearize.distill_loss` of the student's outputs to the teacher's; a batch without
            labels gets the distillation term alone (no labels needed). The teacher runs in eval mode
            under ``torch.no_grad`` and is never modified (its parameters may be shared with the
            student, e.g. tied embeddings); the student itself, or a model holding its units, is refused.
        distill: what to match: ``"hidden"`` (last hidden states), ``"logits"`` or ``"pooled"``.
        distill_weight: the weight of the distillation term (default 1.0; ``"hidden"`` is a relative
            squared error, 0 at the start, so the task's loss leads and the term keeps the student
            near the original).
        **sparsifier_kwargs: further :class:`~linearize.Sparsifier` arguments (``rate``, ``lam``,
            ``mode``, ``weights``...).

    Logs ``nonlinear_fraction``, ``lambda`` and ``linear_units`` with every Trainer log. Its
    state (step count, target path, history) is stored in the checkpoint's ``trainer_state.json``
    and restored on ``resume_from_checkpoint``; keep ``restore_callback_states_from_checkpoint``
    at its default ``False`` (the callback restores itself; the Trainer would rebuild it empty).
    """

    def __init__(
        self, sparsifier: Sparsifier | None = None, schedule=None, teacher: nn.Module | None = None,
        distill: str = "hidden", distill_weight: float = 1.0, **sparsifier_kwargs,
    ) -> None:
        if distill not in KINDS:
            raise ValueError(f"distill must be one of {KINDS}, got {distill!r}")
        if isinstance(distill_weight, bool) or not isinstance(distill_weight, (int, float)) \
                or not (distill_weight > 0 and math.isfinite(distill_weight)):
            raise ValueError(f"distill_weight must be a finite number above 0 (the weight of the distillation "
                             f"term; leave teacher=None to train without it), got {distill_weight!r}")
        if teacher is not None and not isinstance(teacher, nn.Module):
            raise TypeError(f"teacher must be the original model (an nn.Module), got {type(teacher).__name__}")
        if sparsifier is None and schedule is None:
            raise TypeError(
                "LinearizeCallback needs a Sparsifier or a schedule (e.g. "
                "LinearizeCallback(schedule=linearize.schedules.target(0.1))). If the Trainer rebuilt "
                "it from a checkpoint, set restore_callback_states_from_checkpoint=False: this "
                "callback restores its own state"
            )
        if sparsifier is not None and (schedule is not None or sparsifier_kwargs):
            raise TypeError("pass either a Sparsifier or schedule arguments, not both")
        if sparsifier is not None and sparsifier._hook is not None:
            raise RuntimeError(
                "this Sparsifier is attached to an optimizer, whose hook already steps it: the callback "
                "would apply the pressure a second time per step; call sparsifier.detach() first"
            )
        self.sparsifier = sparsifier
        self.schedule = schedule
        self.sparsifier_kwargs = sparsifier_kwargs
        self.teacher = teacher  # never modified: it may share modules with the student (tied embeddings)
        self.distill = distill
        self.distill_weight = float(distill_weight)
        self._hook = None
        self._in_mixin = False  # set by LinearizeTrainerMixin, whose compute_loss reads the teacher
        self._checked_student: int | None = None  # id of the model check_teacher last accepted
        self._warned_head = False

    def check_teacher(self, student: nn.Module) -> None:
        """Refuse a teacher that is ``student`` or holds its units (``ValueError``).

        ``linearize.convert`` converts in place, so the model passed to it *is* the converted
        student: as its own teacher it would distil towards itself and learn nothing. A copy made
        before converting (``copy.deepcopy``) is the teacher. Sharing other modules (tied
        embeddings) is fine: the teacher is never modified.
        """
        if self.teacher is None or self._checked_student == id(student):
            return
        if self.teacher is student or self.teacher is getattr(student, "module", None):
            raise ValueError(
                "LinearizeCallback(teacher=...) got the model being trained: linearize.convert converts in place, "
                "so the model it was given is the student now. Pass a copy made before converting: "
                "original = copy.deepcopy(model); model = linearize.convert(model); "
                "LinearizeCallback(..., teacher=original)")
        slopes = {id(u.slope) for _, u in units(student)}
        shared = [n for n, p in self.teacher.named_parameters() if id(p) in slopes]
        if shared:
            raise ValueError(
                f"the teacher given to LinearizeCallback holds {len(shared)} unit slopes of the model being trained "
                f"(e.g. {shared[0]!r}): it is (part of) the student, not the original. Pass a copy made before "
                "converting: original = copy.deepcopy(model); model = linearize.convert(model)")
        self._checked_student = id(student)

    def state(self) -> dict:
        """For ``trainer_state.json`` (read back by :meth:`on_train_begin` when resuming)."""
        saved = self.sparsifier.state_dict() if self.sparsifier is not None else None
        return {"args": {}, "attributes": {"sparsifier_state": saved}}

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None:  # before the Trainer wraps the model (DDP would fail on a sharded one)
            _check_sharding(args, model, prepared=False)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.teacher is not None:
            if model is not None:
                self.check_teacher(model)
            if not self._in_mixin:
                warnings.warn(
                    "linearize: LinearizeCallback(teacher=...) distils only in a Trainer built from "
                    "LinearizeTrainerMixin (class LinearizeTrainer(LinearizeTrainerMixin, Trainer): pass): this "
                    "Trainer's loss ignores the teacher", UserWarning, stacklevel=2)
        if self.schedule is not None:  # a new Sparsifier for every train(): model_init, a search's trials
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self.sparsifier = Sparsifier(model, self.schedule, state.max_steps, **self.sparsifier_kwargs)
        elif model is not None and {id(u) for _, u in self.sparsifier._units} != {id(u) for _, u in units(model)}:
            raise ValueError("the Sparsifier given to LinearizeCallback was built on another model than the one "
                             "training (model_init builds a new one per train()): pass schedule=... instead")
        elif state.max_steps != self.sparsifier.total_steps:
            accumulation = getattr(args, "gradient_accumulation_steps", 1)
            counted = f" (gradient_accumulation_steps={accumulation}: count optimizer steps, not batches)" \
                if accumulation > 1 else ""
            fix = (_SAME_LENGTH if state.global_step > 0 else
                   "pass schedule=... (and the Sparsifier's other arguments) to LinearizeCallback, which builds it "
                   f"with total_steps=state.max_steps, or build it with total_steps={state.max_steps}")
            raise ValueError(
                f"the Sparsifier given to LinearizeCallback has total_steps={self.sparsifier.total_steps}, but this "
                f"Trainer runs max_steps={state.max_steps} optimizer steps{counted}: its schedule would not end "
                f"where training does. Fix: {fix}")
        elif state.global_step == 0 and self.sparsifier.step_count > 0:
            raise ValueError(f"the Sparsifier given to LinearizeCallback has run {self.sparsifier.step_count} steps "
                             "already and this train() starts from step 0: pass schedule=... (a new Sparsifier per "
                             "run) or a fresh Sparsifier")
        if model is not None:
            _check_sharding(args, model, prepared=True)
        if optimizer is not None:
            self.sparsifier.optimizer = torch_optimizer(optimizer)
        elif self.sparsifier.optimizer is None:
            self._find_optimizer()
        if self.sparsifier.optimizer is not None:
            self._check_decay(self.sparsifier.optimizer)
        if state.global_step > 0:  # resuming: the checkpoint's trainer_state.json holds our state
            saved = (state.stateful_callbacks or {}).get(type(self).__name__)
            saved = saved[0] if isinstance(saved, list) else saved
            if not saved or not saved.get("attributes", {}).get("sparsifier_state"):
                raise ValueError(
                    f"resuming at step {state.global_step} but the checkpoint holds no "
                    f"{type(self).__name__} state: it was saved without this callback"
                )
            sparsifier_state = saved["attributes"]["sparsifier_state"]
            ran = sparsifier_state.get("total_steps") if isinstance(sparsifier_state, dict) else None
            if ran is not None and ran != state.max_steps:
                raise ValueError(
                    f"resuming at step {state.global_step} a run of max_steps={ran} optimizer steps, but this Trainer "
                    f"runs max_steps={state.max_steps}: the sparsity schedule cannot change its length mid-run. "
                    f"Fix: {_SAME_LENGTH}")
            self.sparsifier.load_state_dict(sparsifier_state)

    def _find_optimizer(self) -> None:
        """The Trainer does not pass its optimizer to callbacks: take the first one that steps the slopes."""
        slope_ids = {id(u.slope) for _, u in self.sparsifier._units}

        def hook(opt, args, kwargs):
            if any(id(p) in slope_ids for g in opt.param_groups for p in g["params"]):
                self.sparsifier.optimizer = opt
                self._check_decay(opt)
                self._hook.remove()
                self._hook = None

        self._hook = register_optimizer_step_post_hook(hook)

    def _check_decay(self, optimizer) -> None:
        """Warn (once per callback) when the optimizer puts weight decay on unit slopes.

        Decay pulls slopes towards 0, back to the activation, against the sparsity pressure; a plain
        ``Trainer`` decays every parameter but biases and norms, slopes included.
        """
        if getattr(self, "_decay_checked", False):
            return
        self._decay_checked = True
        names = {id(u.slope): f"{n}.slope" if n else "slope" for n, u in self.sparsifier._units}
        decayed = [names[id(p)] for g in optimizer.param_groups if g.get("weight_decay", 0.0) > 0
                   for p in g["params"] if id(p) in names]
        if decayed:
            decays = sorted({g["weight_decay"] for g in optimizer.param_groups if g.get("weight_decay", 0.0) > 0})
            warnings.warn(
                f"linearize: the optimizer puts weight decay ({', '.join(map(str, decays))}) on {len(decayed)} of "
                f"{len(names)} unit slopes (e.g. {decayed[0]}): it pulls them back towards the activation, "
                f"against the sparsity pressure. Fix: build the Trainer from LinearizeTrainerMixin "
                f"(class LinearizeTrainer(LinearizeTrainerMixin, Trainer): pass), or pass "
                f"optimizers=(torch.optim.AdamW(linearize.param_groups(model, weight_decay=...)), None)",
                UserWarning, stacklevel=2)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.sparsifier.step()

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def metrics(self) -> dict[str, float]:
        """``nonlinear_fraction``, ``lambda`` (of the last step) and ``linear_units`` now."""
        sp = self.sparsifier
        return {
            "nonlinear_fraction": sp.nonlinear_fraction(),
            "lambda": sp.lam_at(max(sp.step_count - 1, 0)),
            "linear_units": sp.linear_units(),
        }

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.sparsifier is None or logs is None:
            return
        values = self.metrics()
        logs.update(values)
        # Trainer.log appended a copy of ``logs`` to the history just before calling us
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)


def _check_sharding(args, model: nn.Module, prepared: bool) -> None:
    """Refuse (``ValueError``) a model sharded with ``fully_shard`` outside the Trainer, which the Trainer then
    runs as unsharded processes (each with all the data, every one saving) or fails to wrap in DDP; once the
    Trainer has ``prepared`` the model, warn when ``TrainingArguments(fsdp=...)`` asked for FSDP and the Trainer
    did not shard: Accelerate shards only on accelerator devices, and on a CPU trains DDP instead (correct,
    but every process holds the whole model)."""
    found = units(model)
    refuse_unsupported(model, [u.slope for _, u in found])  # FSDP1 (the Trainer's default fsdp_version), ZeRO-3
    sharded = any(is_sharded(u.slope) for _, u in found)
    if sharded and (not prepared or not args.fsdp):  # before the Trainer prepared it, or it shards none
        raise ValueError(
            "the model given to the Trainer was sharded with fully_shard beforehand, which the Trainer does not "
            "manage: it would run every process unsharded (all the data on each, every one saving). Fix: pass the "
            "model unsharded with TrainingArguments(fsdp=True, fsdp_config={'fsdp_version': 2}) on GPUs (the "
            "Trainer shards it), or train the sharded model in your own loop (docs/distributed.md)")
    if prepared and args.fsdp and not sharded:
        warnings.warn(
            "linearize: TrainingArguments(fsdp=...) asks for FSDP but the Trainer did not shard the model: "
            "Accelerate runs FSDP on GPUs (and other accelerators) only, and on a CPU trains DDP instead (every "
            "process holds the whole model; the run is otherwise correct). To shard on a CPU, use fully_shard in "
            "your own loop under torchrun (docs/distributed.md)", UserWarning, stacklevel=3)


class LinearizeTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before ``Trainer`` in the bases).

    - no weight decay on slopes (``create_optimizer`` reads :meth:`get_decay_parameter_names`);
    - ``compute_loss`` adds ``sparsifier.penalty()`` (via ``super()``) when the callback's
      Sparsifier has ``mode="loss"``; with ``LinearizeCallback(teacher=...)`` it adds
      ``distill_weight`` times :func:`linearize.distill_loss` to the teacher to the model's own
      loss (the distillation term alone for a batch without labels); the outputs it returns (the
      predictions of ``evaluate``) are the model's, without the hidden states it asked for; under gradient
      accumulation both terms count once per optimizer step, as in one large batch (divided by the
      accumulation steps where the Trainer takes the model's loss as already divided for them);
    - moves the :class:`LinearizeCallback` first, so reporters log its values.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        callbacks = self.callback_handler.callbacks
        ours = [cb for cb in callbacks if isinstance(cb, LinearizeCallback)]
        callbacks[:] = ours + [cb for cb in callbacks if not isinstance(cb, LinearizeCallback)]
        for cb in ours:
            cb._in_mixin = True

    def get_decay_parameter_names(self, model) -> list[str]:
        slope_names = {f"{name}.slope" if name else "slope" for name, _ in units(model)}
        return [n for n in super().get_decay_parameter_names(model) if n not in slope_names]

    def _linearize_callback(self) -> LinearizeCallback | None:
        return next((cb for cb in self.callback_handler.callbacks if isinstance(cb, LinearizeCallback)), None)

    def _linearize_sparsifier(self) -> Sparsifier | None:
        cb = self._linearize_callback()
        return cb.sparsifier if cb is not None else None

    def _distill_loss(self, cb: LinearizeCallback, model, inputs: dict, return_outputs: bool, **kwargs):
        """The model's own loss (when ``inputs`` hold the labels) plus ``cb.distill_weight`` times the
        student's distance to ``cb.teacher`` on the same inputs."""
        cb.check_teacher(model)
        label_names = getattr(self, "label_names", None) or ["labels"]
        has_labels = all(inputs.get(k) is not None for k in label_names)
        features = {k: v for k, v in inputs.items() if k not in (*label_names, "labels", "label")}
        config = getattr(getattr(model, "module", model), "config", None)
        add_hidden = cb.distill != "logits" and not inputs.get("output_hidden_states") \
            and not getattr(config, "output_hidden_states", False)
        hidden = {"output_hidden_states": True} if add_hidden else {}
        if has_labels:  # the Trainer's own loss (label smoothing, compute_loss_func...), one student forward
            task, outputs = super().compute_loss(model, {**inputs, **hidden}, return_outputs=True, **kwargs)
        else:
            task, outputs = None, model(**features, **hidden)
            self._warn_untrained_head(cb, outputs, label_names)
        teacher = cb.teacher
        device = next(model.parameters()).device
        if next(teacher.parameters()).device != device:
            teacher.to(device)
        with torch.no_grad(), _eval_mode(teacher):
            target = teacher(**features, **hidden)
        loss = cb.distill_weight * distill_loss(outputs, target, cb.distill, features.get("attention_mask"))
        loss = loss / self._summed_micro_batches(model, kwargs.get("num_items_in_batch"))
        if task is not None:
            loss = task + loss.to(task.dtype)
        if not return_outputs:
            return loss
        return loss, _without_hidden_states(outputs) if add_hidden else outputs

    def _warn_untrained_head(self, cb: LinearizeCallback, outputs: Any, label_names: list[str]) -> None:
        """Warn once when a model with a head (``logits``) distils hidden states from batches without labels:
        the head then gets no gradient at all."""
        logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
        if cb.distill == "logits" or logits is None or cb._warned_head:
            return
        cb._warned_head = True
        warnings.warn(
            f"linearize: the batches hold no labels ({', '.join(label_names)}), so the loss is the distance of the "
            f"{cb.distill} states to the teacher's alone, which does not depend on the model's head: the head "
            "does not train. Keep the labels in the dataset (the loss is then the model's own plus the "
            "distillation term), or pass distill='logits'", UserWarning, stacklevel=3)

    def _summed_micro_batches(self, model, num_items_in_batch) -> int:
        """How many micro-batch losses the Trainer sums as they are into one optimizer step: its gradient
        accumulation steps when it takes the loss as already divided for them (the model's loss normalized by
        ``num_items_in_batch``, a ``compute_loss_func``, or ``loss_is_scaled_for_ga = True``; the rule of
        transformers >= 4.53), else 1 (it divides the whole loss itself; and in evaluation). The distillation
        term and the penalty are per micro-batch: divided by this, they weigh the same at any accumulation."""
        if not model.training:
            return 1
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) \
                or getattr(self, "compute_loss_func", None) is not None
        if not scaled:
            return 1
        return getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        cb = self._linearize_callback()
        if cb is not None and cb.teacher is not None:
            result = self._distill_loss(cb, model, inputs, return_outputs, **kwargs)
        else:
            result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        sparsifier = cb.sparsifier if cb is not None else None
        if sparsifier is None or sparsifier.mode != "loss":
            return result
        loss, outputs = result if return_outputs else (result, None)
        micro_batches = self._summed_micro_batches(model, kwargs.get("num_items_in_batch"))
        penalty = sparsifier.penalty().to(loss.device) / micro_batches
        return (loss + penalty, outputs) if return_outputs else loss + penalty


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode inside the block, every submodule's mode restored after it (a module the
    teacher shares with the student, e.g. tied embeddings, trains again in the student's next forward)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _without_hidden_states(outputs: Any) -> Any:
    """Model outputs without the ``hidden_states`` the distillation asked for: the Trainer's predictions are
    every output but the loss, and these would turn the logits into a tuple ``compute_metrics`` does not expect."""
    if isinstance(outputs, dict) and outputs.get("hidden_states") is not None:
        fields = {k: v for k, v in outputs.items() if k != "hidden_states"}
        return fields if type(outputs) is dict else type(outputs)(**fields)
    return outputs
