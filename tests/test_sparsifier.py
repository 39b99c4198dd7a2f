"""Sparsity pressure and schedules in a plain PyTorch loop, on the real scikit-learn digits."""

from __future__ import annotations

import io
import json
import math
import warnings

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

import linearize
from linearize import LinearizableActivation
from linearize import schedules as S
import copy

BATCH = 64
EPOCHS = 12


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits():
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x, y, perm[:1300], perm[1300:]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), LinearizableActivation("relu", 64, -1),
        nn.Linear(64, 64), LinearizableActivation("relu", 64, -1),
        nn.Linear(64, 10),
    )


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1), LinearizableActivation("relu", 16, 1),
        nn.Conv2d(16, 32, 3, padding=1, stride=2), LinearizableActivation("relu", 32, 1),
        nn.Flatten(), nn.Linear(512, 10),
    )


def steps_per_epoch(train_idx) -> int:
    return math.ceil(len(train_idx) / BATCH)


def batches(train_idx, epochs: int, first_step: int = 0):
    """Deterministic batches: the order of epoch ``e`` depends only on ``e`` (resumable)."""
    per = steps_per_epoch(train_idx)
    for step in range(first_step, epochs * per):
        epoch, i = divmod(step, per)
        order = train_idx[torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(epoch))]
        yield order[i * BATCH : (i + 1) * BATCH]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(linearize.param_groups(model, weight_decay=5e-4), lr=0.05, momentum=0.9)


def train(
    model, data, epochs=EPOCHS, schedule="none", lam=1e-2, first_step=0, optimizer=None, sparsifier=None, stop=None
):
    """Train; ``schedule="none"`` builds no Sparsifier. Returns (accuracy, optimizer, sparsifier)."""
    x, y, tr, te = data
    opt = optimizer or make_optimizer(model)
    total = epochs * steps_per_epoch(tr)
    if sparsifier is None and schedule != "none":
        sparsifier = linearize.Sparsifier(model, schedule, total, lam=lam)
        sparsifier.attach(opt)  # the one line a plain loop needs besides the constructor
    for step, b in enumerate(batches(tr, epochs, first_step), start=first_step):
        if stop is not None and step == stop:
            break
        loss = nn.functional.cross_entropy(model(x[b]), y[b])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (model(x[te]).argmax(1) == y[te]).float().mean().item()
    return acc, opt, sparsifier


@pytest.mark.parametrize("build", [mlp, cnn])
def test_target_reaches_fraction_and_keeps_accuracy(digits, build):
    base_acc, _, _ = train(build(), digits)
    model = build()
    end_step = 6 * steps_per_epoch(digits[2])
    acc, _, sp = train(model, digits, schedule=S.target(0.10, start=0, end=end_step))
    print(f"{build.__name__}: unconstrained {base_acc:.4f}, target 0.10 -> {acc:.4f}")
    # reached by the given step and held within +-0.01 afterwards (no oscillation)
    after = [h["nonlinear_fraction"] for h in sp.history if h["step"] >= end_step]
    assert after and all(abs(f - 0.10) <= 0.02 for f in after)
    assert max(after) - min(after) <= 0.01
    assert abs(linearize.nonlinear_fraction(model) - 0.10) <= 0.02
    assert acc >= base_acc - 0.03
    # the path is monotone: the fraction never rises on the way down
    fr = [h["nonlinear_fraction"] for h in sp.history]
    assert all(b <= a + 1e-9 for a, b in zip(fr, fr[1:]))
    # linear channels are exactly 1, not 0.98
    slopes = torch.cat([u.slope.detach() for _, u in linearize.units(model)])
    assert int((slopes == 1.0).sum()) == linearize.count_units(model)["linear"] > 0


def test_early_and_late_both_reach_target(digits):
    per = steps_per_epoch(digits[2])
    results = {}
    for name, sched in {
        "early": S.target(0.10, start=0, end=5 * per),
        "late": S.target(0.10, start=6 * per, end=10 * per),
    }.items():
        model = mlp()
        acc, _, sp = train(model, digits, schedule=sched)
        results[name] = acc
        assert abs(linearize.nonlinear_fraction(model) - 0.10) <= 0.02
        if name == "late":  # no pressure before start
            assert all(h["nonlinear_fraction"] == 1.0 for h in sp.history if h["step"] <= 6 * per)
    print(f"early {results['early']:.4f}  late {results['late']:.4f} (gap: see recipes/benchmarks/schedule.py)")


def test_lam_zero_changes_nothing(digits):
    a = mlp()
    train(a, digits, epochs=3)
    b = mlp()
    _, _, sp = train(b, digits, epochs=3, schedule=S.constant(0.0))
    assert sp.step_count == 3 * steps_per_epoch(digits[2])
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, equal_nan=True)  # bitwise


def test_unit_at_one_stays_exactly_one_and_frozen_channels_do_not_move(digits):
    model = mlp()
    first, second = linearize.units(model)[0][1], linearize.units(model)[1][1]
    with torch.no_grad():
        first.slope[:8] = 1.0
    second.freeze_(torch.arange(64) < 4, 0.0)  # frozen nonlinear: pressure must not move them
    second.freeze_((torch.arange(64) >= 4) & (torch.arange(64) < 6), 1.0)
    _, _, sp = train(model, digits, epochs=3, schedule=S.constant(1.0))
    assert torch.all(first.slope[:8] == 1.0)  # exactly 1 at every later step (checked at the end)
    assert torch.all(second.slope[:4] == 0.0) and torch.all(second.slope[4:6] == 1.0)
    # the pressure did act on free channels
    assert sp.nonlinear_fraction() < 1.0


