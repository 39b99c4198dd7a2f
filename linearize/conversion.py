"""``linearize.convert``: swap every activation call site of a model for a linearizable unit.

How it works (like PEFT's injection, but per *call*, not per module):

1. Plain activation functions stored as module attributes (e.g. an HF config's ``hidden_act``
   callable kept as ``self.act_fn = F.gelu``) are wrapped in a :class:`FunctionalActivation`
   module so that they become swappable.
2. One probe forward on ``example_inputs`` (eval mode, no grad; the model's mode is restored)
   records, with global module hooks, every call of every activation module: which module's
   ``forward`` made the call, the input shape and the last leaf layer that ran before it (to infer
   the channel dimension). A ``TorchFunctionMode`` records functional activation calls made
   inside ``forward`` code (``F.relu`` in torchvision DenseNet, ``x.relu_()``, ``torch.tanh`` ...),
   with the module whose own forward made them. The same forward follows every
   activation output (through views and reshapes) into products: a call whose output
   multiplies another tensor as a gate (squeeze-excitation ``x * sigmoid(s)``, see
   ``LinearizeConfig.gates``) is left as it is by default and listed in ``report.gates``.
3. Each registration ``owner.attr`` of an activation module is replaced: by one
   :class:`~linearize.unit.LinearizableActivation` when ``owner`` calls it once per forward, or by
   a :class:`CallSites` dispatcher holding one unit per call when it is reused (torchvision
   ``BasicBlock.relu`` is called twice, ``Bottleneck.relu`` three times, on different widths).
4. Functional activation calls (``F.relu``, ``x.relu_()``, ``F.gelu``, ``torch.sigmoid``, ``torch.tanh``
   ...: ``FUNCTIONAL_SPECS``) get one unit per call of their owner's forward, held by a
   :class:`~linearize.functional_sites.FunctionalSites` child of the owner and dispatched by call
   order (see that module); gates among them stay as they are, like gate modules.

The model keeps its class, methods and the parameter names of untouched layers; nothing is
traced into a ``GraphModule``. Right after conversion it computes exactly the same function:
``a = 0`` units reproduce their activation bit for bit.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable

import torch
from torch import nn

from .activations import FunctionalActivation, activation_kind
from .example_inputs import guess_example_inputs
from .inputs import call_model, eval_mode, map_tensors, max_difference, output_tensors
from .config import BlendConfig, GatedConfig, LinearizeConfig
from .functional_sites import FunctionalSites, install_functional_sites
from .injection import (CallSites, ConversionReport, call_channels, install_call_sites, plan_conversion,
                        wrap_function_attributes)
from .unit import LinearizableActivation, install_optimizer_hooks

__all__ = ["convert", "dry_run"]


def _resolve_config(config: LinearizeConfig | dict | None, overrides: dict) -> LinearizeConfig:
    if config is None:
        return LinearizeConfig(**overrides)
    if isinstance(config, dict):
        return LinearizeConfig.from_dict({**config, **overrides})
    if not isinstance(config, LinearizeConfig):
        raise TypeError(f"config must be a LinearizeConfig, a dict or None, got {type(config).__name__}")
    return config.replace(**overrides) if overrides else config


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"linearize.convert expects a torch.nn.Module, got {type(model).__name__}")
    if hasattr(model, "linearize_config") or any(
        isinstance(m, (LinearizableActivation, CallSites, FunctionalSites)) for m in model.modules()
    ):
        raise ValueError(
            "this model is already converted (it has linearize units); convert the original model, "
            "or load saved units with linearize.from_pretrained(fresh_model, directory)"
        )
    from .hf import refuse_stripped

    refuse_stripped(model)  # saved converted, loaded plain: its units were dropped


def _convert_blend(model: nn.Module, config: BlendConfig, example_inputs: Any) -> nn.Module:
    """Blend units in place of every selected activation call site of ``model`` (in place)."""
    wrap_function_attributes(model)
    # the probe runs on a copy: a model whose first activation works in place would rewrite the caller's inputs
    probe_inputs = None if example_inputs is None else map_tensors(example_inputs, torch.clone)
    report, plan, owner_plans = plan_conversion(model, config, probe_inputs, functional=True)
    if not report.sites:
        raise ValueError(
            f"{type(model).__name__} has no convertible activation (kinds {list(config.activations)})."
            + (f" Functional calls seen: {', '.join(report.functional_calls)}" if report.functional_calls else "")
        )
    param = next(model.parameters(), None)
    # new units go to the model's device; float64 models get float64 slopes, low precision ones float32
    dtype = param.dtype if param is not None and param.dtype == torch.float64 else None
    # an in-place activation whose input the model reads again after the call (out = act(h) + h): an
    # out-of-place unit would change the function, so compare with the original before and after
    inplace_sites = any(getattr(act, "inplace", False) for _, _, act, _ in plan)
    if inplace_sites:
        inputs = example_inputs if example_inputs is not None else guess_example_inputs(model)
        reference = _outputs(model, inputs)
    from_inplace: list[LinearizableActivation] = []
    for owner, attr, act, calls in plan:
        made = [
            act if call.gate is not None else LinearizableActivation(  # an excluded gate call keeps act
                act.fn if isinstance(act, FunctionalActivation) else act,
                num_channels=call.shape[call.channel_dim],
                channel_dim=call.channel_dim,
                kind=activation_kind(act),
                init_slope=config.init_slope,
            )
            for call in calls
        ]
        if param is not None:
            made = [u.to(param.device, dtype) for u in made]
        if getattr(act, "inplace", False):
            from_inplace += [u for u in made if isinstance(u, LinearizableActivation)]
        install_call_sites(owner, attr, made)
        getattr(owner, attr).train(act.training)  # new units (and dispatcher) take the replaced flag
    for p in owner_plans:
        made = {
            k: LinearizableActivation(p.calls[k].act, num_channels=site.num_channels, channel_dim=site.channel_dim,
                                      kind=site.kind, init_slope=config.init_slope)
            for k, site in p.units.items()
        }
        if param is not None:
            made = {k: u.to(param.device, dtype) for k, u in made.items()}
        sites = FunctionalSites(p.name, [c.kind for c in p.calls], [call_channels(c) for c in p.calls], made)
        install_functional_sites(p.owner, sites)
    if inplace_sites:
        _keep_inplace(model, inputs, reference, from_inplace)
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


def _outputs(model: nn.Module, inputs: Any) -> list[torch.Tensor]:
    """Every output tensor of ``model`` in eval mode on a copy of ``inputs`` (an in-place activation of
    the input must not change the next call's), with the random generators at one fixed state."""
    with eval_mode(model), torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = call_model(model, map_tensors(inputs, torch.clone))
    return [t.clone() for t in output_tensors(out)]


def _keep_inplace(model: nn.Module, inputs: Any, reference: list[torch.Tensor],
                  units: list[LinearizableActivation]) -> None:
    """If the converted ``model`` at slopes 0 differs from its ``reference`` outputs, make the ``units``
    of in-place activations write into their input as those did (``unit.inplace``: a copy per call when
    gradients flow), and warn if that does not restore the original function either. The units'
    slopes are restored afterwards (``init_slope`` may be other than 0)."""
    every = [m for m in model.modules() if isinstance(m, LinearizableActivation)]
    slopes = [u.slope.detach().clone() for u in every]

    def error() -> float:
        with torch.no_grad():
            for u in every:
                u.slope.zero_()
        out = _outputs(model, inputs)
        if len(out) != len(reference) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(reference, out)):
            return math.inf
        if any(not torch.equal(a, b) for a, b in zip(reference, out) if not a.is_floating_point()):
            return math.inf  # integer outputs (predicted classes) must not change at all
        floats = [(a, b) for a, b in zip(reference, out) if a.is_floating_point()]
        err, scale = max_difference([a for a, _ in floats], [b for _, b in floats])
        return err if err > 1e-5 * max(scale, 1e-12) else 0.0

    try:
        if error():
            for unit in units:
                unit.inplace = True
            left = error()
            if left:
                warnings.warn(f"linearize.convert: the converted {type(model).__name__} differs from the original "
                              f"by {left:.3g} at slopes 0 on the probe input; please report this model", stacklevel=4)
    finally:
        with torch.no_grad():
            for u, a in zip(every, slopes):
                u.slope.copy_(a)


