"""One data protocol (linearize.inputs): every public function that takes data reads every form the
same way, and no function leaves a module's train/eval flag changed.

Truth: the same samples as one plain tensor, and for freeze, stable_units, affinity_signature and
gate_statistics the quantity itself computed directly from the first layer's pre-activations.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import linearize
from linearize.gated import gate_statistics
from linearize.inputs import Batches, call_model, eval_mode, hooks
from linearize.measures import affinity_score, affinity_signature, average_path_length
from linearize.inputs import max_difference

pytestmark = pytest.mark.usefixtures("one_thread")

N = 24
X = torch.randn(N, 4, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(2))
CUTS = [(0, 7), (7, 16), (16, N)]


class _Dicts(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"input": X[i]}


FORMS = {
    "tensor": lambda: X,
    "array": lambda: X.numpy(),
    "pair": lambda: (X, Y),
    "single": lambda: (X,),
    "dict": lambda: {"input": X},  # nn.Sequential.forward(input)
    "list": lambda: [X[a:b] for a, b in CUTS],
    "list_of_pairs": lambda: [(X[a:b], Y[a:b]) for a, b in CUTS],
    "list_of_dicts": lambda: [{"input": X[a:b]} for a, b in CUTS],
    "loader": lambda: DataLoader(TensorDataset(X, Y), batch_size=5),
    "dict_loader": lambda: DataLoader(_Dicts(), batch_size=10),
    "generator": lambda: ((X[a:b], Y[a:b]) for a, b in CUTS),
    "batches": lambda: Batches.of(DataLoader(TensorDataset(X, Y), batch_size=6)),
}


def _mlp() -> nn.Sequential:
    """Converted MLP whose first layer has 3 stably active and 2 stably inactive channels on X."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        net[0].bias[:3] = 10.0
        net[0].bias[3:5] = -10.0
    return linearize.convert(net, example_inputs=X[:2])


def _preact(model: nn.Sequential) -> torch.Tensor:
    with torch.no_grad():
        return model[0](X)


# ----------------------------------------------------------------------------- each function


def _freeze(data):
    model = _mlp()
    summary = linearize.freeze(model, data=data)
    return summary.sites, model[1].slope.detach().clone(), model[1].frozen.clone()


def _stable_units(data):
    res = linearize.stable_units(_mlp(), data)
    return {n: (s.lower, s.upper, s.active, s.inactive) for n, s in res.sites.items()}


def _compress(data):
    model = _mlp()
    small = linearize.compress(model, data)
    rep = small.compression_report
    with torch.no_grad():
        out = small(X)
    return (rep.units_before, rep.units_after, rep.removed_inactive, rep.verified_samples), out


def _affinity(data):
    return affinity_signature(_mlp(), data, progress=False)


def _gates(data):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    gated = linearize.convert(net, mode="dgn", example_inputs=X[:2])
    return gate_statistics(gated, data), gated


def _report(data):
    rep = linearize.report(_mlp(), data, segments=3, progress=False)
    return rep.num_samples, rep.units, rep.path_length, rep.affinity, rep.regions


FUNCTIONS = {
    "freeze": _freeze, "stable_units": _stable_units, "compress": _compress, "affinity": _affinity,
    "gate_statistics": _gates, "report": _report,
}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    if isinstance(a, float):
        return a == pytest.approx(b, rel=1e-6, abs=1e-9)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(u, v) for u, v in zip(a, b))
    return a == b


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("function", FUNCTIONS)
def test_every_data_form_gives_the_plain_tensor_result(function, form):
    if function == "compress" and "dict" in form:
        pytest.skip("compress runs an nn.Sequential on one input tensor: keyword inputs do not apply")
    if function == "gate_statistics":
        got, ref = FUNCTIONS[function](FORMS[form]())[0], FUNCTIONS[function](X)[0]
    else:
        got, ref = FUNCTIONS[function](FORMS[form]()), FUNCTIONS[function](X)
    if function == "report" and "dict" in form:  # regions need one input tensor: skipped for kwargs
        got, ref = got[:-1], ref[:-1]
    assert _equal(got, ref)


