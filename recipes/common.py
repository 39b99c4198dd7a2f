"""Shared pieces of the Accelerate recipes (``recipes/cifar.py``, ``recipes/wmt14.py``).

- argument groups: linearization flags and run flags (output, checkpoints, tracking);
- linearization: convert, sparsity schedule, the optional end-of-run steps (freeze, fold, report);
- checkpoints: ``save_state`` / ``load_state`` with a fingerprint of the model so a checkpoint
  directory of another model is refused, plus the step counter for exact continuation;
- per-step seeding, so that augmentation and dropout depend only on (seed, step, process),
  which makes a resumed run repeat the uninterrupted one;
- ``metrics.json`` writing (final metrics, command, versions, wall time).

Everything here is plain Python around ``accelerate.Accelerator``; the recipes stay runnable with
``python recipes/x.py`` (one process) and ``accelerate launch recipes/x.py`` (N processes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from tqdm.auto import tqdm

import linearize

if TYPE_CHECKING:
    from accelerate import Accelerator

LINEARIZE_MODES = ("none", "prelu", "dgn", "dlgn")
SCHEDULES = ("early", "late", "none")
STATE_FILE = "recipe_state.json"


# ----------------------------------------------------------------------------- arguments


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """Output, seed, precision, tracking and checkpoint flags (Accelerate example names)."""
    g = parser.add_argument_group("run")
    g.add_argument("--output_dir", "--output-dir", dest="output_dir", required=True,
                   help="where checkpoints, the final model, metrics.json and logs go")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--mixed_precision", "--mixed-precision", dest="mixed_precision", default=None,
                   choices=["no", "fp16", "bf16"], help="default: what `accelerate launch` says, else no")
    g.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    g.add_argument("--with_tracking", "--with-tracking", dest="with_tracking", action="store_true",
                   help="log losses, LR and the nonlinear fraction to TensorBoard under output_dir")
    g.add_argument("--checkpointing_steps", "--checkpointing-steps", dest="checkpointing_steps",
                   type=int, default=0, help="save_state every N optimizer steps (0: only at the end)")
    g.add_argument("--keep_checkpoints", "--keep-checkpoints", dest="keep_checkpoints", type=int,
                   default=2, help="keep only the newest N step checkpoints")
    g.add_argument("--resume_from_checkpoint", "--resume-from-checkpoint", dest="resume_from_checkpoint",
                   default=None, help="a checkpoint directory, or 'latest' (newest under output_dir)")
    g.add_argument("--max_steps", "--max-steps", dest="max_steps", type=int, default=None,
                   help="stop after this many optimizer steps (the schedules still span all epochs)")
    g.add_argument("--log_every", "--log-every", dest="log_every", type=int, default=50)


def add_linearize_args(parser: argparse.ArgumentParser, default_mode: str = "prelu", default_lam: float = 1e-3) -> None:
    """``--linearize --schedule --target --late-start --ramp-end --lam --tol --freeze --fold --report``.

    ``default_lam``: the proximal step moves a slope by ``lr * lam`` per step. Under SGD a slope's loss
    step is ``lr * grad``, so a small ``lam`` (1e-3) competes with it; under Adam(W) updates are about
    ``lr`` per step whatever the gradient scale, so ``lam`` of order 1 puts the pressure on that scale.
    """
    g = parser.add_argument_group("linearization")
    g.add_argument("--linearize", choices=LINEARIZE_MODES, default=default_mode,
                   help="none: the plain model; prelu: blend units; dgn / dlgn: gated splits")
    g.add_argument("--schedule", choices=SCHEDULES, default="late",
                   help="when the sparsity pressure starts: step 0 (early), --late-start (late), never (none)")
    g.add_argument("--target", type=float, default=0.10,
                   help="fraction of channels left nonlinear at the end, in (0, 1]")
    g.add_argument("--late-start", "--late_start", dest="late_start", type=float, default=0.5,
                   help="start of the late schedule: a fraction of training (< 1) or a step (>= 1)")
    g.add_argument("--ramp-end", "--ramp_end", dest="ramp_end", type=float, default=0.8,
                   help="fraction of training by which the target is reached")
    g.add_argument("--lam", type=float, default=default_lam,
                   help="strength of the L1 pressure on the slopes: each step moves them by lr * lam")
    g.add_argument("--tol", type=float, default=1e-3, help="a channel is linear when its slope >= 1 - tol")
    g.add_argument("--freeze", action="store_true", help="at the end, freeze linear channels at slope 1")
    g.add_argument("--fold", action="store_true", help="at the end, fold linear parts away (folded.pt)")
    g.add_argument("--report", action="store_true", help="at the end, write a linearize report (report/)")
    g.add_argument("--report-skip", "--report_skip", dest="report_skip", default="regions",
                   help="comma-separated report measures to skip (of units, path_length, affinity, regions, "
                        "history, gates); exact linear regions of a deep net along image segments can take hours")
    g.add_argument("--report-samples", "--report_samples", dest="report_samples", type=int, default=128,
                   help="samples the report measures on")


def check_linearize_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` with a hint for inconsistent linearization flags."""
    if not 0.0 < args.target <= 1.0:
        raise ValueError(f"--target is the fraction of channels kept nonlinear and must lie in (0, 1], "
                         f"got {args.target}")
    if args.late_start < 0:
        raise ValueError(f"--late-start must be >= 0 (a fraction of training or a step), got {args.late_start}")
    if not 0.0 < args.ramp_end <= 1.0:
        raise ValueError(f"--ramp-end must lie in (0, 1], got {args.ramp_end}")
    if args.linearize == "none" and (args.freeze or args.fold):
        raise ValueError("--freeze/--fold need linearizable units: use --linearize prelu (or dgn/dlgn)")