def test_proximal_step_matches_hand_formula():
    model = mlp()
    names = [n for n, _ in linearize.units(model)]
    sp = linearize.Sparsifier(model, S.constant(0.5), total_steps=10, lr=0.1, weights={names[0]: 3.0})
    # normalized weights: 64 channels each at 3 and 1 -> mean 2 -> 1.5 and 0.5
    assert sp.weights == {names[0]: 1.5, names[1]: 0.5}
    before = []
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.copy_(torch.linspace(0.0, 1.0, 64))
            before.append(u.slope.clone())
    sp.step()
    for (_, u), a0, w in zip(linearize.units(model), before, (1.5, 0.5)):
        expected = torch.clamp(a0 + 0.1 * 0.5 * w, max=1.0)
        assert torch.equal(u.slope.detach(), expected)


def test_penalty_value_gradient_and_loss_mode():
    model = mlp()
    sp = linearize.Sparsifier(model, S.constant(0.2), total_steps=10, mode="loss", lr=0.1)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.uniform_(0, 1)
    expected = 0.2 * sum(float((1 - u.slope.detach()).sum()) for _, u in linearize.units(model))
    p = sp.penalty()
    assert p.item() == pytest.approx(expected, rel=1e-6)
    p.backward()
    for _, u in linearize.units(model):
        assert torch.allclose(u.slope.grad, torch.full((64,), -0.2))
    before = [u.slope.detach().clone() for _, u in linearize.units(model)]
    sp.step()  # loss mode: the step itself applies no pressure
    assert all(torch.equal(b, u.slope) for b, (_, u) in zip(before, linearize.units(model)))


def test_ramps_and_schedules_values():
    assert S.constant(0.3)(0, 100) == 0.3
    assert S.late(start=0.5, lam=2.0)(49, 100) == 0.0 and S.late(start=0.5, lam=2.0)(50, 100) == 2.0
    assert S.late(start=50, lam=2.0)(50, 1000) == 2.0  # int = absolute step
    lin = S.early(lam=1.0, ramp=10)
    assert [lin(s, 100) for s in (0, 4, 9, 50)] == pytest.approx([0.1, 0.5, 1.0, 1.0])
    cos = S.cosine(lam=1.0, warmup=10)
    assert cos(4, 100) == pytest.approx(0.5 * (1 - math.cos(math.pi * 0.5)))
    t = S.target(0.1, start=10, end=20)
    assert t.wanted(5, 100, 1.0) is None
    assert t.wanted(14, 100, 1.0) == pytest.approx(0.1 + 0.9 * 0.5**3)
    assert t.wanted(19, 100, 1.0) == pytest.approx(0.1) and t.wanted(90, 100, 1.0) == pytest.approx(0.1)
    assert S.from_dict(t.to_dict()) == t
    # lam=None schedules take the Sparsifier's lam
    sp = linearize.Sparsifier(mlp(), S.late(start=0.5), total_steps=10, lam=0.25, lr=1.0)
    assert sp.lam_at(4) == 0.0 and sp.lam_at(5) == 0.25
    # a plain function is a schedule
    sp = linearize.Sparsifier(mlp(), lambda step, total: step / total, total_steps=10, lr=1.0)
    assert sp.lam_at(5) == 0.5


def test_state_dict_round_trip_continues_identically(digits):
    sched = lambda: S.target(0.2, start=5, end=60)  # noqa: E731
    epochs, stop = 3, 30
    ref = mlp()
    _, _, sp_ref = train(ref, digits, epochs=epochs, schedule=sched())

    first = mlp()
    _, opt, sp = train(first, digits, epochs=epochs, schedule=sched(), stop=stop)
    saved = json.loads(json.dumps(sp.state_dict()))  # must be JSON-serializable
    model_state, opt_state = first.state_dict(), opt.state_dict()

    resumed = mlp()
    resumed.load_state_dict(model_state)
    opt2 = make_optimizer(resumed)
    opt2.load_state_dict(opt_state)
    sp2 = linearize.Sparsifier(resumed, sched(), epochs * steps_per_epoch(digits[2]), lam=1e-2).attach(opt2)
    sp2.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # resuming must not trigger the missed-step warning
        train(resumed, digits, epochs=epochs, first_step=stop, optimizer=opt2, sparsifier=sp2)
    for (_, u), (_, v) in zip(linearize.units(ref), linearize.units(resumed)):
        assert torch.equal(u.slope, v.slope)
    assert sp2.step_count == sp_ref.step_count and sp2.history == sp_ref.history


def test_history_saved_as_json(tmp_path, digits):
    model = mlp()
    _, _, sp = train(model, digits, epochs=1, schedule=S.target(0.5, end=10))
    path = sp.save_history(tmp_path / "history.json")
    data = json.loads(path.read_text())
    assert data["sites"] == [n for n, _ in linearize.units(model)]
    last = data["history"][-1]
    assert last["step"] == sp.step_count
    for name, unit in linearize.units(model):
        assert last["sites"][name] == pytest.approx(float((unit.slope < 1).float().mean()))


def test_flops_weights_follow_layer_sizes():
    model = nn.Sequential(
        nn.Linear(4, 8), LinearizableActivation("relu", 8, -1),
        nn.Linear(8, 100), LinearizableActivation("relu", 100, -1), nn.Linear(100, 2),
    )
    raw = linearize.sparsifier.flops_weights(model, torch.randn(3, 4))
    names = [n for n, _ in linearize.units(model)]
    assert raw[names[0]] == pytest.approx((4 * 8 + 8 * 100) / 8)
    assert raw[names[1]] == pytest.approx((8 * 100 + 100 * 2) / 100)



