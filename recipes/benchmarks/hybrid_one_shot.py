"""Hybrid one-shot on MiniLM's FFNs: per FFN, linear channels (one passthrough) or removed ones (none), at one budget.

The real all-MiniLM-L6-v2 and Multi30k's English sentences, with the helpers of ``affine_one_shot.py``. All three
students are brought to ``--flops`` (0.375x) of the FFN FLOPs, one-shot (no fine-tune), their channels chosen on
``--calibration`` sentences:

- **hybrid**: ``linearize.one_shot(end="hybrid", flops=0.375)``: per FFN, either 384 nonlinear channels and the
  others at their affine fit (the ``d x d`` passthrough paid) or 576 nonlinear and the others constants
  (``alpha = 0``, no passthrough), whichever changes the FFN's output less on the calibration data;
- **affine**: ``linearize.one_shot(target=0.25)`` (384 nonlinear, affine ends, passthrough in every FFN), and the
  same without the refit of each FFN's second layer (``refit=False``);
- **prune**: ``linearize.prune(keep=576, importance="magnitude")``, and pruning with mean compensation and the
  refit (the reconstruction of post-training pruning): ``linearize.one_shot(end="constant", target=576/1536)``,
  the removed plan in every FFN.

Each student is folded or pruned into a real model whose FFN multiply-adds are counted (``affine_one_shot.ffn_flops``)
and checked against the hybrid plan. Metrics on ``--test`` sentences against the original: mean cosine and the
Spearman correlation of all pairwise similarities (``affine_one_shot.quality``). ``--steps N`` then runs the
user loop (AdamW 5e-5, N steps of 32 unseen sentences, cosine distillation) on every student but the one without
refit, without a Sparsifier: slopes stay frozen and removed FFNs' ``alpha`` stays 0, so the folded FLOPs hold.

Run: ``nice -n 10 python recipes/benchmarks/hybrid_one_shot.py --out recipes/results/hybrid_one_shot.json``
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import linearize  # noqa: E402
from affine_one_shot import ffn_flops, load_setup, quality, user_loop  # noqa: E402
from distill import FFN_PATTERNS  # noqa: E402
from prune_vs_linearize import save  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration", type=int, default=256)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--flops", type=float, default=0.375, help="fraction of each FFN's FLOPs")
    parser.add_argument("--target", type=float, default=0.25, help="affine: fraction of channels nonlinear")
    parser.add_argument("--keep", type=int, default=576, help="prune: channels kept per FFN")
    parser.add_argument("--steps", type=int, default=0, help="also fine-tune the hybrid student this many steps")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    setup = load_setup(args.calibration, args.test)
    teacher, calib, test, reference = setup.teacher, setup.calib, setup.test, setup.reference
    base = ffn_flops(teacher)
    command = "nice -n 10 python recipes/benchmarks/hybrid_one_shot.py " + " ".join(argv or sys.argv[1:])
    machine = (f"{platform.machine()} CPU ({os.cpu_count()} cores), {torch.get_num_threads()} thread(s), "
               f"torch {torch.__version__}")
    result: dict = {"command": command, "machine": machine, "args": {k: str(v) for k, v in vars(args).items()},
                    "rows": {}}
    rows = result["rows"]

    start = time.perf_counter()
    hybrid = linearize.convert(copy.deepcopy(teacher), target_modules=FFN_PATTERNS)
    sites = linearize.one_shot(hybrid, calib, end="hybrid", flops=args.flops)
    seconds = round(time.perf_counter() - start, 1)
    plan = {name: {"mode": s.plan.mode, "nonlinear": s.nonlinear, "flops_ratio": s.plan.flops / s.plan.flops_full,
                   "errors": s.plan.errors, "refit_errors": s.plan.refit_errors} for name, s in sites.items()}
    folded = linearize.fold(copy.deepcopy(hybrid).eval(), calib[0], latency=False)
    planned = sum(s.plan.flops for s in sites.values()) // 2  # multiply-adds per token, as ffn_flops counts
    if ffn_flops(folded) != planned:
        raise AssertionError(f"folded hybrid FFN multiply-adds {ffn_flops(folded):,} != the plan's {planned:,}")
    rows["hybrid one-shot"] = {**quality(hybrid, test, reference), "ffn_flops_ratio": ffn_flops(folded) / base,
                               "fold_max_abs_error": folded.linearize_fold_summary.max_abs_error,
                               "seconds": seconds, "plan": plan}
    print("hybrid", rows["hybrid one-shot"], flush=True)

    affine = linearize.convert(copy.deepcopy(teacher), target_modules=FFN_PATTERNS)
    linearize.one_shot(affine, calib, target=args.target)
    affine_folded = linearize.fold(copy.deepcopy(affine).eval(), calib[0], latency=False)
    rows["affine one-shot"] = {**quality(affine, test, reference), "ffn_flops_ratio": ffn_flops(affine_folded) / base}
    print("affine", rows["affine one-shot"], flush=True)

    plain = linearize.convert(copy.deepcopy(teacher), target_modules=FFN_PATTERNS)
    linearize.one_shot(plain, calib, target=args.target, refit=False)
    rows["affine one-shot, no refit"] = quality(plain, test, reference)
    print("affine, no refit", rows["affine one-shot, no refit"], flush=True)

    # pruning with mean compensation and the reconstruction of each FFN's second layer: the removed plan everywhere
    constant = linearize.convert(copy.deepcopy(teacher), target_modules=FFN_PATTERNS)
    linearize.one_shot(constant, calib, target=args.keep / 1536, end="constant")
    constant_folded = linearize.fold(copy.deepcopy(constant).eval(), calib[0], latency=False)
    rows["prune (constant ends), refit, one-shot"] = {**quality(constant, test, reference),
                                                      "ffn_flops_ratio": ffn_flops(constant_folded) / base}
    print("constant ends, refit", rows["prune (constant ends), refit, one-shot"], flush=True)

    pruned = linearize.prune(copy.deepcopy(teacher), keep=args.keep, importance="magnitude", data=calib)
    rows["prune magnitude one-shot"] = {**quality(pruned, test, reference), "ffn_flops_ratio": ffn_flops(pruned) / base}
    print("prune magnitude", rows["prune magnitude one-shot"], flush=True)
    save(result, args.out)

    if args.steps:  # the same loop for every student: frozen slopes, no Sparsifier, the folded FLOPs hold
        students = {"hybrid": hybrid, "affine": affine, "prune (constant ends), refit": constant,
                    "prune magnitude": pruned}
        for label, student in students.items():
            for _, unit in linearize.units(student):  # the nonlinear channels stay at a = 0 too: one plan
                unit.freeze_(~unit.linear_mask(), 0.0)
            start = time.perf_counter()
            loop = user_loop(student, teacher, setup.train(args.steps), test, reference, args.steps, sparsify=False)
            small = student if label == "prune magnitude" else \
                linearize.fold(copy.deepcopy(student).eval(), calib[0], latency=False)
            rows[f"{label} + {args.steps} steps"] = {**loop, "ffn_flops_ratio": ffn_flops(small) / base,
                                                    "seconds": round(time.perf_counter() - start, 1)}
            print(label, "+ loop", rows[f"{label} + {args.steps} steps"], flush=True)
            save(result, args.out)
    return result


if __name__ == "__main__":
    main()
