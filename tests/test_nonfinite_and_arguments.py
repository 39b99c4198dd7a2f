"""NaN/inf slopes never become a number, and arguments are validated.

Expected counts are worked out by hand from slopes set by the test; every entry point must agree
on them (one definition of a linear channel) and must raise, naming the unit, on a NaN/inf slope.
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

import linearize
from linearize import reporting
from linearize.cli import report as cli_report
from linearize.folding import FoldVerificationError
from linearize.measures import average_path_length
from linearize.unit import LinearizableActivation

NAN, INF = float("nan"), float("inf")


def two_units() -> nn.Sequential:
    """Units 'a' (4 channels) and 'b' (3) with slopes a = [1, 0.999, 0.5, 0], b = [1, 1, 0.2]."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(
        fc1=nn.Linear(3, 4), a=LinearizableActivation("relu", 4, -1),
        fc2=nn.Linear(4, 3), b=LinearizableActivation("relu", 3, -1), out=nn.Linear(3, 2),
    )).eval()
    with torch.no_grad():
        model.a.slope.copy_(torch.tensor([1.0, 0.999, 0.5, 0.0]))
        model.b.slope.copy_(torch.tensor([1.0, 1.0, 0.2]))
    return model


# ----------------------------------------------------------------------------- one definition


def test_every_count_agrees_with_hand_counts_and_none_counts_nan():
    model = two_units()
    # tol = 0: linear a[0], b[0], b[1] -> 4 of 7 nonlinear; tol = 0.01 adds a[1] -> 3 of 7
    counts = linearize.count_units(model)
    assert (counts["nonlinear"], counts["linear"]) == (4, 3)
    assert (counts["sites"]["a"]["nonlinear"], counts["sites"]["b"]["nonlinear"]) == (3, 1)
    assert linearize.count_units(model, tol=0.01)["nonlinear"] == 3
    assert linearize.nonlinear_fraction(model) == pytest.approx(4 / 7)
    sp = linearize.Sparsifier(model, total_steps=10, lr=0.1)
    assert sp.nonlinear_fraction() == pytest.approx(4 / 7)
    assert sp.linear_units() == 3
    # path length of a chain: sum over units of nonlinear / width = 3/4 + 1/3
    apl = average_path_length(model, torch.randn(2, 3), tol=0.0)
    assert apl == pytest.approx(3 / 4 + 1 / 3)
    _poison(model)  # before: the Sparsifier said 3/7 (NaN counted linear), count_units 4/7 (nonlinear)
    for count in (linearize.count_units, linearize.nonlinear_fraction, lambda m: sp.nonlinear_fraction(),
                  lambda m: sp.linear_units()):
        with pytest.raises(ValueError, match="non-finite slopes"):
            count(model)


def _poison(model: nn.Module, value: float = NAN) -> nn.Module:
    with torch.no_grad():
        model.b.slope[1] = value
    return model


ENTRY_POINTS = {
    "count_units": lambda m: linearize.count_units(m),
    "nonlinear_fraction": lambda m: linearize.nonlinear_fraction(m),
    "Sparsifier.nonlinear_fraction": lambda m: linearize.Sparsifier(m, total_steps=4, lr=0.1).nonlinear_fraction(),
    "Sparsifier.linear_units": lambda m: linearize.Sparsifier(m, total_steps=4, lr=0.1).linear_units(),
    "freeze": lambda m: linearize.freeze(m),
    "fold": lambda m: linearize.fold(m, torch.randn(5, 3), latency=False),
    "average_path_length": lambda m: average_path_length(m, torch.randn(2, 3)),
    "stable_units (data)": lambda m: linearize.stable_units(m, torch.randn(8, 3)),
    "stable_units (box)": lambda m: linearize.stable_units(m, linearize.Box(torch.zeros(3), torch.ones(3))),
    "report": lambda m: linearize.report(m, torch.randn(8, 3), progress=False, skip=["affinity", "regions"]),
}


