"""The reproduction's plots: which runs each series holds."""

from __future__ import annotations

import sys
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
if str(RECIPES) not in sys.path:
    sys.path.insert(0, str(RECIPES))


def test_apl_plot_keeps_variant_runs_out_of_the_plain_late_series(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from reproduce import full as F
    from reproduce import measure as R

    axes = {}

    def plot(path, draw):
        fig, ax = plt.subplots()
        draw(ax)
        axes[Path(path).name] = (fig, ax)

    monkeypatch.setattr(R, "plot", plot)
    run = {"task": "c10", "schedule": "late", "target": 0.1, "apl": {"normalized": 3.0}}
    runs = {"r20_late_10_s0": {**run, "variant": None, "seed": 0, "test_accuracy": 0.90},
            "r20_late_10_kd_s0": {**run, "variant": "kd", "seed": 0, "test_accuracy": 0.80,
                                  "apl": {"normalized": 2.0}}}
    F._plots(tmp_path, {}, runs)
    fig, ax = axes["path_length_vs_accuracy.png"]
    try:
        late = [line for line in ax.get_lines() if line.get_label() == "10 classes, late"]
        assert len(late) == 1 and len(late[0].get_xdata()) == 1  # the kd run is not a plain late run
    finally:
        plt.close(fig)
