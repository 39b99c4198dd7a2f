"""Benchmark the training cost of CIFAR models side by side: the median wall time of one training step
(forward, backward, SGD step; batch 128, 32x32, channels-last as the speed plan trains, one thread),
repetitions interleaved, and each model's time relative to the first one.

The speed study compares a linearized MobileNet-V2 x0.5 with the narrower x0.35 "trained for the same total
time": ``recipes/reproduce/speed.py`` gives x0.35 as many epochs as the x0.5 pipeline (baseline + late
run) divided by the ratio printed here, so both spend about the same CPU time on their steps::

    python recipes/benchmarks/train_step.py                          # x0.5 and x0.35, about a minute
    python recipes/benchmarks/train_step.py --arch resnet20 mobilenet_v2_x0_5 --epochs 21
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cifar import build_model  # noqa: E402

from linearize.timing import median_ms  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Time one training step of each ``--arch``; return ``{arch: {"ms": ..., "ratio": ..., "epochs": ...}}``
    (``epochs``: how many epochs of it take as long as ``--epochs`` epochs of the first arch)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=["mobilenet_v2_x0_5", "mobilenet_v2_x0_35"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--epochs", type=float, default=21.0, help="epochs of the first arch to match")
    parser.add_argument("--budget", type=float, default=40.0, help="seconds of timing in all")
    parser.add_argument("--contiguous", action="store_true", help="time contiguous inputs, not channels-last")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.budget <= 0 or args.epochs <= 0:
        parser.error("--batch, --budget and --epochs must be positive")
    layout = torch.contiguous_format if args.contiguous else torch.channels_last
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, 32, 32).to(memory_format=layout)
    y = torch.randint(0, 10, (args.batch,))

    def step_of(arch: str):
        model = build_model(arch, 10).to(memory_format=layout).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step() -> None:
            with torch.enable_grad():  # median_ms times under no_grad
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()

        return step

    ms = median_ms([step_of(a) for a in args.arch], budget_s=args.budget, threads=1)
    result = {a: {"ms": t, "ratio": t / ms[0], "epochs": args.epochs * ms[0] / t} for a, t in zip(args.arch, ms)}
    print(f"training step, batch {args.batch}, {'contiguous' if args.contiguous else 'channels-last'}, 1 thread "
          "(median of interleaved repetitions):")
    for arch, r in result.items():
        print(f"  {arch:22s} {r['ms']:9.1f} ms  {r['ratio']:.3f}x  {args.epochs:g} epochs of {args.arch[0]} "
              f"take as long as {r['epochs']:.1f} of it")
    return result


if __name__ == "__main__":
    main()
