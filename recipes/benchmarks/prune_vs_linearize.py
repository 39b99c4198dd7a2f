"""Linearize against structured pruning on MiniLM's FFNs, at equal FFN FLOPs.

The real all-MiniLM-L6-v2 and Multi30k's English sentences, with the helpers of ``affine_one_shot.py``:

- **linearize**: ``linearize.one_shot`` (affine ends) keeps 25% of each FFN's 1,536 channels nonlinear; folded,
  an FFN costs ``d*n + (n + d)*d`` multiply-adds per token (d = 384, n = 384: the nonlinear channels plus the
  ``d x d`` passthrough of the linear ones);
- **prune**: ``linearize.prune`` keeps 576 of the 1,536 channels of each FFN (``2*d*576``: the same count; the
  script checks the equality on the two real models), ranked by magnitude, Taylor or the affine-fit residual.

Each is measured one-shot (no fine-tune) and after the obvious user loop (``affine_one_shot.user_loop``: AdamW
5e-5, ``--steps`` batches of 32 unseen sentences, cosine distillation to the original; the linearize students
with the Sparsifier to 25% as that script's ``--steps`` runs them, the pruned ones without). Metrics on the
1,000 test sentences against the original model: mean cosine, Spearman correlation of all pairwise
similarities, nearest-neighbour agreement (the fraction of sentences whose nearest other sentence is the
same for student and original); FFN FLOPs; CPU latency of the original, folded and pruned models at batch 1
and 32 (``linearize.timing.median_latency_ms``: repetitions interleaved, one thread).

Run: ``nice -n 10 python recipes/benchmarks/prune_vs_linearize.py --steps 300 --out prune_vs_linearize.json``
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import linearize  # noqa: E402
from affine_one_shot import embed, ffn_flops, load_setup, quality, user_loop  # noqa: E402
from distill import FFN_PATTERNS  # noqa: E402
from linearize.timing import busy_cpu, median_latency_ms  # noqa: E402


def neighbour_agreement(student: torch.Tensor, teacher: torch.Tensor) -> float:
    """Fraction of rows whose nearest other row (cosine; rows normalized) is the same in both embeddings."""
    def nearest(e: torch.Tensor) -> torch.Tensor:
        sim = e @ e.T
        sim.fill_diagonal_(-float("inf"))
        return sim.argmax(1)

    return float((nearest(student) == nearest(teacher)).double().mean())


def measure(student, test: list[dict], reference: torch.Tensor) -> dict:
    out = quality(student, test, reference)
    out["nn_agreement"] = neighbour_agreement(embed(student.eval(), test), reference)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration", type=int, default=256)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--target", type=float, default=0.25, help="linearize: fraction of channels nonlinear")
    parser.add_argument("--keep", type=int, default=576, help="prune: channels kept per FFN")
    parser.add_argument("--importances", default="magnitude,taylor,residual")
    parser.add_argument("--steps", type=int, default=0, help="also run the user loop for this many steps")
    parser.add_argument("--loop", default="linearize,magnitude,taylor,residual",
                        help="which students get the user loop: linearize (one-shot start), defaults (convert "
                             "only), and pruning importances")
    parser.add_argument("--latency-budget", type=float, default=4.0, help="seconds of timing per batch size")
    parser.add_argument("--no-refit", action="store_true",
                        help="one_shot(refit=False): no least-squares refit of each FFN's second layer")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    setup = load_setup(args.calibration, args.test)
    teacher, calib, test, reference = setup.teacher, setup.calib, setup.test, setup.reference
    rows: dict[str, dict] = {}
    students: dict[str, torch.nn.Module] = {}

    linear = linearize.convert(copy.deepcopy(teacher), target_modules=FFN_PATTERNS)
    linearize.one_shot(linear, calib, target=args.target, refit=not args.no_refit)
    students["linearize"] = linear
    rows["linearize one-shot"] = measure(linear, test, reference)
    for importance in args.importances.split(","):
        pruned = linearize.prune(copy.deepcopy(teacher), keep=args.keep, importance=importance, data=calib)
        students[importance] = pruned
        rows[f"prune {importance} one-shot"] = measure(pruned, test, reference)
        print(f"prune {importance}", rows[f"prune {importance} one-shot"], flush=True)
    print("linearize", rows["linearize one-shot"], flush=True)

    folded = {"linearize one-shot": linearize.fold(copy.deepcopy(linear).eval(), calib[0], latency=False)}
    base = ffn_flops(teacher)
    flops = {name: ffn_flops(m) for name, m in [*folded.items(), *((f"prune {k}", v) for k, v in students.items()
                                                                  if k != "linearize")]}
    if len(set(flops.values())) != 1:
        raise AssertionError(f"FFN multiply-adds per token differ: {flops}")
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "ffn_macs_per_token": flops,
                    "ffn_macs_per_token_original": base, "ffn_flops_ratio": next(iter(flops.values())) / base,
                    "rows": rows}
    # timed before the loop, so that a stopped run keeps them: the loop changes the pruned models' weights, not
    # their shapes, and keeps the linearize student's linear channels frozen at a = 1 (its folded FFN FLOPs after
    # the loop are reported with its row)
    timed = {"original": teacher, **folded, **{f"prune {k}": v for k, v in students.items() if k != "linearize"}}
    latency: dict = {"busy_cpu": busy_cpu(), "threads": 1}
    for size in (1, 32):
        inputs = dict(setup.tokenizer(setup.test_texts[:size], padding=True, truncation=True, max_length=64, return_tensors="pt"))
        ms = median_latency_ms([m.eval() for m in timed.values()], inputs, budget_s=args.latency_budget, threads=1)
        latency[f"batch_{size}_ms"] = dict(zip(timed, ms))
    print("latency", latency, flush=True)
    result["latency"] = latency
    save(result, args.out)

    if args.steps:
        train = setup.train(args.steps)
        for name in args.loop.split(","):
            if name == "defaults":
                student = linearize.convert(copy.deepcopy(teacher), target_modules=FFN_PATTERNS)
            else:
                student = students[name]
            sparsify = name in ("linearize", "defaults")
            row = f"{name} + loop" if sparsify else f"prune {name} + loop"
            rows[row] = user_loop(student, teacher, train, test, reference, args.steps, sparsify=sparsify)
            rows[row]["nn_agreement"] = neighbour_agreement(embed(student.eval(), test), reference)
            if sparsify:
                try:
                    folded[row] = linearize.fold(student.eval(), calib[0], latency=False)
                    rows[row]["ffn_flops_ratio"] = ffn_flops(folded[row]) / base
                except Exception as err:  # a student the Sparsifier left off 0/1 slopes does not fold
                    rows[row]["fold_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            print(row, rows[row], flush=True)
            save(result, args.out)
    return result


def save(result: dict, out: Path | None) -> None:
    """Write the results so far (a run stopped in the user loop keeps its one-shot rows and latencies)."""
    if out:
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