def _convert_gated(model: nn.Module, config: GatedConfig, example_inputs: Any) -> nn.Module:
    """The DGN / DLGN split of ``model`` as a new module (``model`` is left untouched)."""
    from .gated import convert_gated  # imported on use: it loads tqdm

    return convert_gated(model, config, example_inputs)


# config type -> the method that converts with it (looked up along the config's class hierarchy)
_METHODS: dict[type[LinearizeConfig], Callable[[nn.Module, Any, Any], nn.Module]] = {
    BlendConfig: _convert_blend,
    GatedConfig: _convert_gated,
}


def _method(config: LinearizeConfig) -> Callable[[nn.Module, Any, Any], nn.Module]:
    for cls in type(config).__mro__:
        if cls in _METHODS:
            return _METHODS[cls]
    raise TypeError(f"no conversion method for {type(config).__name__}; use a BlendConfig or a GatedConfig")


def convert(
    model: nn.Module,
    config: LinearizeConfig | dict | None = None,
    example_inputs: Any = None,
    **overrides: Any,
) -> nn.Module:
    """Swap every activation call site of ``model`` for a linearizable unit (``"prelu"``: in place)
    or build its gated split (``"dgn"``/``"dlgn"``: a new model, ``model`` untouched).

    The config's type picks the method: a :class:`~linearize.config.BlendConfig` (``mode="prelu"``,
    the default) or a :class:`~linearize.config.GatedConfig` (``mode="dgn"`` / ``"dlgn"``).

    Args:
        model: any ``nn.Module`` (torchvision, Hugging Face, your own).
        config: a config (or its dict, with ``mode``); ``overrides`` set single fields
            (``convert(model, exclude_modules=["pooler.activation"])``, ``convert(model, mode="dgn", beta=2.0)``).
            An option of another method (``init_slope`` with ``mode="dgn"``, ``beta`` with
            ``"prelu"``) raises ``TypeError`` naming it and the mode.
        example_inputs: the probe input: a tensor, a tuple of positional arguments or a dict of
            keyword arguments. ``None`` builds one for torchvision and HF models
            (:func:`linearize.example_inputs.guess_example_inputs`).

    Returns:
        ``"prelu"``: ``model`` itself, modified in place, with ``model.linearize_config`` and
        ``model.linearize_report`` (a :class:`ConversionReport`) set. ``"dgn"``/``"dlgn"``: a new
        :class:`~linearize.gated.GatedNetwork` (built from deep copies; ``model`` is not modified).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or an option of another method. ValueError:
        already converted, or no convertible activation found (the message lists functional calls it saw).

    Warns when some activations cannot be converted (functional calls inside ``forward``,
    modules never called during the probe); they are listed in ``model.linearize_report``.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> x = torch.randn(3, 4)
        >>> ref = net(x)
        >>> model = linearize.convert(net, example_inputs=x)  # in place: model is net
        >>> [name for name, _ in linearize.units(model)], torch.equal(model(x), ref)  # exact at init
        (['1'], True)
    """
    _check_model(model)
    config = _resolve_config(config, overrides)
    converted = _method(config)(model, config, example_inputs)
    from .hf import mark

    # config.json of model.save_pretrained / Trainer checkpoints carries the manifest; a gated split's
    # HF networks saved alone would load as another function: guard them
    mark(converted)
    return converted


def dry_run(
    model: nn.Module, config: LinearizeConfig | dict | None = None, example_inputs: Any = None, **overrides: Any
) -> ConversionReport:
    """What :func:`convert` would do (the sites a ``"prelu"`` conversion would swap), as a report;
    ``model`` is not modified (the probe runs on a deep copy)."""
    _check_model(model)
    config = _resolve_config(config, overrides)
    probe_model = copy.deepcopy(model)
    wrap_function_attributes(probe_model)
    return plan_conversion(probe_model, config, example_inputs, functional=True)[0]