def test_flops_weights_count_the_transposed_convs_next_to_a_unit():
    """A decoder: each unit's neighbours are the layers that run just before and after it, transposed convs
    included; hand count of multiply-adds per sample."""
    from linearize.sparsity.weights import flops_weights

    x = torch.randn(2, 3, 8, 8)
    model = linearize.convert(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(8, 8, 4, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(8, 8, 4, stride=2, padding=1, groups=2), nn.ReLU(), nn.Conv2d(8, 3, 1)), example_inputs=x)
    conv0 = 8 * 8 * 8 * 3 * 9  # outputs x (inputs x kernel) each
    tconv2 = 8 * 8 * 8 * 8 * 16  # inputs x (outputs / groups x kernel) each
    tconv4 = 8 * 16 * 16 * 4 * 16
    conv6 = 3 * 32 * 32 * 8
    assert flops_weights(model, x) == pytest.approx(
        {"1": (conv0 + tconv2) / 8, "3": (tconv2 + tconv4) / 8, "5": (tconv4 + conv6) / 8})

def test_param_groups_exclude_slopes_from_weight_decay():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), LinearizableActivation("relu", 8, -1), nn.Linear(8, 2))
    groups = linearize.param_groups(model, weight_decay=0.1, slope_lr=0.5, betas=(0.9, 0.99))
    slope = linearize.units(model)[0][1].slope
    by_id = {id(p): g for g in groups for p in g["params"]}
    assert by_id[id(slope)]["weight_decay"] == 0.0 and by_id[id(slope)]["lr"] == 0.5
    assert by_id[id(model[0].weight)]["weight_decay"] == 0.1
    assert by_id[id(model[0].bias)]["weight_decay"] == 0.0 and by_id[id(model[1].weight)]["weight_decay"] == 0.0
    assert len(by_id) == len(list(model.parameters()))
    torch.optim.AdamW(groups, lr=1e-3)  # accepted by a torch optimizer


def test_warns_when_step_is_called_before_the_optimizer_stepped():
    model = mlp()
    opt = make_optimizer(model)
    sp = linearize.Sparsifier(model, S.constant(0.1), total_steps=10, optimizer=opt)
    with pytest.warns(UserWarning, match="after optimizer.step"):
        sp.step()


@pytest.mark.parametrize("slopes", ["frozen", "left out of the optimizer"])
def test_slopes_no_optimizer_moves_give_no_unstepped_warning(slopes):
    """Slopes no optimizer moves: frozen (requires_grad=False: nothing moves them, the Sparsifier neither), or
    trainable but in no optimizer (the Sparsifier moves them alone: select="fit" needs no gradient). step(), run
    after every optimizer.step(), warned that the slopes did not change since the last call. Truth: the run
    reaches the target, counted slope by slope; the frozen slopes stay at 0, which the floor's warning says."""
    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                                            nn.Linear(16, 3)))
    unit_slopes = [u.slope for _, u in linearize.units(model)]
    if slopes == "frozen":
        for s in unit_slopes:
            s.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if all(p is not s for s in unit_slopes)], lr=1e-3)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sp = linearize.Sparsifier(model, S.target(0.25), total_steps=30).attach(opt)
        for _ in range(30):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert sp.select == "fit"
    assert not [w for w in caught if "did not change" in str(w.message)]
    frozen = slopes == "frozen"
    assert float((torch.cat([s.detach() for s in unit_slopes]) < 1).float().mean()) == (1.0 if frozen else 0.25)
    assert bool([w for w in caught if "32 of 32 channels are frozen nonlinear" in str(w.message)]) == frozen


def test_bad_inputs_raise():
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            S.target(bad)
    with pytest.raises(ValueError, match=">= 0"):
        S.constant(-1.0)
    with pytest.raises(ValueError, match="after end"):
        S.target(0.1, start=0.9, end=0.5)
    with pytest.raises(ValueError, match="after end"):
        S.Ramp(lam=1.0, start=0.9, end=0.2)
    with pytest.raises(ValueError, match="after end"):  # mixed int / fraction: checked against total_steps
        linearize.Sparsifier(mlp(), S.target(0.1, start=80, end=0.5), total_steps=100)
    with pytest.raises(ValueError, match="fraction of training"):
        S.late(start=1.5)
    # a warm-up longer than the run never reaches full pressure: refused, not silently weaker
    with pytest.raises(ValueError, match="reaches full pressure at step 200"):
        linearize.Sparsifier(mlp(), S.linear(warmup=200), total_steps=100)
    with pytest.raises(ValueError, match="after end=20"):
        linearize.Sparsifier(mlp(), S.Ramp(start=10, ramp=20, end=20), total_steps=100)
    with pytest.raises(ValueError, match="reaches full pressure at step 2"):  # a float start rounds nothing here
        linearize.Sparsifier(mlp(), S.Ramp(start=0.0, ramp=2), total_steps=1)
    for never in (S.late(start=1.0), S.Ramp(start=10), S.target(0.5, start=10, end=10)):  # steps run 0 .. 9
        with pytest.raises(ValueError, match="the last step is 9"):
            linearize.Sparsifier(mlp(), never, total_steps=10)
    for fits in (S.linear(warmup=100), S.cosine(warmup=0.1), S.Ramp(start=99)):  # full pressure by the last step
        linearize.Sparsifier(mlp(), fits, total_steps=100)
    for total in range(1, 60):  # halves of an odd run round apart, but together they fit it
        linearize.Sparsifier(mlp(), S.late(start=0.5, ramp=0.5), total_steps=total)
    with pytest.raises(ValueError, match="no linearizable units"):
        linearize.Sparsifier(nn.Linear(3, 3), S.constant(0.1), total_steps=10)
    with pytest.raises(ValueError, match="lam"):
        linearize.Sparsifier(mlp(), S.constant(0.1), total_steps=10, lam=-1.0)
    with pytest.raises(ValueError, match="total_steps"):
        linearize.Sparsifier(mlp(), S.constant(0.1), total_steps=0)
    with pytest.raises(ValueError, match="weights"):
        linearize.Sparsifier(mlp(), S.constant(0.1), total_steps=10, weights="bogus")
    with pytest.raises(ValueError, match="does not have"):
        linearize.Sparsifier(mlp(), S.constant(0.1), total_steps=10, weights={"nope": 1.0})
    with pytest.raises(ValueError, match="learning rate"):
        sp = linearize.Sparsifier(mlp(), S.constant(0.1), total_steps=10)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sp.step()