@pytest.mark.parametrize("value", [NAN, INF])
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_nonfinite_slope_raises_naming_the_unit(entry, value):
    model = _poison(two_units(), value)
    with pytest.raises(ValueError, match=r"non-finite slopes in 1 unit\(s\): 'b' \(\d NaN, \d inf of 3 channels\)"):
        ENTRY_POINTS[entry](model)
    if value != value:  # NaN: nothing above rewrote it
        assert math.isnan(model.b.slope[1].item())


def test_unit_linear_mask_refuses_nan():
    model = _poison(two_units())
    with pytest.raises(ValueError, match=r"non-finite slopes in 1 unit\(s\): '<relu unit>'"):
        model.b.linear_mask()
    assert model.a.linear_mask().tolist() == [True, False, False, False]


def test_sparsifier_step_raises_and_logs_no_number_after_divergence():
    model = two_units()
    linearize.freeze(model, tol=0.01)  # frozen channels (the buffer holds NaN for free ones) are no divergence
    assert linearize.count_units(model)["nonlinear"] == 3  # a[1] = 0.999 snapped to 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sp = linearize.Sparsifier(model, linearize.schedules.target(0.5, start=0, end=0.5), total_steps=10,
                              lam=0.1, log_every=1).attach(opt)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    assert len(sp.history) == 1
    logged = list(sp.history)
    _poison(model)
    with pytest.raises(ValueError, match=r"Sparsifier\.step.*non-finite slopes.*'b'") as raised:
        opt.step()  # the attached hook runs Sparsifier.step
    assert isinstance(raised.value, linearize.NonFiniteSlopeError)
    assert sp.history == logged  # no NaN counted as linear (0.0) in the history
    assert math.isnan(model.b.slope[1].item())  # the target projection did not set it to 1.0


