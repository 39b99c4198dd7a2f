"""The ``cpu-small`` sweep of ``python recipes/reproduce`` (the default ``--scale``): a reduced run of
the seed-paper reproductions (one seed, 5,000 CIFAR-10 training images, 5 epochs; Multi30k translation),
its run list and its analysis (tables and plots in ``recipes/results/*.md|json|png``)."""

from __future__ import annotations

import json
from pathlib import Path

from .measure import (RECIPES, cached, cifar_inputs, fold_summary, interleaved_latency, path_lengths, plot, run_model,
                      site_counts)
from .sweep import Job, read_json

TARGETS = (0.5, 0.25, 0.10, 0.05, 0.02)
MT_TARGETS = (0.10, 0.25, 0.05)

SCALES = {
    # train images, test images, epochs; Multi30k train pairs, eval pairs, epochs, tokens per batch
    # (Multi30k: all 29k pairs, 6 epochs = 702 steps, ~28 min per run on one CPU thread; shorter runs
    # do not converge far enough to say anything about linearization)
    "cpu-small": dict(subset=5000, eval_subset=2000, epochs=5, mt_train=None, mt_eval=None, mt_epochs=6,
                      mt_tokens=4000, mt_warmup=250, mt_beams=4),
}


def cifar_jobs(s: dict, data: str, runs: Path) -> list[Job]:
    """Every CIFAR run of the cpu-small sweep, most important first."""
    base = [str(RECIPES / "cifar.py"), "--data-dir", data, "--arch", "resnet20", "--epochs", str(s["epochs"]),
            "--cpu", "--seed", "0"]
    if s["subset"]:
        base += ["--subset", str(s["subset"])]
    if s["eval_subset"]:
        base += ["--eval-subset", str(s["eval_subset"])]
    jobs = [("cifar_baseline", base + ["--linearize", "none"])]
    order = [0.10, 0.02, 0.5] + [t for t in TARGETS if t not in (0.10, 0.02, 0.5)]
    for i, t in enumerate(order):
        for sched in ("late", "early"):
            jobs.append((f"cifar_{sched}_{t:g}", base + ["--linearize", "prelu", "--schedule", sched,
                                                         "--target", f"{t:g}", "--freeze"]))
        if i == 2:  # the gated networks after the three most telling targets
            jobs += [(f"cifar_{m}", base + ["--linearize", m, "--schedule", "none"]) for m in ("dgn", "dlgn")]
    return [Job(n, a + ["--output_dir", str(runs / n)]) for n, a in jobs]


def mt_jobs(s: dict, data: str, runs: Path) -> list[Job]:
    """Every Multi30k run of the cpu-small sweep."""
    d = Path(data)
    base = [str(RECIPES / "wmt14.py"), "--train-file", str(d / "train.jsonl.gz"),
            "--validation-file", str(d / "validation.jsonl.gz"), "--test-file", str(d / "test.jsonl.gz"),
            "--source-lang", "en", "--target-lang", "de", "--model-size", "small", "--epochs", str(s["mt_epochs"]),
            "--max-tokens", str(s["mt_tokens"]), "--warmup-steps", str(s["mt_warmup"]),
            "--num-beams", str(s["mt_beams"]), "--cpu", "--seed", "0"]
    if s["mt_train"]:
        base += ["--max-train-samples", str(s["mt_train"])]
    if s["mt_eval"]:
        base += ["--max-eval-samples", str(s["mt_eval"])]
    jobs = [("mt_baseline", base + ["--linearize", "none"])]
    # --select slope --lam 0.001: the recorded runs (recipes/results/results.md) predate --rate and wmt14.py's
    # --select saliency default: they pushed the slopes by lr * 0.001, highest slope first
    jobs += [(f"mt_late_{t:g}", base + ["--linearize", "prelu", "--schedule", "late", "--target", f"{t:g}",
                                        "--select", "slope", "--lam", "0.001", "--freeze", "--fold"])
             for t in MT_TARGETS]
    return [Job(n, a + ["--output_dir", str(runs / n)]) for n, a in jobs]


# ----------------------------------------------------------------------------- analysis


def _latencies(runs: Path, names: list[str], x, reps: int = 15) -> dict:
    """Latency (ms) of the saved model of every run in ``names`` and of its folded version, on ``x``."""
    import linearize

    models = {}
    for n in names:
        models[n] = run_model(runs / n)
        models[n + "/folded"] = linearize.fold(models[n], x, latency=False)
    return {k: v["x"] for k, v in interleaved_latency(models, {"x": x}, reps).items()}


