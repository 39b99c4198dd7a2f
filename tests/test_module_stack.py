"""The module call stack that convert's probe, DLGN's audit, linear_regions and fold share (ModuleStack):
checked against stacks written out by hand for hand-written models, after exceptions inside nested
forwards, for a module called inside its own call, and with two threads running forwards at once."""

from __future__ import annotations

import doctest
import threading

import pytest
import torch
from torch import nn

import linearize
import linearize.module_stack as module_stack
from linearize.folding.probe import Probe, run_counting
from linearize.module_stack import ModuleStack
from linearize.unit import LinearizableActivation


class Log:
    """Where modules write the stack they see: ``(thread name, [names of the running modules])``."""

    def __init__(self) -> None:
        self.tracker: ModuleStack | None = None
        self.seen: list[list[str]] = []
        self.lock = threading.Lock()

    def record(self) -> None:
        names = [self.tracker.names.get(id(m), f"<{type(m).__name__}>") for m in self.tracker.stack]
        with self.lock:
            self.seen.append(names)


class Leaf(nn.Module):
    """Records the stack it sees; raises instead when ``fail`` is set; waits at ``barrier`` if given."""

    def __init__(self, log: Log) -> None:
        super().__init__()
        self.log, self.fail, self.barrier = log, False, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.barrier is not None:
            self.barrier.wait()
        self.log.record()
        if self.fail:
            raise ValueError("leaf failed")
        return x + 1


class Block(nn.Module):
    def __init__(self, log: Log) -> None:
        super().__init__()
        self.inner = Leaf(log)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.inner(x))  # one module called twice


class Net(nn.Module):
    """``a``, then ``block`` (``block.inner`` twice), then ``a`` again."""

    def __init__(self, log: Log) -> None:
        super().__init__()
        self.a, self.block = Leaf(log), Block(log)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.block(self.a(x)))


EXPECTED = [["", "a"], ["", "block", "block.inner"], ["", "block", "block.inner"], ["", "a"]]


def tracked(net: nn.Module, log: Log, **kwargs) -> ModuleStack:
    log.tracker = ModuleStack(net, **kwargs)
    return log.tracker


@pytest.mark.parametrize("every_module", [False, True], ids=["model hooks", "global hooks"])
def test_the_stack_inside_each_forward_is_the_chain_of_calls(every_module):
    log = Log()
    net = Net(log)
    with tracked(net, log, every_module=every_module) as tracker:
        assert tracker.stack == []
        net(torch.zeros(1))
        assert tracker.stack == []
    assert log.seen == EXPECTED


def test_enter_sees_the_caller_and_leave_gets_what_enter_kept():
    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
    names = {id(m): n for n, m in net.named_modules()}
    events = []

    def enter(module, args, kwargs):
        caller = names[id(tracker.stack[-1])] if tracker.stack else None
        events.append(("enter", names[id(module)], caller, sorted(kwargs)))
        return f"kept {names[id(module)]}"

    def leave(module, args, output, kept):
        events.append(("leave", names[id(module)], [names[id(m)] for m in tracker.stack], kept))

    with ModuleStack(net, enter=enter, leave=leave) as tracker:
        net(torch.ones(1, 2))
    assert events == [
        ("enter", "", None, []),
        ("enter", "0", "", []),
        ("leave", "0", [""], "kept 0"),
        ("enter", "1", "", []),
        ("enter", "1.0", "1", []),
        ("leave", "1.0", ["", "1"], "kept 1.0"),
        ("leave", "1", [""], "kept 1"),
        ("leave", "", [], "kept "),
    ]


class Keyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(input=x)


def test_enter_gets_the_keyword_arguments_on_model_hooks():
    net = Keyword()
    seen = []
    with ModuleStack(net, enter=lambda m, args, kwargs: seen.append((type(m).__name__, sorted(kwargs)))):
        net(torch.ones(1, 2))
    assert seen == [("Keyword", []), ("Linear", ["input"])]


@pytest.mark.parametrize("every_module", [False, True], ids=["model hooks", "global hooks"])
def test_an_exception_in_a_nested_forward_leaves_the_stack_clean(every_module):
    log = Log()
    net = Net(log)
    net.block.inner.fail = True
    left = []
    with tracked(net, log, every_module=every_module, leave=lambda m, *_: left.append(log.tracker.names[id(m)])):
        with pytest.raises(ValueError, match="leaf failed"):
            net(torch.zeros(1))
        assert log.tracker.stack == []
        assert left == ["a"]  # only the call that returned: not block.inner, block or the root
        net.block.inner.fail = False
        log.seen.clear()
        net(torch.zeros(1))  # a clean forward after it
        assert log.tracker.stack == []
    assert log.seen == EXPECTED