def one_finite_default_step(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    """The default loop (AdamW, a fraction target: the fit tracker records the units' inputs) after one finite
    step on a batch of 8: the optimizer and that batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sp = linearize.Sparsifier(model, linearize.schedules.target(0.5), total_steps=10).attach(opt)
    assert sp.select == "fit"
    x = torch.randn(8, 3)
    model(x).sum().backward()
    opt.step()
    return opt, x


@pytest.mark.parametrize("poisoned, named", [
    ("input", r"unit 'a', the first, NaN/inf inputs \(1 position\): the batch held them \(check the data\)"),
    ("weight", r"unit 'b' NaN/inf inputs \(8 positions\), where unit 'a' before it got finite ones: they arose "
               r"between the two, in the weights fc2.weight, which hold NaN/inf that this step's gradients did not "
               r"write"),
    ("gradient", r"Training diverged \(a NaN/inf loss or gradient reached the slopes\).*lower the learning rate")])
def test_the_divergence_error_names_where_nan_entered_the_forward(poisoned, named):
    """The default loop (AdamW, a fraction target: the fit tracker records the units' inputs). One NaN in the
    batch, or in a weight loaded from a damaged checkpoint, made every gradient NaN and was reported as a
    divergence to fix by lowering the learning rate. Truth: where the test put the NaN. A NaN gradient after a
    finite forward still gets the divergence's advice."""
    model = two_units().train()
    opt, x = one_finite_default_step(model)
    with torch.no_grad():
        if poisoned == "input":
            x[2, 1] = NAN
        elif poisoned == "weight":
            model.fc2.weight[1, 0] = NAN
    opt.zero_grad()
    model(x).sum().backward()
    if poisoned == "gradient":
        model.a.slope.grad[1] = NAN
    with pytest.raises(linearize.NonFiniteSlopeError, match=named) as raised:
        opt.step()
    assert ("lower the learning rate" in str(raised.value)) == (poisoned == "gradient")


@pytest.mark.parametrize("optimizer, select", [(torch.optim.SGD, "auto"), (torch.optim.AdamW, "saliency"),
                                               (torch.optim.AdamW, "slope")])
@pytest.mark.parametrize("batch", [0, 3])
def test_a_nan_in_the_batch_is_named_whatever_the_selection(optimizer, select, batch):
    """Only the fit tracker (select='fit', the AdamW default) recorded the units' NaN/inf inputs: under the SGD
    defaults or select='saliency' one NaN in the batch was reported as a divergence to fix by lowering the
    learning rate. Truth: the test put the NaN in sample 2 of the batch of step ``batch``."""
    model = two_units().train()
    opt = optimizer(model.parameters(), lr=1e-3)
    sp = linearize.Sparsifier(model, linearize.schedules.target(0.5), total_steps=10, select=select).attach(opt)
    torch.manual_seed(1)
    for step in range(batch + 1):
        x = torch.randn(8, 3)
        if step == batch:
            x[2, 1] = NAN
        opt.zero_grad()
        model(x).sum().backward()
        if step < batch:
            opt.step()
    assert sp.select != "fit"
    with pytest.raises(linearize.NonFiniteSlopeError,
                       match=r"unit 'a', the first, NaN/inf inputs \(1 position\): the batch held them") as raised:
        opt.step()
    assert "lower the learning rate" not in str(raised.value)


class RunsInAnotherOrder(nn.Module):
    """``l2, a2`` are registered before ``l1, a1`` but run after them."""

    def __init__(self) -> None:
        super().__init__()
        self.l2, self.a2 = nn.Linear(6, 6), nn.ReLU()
        self.l1, self.a1 = nn.Linear(3, 6), nn.ReLU()
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.a2(self.l2(self.a1(self.l1(x)))))


@pytest.mark.parametrize("poisoned, named", [
    ("l1", r"unit 'a1', the first, NaN/inf inputs \(8 positions\) from a finite batch: they arose before it, in "
           r"the weights l1.weight, which hold NaN/inf that this step's gradients did not write"),
    ("l2", r"unit 'a2' NaN/inf inputs \(8 positions\), where unit 'a1' before it got finite ones: they arose "
           r"between the two, in the weights l2.weight, which hold NaN/inf that this step's gradients did not")])
def test_the_divergence_error_names_where_nan_entered_in_the_order_the_forward_ran(poisoned, named):
    """The units and layers named were taken in registration order: a NaN weight in l1 (registered after l2,
    run before it) was reported as reaching a2 first, from the batch or l2, never naming l1. Now they are taken
    in the order the forward ran them. Truth: where the test put the NaN."""
    torch.manual_seed(0)
    model = linearize.convert(RunsInAnotherOrder(), example_inputs=torch.randn(4, 3)).train()
    opt, x = one_finite_default_step(model)
    with torch.no_grad():
        getattr(model, poisoned).weight[:] = NAN
    opt.zero_grad()
    model(x).sum().backward()
    with pytest.raises(linearize.NonFiniteSlopeError, match=named):
        opt.step()


def test_nan_weights_written_by_an_optimizer_step_are_not_blamed_on_the_finite_batch():
    """The optimizer wrote NaN into fc1's weights (float16 AdamW's eps underflows: here set by the test after a
    finite step); the next forward fed unit 'a' NaN from a finite batch, and the error said 'the batch held them
    (check the data)', 'the learning rate is not the cause'. Truth: the batch is finite, fc1.weight is NaN."""
    model = two_units().train()
    opt, x = one_finite_default_step(model)
    with torch.no_grad():
        model.fc1.weight[0, 0] = NAN  # what the step wrote
    assert bool(torch.isfinite(x).all())
    opt.zero_grad()
    model(x).sum().backward()
    with pytest.raises(linearize.NonFiniteSlopeError, match=r"unit 'a', the first, NaN/inf inputs \(8 positions\) "
                       r"from a finite batch: they arose before it, in the weights fc1.weight, which hold NaN/inf "
                       r"that this step's gradients did not write.*an earlier optimizer step that wrote NaN/inf") \
            as raised:
        opt.step()
    assert "check the data" not in str(raised.value)


class DivideByZero(nn.Module):
    """No parameters: divides by zero (NaN/inf) once ``bad`` is set, else the identity."""

    bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.zeros_like(x) if self.bad else x


@pytest.mark.parametrize("trained", ["all", "frozen"])
@pytest.mark.parametrize("poisoned", ["head", "op", "between"])
def test_the_divergence_error_names_the_layer_or_operation_that_made_nan(poisoned, trained):
    """Two cases were blamed on the wrong place: a NaN weight in the head (after the last unit) got 'training
    diverged, lower the learning rate'; NaN made by the parameter-less module '3' between units '1' and '4'
    got 'in '2': non-finite weights there', whose weights were finite. Truth: what the test poisoned at step 2
    ('5.weight', the module '3', or '2.weight'). With every layer trained the step's NaN gradients overwrite
    the weights before the check, so both candidates are named; with the layers frozen (their weights not
    written by the step) only the poisoned one is."""
    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), DivideByZero(),
                                            nn.ReLU(), nn.Linear(16, 3)))
    if trained == "frozen":
        model[2].requires_grad_(False), model[5].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    linearize.Sparsifier(model, linearize.schedules.target(0.5, start=0.0, end=0.5), total_steps=10).attach(opt)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                if poisoned == "head":
                    model[5].weight[0, 0] = NAN
                elif poisoned == "between":
                    model[2].weight[0, 0] = NAN
            model[3].bad = poisoned == "op"
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if step < 2:
            opt.step()
    with pytest.raises(linearize.NonFiniteSlopeError) as raised:
        opt.step()
    message = str(raised.value)
    assert "lower the learning rate" not in message
    if poisoned == "head":
        assert "fed every unit finite inputs but the gradients hold NaN/inf: they arose after the last unit '4'" \
            in message and "or in the loss" in message and "'2'" not in message
        assert ("in the weights 5.weight, which hold NaN/inf that this step's gradients did not write"
                if trained == "frozen" else "in the weights of '5' if they held NaN/inf") in message
        return
    assert "where unit '1' before it got finite ones: they arose between the two" in message and "'5'" not in message
    if trained == "all":  # both candidates, the weights of '2' not claimed non-finite
        assert "an operation without parameters (x / 0, the log of a negative number, an overflow), e.g. in '3', " \
               "or in the weights of '2' if they held NaN/inf in that forward" in message
    elif poisoned == "op":
        assert "no layer with parameters there ('2') holds NaN/inf: an operation without parameters (x / 0, the " \
               "log of a negative number, an overflow), e.g. in '3' produced them" in message
    else:
        assert "in the weights 2.weight, which hold NaN/inf" in message and "'3'" not in message


