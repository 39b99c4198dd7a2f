"""``recipes/wmt14.py --one-shot affine|hybrid|constant|identity``: the plain model (slopes frozen at 0) trained up
to ``--late-start``, its FFN channels linearized there by ``linearize.one_shot`` to the FFN cost ``--prune`` keeps
for ``--target``, then trained on without sparsity pressure.

Tiny synthetic data built in tmp_path (``test_resume.tiny_late_start_args``). Checked against independent truths: the
folded FFN cost against the budget written out for the tiny preset; the folded model (and the saved unfolded one)
against the plain Marian model run on the same weights with each FFN's activation written out (``relu`` where the
slope is 0, ``alpha * x + beta`` where it is 1); a run killed after the one-shot step (SIGKILL) and one stopped at
it, each resumed, against uninterrupted runs, bit for bit.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import linearize

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import wmt14  # noqa: E402
from test_resume import (EPOCHS, assert_resumed_as_uninterrupted, assert_same_tree, env, kernel,  # noqa: E402,F401
                         kill_and_resume, tiny_late_start_args)

pytestmark = pytest.mark.usefixtures("one_thread")

D, FFN, FFNS = 64, 128, 2  # the tiny preset: one encoder and one decoder layer
TARGET = 0.25  # 32 of 128 channels nonlinear per FFN; folded: 2 d^2 + 2 d round(0.25 * 256) = 16,384 MACs per token
UNITS = ("model.encoder.layers.0.activation_fn", "model.decoder.layers.0.activation_fn")


@pytest.fixture(scope="module")
def one_shot_args(tmp_path_factory) -> list[str]:
    return tiny_late_start_args(tmp_path_factory.mktemp("mt-data"), TARGET)


@pytest.fixture(scope="module")
def affine_runs(one_shot_args, env, tmp_path_factory):
    """Uninterrupted; killed once a checkpoint of epoch 2 exists (after the one-shot at the end of epoch 0), resumed."""
    return kill_and_resume("wmt14.py", wmt14.main, one_shot_args + ["--one-shot", "affine", "--fold"],
                           tmp_path_factory.mktemp("one-shot-runs"), env)


def one_shot_step(run: Path) -> int:
    return json.loads((run / "metrics.json").read_text())["one_shot"]["step"]


def unit_tensors(ckpt: common.Checkpoint, unit: str) -> dict[str, torch.Tensor]:
    return {k.rsplit(".", 1)[1]: v for k, v in ckpt.model.items() if k.startswith(unit + ".")}


class WrittenOut(nn.Module):
    """A one-shot FFN activation written out: ``relu(x)`` where the slope is 0, ``alpha * x + beta`` where it is 1."""

    def __init__(self, slope: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> None:
        super().__init__()
        assert set(slope.unique().tolist()) == {0.0, 1.0}
        self.linear, self.alpha, self.beta = slope == 1, alpha, beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.linear, self.alpha * x + self.beta, torch.relu(x))


def unconverted(model_dir: Path) -> nn.Module:
    """The plain ``MarianMTModel`` with the saved weights and each FFN's activation :class:`WrittenOut`."""
    weights = load_file(str(model_dir / "model.safetensors"))
    model = wmt14.build_model("tiny", weights["model.shared.weight"].shape[0])
    for unit in UNITS:
        ends = {k: weights.pop(f"{unit}.{k}") for k in ("slope", "frozen", "alpha", "beta")}
        model.get_submodule(unit.rsplit(".", 1)[0]).activation_fn = WrittenOut(ends["slope"], ends["alpha"],
                                                                               ends["beta"])
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {  # tied to model.shared; sinusoidal, built from the config
        "lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
        "model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"}
    return model.eval()


def test_affine_one_shot_folds_to_the_prune_budget(affine_runs):
    m = json.loads((affine_runs.full / "metrics.json").read_text())
    budget = FFNS * D * D + 2 * D * round(TARGET * FFNS * FFN)  # each FFN: its nonlinear channels + a d x d
    assert wmt14.prune_budget("tiny", TARGET)[1] == budget == 16_384
    assert m["steps"] == m["total_steps"] and 0.0 <= m["bleu"] <= 100.0
    shot = m["one_shot"]
    assert shot["end"] == "affine" and shot["ffn_macs_budget"] == budget
    assert shot["nonlinear_channels"] == {u: 32 for u in UNITS}
    assert shot["calibration_pairs"] == 96 and shot["calibration_batches"] == m["total_steps"] // EPOCHS
    assert shot["refit"] == {u: u.replace("activation_fn", "fc2") for u in UNITS}
    macs = m["fold"]["ffn_macs_per_token"]
    assert macs["before"] == FFNS * 2 * D * FFN and abs(macs["after"] - budget) <= FFNS * D  # half a channel per FFN
    assert m["nonlinear_fraction"] == TARGET


def test_the_plain_model_trains_up_to_the_step_and_the_ends_after_it(affine_runs):
    """Up to the one-shot step every slope is 0 and no end exists; after it the same 32 channels per FFN are
    nonlinear (slope 0) at every step and the others linear (1), and their learnable ends move with training."""
    run = affine_runs.full
    at, total = one_shot_step(run), affine_runs.total
    before, after, last = (common.read_checkpoint(common.checkpoint_dir(run, s)) for s in (at, at + 1, total))
    for unit in UNITS:
        b, a, z = (unit_tensors(c, unit) for c in (before, after, last))
        assert set(b) == {"slope", "frozen"} and not b["slope"].any()
        assert set(a) == {"slope", "frozen", "alpha", "beta"} and int((a["slope"] == 0).sum()) == 32
        assert torch.equal(a["slope"], z["slope"]) and torch.equal(a["frozen"], a["slope"])
        assert not torch.equal(a["alpha"], z["alpha"]) and not torch.equal(a["beta"], z["beta"])