# ----------------------------------------------------------------------------- accelerator


def make_accelerator(args: argparse.Namespace, split_batches: bool) -> "Accelerator":
    """``Accelerator`` with TensorBoard under ``output_dir`` when ``--with_tracking``."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    kwargs = {}
    if args.mixed_precision is not None:
        kwargs["mixed_precision"] = args.mixed_precision
    # Without an accelerator device, Accelerator(cpu=False) under torchrun gives N independent
    # rank-0 processes (accelerate 1.x); cpu=True gives real DDP over gloo.
    has_device = torch.cuda.is_available() or torch.backends.mps.is_available() or (
        hasattr(torch, "xpu") and torch.xpu.is_available())
    return Accelerator(
        cpu=args.cpu or not has_device,
        log_with="tensorboard" if args.with_tracking else None,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=str(Path(args.output_dir) / "logs")),
        dataloader_config=DataLoaderConfiguration(split_batches=split_batches),
        **kwargs,
    )


def init_tracking(accelerator, args: argparse.Namespace, name: str) -> None:
    """Start TensorBoard tracking (hyper-parameters as scalars and strings only)."""
    if args.with_tracking:
        config = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in vars(args).items()}
        accelerator.init_trackers(name, config=config)


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


# ----------------------------------------------------------------------------- linearization


def convert_model(model: nn.Module, args: argparse.Namespace, example_inputs: Any = None, **overrides: Any) -> nn.Module:
    """``linearize.convert`` for ``--linearize prelu|dgn|dlgn``; the model itself for ``none``."""
    if args.linearize == "none":
        return model
    return linearize.convert(model, mode=args.linearize, example_inputs=example_inputs, **overrides)


def has_units(model: nn.Module) -> bool:
    return bool(linearize.units(model))


def schedule_start(args: argparse.Namespace, total_steps: int) -> int | float:
    """Start of the sparsity pressure: a fraction of training (float) or an optimizer step (int)."""
    if args.schedule == "early":
        return 0
    start = int(args.late_start) if args.late_start >= 1 else float(args.late_start)
    start_step = start if isinstance(start, int) else round(start * total_steps)
    if start_step >= round(args.ramp_end * total_steps):
        raise ValueError(f"--late-start {args.late_start} (step {start_step} of {total_steps}) must come "
                         f"before --ramp-end {args.ramp_end} (step {round(args.ramp_end * total_steps)})")
    return start


def make_sparsifier(model: nn.Module, args: argparse.Namespace, total_steps: int,
                    optimizer: torch.optim.Optimizer):
    """A ``linearize.Sparsifier`` steering the nonlinear fraction to ``--target``, attached to
    ``optimizer`` (it steps after every optimizer step), or ``None`` without pressure."""
    if args.linearize == "none" or args.schedule == "none":
        return None
    if not has_units(model):
        raise ValueError(f"--linearize {args.linearize} produced no slope units to sparsify; use --schedule none")
    schedule = linearize.schedules.target(args.target, start=schedule_start(args, total_steps),
                                          end=float(args.ramp_end))
    from accelerate.optimizer import AcceleratedOptimizer

    if isinstance(optimizer, AcceleratedOptimizer):  # hook the torch optimizer inside the wrapper
        optimizer = optimizer.optimizer
    return linearize.Sparsifier(model, schedule=schedule, total_steps=total_steps, lam=args.lam).attach(optimizer)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer groups: weight decay on weights, none on biases, norms and slopes."""
    if has_units(model):
        return linearize.param_groups(model, weight_decay=weight_decay)
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim > 1 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def unit_stats(model: nn.Module, tol: float) -> dict:
    """``{"nonlinear_fraction", "units_total", "units_nonlinear"}`` or ``{}`` without units."""
    if not has_units(model):
        return {}
    c = linearize.count_units(model, tol)
    return {"nonlinear_fraction": c["nonlinear"] / c["total"], "units_total": c["total"],
            "units_nonlinear": c["nonlinear"]}


