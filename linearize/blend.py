"""The blend conversion (``linearize.convert`` with a :class:`~linearize.config.BlendConfig`): a
linearizable unit in place of every selected activation call site (the units of in-place activation
modules write into their input, as those did). Low in the package: ``linearize.conversion`` dispatches
to it and to the gated split (:mod:`linearize.gated`)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from .activations import FunctionalActivation, activation_kind, module_arguments
from .config import BlendConfig
from .example_inputs import guess_example_inputs
from .functional_sites import FunctionalSites, install_functional_sites
from .injection import (call_channels, install_call_sites, plan_conversion, restored_on_error, settle_placed_modules,
                        wrap_function_attributes)
from .dispatch import THREAD_CALL
from .inputs import call_model, eval_mode, map_tensors, output_tensors
from .unit import LinearizableActivation, install_optimizer_hooks, make_unit


def convert_blend(model: nn.Module, config: BlendConfig, example_inputs: Any) -> nn.Module:
    """Blend units in place of every selected activation call site of ``model`` (in place)."""
    with restored_on_error(model):  # all or nothing: the model is left as given when anything here raises
        # the probe runs on a copy: a model whose first activation works in place would rewrite the caller's inputs
        probe_inputs = None if example_inputs is None else map_tensors(example_inputs, torch.clone)
        wrap_function_attributes(model)
        report, plan, owner_plans = plan_conversion(model, config, probe_inputs, functional=True)
        if not report.sites:
            raise _nothing_to_convert(model, config, report)
        param = next(model.parameters(), None)
        # new units go to the model's device; float64 models get float64 slopes, low precision ones float32
        dtype = param.dtype if param is not None and param.dtype == torch.float64 else None
        hooked: list[nn.Module] = []
        placed: list[tuple[nn.Module, nn.Module, nn.Module]] = []  # (owner, the replaced module, what replaced it)
        for owner, attr, act, calls in plan:
            made = [
                act if call.gate is not None else make_unit(  # an excluded gate call keeps act
                    act.fn if isinstance(act, FunctionalActivation) else act, call.shape, call.channel_dim,
                    activation_kind(act), config.init_slope, config.granularity, call.where or type(act).__name__)
                for call in calls
            ]
            if param is not None:
                made = [u.to(param.device, dtype) for u in made]
            if getattr(act, "inplace", False):  # write into the input as act did: any later read of it (another
                for unit in made:  # path, a hook, a buffer) sees what it saw in the original
                    if isinstance(unit, LinearizableActivation):
                        unit.inplace = True
            install_call_sites(owner, attr, made, [c.check for c in calls], [c.position for c in calls])
            getattr(owner, attr).train(act.training)  # new units (and dispatcher) take the replaced flag
            if getattr(owner, attr) is not act:
                placed.append((owner, act, getattr(owner, attr)))
                if carry_hooks(act, getattr(owner, attr)):
                    hooked.append(act)
        for act in hooked:  # the units call act (GELU, ...): its hooks now run once per call, on the unit
            for name in HOOK_DICTS:
                setattr(act, name, type(getattr(act, name))())
        for p in owner_plans:
            made = {
                k: make_unit(p.calls[k].act, site.input_shape, site.channel_dim, site.kind, config.init_slope,
                             config.granularity, site.name)
                for k, site in p.units.items()
            }
            if param is not None:
                made = {k: u.to(param.device, dtype) for k, u in made.items()}
            sites = FunctionalSites(p.name, [c.kind for c in p.calls], [call_channels(c) for c in p.calls], made,
                                    [module_arguments(c.act) if c.act is not None else None for c in p.calls],
                                    p.repeat, [c.check for c in p.calls], [c.position for c in p.calls])
            install_functional_sites(p.owner, sites)
        settle_placed_modules(model)
        _restore_unreached(model, example_inputs, placed, report)
        if not report.sites:
            raise _nothing_to_convert(model, config, report)
        model.linearize_config = config
        model.linearize_report = report
        install_optimizer_hooks()
        problems = report.problems()
        if problems:
            warnings.warn(
                f"linearize.convert left {len(problems)} activation(s) unconverted (see model.linearize_report):\n  "
                + "\n  ".join(problems),
                stacklevel=3,
            )
        return model


# the hook registries of a module that a unit takes over from the activation module it replaces
HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def carry_hooks(act: nn.Module, new: nn.Module) -> bool:
    """Give ``new`` (the unit or dispatcher put in place of the activation module ``act``) the hooks a user
    registered on ``act``: the same registries, so they run on every call of the site and the user's handles
    still remove them. Returns whether ``act`` had any."""
    if not any(getattr(act, name) for name in HOOK_DICTS):
        return False
    for name in HOOK_DICTS:
        setattr(new, name, getattr(act, name))
    new._is_full_backward_hook = act._is_full_backward_hook
    return True


UNREACHED = ("called through a reference convert cannot replace (a plain list or tuple, a functools.partial, a "
             "closure): the unit put at its name was not called, so the activation is left as it is. Fix: hold the "
             "modules in an nn.ModuleList / nn.Sequential, or call the activation by its attribute")


def _restore_unreached(model: nn.Module, example_inputs: Any, placed: list[tuple[nn.Module, nn.Module, nn.Module]],
                       report: Any) -> None:
    """Put back each replaced activation module whose replacement the model's forward does not call (it reaches
    the old module another way), and list it in ``report.unreachable``: its slopes would do nothing, and
    ``nonlinear_fraction`` would call the model linear where it is not. One forward on the probe's inputs."""
    if not placed:
        return
    calls = {id(new): 0 for _, _, new in placed}
    count = lambda module, args: calls.__setitem__(id(module), calls[id(module)] + 1)  # noqa: E731
    handles = [new.register_forward_pre_hook(count) for _, _, new in placed]
    try:  # a dispatch the forward cannot make (a call on another thread) raises: convert gives the model back
        _outputs(model, example_inputs if example_inputs is not None else guess_example_inputs(model))
    finally:
        for h in handles:
            h.remove()
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    for owner, act, new in placed:
        if calls[id(new)]:
            continue
        name = names.get(id(new), type(act).__name__)
        for attr in [a for a, m in owner._modules.items() if m is new]:
            setattr(owner, attr, act)
        carry_hooks(new, act)
        report.sites = [s for s in report.sites if s.name != name and not s.name.startswith(name + ".")]
        report.unreachable[name] = UNREACHED