class Fallback(nn.Module):
    """Catches the failure of ``bad`` inside its forward, then runs ``good``."""

    def __init__(self, log: Log) -> None:
        super().__init__()
        self.bad, self.good = Block(log), Leaf(log)
        self.bad.inner.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            x = self.bad(x)
        except ValueError:
            pass
        return self.good(x)


@pytest.mark.parametrize("every_module", [False, True], ids=["model hooks", "global hooks"])
def test_an_exception_caught_inside_a_forward_pops_the_failed_calls(every_module):
    log = Log()
    net = Fallback(log)
    left = []
    with tracked(net, log, every_module=every_module, leave=lambda m, *_: left.append(log.tracker.names[id(m)])):
        net(torch.zeros(1))
    assert log.seen == [["", "bad", "bad.inner"], ["", "good"]]
    assert left == ["good", ""]


class Recursive(nn.Module):
    """Calls itself ``depth`` times, recording the stack at each level; the innermost call raises when
    ``fail`` is set and the level above catches it, then records again."""

    def __init__(self, log: Log) -> None:
        super().__init__()
        self.log, self.fail = log, False

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        self.log.record()
        if depth == 0:
            if self.fail:
                raise ValueError("innermost failed")
            return x
        try:
            x = self(x, depth - 1)
        except ValueError:
            self.log.record()
        return x


class Holder(nn.Module):
    def __init__(self, log: Log) -> None:
        super().__init__()
        self.r = Recursive(log)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.r(x, 2)
        self.r.log.record()
        return out


@pytest.mark.parametrize("every_module", [False, True], ids=["model hooks", "global hooks"])
@pytest.mark.parametrize("fail", [False, True], ids=["returns", "innermost raises"])
def test_a_module_called_inside_its_own_call(every_module, fail):
    log = Log()
    net = Holder(log)
    net.r.fail = fail
    with tracked(net, log, every_module=every_module) as tracker:
        net(torch.zeros(1))
        assert tracker.stack == []
    caught = [["", "r", "r"]] if fail else []  # back in the middle call after the innermost one raised
    assert log.seen == [["", "r"], ["", "r", "r"], ["", "r", "r", "r"], *caught, [""]]


