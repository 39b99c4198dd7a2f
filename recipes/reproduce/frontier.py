"""The frontier: test accuracy against nonlinear ReLUs per image, our runs beside the published curves.

Reads every committed CIFAR-10 run in ``recipes/results/<run>/`` (``metrics.json`` and ``model/``) of the
ResNet-20 and airbench94 studies (runs named ``r20_*`` and ``ab94_*``), counts each model's nonlinear
activation elements per 32x32 image with :func:`linearize.measures.count_relus` (an element of a channel
is nonlinear while the channel's slope is below 1, as the private-inference literature counts ReLUs), and
writes ``recipes/results/frontier/{frontier.md, frontier.json, frontier.png}``: the table, one plot
(log x) with the published points of SNL and AutoReP, each cited in :data:`PUBLISHED`, and per network the
core network: where the nonlinear elements of each linearized run sit, unit by unit.

Run: ``python recipes/reproduce/frontier.py`` (about 10 s per model on one CPU thread; no data needed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from torch import nn

RECIPES = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(RECIPES))
import cifar  # noqa: E402
import linearize  # noqa: E402

# <network>_<schedule>[_<target>][_<variant>]_s<seed>: target 10 = 10% of channels, r12900 = 12,900 ReLUs
RUN = re.compile(r"^(r20|ab94)_(base|late|early)(?:_(\d+|r\d+))?(?:_(\w+?))?_s(\d+)$")
# the variants on the frontier (others, e.g. distillation or class subsets, belong to other studies)
VARIANTS = {None: "", "elem": "element units", "fit": "affine ends", "fitid": "fit selection, identity ends",
            "elemfit": "element units, fit selection", "long": "longer fine-tune", "kd": "distillation",
            "longkd": "longer fine-tune, distillation", "elemfit_long": "element units, fit selection, longer fine-tune"}
# the face of each variant's markers in the plot (None: the network's color)
FILLS = {"": None, "element units": "gold", "affine ends": "none", "fit selection, identity ends": "palegreen",
         "element units, fit selection": "black", "longer fine-tune": "orange", "distillation": "pink",
         "longer fine-tune, distillation": "purple", "element units, fit selection, longer fine-tune": "gray"}
NETWORK = {"r20": "ResNet-20", "ab94": "airbench94"}
# Published CIFAR-10 points, (network, nonlinear ReLUs per image, test accuracy %, source). Only numbers
# stated in the sources; ResNet-18 in both papers (SNL: the standard CIFAR ResNet-18, 557K ReLUs;
# AutoReP-dev: a ResNet-18 variant with ResNet-20's 188,416 ReLUs, pixel-level masks).
PUBLISHED = [
    ("SNL ResNet-18", 49_400, 92.27, "Cho et al., Selective Network Linearization, ICML 2022, CIFAR-10 ResNet-18"),
    ("SNL ResNet-18", 12_900, 88.23, "Cho et al., Selective Network Linearization, ICML 2022, CIFAR-10 ResNet-18"),
    ("AutoReP-dev ResNet-18", 188_416, 93.84, "AutoReP development README (github.com/harveyp123/AutoReP)"),
    ("AutoReP-dev ResNet-18", 18_842, 89.40, "AutoReP development README (github.com/harveyp123/AutoReP), 10% of 188,416"),
    ("AutoReP-dev ResNet-18", 9_421, 88.29, "AutoReP development README (github.com/harveyp123/AutoReP), 5% of 188,416"),
]


def max_pool_comparisons(model: nn.Module, x: torch.Tensor) -> int:
    """Comparisons per image of the model's max-pools (``k * k - 1`` per output element): nonlinear
    operations that ReLU counts leave out (``max(a, b) = a + relu(b - a)``)."""
    total = [0]

    def count(module: nn.MaxPool2d, _inputs: tuple, out: torch.Tensor) -> None:
        k = module.kernel_size
        total[0] += out[0].numel() * ((k * k if isinstance(k, int) else k[0] * k[1]) - 1)

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return total[0]


def runs(results: Path) -> list[dict]:
    """One row per committed run of the two studies: accuracy, channel fraction, nonlinear ReLUs per image."""
    rows = []
    for folder in sorted(results.iterdir()):
        m = RUN.match(folder.name)
        if not m or not (folder / "metrics.json").is_file() or not (folder / "model").is_dir():
            continue
        net, kind, target, variant, seed = m.groups()
        if variant not in VARIANTS:
            continue
        metrics = json.loads((folder / "metrics.json").read_text())
        model = cifar.load_model(folder / "model")
        if kind == "base":  # a plain model: every activation element nonlinear
            model = linearize.convert(model, example_inputs=torch.zeros(1, 3, 32, 32))
        counts = linearize.measures.count_relus(model, torch.zeros(1, 3, 32, 32))
        fraction = metrics.get("nonlinear_fraction", 1.0)
        slopes = torch.cat([u.slope.detach().flatten() for _, u in linearize.units(model)])
        kept = slopes[slopes < 1]
        rows.append({"run": folder.name, "network": NETWORK[net], "kind": kind, "variant": VARIANTS[variant],
                     "seed": int(seed), "target": None if target is None or target[0] == "r" else int(target) / 100,
                     "target_relus": int(target[1:]) if target and target[0] == "r" else None,
                     "nonlinear_fraction": fraction,
                     "relus_total": counts["total"], "relus_nonlinear": counts["nonlinear"],
                     "max_pool_comparisons": max_pool_comparisons(model, torch.zeros(1, 3, 32, 32)),
                     "device": "GPU" if str(metrics.get("device", "cpu")).startswith("cuda") else "CPU",
                     "kept_slope": float(kept.mean()) if kept.numel() else None,
                     "sites": {n: [c["nonlinear"], c["total"]] for n, c in counts["sites"].items()},
                     "accuracy": 100 * metrics["test_accuracy"],
                     "accuracy_tta": None if metrics.get("test_accuracy_tta") is None else
                     100 * metrics["test_accuracy_tta"],
                     "average_path_length": metrics.get("average_path_length")})
    return rows


def table(rows: list[dict]) -> list[str]:
    md = ["| run | network | schedule | nonlinear units | mean slope of the nonlinear units | "
          "nonlinear ReLUs / image | max-pool comparisons / image | APL | test accuracy | with TTA | trained on |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tta = "" if r["accuracy_tta"] is None else f"{r['accuracy_tta']:.2f}%"
        slope = "" if r["kept_slope"] is None else f"{r['kept_slope']:.2f}"
        apl = "" if r["average_path_length"] is None else f"{r['average_path_length']:.2f}"
        kind = r["kind"] + (f", {r['variant']}" if r["variant"] else "")
        md.append(f"| [{r['run']}](../{r['run']}/metrics.json) | {r['network']} | {kind} | "
                  f"{100 * r['nonlinear_fraction']:.1f}% | {slope} | "
                  f"{r['relus_nonlinear']:,} of {r['relus_total']:,} | {r['max_pool_comparisons']:,} | {apl} | "
                  f"{r['accuracy']:.2f}% | {tta} | {r['device']} |")
    md += ["", "airbench94's max-pools are nonlinear too and are not in its ReLU counts: counted as ReLUs "
           "(`max(a, b) = a + relu(b - a)`), they add the column's comparisons to every airbench94 point, more than "
           "its 81,560 GELUs. ResNet-20 has none (average pool only), nor has the standard CIFAR ResNet-18 of SNL's "
           "points (557K ReLUs: a 32x32 stem without max-pool), so the ResNet-20 points sit on the published curves "
           "like for like and the airbench94 points only by their GELUs.",
           "", "Published points (CIFAR-10):", "", "| method | nonlinear ReLUs / image | test accuracy | source |",
           "|---|---|---|---|"]
    md += [f"| {name} | {relus:,} | {acc:.2f}% | {src} |" for name, relus, acc, src in PUBLISHED]
    return md


def core_network(rows: list[dict]) -> list[str]:
    """Per network, one table: every linearized run's nonlinear elements per image in each unit (in forward
    order), and their share of that unit's elements."""
    md = []
    for net in NETWORK.values():
        mine = [r for r in rows if r["network"] == net and r["kind"] != "base"]
        if not mine:
            continue
        sites = list(mine[0]["sites"])
        md += ["", f"Where the nonlinear elements of the {net} runs sit (per unit: nonlinear elements per image, and "
               "their share of the unit's elements):", "",
               "| run | " + " | ".join(f"`{s}`" for s in sites) + " |", "|---" * (len(sites) + 1) + "|"]
        for r in mine:
            cells = [f"{k:,} ({100 * k / n:.0f}%)" for k, n in (r["sites"].get(s, [0, 1]) for s in sites)]
            md.append(f"| {r['run']} | " + " | ".join(cells) + " |")
    return md


