"""Invariants every zoo model (tests/zoo.py) keeps, in every mode it supports (the PEFT common-tester
pattern): exact at init, save/load round trip, independent deep copies, training flags kept, fold
equal to the unfolded model after freeze, and every data form read alike.

Truths: the original model's outputs (float64), the outputs before a save or a copy, pre-activations
recorded by this file's own hooks; never a linearize function compared with itself.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import linearize
from linearize.gated import gate_statistics
from linearize.measures import average_path_length
from zoo import ZOO, Entry, call, to_double

pytestmark = pytest.mark.usefixtures("one_thread")

GATED = [name for name, e in ZOO.items() if e.gated]
EXACT_DGN = {"mode": "dgn", "init": "copy", "hard_gates": True, "value_input": "x"}  # computes the original


def _convert(entry: Entry, mode: str, model: nn.Module | None = None, double: bool = False, **kw) -> nn.Module:
    model = entry.build() if model is None else model
    x = entry.inputs()
    if double:
        model, x = model.double(), to_double(x)
    return linearize.convert(model, example_inputs=x, mode=mode, **kw)


def _random_slopes(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.copy_(torch.rand(u.num_channels, generator=g))


def _matrix(names=ZOO) -> list:
    return [pytest.param(mode, n, id=f"{mode}-{n}") for mode in ("prelu", "dgn") for n in names
            if mode == "prelu" or ZOO[n].gated]


# ----------------------------------------------------------------------------- exact at init


@pytest.mark.parametrize("mode, name", _matrix())
def test_exact_at_init(mode, name):
    """Float64: the converted model computes the original bit for bit; it has sites, and they matter."""
    entry = ZOO[name]
    original = entry.build().double()
    x = to_double(entry.inputs())
    ref = call(original, x)
    model = linearize.convert(copy.deepcopy(original), example_inputs=x,
                              **(EXACT_DGN if mode == "dgn" else {"mode": mode}))
    assert torch.equal(call(model, x), ref)
    if mode == "prelu":
        assert linearize.units(model)
        with torch.no_grad():
            for _, u in linearize.units(model):
                u.slope.fill_(1.0)
        assert not torch.allclose(call(model, x), ref)  # the units can change the output: this test can fail
    else:
        assert model.gates()


@pytest.mark.parametrize("name", [n for n in ZOO if not ZOO[n].gated])
def test_dgn_refuses_models_without_gatable_modules(name):
    """Gated splits gate ReLU-family activation modules; smooth activations (BERT, GPT-2) and functional
    calls leave nothing to gate: a ValueError, not a wrong model."""
    with pytest.raises(ValueError):
        _convert(ZOO[name], "dgn")


# ----------------------------------------------------------------------------- save, load, copy


@pytest.mark.parametrize("mode, name", _matrix())
def test_save_load_round_trip(mode, name, tmp_path):
    """``save_pretrained`` then ``from_pretrained`` on a freshly built model gives the same function as the
    trained one (random slopes; for dgn the re-initialized feature network), not the original's."""
    entry = ZOO[name]
    x = entry.inputs()
    original = call(entry.build(), x)
    model = _convert(entry, mode)
    _random_slopes(model)
    if mode == "dgn":
        with torch.no_grad():
            for p in model.value.parameters():
                p.add_(0.05 * torch.randn_like(p))  # a trained value network
    ref = call(model, x)
    assert not torch.allclose(ref, original, atol=1e-4)  # the state to restore is not the original's
    linearize.save_pretrained(model, tmp_path)
    loaded = linearize.from_pretrained(entry.build(), tmp_path, example_inputs=x)
    assert torch.equal(call(loaded.eval(), x), ref)


@pytest.mark.parametrize("mode, name", _matrix())
def test_deepcopy_is_equal_and_independent(mode, name):
    entry = ZOO[name]
    x = entry.inputs()
    model = _convert(entry, mode)
    _random_slopes(model)
    ref = call(model, x)
    twin = copy.deepcopy(model)
    assert torch.equal(call(twin, x), ref)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
        for _, u in linearize.units(twin):
            u.slope.fill_(1.0)
    assert not torch.equal(call(twin, x), ref)
    assert torch.equal(call(model, x), ref)  # the original does not share the copy's tensors


# ----------------------------------------------------------------------------- training flags


def _odd_module(model: nn.Module) -> nn.Module:
    """The module to put in the other mode than the root: the first BatchNorm, else Dropout, else Linear."""
    for kind in (nn.modules.batchnorm._BatchNorm, nn.Dropout, nn.Linear):
        found = [m for m in model.modules() if isinstance(m, kind)]
        if found:
            return found[0]
    raise AssertionError(f"{type(model).__name__} has no BatchNorm, Dropout or Linear")


def _flags(model: nn.Module) -> dict[str, bool]:
    return {n: m.training for n, m in model.named_modules()}


@pytest.mark.parametrize("mode, name", _matrix())
def test_training_flags_are_kept(mode, name):
    """A model in train mode with one module (a BatchNorm where there is one) in eval mode keeps every
    flag through convert, average_path_length and report."""
    entry = ZOO[name]
    x = entry.inputs()
    model = entry.build().train()
    _odd_module(model).eval()
    before = _flags(model)
    converted = linearize.convert(model, example_inputs=x, mode=mode)
    nets = [converted] if mode == "prelu" else [converted.feature, converted.value]
    for net in nets:  # every module that was there keeps its flag (gated copies: by name)
        after = _flags(net)
        assert {n: after[n] for n in before if n in after} == {n: f for n, f in before.items() if n in after}
        assert sum(not f for f in after.values()) >= 1  # the odd one is still there
    assert converted.training
    before = _flags(converted)
    linearize.report(converted, x, segments=1, max_samples=4, progress=False)
    assert _flags(converted) == before
    if mode == "prelu":
        average_path_length(converted, x)
        assert _flags(converted) == before


