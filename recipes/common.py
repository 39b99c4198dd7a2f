"""Plumbing shared by the Accelerate recipes (``recipes/cifar.py``, ``recipes/wmt14.py``); the calls of
linearize itself (convert, Sparsifier, freeze, fold, report) are in the recipes.

- argument groups: linearization flags (checked, defaults filled in) and run flags (output, checkpoints,
  tracking);
- the ``Accelerator`` and the training loop (:func:`train`), which checks every step's loss for inf/NaN;
- checkpoints written by the recipes themselves (safetensors, ``torch.load(weights_only=True)`` and
  JSON, so that loading one executes no code), atomically, verified by size and sha256 before use,
  with a fingerprint of the model so a checkpoint directory of another model is refused;
- per-step seeding, so that augmentation and dropout depend only on (seed, step, process),
  which makes a resumed run repeat the uninterrupted one;
- ``metrics.json`` writing (final metrics, unit counts, fold summary, command, versions, wall time).

Everything here is plain Python around ``accelerate.Accelerator``; the recipes stay runnable with
``python recipes/x.py`` (one process) and ``accelerate launch recipes/x.py`` (N processes); with
``--fsdp`` (``recipes/wmt14.py``, ``recipes/distill.py``) :func:`shard` shards the model across the
processes with FSDP2 and the checkpoints gather it onto the main process.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import math
import os
import re
import platform
import shutil
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from tqdm.auto import tqdm

import linearize
from linearize import distributed as sharding
from linearize._files import atomic_write, fsync_path

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
                   help="the run's length in optimizer steps, instead of --epochs (as Hugging Face's max_steps "
                   "and Accelerate's --max_train_steps): the LR and sparsity schedules span these steps")
    g.add_argument("--stop_after", "--stop-after", dest="stop_after", type=int, default=None,
                   help="stop (with a checkpoint) after this many optimizer steps, without changing the "
                   "schedules; --resume_from_checkpoint latest continues the run")
    g.add_argument("--log_every", "--log-every", dest="log_every", type=int, default=50)


def flag(dest: str) -> str:
    """The command-line flag of an argument (``batch_size`` -> ``--batch-size``)."""
    return "--" + dest.replace("_", "-")


def check_run_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the flag for run flags out of range (checked before any data is read):
    ``--epochs`` and ``--log_every`` >= 1, ``--max-steps`` / ``--stop-after`` >= 1 when given,
    ``--checkpointing_steps`` / ``--keep_checkpoints`` >= 0."""
    for name, low in (("epochs", 1), ("log_every", 1), ("max_steps", 1), ("stop_after", 1),
                      ("checkpointing_steps", 0), ("keep_checkpoints", 0)):
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise ValueError(f"{flag(name)} {value}: give a whole number >= {low}")


# What a flag left out means, filled in by check_linearize_args after its checks (the flags default to None
# so that the checks see which ones were given).
LINEARIZE_DEFAULTS = {"schedule": "late", "late_start": 0.5, "ramp_end": 0.8, "granularity": "channel",
                      "linear_end": "identity", "tol": 1e-3,
                      "report_skip": "regions", "report_samples": 128}
# the flags that steer the sparsity pressure: no-ops under --linearize none / dgn / dlgn or --schedule none
PRESSURE_FLAGS = ("target", "target_flops", "target_latency", "late_start", "ramp_end", "rate", "select",
                  "granularity", "lam", "linear_end")


def add_linearize_args(parser: argparse.ArgumentParser, default_mode: str = "prelu",
                       default_select: str = "slope") -> None:
    """``--linearize --schedule --target --late-start --ramp-end --rate --select --granularity --lam --tol
    --freeze --fold --report``.

    By default the pressure is scale-free (``--rate``, slope units per step, auto ``1 / ramp``: the same
    under SGD and AdamW); ``--lam`` is the legacy ``lr * lam`` step. ``default_select`` (pass the same to
    :func:`check_linearize_args`): ``"slope"`` for SGD recipes, ``"saliency"`` for Adam ones (under Adam
    every slope drifts alike, so the slope order no longer says which channels matter). Flags left out
    are None here and get their defaults (:data:`LINEARIZE_DEFAULTS`) in :func:`check_linearize_args`.
    """
    g = parser.add_argument_group("linearization")
    g.add_argument("--linearize", choices=LINEARIZE_MODES, default=default_mode,
                   help="none: the plain model; prelu: blend units; dgn / dlgn: gated splits (need --schedule none)")
    g.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="when the sparsity pressure starts: step 0 (early), --late-start (late, the default), "
                        "never (none)")
    g.add_argument("--target", type=float, default=None,
                   help="fraction of channels left nonlinear at the end, in (0, 1] (default 0.1)")
    g.add_argument("--target-flops", "--target_flops", dest="target_flops", type=float, default=None,
                   help="instead of --target: the folded model's FLOPs as a fraction of the original model folded, "
                        "in (0, 1] (whole sites go linear: needs --granularity site or block)")
    g.add_argument("--target-latency", "--target_latency", dest="target_latency", type=float, default=None,
                   help="instead of --target: the folded model's measured CPU latency at batch 1, as a fraction "
                        "of the original model folded (needs --granularity site or block)")
    g.add_argument("--late-start", "--late_start", dest="late_start", type=float, default=None,
                   help="start of the late schedule: a fraction of training (< 1) or a step (>= 1) (default 0.5)")
    g.add_argument("--ramp-end", "--ramp_end", dest="ramp_end", type=float, default=None,
                   help="fraction of training by which the target is reached (default 0.8)")
    g.add_argument("--rate", type=float, default=None,
                   help="pressure in slope units per step at the peak LR (default: 1 / ramp steps)")
    g.add_argument("--select", choices=("slope", "saliency", "fit"), default=None,
                   help="which channels the target makes linear: slope (pushed highest first; SGD), saliency "
                        "(cheapest by the running squared slope gradient) or fit (least output error of the "
                        "channel's affine fit on the training batches); saliency and fit apply no uniform push, "
                        f"so no --rate or --lam (docs/sparsity.md) (default {default_select})")
    g.add_argument("--linear-end", "--linear_end", dest="linear_end", choices=("identity", "affine"), default=None,
                   help="what a channel computes at slope 1: identity (x, the paper's) or affine (its least-squares "
                        "fit alpha * x + beta on the training batches, docs/affine-ends.md) (default identity)")
    g.add_argument("--granularity", choices=("channel", "site", "block"), default=None,
                   help="channel: each channel on its own; site: the channels of a call site move and become "
                        "linear together (group lasso), the target makes whole sites linear; block: all sites of "
                        "a residual block together (default channel)")
    g.add_argument("--lam", type=float, default=None,
                   help="legacy pressure instead of --rate: each step moves the slopes by lr * lam (--select slope)")
    g.add_argument("--tol", type=float, default=None,
                   help="a channel is linear when its slope >= 1 - tol, in [0, 1), below 0.5 with --freeze "
                        "(default 0.001)")
    g.add_argument("--freeze", action="store_true", help="at the end, freeze linear channels at slope 1")
    g.add_argument("--fold", action="store_true", help="at the end, fold linear parts away (folded/)")
    g.add_argument("--report", action="store_true", help="at the end, write a linearize report (report/)")
    g.add_argument("--report-skip", "--report_skip", dest="report_skip", default=None,
                   help="with --report: comma-separated report measures to skip (of units, path_length, affinity, "
                        "regions, history, gates); exact linear regions of a deep net along image segments can "
                        "take hours (default regions)")
    g.add_argument("--report-samples", "--report_samples", dest="report_samples", type=int, default=None,
                   help="with --report: samples the report measures on, >= 2 (default 128)")


