"""Argument groups of the recipes and their checks: the linearization flags (checked, defaults filled in)
and the run flags (output, seed, precision, tracking, checkpoints, run length). Every check raises
``ValueError`` naming the flag, before any data is read."""

from __future__ import annotations

import argparse
import math


LINEARIZE_MODES = ("none", "prelu", "dgn", "dlgn")
SCHEDULES = ("early", "late", "none")


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
                   default=None, help="a checkpoint directory, or 'latest' (newest under output_dir; none yet: "
                   "start at step 0)")
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