# ----------------------------------------------------------------------------- fold


@pytest.mark.parametrize("name", list(ZOO))
def test_fold_after_freeze_equals_the_unfolded_model(name):
    """Slopes at random 0 / 1 (some at 1 - 1e-4, which freeze snaps to 1): the folded plain model computes
    the frozen unfolded model within 1e-5 of the output scale (both re-evaluated in float64)."""
    entry = ZOO[name]
    x = entry.inputs()
    model = _convert(entry, "prelu")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.copy_((torch.rand(u.num_channels, generator=g) < 0.5).float())
            u.slope[torch.rand(u.num_channels, generator=g) < 0.2] = 1 - 1e-4
    almost = {n: (u.slope == 1 - 1e-4).clone() for n, u in linearize.units(model)}
    linearize.freeze(model)
    for n, u in linearize.units(model):  # the definition: a >= 1 - tol becomes exactly 1, frozen
        assert torch.all(u.slope[almost[n]] == 1) and torch.all(u.frozen[almost[n]] == 1)
    folded = linearize.fold(model, x, latency=False)
    assert not any(isinstance(m, linearize.LinearizableActivation) for m in folded.modules())
    xd = to_double(x)
    ref = call(copy.deepcopy(model).double(), xd)
    out = call(copy.deepcopy(folded).double(), xd)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


# ----------------------------------------------------------------------------- data forms


def _forms(entry: Entry, model: nn.Module) -> dict:
    """The same 4 samples as a tensor, an (inputs, targets) pair, a dict of keyword inputs, a DataLoader."""
    x = entry.inputs()
    y = torch.arange(4)
    if isinstance(x, dict):  # token ids: the tensor is the first positional input
        (key, ids), = x.items()
        rows = [{key: ids[i]} for i in range(4)]
        return {"tensor": ids, "pair": (ids, y), "dict": x, "loader": DataLoader(rows, batch_size=3)}
    key = next(iter(inspect.signature(model.forward).parameters))
    return {"tensor": x, "pair": (x, y), "dict": {key: x}, "loader": DataLoader(TensorDataset(x, y), batch_size=3)}


def _preactivations(model: nn.Module, x) -> dict[str, torch.Tensor]:
    """Every unit's input on ``x``, recorded by forward pre-hooks (a unit called twice: concatenated)."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [u.register_forward_pre_hook(lambda m, a, n=n: seen.setdefault(n, []).append(a[0].detach().clone()))
               for n, u in linearize.units(model)]
    try:
        call(model, x)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


@pytest.mark.parametrize("form", ["tensor", "pair", "dict", "loader"])
@pytest.mark.parametrize("name", list(ZOO))
def test_every_data_form_gives_the_recorded_preactivations(name, form):
    """``stable_units(model, data)`` bounds are the min / max of the units' inputs over the 4 samples, and
    ``freeze(data=)`` freezes exactly the ReLU channels whose input is > 0 everywhere, in every form."""
    entry = ZOO[name]
    model = _convert(entry, "prelu")
    data = _forms(entry, model)[form]
    pre = _preactivations(model, entry.inputs())
    sites = linearize.stable_units(model, data).sites
    assert sites.keys() == pre.keys()
    for n, z in pre.items():  # batches of other sizes round differently: float32 rounding of the scale apart
        atol = 1e-6 * max(1.0, z.abs().max().item())
        torch.testing.assert_close(sites[n].lower.float(), z.amin(0), rtol=1e-5, atol=atol)
        torch.testing.assert_close(sites[n].upper.float(), z.amax(0), rtol=1e-5, atol=atol)
    linearize.freeze(model, data=data)
    for n, u in linearize.units(model):
        z = pre[n].movedim(u.channel_dim, 0).flatten(1)
        expected = (z > 0).all(1) if u.is_prelu else torch.zeros(u.num_channels, dtype=torch.bool)
        assert torch.equal(u.frozen == 1, expected), n


@pytest.mark.parametrize("form", ["tensor", "pair", "dict", "loader"])
@pytest.mark.parametrize("name", GATED)
def test_gate_statistics_read_every_data_form(name, form):
    """Hard gates of the exact DGN are on where the original ReLU's input is > 0: the fraction on per site."""
    entry = ZOO[name]
    gated = _convert(entry, "dgn", **{k: v for k, v in EXACT_DGN.items() if k != "mode"})
    stats = gate_statistics(gated, _forms(entry, gated.value)[form])
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [g.register_forward_pre_hook(lambda m, a, s=s: seen.setdefault(s, []).append(a[0]))
               for s, g in gated.gates()]
    try:
        call(gated, entry.inputs())  # init="copy", value_input="x": a GaLU's input z is its gate's q
    finally:
        for h in handles:
            h.remove()
    assert stats.keys() == seen.keys()
    for s, zs in seen.items():
        on = torch.cat([(z > 0).double().flatten() for z in zs]).mean().item()
        assert stats[s]["fraction_on"] == pytest.approx(on, abs=1e-12), s
