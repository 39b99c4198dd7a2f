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
from typing import Any, Callable

import torch
from torch import nn

from .blend import convert_blend
from .config import BlendConfig, GatedConfig, LinearizeConfig
from .functional_sites import FunctionalSites
from .injection import CallSites, ConversionReport, function_attributes_wrapped, plan_conversion
from .unit import LinearizableActivation

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
    converted = _converted_submodules(model)
    if "" in converted:
        raise ValueError(
            "this model is already converted (it has linearize units); convert the original model, "
            "or load saved units with linearize.from_pretrained(fresh_model, directory)"
        )
    if converted:
        raise ValueError(
            f"linearize.convert: submodule(s) {converted} already converted (they hold linearize units), and one "
            "model cannot hold the units of two conversions (units, count_units, the Sparsifier and saves would mix "
            f"them; exclude_modules cannot leave them out). Fix: put the original of {converted[0]!r} in its place "
            "and convert the whole model; or, for a converted teacher or frozen backbone, hold it outside the "
            f"module tree (self._{converted[0].rpartition('.')[2]} = [converted], a list is no submodule), where "
            "it runs as it is; the model is left as given")
    from .hf import refuse_stripped

    refuse_stripped(model)  # saved converted, loaded plain: its units were dropped
    compiled = [name for name, m in model.named_modules() if _is_compiled(m)]
    if compiled:
        name = compiled[0]
        fix = ("convert the module it compiles, then compile the result: torch.compile(linearize.convert("
               "model._orig_mod, ...))") if not name else (
            f"put the module it compiles back, model.set_submodule({name!r}, model.get_submodule({name!r})._orig_mod), "
            "convert the model, then compile it (or that module again)")
        raise ValueError(
            f"linearize.convert: {'the model' if not name else repr(name)} is a torch.compile'd module "
            "(OptimizedModule): convert probes and swaps the Python modules and activation calls, which "
            f"TorchDynamo runs as compiled code instead. Fix: {fix}; the model is left as given")


def _converted_submodules(model: nn.Module) -> list[str]:
    """The names of the outermost modules of ``model`` that a conversion made or changed (``""``: ``model``
    itself): converted models (``linearize_config``), else the units and call-site dispatchers outside them."""
    found: list[str] = []
    for name, m in model.named_modules():
        if any(name.startswith(f + ".") for f in found if f) or "" in found:
            continue
        if hasattr(m, "linearize_config") or isinstance(m, (LinearizableActivation, CallSites, FunctionalSites)):
            found.append(name)
    return found


def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns (told by its class, so that
    ``torch._dynamo``, slow to import, is not imported for a model that has none)."""
    return type(module).__name__ == "OptimizedModule" and type(module).__module__.startswith("torch._dynamo")


def _convert_gated(model: nn.Module, config: GatedConfig, example_inputs: Any) -> nn.Module:
    """The DGN / DLGN split of ``model`` as a new module (``model`` is left untouched)."""
    from .gated import convert_gated  # imported on use: it loads tqdm

    return convert_gated(model, config, example_inputs)


# config type -> the method that converts with it (looked up along the config's class hierarchy)
_METHODS: dict[type[LinearizeConfig], Callable[[nn.Module, Any, Any], nn.Module]] = {
    BlendConfig: convert_blend,
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
    with function_attributes_wrapped(probe_model):
        return plan_conversion(probe_model, config, example_inputs, functional=True)[0]