def _baseline_path_length(run: Path, x) -> float:
    """Average path length (normalized) of the plain baseline: every activation nonlinear."""
    return float(path_lengths(run_model(run), x)["normalized"])


def _sites(run: Path) -> dict:
    return {n: s["nonlinear"] / s["total"] for n, s in site_counts(run).items()}


def _affinity(run: Path, x) -> list:
    import linearize

    return [[n, float(v)] for n, v in linearize.measures.affinity_signature(run_model(run), x, progress=False)]


def _regions(run: Path, x, radius: float, segments: int | None, pieces: int, n_anchors: int = 8) -> dict:
    """Linear regions and exact absolute deviation along the closed translation loops of ``x``
    (``n_anchors`` shifts on a circle of ``radius`` pixels), on the first ``segments`` segments,
    each walked as ``pieces`` sub-segments in parallel (same result, faster)."""
    import linearize

    m = linearize.measures
    x0, x1 = m.translation_loops(x.double(), n_anchors=n_anchors, radius=radius)
    x0, x1 = x0[:segments], x1[:segments]
    res = m.linear_regions(run_model(run), x0, x1, pieces=pieces, batch_size=max(256, pieces * x0.shape[0]))
    dev = res.deviation().mean(1)  # [S]: integral over arc length, mean over the logits
    length = (x1 - x0).flatten(1).norm(dim=1)
    return {"segment_regions": res.count.tolist(), "segment_length": length.tolist(), "segment_deviation": dev.tolist()}