def _no_pressure(args: argparse.Namespace) -> str | None:
    """The flag that turns the sparsity pressure off (``--linearize none`` / ``dgn`` / ``dlgn``,
    ``--schedule none``), or None when there is pressure."""
    if args.linearize != "prelu":
        return f"--linearize {args.linearize}"
    return "--schedule none" if args.schedule == "none" else None


def check_linearize_args(args: argparse.Namespace, default_select: str = "slope") -> None:
    """Raise ``ValueError`` naming the flag for inconsistent, out-of-range or no-op linearization flags,
    then fill in the defaults of the flags left out (:data:`LINEARIZE_DEFAULTS`, ``--select
    default_select``, ``--target 0.1`` unless a cost target is given). Runs before any data is read."""
    given = {k for k in (*PRESSURE_FLAGS, *LINEARIZE_DEFAULTS) if getattr(args, k, None) is not None}
    if args.linearize in ("dgn", "dlgn") and args.schedule != "none":
        raise ValueError(f"--linearize {args.linearize} builds a gated network with no slope units for sparsity "
                         "pressure to act on: add --schedule none")
    if args.linearize == "none" and args.schedule not in (None, "none"):
        raise ValueError(f"--schedule {args.schedule} starts sparsity pressure on units, which --linearize none "
                         "does not have: drop --schedule (or use --linearize prelu)")
    off = _no_pressure(args)
    if off is not None and (useless := [k for k in PRESSURE_FLAGS if k in given]):
        raise ValueError(f"{flag(useless[0])} steers the sparsity pressure, which {off} turns off: drop "
                         f"{', '.join(flag(k) for k in useless)} (or use --linearize prelu with a schedule)")
    if args.schedule == "early" and "late_start" in given:
        raise ValueError("--late-start is the start of --schedule late; --schedule early starts at step 0: "
                         "drop --late-start or use --schedule late")
    costs = [k for k in ("flops", "latency") if getattr(args, f"target_{k}", None) is not None]
    if len(costs) + (args.target is not None) > 1:
        raise ValueError("give one target: --target (a nonlinear fraction), --target-flops or --target-latency")
    if args.target is not None and not 0.0 < args.target <= 1.0:
        raise ValueError(f"--target is the fraction of channels kept nonlinear and must lie in (0, 1], "
                         f"got {args.target}")
    for k in costs:
        if not 0.0 < getattr(args, f"target_{k}") <= 1.0:
            raise ValueError(f"--target-{k} is a fraction of the folded model's {k} and must lie in (0, 1], "
                             f"got {getattr(args, f'target_{k}')}")
        if args.granularity in (None, "channel"):
            raise ValueError(f"--target-{k} makes whole sites linear (the only linearity fold removes): add "
                             "--granularity site or --granularity block")
    if args.late_start is not None and not args.late_start >= 0:
        raise ValueError(f"--late-start must be >= 0 (a fraction of training or a step), got {args.late_start}")
    if args.ramp_end is not None and not 0.0 < args.ramp_end <= 1.0:
        raise ValueError(f"--ramp-end must lie in (0, 1], got {args.ramp_end}")
    if args.rate is not None and args.lam is not None:
        raise ValueError("give one pressure: --rate (slope units per step) or the legacy --lam, not both")
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise ValueError(f"--rate must be a finite number > 0, got {args.rate}")
    if args.lam is not None and not (math.isfinite(args.lam) and args.lam >= 0):
        raise ValueError(f"--lam must be a finite number >= 0, got {args.lam}")
    select = args.select or default_select
    if off is None and select in ("saliency", "fit") and (push := "rate" if args.rate is not None else
                                                           "lam" if args.lam is not None else None):
        why = f"--select {select}" if args.select else f"--select {select} (this recipe's default)"
        raise ValueError(f"--{push} is a uniform push on every slope, which {why} does not apply (it makes "
                         f"the cheapest channels linear): add --select slope, or drop --{push}")
    if args.linearize != "prelu" and (args.freeze or args.fold):
        raise ValueError(f"--freeze/--fold act on slope units, which --linearize {args.linearize} does not "
                         "have: use --linearize prelu, or drop them")
    if args.linearize == "none" and (args.report or "tol" in given):
        raise ValueError(f"{'--report' if args.report else '--tol'} measures units, which --linearize none does "
                         "not have: drop it (or use --linearize prelu, dgn or dlgn)")
    if not args.report and (extra := [k for k in ("report_skip", "report_samples") if k in given]):
        raise ValueError(f"{flag(extra[0])} sets up --report, which is not given: add --report or drop it")
    for k, v in LINEARIZE_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.select = select
    if not costs and args.target is None:
        args.target = 0.10
    from linearize.checks import check_tol

    check_tol(args.tol, 0.5 if args.freeze else 1.0, "--tol" + (" (with --freeze)" if args.freeze else ""))
    if args.report:
        _check_report_args(args)