def slopes_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{unit name: slope}`` (CPU copies), for comparisons and reports."""
    return {n: u.slope.detach().cpu().clone() for n, u in linearize.units(model)}


def _feature(name: str) -> Any:
    """A ``linearize`` feature by name, or a clear error if this install lacks it."""
    try:
        return getattr(linearize, name)
    except (AttributeError, ImportError) as e:
        raise RuntimeError(f"linearize.{name} is not available in this install ({e}); "
                           f"drop the flag that needs it") from e


def average_path_length(model: nn.Module, example_inputs: Any) -> float | None:
    """``linearize.measures.average_path_length`` when that measure is installed and applies."""
    try:
        fn = linearize.measures.average_path_length
    except (AttributeError, ImportError):
        return None
    try:
        return float(fn(model, example_inputs, normalized=True))
    except (TypeError, ValueError, NotImplementedError) as e:
        warnings.warn(f"average path length not computed: {e}")
        return None


def freeze_units(model: nn.Module, args: argparse.Namespace) -> None:
    """``--freeze``: set channels with slope >= 1 - tol to exactly 1 and stop their training."""
    _feature("freeze")(model, tol=args.tol)


def fold_and_report(model: nn.Module, args: argparse.Namespace, example_inputs: Any, report_data: Any,
                    output_dir: Path, history: Path | None = None,
                    fold_counts: dict[str, Callable[[nn.Module], int]] | None = None) -> dict:
    """``--fold`` (the folded model pickled to ``folded.pt``) and ``--report`` (``report/``).

    ``history``: the sparsifier history JSON, for the report's fraction-over-time plot.
    ``fold_counts``: recipe-specific counts (name -> function of a model), stored in the fold entry as
    ``{"before": count(model), "after": count(folded)}``.
    Returns the entries for ``metrics.json``.
    """
    out: dict = {}
    model.eval()
    if args.fold:
        folded = _feature("fold")(model, example_inputs)
        path = output_dir / "folded.pt"
        torch.save(folded, path)
        summary = folded.linearize_fold_summary
        out["fold"] = {"path": str(path), "params_before": summary.params_before, "params_after": summary.params_after,
                       "flops_before": summary.flops_before, "flops_after": summary.flops_after,
                       "max_abs_error": summary.max_abs_error, "output_scale": summary.output_scale}
        for name, count in (fold_counts or {}).items():
            out["fold"][name] = {"before": count(model), "after": count(folded)}
    if args.report:
        skip = [m for m in args.report_skip.split(",") if m]
        rep = _feature("report")(model, report_data, tol=args.tol, max_samples=args.report_samples, skip=skip,
                                 history=history if history and history.exists() else None)
        rep.save(output_dir / "report")
        out["report"] = str(output_dir / "report")
    return out


# ----------------------------------------------------------------------------- checkpoints


def model_fingerprint(model: nn.Module) -> str:
    """Hash of parameter/buffer names and shapes: equal for the same architecture and conversion."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)};".encode())
    return h.hexdigest()[:16]


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:08d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = sorted((Path(output_dir) / "checkpoints").glob("step_*"))
    found = [p for p in found if (p / STATE_FILE).exists()]
    return found[-1] if found else None


