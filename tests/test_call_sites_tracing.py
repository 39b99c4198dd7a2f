"""Call-site dispatch under torch.fx tracing, torch.compile (with an exception inside the forward) and threads a
forward starts: each gives the converted model's numbers or a clear error naming the situation and the fix.

Truths: the converted layers written out by hand (PReLU and GELU blends of the same weights and slopes), the
network with every activation replaced by the identity (slope 1), and the plain activations of torch.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision
from test_call_sites import Functional, Reused, by_hand, converted, random_slopes, failing
from test_functional_units import W, AllCalls, calls
from torch import nn

import linearize
from linearize.functional_sites import FunctionalSiteError


def _plain_activations_are_untouched() -> None:
    assert F.relu(torch.tensor(-2.0)).item() == 0.0
    assert torch.relu(torch.tensor([-3.0, 1.0])).tolist() == [0.0, 1.0]
    assert F.gelu(torch.tensor(-1.0)).item() == pytest.approx(-0.15865525, abs=1e-6)


@pytest.mark.parametrize("cls", [Functional, Reused])
def test_fx_trace_of_a_wrapper_records_every_unit_as_a_module_call(cls):
    model, x, expected = converted(cls)
    traced = torch.fx.symbolic_trace(nn.Sequential(model))
    targets = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert [t for t in targets if t.startswith("0.linearize_functional.") or t.startswith("0.act.calls.")] == (
        ["0.linearize_functional.relu_0", "0.linearize_functional.gelu_1"] if cls is Functional
        else ["0.act.calls.0", "0.act.calls.1"])
    assert not [n for n in traced.graph.nodes if n.op == "call_function" and n.target in (F.relu, F.gelu)]
    with torch.no_grad():
        assert torch.allclose(traced(x), expected, atol=1e-6)
        random_slopes(model, seed=1)  # the GraphModule runs the model's own units
        assert torch.allclose(traced(x), by_hand(model, x), atol=1e-6)


class FunctionForms(AllCalls):
    """AllCalls without its Tensor method calls (x.relu(), x.relu_()): every call a function, in place ones too."""

    def __init__(self):
        super().__init__()
        forms = [(name, fn) for name, fn in calls() if not name.startswith("Tensor.")]
        self.lins = nn.ModuleList(nn.Linear(W, W) for _ in forms)
        self.fns = [fn for _, fn in forms]


def test_fx_trace_keeps_in_place_functional_calls_in_place():
    torch.manual_seed(0)
    x = torch.randn(4, W)
    model = linearize.convert(FunctionForms().eval(), example_inputs=x)
    traced = torch.fx.symbolic_trace(nn.Sequential(model))
    with torch.no_grad():
        for _, u in linearize.units(model):
            u.slope.fill_(1.0)
        assert torch.allclose(traced(x), model.linear(x), atol=1e-5)  # every call its unit, at slope 1: linear
        random_slopes(model)
        assert torch.allclose(traced(x), model(x), atol=1e-6)


def test_fx_trace_of_tensor_method_calls_is_refused_naming_them_and_the_fix():
    torch.manual_seed(0)
    x = torch.randn(4, W)
    model = linearize.convert(AllCalls().eval(), example_inputs=x)
    with pytest.raises(FunctionalSiteError, match=r"symbolic_trace of module '<root>' saw 13 of its 15 functional "
                                                  r"activation calls.*Tensor method.*Fix: call the function form"):
        torch.fx.symbolic_trace(nn.Sequential(model))
    _plain_activations_are_untouched()


def test_fx_trace_of_module_units_runs_the_units():
    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 5), nn.GELU()),
                              example_inputs=torch.randn(2, 4))
    random_slopes(model)
    a1, a2 = (u.slope.detach() for _, u in linearize.units(model))
    x = torch.randn(3, 4)
    h = model[2](torch.where(model[0](x) >= 0, model[0](x), a1 * model[0](x)))
    with torch.no_grad():
        assert torch.allclose(torch.fx.symbolic_trace(model)(x), (1 - a2) * F.gelu(h) + a2 * h, atol=1e-6)


class _CallModuleTracer(torch.fx.Tracer):
    """A tracer defined outside torch, as fx-based tools write them (torchvision's NodePathTracer)."""

    def call_module(self, m: nn.Module, forward, args: tuple, kwargs: dict):
        return super().call_module(m, forward, args, kwargs)


def test_fx_tracer_subclasses_and_torchvision_feature_extractors_trace_converted_models():
    """A Tracer subclass's own frames moved the probe's call positions: its trace was refused as control flow, and
    create_feature_extractor left the model in training mode. Truth: the unconverted model, traced the same way."""
    from torchvision.models.feature_extraction import create_feature_extractor

    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    original = torchvision.models.resnet18(num_classes=10).eval()
    model = linearize.convert(copy.deepcopy(original), example_inputs=x)
    with torch.no_grad():
        want = create_feature_extractor(original, {"layer2": "feat"})(x)["feat"]
        assert torch.equal(create_feature_extractor(model, {"layer2": "feat"})(x)["feat"], want)
        assert not model.training
        for cls in (Functional, Reused):
            small, y, by_hand_output = converted(cls)  # random slopes, its output written out by hand
            traced = torch.fx.GraphModule(nn.Sequential(small), _CallModuleTracer().trace(nn.Sequential(small)))
            assert torch.allclose(traced(y), by_hand_output, atol=1e-6)


@pytest.mark.parametrize("cls", [Functional, Reused])
def test_fx_trace_of_an_owner_itself_is_refused_with_the_wrapper_fix(cls):
    model, x, expected = converted(cls)
    with pytest.raises(FunctionalSiteError, match=r"symbolic_trace of .* itself would record the original "
                                                  r"activation.*Fix: trace a wrapper, .*nn.Sequential\(model\)"):
        torch.fx.symbolic_trace(model)
    _plain_activations_are_untouched()
    assert torch.allclose(model(x), expected, atol=1e-6)


def test_a_tool_tracing_an_owner_is_refused_naming_the_mode_it_left_and_a_wrapper_fix_that_works():
    """create_feature_extractor of a model whose own forward makes functional calls is refused (the root's forward
    runs without its hooks), and torchvision leaves the model in training mode after the error: the refusal did not
    say so, and its wrapper fix, nn.Sequential(model), put the model in training mode for good (torchvision restores
    the wrapper's mode, training for a new Sequential). Truth: the output written out by hand, in eval mode."""
    from torchvision.models.feature_extraction import create_feature_extractor

    model, x, expected = converted(Functional)
    assert not model.training
    with pytest.raises(FunctionalSiteError, match=r"The model is in training mode now: a tool that sets the mode "
                       r"for its trace \(NodePathTracer: .*set it again \(model.eval\(\)\).*create_feature_extractor"
                       r"\(torch.nn.Sequential\(model\).eval\(\), \{'0.layer'"):
        create_feature_extractor(model, {"c": "out"})
    assert model.training  # torchvision's doing: the error says so
    model.eval()
    features = create_feature_extractor(nn.Sequential(model).eval(), {"0.c": "out"})
    assert not model.training and torch.allclose(features(x)["out"], expected, atol=1e-6)
    with pytest.raises(FunctionalSiteError) as raised:  # torch's own tracer sets no mode: nothing to say about it
        torch.fx.symbolic_trace(model)
    assert "is in training mode now" not in str(raised.value)


class _Raises(nn.Module):
    """The identity, or raises: in every forward (``when="forward"``) or under an fx trace (``"trace"``)."""

    when: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _Raises.when == "forward" or (_Raises.when == "trace" and isinstance(x, torch.fx.Proxy)):
            raise RuntimeError("injected")
        return x


class _WithRaises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b, self.raises, self.c = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), \
            _Raises(), nn.Linear(8, 3)
        self.act, self.act2 = nn.ReLU(), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.act2(self.raises(self.b(self.act(self.bn(self.a(x)))))))