def test_folded_model_computes_the_written_out_ffns(affine_runs, one_shot_args):
    run = affine_runs.full
    reference = unconverted(run / "model")
    vocab = reference.config.vocab_size
    folded = linearize.load_folded(run / "folded", base=wmt14.build_model("tiny", vocab))
    saved = wmt14.load_model(run / "model").eval()
    g = torch.Generator().manual_seed(1)
    batch = wmt14.collate([(torch.randint(3, vocab, (n,), generator=g).tolist() + [1],
                            torch.randint(3, vocab, (n + 2,), generator=g).tolist() + [1]) for n in (4, 7, 9)])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        expected = reference(**inputs).logits
        scale = expected.abs().max()
        torch.testing.assert_close(folded(**inputs).logits, expected, atol=1e-5 * scale, rtol=0)
        torch.testing.assert_close(saved(**inputs).logits, expected, atol=1e-5 * scale, rtol=0)
    assert wmt14.ffn_macs_per_token(folded) == wmt14.prune_budget("tiny", TARGET)[1]


def test_killed_after_the_one_shot_step_resumes_bit_exact(affine_runs):
    runs = affine_runs
    latest = max(int(p.name[5:]) for p in runs.snapshot.glob("step_*"))
    assert one_shot_step(runs.full) < latest < runs.total  # the resumed process starts from one-shot weights
    assert "alpha" in unit_tensors(common.read_checkpoint(runs.snapshot / f"step_{latest:08d}"), UNITS[0])
    assert_resumed_as_uninterrupted(runs.full, runs.resumed, runs.total, wmt14.ONE_SHOT_FILE,
                                    (("one_shot", "file"), ("fold", "path")))


def test_stopped_at_the_one_shot_step_resumes_into_it_as_the_uninterrupted_run(one_shot_args, tmp_path):
    """Hybrid: the resumed process plans the FFNs on the same batches, with the same errors, and trains on the same."""
    args = one_shot_args + ["--one-shot", "hybrid"]
    full = wmt14.main(args + ["--output_dir", str(tmp_path / "full")])
    at = full["one_shot"]["step"]
    assert set(full["one_shot"]["plans"]) == set(UNITS)
    wmt14.main(args + ["--output_dir", str(tmp_path / "part"), "--stop-after", str(at)])
    assert not (tmp_path / "part" / wmt14.ONE_SHOT_FILE).exists()
    resumed = wmt14.main(args + ["--output_dir", str(tmp_path / "part"), "--resume_from_checkpoint", "latest"])
    assert full["one_shot"].pop("file") != resumed["one_shot"].pop("file")
    assert full["one_shot"] == resumed["one_shot"]
    assert_same_tree(load_file(str(tmp_path / "full" / "model" / "model.safetensors")),
                     load_file(str(tmp_path / "part" / "model" / "model.safetensors")), "final weights")


@pytest.mark.parametrize("flags, message", [
    (["--one-shot", "affine", "--linearize", "none"], "--linearize none .* use --linearize prelu"),
    (["--one-shot", "hybrid", "--linearize", "none", "--prune", "magnitude"], "--prune magnitude .* give one"),
    (["--one-shot", "affine", "--fsdp"], "--one-shot affine .* drop --fsdp"),
    (["--one-shot", "affine", "--schedule", "early"], "--schedule early .* drop --schedule"),
    (["--one-shot", "constant", "--schedule", "none"], "--schedule none .* drop --schedule"),
    (["--one-shot", "affine", "--select", "fit", "--rate", "0.1"], "--rate steers .* drop --rate, --select"),
    (["--one-shot", "affine", "--model-size", "tiny", "--target", "1"], "1 to 128"),
])
def test_bad_one_shot_flags_name_the_fix(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        wmt14.parse_args(["--output_dir", str(tmp_path), *flags])
    assert re.search(message, capsys.readouterr().err)


def test_one_shot_past_the_last_step_is_refused(one_shot_args, tmp_path):
    with pytest.raises(ValueError, match="linearizes at step 500, but the run has"):
        wmt14.main(one_shot_args + ["--one-shot", "affine", "--late-start", "500", "--output_dir", str(tmp_path)])



@pytest.mark.parametrize("started, resumed, stop_after", [
    ([], ["--one-shot", "affine"], 12), ([], ["--one-shot", "affine"], 6), (["--one-shot", "affine"], [], 12),
], ids=["added-after-the-step", "added-before-the-step", "dropped"])
def test_resuming_with_one_shot_added_or_dropped_names_the_flag(one_shot_args, tmp_path, started, resumed,
                                                                 stop_after):
    """A run stopped after (step 12) or before (6) the step --one-shot acts at (9), resumed with --one-shot added
    or dropped: refused naming --one-shot, as the run recorded it and as given now, and the output folder left as
    it was. Before, adding it after the step blamed a missing one_shot.json the run never had (read before the
    flags were compared), and the other cases a sparsifier state."""
    out = tmp_path / "run"
    wmt14.main(one_shot_args + started + ["--output_dir", str(out), "--stop-after", str(stop_after)])
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    was, now = (flags[1] if flags else None for flags in (started, resumed))
    with pytest.raises(ValueError, match=re.escape(f"other settings: --one-shot {was!r} (now {now!r})")):
        wmt14.main(one_shot_args + resumed + ["--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