def test_budget_projection_keeps_exactly_the_budget_and_prefers_linear_channels():
    model = nn.Sequential(nn.Linear(2, 10), LinearizableActivation("relu", 10, -1))
    unit = linearize.units(model)[0][1]
    sp = linearize.Sparsifier(model, S.target(0.8, start=0, end=0), total_steps=5, lam=0.0, release=0.01)
    with torch.no_grad():
        unit.slope.copy_(torch.tensor([1.0, 1.0, 1.0, 0.5, 0.95, 0, 0, 0, 0, 0]))
    sp.step()  # 2 linear wanted: the first two of the three tied at 1 stay, the third is released
    assert unit.slope.tolist() == pytest.approx([1, 1, 0.99, 0.5, 0.95, 0, 0, 0, 0, 0])
    with torch.no_grad():
        unit.slope[[2, 4]] = 1.0  # e.g. pushed there by the gradient
    sp.step()  # ties at 1: channels that were linear before keep their place
    assert unit.slope.tolist() == pytest.approx([1, 1, 0.99, 0.5, 0.99, 0, 0, 0, 0, 0])
    with torch.no_grad():
        unit.slope[0] = 0.9  # pulled below 1 by the loss: the next closest to 1 takes its place
    unit.freeze_(torch.arange(10) == 9, 1.0)  # frozen linear channels count against the budget
    sp.step()
    assert unit.slope.tolist() == pytest.approx([0.9, 1, 0.99, 0.5, 0.99, 0, 0, 0, 0, 1])
    assert sp.nonlinear_fraction() == 0.8


def test_attaching_an_optimizer_without_the_slopes_warns():
    """Slopes trained by optimizer B, the Sparsifier attached to A (the weights'): the pressure would run
    after a step that does not move the slopes. Attached to B, or to A with frozen slopes: no warning."""
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                              example_inputs=torch.randn(2, 4))
    slopes = [u.slope for _, u in linearize.units(model)]
    weights = [p for p in model.parameters() if all(p is not s for s in slopes)]
    a, b = torch.optim.SGD(weights, lr=0.1), torch.optim.Adam(slopes, lr=0.1)
    schedule = linearize.schedules.constant(1.0)
    with pytest.warns(UserWarning, match="this SGD holds none of the unit slopes"):
        linearize.Sparsifier(model, schedule, total_steps=10).attach(a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linearize.Sparsifier(model, schedule, total_steps=10).attach(b)
        for s in slopes:
            s.requires_grad_(False)
        linearize.Sparsifier(model, schedule, total_steps=10).attach(torch.optim.SGD(weights, lr=0.1))


def test_a_step_by_hand_on_an_attached_sparsifier_is_refused():
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(linearize.param_groups(model), lr=0.01)
    sp = linearize.Sparsifier(model, S.target(0.25, start=0.0, end=1.0), total_steps=10).attach(opt)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 4)).square().mean().backward()
        opt.step()
        with pytest.raises(RuntimeError, match=r"attached.*twice.*remove the sparsifier.step\(\) call.*detach"):
            sp.step()  # the hook stepped it already: a second step would run the schedule at double speed
    assert sp.step_count == 3  # one per optimizer step
    sp.detach()
    opt.step()
    sp.step()  # detached: stepping by hand is the way
    assert sp.step_count == 4


def test_attach_warning_raised_as_error_leaves_the_sparsifier_detached():
    """Under ``simplefilter("error")`` the warning stops attach(): nothing is half attached (no optimizer
    held, no hook, the optimizer free for another Sparsifier), and a second try raises again."""
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                              example_inputs=torch.randn(2, 4))
    slopes = {id(u.slope) for _, u in linearize.units(model)}
    opt = torch.optim.SGD([p for p in model.parameters() if id(p) not in slopes], lr=0.1)
    sp = linearize.Sparsifier(model, linearize.schedules.constant(1.0), total_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with pytest.raises(UserWarning, match="holds none of the unit slopes"):
                sp.attach(opt)
            assert sp.optimizer is None and sp._hook is None
    assert not opt._optimizer_step_post_hooks
    with pytest.warns(UserWarning, match="holds none of the unit slopes"):
        linearize.Sparsifier(model, linearize.schedules.constant(1.0), total_steps=10).attach(opt)
    assert len(opt._optimizer_step_post_hooks) == 1


def test_attaching_through_a_wrapper_and_copying_do_not_warn():
    """The slopes are in the optimizer inside an accelerate-like wrapper; a deep copy and a pickle re-attach
    to their own copy of it: no "holds none of the unit slopes" warning (found holding by a break-it review)."""
    import copy
    import pickle

    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                              example_inputs=torch.randn(2, 4))
    opt = torch.optim.SGD(linearize.param_groups(model), lr=0.1)

    class Wrapper:  # as accelerate's AcceleratedOptimizer: the torch optimizer at .optimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sp = linearize.Sparsifier(model, S.constant(1.0), total_steps=10).attach(Wrapper(opt))
        copy.deepcopy((model, opt, sp))
        pickle.loads(pickle.dumps((model, opt, sp)))