_PROBES = {
    "convert": lambda m, x: linearize.convert(m, example_inputs=x),
    "average_path_length fx": lambda m, x: linearize.measures.average_path_length(m, x, method="fx"),
    "average_path_length record": lambda m, x: linearize.measures.average_path_length(m, x, method="record"),
    "fold": lambda m, x: linearize.fold(m, x, latency=False),
    "count_flops": lambda m, x: linearize.count_flops(m, x),
    "freeze": lambda m, x: linearize.freeze(m, data=[x]),
    "report": lambda m, x: linearize.report(m, x, progress=False),
    "Sparsifier weights='flops'": lambda m, x: linearize.Sparsifier(
        m, linearize.schedules.target(0.5), total_steps=10, weights="flops", example_inputs=x),
    "symbolic_trace of a wrapper": lambda m, x: torch.fx.symbolic_trace(nn.Sequential(m)),
}


@pytest.mark.parametrize("probe, when", [(p, "forward") for p in _PROBES] + [
    ("average_path_length fx", "trace"), ("symbolic_trace of a wrapper", "trace")])
def test_an_exception_mid_probe_or_mid_trace_leaves_every_mode_and_hook_as_it_was(probe, when):
    """The paths of linearize that probe or trace a model, with an exception raised inside its forward (or only
    under an fx trace): every module's training flag (a BatchNorm kept in eval mode inside a model in training mode)
    and its hooks are as before, and the model computes what it did. Truth: the state taken before the call."""
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    model = _WithRaises()
    if probe != "convert":
        linearize.convert(model, example_inputs=x)
    model.train()
    model.bn.eval()

    def state() -> list:
        return [(n, m.training, *map(len, (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                                           m._backward_pre_hooks, m._forward_hooks_always_called)))
                for n, m in model.named_modules()]

    before, want = state(), model(x)
    _Raises.when = when
    try:
        with pytest.raises((RuntimeError, ValueError), match="injected"):
            _PROBES[probe](model, x)
    finally:
        _Raises.when = None
    assert state() == before and torch.equal(model(x), want)