def test_infinite_slope_is_not_projected_to_one():
    model = _poison(two_units(), INF)
    linearize.project_slopes(model)  # what the global optimizer hook runs after every step
    b = model.b.slope.detach().tolist()
    assert math.isnan(b[1])  # still non-finite, not clamped to exactly 1
    assert b[0] == 1.0 and b[2] == pytest.approx(0.2)  # finite ones untouched
    with pytest.raises(linearize.NonFiniteSlopeError):
        linearize.count_units(model)


# ----------------------------------------------------------------------------- tol


BAD_TOLS = [-0.1, 1.0, 2.0, NAN]


@pytest.mark.parametrize("tol", BAD_TOLS)
@pytest.mark.parametrize("call", [
    lambda m, t: linearize.count_units(m, t),
    lambda m, t: linearize.nonlinear_fraction(m, t),
    lambda m, t: linearize.report(m, torch.randn(8, 3), tol=t, progress=False),
    lambda m, t: average_path_length(m, torch.randn(2, 3), tol=t),
    lambda m, t: m.a.linear_mask(t),
], ids=["count_units", "nonlinear_fraction", "report", "average_path_length", "linear_mask"])
def test_tol_outside_its_range_is_refused(call, tol):
    with pytest.raises(ValueError, match="tol must"):
        call(two_units(), tol)