def _outputs(model: nn.Module, inputs: Any, training: bool = False) -> list[torch.Tensor]:
    """Every output tensor of ``model`` in eval mode (every module's flag put back after), or with ``training``
    in training mode on a deep copy of ``model`` (a training forward may change the model in ways nothing can
    put back: BatchNorm statistics, a parameter updated in place such as an EMA, a step counter; a model that
    cannot be deep-copied raises), on a copy of ``inputs`` (an in-place activation of the input must not change
    the next call's), with the random generators at one fixed state (the same dropout masks in every call)."""
    if training:
        model = copy.deepcopy(model)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # else no CUDA generator to fork or seed
    with eval_mode(model), torch.no_grad(), torch.random.fork_rng(
            devices=list(range(torch.cuda.device_count())) if cuda else []):
        model.train(training)
        torch.default_generator.manual_seed(0)  # not torch.manual_seed: it also seeds (or queues a seed for) CUDA
        if cuda:
            torch.cuda.manual_seed_all(0)
        out = call_model(model, map_tensors(inputs, torch.clone))
    return [t.clone() for t in output_tensors(out)]


def _nothing_to_convert(model: nn.Module, config: BlendConfig, report: Any) -> ValueError:
    """The error for a model with no activation call site to convert (what the probe saw instead)."""
    return ValueError(
        f"{type(model).__name__} has no convertible activation (kinds {list(config.activations)})."
        + (f" Functional calls seen: {', '.join(report.functional_calls)}" if report.functional_calls else "")
        + (f" Nonlinearities no kind covers: {', '.join(f'{n} ({w})' for n, w in report.unsupported.items())}."
           if report.unsupported else "")
        + (f" Left as multiplicative gates: {', '.join(report.gates)} (convert(..., gates='include') converts them)."
           if report.gates else "")
        + (f" Activation calls {', '.join(map(repr, report.threads))} ran {THREAD_CALL}." if report.threads else "")
        + "".join(f" {name}: {why}." for name, why in report.unreachable.items())
    )