@pytest.mark.parametrize("cls", [Functional, Reused])
def test_compile_fullgraph_says_why_and_the_fix_and_leaves_nothing_behind(cls):
    model, x, expected = converted(cls)
    with pytest.raises(Exception, match=r"fullgraph=True cannot compile this model. Fix: torch.compile\(model\) "
                                        r"without fullgraph=True"):
        torch.compile(model, fullgraph=True, backend="eager")(x)
    _plain_activations_are_untouched()
    assert torch.allclose(model(x), expected, atol=1e-6)
    assert torch.allclose(torch.compile(model, backend="eager")(x), expected, atol=1e-6)


def test_compile_fullgraph_of_module_units_compiles_with_the_blends_values_and_gradients():
    """Dynamo refused the units' autograd Functions for their jvp ("Unsupported custom jvp"): fullgraph=True failed
    on a plain converted Sequential. Truth: the blend written out by hand, ``(1 - a) act(h) + a h``, in autograd."""
    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)),
                              example_inputs=torch.randn(2, 6))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, 6, requires_grad=True)
    for seed in (None, 1):  # slope 0 (the original), then random slopes
        if seed is not None:
            random_slopes(model, seed=seed)
        (_, relu), (_, gelu) = linearize.units(model)
        h = model[0](x)
        h = model[2]((1 - relu.slope) * F.relu(h) + relu.slope * h)
        want = model[4]((1 - gelu.slope) * F.gelu(h) + gelu.slope * h)
        got = compiled(x)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        leaves = [x, relu.slope, gelu.slope, *model.parameters()]
        for g, w in zip(torch.autograd.grad(got.square().sum(), leaves, allow_unused=True),
                        torch.autograd.grad(want.square().sum(), leaves, allow_unused=True)):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_an_exception_inside_a_compiled_forward_leaves_no_interception_behind(error, fullgraph):
    model, x, expected = failing(error)
    compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
    model.fail.armed = True
    with pytest.raises((error, RuntimeError)):  # fullgraph: the compile error comes first
        compiled(x)
    _plain_activations_are_untouched()
    model.fail.armed = False
    with torch.no_grad():
        assert torch.allclose(model(x), expected, atol=1e-6)
        if not fullgraph:
            assert torch.allclose(compiled(x), expected, atol=1e-6)
    _plain_activations_are_untouched()
    assert torch._C._len_torch_function_stack() == 0


