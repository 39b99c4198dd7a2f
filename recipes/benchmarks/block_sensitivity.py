"""What each residual block of a trained CIFAR model costs to make linear, and what folding it saves
(for the speed study, ``recipes/reproduce/speed.py``: why a latency budget costs the accuracy it does).

For every block (the sites grouped by :func:`linearize.sparsifier.site_groups`; the stem and the last
conv are groups of one site) of a model saved by ``recipes/cifar.py`` (``OUTPUT_DIR/model``):

* **acc / loss linear**: test accuracy and cross-entropy with that block alone made linear (every
  slope 1), no fine-tuning;
* **saliency**: the sum over the block's channels of the mean squared loss gradient of their slopes
  (slopes 0, eval mode, ``--batches`` shuffled training batches of 128): what ``--select saliency`` ranks
  by (training takes a running mean over its steps, in training mode);
* **MFLOPs / ms saved**: the model folded with that block alone linear against it folded with none
  (BatchNorm folding only), FLOPs per image and median CPU latency at batch 1 on one thread,
  repetitions interleaved in one run.

It ends with the Spearman rank correlations of the accuracy lost with the saliency and with the
channel count (the importance ``--select slope`` gives a block at slope 0).

    python recipes/benchmarks/block_sensitivity.py --model recipes/results/mnv2_x0_5_base_s0/model
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import linearize
from linearize.folding import count_flops
from linearize.sparsifier import site_groups
from linearize.timing import median_latency_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cifar  # noqa: E402  (the recipe's loader: what recipes/cifar.py saved)


def _images(data: str, split: str, n: int, meta: dict, cache: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` normalized images of ``split`` (a fixed subset) and their labels in the model's class order."""
    s = cifar.load_split(data, "cifar10", split, n, meta["image_size"], cache, show=False, classes=meta.get("classes"),
                         drop_others=True)
    return cifar.normalize(s["x"], torch.tensor(meta["mean"]), torch.tensor(meta["std"])), s["y"]


def _spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (ties get their mean rank)."""
    ra, rb = (np.argsort(np.argsort(v, kind="stable"), kind="stable").astype(float) for v in (a, b))
    for r, v in ((ra, np.asarray(a)), (rb, np.asarray(b))):
        for u in np.unique(v):
            r[v == u] = r[v == u].mean()
    return float(np.corrcoef(ra, rb)[0, 1])


def _set(units: dict, sites: list[str], value: float) -> None:
    with torch.no_grad():
        for s in sites:
            units[s].slope.fill_(value)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder saved by recipes/cifar.py (OUTPUT_DIR/model)")
    parser.add_argument("--data-dir", default=os.environ.get("LINEARIZE_CIFAR10"),
                        help="CIFAR-10 (as recipes/cifar.py takes it; default $LINEARIZE_CIFAR10)")
    parser.add_argument("--images", type=int, default=2000, help="test images for the accuracy")
    parser.add_argument("--batches", type=int, default=10, help="training batches of 128 for the saliency")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds of latency timing in all")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "linearize"))
    args = parser.parse_args(argv)
    if not args.data_dir:
        parser.error("no CIFAR data: pass --data-dir or set LINEARIZE_CIFAR10")
    if args.images < 1 or args.batches < 1 or not args.budget > 0:
        parser.error("--images and --batches must be >= 1 and --budget > 0")
    torch.manual_seed(0)
    torch.set_num_threads(1)

    meta = cifar.read_meta(args.model)
    if meta["linearize"] != "none":
        parser.error(f"{args.model} was trained with --linearize {meta['linearize']}: pass a plain model (a baseline)")
    x, y = _images(args.data_dir, "test", args.images, meta, Path(args.cache_dir))
    xt, yt = _images(args.data_dir, "train", 128 * args.batches, meta, Path(args.cache_dir))
    mix = torch.randperm(len(yt), generator=torch.Generator().manual_seed(0))  # the subset comes class by class
    xt, yt = xt[mix], yt[mix]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = linearize.convert(cifar.load_model(args.model), example_inputs=x[:2])
    units = dict(linearize.units(model))
    groups = site_groups(model)

    def accuracy() -> tuple[float, float]:
        """Test accuracy and mean cross-entropy."""
        with torch.no_grad():
            out = torch.cat([model(x[i:i + 500]) for i in range(0, len(x), 500)])
        return (out.argmax(1) == y).float().mean().item(), F.cross_entropy(out, y).item()

    squared = {s: torch.zeros_like(u.slope) for s, u in units.items()}
    batches = range(0, len(xt), 128)
    for i in batches:  # squared gradient of each batch's mean loss
        model.zero_grad()
        F.cross_entropy(model(xt[i:i + 128]), yt[i:i + 128]).backward()
        for s, u in units.items():
            squared[s] += u.slope.grad.detach() ** 2
    model.zero_grad(set_to_none=True)
    saliency = {b: sum(float(squared[s].sum()) for s in sites) / len(batches) for b, sites in groups.items()}

    base, base_loss = accuracy()
    one = x[:1]
    rows, folded = [], {"none": linearize.fold(copy.deepcopy(model), one, latency=False)}
    for b, sites in groups.items():
        _set(units, sites, 1.0)
        acc, loss = accuracy()
        folded[b] = linearize.fold(copy.deepcopy(model), one, latency=False, merge_latency=True)
        _set(units, sites, 0.0)
        rows.append({"block": b, "channels": sum(units[s].num_channels for s in sites), "accuracy_linear": acc,
                     "loss_linear": loss, "saliency": saliency[b]})
    flops = {k: count_flops(m, one) for k, m in folded.items()}
    ms = dict(zip(folded, median_latency_ms(list(folded.values()), one, budget_s=args.budget, threads=1)))
    for r in rows:
        r["mflops_saved"] = (flops["none"] - flops[r["block"]]) / 1e6
        r["ms_saved"] = ms["none"] - ms[r["block"]]

    print(f"{meta['arch']}, {len(x)} test images: accuracy {100 * base:.2f}% (loss {base_loss:.3f}); folded with no linear block "
          f"{flops['none'] / 1e6:.1f} MFLOPs, {ms['none']:.2f} ms at batch 1")
    print(f"{'block':>14} | {'channels':>8} | {'acc linear':>10} | {'loss linear':>11} | {'saliency':>9} | "
          f"{'MFLOPs saved':>12} | {'ms saved':>8}")
    for r in rows:
        print(f"{r['block']:>14} | {r['channels']:>8} | {100 * r['accuracy_linear']:>9.2f}% | {r['loss_linear']:>11.3f} | "
              f"{r['saliency']:>9.2e} | "
              f"{r['mflops_saved']:>12.2f} | {r['ms_saved']:>8.3f}")
    lost = [base - r["accuracy_linear"] for r in rows]
    corr = {"saliency": _spearman([r["saliency"] for r in rows], lost),
            "channels": _spearman([r["channels"] for r in rows], lost)}
    print(f"Spearman with the accuracy lost: saliency {corr['saliency']:+.2f}, channel count {corr['channels']:+.2f}")
    return {"accuracy": base, "loss": base_loss, "rows": rows, "flops_none": flops["none"], "ms_none": ms["none"], "spearman": corr}


if __name__ == "__main__":
    main()
