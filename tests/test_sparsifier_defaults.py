"""The Sparsifier's defaults in a user's own loop: ``select="auto"`` and ``linear_end="auto"`` resolve by the
optimizer in use (adaptive: the channels whose affine fit loses least, with fitted linear ends; SGD: the
paper's push and identity ends), and under AdamW at a fine-tune learning rate they keep a pretrained
model's function where the paper's settings lose it. The truth is the unconverted teacher's output, the
ends are checked against numpy's least squares on the data, resume against an uninterrupted run."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import linearize

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 120


def _teacher() -> nn.Module:
    """A small 'pretrained' GELU MLP: trained on a smooth regression task, so its channels differ (some
    mostly inactive, some mostly linear) as a real pretrained FFN's do."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8))
    with torch.no_grad():
        net[0].bias.add_(torch.linspace(-3, 3, 64))  # channels from mostly off to mostly on
    x = torch.randn(2048, 8)
    y = torch.sin(x) + x.roll(1, 1) * x
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(300):
        i = torch.randint(0, 2048, (128,))
        opt.zero_grad()
        nn.functional.mse_loss(net(x[i]), y[i]).backward()
        opt.step()
    return net.eval()


def _user_loop(teacher: nn.Module, steps: int = STEPS, optimizer=torch.optim.AdamW, lr: float = 1e-4,
               state: dict | None = None, stop: int | None = None, by_hand: bool = False,
               **kwargs) -> tuple[nn.Module, dict]:
    """The obvious loop: convert, a 25% target with the defaults, the user's own distillation loss; the Sparsifier
    attached, or (``by_hand``) stepped after each ``opt.step()``."""
    torch.manual_seed(1)
    student = linearize.convert(copy.deepcopy(teacher), example_inputs=torch.randn(2, 8)).train()
    opt = optimizer(student.parameters(), lr=lr)
    sp = linearize.Sparsifier(student, linearize.schedules.target(0.25), total_steps=steps, **kwargs)
    if not by_hand:
        sp.attach(opt)
    start = 0
    if state is not None:
        student.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sp.load_state_dict(state["sparsifier"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
    for step in range(start, steps if stop is None else stop):
        x = torch.randn(64, 8)
        with torch.no_grad():
            want = teacher(x)
        loss = nn.functional.mse_loss(student(x), want)
        opt.zero_grad()
        loss.backward()
        opt.step()  # the attached Sparsifier steps after it
        if by_hand:
            sp.step()
    saved = {"model": copy.deepcopy(student.state_dict()), "optimizer": copy.deepcopy(opt.state_dict()),
             "sparsifier": copy.deepcopy(sp.state_dict()), "rng": torch.get_rng_state(),
             "step": steps if stop is None else stop}
    return student.eval(), {"sparsifier": sp, "saved": saved}


def _error(student: nn.Module, teacher: nn.Module) -> float:
    torch.manual_seed(5)
    x = torch.randn(4096, 8)
    with torch.no_grad():
        want = teacher(x)
        return float((student(x) - want).square().mean() / want.square().mean())


def test_auto_resolves_by_the_optimizer():
    teacher = _teacher()
    cases = {torch.optim.AdamW: ("fit", "affine"), torch.optim.Adam: ("fit", "affine"),
             torch.optim.RMSprop: ("fit", "affine"), torch.optim.SGD: ("slope", "identity")}
    for optimizer, expected in cases.items():
        _, out = _user_loop(teacher, steps=4, optimizer=optimizer, lr=1e-3)
        sp = out["sparsifier"]
        assert (sp.select, sp.linear_end) == expected, optimizer.__name__
    student = linearize.convert(copy.deepcopy(teacher))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    # an explicit push means the paper's selection; explicit choices are kept
    sp = linearize.Sparsifier(student, linearize.schedules.target(0.25), total_steps=10, rate=0.01)
    sp.attach(opt)
    assert (sp.select, sp.linear_end) == ("slope", "identity")
    sp.detach()
    sp = linearize.Sparsifier(student, linearize.schedules.target(0.25), total_steps=10, select="saliency",
                              linear_end="affine")
    sp.attach(opt)
    assert (sp.select, sp.linear_end) == ("saliency", "affine")
    sp.detach()
    # a ramp (no target) has nothing to select: the push, identity ends
    sp = linearize.Sparsifier(student, linearize.schedules.late(), total_steps=10)
    sp.attach(opt)
    assert (sp.select, sp.linear_end) == ("slope", "identity")
    with pytest.raises(ValueError, match="linear_end"):
        linearize.Sparsifier(student, linearize.schedules.target(0.25), total_steps=10, linear_end="affin")


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.SGD])
def test_a_sparsifier_stepped_by_hand_settles_the_defaults_as_attach_does(optimizer):
    teacher = _teacher()
    attached, a = _user_loop(teacher, steps=30, optimizer=optimizer, lr=1e-3)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        by_hand, b = _user_loop(teacher, steps=30, optimizer=optimizer, lr=1e-3, by_hand=True)
    assert not [w for w in said if "no optimizer is known" in str(w.message)]  # it is known
    a, b = a["sparsifier"], b["sparsifier"]
    assert (b.select, b.linear_end) == (a.select, a.linear_end)
    # the attached run is the truth: the same slopes, ends and outputs
    for (_, u), (_, v) in zip(linearize.units(attached), linearize.units(by_hand)):
        assert torch.equal(u.slope, v.slope)
        if u.linear_end is not None:
            assert all(torch.equal(x, y) for x, y in zip(u.linear_end, v.linear_end))
    x = torch.randn(256, 8)
    with torch.no_grad():
        assert torch.equal(attached(x), by_hand(x))