class SpawnsReused(Reused):
    """Runs its second activation call on a thread of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, out = self.act(self.a(x)), {}

        def work() -> None:
            try:
                out["h"] = self.act(self.b(h))
            except FunctionalSiteError as e:
                out["error"] = e

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        if "error" in out:
            raise out["error"]
        return self.c(out["h"])


def test_a_reused_activation_called_on_a_thread_the_forward_started_is_refused_naming_it():
    """convert's check run meets the call on the other thread: it refuses, naming it, and leaves the model as
    given (it used to convert a model that raised at every forward)."""
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    model = SpawnsReused().eval()
    with torch.no_grad():
        want = model(x)
    with pytest.raises(FunctionalSiteError, match=r"a thread that the owner's forward started.*Fix: .*on the "
                                                  r"thread that runs that forward"):
        linearize.convert(model, example_inputs=x)
    assert type(model.act) is nn.ReLU and not hasattr(model, "linearize_config")
    with torch.no_grad():
        assert torch.equal(model(x), want)



def test_compile_fullgraph_of_models_unpickled_in_a_fresh_process_says_why(tmp_path):
    """Whole converted models (reused module, functional calls) saved with torch.save and loaded in a new
    process (no __init__ runs there) still get the refusal with the fix under fullgraph=True, and run compiled
    without it."""
    import subprocess
    import sys

    script = tmp_path / "check.py"
    script.write_text(f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_call_sites import Functional, Reused, converted
if sys.argv[1] == "save":
    torch.save([converted(cls)[:2] for cls in (Reused, Functional)], sys.argv[2])
else:
    for m, x in torch.load(sys.argv[2], weights_only=False):
        try:
            torch.compile(m, fullgraph=True, backend="eager")(x)
            print("compiled")
        except Exception as e:
            print("fullgraph=True cannot compile this model. Fix:" in str(e))
        print(torch.allclose(torch.compile(m, backend="eager")(x), m(x), atol=1e-6))
""")
    path = tmp_path / "models.pt"
    run = lambda *a: subprocess.run([sys.executable, str(script), *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=300)
    saved = run("save", str(path))
    assert saved.returncode == 0, saved.stderr[-3000:]
    done = run("load", str(path))
    assert done.stdout.split() == ["True"] * 4, done.stdout + done.stderr[-3000:]


@pytest.mark.parametrize("compile_first", [False, True])
def test_fx_trace_detection_does_not_depend_on_a_torch_compile_before_the_first_convert(tmp_path, compile_first):
    """torch.compile replaces ``torch.fx.Tracer.trace`` by a generic wrapper: in a process that compiled anything
    before linearize was imported, symbolic_trace of an owner is still refused, and a reordered loop or a
    training-only call still gets its own error, not an fx-tracing one (as in a process without torch.compile)."""
    import subprocess
    import sys

    script = tmp_path / "check.py"
    script.write_text(f"""
import sys, torch
import torch.nn.functional as F
from torch import nn
if {compile_first!r}:
    torch.compile(nn.Linear(2, 2))
import linearize
class Layers(nn.Module):
    def __init__(s):
        super().__init__(); s.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
    def forward(s, x, order=(0, 1, 2)):
        for i in order: x = F.relu(s.layers[i](x))
        if s.training: x = x + F.gelu(x)
        return x
x = torch.randn(4, 8)
m = linearize.convert(Layers().eval(), example_inputs=x)
for call in (lambda: m(x, order=(2, 1, 0)), lambda: m.train()(x), lambda: torch.fx.symbolic_trace(m.eval())):
    try:
        call(); print("ran")
    except Exception as e:
        print(repr(str(e)))
""")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    loop, training, trace = run.stdout.splitlines()
    assert "runs in a loop of the forward" in loop
    assert "made 4 functional activation call(s)" in training
    assert "symbolic_trace of Layers itself would record" in trace


@pytest.mark.parametrize("root", [True, False])
@pytest.mark.parametrize("cls", [Functional, Reused])
def test_a_graph_module_owner_keeps_its_dispatch_in_deep_copies_and_through_pickle(cls, root):
    """torch rebuilds a GraphModule for copy.deepcopy and pickling without its forward hooks: the copy ran the
    plain activations (or refused a reused one), and unpickling refused a trace the user never made. Now every
    copy computes the converted function, written out by hand with the copy's own slopes."""
    import copy
    import io
    import pickle

    torch.manual_seed(0)
    x = torch.randn(5, 6)
    graph = torch.fx.symbolic_trace(cls())
    model = linearize.convert(graph if root else nn.Sequential(graph, nn.Linear(3, 3)), example_inputs=x)
    random_slopes(model)

    def by_hand_of(m: nn.Module) -> torch.Tensor:
        gm = m if root else m[0]
        a1, a2 = [u.slope for _, u in linearize.units(gm)]
        h = gm.b(torch.where(gm.a(x) >= 0, gm.a(x), a1 * gm.a(x)))
        h = gm.c((1 - a2) * F.gelu(h) + a2 * h if cls is Functional else torch.where(h >= 0, h, a2 * h))
        return h if root else m[1](h)

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for m in (model, twin, copy.deepcopy(twin), pickle.loads(pickle.dumps(model)), pickle.loads(pickle.dumps(twin)),
                  torch.load(buffer, weights_only=False)):
            torch.testing.assert_close(m(x), by_hand_of(m))
            torch.testing.assert_close(m(x), model(x), rtol=0, atol=0)