def _report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="linearize")
    cli_report.register_cli(parser.add_subparsers())
    return parser


@pytest.mark.parametrize("flag,value", [("--tol", "2"), ("--tol", "-1"), ("--tol", "nan"), ("--batch-size", "0"),
                                        ("--batch-size", "-3"), ("--num-samples", "1"), ("--max-length", "0")])
def test_cli_refuses_out_of_range_numbers(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _report_parser().parse_args(["report", "resnet18", "--data", "digits", flag, value])
    assert exit_info.value.code == 2  # an argparse usage error, not a traceback later
    assert flag in capsys.readouterr().err


def test_report_refuses_bad_sizes():
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        linearize.report(two_units(), torch.randn(8, 3), batch_size=0, progress=False)
    with pytest.raises(ValueError, match="max_samples"):
        linearize.report(two_units(), torch.randn(8, 3), max_samples=1, progress=False)


# ----------------------------------------------------------------------------- history


@pytest.mark.parametrize("text,why", [
    ("{not json", "not valid JSON"),
    ('{"history": [{"step": 1, "sites": {"a": NaN}}]}', "not a fraction"),
    ('{"history": [{"step": 1, "sites": {"a": 0.5}, "nonlinear_fraction": 3}]}', "not a fraction"),
    ('{"history": [{"sites": {"a": 0.5}}]}', "no 'step' key"),
    ('{"history": []}', "is empty"),
])
def test_corrupt_history_fails_before_any_measure_naming_the_file(tmp_path, monkeypatch, text, why):
    path = tmp_path / "my_history.json"
    path.write_text(text)

    def no_measure(*args, **kwargs):
        raise AssertionError("a measure ran before the history was checked")

    monkeypatch.setattr(reporting, "_check_finite", no_measure)
    with pytest.raises(ValueError, match=f"my_history.json.*{why}"):
        linearize.report(two_units(), torch.randn(8, 3), history=path, progress=False)


# ----------------------------------------------------------------------------- conversion


def fourteen_layers() -> nn.Sequential:
    """Linear layers at 0, 2, ..., 14 and ReLUs at 1, 3, ..., 13."""
    layers = []
    for _ in range(7):
        layers += [nn.Linear(4, 4), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(4, 2))


def test_a_string_pattern_is_one_pattern_not_its_characters():
    model = linearize.convert(fourteen_layers(), target_modules="13", example_inputs=torch.randn(2, 4))
    assert [n for n, _ in linearize.units(model)] == ["13"]
    model = linearize.convert(fourteen_layers(), exclude_modules="13", example_inputs=torch.randn(2, 4))
    assert [n for n, _ in linearize.units(model)] == ["1", "3", "5", "7", "9", "11"]
    with pytest.raises(ValueError, match=r"target_modules pattern '\(' is not a valid regular expression"):
        linearize.LinearizeConfig(target_modules="(")


def test_channel_dim_is_checked_against_the_input():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="batch dimension"):
        linearize.convert(fourteen_layers(), channel_dim=0, example_inputs=x)
    with pytest.raises(ValueError, match=r"channel_dim=2 is out of range for the 2-dim input at activation '1'"):
        linearize.convert(fourteen_layers(), channel_dim=2, example_inputs=x)
    with pytest.raises(ValueError, match="batch dimension"):
        LinearizableActivation("relu", 4, channel_dim=0)
    model = linearize.convert(fourteen_layers(), channel_dim=-1, example_inputs=x)
    assert all(u.num_channels == 4 for _, u in linearize.units(model))


def test_config_refuses_nan_beta():
    with pytest.raises(ValueError, match="beta"):
        linearize.LinearizeConfig(mode="dgn", beta=NAN)  # beta is a gated option (a TypeError for "prelu")


