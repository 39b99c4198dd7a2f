"""The training loop of the recipes (:func:`train`): per-step seeding, so that augmentation and dropout depend
only on (seed, step, process) and a resumed run repeats the uninterrupted one; every step's loss checked
for inf/NaN; logs and periodic checkpoints; the run's length and its start (resume, tracking)."""

from __future__ import annotations

import argparse
import math
import warnings
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from .accelerator import init_tracking
from .checkpoints import load_checkpoint, remove_partial_checkpoints, resume_checkpoint, save_checkpoint
from .outputs import unit_stats
from .run import NONFINITE_ADVICE, Run


def seed_step(seed: int, step: int, process_index: int) -> None:
    """Seed torch's RNG from (seed, step, process): augmentation and dropout of a step are then
    the same whether the run was resumed or not."""
    torch.manual_seed((seed * 1_000_003 + step * 7_919 + process_index * 104_729) % (2**63 - 1))


class EpochSampler(torch.utils.data.Sampler[int]):
    """Random permutation of ``range(n)`` that depends only on ``(seed, epoch)``."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.n))
        g = torch.Generator().manual_seed(self.seed * 10_007 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def run_length(args: argparse.Namespace, steps_per_epoch: int) -> int:
    """Optimizer steps of the whole run, which the LR and sparsity schedules span.

    ``--max-steps`` when given (as Hugging Face's ``max_steps`` and Accelerate's ``--max_train_steps``:
    it overrides ``--epochs``, and the run goes on into further epochs if it needs them), else
    ``--epochs`` epochs (a fraction rounded up to whole steps). Example: 8 steps per epoch, ``--epochs 10
    --max-steps 20``: 20; ``--epochs 9.9``: 80.
    (:func:`check_run_args` has checked both flags; the recipes refuse data giving no step per epoch.)
    """
    return args.max_steps if args.max_steps else math.ceil(steps_per_epoch * args.epochs)


def start(run: Run, total_steps: int) -> tuple[int, int]:
    """Remove temp folders of interrupted checkpoint writes, resume from ``--resume_from_checkpoint``,
    start tracking. Returns ``(first step, last step)`` (``--stop-after`` caps the last one)."""
    acc, args = run.accelerator, run.args
    run.total_steps = total_steps
    if acc.is_main_process:
        remove_partial_checkpoints(run.out_dir)
    acc.wait_for_everyone()  # it may rename a restored checkpoint into place: every process then sees it
    step = 0
    ckpt, skipped = resume_checkpoint(args.resume_from_checkpoint, run.out_dir)
    if ckpt is not None:
        if acc.is_main_process:
            for reason in skipped:
                warnings.warn(f"skipping a damaged checkpoint: {reason}", RuntimeWarning, stacklevel=2)
        load_checkpoint(run, ckpt)
        step = ckpt.step
        acc.print(f"resumed from {ckpt.path} at step {step}")
    elif args.resume_from_checkpoint:
        acc.print(f"--resume_from_checkpoint {args.resume_from_checkpoint}: no checkpoint under "
                  f"{run.out_dir / 'checkpoints'} yet: starting at step 0")
    init_tracking(acc, args, run.recipe)
    return step, min(total_steps, args.stop_after) if args.stop_after else total_steps


class LossWatch:
    """Checks the training loss of every step for inf/NaN.

    On the CPU each loss is checked at once (reading it back costs nothing), before the backward
    pass, so a bad step never reaches the weights. On an accelerator the first bad step is recorded
    on the device and read back only by :meth:`check` (at log and checkpoint steps), adding no sync.
    """

    def __init__(self, device: torch.device) -> None:
        self.eager = device.type == "cpu"
        self.first_bad: torch.Tensor | None = None

    def update(self, loss: torch.Tensor, step: int) -> None:
        """Watch the loss of optimizer step ``step`` (1-based, the number of the checkpoint after it)."""
        loss = loss.detach()
        bad = ~torch.isfinite(loss)
        if self.eager:
            if bad:
                self._raise(step, float(loss))
            return
        at = torch.where(bad, step, -1)
        self.first_bad = at if self.first_bad is None else torch.where(self.first_bad >= 0, self.first_bad, at)

    def check(self) -> None:
        """Raise if a step since the start had a non-finite loss."""
        if self.first_bad is not None and int(self.first_bad) >= 0:
            self._raise(int(self.first_bad), None)

    @staticmethod
    def _raise(step: int, value: float | None) -> None:
        what = f"is {value}" if value is not None else "became inf or NaN"
        raise FloatingPointError(f"the training loss {what} at optimizer step {step}; the run stops here and "
                                 f"writes no checkpoint of it. {NONFINITE_ADVICE}")


def train(run: Run, train_loader, sampler, loss_fn: Callable[[Any], torch.Tensor], step: int, last_step: int,
          steps_per_epoch: int, clip_grad: float = 0.0) -> int:
    """The training loop of both recipes, from optimizer step ``step`` to ``last_step``.

    Resumes mid-epoch exactly (the epoch's order, then ``skip_first_batches``), seeds every step,
    checks every loss (:class:`LossWatch`), clips the gradient norm to ``clip_grad`` when it is
    nonzero, logs and checkpoints through :func:`end_of_step`, and saves a final checkpoint.
    ``loss_fn(batch)`` returns the scalar loss of one batch. Returns the last step done."""
    acc, args, model, optimizer, scheduler = run.accelerator, run.args, run.model, run.optimizer, run.scheduler
    bar = tqdm(total=last_step, initial=step, desc="train", disable=not acc.is_local_main_process)
    watch = LossWatch(acc.device)
    model.train()
    with bar:
        while step < last_step:
            epoch, skip = divmod(step, steps_per_epoch)
            # Accelerate's prepared loader calls set_epoch(its own pass counter) when iterated, over the
            # sampler's epoch; that counter is 0 in a resumed process, so set both here.
            sampler.set_epoch(epoch)
            if hasattr(train_loader, "set_epoch"):
                train_loader.set_epoch(epoch)
            loader = acc.skip_first_batches(train_loader, skip) if skip else train_loader
            for batch in loader:
                seed_step(args.seed, step, acc.process_index)
                loss = loss_fn(batch)
                watch.update(loss, step + 1)
                acc.backward(loss)
                if clip_grad:
                    acc.clip_grad_norm_(model.parameters(), clip_grad)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                end_of_step(run, watch, bar, loss, step, last_step, epoch)
                if step >= last_step:
                    break
    watch.check()
    save_checkpoint(run, step)
    return step


def end_of_step(run: Run, watch: LossWatch, bar, loss: torch.Tensor, step: int, last_step: int, epoch: int) -> None:
    """After optimizer step ``step``: progress bar, logs every ``--log_every`` steps and at the end
    (loss, lr, nonlinear fraction; to the tracker with ``--with_tracking``), and the periodic
    checkpoint every ``--checkpointing_steps`` (after checking the losses since the last check)."""
    args = run.args
    bar.update(1)
    if step % args.log_every == 0 or step == last_step:
        watch.check()
        logs = {"train_loss": loss.item(), "lr": run.scheduler.get_last_lr()[0], "epoch": epoch,
                **unit_stats(run.accelerator.unwrap_model(run.model), args.tol)}
        bar.set_postfix(loss=f"{logs['train_loss']:.3f}", nl=f"{logs.get('nonlinear_fraction', 1.0):.3f}")
        if args.with_tracking:
            run.accelerator.log(logs, step=step)
    if args.checkpointing_steps and step % args.checkpointing_steps == 0 and step < last_step:
        watch.check()
        save_checkpoint(run, step)