def test_the_plain_tensor_results_match_the_definitions():
    z = _preact(_mlp())
    active = (z > 0).all(0)
    assert active.sum() == 3 and (z <= 0).all(0).sum() == 2
    sites, slope, frozen = _freeze(X)
    assert sites["1"]["stably_active"] == 3 and torch.equal(frozen == 1, active)
    site = linearize.stable_units(_mlp(), X).sites["1"]
    assert torch.equal(site.lower.float(), z.amin(0)) and torch.equal(site.upper.float(), z.amax(0))
    ((name, score),) = _affinity(X)
    assert name == "1" and score == pytest.approx(affinity_score(z, z.relu()), rel=1e-9)
    stats, gated = _gates(X)
    with torch.no_grad():
        on = gated.feature[0](X) > 0
    assert stats["1"]["fraction_on"] == pytest.approx(on.double().mean().item(), abs=1e-12)
    assert stats["1"]["always_on"] == int(on.all(0).sum()) and stats["1"]["always_off"] == int((~on).all(0).sum())
    assert _report(X)[0] == N


# ----------------------------------------------------------------------------- Batches and helpers


def test_batches_read_a_generator_once_and_replay_it():
    gen = ((X[a:b], Y[a:b]) for a, b in CUTS)
    data = Batches.of(gen)
    first = next(iter(data))  # a pass that stops early, then full passes
    assert torch.equal(first, X[:7])
    assert len(data) == 3 and data.num_samples == N
    assert torch.equal(torch.cat(list(data)), X) and torch.equal(data.concat(), X)
    assert [b.shape[0] for b in data.split(4)] == [4, 3, 4, 4, 1, 4, 4]
    assert [b.shape[0] for b in data.limit(samples=10)] == [7, 3]
    assert [b.shape[0] for b in data.limit(batches=2)] == [7, 9]
    assert Batches.of(data) is data


def test_batch_inputs_keep_positional_args_and_drop_targets():
    a, b = torch.randn(3, 2), torch.randn(3, 2)
    assert [tuple(t.shape) for t in next(iter(Batches.of(((a, b), Y[:3]))))] == [(3, 2), (3, 2)]
    sliced = Batches.of([{"input": X, "scale": torch.tensor(2.0)}]).split(10)
    assert [(d["input"].shape[0], float(d["scale"])) for d in sliced] == [(10, 2.0), (10, 2.0), (4, 2.0)]
    assert torch.equal(call_model(nn.Identity(), {"input": X}), X)


def test_hooks_are_removed_on_an_exception():
    net = nn.Linear(4, 2)
    with pytest.raises(RuntimeError, match="boom"):
        with hooks() as handles:
            handles.append(net.register_forward_hook(lambda *a: None))
            raise RuntimeError("boom")
    assert not net._forward_hooks


@pytest.mark.parametrize(
    "bad, error, words",
    [
        ([], ValueError, "no batches"),
        (iter([]), ValueError, "no batches"),
        (torch.zeros(0, 4), ValueError, "empty tensor"),
        ("data.pt", TypeError, "got str"),
        (3, TypeError, "got int"),
        ((), ValueError, "empty tuple"),
        ((None, Y), TypeError, r"\(inputs, \*targets\)"),
        ([("x", Y)], TypeError, r"batch 0 .*is a str"),
        ({"mask": [1, 2]}, TypeError, "holds no tensor"),
    ],
)
@pytest.mark.parametrize("function", ["freeze", "stable_units", "affinity", "gate_statistics", "report"])
def test_bad_data_names_the_form(function, bad, error, words):
    call = {
        "freeze": lambda d: linearize.freeze(_mlp(), data=d),
        "stable_units": lambda d: linearize.stable_units(_mlp(), d, method="data"),
        "affinity": lambda d: affinity_signature(_mlp(), d, progress=False),
        "gate_statistics": lambda d: _gates(d),
        "report": lambda d: linearize.report(_mlp(), d, progress=False),
    }[function]
    with pytest.raises(error, match=words):
        call(bad)