# ----------------------------------------------------------------------------- fold and compress


def test_fold_refuses_empty_batches_and_bad_tolerances():
    model = two_units()
    with pytest.raises(ValueError, match="empty batch"):
        linearize.fold(model, torch.randn(0, 3), latency=False)
    for kwargs in ({"rtol": NAN}, {"rtol": 0.0}, {"rtol": INF}, {"atol": NAN}, {"atol": -1.0}):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=name):
            linearize.fold(model, torch.randn(4, 3), latency=False, **kwargs)


def test_fold_names_nan_outputs_instead_of_the_tolerance():
    model = two_units()
    with torch.no_grad():
        model.out.bias[0] = NAN
    with pytest.raises(ValueError, match="own output .* NaN/inf"):
        linearize.fold(model, torch.randn(4, 3), latency=False)


def _mlp() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2)).eval()


def test_compress_raises_the_fold_verification_error():
    model = _mlp()
    narrow = torch.rand(100, 2) * 0.1
    with pytest.raises(FoldVerificationError, match="not lossless"):  # as fold, not a bare RuntimeError
        linearize.compress(model, narrow, data=torch.randn(100, 2) * 5)


def test_compress_refuses_nan_outputs_and_bad_arguments():
    model = _mlp()
    box = linearize.Box(torch.zeros(2), torch.ones(2))
    with torch.no_grad():
        model[2].bias[0] = NAN  # a NaN difference must not pass as "lossless"
    with pytest.raises(ValueError, match="own output has NaN/inf"):
        linearize.compress(model, box)
    for kwargs in ({"rtol": NAN}, {"rank_tol": -1.0}, {"samples": 0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            linearize.compress(_mlp(), box, **kwargs)


def test_stable_units_refuses_nan_prelu_weights():
    model = nn.Sequential(nn.Linear(2, 3), nn.PReLU(3), nn.Linear(3, 1)).eval()
    with torch.no_grad():
        model[1].weight[0] = NAN
    with pytest.raises(ValueError, match="'1' .* NaN/inf negative slopes"):
        linearize.stable_units(model, linearize.Box(torch.zeros(2), torch.ones(2)))


# ----------------------------------------------------------------------------- Sparsifier


def test_one_optimizer_takes_one_sparsifier():
    model = two_units()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = linearize.Sparsifier(model, total_steps=10).attach(opt)
    with pytest.raises(RuntimeError, match="another Sparsifier is already attached"):
        linearize.Sparsifier(model, total_steps=10).attach(opt)
    with pytest.raises(RuntimeError, match="already attached"):
        first.attach(opt)
    first.detach()
    second = linearize.Sparsifier(model, total_steps=10).attach(opt)  # allowed once the first let go
    assert second._hook is not None


def test_sparsifier_refuses_bad_lr_and_log_every():
    for kwargs in ({"lr": NAN}, {"lr": -0.1}, {"log_every": 0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            linearize.Sparsifier(two_units(), total_steps=10, **kwargs)


# ----------------------------------------------------------------------------- inputs that do not fit the model


def _gelu_mlp(act: type[nn.Module] = nn.GELU) -> nn.Module:
    torch.manual_seed(1)
    return linearize.convert(nn.Sequential(nn.Linear(16, 64), act(), nn.Linear(64, 4)))


SEVEN = torch.randn(2, 7)  # the model takes 16 features
BOX = linearize.Box(-torch.ones(7), torch.ones(7))
_target = linearize.schedules.target


@pytest.mark.parametrize("call, named", [
    (lambda: linearize.fold(_gelu_mlp().eval(), SEVEN), "example_inputs"),
    (lambda: linearize.Sparsifier(_gelu_mlp(), _target(relus=10), total_steps=10, example_inputs=SEVEN),
     "example_inputs"),
    (lambda: linearize.Sparsifier(_gelu_mlp(), _target(0.5), total_steps=10, weights="flops", example_inputs=SEVEN),
     "example_inputs"),
    (lambda: linearize.Sparsifier(_gelu_mlp(), _target(0.5), total_steps=10, weights="latency",
                                  example_inputs=SEVEN), "example_inputs"),
    (lambda: linearize.measures.count_relus(_gelu_mlp(), SEVEN), "example_inputs"),
    (lambda: linearize.convert(nn.Sequential(nn.Linear(16, 64), nn.GELU()), example_inputs=SEVEN), "example_inputs"),
    (lambda: linearize.one_shot(_gelu_mlp(), SEVEN, target=0.25), "data batch"),
    (lambda: linearize.fit_linear_ends(_gelu_mlp(), SEVEN), "data batch"),
    (lambda: linearize.measures.affinity_signature(_gelu_mlp(), SEVEN, progress=False), "inputs batch"),
    (lambda: linearize.measures.average_path_length(_gelu_mlp(), SEVEN, method="record"), "example_inputs"),
    (lambda: linearize.report(_gelu_mlp(), SEVEN), "data batch"),
    (lambda: linearize.stable_units(_gelu_mlp(nn.ReLU).eval(), SEVEN), "data batch"),
    (lambda: linearize.stable_units(_gelu_mlp(nn.ReLU).eval(), BOX), "Box bounds"),
    (lambda: linearize.compress(_gelu_mlp(nn.ReLU).eval(), BOX), "Box bounds"),
], ids=["fold", "relus", "weights-flops", "weights-latency", "count_relus", "convert", "one_shot", "fit_linear_ends",
        "affinity_signature", "average_path_length", "report", "stable_units-data", "stable_units-box", "compress"])
def test_inputs_that_do_not_fit_the_model_are_named_with_the_fix(call, named):
    """Only fold and cost targets named the argument: elsewhere a batch of the wrong shape raised torch's raw
    'mat1 and mat2 shapes cannot be multiplied' from deep inside the forward. Truth: the model takes 16
    features, the inputs have 7."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=rf"^{named} .*7.* do not fit the model \(RuntimeError: mat1 and mat2 "
                                             r"shapes cannot be multiplied.*\); pass "):
            call()


@pytest.mark.parametrize("case", ["float16 weights", "huge learning rate"])
def test_nonfinite_weights_are_reported_at_the_optimizer_step_that_wrote_them(case):
    """An optimizer step that overflows the weights (float16 weights under a large update; a huge learning rate)
    while the slopes stay finite was reported one step later, when the next forward had made every slope and
    gradient NaN. Truth: the weights themselves, finite before the step that raises and not finite after it."""
    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)))
    half = case == "float16 weights"
    if half:  # the layers in float16, the slopes float32 (as the docs advise)
        model[0].half(), model[2].half()
    weights = [p for name, p in model.named_parameters() if "slope" not in name]
    opt = torch.optim.SGD([{"params": weights, "lr": 1e-3}, {"params": [model[1].slope], "lr": 1e-3}])
    sp = linearize.Sparsifier(model, linearize.schedules.target(0.5), total_steps=10).attach(opt)
    x = torch.randn(16, 3, dtype=torch.float16 if half else torch.float32)
    for step in range(4):
        if step == 2:  # this step's update overflows the weights
            for group in opt.param_groups[:1] if half else opt.param_groups:
                group["lr"] = 6e4 if half else 3e38
        opt.zero_grad()
        (100 * model(x).float().square().mean()).backward()
        finite = bool(torch.isfinite(model[0].weight).all())
        if step < 2:
            opt.step()
            continue
        with pytest.raises(linearize.NonFiniteSlopeError, match=r"Sparsifier\.step \(step 2\).*'0\.weight'"):
            opt.step()
        break
    assert finite and not bool(torch.isfinite(model[0].weight).all()) and sp.step_count == 2
    if half:
        assert bool(torch.isfinite(model[1].slope).all())  # the slopes stayed finite: only the weights tell
