"""Activation calls on threads a model's forward starts: convert's probe (a per-thread torch-function mode)
cannot follow them, so they are listed and warned about, never silently counted as converted or linear."""

from __future__ import annotations

import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import linearize


class SpawnsActivation(nn.Module):
    """Linear -> an activation run on a thread the forward starts -> Linear."""

    def __init__(self, call) -> None:
        super().__init__()
        self.a, self.b, self.call = nn.Linear(4, 6), nn.Linear(6, 2), call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, out = self.a(x), {}
        worker = threading.Thread(target=lambda: out.update(h=self.call(self, h)), name="side")
        worker.start()
        worker.join()
        return self.b(out["h"])


CALLS = {
    "F.relu": (lambda self, h: F.relu(h), "relu"),
    "torch.relu": (lambda self, h: torch.relu(h), "relu"),
    "Tensor.relu": (lambda self, h: h.relu(), "relu"),
    "F.gelu": (lambda self, h: F.gelu(h), "gelu"),
}


def convert_with_own_relu(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """Give the model one activation convert can see (on the forward's thread), then convert it."""
    model.a = nn.Sequential(model.a, nn.ReLU())
    return linearize.convert(model, example_inputs=x)


@pytest.mark.parametrize("name", list(CALLS))
def test_an_activation_on_a_thread_the_forward_started_is_listed_and_warned(name):
    torch.manual_seed(0)
    call, fn = CALLS[name]
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match=r"thread 'side'.*on a thread the forward started"):
        model = convert_with_own_relu(SpawnsActivation(call), x)
    (where, n), = model.linearize_report.threads.items()
    assert where.endswith(f": {fn}") and n == 1
    # every unit linear: the counts say linear, but the thread's activation is still there (independent truth:
    # an affine map satisfies f(x) + f(-x) = 2 f(0))
    with torch.no_grad():
        for _, unit in linearize.units(model):
            unit.slope.fill_(1.0)
        gap = (model(x) + model(-x) - 2 * model(torch.zeros_like(x))).abs().max().item()
    assert gap > 1e-3
    with pytest.warns(RuntimeWarning, match=r"thread 'side'.*less linear than the counts say"):
        assert linearize.nonlinear_fraction(model) == 0.0


def test_a_model_whose_only_activation_runs_on_a_started_thread_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"no convertible activation.*thread 'side'.*Fix: call the activation on"):
        linearize.convert(SpawnsActivation(CALLS["F.relu"][0]), example_inputs=torch.randn(2, 4))


def test_activations_on_the_forwards_own_thread_are_not_listed():
    x = torch.randn(8, 4)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    model = linearize.convert(model, example_inputs=x)
    assert model.linearize_report.threads == {}


class SpawnsModule(nn.Module):
    """A registered activation module called (once per forward) on a thread the forward starts."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = {}
        worker = threading.Thread(target=lambda: out.update(h=self.act(self.a(x))))
        worker.start()
        worker.join()
        return self.b(out["h"])


def test_an_activation_module_on_a_started_thread_converts_and_is_linear_at_slope_one():
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    ref = SpawnsModule()
    with torch.no_grad():
        want = ref(x)
    model = linearize.convert(ref, example_inputs=x)
    assert model.linearize_report.threads == {} and [n for n, _ in linearize.units(model)] == ["act"]
    with torch.no_grad():
        assert torch.equal(model(x), want)
        linearize.units(model)[0][1].slope.fill_(1.0)
        affine = model.b(model.a(x))  # the truth at slope 1: the two linear layers composed
        assert torch.allclose(model(x), affine, atol=1e-6)


def test_the_watch_keeps_a_users_profiler_and_leaves_later_threads_alone():
    x = torch.randn(8, 4)
    events, seen = [], []

    def profiler(frame, event, arg):  # a user's profiler, set for every new thread
        if threading.current_thread().name == "side":
            events.append(event)

    threading.setprofile(profiler)
    try:
        with pytest.warns(UserWarning, match="thread 'side'"):
            convert_with_own_relu(SpawnsActivation(CALLS["F.relu"][0]), x)
        assert threading.getprofile() is profiler and events  # it kept profiling the forward's thread
    finally:
        threading.setprofile(None)
    worker = threading.Thread(target=lambda: seen.append(sys.getprofile()))
    worker.start()
    worker.join()
    assert seen == [None]


class LongLived(nn.Module):
    """Starts a worker thread at its first forward and keeps using it (a lazily made pool)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act, self.jobs, self.worker = nn.Linear(4, 4), nn.ReLU(), None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import queue

        if self.worker is None:
            self.jobs, self.results = queue.Queue(), queue.Queue()

            def serve() -> None:
                for job in iter(self.jobs.get, None):
                    self.results.put((torch.relu(job), sys.getprofile()))

            self.worker = threading.Thread(target=serve, daemon=True, name="pool")
            self.worker.start()
        self.jobs.put(self.act(self.lin(x)))
        return self.results.get()[0]


