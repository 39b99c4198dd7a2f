"""Lossless compression of ReLU MLPs on sklearn digits (the shape of seed 004's table).

MLPs ``64 -> w -> w -> 10`` (w = 25, 50, 100) are trained with and without an L1 weight penalty;
each is compressed with ``linearize.compress`` over the whole input box ``[0, 1]^64`` (digits
scaled to [0, 1]), which removes stably inactive units and re-expresses or folds stably active
ones, verified on box samples and on the test set. Prints a Markdown table: test accuracy, the
fraction of hidden units removed (CROWN and IBP), and the compression time (mean +- std over seeds).

    python recipes/benchmarks/stable_units.py                 # about 2-3 minutes on 2 cores
    python recipes/benchmarks/stable_units.py --seeds 5 --widths 25 50 100
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm.auto import tqdm

import linearize

# L1 strengths per width: (strong, mild, none), as in the seed's table (wider nets need less).
DEFAULT_L1 = {25: (1e-3, 2e-4, 0.0), 50: (1e-3, 2e-4, 0.0), 100: (5e-4, 1e-4, 0.0)}


def data(seed: int = 0):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return xtr, xte, ytr, yte


def train(width: int, l1: float, seed: int, epochs: int, xtr, ytr) -> nn.Sequential:
    """Adam, batch 64, cross-entropy + ``l1 * sum |W|`` over the weight matrices."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    for _ in range(epochs):
        for idx in torch.randperm(len(xtr)).split(64):
            loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            if l1:
                loss = loss + l1 * sum(w.abs().sum() for w in weights)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def fmt(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    mean = statistics.mean(values) * scale
    std = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[25, 50, 100])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    xtr, xte, ytr, yte = data()
    box = linearize.Box(torch.zeros(64), torch.ones(64))
    rows = []
    jobs = [(w, l1, s) for w in args.widths for l1 in DEFAULT_L1.get(w, (1e-3, 2e-4, 0.0))
            for s in range(args.seeds)]
    results: dict[tuple[int, float], list[dict]] = {}
    for width, l1, seed in tqdm(jobs, desc="train + compress"):
        model = train(width, l1, seed, args.epochs, xtr, ytr)
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        start = time.perf_counter()
        small = linearize.compress(model, box, method="crown", data=xte)
        seconds = time.perf_counter() - start
        rep = small.compression_report
        ibp = linearize.stable_units(model, box, method="ibp").counts
        with torch.no_grad():
            acc_small = (small(xte).argmax(1) == yte).float().mean().item()
        assert acc_small == acc, "compressed model disagrees on the test set"
        counts = rep.stability.counts
        results.setdefault((width, l1), []).append({
            "acc": acc, "removed": rep.removed_fraction, "seconds": seconds,
            "inactive": counts["inactive"] / counts["total"], "active": counts["active"] / counts["total"],
            "ibp_stable": (ibp["inactive"] + ibp["active"]) / ibp["total"], "error": rep.max_error,
        })
    print(f"\nsklearn digits, 64-w-w-10 ReLU MLPs, {args.seeds} seeds, {args.epochs} epochs, "
          f"domain [0, 1]^64, bounds by CROWN (IBP stable fraction for comparison)\n")
    print("| width | L1 | test acc (%) | removed (%) | stably inactive (%) | stably active (%) "
          "| IBP stable (%) | compress time (s) | max abs error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (width, l1), rs in results.items():
        col = lambda k: [r[k] for r in rs]  # noqa: E731
        rows.append(
            f"| {width} | {l1:g} | {fmt(col('acc'), 100, 2)} | {fmt(col('removed'), 100)} | "
            f"{fmt(col('inactive'), 100)} | {fmt(col('active'), 100)} | {fmt(col('ibp_stable'), 100)} | "
            f"{fmt(col('seconds'), 1, 2)} | {max(col('error')):.1e} |"
        )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