def schedule_start(args: argparse.Namespace, total_steps: int) -> int | float:
    """``start`` of ``linearize.schedules.target`` from ``--schedule`` / ``--late-start``: a fraction of
    training (float) or an optimizer step (int); refuses a start at or after ``--ramp-end``."""
    if args.schedule == "early":
        return 0
    start = int(args.late_start) if args.late_start >= 1 else float(args.late_start)
    start_step = start if isinstance(start, int) else round(start * total_steps)
    if start_step >= round(args.ramp_end * total_steps):
        raise ValueError(f"--late-start {args.late_start} (step {start_step} of {total_steps}) must come "
                         f"before --ramp-end {args.ramp_end} (step {round(args.ramp_end * total_steps)})")
    return start


def _check_report_args(args: argparse.Namespace) -> None:
    """``--report-skip`` names only known report measures; ``--report-samples`` >= 2."""
    from linearize.reporting import MEASURES

    unknown = [m for m in args.report_skip.split(",") if m and m not in MEASURES]
    if unknown:
        raise ValueError(f"--report-skip: unknown report measures {unknown}; known: {', '.join(MEASURES)}")
    if args.report_samples < 2:
        raise ValueError(f"--report-samples {args.report_samples}: give at least 2 samples")


# ----------------------------------------------------------------------------- accelerator


def has_device() -> bool:
    """Whether an accelerator device (CUDA, MPS, XPU) is present. Without one, ``Accelerator(cpu=False)`` under
    torchrun gives N independent rank-0 processes (accelerate 1.x); ``cpu=True`` gives real DDP over gloo."""
    return torch.cuda.is_available() or torch.backends.mps.is_available() or (
        hasattr(torch, "xpu") and torch.xpu.is_available())