def test_deepcopy_of_an_attached_sparsifier_drives_its_own_copy():
    """A deep copy (model, optimizer and sparsifier together) is attached to its own optimizer: a
    step of the copy's optimizer moves the copy's slopes only, a step of the original's the original's
    only (truth: the slopes before and after, compared tensor by tensor)."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    linearize.convert(model, example_inputs=torch.randn(2, 4))
    opt = torch.optim.SGD(linearize.param_groups(model), lr=0.1)
    sp = linearize.Sparsifier(model, schedule=linearize.schedules.constant(1.0), total_steps=10).attach(opt)
    copy_model, copy_opt, copied = copy.deepcopy((model, opt, sp))
    slope, copy_slope = linearize.units(model)[0][1].slope, linearize.units(copy_model)[0][1].slope
    assert copied.optimizer is copy_opt and copy_slope is not slope
    before, copy_before = slope.clone(), copy_slope.clone()
    copy_model(torch.randn(3, 4)).sum().backward()
    copied.optimizer.step()
    assert copied.step_count == 1 and sp.step_count == 0
    assert torch.equal(slope, before) and not torch.equal(copy_slope, copy_before)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert sp.step_count == 1 and copied.step_count == 1 and not torch.equal(slope, before)


def _tiny(widths=(16, 12)) -> nn.Module:
    layers, d = [], 8
    for w in widths:
        layers += [nn.Linear(d, w), nn.ReLU()]
        d = w
    return linearize.convert(nn.Sequential(*layers, nn.Linear(d, 2)), example_inputs=torch.randn(2, 8))


@pytest.mark.parametrize("key, value, match", [
    ("step_count", -5, "step_count must be an int >= 0"),
    ("step_count", True, "step_count must be an int >= 0"),
    ("initial_fraction", float("nan"), r"initial_fraction must be null or a number in \[0, 1\]"),
    ("selected", [-1], "selected must be null or distinct channel indices"),
    ("selected", [1.7], "selected must be null or distinct channel indices"),
    ("lam", float("nan"), "lam must be null or a finite number"),
    ("rate", -1.0, "rate must be a finite number >= 0"),
    ("lr_peak", [1.0], "lr_peak must be null or 2 entries"),
    ("history", "abc", "history must be a list of records"),
    ("sites", [["1", 12], ["3", 16]], r"other sites \(\['1', 12\] there, \['1', 16\] here\)"),
    ("total_steps", 80, "total_steps=80, this Sparsifier has 40"),
    ("schedule", S.target(0.6, end=20).to_dict(), "build it with the same schedule"),
])
def test_a_state_that_is_not_this_runs_is_refused_naming_the_key(key, value, match):
    """Such states loaded and then wrapped indices, split strings into history, blamed the schedule for a NaN
    rate, or put another model's per-unit state (same channel total) on the wrong units."""
    sp = linearize.Sparsifier(_tiny(), S.target(0.25, end=20), total_steps=40)
    state = json.loads(json.dumps(sp.state_dict())) | {key: value}
    with pytest.raises(ValueError, match=match):
        linearize.Sparsifier(_tiny(), S.target(0.25, end=20), total_steps=40).load_state_dict(state)
    with pytest.raises(ValueError, match=r"lacks \['channels'\]"):
        sp.load_state_dict({k: v for k, v in state.items() if k != "channels"})


@pytest.mark.parametrize("kwargs, match", [
    ({"rate": "0.01"}, r"rate must be a finite number >= 0 .*got '0.01'"),
    ({"rate": float("inf")}, r"rate must be a finite number >= 0"),
    ({"rate": True}, r"rate must be a finite number >= 0"),
    ({"release": "0.01"}, r"release must be a number in \(0, 1\), got '0.01'"),
    ({"release": None}, r"release must be a number in \(0, 1\), got None"),
    ({"release": 1.0}, r"release must be a number in \(0, 1\), got 1.0"),
])
def test_arguments_of_the_wrong_type_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        linearize.Sparsifier(_tiny(), S.target(0.25, end=20), total_steps=40, **kwargs)


def test_numbers_of_other_types_are_taken_as_floats():
    from decimal import Decimal

    for rate, release in ((torch.tensor(0.01), torch.tensor(0.05)), (Decimal("0.01"), np.float32(0.05))):
        sp = linearize.Sparsifier(_tiny(), S.target(0.25, end=20), total_steps=40, rate=rate, release=release)
        assert sp.state_dict()["rate"] == pytest.approx(0.01)


def test_a_fraction_target_that_frozen_channels_keep_out_of_reach_warns():
    model = _tiny()
    for _, u in linearize.units(model):
        u.frozen.fill_(0.0)  # every channel frozen nonlinear: the fraction cannot leave 1
    sp = linearize.Sparsifier(model, S.target(0.25, end=10), total_steps=10)
    with pytest.warns(UserWarning, match=r"28 of 28 channels are frozen nonlinear \(slope 0, or a slope below 1 "
                      r"with requires_grad=False\), a floor of 1.0000"):
        for _ in range(10):
            sp.step()
    assert sp.nonlinear_fraction() == 1.0


