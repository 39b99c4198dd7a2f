"""Benchmark the folds that pay (for the speed study, ``recipes/reproduce/speed.py``): CPU latency of a CIFAR
model with about half its blocks linear (or all its sites), before and after ``linearize.fold``, at batch 1 and
batch 64 on one thread.

The model is ``recipes/cifar.py``'s ``--arch`` (default MobileNet-V2 x0.5 with the CIFAR stem: stem conv
and the first stride-2 block at stride 1, 32x32 inputs end at 4x4), random weights and BatchNorm
statistics from random inputs (no training: latency does not depend on the weights). ``--linear
half``: every other residual block (the sites grouped by :func:`linearize.sparsifier.site_groups`,
blocks with two or more sites: MobileNet-V2 blocks 2, 4, ..., 16) gets all its units' channels linear
(slope 1), every other site its plain activation (slope 0); ``--linear all``: every site linear, the
lowest latency any cost target (``--target-latency``) can reach on this model. Three models are
timed in one run, repetitions interleaved (median ms):

* ``original``: the plain model (BatchNorm not folded), what a user starts from;
* ``bn-folded``: the same model folded with no linear site (BatchNorm folding only), the fair baseline
  and the reference of a latency target;
* ``merged``: the linearized model folded with ``merge_latency=True``: e.g. each linear inverted
  residual's expand 1x1 -> depthwise 3x3 -> project 1x1 becomes one 3x3 conv (skip in its centre
  tap) where FLOPs drop and the batch-1 probe measures it faster.

    python recipes/benchmarks/fold_merges.py                 # MobileNet-V2 x0.5, about a minute on one core
    python recipes/benchmarks/fold_merges.py --arch resnet20 --linear all
    python recipes/benchmarks/fold_merges.py --arch mobilenet_v2_x1_0 --budget 20
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

import linearize
from linearize.folding import count_flops
from linearize.sparsifier import site_groups
from linearize.timing import median_latency_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cifar import ARCHS, build_model  # noqa: E402  (the recipe's models: what recipes/cifar.py trains)


def calibrate(model: nn.Module, size: int = 32) -> nn.Module:
    """BatchNorm running statistics from two random batches (cumulative average), then eval mode."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = None
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(32, 3, size, size))
    return model.eval()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="mobilenet_v2_x0_5", choices=ARCHS, help="a recipes/cifar.py model")
    parser.add_argument("--linear", choices=("half", "all"), default="half",
                        help="every other residual block linear, or every site")
    parser.add_argument("--budget", type=float, default=6.0, help="seconds of timing per batch size")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)

    original = calibrate(build_model(args.arch, 10))
    x = torch.randn(8, 3, 32, 32)
    model = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize.convert(model, example_inputs=x)
    linear: list[str] = []  # the blocks made linear (--linear half)
    if args.linear == "all":
        on = {name for name, _ in linearize.units(model)}
    else:
        try:
            groups = site_groups(model)
        except ValueError:  # no residual block around any site
            parser.error(f"--arch {args.arch} has no residual blocks to linearize every other one: pass --linear all")
        linear = [name for name, sites in groups.items() if len(sites) > 1][::2]
        on = {site for name in linear for site in groups[name]}
    with torch.no_grad():
        for name, unit in linearize.units(model):
            unit.slope.fill_(1.0 if name in on else 0.0)
    plain = copy.deepcopy(model)
    with torch.no_grad():
        for _, unit in linearize.units(plain):
            unit.slope.fill_(0.0)
    bn_folded = linearize.fold(plain, x, latency=False)
    merged = linearize.fold(model, x, latency=False, merge_latency=True)
    summary = merged.linearize_fold_summary

    print(f"{args.arch}, 32x32 input, " + ("every site" if args.linear == "all" else f"blocks {', '.join(linear)}")
          + f" linear ({sum(r.kept for r in summary.merges)} of {len(summary.merges)} block merges kept)")
    print(f"max abs error of the fold {summary.max_abs_error:.2g} (output scale {summary.output_scale:.3g})")
    for r in summary.merges:
        print(f"  {r}")
    models = {"original": original, "bn-folded": bn_folded, "merged": merged}
    result: dict = {"flops": {k: count_flops(m, x[:1]) for k, m in models.items()}}
    f = result["flops"]
    print(f"\nFLOPs per image: original {f['original']:,}, bn-folded {f['bn-folded']:,}, merged {f['merged']:,} "
          f"(merged / bn-folded {f['merged'] / f['bn-folded']:.3f})")
    print(f"\n{'batch':>5} | {'original ms':>11} | {'bn-folded ms':>12} | {'merged ms':>9} | "
          f"{'merged / original':>17} | {'merged / bn-folded':>18}")
    for batch in (1, 64):
        inputs = torch.randn(batch, 3, 32, 32)
        t = dict(zip(models, median_latency_ms(list(models.values()), inputs, budget_s=args.budget, threads=1)))
        result[batch] = t
        print(f"{batch:>5} | {t['original']:>11.3f} | {t['bn-folded']:>12.3f} | {t['merged']:>9.3f} | "
              f"{t['merged'] / t['original']:>17.3f} | {t['merged'] / t['bn-folded']:>18.3f}")
    return result


if __name__ == "__main__":
    main()