def _num(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def analyze(runs: Path, out: Path, scale: str, data: str | None, regions_images: int, regions_radius: float,
            regions_runs: list[str], machine: str, regions_pieces: int = 32, remeasure_latency: bool = False) -> dict:
    """Tables (``results.json``, ``results.md``) and PNG plots from the finished runs in ``runs``.

    Parts whose runs are missing here keep their entry of the previous ``results.json`` (e.g.
    the translation runs on a machine that only has the CIFAR runs), and the interleaved
    latencies of the previous ``results.json`` are reused for the same set of models unless
    ``remeasure_latency`` (they are only comparable when measured on an otherwise idle machine).
    """
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    previous = read_json(out / "results.json")
    jobs = read_json(runs / "jobs.json")
    runs_info = {}
    for d in sorted(p for p in runs.iterdir() if (p / "metrics.json").exists()):
        m = read_json(d / "metrics.json", damaged_ok=True)
        root = str(RECIPES.parent) + "/"
        runs_info[d.name] = {k: v for k, v in m.items() if not isinstance(v, dict) and k != "command"}
        runs_info[d.name]["command"] = jobs.get(d.name, {}).get("command", m.get("command", "")).replace(root, "")
        runs_info[d.name]["runner_wall_s"] = jobs.get(d.name, {}).get("wall_s")
        if "fold" in m:
            runs_info[d.name]["recipe_fold"] = m["fold"]
    res: dict = {"scale": scale, "machine": machine, "runs": runs_info}
    md = [f"# Reproduction results ({scale})", "", f"Machine: {machine}. Every run: one seed (0).", ""]
    acc = lambda n: runs_info.get(n, {}).get("test_accuracy")  # noqa: E731
    base = runs / "cifar_baseline"
    have = lambda n: n in runs_info and (runs / n / "model").exists()  # noqa: E731

    # 1-2. late vs early, path length
    if runs_info:
        first = next(iter(runs_info.values()))
        md += [f"CIFAR-10 runs: ResNet-20 (width 16), {first.get('train_images')} training images, "
               f"{first.get('test_images')} test images, {first.get('total_steps')} steps of batch 128.", ""]
    if have("cifar_baseline"):
        x64 = cifar_inputs(base, data, 64)[0]
        runs_info["cifar_baseline"]["average_path_length"] = cached(base, "apl", lambda: _baseline_path_length(base, x64))
    rows = []
    for t in TARGETS:
        r = {"target": t}
        for s in ("late", "early"):
            info = runs_info.get(f"cifar_{s}_{t:g}", {})
            r[s] = {k: info.get(k) for k in ("test_accuracy", "nonlinear_fraction", "average_path_length",
                                               "wall_time_s")}
        if r["late"]["test_accuracy"] is not None and r["early"]["test_accuracy"] is not None:
            r["late_minus_early"] = r["late"]["test_accuracy"] - r["early"]["test_accuracy"]
        rows.append(r)
    res["late_vs_early"] = {"baseline_accuracy": acc("cifar_baseline"), "rows": rows}
    md += ["## Late vs early linearization (seed 000)", "",
           f"Baseline (no linearization): test accuracy {_pct(acc('cifar_baseline'))}, average path length "
           f"{runs_info.get('cifar_baseline', {}).get('average_path_length', '-')}.", "",
           "| target | late acc | late nonlinear | late APL | early acc | early nonlinear | early APL | late - early |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        la, ea = r["late"], r["early"]
        gap = r.get("late_minus_early")
        md.append(f"| {r['target']:g} | {_pct(la['test_accuracy'])} | {_pct(la['nonlinear_fraction'])} | "
                  f"{_num(la['average_path_length'])} | {_pct(ea['test_accuracy'])} | {_pct(ea['nonlinear_fraction'])} | "
                  f"{_num(ea['average_path_length'])} | {'-' if gap is None else f'{100 * gap:+.1f} pts'} |")
    md += ["", "![accuracy vs nonlinear fraction](accuracy_vs_fraction.png) ![path length](path_length_vs_accuracy.png)", ""]

    def draw_acc(ax):
        for s, mk in (("late", "o-"), ("early", "s--")):
            pts = sorted((r[s]["nonlinear_fraction"], r[s]["test_accuracy"]) for r in rows
                         if r[s]["test_accuracy"] is not None)
            if pts:
                ax.plot(*zip(*pts), mk, label=s)
        if acc("cifar_baseline") is not None:
            ax.axhline(acc("cifar_baseline"), color="k", lw=1, label="baseline (no linearization)")
        ax.set_xscale("log")
        ax.set_xticks([*TARGETS, 1.0], [f"{t:g}" for t in (*TARGETS, 1.0)])
        ax.minorticks_off()
        ax.margins(y=0.1)
        ax.set_xlabel("nonlinear fraction of channels (final; 1 = baseline)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"ResNet-20, CIFAR-10 ({scale})")
        ax.legend()

    plot(out / "accuracy_vs_fraction.png", draw_acc)

    def draw_apl(ax):
        for s, mk in (("late", "o"), ("early", "s")):
            pts = [(r[s]["average_path_length"], r[s]["test_accuracy"]) for r in rows
                   if r[s]["test_accuracy"] is not None and r[s]["average_path_length"] is not None]
            if pts:
                ax.plot(*zip(*pts), mk, label=s)
        b = runs_info.get("cifar_baseline", {})
        if b.get("average_path_length") is not None:
            ax.plot([b["average_path_length"]], [b["test_accuracy"]], "k*", ms=12, label="baseline")
        ax.set_xlabel("average path length (nonlinear units met from input to output)")
        ax.set_ylabel("test accuracy")
        ax.legend()

    plot(out / "path_length_vs_accuracy.png", draw_apl)

    # 2b. where the nonlinear units sit
    site_runs = [n for n in ("cifar_late_0.1", "cifar_early_0.1", "cifar_late_0.02", "cifar_early_0.02") if have(n)]
    res["sites"] = {n: cached(runs / n, "sites", lambda n=n: _sites(runs / n)) for n in site_runs}
    if site_runs:
        def draw_sites(ax):
            names = list(res["sites"][site_runs[0]])
            w = 0.8 / len(site_runs)
            for i, n in enumerate(site_runs):
                ax.bar(np.arange(len(names)) + i * w, [res["sites"][n].get(k, 0) for k in names], w, label=n[6:])
            ax.set_xticks(np.arange(len(names)) + 0.4 - w / 2, [k.replace(".calls.", "#") for k in names],
                          rotation=90, fontsize=6)
            ax.set_ylabel("nonlinear fraction at the site")
            ax.legend(fontsize=7)

        plot(out / "nonlinear_sites.png", draw_sites)
        md += ["## Where the nonlinear channels survive", "", "![sites](nonlinear_sites.png)", "",
               "| site | " + " | ".join(n[6:] for n in site_runs) + " |", "|---|" + "---|" * len(site_runs)]
        for k in res["sites"][site_runs[0]]:
            md.append(f"| {k} | " + " | ".join(_pct(res["sites"][n].get(k)) for n in site_runs) + " |")
        md.append("")

    # 3. freeze + fold
    fold_runs = [n for n in ["cifar_baseline"] + [f"cifar_{s}_{t:g}" for t in TARGETS for s in ("late", "early")]
                 if have(n)]
    if fold_runs:
        x64 = cifar_inputs(runs / fold_runs[0], data, 64)[0]
        res["fold"] = {n: cached(runs / n, "fold_v2", lambda n=n: fold_summary(runs / n, x64)) for n in fold_runs}
        md += ["## After freeze + fold (`linearize.freeze`, `linearize.fold`)", "",
               "FLOPs and CPU latency for a batch of 64 test images (latency: before -> after folding, median of 15 "
               "repetitions of all models interleaved in one process, 1 thread, on the shared machine; "
               "'vs baseline' compares with the plain baseline model). Error: max |folded - model| over the logits.", "",
               "| run | test acc | sites folded to identity | params | FLOPs (batch 64) | FLOPs vs baseline | latency ms | latency vs baseline | max abs error | conv merges refused |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        lat_ms = previous.get("latency_ms_interleaved", {})
        if remeasure_latency or set(lat_ms) != {k for n in fold_runs for k in (n, n + "/folded")}:
            lat_ms = _latencies(runs, fold_runs, x64)
        res["latency_ms_interleaved"] = lat_ms
        fb = res["fold"].get("cifar_baseline")
        for n, f in res["fold"].items():
            rel = f"{f['flops_after'] / fb['flops_after']:.3f}x" if fb else "-"
            f = {**f, "latency_ms_before": lat_ms[n], "latency_ms_after": lat_ms[n + "/folded"]}
            lat = (f"{f['latency_ms_after'] / lat_ms['cifar_baseline']:.2f}x" if fb else "-")
            md.append(f"| {n[6:]} | {_pct(acc(n))} | "
                      f"{f['sites_to_identity']} of {f['sites_total']} | "
                      f"{f['params_before']:,} -> {f['params_after']:,} | "
                      f"{f['flops_before'] / 1e6:.0f}M -> {f['flops_after'] / 1e6:.0f}M | {rel} | "
                      f"{f['latency_ms_before']:.1f} -> {f['latency_ms_after']:.1f} | {lat} | "
                      f"{f['max_abs_error']:.2g} (scale {f['output_scale']:.2g}) | {len(f['skipped'])} |")
        reasons = sorted({r.split(": ", 1)[-1] for f in res["fold"].values() for r in f["skipped"]})
        md += ["", "Why conv merges were refused: " + ("; ".join(f"`{r}`" for r in reasons) or "none") + "."]
        md.append("")

    # 5. DNN vs DGN vs DLGN
    gated = [n for n in ("cifar_baseline", "cifar_dgn", "cifar_dlgn") if n in runs_info]
    if len(gated) > 1:
        res["gated"] = {n: {"test_accuracy": acc(n), "wall_time_s": runs_info[n].get("wall_time_s")} for n in gated}
        md += ["## DNN vs DGN vs DLGN (seed 003)", "", "| network | test acc | wall time |", "|---|---|---|"]
        md += [f"| {n[6:].replace('baseline', 'DNN (ReLU)').upper() if n != 'cifar_baseline' else 'DNN (ReLU)'} | "
               f"{_pct(acc(n))} | {runs_info[n].get('wall_time_s', 0):.0f} s |" for n in gated]
        md.append("")

    # 6. translation
    mt = [n for n in ["mt_baseline"] + [f"mt_late_{t:g}" for t in MT_TARGETS] if n in runs_info]
    if mt:
        res["translation"] = {n: {k: runs_info[n].get(k) for k in ("bleu", "bleu_signature", "nonlinear_fraction",
                                                                    "train_pairs", "eval_pairs", "total_steps",
                                                                    "wall_time_s")} | {"fold": runs_info[n].get("recipe_fold")}
                              for n in mt}
    elif previous.get("translation"):
        res["translation"] = previous["translation"]
        for n, v in previous.get("runs", {}).items():
            if n.startswith("mt_"):
                runs_info.setdefault(n, v)
    if res.get("translation"):
        sig = next((v["bleu_signature"] for v in res["translation"].values() if v.get("bleu_signature")), "")
        md += ["## Translation: Multi30k En->De (small Transformer)", "", f"sacreBLEU signature: `{sig}`", "",
               "| run | BLEU | nonlinear FFN channels | params after fold | steps | wall time |", "|---|---|---|---|---|---|"]
        for n, v in res["translation"].items():
            f = v.get("fold") or {}
            md.append(f"| {n[3:]} | {v['bleu']} | {_pct(v['nonlinear_fraction'])} | "
                      f"{f.get('params_after', '-'):,} of {f.get('params_before', 0):,} | {v['total_steps']} | "
                      f"{v['wall_time_s']:.0f} s |" if f else
                      f"| {n[3:]} | {v['bleu']} | {_pct(v['nonlinear_fraction'])} | - | {v['total_steps']} | "
                      f"{v['wall_time_s']:.0f} s |")
        md.append("")

    # 4. affinity signature, linear regions along translation loops
    aff_runs = [n for n in ["cifar_baseline"] + [f"cifar_late_{t:g}" for t in TARGETS] if have(n)]
    if aff_runs:
        x512 = cifar_inputs(runs / aff_runs[0], data, 512)[0]
        res["affinity"] = {n: cached(runs / n, "affinity", lambda n=n: _affinity(runs / n, x512)) for n in aff_runs}

        def draw_aff(ax):
            for n in aff_runs:
                ax.plot([v for _, v in res["affinity"][n]], "o-", ms=3, label=n[6:])
            ax.set_xlabel("activation call site (forward order)")
            ax.set_ylabel("affinity score (1 = affine)")
            ax.legend(fontsize=7)

        plot(out / "affinity_signature.png", draw_aff)
        md += ["## Affinity signature (seed 002), 512 test images", "", "![affinity](affinity_signature.png)", "",
               "| run | mean affinity | min affinity |", "|---|---|---|"]
        md += [f"| {n[6:]} | {np.mean([v for _, v in res['affinity'][n]]):.3f} | "
               f"{min(v for _, v in res['affinity'][n]):.3f} |" for n in aff_runs]
        md.append("")
    reg = [(n.split(":")[0], int(n.split(":")[1]) if ":" in n else None) for n in regions_runs]
    reg = [(n, k) for n, k in reg if have(n)]
    if reg and regions_images > 0:
        xr = cifar_inputs(runs / reg[0][0], data, regions_images)[0]
        res["regions"] = {n: cached(runs / n, f"regions_{regions_images}_r{regions_radius:g}" + (f"_s{k}" if k else ""),
                                     lambda n=n, k=k: _regions(runs / n, xr, regions_radius, k, regions_pieces))
                          for n, k in reg}

        def draw_reg(ax):
            for n, _ in reg:
                r = res["regions"][n]
                length = np.array(r["segment_length"])
                ax.plot(np.array(r["segment_regions"]) / length, np.array(r["segment_deviation"]) / length, "o", ms=5,
                        label=n[6:])
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("linear regions per unit input distance")
            ax.set_ylabel("absolute deviation from the chord per unit distance")
            ax.set_title("one point per segment of a closed translation loop", fontsize=9)
            ax.legend(fontsize=7)

        plot(out / "regions_vs_deviation.png", draw_reg)
        md += ["## Linear regions and absolute deviation along closed translation loops (seed 001)", "",
               f"{regions_images} test image(s), loop of 8 translations on a circle of radius {regions_radius:g} px, "
               "exact regions (`linearize.measures.linear_regions`) and exact absolute deviation from the chord "
               "(mean over the 10 logits; distances in normalized-input L2 units).", "",
               "![regions](regions_vs_deviation.png)", "",
               "| run | nonlinear | segments | regions per segment | regions per unit distance | deviation per unit distance |",
               "|---|---|---|---|---|---|"]
        for n, _ in reg:
            r = res["regions"][n]
            length = np.array(r["segment_length"])
            md.append(f"| {n[6:]} | {_pct(runs_info[n].get('nonlinear_fraction', 1.0))} | {len(length)} | "
                      f"{np.mean(r['segment_regions']):.0f} | {np.sum(r['segment_regions']) / length.sum():.2f} | "
                      f"{np.sum(r['segment_deviation']) / length.sum():.3g} |")
        md.append("")

    md += ["## Runs", "", "| run | test acc / BLEU | steps | wall time | command |", "|---|---|---|---|---|"]
    for n, v in runs_info.items():
        score = _pct(v.get("test_accuracy")) if "test_accuracy" in v else f"BLEU {v.get('bleu')}"
        md.append(f"| {n} | {score} | {v.get('total_steps')} | {v.get('wall_time_s', 0):.0f} s | `{v['command']}` |")
    (out / "results.json").write_text(json.dumps(res, indent=2))
    (out / "results.md").write_text("\n".join(md) + "\n")
    return res