def test_a_fraction_target_above_what_channels_frozen_linear_allow_warns_with_the_ceiling():
    """freeze / one_shot left 21 of 28 channels frozen at slope 1: target(0.5) ended at 0.25 without a word (the
    mirror case, frozen nonlinear, warned). Truth: the count of channels the test froze."""
    model = _tiny()
    assert sum(u.num_channels for _, u in linearize.units(model)) == 28
    need = 21
    for _, u in linearize.units(model):
        take = min(u.num_channels, need)
        u.freeze_(torch.arange(u.num_channels) < take, 1.0)
        need -= take
    sp = linearize.Sparsifier(model, S.target(0.5, end=10), total_steps=10)
    with pytest.warns(UserWarning, match=r"21 of 28 channels are frozen linear \(slope 1.*a ceiling of 0.2500"):
        for _ in range(10):
            sp.step()
    assert sp.nonlinear_fraction() == 0.25


def test_half_precision_slopes_whose_push_rounds_away_warn_and_float32_slopes_move():
    """rate 1e-3 is below half a bfloat16 ulp near 1: the slopes stopped at 0.5 without a word."""
    model = _tiny().to(torch.bfloat16)
    opt = torch.optim.SGD(linearize.param_groups(model), lr=1e-4)
    sp = linearize.Sparsifier(model, S.early(), total_steps=1000).attach(opt)
    with pytest.warns(UserWarning, match="below half a torch.bfloat16 ulp"):
        opt.step()
    for _, u in linearize.units(model):  # the fix the warning names
        u.slope.data = u.slope.data.float()
    for _ in range(999):
        opt.step()
    assert all(float(u.slope.detach().min()) > 0.99 for _, u in linearize.units(model))  # 1000 x 1e-3 from 0



class _WithBlock(nn.Module):
    """A ReLU, then a module named ``block`` holding two units, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


def test_blocks_given_as_one_string_is_refused_not_read_per_character():
    """``blocks="block"`` was read per character ('b', 'l', ...: "modules the model does not have"; with
    one-letter module names it would group the wrong sites silently): a string is refused with the fix,
    and so is a module in place of its name; the list of the name groups the block's two sites."""
    model = linearize.convert(_WithBlock())
    names = [n for n, _ in linearize.units(model)]
    with pytest.raises(TypeError, match=r"blocks must be a list of module names, got the string 'block'.*"
                                        r"blocks=\['block'\]"):
        linearize.Sparsifier(model, S.constant(0.1), total_steps=10, granularity="block", blocks="block")
    with pytest.raises(TypeError, match=r"blocks must hold module names .* got Sequential"):
        linearize.Sparsifier(model, S.constant(0.1), total_steps=10, granularity="block", blocks=[model.block])
    assert linearize.sparsifier.site_groups(model, ["block"]) == {names[0]: [names[0]], "block": names[1:]}
    linearize.Sparsifier(model, S.constant(0.1), total_steps=10, granularity="block", blocks=["block"])


def test_shallow_copy_of_attached_sparsifier():
    """Truth: ``copy.copy`` of an object does not raise; the original stays the one attached (it still
    runs once per optimizer step). Observed: __setstate__ re-attaches the copy to the same optimizer and
    attach raises 'another Sparsifier is already attached'."""
    model = linearize.convert(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sparsifier = linearize.Sparsifier(model, total_steps=10).attach(optimizer)
    clone = copy.copy(sparsifier)
    assert clone is not sparsifier and sparsifier._hook is not None


def test_sparsifier_weights_survive_huge_values():
    """Only the ratios of unit weights matter (normalized to mean 1 over channels): weights of 1e308
    overflowed the sum and became 0 for every unit (no pressure at all), silently."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.ReLU())
    linearize.convert(model, example_inputs=torch.randn(2, 3))
    a, b = (n for n, _ in linearize.units(model))
    equal = linearize.Sparsifier(model, total_steps=10, weights={a: 1e308, b: 1e308}).weights
    assert equal == {a: 1.0, b: 1.0}
    ratio = linearize.Sparsifier(model, total_steps=10, weights={a: 1e308, b: 0.5e308}).weights
    assert ratio[a] == pytest.approx(4 / 3) and ratio[b] == pytest.approx(2 / 3)  # 4 channels each


def _model_hooks(model: nn.Module) -> dict:
    """Every hook dict of every module of ``model``, as ``{module: {kind: [(id, hook), ...]}}``."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
    return {name: {k: list(getattr(m, k).items()) for k in kinds} for name, m in model.named_modules()}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "attached"])
def test_a_dropped_sparsifier_leaves_the_models_hooks_as_they_were(optimizer):
    """A Sparsifier hooks the model (the non-finite input tracker, and the running fit under AdamW); once it is
    dropped (garbage collected; an attached one with its optimizer) the model's hook dicts hold what they held
    before it was built (truth: the dicts read before), and the model still trains and runs."""
    import gc

    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    model[0].register_forward_hook(lambda *args: None)  # the user's own hooks stay
    before = _model_hooks(model)
    opt = (torch.optim.SGD if optimizer != "adamw" else torch.optim.AdamW)(linearize.param_groups(model), lr=0.1)
    sp = linearize.Sparsifier(model, S.target(0.5), total_steps=10, optimizer=opt)
    if optimizer == "attached":
        sp.attach(opt)
    assert _model_hooks(model) != before
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(16, 4)).square().mean().backward()
        opt.step()
        if optimizer != "attached":
            sp.step()
    assert sp.step_count == 2
    del sp, opt
    gc.collect()  # its hooks are made inert: a finalizer may run while a hook dict is being iterated
    model(torch.randn(3, 4)).sum().backward()  # each removes itself at its next call
    assert _model_hooks(model) == before