def start(accelerator, args: argparse.Namespace, scheduler, sparsifier, out_dir: Path, fingerprint: str,
          recipe: str, total_steps: int) -> tuple[int, int]:
    """Register the scheduler and sparsifier for checkpointing, resume from ``--resume_from_checkpoint``,
    start tracking. Returns ``(first step, last step)`` (``--max-steps`` caps the last one)."""
    accelerator.register_for_checkpointing(scheduler)
    if sparsifier is not None:
        accelerator.register_for_checkpointing(sparsifier)
    step = 0
    if args.resume_from_checkpoint:
        path = resolve_checkpoint(args.resume_from_checkpoint, out_dir)
        step = load_checkpoint(accelerator, path, fingerprint, recipe)
        accelerator.print(f"resumed from {path} at step {step}")
    init_tracking(accelerator, args, recipe)
    return step, min(total_steps, args.max_steps) if args.max_steps else total_steps


def train(accelerator, args: argparse.Namespace, model: nn.Module, optimizer, scheduler, train_loader, sampler,
          loss_fn, step: int, last_step: int, steps_per_epoch: int, out_dir: Path, fingerprint: str,
          recipe: str, clip_grad: float = 0.0) -> int:
    """The training loop of both recipes, from optimizer step ``step`` to ``last_step``.

    Resumes mid-epoch exactly (the sampler's epoch order, then ``skip_first_batches``), seeds every
    step, clips the gradient norm to ``clip_grad`` when it is nonzero, logs and checkpoints through
    :func:`end_of_step`, and saves a final checkpoint. ``loss_fn(batch)`` returns the scalar loss of
    one batch. Returns the last step done."""
    bar = tqdm(total=last_step, initial=step, desc="train", disable=not accelerator.is_local_main_process)
    model.train()
    while step < last_step:
        epoch, skip = divmod(step, steps_per_epoch)
        # Accelerate's prepared loader calls set_epoch(its own pass counter) when iterated, over the
        # sampler's epoch; that counter is 0 in a resumed process, so set it (and the sampler) here.
        getattr(train_loader, "set_epoch", sampler.set_epoch)(epoch)
        loader = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        for batch in loader:
            seed_step(args.seed, step, accelerator.process_index)
            loss = loss_fn(batch)
            accelerator.backward(loss)
            if clip_grad:
                accelerator.clip_grad_norm_(model.parameters(), clip_grad)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            end_of_step(accelerator, args, model, scheduler, bar, loss, step, last_step, epoch, out_dir,
                        fingerprint, recipe)
            if step >= last_step:
                break
    bar.close()
    save_checkpoint(accelerator, out_dir, step, fingerprint, recipe, args.keep_checkpoints)
    return step


