"""``linearize demo``: the whole pipeline on scikit-learn's bundled digits (no download).

convert -> train -> sparsify late (to a target nonlinear fraction) -> freeze -> fold -> report.
An MLP ``64 -> 256 -> 256 -> 10`` with ReLUs is trained on 80% of the 1,797 8x8 digits, then
linearized *late*: the sparsity pressure starts on the trained network and steers the fraction of
nonlinear channels to ``target``. Takes well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import linearize
from linearize._optional import require


def digits_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """sklearn digits as float tensors in ``[0, 1]``: ``x_train [1437, 64]``, ``y_train``, ``x_test [360, 64]``, ``y_test``."""
    load_digits = require("sklearn.datasets", what="the demo's digits data").load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=seed, stratify=y)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy in percent."""
    model.eval()
    with torch.no_grad():
        return 100.0 * (model(x).argmax(1) == y).float().mean().item()


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int, desc: str,
          sparsifier: "linearize.Sparsifier | None" = None) -> None:
    """Adam, batch 64; with a sparsifier attached, its proximal step follows each optimizer step."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(linearize.param_groups(model, weight_decay=0.0) if sparsifier else model.parameters(),
                           lr=1e-3)
    if sparsifier is not None:
        sparsifier.attach(opt)
    model.train()
    for _ in tqdm(range(epochs), desc=desc, leave=False):
        for idx in torch.randperm(len(x), generator=gen).split(64):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    if sparsifier is not None:
        sparsifier.detach()


def steps_per_epoch(n: int, batch: int = 64) -> int:
    return -(-n // batch)


def run_demo(epochs: int = 30, target: float = 0.10, seed: int = 0, threads: int = 1) -> dict:
    """Run the pipeline, print each stage, return the measured numbers. Torch runs on ``threads`` threads
    meanwhile (the MLP's ops are too small to share: on a busy 2-core machine, 2 threads ran 13-30x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run_demo(epochs, target, seed)
    finally:
        torch.set_num_threads(before)


def _run_demo(epochs: int, target: float, seed: int) -> dict:
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    x_tr, y_tr, x_te, y_te = digits_data(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    print(f"digits: {len(x_tr)} train / {len(x_te)} test images of 8x8; MLP 64-256-256-10 with ReLU")

    train(model, x_tr, y_tr, epochs, seed, "baseline")
    base_acc = accuracy(model, x_te, y_te)
    print(f"1. baseline trained {epochs} epochs: test accuracy {base_acc:.2f}%")

    with torch.no_grad():
        before = model(x_te)
    linearize.convert(model, example_inputs=x_te[:2])
    with torch.no_grad():
        diff = (model(x_te) - before).abs().max().item()
    print(f"2. convert: {len(linearize.units(model))} sites, {linearize.count_units(model)['total']} channels, "
          f"max |difference| to the original {diff:.1e}")

    late_epochs = max(1, epochs // 2)
    total = late_epochs * steps_per_epoch(len(x_tr))
    sparsifier = linearize.Sparsifier(model, linearize.schedules.target(target, start=0, end=0.7),
                                      total_steps=total, lam=1e-2)
    train(model, x_tr, y_tr, late_epochs, seed + 1, "late linearization", sparsifier)
    lin_acc = accuracy(model, x_te, y_te)
    fraction = linearize.nonlinear_fraction(model)
    print(f"3. late linearization ({late_epochs} more epochs, target {target:.2f}): nonlinear fraction "
          f"{fraction:.3f}, test accuracy {lin_acc:.2f}%")

    summary = linearize.freeze(model, tol=1e-3)
    print(f"4. freeze: {summary.linear_after} of {summary.total} channels exactly linear and frozen")

    model.eval()
    folded = linearize.fold(model, x_te)
    fold = folded.linearize_fold_summary
    fold_acc = accuracy(folded, x_te, y_te)
    print(f"5. fold: params {fold.params_before} -> {fold.params_after}, FLOPs ratio {fold.flop_ratio:.3f}, "
          f"latency ratio {fold.latency_ratio:.3f}, max error {fold.max_abs_error:.1e}, test accuracy {fold_acc:.2f}%")

    rep = linearize.report(model, x_te, progress=False)
    print("6. report (nonlinear channels per site, average path length, affinity signature):")
    for name, site in rep.units["sites"].items():
        print(f"     {name:<4} {site['nonlinear']:>4} / {site['total']:<4} nonlinear")
    print(f"     average path length: normalized {rep.path_length['normalized']:.3f}, "
          f"unnormalized {rep.path_length['unnormalized']:.3f} (of 2 unit layers)")
    print("     affinity signature: " + ", ".join(f"{site} {score:.3f}" for site, score in rep.affinity))
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return {"baseline_accuracy": base_acc, "linearized_accuracy": lin_acc, "nonlinear_fraction": fraction,
            "folded_accuracy": fold_acc, "fold_max_error": fold.max_abs_error}