def test_a_sparsifier_collected_while_the_model_is_deep_copied_changes_no_hook_dict_under_the_copy():
    """``copy.deepcopy`` iterates each module's hook dicts; a garbage collection inside it (here: a user's hook
    object that collects when copied, before the Sparsifier's hooks in the same dict) that drops a Sparsifier must
    not remove hooks from the dict being copied ("OrderedDict mutated during iteration"). Truth: the copy runs as
    the original, and the original's hook dicts end as before the Sparsifier once its inert hooks ran."""
    import copy
    import gc

    class Collecting:
        def __call__(self, module, args):
            return None

        def __deepcopy__(self, memo):
            gc.collect()  # the dropped Sparsifier (a reference cycle) goes here, inside the dict's iteration
            return Collecting()

    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    before_user = _model_hooks(model)
    opt = torch.optim.AdamW(linearize.param_groups(model), lr=0.1)
    sp = linearize.Sparsifier(model, S.target(0.5), total_steps=10).attach(opt)
    handle = model[0].register_forward_pre_hook(Collecting(), prepend=True)  # copied before the Sparsifier's hooks
    gc.disable()
    try:
        trainer = {"sparsifier": sp, "optimizer": opt}
        trainer["self"] = trainer  # a reference cycle: only a collection frees it
        del sp, opt, trainer
        twin = copy.deepcopy(model)
    finally:
        gc.enable()
    x = torch.randn(3, 4)
    assert torch.equal(twin(x), model(x))
    handle.remove()
    model(x).sum().backward()  # the inert hooks remove themselves
    assert _model_hooks(model) == before_user


def test_a_sparsifier_collected_during_a_forward_leaves_inert_hooks_that_remove_themselves():
    """A garbage collection may run inside a module call, while torch lists a module's hooks: the dropped
    Sparsifier's hooks then do nothing and each removes itself at its next call, leaving the hook dicts as they
    were before it was built (truth: the dicts read before)."""
    import gc

    class Collect(nn.Module):
        def forward(self, x):
            gc.collect()  # the dropped Sparsifier (a reference cycle) goes here, inside the model's call
            return x

    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(4, 4), Collect(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    before = _model_hooks(model)
    opt = torch.optim.AdamW(linearize.param_groups(model), lr=0.1)
    sp = linearize.Sparsifier(model, S.target(0.5), total_steps=10).attach(opt)
    gc.disable()
    try:
        del sp, opt
        model(torch.randn(3, 4))  # the forward collects it: its hooks are left inert
        assert _model_hooks(model) != before  # the first layer's, called before the collection
        model(torch.randn(3, 4))  # each inert hook removes itself when called
    finally:
        gc.enable()
    assert _model_hooks(model) == before


def _scaled_run(stepping: str, optimizer: str, skip: int | None, cut: int | None = None
                ) -> tuple[nn.Module, linearize.Sparsifier, float]:
    """20 steps under a ``torch.amp.GradScaler``; batch 5 of 21 overflows the scaled loss (its forward is finite),
    so the scaler skips its optimizer step; ``skip=5`` leaves that batch out instead. ``cut``: before that batch,
    save the model, optimizer, scaler and Sparsifier (through ``torch.save``), build them afresh and load them."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer, linearize.Sparsifier, torch.amp.GradScaler]:
        torch.manual_seed(0)
        model = linearize.convert(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)))
        opt = (torch.optim.SGD(linearize.param_groups(model), lr=0.05) if optimizer == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=1e-2))  # AdamW: select="fit", affine ends
        sp = linearize.Sparsifier(model, S.target(0.5, start=0, end=0.8), total_steps=20, optimizer=opt)
        return model, opt, sp, torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=1000)

    model, opt, sp, scaler = build()
    if stepping == "attached":
        sp.attach(opt)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(32, 4, generator=g) for _ in range(21)]
    batches[5] = batches[5] * 1e30  # the loss is finite in float32, the scaled loss's gradients are not
    for i, x in enumerate(batches):
        if i == skip:
            continue
        if i == cut:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                        "sp": sp.state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False)
            model, opt, sp, scaler = build()
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            scaler.load_state_dict(saved["scaler"])
            sp.load_state_dict(saved["sp"])
            if stepping == "attached":
                sp.attach(opt)
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        if stepping == "by hand":
            sp.step()  # after every scaler.step, the skipped one too
    return model, sp, scaler.get_scale()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("stepping", ["attached", "by hand"])
def test_a_step_a_grad_scaler_skips_is_not_counted_as_an_uninterrupted_run_without_its_batch(stepping, optimizer):
    """A step a GradScaler skips (inf gradients, no optimizer step) is not a step of the Sparsifier: stepped by
    hand it used to advance the schedule and push the slopes, and under AdamW the running fit took the skipped
    batch's (finite, huge) activations into the affine ends. Truth: the same run without that batch, which ends
    with the same weights, slopes, ends, schedule position and history, exactly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kept channels' mean slope at the target's end (SGD)
        model, sp, scale = _scaled_run(stepping, optimizer, None)
        truth, truth_sp, truth_scale = _scaled_run(stepping, optimizer, 5)
    assert scale == truth_scale / 2  # the scaler did skip one step
    assert sp.step_count == truth_sp.step_count == 20 and sp.history == truth_sp.history
    for (name, value), (_, expected) in zip(model.state_dict().items(), truth.state_dict().items()):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, equal_nan=True, msg=name)
    if optimizer == "adamw":
        assert sp.select == "fit" and linearize.units(model)[0][1].linear_end is not None


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("stepping", ["attached", "by hand"])
def test_a_step_a_grad_scaler_skips_right_after_a_resume_is_not_counted(stepping, optimizer):
    """Resumed (load_state_dict) just before the batch whose step the scaler skips: stepped by hand, that step was
    counted (load_state_dict forgot the slopes' versions, by which a skipped step is told), pushing the slopes and
    advancing the schedule. Truth: the uninterrupted run, equal bit for bit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kept channels' mean slope at the target's end (SGD)
        model, sp, scale = _scaled_run(stepping, optimizer, None, cut=5)
        truth, truth_sp, truth_scale = _scaled_run(stepping, optimizer, None)
    assert scale == truth_scale
    assert sp.step_count == truth_sp.step_count == 20 and sp.history == truth_sp.history
    for (name, value), (_, expected) in zip(model.state_dict().items(), truth.state_dict().items()):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, equal_nan=True, msg=name)


def _train_with_a_frozen_block(how: str, value: float, fraction: float | None) -> tuple[nn.Module, list[str]]:
    """30 SGD steps of a Sparsifier at target(fraction) (``None``: target(flops=0.8) by sites) on a model whose
    first block (layer '0' and unit '1', its slopes at ``value``) is frozen: by ``requires_grad_(False)`` on both,
    or ``how="freeze_"``: the unit by the library's own :meth:`freeze_`. Returns the model and the warnings about
    an unreachable target."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    model = linearize.convert(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                            nn.Linear(32, 4)))
    model[0].requires_grad_(False)
    with torch.no_grad():
        model[1].slope.fill_(value)
    if how == "requires_grad":
        model[1].requires_grad_(False)
    else:
        model[1].freeze_(torch.ones(32, dtype=torch.bool), value)
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if p.requires_grad and n != "1.slope"],
                          lr=0.05, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fraction is None:
            linearize.Sparsifier(model, linearize.schedules.target(flops=0.8, start=0.2, end=0.8), total_steps=30,
                                 select="slope", granularity="site", example_inputs=x[:2]).attach(opt)
        else:
            linearize.Sparsifier(model, linearize.schedules.target(fraction, start=0.2, end=0.8), total_steps=30,
                                 select="slope").attach(opt)
        for _ in range(30):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model, [str(w.message) for w in caught if "cannot be reached" in str(w.message)]