def end_of_step(accelerator, args, model, scheduler, bar, loss, step: int, last_step: int, epoch: int,
                out_dir: Path, fingerprint: dict, recipe: str) -> None:
    """After optimizer step ``step``: progress bar, logs every ``--log_every`` steps and at the end
    (loss, lr, nonlinear fraction; to the tracker with ``--with_tracking``), and the periodic
    checkpoint every ``--checkpointing_steps``. Raises on a non-finite loss."""
    bar.update(1)
    if step % args.log_every == 0 or step == last_step:
        logs = {"train_loss": loss.item(), "lr": scheduler.get_last_lr()[0], "epoch": epoch,
                **unit_stats(accelerator.unwrap_model(model), args.tol)}
        bar.set_postfix(loss=f"{logs['train_loss']:.3f}", nl=f"{logs.get('nonlinear_fraction', 1.0):.3f}")
        if args.with_tracking:
            accelerator.log(logs, step=step)
        if not math.isfinite(logs["train_loss"]):
            raise FloatingPointError(f"training loss is {logs['train_loss']} at step {step}: lower --lr")
    if args.checkpointing_steps and step % args.checkpointing_steps == 0 and step < last_step:
        save_checkpoint(accelerator, out_dir, step, fingerprint, recipe, args.keep_checkpoints)


def save_checkpoint(accelerator, output_dir: str | Path, step: int, fingerprint: str, recipe: str,
                    keep: int) -> Path:
    """``accelerator.save_state`` plus the step and model fingerprint; prunes old checkpoints."""
    path = checkpoint_dir(output_dir, step)
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        (path / STATE_FILE).write_text(json.dumps({"step": step, "fingerprint": fingerprint, "recipe": recipe}))
        old = sorted((Path(output_dir) / "checkpoints").glob("step_*"))[:-keep] if keep > 0 else []
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def resolve_checkpoint(arg: str, output_dir: str | Path) -> Path:
    """``--resume_from_checkpoint`` value -> a checkpoint directory (``latest``: newest in output_dir)."""
    if arg == "latest":
        path = latest_checkpoint(output_dir)
        if path is None:
            raise FileNotFoundError(f"--resume_from_checkpoint latest: no checkpoint under {output_dir}/checkpoints")
        return path
    path = Path(arg)
    if not (path / STATE_FILE).exists():
        newest = latest_checkpoint(path)  # an output_dir was given
        if newest is None:
            raise FileNotFoundError(f"{path} is not a checkpoint of these recipes (no {STATE_FILE}); "
                                    "pass a directory like OUTPUT_DIR/checkpoints/step_00000100 or 'latest'")
        path = newest
    return path


def load_checkpoint(accelerator, path: Path, fingerprint: str, recipe: str) -> int:
    """Check the checkpoint belongs to this model, ``load_state`` it, return its step."""
    state = json.loads((path / STATE_FILE).read_text())
    if state.get("recipe") != recipe or state.get("fingerprint") != fingerprint:
        raise ValueError(
            f"checkpoint {path} was written by another model ({state.get('recipe')}, fingerprint "
            f"{state.get('fingerprint')}) than this run ({recipe}, fingerprint {fingerprint}): resume with "
            "the same model, dataset and --linearize flags, or start a fresh --output_dir"
        )
    accelerator.load_state(str(path))
    return int(state["step"])


# ----------------------------------------------------------------------------- metrics


def versions() -> dict:
    import accelerate
    import torchvision
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
         "accelerate": accelerate.__version__, "transformers": transformers.__version__,
         "linearize": linearize.__version__}
    for name in ("tokenizers", "sacrebleu", "datasets"):
        try:
            v[name] = __import__(name).__version__
        except ImportError:
            pass
    return v


def command_line(num_processes: int) -> str:
    """The command that ran this recipe (``accelerate launch`` when under several processes)."""
    argv = " ".join(sys.argv)
    if num_processes > 1 or "ACCELERATE_MIXED_PRECISION" in os.environ:
        return f"accelerate launch --num_processes {num_processes} {argv}"
    return f"python {argv}"


def write_metrics(output_dir: str | Path, metrics: dict, args: argparse.Namespace, start_time: float,
                  num_processes: int, device: str) -> Path:
    """Write ``metrics.json``: metrics, wall time, command, arguments, versions."""
    payload = {
        **metrics,
        "wall_time_s": round(time.time() - start_time, 2),
        "num_processes": num_processes,
        "device": device,
        "command": command_line(num_processes),
        "args": {k: v for k, v in vars(args).items()},
        "versions": versions(),
    }
    path = Path(output_dir) / "metrics.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