def fraction_plot(rows: list[dict], path: Path) -> None:
    """Per network: test accuracy against the nonlinear fraction of channels, late and early (seed mean,
    min-max over seeds), the baselines' band, and the channel-level variants as their own markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nets = [n for n in NETWORK.values() if any(r["network"] == n and r["kind"] != "base" for r in rows)]
    fig, axes = plt.subplots(1, len(nets), figsize=(6.2 * len(nets), 4.6), squeeze=False)
    variants = [v for v in VARIANTS.values() if v]  # one marker and color per variant, in both panels
    markers = dict(zip(variants, "DvP*XhpH<>"))
    colors = dict(zip(variants, ("tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                                 "tab:cyan", "tab:gray", "black")))
    for ax, net in zip(axes[0], nets):
        base = [r["accuracy"] for r in rows if r["network"] == net and r["kind"] == "base"]
        if base:
            ax.axhspan(min(base), max(base), color="lightgray", label=f"baseline, {len(base)} seed(s)")
        groups: dict[tuple[str, str], dict[float, list[float]]] = {}
        for r in rows:
            if r["network"] == net and r["kind"] != "base" and r["target"] is not None:
                groups.setdefault((r["kind"], r["variant"]), {}).setdefault(r["target"], []).append(r["accuracy"])
        for (kind, variant), points in sorted(groups.items(), key=lambda kv: (kv[0][1] != "", kv[0])):
            xs = sorted(points)
            mean = [sum(points[x]) / len(points[x]) for x in xs]
            err = [[m - min(points[x]) for m, x in zip(mean, xs)], [max(points[x]) - m for m, x in zip(mean, xs)]]
            style = dict(marker="o", linestyle="-", color="tab:blue") if (kind, variant) == ("late", "") else \
                dict(marker="s", linestyle="--", color="tab:orange") if (kind, variant) == ("early", "") else \
                dict(marker=markers[variant], color=colors[variant], linestyle="none")
            ax.errorbar(xs, mean, yerr=err, capsize=3, label=f"{kind}{', ' + variant if variant else ''} "
                        f"({max(len(v) for v in points.values())} seed(s): mean, min-max)", **style)
        ax.set_xscale("log")
        ax.set_xticks(sorted({r["target"] for r in rows if r["network"] == net and r["target"]}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{100 * v:g}%"))
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"{net}, CIFAR-10: late vs early linearization")
        ax.set_xlabel("nonlinear fraction of channels")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11.5, 5.2))
    styles = {("ResNet-20", "base"): ("s", "tab:blue"), ("ResNet-20", "late"): ("o", "tab:blue"),
              ("ResNet-20", "early"): ("^", "tab:blue"), ("airbench94", "base"): ("s", "tab:red"),
              ("airbench94", "late"): ("o", "tab:red"), ("airbench94", "early"): ("^", "tab:red")}
    for (net, kind), (marker, color) in styles.items():
        for variant, fill in ((v, FILLS[v] or color) for v in VARIANTS.values()):
            pts = [r for r in rows if r["network"] == net and r["kind"] == kind and r["variant"] == variant]
            if pts:
                ax.scatter([r["relus_nonlinear"] for r in pts], [r["accuracy"] for r in pts], marker=marker,
                           facecolors=fill, edgecolors=color, zorder=3,
                           label=f"ours: {net}, {kind} ({variant or 'channels'})")
    for name, marker in (("SNL ResNet-18", "D"), ("AutoReP-dev ResNet-18", "P")):
        pts = sorted((relus, acc) for n, relus, acc, _ in PUBLISHED if n == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color="gray", linestyle=":",
                label=f"{name} (published, elements)")
    ax.set_xscale("log")
    ax.set_xlabel("nonlinear ReLUs (activation elements) per image")
    ax.set_ylabel("CIFAR-10 test accuracy (%)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results-dir", type=Path, default=RECIPES / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = runs(args.results_dir)
    if not rows:
        sys.exit(f"no r20_* / ab94_* runs with metrics.json and model/ in {args.results_dir}")
    out = args.results_dir / "frontier"
    out.mkdir(exist_ok=True)
    (out / "frontier.json").write_text(json.dumps({"runs": rows, "published": PUBLISHED}, indent=1) + "\n")
    (out / "frontier.md").write_text("\n".join(["# Accuracy against nonlinear ReLUs per image", "",
                                                "![frontier](frontier.png)", "",
                                                "![accuracy against the nonlinear fraction of channels]"
                                                "(accuracy_vs_fraction.png)", "", *table(rows),
                                                *core_network(rows)]) + "\n")
    plot(rows, out / "frontier.png")
    fraction_plot(rows, out / "accuracy_vs_fraction.png")
    print(f"{len(rows)} runs -> {out}/frontier.md, frontier.json, frontier.png")


if __name__ == "__main__":
    main()