def make_accelerator(args: argparse.Namespace, split_batches: bool) -> "Accelerator":
    """``Accelerator`` with TensorBoard under ``output_dir`` when ``--with_tracking``."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    kwargs = {}
    if args.mixed_precision is not None:
        kwargs["mixed_precision"] = args.mixed_precision
    return Accelerator(
        cpu=args.cpu or not has_device(),
        log_with="tensorboard" if args.with_tracking else None,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=str(Path(args.output_dir) / "logs")),
        dataloader_config=DataLoaderConfiguration(split_batches=split_batches),
        **kwargs,
    )


# ----------------------------------------------------------------------------- FSDP2 (--fsdp)
#
# Accelerate 1.15 runs FSDP only on accelerator devices (on a CPU an FSDP config gives independent single
# processes, or DDP with cpu=True), so under --fsdp the recipes shard the model themselves with
# torch.distributed.fsdp.fully_shard and let the Accelerator (DDP type, gloo or NCCL) handle the processes,
# the data and the optimizer only. Checkpoints hold the whole model and optimizer state, gathered onto the
# main process; evaluation and the final saves use the whole model, gathered onto every process.

FSDP_HELP = ("shard the model across the processes with FSDP2 (torch.distributed.fsdp.fully_shard: each block, "
             "then the rest); launch with torchrun --nproc_per_node N (gloo on a CPU, NCCL on GPUs), "
             "docs/distributed.md")


def check_fsdp(accelerator: "Accelerator", args: argparse.Namespace) -> None:
    """Refuse, with the fix, an Accelerate FSDP launch (``--use_fsdp`` or an FSDP config: on GPUs Accelerate
    would shard the model itself, which the recipes' checkpoints do not read; on a CPU it silently trains DDP),
    ``--fsdp`` on one process, and
    ``--fsdp`` with ``--select fit`` or ``--linear-end affine`` (affine fits of every unit's inputs, kept
    on the whole model: not on a sharded one)."""
    if accelerator.distributed_type == "FSDP" or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        raise ValueError("this run was launched with Accelerate's FSDP (accelerate launch --use_fsdp or an FSDP "
                         "config), which the recipes do not use: launch with torchrun --nproc_per_node N (or "
                         "accelerate launch --multi_gpu --num_processes N) and add --fsdp: the recipe then shards "
                         "the model itself with fully_shard")
    if args.fsdp and accelerator.num_processes < 2:
        raise ValueError("--fsdp shards the model across processes, but this run has one process: launch it with "
                         "torchrun --nproc_per_node N (N >= 2; gloo on a CPU, NCCL on GPUs), or drop --fsdp")
    fits = [f for f, on in (("--select fit", getattr(args, "select", None) == "fit"),
                            ("--linear-end affine", getattr(args, "linear_end", None) == "affine")) if on]
    if args.fsdp and fits:
        raise ValueError(f"{fits[0]} tracks affine fits of the units' inputs on the whole model, which --fsdp "
                         "shards: drop --fsdp (DDP: the whole model on every process), or use --select saliency or slope "
                         "with --linear-end identity")


def shard(model: nn.Module, blocks: Iterable[nn.Module], device: torch.device) -> None:
    """FSDP2 over all processes: ``fully_shard`` each of ``blocks`` (a group gathered for its forward), then
    the root (embeddings, head, what is left). After :func:`linearize.convert`, before the optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds parameters sharded by FSDP2 (``--fsdp``)."""
    return any(sharding.is_sharded(p) for p in model.parameters())


def _state_dict_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def gathered(model: nn.Module, build: Callable[[], nn.Module]) -> nn.Module:
    """The whole of the sharded ``model`` on every process (a collective): ``build()`` makes the same model
    unsharded (converted alike), which gets the gathered weights, units included, on ``model``'s device."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_state_dict_options())
    plain = build().to(sharding.local(next(model.parameters())).device)
    plain.load_state_dict(state)
    return plain


def prepare(accelerator: "Accelerator", model: nn.Module, *others: Any) -> tuple:
    """``accelerator.prepare(model, *others)`` (the optimizer, data loaders); a model sharded by :func:`shard`
    is returned as it is (preparing it would wrap it in DDP)."""
    if not is_sharded(model):
        return accelerator.prepare(model, *others)
    prepared = accelerator.prepare(*others)
    return (model, *(prepared if len(others) > 1 else (prepared,)))


def blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of a Hugging Face model to shard one by one: its modules of the classes its
    ``_no_split_modules`` names (its layers), as Accelerate's ``TRANSFORMER_BASED_WRAP`` picks them."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


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


# ----------------------------------------------------------------------------- training


@dataclass
class Run:
    """The objects of a training run that a checkpoint saves and restores, and the run's identity.

    ``model`` and ``optimizer`` as returned by ``accelerator.prepare``; ``scheduler`` steps once per
    optimizer step; ``sparsifier`` is ``None`` without sparsity pressure; ``fingerprint`` identifies
    the model (and whatever else must match on resume), ``recipe`` the script.
    """

    accelerator: Accelerator
    args: argparse.Namespace
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sparsifier: linearize.Sparsifier | None
    out_dir: Path
    fingerprint: str
    recipe: str
    total_steps: int | None = None  # the run's length (set by :func:`start`); must match on resume
    started: float = field(default_factory=time.time)  # when this process began the run
    earlier_s: float = 0.0  # wall time of the earlier processes up to the checkpoint resumed from

    def elapsed_s(self) -> float:
        """Wall time of the run so far: earlier processes up to the checkpoint it resumed from (time
        after their last checkpoint, redone here, is not counted twice) plus this process's."""
        return self.earlier_s + max(0.0, time.time() - self.started)  # a wall clock stepped back counts 0


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
    if args.resume_from_checkpoint:
        ckpt, skipped = find_checkpoint(args.resume_from_checkpoint, run.out_dir)
        if acc.is_main_process:
            for reason in skipped:
                warnings.warn(f"skipping a damaged checkpoint: {reason}", RuntimeWarning, stacklevel=2)
        load_checkpoint(run, ckpt)
        step = ckpt.step
        acc.print(f"resumed from {ckpt.path} at step {step}")
    init_tracking(acc, args, run.recipe)
    return step, min(total_steps, args.stop_after) if args.stop_after else total_steps


NONFINITE_ADVICE = ("Lower --lr (or add warm-up or gradient clipping) and start again in a fresh --output_dir: "
                    "resuming from a checkpoint with the same flags repeats the same steps exactly")


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


# ----------------------------------------------------------------------------- checkpoints
#
# OUTPUT_DIR/checkpoints/step_XXXXXXXX (the state after XXXXXXXX optimizer steps) holds
#   model.safetensors  the unwrapped model's state dict (tied tensors once)
#   optimizer.pt       the optimizer's state dict, read back with torch.load(weights_only=True)
#   recipe_state.json  written last: format, step, recipe, model fingerprint, the run's arguments
#                      (recorded_args: a resume with others is refused), the LR scheduler's, sparsifier's
#                      and grad scaler's state, and size + sha256 of the two files above.
# Only the main process writes, into .tmp-step_XXXXXXXX-<pid> beside it, renamed into place when
# complete; every process reads. No file of a checkpoint is unpickled with code execution. Under --fsdp
# both states are gathered whole onto the main process (the optimizer's keyed by parameter names, so such a
# checkpoint resumes only a --fsdp run: --fsdp is a recorded argument) and every process loads its shards.

CHECKPOINT_FORMAT = 2
# Arguments that do not change what a run computes (where it reads and writes, how it checkpoints and logs,
# when this process stops): a resume (recipe_state.json records the others) and sweep.adopt ignore them.
NEUTRAL_ARGS = frozenset({
    "output_dir", "data_dir", "cache_dir", "download", "train_file", "validation_file", "test_file", "cpu",
    "mixed_precision", "resume_from_checkpoint", "with_tracking", "log_every", "checkpointing_steps",
    "keep_checkpoints", "stop_after", "init_from"})
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
TMP_PREFIX = ".tmp-"
# The `frozen` buffer of a linearize unit holds NaN for free channels (0 or 1 for frozen ones).
NAN_SENTINEL_SUFFIX = ".frozen"


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be used: incomplete, damaged, unsafe to load or non-finite."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


@dataclass
class Checkpoint:
    """A checkpoint read into CPU memory and verified (see :func:`read_checkpoint`)."""

    path: Path
    step: int
    recipe: str | None
    fingerprint: str | None
    model: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    sparsifier: dict | None
    scaler: dict | None
    total_steps: int | None = None  # the run length it was written by (None: before it was recorded)
    elapsed_s: float = 0.0  # wall time of the run up to this checkpoint (0: before it was recorded)
    args: dict | None = None  # recorded_args of the run that wrote it (None: before they were recorded)


def json_value(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists, other objects their ``str``)."""
    return json.loads(json.dumps(value, default=str))


def recorded_args(args: argparse.Namespace) -> dict:
    """The arguments that change what a run computes (all but :data:`NEUTRAL_ARGS`), as JSON values."""
    return {k: json_value(v) for k, v in sorted(vars(args).items()) if k not in NEUTRAL_ARGS}


# Values a recipe adds to its arguments once it has read its inputs, recorded and compared like them: the name
# a difference is reported under.
DERIVED_ARGS = {"teacher_sha256": "the --distill teacher (the --init-from weights), sha256"}


def args_differences(stored: dict, args: argparse.Namespace) -> list[str]:
    """``--flag A (now B)`` for every argument of ``stored`` (:func:`recorded_args` of an earlier run) that
    ``args`` sets otherwise; arguments one side lacks (added or removed by another version) are not compared."""
    now = recorded_args(args)
    return [f"{DERIVED_ARGS.get(k, flag(k))} {stored[k]!r} (now {now[k]!r})" for k in sorted(stored.keys() & now.keys())
            if stored[k] != now[k]]


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """First 16 hex digits of the sha256 of a state dict: names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def model_fingerprint(model: nn.Module) -> str:
    """Hash of parameter/buffer names and shapes: equal for the same architecture and conversion."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)};".encode())
    return h.hexdigest()[:16]


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """``OUTPUT_DIR/checkpoints/step_XXXXXXXX``: the checkpoint after ``step`` optimizer steps."""
    return Path(output_dir) / "checkpoints" / f"step_{step:08d}"


def first_nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """Name of the first floating tensor holding inf or NaN (NaN allowed in units' ``frozen`` buffers)."""
    for name, t in tensors:
        if not torch.is_floating_point(t):
            continue
        ok = ~torch.isinf(t).any() if name.endswith(NAN_SENTINEL_SUFFIX) else torch.isfinite(t).all()
        if not bool(ok):
            return name
    return None


def _optimizer_tensors(state: dict) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of an optimizer state dict's per-parameter state (momentum buffers, ...)."""
    return [(f"state.{i}.{k}", v) for i, s in state.get("state", {}).items() for k, v in s.items()
            if isinstance(v, torch.Tensor)]


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(run: Run, step: int) -> Path:
    """Write the checkpoint of ``step`` (main process; atomically) and prune old ones to
    ``--keep_checkpoints``. Raises ``FloatingPointError`` instead of writing non-finite tensors."""
    from safetensors.torch import save_file, save_model

    acc = run.accelerator
    path = checkpoint_dir(run.out_dir, step)
    raw = acc.unwrap_model(run.model)
    if is_sharded(raw):  # --fsdp: the whole state gathered onto the main process ({} on the others)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(raw, run.optimizer.optimizer,
                                                      options=_state_dict_options(cpu_offload=True))
    else:
        model_state, optimizer_state = raw.state_dict(), run.optimizer.state_dict()
    bad = first_nonfinite(chain(model_state.items(), _optimizer_tensors(optimizer_state)))
    if is_sharded(raw):  # the main process found it: every process stops
        from accelerate.utils import broadcast_object_list

        bad = broadcast_object_list([bad])[0]
    if bad is not None:
        raise FloatingPointError(f"{bad} holds inf or NaN after optimizer step {step}: not writing checkpoint "
                                 f"{path}. {NONFINITE_ADVICE}")
    if acc.is_main_process:
        state = {"format": CHECKPOINT_FORMAT, "step": step, "recipe": run.recipe, "fingerprint": run.fingerprint,
                 "total_steps": run.total_steps, "elapsed_s": round(run.elapsed_s(), 3),
                 "args": recorded_args(run.args),
                 "scheduler": run.scheduler.state_dict(),
                 "sparsifier": None if run.sparsifier is None else run.sparsifier.state_dict(),
                 "scaler": None if acc.scaler is None else acc.scaler.state_dict()}
        tmp = path.parent / f"{TMP_PREFIX}{path.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if is_sharded(raw):
            save_file(model_state, str(tmp / MODEL_FILE))
        else:
            save_model(raw, str(tmp / MODEL_FILE))
        torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        state["files"] = {}
        for name in (MODEL_FILE, OPTIMIZER_FILE):
            fsync_path(tmp / name)
            state["files"][name] = {"size": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
        try:
            state["state_sha256"] = _state_digest(state)  # a flipped bit in the JSON itself is caught too
            text = json.dumps(state, indent=1)
        except TypeError as e:
            raise TypeError(f"checkpoint state of step {step} is not JSON ({e}): the LR scheduler's lambdas must be "
                            "plain functions, the sparsifier's state plain values") from e
        (tmp / STATE_FILE).write_text(text)
        fsync_path(tmp / STATE_FILE)
        if path.exists():  # a damaged folder of this step, or the final step written again
            _remove(path)
        tmp.rename(path)
        fsync_path(path.parent)
        if run.args.keep_checkpoints > 0:
            # The newest --keep_checkpoints of this run: the one just written and those before it.
            # Folders of later steps (left by a run resumed from an earlier checkpoint) are neither
            # counted nor removed: counting them would delete the checkpoint just written.
            older = sorted(p for p in path.parent.glob("step_*") if p.name < path.name)
            for p in older[:max(0, len(older) - (run.args.keep_checkpoints - 1))]:
                _remove(p)
    acc.wait_for_everyone()
    return path


def _remove(path: Path) -> None:
    """Delete a checkpoint folder: renamed to a temp name first, so that an interrupted delete leaves
    no half-deleted ``step_*`` folder (only a temp folder, removed at the next start)."""
    doomed = path.parent / f"{TMP_PREFIX}{path.name}-removed-{os.getpid()}"
    path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_partial_checkpoints(output_dir: str | Path) -> list[Path]:
    """Remove the temp folders that interrupted checkpoint writes left under ``OUTPUT_DIR/checkpoints``.

    One exception: a complete, verified write of a step whose folder is missing (a rewrite of the same
    step killed between removing the old folder and renaming the new one into place) is renamed into
    place instead. Returns the temp folders removed."""
    root = Path(output_dir) / "checkpoints"
    removed = []
    for p in sorted(root.glob(f"{TMP_PREFIX}step_*")):
        name = p.name[len(TMP_PREFIX):].split("-")[0]
        target = root / name
        if "-removed-" not in p.name and name[5:].isdigit() and not target.exists():
            try:
                complete = read_checkpoint(p).step == int(name[5:])
            except CheckpointError:
                complete = False
            if complete:
                p.rename(target)
                continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _load(path: Path, what: str, loader: Callable[[Path], Any]) -> Any:
    """``loader(path)``, with any failure (missing, truncated, refused by ``weights_only``) as a CheckpointError."""
    if not path.is_file():
        raise CheckpointError(path.parent, f"{path.name} ({what}) is missing")
    try:
        return loader(path)
    except Exception as e:  # SafetensorError, RuntimeError (bad zip), UnpicklingError (weights_only), ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise CheckpointError(path.parent, f"{path.name} ({what}) cannot be read safely: "
                                           f"{type(e).__name__}: {first}") from e


def _torch_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _safetensors_load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read and verify one checkpoint folder; raise :class:`CheckpointError` saying what is wrong.

    Verified: the state JSON parses; every file it lists has its size and sha256; the tensors load
    without executing code (safetensors, ``torch.load(weights_only=True)``) and are finite.
    Folders written by ``accelerator.save_state`` (before format 2) are read by
    :func:`_read_accelerate_layout`.
    """
    path = Path(path)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(path, f"no {STATE_FILE} (an interrupted or foreign checkpoint)")
    try:
        state = json.loads(state_file.read_text())
        step = state["step"]
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise CheckpointError(path, f"{STATE_FILE} is empty or damaged ({type(e).__name__}: {e})") from e
    problem = _state_problem(state, path)
    if problem:
        raise CheckpointError(path, f"{STATE_FILE} is damaged or was edited: {problem}")
    if "files" not in state:
        ckpt = _read_accelerate_layout(path, state)
    else:
        for name, meta in state["files"].items():
            f = path / name
            if not f.is_file():
                raise CheckpointError(path, f"{name} is missing")
            if f.stat().st_size != meta["size"]:
                raise CheckpointError(path, f"{name} has {f.stat().st_size} bytes, {STATE_FILE} says {meta['size']} "
                                            "(truncated)")
            if file_sha256(f) != meta["sha256"]:
                raise CheckpointError(path, f"{name} does not match its sha256 in {STATE_FILE} (modified or damaged)")
        ckpt = Checkpoint(path, step, state.get("recipe"), state.get("fingerprint"),
                          _load(path / MODEL_FILE, "model weights", _safetensors_load),
                          _load(path / OPTIMIZER_FILE, "optimizer state", _torch_load),
                          state["scheduler"], state.get("sparsifier"), state.get("scaler"),
                          total_steps=state.get("total_steps"), elapsed_s=float(state.get("elapsed_s", 0.0)),
                          args=state.get("args"))
    bad = first_nonfinite(chain(ckpt.model.items(), _optimizer_tensors(ckpt.optimizer)))
    if bad is not None:
        raise CheckpointError(path, f"{bad} holds inf or NaN")
    return ckpt


def _state_digest(state: dict) -> str:
    """sha256 of ``state`` (less its own ``state_sha256``) as canonical JSON (floats round-trip exactly)."""
    rest = json.loads(json.dumps({k: v for k, v in state.items() if k != "state_sha256"}))  # as read back:
    # int keys become strings, tuples lists
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _state_problem(state: Any, path: Path) -> str | None:
    """What is wrong with the structure of a parsed ``recipe_state.json`` (None when nothing is)."""
    if not isinstance(state, dict):
        return f"expected a JSON object, got {type(state).__name__}"
    if "state_sha256" in state and state["state_sha256"] != _state_digest(state):  # absent before it was added
        return "its contents do not match the sha256 recorded in it (a flipped bit, or edited)"
    step = state.get("step")
    if type(step) is not int or step < 0:
        return f"step {step!r} is not a non-negative integer"
    if path.name.startswith("step_") and path.name[5:].isdigit() and int(path.name[5:]) != step:
        return f"it says step {step}, the folder name says {int(path.name[5:])}"
    if "files" not in state:  # the accelerate layout: its own files are checked when read
        return None
    files = state["files"]
    if not isinstance(files, dict) or set(files) != {MODEL_FILE, OPTIMIZER_FILE}:
        return f"'files' must record exactly {MODEL_FILE} and {OPTIMIZER_FILE}"
    for name, meta in files.items():
        if not (isinstance(meta, dict) and type(meta.get("size")) is int and isinstance(meta.get("sha256"), str)):
            return f"'files' entry of {name} must be {{size, sha256}}"
    if not isinstance(state.get("scheduler"), dict):
        return "no LR scheduler state"
    if "args" in state and not isinstance(state["args"], dict):
        return "'args' is not a JSON object"
    for key in ("sparsifier", "scaler"):
        if state.get(key) is not None and not isinstance(state[key], dict):
            return f"{key!r} is neither null nor a JSON object"
    elapsed = state.get("elapsed_s", 0.0)
    if type(elapsed) not in (int, float) or not math.isfinite(elapsed) or elapsed < 0:
        return f"elapsed_s {elapsed!r} is not a finite number of seconds >= 0"
    return None


def _read_accelerate_layout(path: Path, state: dict) -> Checkpoint:
    """A checkpoint of the recipes before format 2, written by ``accelerator.save_state``:
    ``model.safetensors``, ``optimizer.bin`` and the registered LR scheduler and sparsifier as
    ``custom_checkpoint_<i>.pkl`` (or ``scheduler.bin``), all read with ``torch.load(weights_only=True)``.
    ``random_states_*.pkl`` is not read: every step is re-seeded."""
    scheduler = sparsifier = None
    for f in sorted(path.glob("custom_checkpoint_*.pkl")) + sorted(path.glob("scheduler*.bin")):
        obj = _load(f, "registered state", _torch_load)
        if isinstance(obj, dict) and {"step_count", "channels", "history"} <= obj.keys():
            sparsifier = obj
        elif isinstance(obj, dict) and "base_lrs" in obj:
            scheduler = obj
        else:
            raise CheckpointError(path, f"{f.name} holds neither an LR scheduler's nor a sparsifier's state")
    if scheduler is None:
        raise CheckpointError(path, "no LR scheduler state (custom_checkpoint_*.pkl or scheduler.bin)")
    return Checkpoint(path, int(state["step"]), state.get("recipe"), state.get("fingerprint"),
                      _load(path / MODEL_FILE, "model weights", _safetensors_load),
                      _load(path / "optimizer.bin", "optimizer state", _torch_load), scheduler, sparsifier, None)


def find_checkpoint(arg: str, output_dir: str | Path) -> tuple[Checkpoint, list[str]]:
    """``--resume_from_checkpoint`` value -> ``(checkpoint, why newer folders were skipped)``.

    ``latest`` (or an output folder): the newest intact checkpoint under ``OUTPUT_DIR/checkpoints``,
    skipping damaged ones. A checkpoint folder: that one, or a :class:`CheckpointError`.
    """
    if arg != "latest":
        path = Path(arg)
        if (path / STATE_FILE).exists() or path.name.startswith("step_"):
            return read_checkpoint(path), []
        if not (path / "checkpoints").is_dir():
            raise FileNotFoundError(f"{path} is not a checkpoint of these recipes (no {STATE_FILE}); "
                                    "pass a directory like OUTPUT_DIR/checkpoints/step_00000100 or 'latest'")
        output_dir = path  # an output_dir was given
    root = Path(output_dir) / "checkpoints"
    found = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    if not found:
        raise FileNotFoundError(f"--resume_from_checkpoint {arg}: no checkpoint under {root}")
    skipped: list[str] = []
    for p in found:
        try:
            return read_checkpoint(p), skipped
        except CheckpointError as e:
            skipped.append(str(e))
    raise CheckpointError(root, "no intact checkpoint to resume from:\n  " + "\n  ".join(skipped) +
                          "\nstart again without --resume_from_checkpoint (in a fresh --output_dir)")


def _load_model_state(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """``load_state_dict`` that accepts tied tensors stored once (safetensors drops their aliases)."""
    own = model.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    loaded = {(own[k].data_ptr(), own[k].shape) for k in state if k in own}
    missing = [k for k in missing if (own[k].data_ptr(), own[k].shape) not in loaded]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit this model (missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}): resume with the same model and --linearize flags")


def load_checkpoint(run: Run, ckpt: Checkpoint) -> None:
    """Check that ``ckpt`` belongs to this run's model and load it into the run's objects."""
    if ckpt.recipe != run.recipe or ckpt.fingerprint != run.fingerprint:
        raise ValueError(
            f"checkpoint {ckpt.path} was written by another model ({ckpt.recipe}, fingerprint {ckpt.fingerprint}) "
            f"than this run ({run.recipe}, fingerprint {run.fingerprint}): resume with the same model, dataset "
            "and --linearize flags (and --channels-last where the recipe has it), or start a fresh --output_dir")
    if ckpt.total_steps is not None and run.total_steps is not None and ckpt.total_steps != run.total_steps:
        raise ValueError(
            f"checkpoint {ckpt.path} belongs to a run of {ckpt.total_steps} optimizer steps, this one has "
            f"{run.total_steps}: the LR and sparsity schedules span the run, so resume with the same --epochs and "
            "--max-steps (to stop early and resume later, use --stop-after)")
    if (ckpt.sparsifier is None) != (run.sparsifier is None):
        has = "no" if ckpt.sparsifier is None else "a"
        raise ValueError(f"checkpoint {ckpt.path} has {has} sparsifier state but this run "
                         f"{'uses' if run.sparsifier is not None else 'has no'} sparsity pressure: resume with the "
                         "same --linearize/--schedule flags")
    if ckpt.args is not None and (changed := args_differences(ckpt.args, run.args)):
        raise ValueError(f"checkpoint {ckpt.path} belongs to a run with other settings: {'; '.join(changed)}; "
                         f"resume with the flags the run was started with ({STATE_FILE} records them), or start "
                         "a fresh --output_dir")
    raw = run.accelerator.unwrap_model(run.model)
    if is_sharded(raw):  # --fsdp: every process takes its shards of the whole state
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(raw, run.optimizer.optimizer, model_state_dict=ckpt.model, optim_state_dict=ckpt.optimizer,
                       options=_state_dict_options())
    else:
        _load_model_state(raw, ckpt.model, ckpt.path)
        run.optimizer.load_state_dict(ckpt.optimizer)
    run.scheduler.load_state_dict(ckpt.scheduler)
    if run.sparsifier is not None:
        run.sparsifier.load_state_dict(ckpt.sparsifier)
    if run.accelerator.scaler is not None and ckpt.scaler:
        run.accelerator.scaler.load_state_dict(ckpt.scaler)
    run.earlier_s = ckpt.elapsed_s


# ----------------------------------------------------------------------------- final model folder


def read_recipe_json(directory: str | Path, required: Iterable[str] = ()) -> dict:
    """``directory/recipe.json`` of a model saved by a recipe (``OUTPUT_DIR/model``), after putting back
    a folder an interrupted save left aside (:func:`restore_aside`); a clear error when there is none,
    or when it lacks one of the ``required`` keys."""
    directory = Path(directory)
    restore_aside(directory)
    path = directory / "recipe.json"
    if not path.is_file():
        raise FileNotFoundError(f"no recipe.json in {directory}: not a model folder written by a recipe "
                                "(OUTPUT_DIR/model, with recipe.json and model.safetensors)")
    try:
        meta = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the save is damaged: train again or restore it") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds {type(meta).__name__}, not a JSON object; the save is damaged")
    missing = [k for k in required if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks {missing}: the save is damaged or not of this recipe; train again or restore it")
    return meta


def file_records(directory: Path, exclude: Iterable[str] = ("recipe.json",)) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` of the files directly in ``directory`` (less ``exclude`` and hidden files,
    such as the save lock of ``linearize.save_pretrained``): the ``files`` field of a saved model's
    ``recipe.json``, which :func:`check_files` verifies on load."""
    return {f.name: {"size": f.stat().st_size, "sha256": file_sha256(f)} for f in sorted(Path(directory).iterdir())
            if f.is_file() and f.name not in set(exclude) and not f.name.startswith(".")}


def check_files(directory: str | Path, meta: dict) -> None:
    """Verify the files ``recipe.json`` of ``directory`` records (``meta["files"]``: :func:`file_records`)
    by size and sha256; raise ``linearize.LoadError`` naming the file. Saves from before the field
    existed have no ``files``: nothing to check."""
    directory = Path(directory)
    path = directory / "recipe.json"
    files = meta.get("files")
    if files is None:
        return
    if not isinstance(files, dict) or not all(
            Path(n).name == n and isinstance(r, dict) and type(r.get("size")) is int and isinstance(r.get("sha256"), str)
            for n, r in files.items()):
        raise linearize.LoadError(f"{path}: field 'files' must map file names of this folder to {{size, sha256}}; "
                                  "the save is damaged or was edited: train again or restore it")
    for name, rec in files.items():
        f = directory / name
        if not f.is_file() or f.stat().st_size != rec["size"] or file_sha256(f) != rec["sha256"]:
            raise linearize.LoadError(f"{f}: missing, truncated or modified (its size or sha256 is not the one "
                                      f"{path} recorded); refusing to load it")


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (signal 0 probes without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0
    return True


def _temp_siblings(directory: Path, old: bool | None) -> list[Path]:
    """The temp folders that killed runs of :func:`replaced_dir` left for ``directory``:
    ``.tmp-<name>-<pid>`` (stages) and ``.tmp-<name>-old-<pid>`` (old folders set aside); ``old`` picks
    one kind (None: both). Exact names only (``.tmp-model-best-old-7`` belongs to ``model-best``, never to
    ``model``), and only of processes that no longer run: a live writer's folders are its own."""
    kind = {True: "old-", False: "", None: "(?:old-)?"}[old]
    pattern = re.compile(rf"{re.escape(TMP_PREFIX + directory.name)}-{kind}(\d+)")
    found = []
    for p in directory.parent.glob(glob.escape(f"{TMP_PREFIX}{directory.name}-") + "*"):
        match = pattern.fullmatch(p.name)
        if match and not _pid_alive(int(match.group(1))):
            found.append(p)
    return found


def _link_target(directory: Path) -> Path:
    """The folder a save of ``directory`` writes: the target of a symlink (dangling or not), else itself."""
    return directory.resolve() if directory.is_symlink() else directory


def restore_aside(directory: str | Path) -> Path | None:
    """Put back the folder that :func:`replaced_dir` had renamed aside when it was killed between its
    two renames (``directory``, or the target of the symlink ``directory``, missing;
    ``.tmp-<name>-old-<pid>`` of a process that no longer runs present: the newest such copy).
    Returns the folder restored, or ``None`` when there was nothing to do."""
    directory = _link_target(Path(directory))
    if directory.exists() or directory.is_symlink():
        return None
    aside = sorted(_temp_siblings(directory, old=True), key=lambda p: p.stat().st_mtime)
    if not aside:
        return None
    aside[-1].rename(directory)
    fsync_path(directory.parent)
    return directory


@contextlib.contextmanager
def replaced_dir(directory: str | Path):
    """Write a folder as a whole: yields a fresh temp sibling to fill; on success it replaces
    ``directory`` (old folder renamed aside, new one renamed into place, old one deleted), on any
    failure it is deleted and ``directory`` is left as it was. Readers see the old folder or the
    complete new one (or, killed between the two renames, none until the next write, which puts the
    old one back first: never a mix of the two, never a lost folder)."""
    directory = _link_target(Path(directory))  # a link to the real folder: replace that one
    directory.parent.mkdir(parents=True, exist_ok=True)
    restore_aside(directory)
    for leftover in _temp_siblings(directory, old=None):  # of interrupted saves
        shutil.rmtree(leftover, ignore_errors=True)
    stage = directory.with_name(f"{TMP_PREFIX}{directory.name}-{os.getpid()}")
    stage.mkdir()
    try:
        yield stage
        for f in stage.iterdir():
            if f.is_file():
                fsync_path(f)
        if directory.is_dir():
            old = directory.with_name(f"{TMP_PREFIX}{directory.name}-old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
            try:
                stage.rename(directory)
            except BaseException:
                old.rename(directory)  # the earlier folder back in place
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(stage, directory)  # raises for a file (or a dangling link) in the way: nothing removed
        fsync_path(directory.parent)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- metrics


def unit_stats(model: nn.Module, tol: float) -> dict:
    """``{"nonlinear_fraction", "units_total", "units_nonlinear"}`` (``linearize.count_units``), or ``{}``
    for a model without units (``--linearize none``)."""
    if not linearize.units(model):
        return {}
    c = linearize.count_units(model, tol)
    return {"nonlinear_fraction": c["nonlinear"] / c["total"], "units_total": c["total"],
            "units_nonlinear": c["nonlinear"]}


FOLD_METRICS = ("params_before", "params_after", "flops_before", "flops_after", "max_abs_error", "output_scale")


def fold_metrics(folded: nn.Module, path: Path) -> dict:
    """The ``fold`` entry of ``metrics.json``: where the folded model was saved, and its
    ``linearize_fold_summary`` (parameters and FLOPs before and after, the largest error of the check)."""
    summary = folded.linearize_fold_summary
    return {"path": str(path), **{k: getattr(summary, k) for k in FOLD_METRICS}}


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
                  num_processes: int, device: str, earlier_s: float = 0.0) -> Path:
    """Write ``metrics.json``: metrics, wall time, command, arguments, versions.

    ``wall_time_s`` is the whole run's: ``earlier_s`` (the processes before a resume, up to the
    checkpoint resumed from: :attr:`Run.earlier_s`) plus this process's since ``start_time``
    (``wall_time_this_process_s``)."""
    this = max(0.0, time.time() - start_time)  # a wall clock stepped back (NTP) counts 0, never negative
    payload = {
        **metrics,
        "wall_time_s": round(earlier_s + this, 2),
        "wall_time_this_process_s": round(this, 2),
        "num_processes": num_processes,
        "device": device,
        "command": command_line(num_processes),
        "args": {k: v for k, v in vars(args).items()},
        "versions": versions(),
    }
    return atomic_write(Path(output_dir) / "metrics.json", json.dumps(payload, indent=2, default=str))
