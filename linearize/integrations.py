"""Hugging Face Trainer integration: scheduled sparsity pressure as a callback (+ an optional mixin).

Convert **before** building the Trainer: the Trainer builds its optimizer from the model's
parameters, so the unit slopes must exist by then::

    model = linearize.convert(AutoModelForSequenceClassification.from_pretrained(path))
    callback = LinearizeCallback(schedule=linearize.schedules.target(0.10, end=0.8))  # teacher=original: distil
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

import warnings

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ._optional import require

require("transformers", what="linearize.integrations")
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .distill import KINDS, distill_loss
from .sparsifier import Sparsifier, _torch_optimizer
from .unit import units

__all__ = ["LinearizeCallback", "LinearizeTrainerMixin"]


class LinearizeCallback(TrainerCallback, ExportableState):
    """Applies a :class:`~linearize.Sparsifier` at every optimizer step of a ``Trainer``.

    Args:
        sparsifier: a ready :class:`~linearize.Sparsifier`; or leave it ``None`` and give
        schedule: a :mod:`linearize.schedules` schedule; a Sparsifier is then built at every
            ``on_train_begin`` with ``total_steps = state.max_steps`` (one per ``train()``: a model
            from ``model_init``, each trial of a hyperparameter search).
        teacher: the original model (e.g. before ``linearize.convert``): with
            :class:`LinearizeTrainerMixin`, ``compute_loss`` becomes :func:`linearize.distill_loss`
            of the student's outputs to the teacher's (no labels needed).
        distill: what to match: ``"hidden"`` (last hidden states), ``"logits"`` or ``"pooled"``.
        **sparsifier_kwargs: further :class:`~linearize.Sparsifier` arguments (``rate``, ``lam``,
            ``mode``, ``weights``...).

    Logs ``nonlinear_fraction``, ``lambda`` and ``linear_units`` with every Trainer log. Its
    state (step count, target path, history) is stored in the checkpoint's ``trainer_state.json``
    and restored on ``resume_from_checkpoint``; keep ``restore_callback_states_from_checkpoint``
    at its default ``False`` (the callback restores itself; the Trainer would rebuild it empty).
    """

    def __init__(
        self, sparsifier: Sparsifier | None = None, schedule=None, teacher=None, distill: str = "hidden",
        **sparsifier_kwargs,
    ) -> None:
        if distill not in KINDS:
            raise ValueError(f"distill must be one of {KINDS}, got {distill!r}")
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
        self.teacher = teacher.eval().requires_grad_(False) if teacher is not None else None
        self.distill = distill
        self._hook = None

    def state(self) -> dict:
        """For ``trainer_state.json`` (read back by :meth:`on_train_begin` when resuming)."""
        saved = self.sparsifier.state_dict() if self.sparsifier is not None else None
        return {"args": {}, "attributes": {"sparsifier_state": saved}}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.schedule is not None:  # a new Sparsifier for every train(): model_init, a search's trials
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self.sparsifier = Sparsifier(model, self.schedule, state.max_steps, **self.sparsifier_kwargs)
        elif model is not None and {id(u) for _, u in self.sparsifier._units} != {id(u) for _, u in units(model)}:
            raise ValueError("the Sparsifier given to LinearizeCallback was built on another model than the one "
                             "training (model_init builds a new one per train()): pass schedule=... instead")
        elif state.global_step == 0 and self.sparsifier.step_count > 0:
            raise ValueError(f"the Sparsifier given to LinearizeCallback has run {self.sparsifier.step_count} steps "
                             "already and this train() starts from step 0: pass schedule=... (a new Sparsifier per "
                             "run) or a fresh Sparsifier")
        if optimizer is not None:
            self.sparsifier.optimizer = _torch_optimizer(optimizer)
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
            self.sparsifier.load_state_dict(saved["attributes"]["sparsifier_state"])

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


class LinearizeTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before ``Trainer`` in the bases).

    - no weight decay on slopes (``create_optimizer`` reads :meth:`get_decay_parameter_names`);
    - ``compute_loss`` adds ``sparsifier.penalty()`` (via ``super()``) when the callback's
      Sparsifier has ``mode="loss"``; with ``LinearizeCallback(teacher=...)`` the loss is
      :func:`linearize.distill_loss` to the teacher instead of the model's own loss;
    - moves the :class:`LinearizeCallback` first, so reporters log its values.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        callbacks = self.callback_handler.callbacks
        ours = [cb for cb in callbacks if isinstance(cb, LinearizeCallback)]
        callbacks[:] = ours + [cb for cb in callbacks if not isinstance(cb, LinearizeCallback)]

    def get_decay_parameter_names(self, model) -> list[str]:
        slope_names = {f"{name}.slope" if name else "slope" for name, _ in units(model)}
        return [n for n in super().get_decay_parameter_names(model) if n not in slope_names]

    def _linearize_callback(self) -> LinearizeCallback | None:
        return next((cb for cb in self.callback_handler.callbacks if isinstance(cb, LinearizeCallback)), None)

    def _linearize_sparsifier(self) -> Sparsifier | None:
        cb = self._linearize_callback()
        return cb.sparsifier if cb is not None else None

    def _distill_loss(self, cb: LinearizeCallback, model, inputs, return_outputs: bool):
        """The student's distance to ``cb.teacher`` on ``inputs`` (labels are not used)."""
        inputs = {k: v for k, v in inputs.items() if k not in ("labels", "label")}
        hidden = {"output_hidden_states": True} if cb.distill != "logits" else {}
        outputs = model(**inputs, **hidden)
        teacher = cb.teacher
        device = next(model.parameters()).device
        if next(teacher.parameters()).device != device:
            teacher.to(device)
        with torch.no_grad():
            target = teacher(**inputs, **hidden)
        loss = distill_loss(outputs, target, cb.distill, inputs.get("attention_mask"))
        return (loss, outputs) if return_outputs else loss

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        cb = self._linearize_callback()
        if cb is not None and cb.teacher is not None:
            result = self._distill_loss(cb, model, inputs, return_outputs)
        else:
            result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        sparsifier = cb.sparsifier if cb is not None else None
        if sparsifier is None or sparsifier.mode != "loss":
            return result
        if return_outputs:
            loss, outputs = result
            return loss + sparsifier.penalty().to(loss.device), outputs
        return result + sparsifier.penalty().to(result.device)