def test_a_first_step_by_hand_with_no_optimizer_known_warns_naming_the_fix():
    student = linearize.convert(copy.deepcopy(_teacher()))
    sp = linearize.Sparsifier(student, linearize.schedules.target(0.25), total_steps=10)
    with pytest.warns(UserWarning, match=r"no optimizer is known.*optimizer=.*attach\(optimizer\)"):
        sp.step()  # before any optimizer.step()
    assert (sp.select, sp.linear_end) == ("slope", "identity")
    # an explicit choice does not depend on the optimizer: nothing to warn of
    sp = linearize.Sparsifier(student, linearize.schedules.target(0.25), total_steps=10, select="slope")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        sp.step()
    assert not [w for w in said if "no optimizer is known" in str(w.message)]


def test_defaults_under_adamw_keep_the_function_the_paper_settings_lose():
    teacher = _teacher()
    student, out = _user_loop(teacher)
    assert linearize.nonlinear_fraction(student) == 0.25  # the target, exactly
    paper, _ = _user_loop(teacher, select="slope", linear_end="identity")
    assert linearize.nonlinear_fraction(paper) == 0.25
    # the one-shot linearization with affine ends, chosen on 2,048 calibration samples, before any training
    # (its ends alone: refit=False; the refit of the next layer does better than this loop on this toy)
    one_shot = linearize.convert(copy.deepcopy(teacher), example_inputs=torch.randn(2, 8))
    torch.manual_seed(3)
    linearize.one_shot(one_shot, torch.randn(2048, 8), target=0.25, refit=False)
    ours, theirs, calibrated = _error(student, teacher), _error(paper, teacher), _error(one_shot.eval(), teacher)
    assert ours <= calibrated and ours < theirs / 10, (ours, calibrated, theirs)
    # the kept channels stay nonlinear (no uniform push carried them towards 1)
    unit = linearize.units(student)[0][1]
    kept = unit.slope.detach() < 1
    assert float(unit.slope.detach()[kept].max()) < 0.05


@pytest.mark.parametrize("steps, glide", [(STEPS, None), (10, None), (STEPS, 0.0)])  # short: channels arrive at once
def test_linear_channels_end_at_the_least_squares_fit_of_their_data(steps, glide):
    teacher = _teacher()
    student, _ = _user_loop(teacher, steps=steps, glide=glide)
    _check_fitted_ends(student)


def test_channels_that_arrive_before_any_fit_get_it_at_the_first_step_with_one():
    teacher = _teacher()
    torch.manual_seed(1)
    student = linearize.convert(copy.deepcopy(teacher), example_inputs=torch.randn(2, 8))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    sp = linearize.Sparsifier(student, linearize.schedules.target(0.25), total_steps=10, glide=0.0).attach(opt)
    unit = linearize.units(student)[0][1]
    for step in range(10):
        student.train(step > 0)  # the first step's forward in eval mode: no fit when channels arrive at 1
        x = torch.randn(512, 8)  # the ends are the fit of one batch: a large one
        loss = nn.functional.mse_loss(student(x), teacher(x).detach())
        opt.zero_grad()
        loss.backward()
        if step == 0:
            with pytest.warns(UserWarning, match="no training-mode forward"):
                opt.step()
            assert unit.linear_end is None and int((unit.slope == 1).sum()) > 0  # no fit yet: the identity
        else:
            opt.step()
    assert sp.step_count == 10
    _check_fitted_ends(student.eval())


