"""Average path length: hand-derived reference values (one skip around four layers: 257 paths), brute-force
path enumeration, real models."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import linearize
from linearize import LinearizableActivation as Unit
from linearize.measures import average_path_length
from linearize.measures.paths import PathLengthResult

METHODS = ["fx", "record"]


def _set_linear(unit: Unit, linear: list[int]) -> None:
    with torch.no_grad():
        unit.slope.zero_()
        unit.slope[linear] = 1.0


class SkipAround(nn.Module):
    """``x + f(x)`` with ``f`` = ``depth`` blocks of Linear + unit, all of width ``width``."""

    def __init__(self, width: int = 4, depth: int = 4) -> None:
        super().__init__()
        self.f = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), Unit("relu", width, -1))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


@pytest.mark.parametrize("method", METHODS)
def test_reference_skip_around_four_layers(method: str) -> None:
    model = SkipAround()
    x = torch.randn(2, 4)
    res = average_path_length(model, x, method=method, detailed=True)
    assert isinstance(res, PathLengthResult) and res.method == method
    assert 10 ** res.log10_paths == pytest.approx(257)
    assert res.unnormalized == pytest.approx(4 * 256 / 257)
    assert res.normalized == pytest.approx(2.0)
    assert average_path_length(model, x, normalized=False, method=method) == pytest.approx(3.984, abs=1e-3)
    for _, u in linearize.units(model):
        _set_linear(u, list(range(4)))
    assert average_path_length(model, x, method=method) == 0.0
    assert average_path_length(model, x, normalized=False, method=method) == 0.0


@pytest.mark.parametrize("method", METHODS)
def test_plain_chain_is_sum_of_fractions(method: str) -> None:
    torch.manual_seed(0)
    widths = [3, 5, 2, 6, 4]
    layers, fracs, prev = [], [], 3
    for w in widths:
        unit = Unit("relu", w, -1)
        lin = torch.randperm(w)[: int(torch.randint(0, w + 1, ())) ].tolist()
        _set_linear(unit, lin)
        fracs.append((w - len(lin)) / w)
        layers += [nn.Linear(prev, w), unit]
        prev = w
    model = nn.Sequential(*layers)
    x = torch.randn(2, 3)
    for normalized in (True, False):
        assert average_path_length(model, x, normalized, method=method) == pytest.approx(sum(fracs))
    # same fraction f in each of L layers: L * f
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(4, 4), Unit("relu", 4, -1))])
    for _, u in linearize.units(model):
        _set_linear(u, [0])
    assert average_path_length(model, torch.randn(2, 4), method=method) == pytest.approx(6 * 0.75)


class Nested(nn.Module):
    """Three routes from x to the output: direct, over u1 -> u4, over u1 -> u2 -> u3 -> u4."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.u1 = nn.Linear(3, 3), Unit("relu", 3, -1)
        self.l2, self.u2 = nn.Linear(3, 2), Unit("relu", 2, -1)
        self.l3, self.u3 = nn.Linear(2, 3), Unit("relu", 3, -1)
        self.l4, self.u4 = nn.Linear(3, 4), Unit("relu", 4, -1)
        self.head, self.proj = nn.Linear(4, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = self.u1(self.l1(x))
        h2 = h1 + self.u3(self.l3(self.u2(self.l2(h1))))
        h3 = self.u4(self.l4(h2))
        return self.head(h3) + self.proj(x)


def _brute_force(routes: list[tuple[float, list[Unit]]]) -> tuple[float, float, int]:
    """(normalized, unnormalized, #paths) by enumerating every channel of every route."""
    total_paths, total_count, walk = 0, 0, 0.0
    for prob, route in routes:
        nonlinear = [(~u.linear_mask()).tolist() for u in route]
        route_paths = route_count = 0
        for channels in itertools.product(*[range(u.num_channels) for u in route]):
            route_paths += 1
            route_count += sum(nonlinear[i][c] for i, c in enumerate(channels))
        total_paths += route_paths
        total_count += route_count
        walk += prob * route_count / route_paths
    return walk, total_count / total_paths, total_paths


@pytest.mark.parametrize("method", METHODS)
def test_brute_force_enumeration(method: str) -> None:
    torch.manual_seed(1)
    model = Nested()
    _set_linear(model.u1, [1])
    _set_linear(model.u2, [])
    _set_linear(model.u3, [0, 2])
    _set_linear(model.u4, [0, 1, 3])
    m = model
    # the walk splits 1/2 at the output merge and 1/2 at h2
    routes = [(0.5, []), (0.25, [m.u1, m.u4]), (0.25, [m.u1, m.u2, m.u3, m.u4])]
    walk, uniform, paths = _brute_force(routes)
    res = average_path_length(model, torch.randn(2, 3), method=method, detailed=True)
    assert res.normalized == pytest.approx(walk)
    assert res.unnormalized == pytest.approx(uniform)
    assert 10 ** res.log10_paths == pytest.approx(paths)
    assert res.merges == 2 and res.unit_calls == 4


class Gated(nn.Module):
    """``act(gate(x)) * up(x)`` and an RMSNorm-style ``x * rsqrt(mean(x^2))`` product."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 4)
        self.act = Unit(nn.SiLU(), 6, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x + self.down(self.act(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("method", METHODS)
def test_products_merge_distinct_operands(method: str) -> None:
    model = Gated()
    _set_linear(model.act, [0, 1, 2])
    # paths: skip (0 units) | up branch (0 units) | gate branch (6 channels, 3 nonlinear)
    res = average_path_length(model, torch.randn(2, 4), method=method, detailed=True)
    assert res.merges == 2  # the RMSNorm product has one distinct operand node
    assert res.normalized == pytest.approx(0.5 * 0.5 * 0.5)
    assert res.unnormalized == pytest.approx(3 / 8)
    assert 10 ** res.log10_paths == pytest.approx(8)


class WriteInto(nn.Module):
    """``h = x.clone(); h[:, :2] = unit(...)``: the written tensor merges both branches."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(4, 4), Unit("relu", 4, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.clone()
        h[:, :2] = self.act(self.lin(x))[:, :2]
        return h


def test_setitem_merges_and_auto_falls_back_to_recording() -> None:
    with pytest.raises(TypeError):  # torch.fx proxies do not support item assignment
        average_path_length(WriteInto(), torch.randn(2, 4), method="fx")
    res = average_path_length(WriteInto(), torch.randn(2, 4), detailed=True)
    assert res.method == "record"
    assert (res.normalized, res.unnormalized, res.merges) == pytest.approx((0.5, 4 / 5, 1))


def test_resnet18_matches_hand_formula_and_methods_agree() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    linearize.convert(model, example_inputs=x)
    fracs = {}
    for name, u in linearize.units(model):
        _set_linear(u, torch.randperm(u.num_channels)[: int(torch.randint(0, u.num_channels + 1, ()))].tolist())
        fracs[name] = 1 - float(u.linear_mask().float().mean())
    # normalized: stem + per block (first relu inside the branch: halved at the add) + relu after the add
    expected = fracs["relu"]
    for layer in range(1, 5):
        for block in range(2):
            expected += fracs[f"layer{layer}.{block}.relu.calls.0"] / 2 + fracs[f"layer{layer}.{block}.relu.calls.1"]
    fx = average_path_length(model, x, method="fx", detailed=True)
    rec = average_path_length(model, x, method="record", detailed=True)
    assert fx.normalized == pytest.approx(expected)
    assert (fx.unnormalized, fx.log10_paths, fx.merges, fx.unit_calls) == pytest.approx(
        (rec.unnormalized, rec.log10_paths, rec.merges, rec.unit_calls)
    )
    assert rec.normalized == pytest.approx(expected)
    assert fx.merges == 8 and fx.unit_calls == 17
    assert average_path_length(model, x) == pytest.approx(expected)  # auto traces resnets


def test_bert_from_config_records() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    width, layers = 37, 3
    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=width, max_position_embeddings=32,
    )
    model = transformers.BertModel(cfg)
    inputs = {"input_ids": torch.randint(0, 50, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    linearize.convert(model, example_inputs=inputs)
    ffn = [u for n, u in linearize.units(model) if "intermediate" in n]
    assert len(ffn) == layers
    res = average_path_length(model, inputs, detailed=True)
    assert res.method == "record"  # HF BERT does not trace with plain torch.fx
    # every residual add is a merge: attention (no unit) and FFN per layer
    assert res.merges == 2 * layers
    assert res.normalized == pytest.approx(layers / 2)
    assert res.unnormalized == pytest.approx(layers * width / (width + 1))
    _set_linear(ffn[1], list(range(10)))
    f = (width - 10) / width
    res = average_path_length(model, inputs, detailed=True)
    assert res.normalized == pytest.approx((2 + f) / 2)
    assert res.unnormalized == pytest.approx((2 + f) * width / (width + 1))


def test_errors() -> None:
    with pytest.raises(ValueError, match="no linearizable units"):
        average_path_length(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), torch.randn(2, 2))
    with pytest.raises(ValueError, match="method"):
        average_path_length(SkipAround(), torch.randn(2, 4), method="export")
    with pytest.raises(TypeError, match="example_inputs"):
        average_path_length(SkipAround(), "x")
    with pytest.raises(KeyError, match="sources"):
        average_path_length(SkipAround(), {"x": torch.randn(2, 4)}, sources=["y"])


def test_gpt2_reshaped_token_ids_start_paths() -> None:
    """GPT-2 reshapes its integer input_ids (``view``) before the embedding: the path still starts at
    them. Truth by hand: every block is h + attn(h) (no unit: a merge of two equal branches) then
    h + mlp(h) (one unit of width W), so normalized APL = layers / 2 and unnormalized
    layers * W / (W + 1), as for BERT; a mask computed from the ids (``ne``) starts no path."""
    transformers = pytest.importorskip("transformers")
    layers, width = 2, 64
    model = transformers.GPT2Model(transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=layers, n_head=2,
                                                           n_positions=32)).eval()
    linearize.convert(model)
    res = average_path_length(model, {"input_ids": torch.randint(0, 50, (2, 8))}, detailed=True)
    assert res.method == "record" and res.merges == 2 * layers
    assert res.normalized == pytest.approx(layers / 2)
    assert res.unnormalized == pytest.approx(layers * width / (width + 1))

    class MaskOnly(nn.Module):  # the ids only shape a mask: no path from the input reaches the output
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.act = nn.Embedding(50, 4), linearize.LinearizableActivation("relu", 4, -1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.act(self.emb.weight.sum(0) * ids.ne(0).unsqueeze(-1).float())

    with pytest.raises(ValueError, match="derives from the source"):
        average_path_length(MaskOnly(), torch.randint(1, 50, (2, 3)), method="record")


class _Ids(nn.Module):
    """ids -> embedding -> linear -> ReLU (width 4) -> linear; ``prep`` turns the ids into the embedding
    input, ``mask`` (optional) gives a mask multiplied into the hidden state."""

    def __init__(self, prep, mask=None) -> None:
        super().__init__()
        self.prep, self.mask = prep, mask
        self.emb, self.f, self.act, self.o = nn.Embedding(10, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.act(self.f(self.emb(self.prep(ids))))
        if self.mask is not None:
            h = h * self.mask(ids).unsqueeze(-1)
        return self.o(h)


def test_apl_record_follows_ids_cast_with_long():
    """Truth: one all-nonlinear unit (initial slope 0) on the only path: APL 1.0 (as fx gives, and as
    ``record`` gives for ``ids.to(torch.long)``). Observed: ``ids.long()`` (and ``F.pad``, ``flip``,
    ``type``, ``index_select`` of the ids) drops the tag: ValueError 'no output tensor derives'."""
    ids = torch.randint(0, 10, (2, 5), dtype=torch.int32)
    model = linearize.convert(_Ids(lambda i: i.long()), example_inputs=ids)
    assert average_path_length(model, ids, method="fx") == 1.0  # the truth the other method gives
    assert average_path_length(model, ids, method="record") == 1.0


def test_apl_mask_from_ids_to_bool_is_a_constant():
    """Truth (module docstring: masks are constants): ``h * mask`` with a mask of the ids keeps the one
    path through the all-nonlinear unit, APL 1.0, as ``ids != 0`` and ``ids.bool()`` give. Observed:
    ``ids.to(torch.bool)`` is tagged as a layout op, the product merges with a 0-unit path: 0.5."""
    ids = torch.randint(0, 10, (2, 5))
    for mask in (lambda i: i != 0, lambda i: i.bool()):  # the same mask: a constant
        model = linearize.convert(_Ids(lambda i: i, mask), example_inputs=ids)
        assert average_path_length(model, ids, method="record") == 1.0
    model = linearize.convert(_Ids(lambda i: i, lambda i: i.to(torch.bool)), example_inputs=ids)
    assert average_path_length(model, ids, method="record") == 1.0


def test_apl_mask_shaped_like_the_ids_is_a_constant():
    """Truth: ``(ids != 0)`` is a constant mask (APL 1.0, as without the shape call); ``expand_as(ids)``,
    ``view_as(ids)``, ``to(ids)`` take only the shape/dtype of ``ids``, not its values. Observed: the
    layout op tags the mask with the ids' node, ``h * mask`` merges with a 0-unit path: 0.5."""
    ids = torch.randint(0, 10, (2, 5))
    for shaped in (lambda i: (i != 0).expand_as(i), lambda i: (i != 0).view_as(i), lambda i: (i != 0).to(i)):
        model = linearize.convert(_Ids(lambda i: i, shaped), example_inputs=ids)
        assert average_path_length(model, ids, method="record") == 1.0


def _shift_right(ids: torch.Tensor) -> torch.Tensor:
    """BART's ``shift_tokens_right``: the ids moved one place into a fresh buffer (decoder inputs)."""
    shifted = ids.new_zeros(ids.shape)
    shifted[:, 1:] = ids[:, :-1].clone()
    return shifted


def test_apl_record_follows_ids_shifted_right():
    """Truth: the shifted ids feed the only path, through one all-nonlinear unit: APL 1.0. ``__setitem__``
    only moves the ids (BART/T5 build decoder inputs this way). Observed: the integer result of
    ``__setitem__`` is not tagged: ValueError 'no output tensor of the model derives from the source'."""
    ids = torch.randint(0, 10, (2, 5))
    model = linearize.convert(_Ids(_shift_right), example_inputs=ids)
    assert average_path_length(model, ids, method="record") == 1.0


def test_fx_trace_leaves_forwards_on_other_threads_alone():
    """Truth: a forward on another thread gives the outputs it gives with no trace running, and each trace gives
    the APL of a plain chain of 30 all-nonlinear units (30.0). ``torch.fx`` patches ``nn.Module.__call__`` and
    ``__getattr__`` for the whole process while it traces. Observed: the other thread's forwards failed with
    NameError 'module is not installed as a submodule', or TraceError (the measured model's own: a Proxy in place
    of a weight); two traces at once could leave the patch in place."""
    import threading

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    measured = linearize.convert(nn.Sequential(*[m for _ in range(30) for m in (nn.Linear(8, 8), nn.ReLU())]),
                                 example_inputs=x).eval()
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        expected = [other(x), measured(x)]
    call, getattr_ = nn.Module.__call__, nn.Module.__getattr__
    done, errors, values, forwards = threading.Event(), [], [], [0]

    def measure() -> None:
        try:
            for _ in range(8):
                values.append(average_path_length(measured, x, method="fx"))
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    def forward() -> None:
        while not done.is_set():
            try:
                with torch.no_grad():
                    outs = [other(x), measured(x)]
                assert all(torch.equal(o, e) for o, e in zip(outs, expected))
                forwards[0] += 1
            except Exception as err:  # noqa: BLE001
                errors.append(err)
                return

    measuring = [threading.Thread(target=measure) for _ in range(2)]
    forwarding = threading.Thread(target=forward)
    for t in [forwarding, *measuring]:
        t.start()
    for t in measuring:
        t.join()
    done.set()
    forwarding.join()
    assert not errors, errors
    assert values == [30.0] * 16 and forwards[0] > 0
    assert nn.Module.__call__ is call and nn.Module.__getattr__ is getattr_