# ----------------------------------------------------------------------------- flags


def _bn_model(root_training: bool) -> nn.Sequential:
    """Root (and all but the BatchNorm) in ``root_training`` mode, the BatchNorm in the other."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model.train(root_training)
    model[1].train(not root_training)
    return model


def _flags(model: nn.Module) -> dict[int, bool]:
    return {id(m): m.training for m in model.modules()}


OPERATIONS = {
    "convert": lambda m: linearize.convert(m, example_inputs=X[:2]),
    "average_path_length": lambda m: average_path_length(m, X[:2]),
    "freeze": lambda m: linearize.freeze(m, data=(X, Y)),
    "report": lambda m: linearize.report(m, (X, Y), segments=2, progress=False),
    "stable_units": lambda m: linearize.stable_units(m, (X, Y)),
    "affinity_signature": lambda m: affinity_signature(m, (X, Y), progress=False),
    "compress": lambda m: linearize.compress(m, (X, Y)),
    "fold": lambda m: linearize.fold(m, X[:4], latency=True),
}
NEED_EVAL_BATCHNORM = {"compress", "fold"}  # they refuse a BatchNorm in training mode


def _operations():
    for name in OPERATIONS:
        for root_training in (True, False):
            yield pytest.param(name, root_training, id=f"{name}-{'train' if root_training else 'eval'}_root")


@pytest.mark.parametrize("name, root_training", _operations())
def test_every_module_keeps_its_own_training_flag(name, root_training):
    model = _bn_model(root_training)
    if name != "convert":
        linearize.convert(model, example_inputs=X[:2])
    before = _flags(model)
    if name in NEED_EVAL_BATCHNORM and not root_training:  # the BatchNorm trains: refused, flags kept
        with pytest.raises(ValueError, match="training mode"):
            OPERATIONS[name](model)
    else:
        OPERATIONS[name](model)
    after = {id(m): m.training for m in model.modules() if id(m) in before}
    assert after == {k: v for k, v in before.items() if k in after}
    assert model.training == root_training and model[1].training == (not root_training)
    if name == "convert":  # the new unit takes the flag of the ReLU it replaced
        assert model[2].training == root_training


@pytest.mark.parametrize("root_training", [True, False], ids=["train_root", "eval_root"])
def test_eval_mode_and_gate_statistics_keep_every_flag(root_training):
    model = _bn_model(root_training)
    before = _flags(model)
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert _flags(model) == before
    _, gated = _gates(X)
    gated.train(root_training)
    gated.value[0].train(not root_training)
    before = _flags(gated)
    gate_statistics(gated, (X, Y))
    assert _flags(gated) == before


def test_limit_reads_no_batch_beyond_it():
    read = []

    def gen():
        for a, b in CUTS:
            read.append(a)
            yield X[a:b]

    assert Batches.of(gen()).limit(samples=7).num_samples == 7 and read == [0]
    assert len(Batches.of(gen()).limit(batches=2)) == 2 and read == [0, 0, 7]


@pytest.mark.parametrize("ref,new", [(torch.zeros(3), torch.zeros(1)), (torch.zeros(0), torch.ones(2)),
                                     (torch.zeros(2, 1), torch.ones(2))], ids=["broadcast", "empty-ref", "2d-1d"])
def test_max_difference_refuses_tensors_of_other_shapes(ref, new):
    """max_difference broadcast tensors of other shapes (or skipped an empty ref) and reported a small or zero error."""
    with pytest.raises(ValueError, match="one shape"):
        max_difference([ref], [new])