def _check_fitted_ends(student: nn.Module) -> None:
    """Every linear channel's end errs about as little as numpy's least-squares fit on fresh data, and no more
    than the identity."""
    unit = linearize.units(student)[0][1]
    linear = (unit.slope.detach() == 1).numpy()
    alpha, beta = (t.detach().double().numpy() for t in unit.linear_end)
    torch.manual_seed(7)
    x = torch.randn(4096, 8)
    with torch.no_grad():
        h = student[0](x).double().numpy()
    y = torch.nn.functional.gelu(torch.from_numpy(h)).numpy()
    for c in np.flatnonzero(linear):  # the fit of the (drifting) training data, near the fresh data's own
        design = np.stack([h[:, c], np.ones(len(h))], 1)
        (a_ls, b_ls), *_ = np.linalg.lstsq(design, y[:, c], rcond=None)
        err_end = np.mean((y[:, c] - alpha[c] * h[:, c] - beta[c]) ** 2)
        err_ls = np.mean((y[:, c] - a_ls * h[:, c] - b_ls) ** 2)
        err_identity = np.mean((y[:, c] - h[:, c]) ** 2)
        assert err_end <= 1.5 * err_ls + 1e-4 and err_end <= err_identity + 1e-9, (c, err_end, err_ls, err_identity)


def test_one_skipped_non_finite_batch_leaves_the_ends_and_the_target_intact():
    teacher = _teacher()
    torch.manual_seed(1)
    student = linearize.convert(copy.deepcopy(teacher), example_inputs=torch.randn(2, 8)).train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    sp = linearize.Sparsifier(student, linearize.schedules.target(0.25), total_steps=40).attach(opt)
    skipped = 0
    for step in range(41):
        x = torch.randn(64, 8)
        if step == 5:
            x[0, 0] = float("inf")  # an overflow: the loss is NaN and the step is skipped, as a loss scaler does
        loss = nn.functional.mse_loss(student(x), teacher(x).detach())
        opt.zero_grad()
        loss.backward()
        if not torch.isfinite(loss):
            skipped += 1
            continue
        opt.step()
    alpha, beta = linearize.units(student)[0][1].linear_end
    assert skipped == 1 and sp.step_count == 40
    assert bool(torch.isfinite(alpha).all() and torch.isfinite(beta).all())
    assert linearize.nonlinear_fraction(student) == 0.25
    assert _error(student, teacher) < 0.5  # the teacher's output, not NaN


