"""Early vs late sparsity pressure on scikit-learn digits (seed 000's gap, at toy scale).

Same model, seeds, optimizer and number of steps for every setting; only the schedule differs:

- ``none``: no pressure (reference accuracy);
- ``early``: ``target(fraction, start=0, end=0.4)``: linearize while the network learns;
- ``late``: ``target(fraction, start=0.5, end=0.8)``: train unconstrained for half the run, then
  linearize the (nearly) converged network.

Both constrained runs hold the target for the last 20% or more of training. Prints mean +- std
test accuracy over seeds and the late - early gap, writes the per-site histories (JSON) and a
plot of the nonlinear fraction over steps::

    python recipes/benchmarks/schedule.py --seeds 5 --fraction 0.05 --out /tmp/linearize-schedule
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

import linearize
from linearize import LinearizableActivation
from linearize import schedules as S


def build(arch: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if arch == "mlp":
        return nn.Sequential(
            nn.Linear(64, 64), LinearizableActivation("relu", 64, -1),
            nn.Linear(64, 64), LinearizableActivation("relu", 64, -1), nn.Linear(64, 10),
        )
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1), LinearizableActivation("relu", 16, 1),
        nn.Conv2d(16, 32, 3, padding=1, stride=2), LinearizableActivation("relu", 32, 1),
        nn.Flatten(), nn.Linear(512, 10),
    )


def run(arch: str, schedule, seed: int, data, epochs: int, batch: int = 64):
    """Train once; returns (test accuracy, Sparsifier or None)."""
    x, y, train, test = data
    model = build(arch, seed)
    opt = torch.optim.SGD(linearize.param_groups(model, weight_decay=5e-4), lr=0.05, momentum=0.9)
    steps = epochs * math.ceil(len(train) / batch)
    sparsifier = None
    if schedule is not None:
        sparsifier = linearize.Sparsifier(model, schedule, steps, lam=1e-2).attach(opt)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = train[torch.randperm(len(train), generator=gen)]
        for i in range(0, len(order), batch):
            b = order[i : i + batch]
            loss = nn.functional.cross_entropy(model(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
    return acc, sparsifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--fraction", type=float, default=0.05, help="target nonlinear fraction")
    parser.add_argument("--arch", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    parser.add_argument("--out", type=Path, default=Path("/tmp/linearize-schedule"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    data = (x, y, perm[:1300], perm[1300:])
    settings = {
        "none": lambda: None,
        "early": lambda: S.target(args.fraction, start=0, end=0.4),
        "late": lambda: S.target(args.fraction, start=0.5, end=0.8),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    acc = {(a, s): [] for a in args.arch for s in settings}
    jobs = [(a, seed, s) for a in args.arch for seed in range(args.seeds) for s in settings]  # interleaved
    for arch, seed, name in tqdm(jobs, desc="runs"):
        value, sparsifier = run(arch, settings[name](), seed, data, args.epochs)
        acc[(arch, name)].append(value)
        if sparsifier is not None:
            sparsifier.save_history(args.out / f"{arch}-{name}-seed{seed}.json")
    print(f"digits, {args.epochs} epochs, target nonlinear fraction {args.fraction}, {args.seeds} seeds")
    print("arch  schedule  test accuracy (mean +- std)")
    for (arch, name), values in acc.items():
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"{arch:5} {name:8}  {100 * statistics.mean(values):.2f} +- {100 * std:.2f}")
    for arch in args.arch:
        gaps = [late - early for early, late in zip(acc[(arch, "early")], acc[(arch, "late")])]
        std = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        print(f"{arch}: late - early = {100 * statistics.mean(gaps):+.2f} +- {100 * std:.2f} points (paired by seed)")
    plot(args.out, args.arch)
    (args.out / "accuracy.json").write_text(json.dumps({f"{a}-{s}": v for (a, s), v in acc.items()}))


def plot(out: Path, archs: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(archs), figsize=(5 * len(archs), 3.5), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        for name, color in (("early", "tab:blue"), ("late", "tab:orange")):
            h = json.loads((out / f"{arch}-{name}-seed0.json").read_text())["history"]
            ax.plot([r["step"] for r in h], [r["nonlinear_fraction"] for r in h], color=color, label=name)
        ax.set(title=f"{arch} (seed 0)", xlabel="optimizer step", ylabel="nonlinear fraction")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fraction.png", dpi=120)
    print(f"histories and plot in {out}")


if __name__ == "__main__":
    main()