def test_a_thread_that_outlives_the_probe_drops_the_watch():
    x = torch.randn(3, 4)
    model = LongLived()
    with pytest.warns(UserWarning, match="thread 'pool'"):
        model = linearize.convert(model, example_inputs=x)
    assert list(model.linearize_report.threads) == ["thread 'pool', in LongLived.forward.<locals>.serve: relu"]
    model.jobs.put(x)  # the next call on that thread: the watch removes itself
    model.results.get()
    model.jobs.put(x)
    assert model.results.get()[1] is None
    model.jobs.put(None)


class Waits(nn.Module):
    """Linear -> ReLU, whose forward runs ``hold()`` first (to order two converts on two threads)."""

    def __init__(self, hold) -> None:
        super().__init__()
        self.lin, self.act, self.hold = nn.Linear(4, 4), nn.ReLU(), hold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hold()
        return self.act(self.lin(x))


def test_a_convert_that_ends_while_another_runs_leaves_the_other_watching():
    """Convert A's probe starts, then convert B's; A ends before B's forward starts its thread: B still lists
    that thread's activation (each watch lasts until its own convert ends)."""
    in_a, in_b, a_may_return, b_may_start = (threading.Event() for _ in range(4))
    x, reports = torch.randn(2, 4), {}

    def hold_a() -> None:
        in_a.set()
        assert a_may_return.wait(30)

    class SpawnsLate(SpawnsActivation):
        def forward(self, x):
            in_b.set()
            assert b_may_start.wait(30)
            return super().forward(x)

    def convert(name: str, model: nn.Module) -> None:
        with pytest.warns(UserWarning) if name == "b" else warnings.catch_warnings():
            reports[name] = linearize.convert(model, example_inputs=x).linearize_report

    a = threading.Thread(target=convert, args=("a", Waits(hold_a)))
    a.start()
    assert in_a.wait(30)
    model_b = SpawnsLate(CALLS["F.relu"][0])
    model_b.a = nn.Sequential(model_b.a, nn.ReLU())
    b = threading.Thread(target=convert, args=("b", model_b))
    b.start()
    assert in_b.wait(30)
    a_may_return.set()
    a.join(30)
    b_may_start.set()
    b.join(30)
    assert reports["a"].threads == {}
    assert list(reports["b"].threads) == ["thread 'side', in <lambda>: relu"], reports["b"].threads
    assert threading.getprofile() is None


def test_a_thread_an_unrelated_thread_starts_during_the_probe_is_not_the_models():
    """While the probe forward runs, another part of the program (a data loader, a service) starts a worker
    that calls F.relu: that call is not the model's and must not be listed (it made every later count warn).
    A thread the forward itself starts still is."""
    in_probe, done = threading.Event(), threading.Event()

    def unrelated_service() -> None:
        in_probe.wait(30)
        worker = threading.Thread(target=lambda: F.relu(torch.ones(2)), name="unrelated-worker")
        worker.start()
        worker.join()
        done.set()

    class Net(nn.Module):
        def __init__(self, starts_one: bool) -> None:
            super().__init__()
            self.fc, self.act, self.starts_one = nn.Linear(4, 4), nn.ReLU(), starts_one

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            in_probe.set()
            done.wait(30)  # the unrelated worker ran while this forward (the probe) did
            if self.starts_one:
                t = threading.Thread(target=lambda: F.gelu(x), name="own-worker")
                t.start()
                t.join()
            return self.act(self.fc(x))

    for starts_one, listed in ((False, []), (True, ["own-worker"])):
        in_probe.clear()
        done.clear()
        service = threading.Thread(target=unrelated_service)
        service.start()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = linearize.convert(Net(starts_one), example_inputs=torch.randn(2, 4))
        service.join(30)
        assert done.is_set()
        threads = model.linearize_report.threads
        assert [name for name in ("unrelated-worker", "own-worker") if any(name in k for k in threads)] == listed