@pytest.mark.parametrize("value, fraction, reachable", [(0.0, 0.5, True), (0.0, 0.25, False), (1.0, 0.75, False),
                                                       (0.0, None, True)])
def test_slopes_with_requires_grad_false_stay_where_they_are_as_if_frozen(value, fraction, reachable):
    """A block frozen with requires_grad_(False), its unit's slope included, had 15 of its 32 channels made
    linear by the Sparsifier. Truth: the same run with that unit frozen by the library's freeze_: the same
    slopes everywhere, the target met with the other unit's channels, or the same floor / ceiling warning."""
    held, held_warnings = _train_with_a_frozen_block("requires_grad", value, fraction)
    frozen, frozen_warnings = _train_with_a_frozen_block("freeze_", value, fraction)
    assert bool((held[1].slope == value).all())
    for (_, a), (_, b) in zip(linearize.units(held), linearize.units(frozen)):
        assert torch.equal(a.slope, b.slope)
    assert held_warnings == frozen_warnings and bool(held_warnings) == (not reachable)
    if fraction is not None and reachable:
        assert linearize.nonlinear_fraction(held) == pytest.approx(fraction)
    if fraction is None:  # the plan makes the one site it can linear
        assert bool((held[3].slope == 1).all())


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_a_sparsifier_with_a_running_fit_trains_on_nested_batches_as_on_their_sequences(layout):
    """Under AdamW (select="fit": a running fit of the units) a Sparsifier crashed at the first forward of a nested
    batch (torch.nested, which the units take) in its statistics hook, deep in torch. Truth: the same run fed
    each batch's sequences one by one as dense micro-batches of one step: the same slopes and linear ends."""
    def run(nested: bool) -> nn.Module:
        torch.manual_seed(0)
        model = linearize.convert(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)),
                                  example_inputs=torch.randn(2, 5, 8))
        opt = torch.optim.AdamW(linearize.param_groups(model), lr=1e-2)
        sp = linearize.Sparsifier(model, S.target(0.5, end=0.5), total_steps=6, optimizer=opt,
                                  linear_end="affine")
        data = torch.Generator().manual_seed(1)
        for _ in range(6):
            seqs = [torch.randn(n, 8, generator=data) for n in (3, 5)]
            opt.zero_grad()
            if nested:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # torch: the strided layout is a prototype
                    out = model(torch.nested.as_nested_tensor(seqs, layout=layout))
                sum(o.square().sum() for o in out.unbind()).backward()
            else:
                for s in seqs:
                    model(s.unsqueeze(0)).square().sum().backward()
            opt.step()
            sp.step()
        return model

    got, want = run(True), run(False)
    [(_, unit)], [(_, twin)] = linearize.units(got), linearize.units(want)
    assert 0 < int((twin.slope == 1).sum()) < 16 and twin.linear_end is not None
    torch.testing.assert_close(unit.slope, twin.slope, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(unit.linear_end, twin.linear_end, rtol=1e-5, atol=1e-6)
