"""DNN vs DGN vs DLGN on real CIFAR-10 images (seed 003), with the same training budget.

    python recipes/benchmarks/gated.py --data /path/to/cifar10-jpeg.tar.gz      # or $LINEARIZE_CIFAR10

A small VGG-like network with batch norm (``--widths``, average pooling as in seed 003's fair
comparison: ``--pool max`` keeps max pooling, which the DLGN feature network then replaces by
average pooling) is trained three times from the same seed, data order and augmentation: as the
plain ReLU network (DNN), as its DGN (``beta=4``) and as its DLGN (``beta=10``; ``--dlgn-ones``
adds a DLGN whose value network sees a constant all-ones input), all with independent
initialization of the feature network. Same optimizer, schedule, batch size and number of
epochs for all (the gated models do about twice the work per step). Prints the test accuracies
side by side, the ratios to the DNN, and the DLGN gate statistics on the test images.

Seed 003 reports (VGG-16 / ResNet-110, full CIFAR-10, many epochs) DLGN recovering more than
83.5% of the DNN accuracy and DGN within about 1-3 points; this CPU-sized run (a subset, few
epochs) only checks the direction and rough size of these gaps.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cifar  # noqa: E402  (recipes/cifar.py: decoding, augmentation, normalization)

import linearize  # noqa: E402
from linearize.gated import gate_statistics  # noqa: E402

MEAN = torch.tensor([0.4914, 0.4822, 0.4465])
STD = torch.tensor([0.2470, 0.2435, 0.2616])


def vgg_like(widths: list[int], pool: str, num_classes: int = 10) -> nn.Sequential:
    """Conv-BN-ReLU pairs per stage, a 2x2 pooling after each stage, global average pool, linear head."""
    layers: list[nn.Module] = []
    cin = 3
    for stage in widths:
        for _ in range(2):
            layers += [nn.Conv2d(cin, stage, 3, padding=1, bias=False), nn.BatchNorm2d(stage), nn.ReLU(inplace=True)]
            cin = stage
        layers.append(nn.AvgPool2d(2) if pool == "avg" else nn.MaxPool2d(2))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def train_and_test(model: nn.Module, train: dict, test: dict, args: argparse.Namespace, label: str) -> float:
    """Train with SGD + Nesterov and a one-cycle LR, return the test accuracy in percent."""
    torch.manual_seed(args.seed)  # same data order and augmentation for every model
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": rest, "weight_decay": 0.0}],
                          lr=args.lr, momentum=0.9, nesterov=True)
    n = len(train["y"])
    steps_per_epoch = n // args.batch_size
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * steps_per_epoch)
    model.train()
    bar = tqdm(total=args.epochs * steps_per_epoch, desc=label, leave=False)
    for _ in range(args.epochs):
        order = torch.randperm(n)
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            x = cifar.normalize(cifar.augment(train["x"][idx]), MEAN, STD)
            loss = F.cross_entropy(model(x), train["y"][idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    return accuracy(model, test, args.batch_size)


@torch.no_grad()
def accuracy(model: nn.Module, data: dict, batch_size: int) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(data["y"]), batch_size):
        x = cifar.normalize(data["x"][i:i + batch_size], MEAN, STD)
        correct += int((model(x).argmax(1) == data["y"][i:i + batch_size]).sum())
    return 100.0 * correct / len(data["y"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.environ.get("LINEARIZE_CIFAR10"),
                   help="CIFAR-10 .tar.gz / image folder / torchvision folder (default $LINEARIZE_CIFAR10)")
    p.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "linearize-cifar-cache"),
                   help="where decoded uint8 tensors are cached (never inside the repository)")
    p.add_argument("--train-subset", type=int, default=5000)
    p.add_argument("--test-subset", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--pool", choices=["avg", "max"], default="avg")
    p.add_argument("--dlgn-ones", action="store_true", help="also train a DLGN with value_input='ones'")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.data is None:
        p.error("no data: pass --data or set LINEARIZE_CIFAR10 (e.g. .../cifar10-jpeg.tar.gz)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.time()
    cache = Path(args.cache_dir)
    train = cifar.load_split(args.data, "cifar10", "train", args.train_subset, 32, cache)
    test = cifar.load_split(args.data, "cifar10", "test", args.test_subset, 32, cache)
    print(f"data: {len(train['y'])} train / {len(test['y'])} test images of {args.data} "
          f"({time.time() - start:.0f} s to load)")

    example = torch.zeros(2, 3, 32, 32)
    variants = [("DNN", {}), ("DGN", {"mode": "dgn"}), ("DLGN", {"mode": "dlgn"})]
    if args.dlgn_ones:
        variants.append(("DLGN (value input ones)", {"mode": "dlgn", "value_input": "ones"}))
    results = []
    for label, overrides in variants:
        torch.manual_seed(args.seed)  # the same base weights for every variant
        model = vgg_like(args.widths, args.pool)
        if overrides:
            model = linearize.convert(model, example_inputs=example, **overrides)
        t0 = time.time()
        acc = train_and_test(model, train, test, args, label)
        stats = gate_statistics(model, cifar.normalize(test["x"][:500], MEAN, STD)) if overrides else None
        results.append((label, acc, time.time() - t0, stats))
        print(f"{label:<26} test accuracy {acc:5.1f}%  ({time.time() - t0:.0f} s)")

    dnn = results[0][1]
    print(f"\nVGG-like widths {args.widths}, {args.pool} pooling, {len(train['y'])} train / {len(test['y'])} "
          f"test images, {args.epochs} epochs, batch {args.batch_size}, SGD-Nesterov one-cycle lr {args.lr}, "
          f"seed {args.seed}")
    print("| model | test accuracy | / DNN | train time | gates on | gate entropy (bits) |")
    print("|---|---|---|---|---|---|")
    for label, acc, secs, stats in results:
        on = ent = "-"
        if stats:
            total = sum(s["channels"] for s in stats.values())
            on = f"{sum(s['fraction_on'] * s['channels'] for s in stats.values()) / total:.2f}"
            ent = f"{sum(s['entropy'] * s['channels'] for s in stats.values()) / total:.2f}"
        print(f"| {label} | {acc:.1f}% | {acc / dnn:.3f} | {secs:.0f} s | {on} | {ent} |")
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