def test_two_threads_running_forwards_at_once_see_their_own_stacks():
    log = Log()
    net = Net(log)
    barrier = threading.Barrier(2, timeout=30)
    net.block.inner.barrier = barrier  # both threads are inside block.inner at the same time, twice
    errors = []

    def work() -> None:
        try:
            net(torch.zeros(1))
        except Exception as err:  # reported below, with the thread's stack
            errors.append(err)

    with tracked(net, log):
        threads = [threading.Thread(target=work, name=f"worker {i}") for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert log.tracker.stack == []  # this thread ran no forward
    assert not errors and not any(t.is_alive() for t in threads)
    assert sorted(log.seen) == sorted(EXPECTED + EXPECTED)


def test_a_forward_on_another_thread_does_not_show_in_this_threads_stack():
    log, other_log = Log(), Log()
    net, other = Net(log), Net(other_log)
    started, finish = threading.Event(), threading.Event()

    class Waits(nn.Module):
        """Keeps the other thread inside ``other``'s forward while this thread runs ``net``."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            started.set()
            finish.wait(timeout=30)
            return x

    other.a = Waits()
    outer = nn.ModuleDict({"net": net, "other": other})
    log.tracker = other_log.tracker = ModuleStack(outer, every_module=True)
    worker = threading.Thread(target=lambda: other(torch.zeros(1)))
    with log.tracker:
        worker.start()
        assert started.wait(timeout=30)
        net(torch.zeros(1))
        finish.set()
        worker.join(timeout=60)
    assert not worker.is_alive()
    assert log.seen == [["net", "net.a"], ["net", "net.block", "net.block.inner"],
                        ["net", "net.block", "net.block.inner"], ["net", "net.a"]]
    assert other_log.seen == [["other", "other.block", "other.block.inner"]] * 2


class Spawns(nn.Module):
    """Runs ``child`` on a thread its forward starts, then on its own thread."""

    def __init__(self, log: Log) -> None:
        super().__init__()
        self.child = Leaf(log)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = {}
        worker = threading.Thread(target=lambda: out.update(y=self.child(x)))
        worker.start()
        worker.join(timeout=60)
        return self.child(out["y"])


@pytest.mark.parametrize("every_module", [False, True], ids=["model hooks", "global hooks"])
def test_a_thread_the_forward_starts_runs_inside_the_forwards_modules(every_module):
    log = Log()
    net = nn.Sequential(Spawns(log))
    with tracked(net, log, every_module=every_module) as tracker:
        net(torch.zeros(1))
        assert tracker.stack == []
    assert log.seen == [["", "0", "0.child"], ["", "0", "0.child"]]  # on the started thread, then on this one


class MakesOne(nn.Module):
    """Runs a module it makes during forward (as Hugging Face's ``ACT2FN[...](x)`` does)."""

    def __init__(self, log: Log) -> None:
        super().__init__()
        self.log = log
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.Sequential(Leaf(self.log))(self.lin(x))


def test_global_hooks_see_modules_made_during_forward():
    log = Log()
    net = MakesOne(log)
    with tracked(net, log, every_module=True):
        net(torch.ones(1, 2))
    assert log.seen == [["", "<Sequential>", "<Leaf>"]]
    log.seen.clear()
    with tracked(net, log):  # model hooks: only the model's own modules
        net(torch.ones(1, 2))
    assert log.seen == [[""]]


def test_innermost_registered_skips_modules_made_during_forward():
    found = []

    class Inner(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            found.append((tracker.names[id(tracker.innermost_registered())], type(tracker.stack[-2]).__name__))
            return x

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.Sequential(Inner())(self.lin(x))

    net = Outer()
    with ModuleStack(net, every_module=True) as tracker:
        net(torch.ones(1, 2))
    assert found == [("", "Sequential")]  # Inner and its Sequential are made in forward: the root owns them


def test_names_are_the_models_with_a_shared_module_under_its_last_name():
    lin = nn.Linear(2, 2)
    net = nn.Sequential(lin, nn.ReLU(), lin)
    tracker = ModuleStack(net)
    assert tracker.names == {id(net): "", id(lin): "2", id(net[1]): "1"}


@pytest.mark.parametrize("every_module", [False, True], ids=["model hooks", "global hooks"])
def test_hooks_are_removed_on_exit_even_after_an_exception(every_module):
    net = nn.Sequential(nn.Linear(2, 2))
    calls = []
    tracker = ModuleStack(net, every_module=every_module, enter=lambda m, *_: calls.append(m))
    with pytest.raises(RuntimeError, match="body failed"):
        with tracker:
            net(torch.ones(1, 2))
            raise RuntimeError("body failed")
    assert len(calls) == 2
    net(torch.ones(1, 2))
    assert len(calls) == 2  # no hook left
    with tracker:  # and it opens again
        net(torch.ones(1, 2))
    assert len(calls) == 4


def test_opening_an_open_tracker_again_is_refused():
    tracker = ModuleStack(nn.Linear(2, 2))
    with tracker:
        with pytest.raises(RuntimeError, match="already open"):
            with tracker:
                pass


def test_the_docstring_example_runs():
    globs = {**vars(module_stack), "torch": torch, "nn": nn}
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(ModuleStack, globs=globs):
        runner.run(test)
    assert runner.summarize(verbose=False).attempted and not runner.summarize(verbose=False).failed


# -- the callers, after an exception caught inside the model's forward

class Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("no")


class ReluAfterFallback(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bad, self.lin, self.act = Raises(), nn.Linear(4, 4), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            x = self.bad(x)
        except ValueError:
            pass
        return self.act(self.lin(x))


def test_convert_finds_the_activation_called_after_a_caught_failure():
    torch.manual_seed(0)
    model, x = ReluAfterFallback().eval(), torch.randn(3, 4)
    want = model(x)
    converted = linearize.convert(model, example_inputs=x)
    assert isinstance(converted.act, LinearizableActivation)  # owned by the root, not by the failed `bad`
    assert [s.name for s in converted.linearize_report.sites] == ["act"]
    torch.testing.assert_close(converted(x), want)


def test_fold_probe_sees_the_caller_after_a_caught_failure():
    model, probe = ReluAfterFallback().eval(), Probe()
    run_counting(model, torch.randn(3, 4), probe)
    assert probe.callers[id(model.lin)] == {id(model)} and probe.callers[id(model.act)] == {id(model)}
    assert id(model.bad) not in probe.calls  # its call raised: no call recorded