def test_nan_at_padded_positions_of_every_batch_leaves_the_ends_the_fit_of_the_other_positions():
    """Every batch holds NaN at positions the loss masks (padding): every step used to be dropped from the
    running fit, so the linear channels kept the identity end, with a warning to call model.train(). Truth:
    numpy's least-squares fit of each linear channel (``_check_fitted_ends``)."""
    teacher = _teacher()
    torch.manual_seed(1)
    student = linearize.convert(copy.deepcopy(teacher), example_inputs=torch.randn(2, 8)).train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    sp = linearize.Sparsifier(student, linearize.schedules.target(0.25), total_steps=STEPS).attach(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        for _ in range(STEPS):
            x = torch.randn(68, 8)
            x[-4:] = float("nan")  # 4 padded positions
            with torch.no_grad():
                want = teacher(x[:-4])
            loss = nn.functional.mse_loss(student(x)[:-4], want)
            opt.zero_grad()
            loss.backward()
            for p in student.parameters():  # the padded rows' 0 * NaN in the weight gradients
                if p.grad is not None:
                    p.grad.nan_to_num_(0.0)
            opt.step()
    assert sp.step_count == STEPS and linearize.nonlinear_fraction(student) == 0.25
    _check_fitted_ends(student.eval())


def test_a_fit_that_saw_only_nan_positions_warns_of_them_not_of_eval_mode():
    """Training forwards whose every position is NaN leave no fit: the warning names the NaN/inf positions
    and the fix, not model.train() (the model trains)."""
    torch.manual_seed(1)
    student = linearize.convert(_teacher(), example_inputs=torch.randn(2, 8)).train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    linearize.Sparsifier(student, linearize.schedules.target(0.25), total_steps=10).attach(opt)
    student(torch.full((16, 8), float("nan")))
    sum(unit.slope.sum() for _, unit in linearize.units(student)).backward()  # finite gradients: the slopes move
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    messages = [str(w.message) for w in caught]
    assert any("held NaN/inf" in m and "16 positions of unit '1'" in m for m in messages), messages
    assert not any("model.train()" in m for m in messages), messages


def test_an_empty_first_batch_warns_of_empty_batches_not_of_eval_mode():
    """A training loop whose first batch has no sample (x[:0]) was told to call model.train(), which it had.
    The warning names the empty batches; the run still reaches its target (counted slope by slope)."""
    teacher = _teacher()
    torch.manual_seed(1)
    student = linearize.convert(copy.deepcopy(teacher), example_inputs=torch.randn(2, 8)).train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    linearize.Sparsifier(student, linearize.schedules.target(0.25), total_steps=10).attach(opt)
    for step in range(10):
        x = torch.randn(0 if step == 0 else 64, 8)
        loss = nn.functional.mse_loss(student(x), teacher(x).detach(), reduction="sum")
        opt.zero_grad()
        loss.backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        messages = [str(w.message) for w in caught]
        if step == 0:
            assert any("held no position (empty batches)" in m for m in messages), messages
        assert not any("model.train()" in m for m in messages), messages
    slopes = torch.cat([u.slope.detach() for _, u in linearize.units(student)])
    assert float((slopes < 1).float().mean()) == 0.25


def test_resume_is_exact():
    teacher = _teacher()
    whole, _ = _user_loop(teacher, steps=40)
    _, first = _user_loop(teacher, steps=40, stop=17)
    resumed, _ = _user_loop(teacher, steps=40, state=first["saved"])
    for (name, a), (_, b) in zip(linearize.units(whole), linearize.units(resumed)):
        assert torch.equal(a.slope, b.slope), name
        assert torch.equal(a.alpha, b.alpha) and torch.equal(a.beta, b.beta), name
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("split", [5, 17])
@pytest.mark.parametrize("optimizer_built", ["before the load", "after the load"])
def test_resume_is_exact_when_the_weights_moved_since_the_fit_began(split, optimizer_built):
    """The fit's selection weighs each channel's residual by its outgoing weight norm, measured at the fit's
    first step. A resumed run (the state through JSON, as checkpoints store it) must use those norms, not the
    norms of the weights at the resume: at a large learning rate they differ, and so do the channels chosen.
    The resumed optimizer is built before or after ``model.load_state_dict`` (as the HF Trainer does): the
    affine ends the Sparsifier made after the first optimizer existed are in neither (after the load they came
    back as parameters, and ``opt.load_state_dict`` failed on the parameter count)."""
    import json

    def make(attach: bool = True, optimizer: bool = True) -> tuple[nn.Module, torch.optim.Optimizer | None,
                                                                   linearize.Sparsifier]:
        torch.manual_seed(0)
        model = linearize.convert(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(),
                                                nn.Linear(16, 1)), example_inputs=torch.randn(2, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer else None
        sp = linearize.Sparsifier(model, linearize.schedules.target(0.25, start=0.2, end=0.7), total_steps=40)
        return model, opt, sp.attach(opt) if attach else sp

    def train(model, opt, steps: range) -> None:
        for i in steps:
            g = torch.Generator().manual_seed(1000 + i)
            x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
            opt.zero_grad()
            (model(x) - y).square().mean().backward()
            opt.step()

    whole, opt, sp = make()
    assert sp.select == "fit"
    train(whole, opt, range(40))
    first, opt, sp = make()
    train(first, opt, range(split))
    saved = copy.deepcopy({"model": first.state_dict(), "optimizer": opt.state_dict(),
                           "sparsifier": json.loads(json.dumps(sp.state_dict()))})
    assert "1.alpha" in saved["model"]  # the Sparsifier made the ends at its first step
    resumed, opt, sp = make(attach=False, optimizer=optimizer_built == "before the load")
    resumed.load_state_dict(saved["model"])
    opt = opt or torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    opt.load_state_dict(saved["optimizer"])
    sp.load_state_dict(saved["sparsifier"])
    sp.attach(opt)  # after the load (as documented)
    train(resumed, opt, range(split, 40))
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)  # frozen: NaN where free
