"""Save and load folded models without pickle: ``save_folded(model, dir)`` / ``load_folded(dir)``.

``linearize.fold`` returns a plain model whose structure differs from its family's (a BERT FFN
narrowed plus a ``d x d`` linear path, merged convs, ...), so neither ``model.save_pretrained`` nor a
state dict alone rebuilds it. A folded save holds:

- ``folded-<sha256[:16]>.safetensors``: the whole state dict (loaded strictly), named by its checksum,
  and a *probe*: one input row (``example_inputs``, else a guessed one) and the outputs a float32 CPU
  copy of the saved model gave on it. ``load_folded`` runs the rebuilt model on it and refuses a model that computes something
  else: a base rebuilt with other arguments than the model folded had (timm's ``global_pool`` or
  ``img_size``, which no save records) loads without a complaint otherwise. ``save_folded`` refuses a
  model it cannot make a probe for (inputs it cannot guess: pass ``example_inputs``) unless told
  ``probe=False``;
- ``folded.json``: how to rebuild the structure: the *base* (a Hugging Face class and its config, a
  torchvision or timm builder and its keyword arguments, or ``"plain"``: the caller passes it), then
  every module in order (qualified name, class, constructor arguments). A torchvision model needs
  its ``builder=`` (``save_folded`` refuses it without). Modules of an allow-list
  (``torch.nn`` layers, linearize's fold modules, transformers activations) are built from their
  arguments; any other class is taken from the base at the same name (or, for a module fold moved,
  at its path in the model folded), and must have the same class there. Anything else is refused with a :class:`LoadError` naming the class: loading runs no code
  from the files.

Saves into one folder (several processes, threads) take turns on its save lock
(:func:`linearize._files.save_lock`): the folder always holds one complete save, the last one.
Loads take no lock: ``folded.json`` is replaced by one rename, and a reader re-reads it when a save
removed the weights it named meanwhile.

Example::

    folded = linearize.fold(model, x)
    linearize.save_folded(folded, "deploy/")
    same = linearize.load_folded("deploy/")                  # HF, timm, all-torch.nn models
    same = linearize.load_folded("deploy/", base=MyNet())    # your own classes
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import inspect
import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from ._files import (MAX_JSON_BYTES, LoadError, atomic_write, check_folder, check_given_folder, parse_json, read_file,
                     remove_stale, save_lock)
from ._optional import require
from .distributed import refuse_sharded
from .activations import FUNCTIONAL_SPECS, FUNCTIONS_BY_NAME
from .folding.layers import ORIGIN
from .functional_sites import ATTR as FUNCTIONAL_ATTR, FunctionalSites, install_functional_sites
from .hf import mark_folded
from .manifest import CONFIG_NAME, FOLDED_CONFIG
from .unit import ElementBlend, ElementPReLU

__all__ = ["save_folded", "load_folded", "FOLDED_CONFIG", "folded_weights_name"]

# the weights file: named by its checksum, so that a new save never overwrites the file an older
# folded.json names (folded.safetensors: saves written before that)
_WEIGHTS_FILE = re.compile(r"folded(-[0-9a-f]{16})?\.safetensors")
FORMAT_VERSION = 1
_JSON = (bool, int, float, str, type(None))
_PROBE = "__linearize_probe__."  # prefix of the probe's tensors in the weights file


# ----------------------------------------------------------------------------- allow-list


def _nn_classes() -> dict[str, type]:
    found = {}
    for name in dir(nn):
        obj = getattr(nn, name)
        if isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__.startswith("torch.nn.modules"):
            found[f"torch.nn.{name}"] = obj
    # nn.MultiheadAttention's out_proj: a Linear under another name (the class exists to refuse quantization)
    from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

    found["torch.nn.modules.linear.NonDynamicallyQuantizableLinear"] = NonDynamicallyQuantizableLinear
    return found


def _fold_classes() -> dict[str, type]:
    from .activations import FunctionalActivation
    from .folding import conv, modules
    from .injection import CallSites

    classes = [modules.ChannelPReLU, modules.ChannelBlend, modules.LinearWithPassthrough, modules.ConvWithPassthrough,
               modules.Residual, conv.BorderBiasConv, conv.BorderExactConv, ElementPReLU, ElementBlend]
    found = {f"{c.__module__}.{c.__qualname__}": c for c in classes}
    # files written before fold became a package name the classes linearize.folding.<name>
    found.update({f"linearize.folding.{c.__qualname__}": c for c in classes})
    # files written before the plain forms of units moved into linearize.unit
    found.update({f"linearize.folding.modules.{c.__qualname__}": c for c in (modules.ChannelPReLU, modules.ChannelBlend)})
    # files written while the residual block of fold was private
    found.update({f"linearize.folding{path}._Residual": modules.Residual for path in ("", ".modules")})
    found["linearize.activations.FunctionalActivation"] = FunctionalActivation
    found["linearize.injection.CallSites"] = CallSites  # one plain module per call of a reused site
    found["linearize.functional_sites.FunctionalSites"] = FunctionalSites  # F.relu(...) calls in a forward
    # files written before the injection core moved out of conversion.py
    found["linearize.conversion.FunctionalActivation"] = FunctionalActivation
    found["linearize.conversion.CallSites"] = CallSites
    return found


def _hf_activation(name: str) -> type | None:
    if not name.startswith("transformers.activations."):
        return None
    try:
        acts = importlib.import_module("transformers.activations")
    except ImportError:
        return None
    cls = getattr(acts, name.rsplit(".", 1)[1], None)
    return cls if isinstance(cls, type) and issubclass(cls, nn.Module) else None


def _timm_activation(name: str) -> type | None:
    """timm's activation classes (``timm.layers.activations.GELU`` ...): built from their arguments, as
    transformers' are (a fold leaves them inside its blend modules, at paths the base does not have)."""
    from .activations import TIMM_KINDS

    module, _, cls_name = name.rpartition(".")
    if module != "timm.layers.activations" or cls_name not in TIMM_KINDS:
        return None
    try:
        cls = getattr(importlib.import_module(module), cls_name, None)
    except ImportError:
        return None
    return cls if isinstance(cls, type) and issubclass(cls, nn.Module) else None


def _allowed(name: str) -> type | None:
    return _nn_classes().get(name) or _fold_classes().get(name) or _hf_activation(name) or _timm_activation(name)


def _class_name(module: nn.Module) -> str:
    cls = type(module)
    if cls.__module__.startswith("torch.nn.modules") and getattr(nn, cls.__name__, None) is cls:
        return f"torch.nn.{cls.__name__}"
    if cls.__module__.startswith("transformers.activations"):
        return f"transformers.activations.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


_FUNCTIONAL_KINDS = {kind for kind, _ in FUNCTIONAL_SPECS.values()}
_FUNCTIONS = FUNCTIONS_BY_NAME  # the activation functions a FunctionalActivation may hold, by saved name


# ----------------------------------------------------------------------------- module specs


def _jsonable(v: Any) -> Any:
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, _JSON):
        return v
    raise TypeError(type(v).__name__)


def _tupled(v: Any) -> Any:
    return tuple(_tupled(x) for x in v) if isinstance(v, list) else v


def _shapes(module: nn.Module) -> dict[str, list[int] | None]:
    """Shapes of the module's own parameters and buffers (None for an attribute set to None)."""
    out: dict[str, list[int] | None] = {}
    for store in (module._parameters, module._buffers):
        for k, t in store.items():
            out[k] = None if t is None else list(t.shape)
    return out


def _attributes(module: nn.Module) -> dict[str, Any]:
    """The plain attributes of ``module`` (JSON values; activation functions of the table by name)."""
    out: dict[str, Any] = {}
    for k, v in vars(module).items():
        if k.startswith("_") or k == "training":
            continue
        name = next((n for n, f in _FUNCTIONS.items() if f is v), None) if callable(v) else None
        if name is not None:
            out[k] = {"function": name}
            continue
        try:
            out[k] = _jsonable(v)
        except TypeError:
            continue  # not data: a forward that reads it fails, and the load's probe names that
    return out


def _generic_args(module: nn.Module) -> dict[str, Any]:
    """Constructor arguments of a ``torch.nn`` layer read back from its attributes of the same names; for
    a layer whose constructor needs what its attributes do not hold (``nn.TransformerEncoder``'s
    ``encoder_layer``, a layer's ``d_model``), ``{"attributes": ...}``: its plain attributes, set on an
    instance made without its constructor (its submodules are rebuilt as its children)."""
    args: dict[str, Any] = {}
    params = inspect.signature(type(module).__init__).parameters
    for p in list(params)[1:]:
        if p in ("device", "dtype", "_weight", "_freeze") or p.startswith("*"):
            continue
        if p == "bias" and ("bias" in module._parameters or hasattr(module, "bias")):
            args[p] = getattr(module, "bias", None) is not None
        elif p in ("elementwise_affine", "affine") and hasattr(module, p):
            args[p] = bool(getattr(module, p))
        elif hasattr(module, p) and not isinstance(getattr(module, p), (nn.Module, torch.Tensor)) and not callable(
            getattr(module, p)
        ):
            try:
                args[p] = _jsonable(getattr(module, p))
            except TypeError:
                raise ValueError(f"cannot record argument {p!r} of {type(module).__name__}") from None
    required = [p for p in list(params.values())[1:] if p.default is p.empty and p.name not in args
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return {"attributes": _attributes(module)} if required else args


def _spec(module: nn.Module) -> dict[str, Any]:
    """``{"args": ...}`` for a module of the allow-list (raises ValueError for an unrecordable one)."""
    from .activations import FunctionalActivation
    from .folding import conv, modules

    if isinstance(module, FunctionalActivation):
        name = next((k for k, f in _FUNCTIONS.items() if f is module.fn), None)
        if name is None:
            raise ValueError(f"activation function {module.fn!r} is not one save_folded can record")
        return {"fn": name, "kind": module.kind}
    if isinstance(module, modules.ChannelPReLU):
        return {"num_parameters": module.num_parameters, "channel_dim": module.channel_dim,
                **({"inplace": True} if module.inplace else {}),
                **({"leak": module.leak} if module.leak is not None else {})}  # what integer inputs get
    if isinstance(module, modules.ChannelBlend):
        return {"channels": module.slope.numel(), "channel_dim": module.channel_dim,
                **({"inplace": True} if module.inplace else {}),
                **({"affine": True} if module._buffers.get("alpha") is not None else {})}  # alpha / beta buffers
    if isinstance(module, (ElementPReLU, ElementBlend)):  # element-level units kept by fold
        return {"map_shape": list(module.map_shape), **({"inplace": True} if module.inplace else {}),
                **({"affine": True} if module._buffers.get("alpha") is not None else {}),
                **({"leak": module.leak} if getattr(module, "leak", None) is not None else {})}
    if isinstance(module, conv.BorderBiasConv):
        return {"tap_bias": list(module.tap_bias.shape), "inner_stride": _jsonable(module.inner_stride),
                "stride": _jsonable(module.stride), "padding": _jsonable(module.padding),
                "dilation": _jsonable(module.dilation)}
    if isinstance(module, conv.BorderExactConv):
        return {"shapes": _shapes(module), "first_geometry": _jsonable(module.first_geometry),
                "second_geometry": _jsonable(module.second_geometry), "geometry": _jsonable(module.geometry)}
    if type(module).__name__ == "CallSites" and any(getattr(module, "after", ())):
        return {"after": list(module.after)}
    if type(module).__name__ in ("Residual", "CallSites"):
        return {}
    if isinstance(module, FunctionalSites):
        return {"owner_name": module.owner_name, "kinds": list(module.kinds), "slots": list(module.slots),
                "channels": [None if c is None else list(c) for c in module.channels],
                "arguments": [None if a is None else [list(pair) for pair in a] for a in module.arguments],
                **({"repeat": True} if module.repeat else {}),
                **({"after": list(module.after)} if any(module.after) else {})}
    return _generic_args(module)


def _functional_sites(args: dict[str, Any]) -> FunctionalSites:
    """A :class:`FunctionalSites` from its record: call kinds, input channels and the slot of every call
    (its modules, the plain forms fold left, are the entry's children and are built next)."""
    kinds, slots, channels = args["kinds"], args["slots"], args["channels"]
    if not (isinstance(kinds, list) and isinstance(slots, list) and isinstance(channels, list)
            and len(kinds) == len(slots) == len(channels) and all(k in _FUNCTIONAL_KINDS for k in kinds)):
        raise ValueError("kinds, slots and channels must be lists of one length, kinds among the activation kinds")
    for i, (kind, slot) in enumerate(zip(kinds, slots)):
        if slot not in (None, f"{kind}_{i}"):
            raise ValueError(f"slot {i} is {slot!r}, not {kind}_{i} or null")
    if not all(c is None or (isinstance(c, list) and len(c) == 2 and all(type(v) is int for v in c)) for c in channels):
        raise ValueError("each channels entry must be null or [channel_dim, width] (two integers)")
    chans = [None if c is None else (c[0], c[1]) for c in channels]
    arguments = args.get("arguments", [None] * len(kinds))  # files written before arguments were recorded
    if not (isinstance(arguments, list) and len(arguments) == len(kinds) and all(
            a is None or (isinstance(a, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                                      and isinstance(p[1], (str, int, float)) for p in a))
            for a in arguments)):
        raise ValueError("arguments must be a list, one entry per call: null or [[name, value], ...]")
    after = args.get("after", [None] * len(kinds))  # files written before loops were told apart
    if not (isinstance(after, list) and len(after) == len(kinds)
            and all(a is None or isinstance(a, str) for a in after)):
        raise ValueError("after must be a list, one entry per call: null or a module name")
    sites = FunctionalSites(str(args["owner_name"]), kinds, chans, {},
                            [None if a is None else tuple((n, v) for n, v in a) for a in arguments],
                            args.get("repeat") is True, after)
    sites.slots = list(slots)
    return sites


def _leak(args: dict[str, Any]) -> float | None:
    """The recorded ``leak`` of a PReLU plain form (the negative slope of the unit's original activation); ``None``
    when absent (saved before it was recorded: integer inputs are then refused)."""
    leak = args.get("leak")
    if leak is not None and (type(leak) not in (int, float) or not math.isfinite(leak)):
        raise ValueError(f"leak must be a finite number or absent, got {leak!r}")
    return None if leak is None else float(leak)


def _build(cls: type, args: dict[str, Any]) -> nn.Module:
    """A module of the allow-listed ``cls`` from its recorded ``args`` (weights are loaded later)."""
    from .activations import FunctionalActivation
    from .folding import conv, modules

    if cls is FunctionalActivation:
        if args.get("fn") not in _FUNCTIONS:
            raise ValueError(f"unknown activation function {args.get('fn')!r}")
        return FunctionalActivation(_FUNCTIONS[args["fn"]], str(args.get("kind")))
    if cls is modules.ChannelPReLU:
        return cls(torch.zeros(int(args["num_parameters"])), int(args["channel_dim"]), args.get("inplace") is True,
                   _leak(args))
    if cls is modules.ChannelBlend:
        ends = (torch.ones(int(args["channels"])), torch.zeros(int(args["channels"]))) if args.get("affine") is True \
            else (None, None)
        return cls(nn.Identity(), torch.zeros(int(args["channels"])), int(args["channel_dim"]),
                   args.get("inplace") is True, *ends)
    if cls in (ElementPReLU, ElementBlend):
        shape = [int(s) for s in args["map_shape"]]
        if not shape or min(shape) < 1:
            raise ValueError(f"map_shape must be positive sizes, got {shape}")
        if cls is ElementPReLU:
            return cls(torch.zeros(shape), args.get("inplace") is True, _leak(args))
        ends = (torch.ones(shape), torch.zeros(shape)) if args.get("affine") is True else (None, None)
        return cls(nn.Identity(), torch.zeros(shape), args.get("inplace") is True, *ends)
    if cls is conv.BorderBiasConv:
        shape = [int(s) for s in args["tap_bias"]]
        return cls(nn.Identity(), torch.zeros([shape[0], *shape[2:]]), *(_tupled(args[k]) for k in
                                                                          ("inner_stride", "stride", "padding", "dilation")))
    if cls is conv.BorderExactConv:
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.conv = nn.Identity()
        for k, shape in args["shapes"].items():
            if k not in ("first_weight", "first_bias", "second_weight"):
                raise ValueError(f"unexpected tensor {k!r}")
            setattr(m, k, None if shape is None else nn.Parameter(torch.zeros(shape), requires_grad=False))
        for k in ("first_geometry", "second_geometry", "geometry"):
            setattr(m, k, _tupled(args[k]))
        return m
    if cls.__name__ == "Residual":
        return cls(nn.Identity(), None)
    if cls.__name__ == "CallSites":
        after = args.get("after")
        if not (after is None or isinstance(after, list) and all(a is None or isinstance(a, str) for a in after)):
            raise ValueError("after must be a list: null or a module name per call")
        return cls([], after=after)
    if cls is FunctionalSites:
        return _functional_sites(args)
    if set(args) == {"attributes"} and "attributes" not in inspect.signature(cls.__init__).parameters:
        return _with_attributes(cls, args["attributes"])
    return cls(**{k: _tupled(v) for k, v in args.items()})


def _with_attributes(cls: type, attributes: Any) -> nn.Module:
    """An instance of the ``torch.nn`` class ``cls`` made without its constructor, given recorded plain
    ``attributes`` (JSON values, or ``{"function": name}`` of the activation table; never a name that
    starts with ``_`` or one of the class's own)."""
    if not isinstance(attributes, dict):
        raise ValueError("attributes must be a mapping")
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    for k, v in attributes.items():
        if not isinstance(k, str) or not k.isidentifier() or k.startswith("_") or hasattr(cls, k):
            raise ValueError(f"attribute {k!r} is not one a save records")
        if isinstance(v, dict):
            if set(v) != {"function"} or v["function"] not in _FUNCTIONS:
                raise ValueError(f"attribute {k!r}: unknown function {v!r}")
            v = _FUNCTIONS[v["function"]]
        setattr(m, k, _tupled(v))
    return m


# ----------------------------------------------------------------------------- base models


def _base_of(model: nn.Module, builder: str | None, builder_kwargs: dict | None, needs_base: bool) -> dict[str, Any]:
    """How :func:`load_folded` builds the base of ``model`` (``needs_base``: some module is not built from its
    description). Raises ``ValueError`` for a torchvision model without ``builder``, which it could not build."""
    from .hf import CONFIG_KEY, GUARD_KEY, is_guard, is_hf_model

    plain = {"kind": "plain", "class": f"{type(model).__module__}.{type(model).__qualname__}"}
    if builder == "plain":  # the caller passes the base to load_folded (a model built by its own code)
        return plain
    if builder is not None:
        family, _, name = builder.partition(":")
        if family not in ("torchvision", "timm") or not name:
            raise ValueError(f"builder must be 'torchvision:NAME', 'timm:NAME' or 'plain', got {builder!r}")
        if not _MODEL_NAME.fullmatch(name):
            raise ValueError(f"builder {builder!r}: NAME must be a plain {family} model name (letters, digits, '_', "
                             "'.', '-'), not a source such as 'hf-hub:ORG/NAME' or 'local-dir:PATH', which would make "
                             "load_folded fetch or read files; it builds the bare model and loads the saved weights")
        reserved = [k for k in _RESERVED_KWARGS[family] if k in (builder_kwargs or {})]
        if reserved:
            raise ValueError(f"builder_kwargs {reserved} would make load_folded fetch or read weights or other files; "
                             "it builds the bare model and loads the saved weights: leave them out")
        return {"kind": family, "name": name, "kwargs": _jsonable_dict(builder_kwargs or {})}
    if is_hf_model(model):
        config = {k: v for k, v in model.config.to_dict().items()
                  if k != CONFIG_KEY and not (k == GUARD_KEY and is_guard(v))}
        return {"kind": "transformers", "class": type(model).__name__, "config": config}
    arch = (getattr(model, "pretrained_cfg", None) or {}).get("architecture")
    if arch and type(model).__module__.startswith("timm."):
        kwargs = {"num_classes": getattr(model, "num_classes", None)}
        return {"kind": "timm", "name": arch, "kwargs": {k: v for k, v in kwargs.items() if v is not None}}
    if needs_base and type(model).__module__.startswith("torchvision."):
        raise ValueError(f"save_folded: {type(model).__module__}.{type(model).__qualname__} is a torchvision model, "
                         "which load_folded cannot rebuild without knowing how it was built: pass "
                         "builder='torchvision:NAME' (the name given to torchvision.models.get_model, e.g. "
                         "'resnet18') and builder_kwargs (e.g. {'num_classes': 10}), or builder='plain' when your own "
                         "code builds it (then load_folded(directory, base=<that model>))")
    return plain


def _jsonable_dict(d: dict) -> dict:
    try:
        return {str(k): _jsonable(v) for k, v in d.items()}
    except TypeError as err:
        raise ValueError(f"builder_kwargs must hold JSON values, got a {err}") from None


# A base built from its record in folded.json may hold at most this many times the bytes of the weights file (or
# BASE_FLOOR_BYTES): fold shrinks a model a few times at most (BatchNorms, merged linear layers), while an edited
# number (num_classes, vocab_size) would have the base allocate whatever it says before anything is checked.
BASE_SIZE_FACTOR, BASE_FLOOR_BYTES = 16, 256 * 2**20


def _build_base(base: dict[str, Any], given: nn.Module | None, path: Path, held: int) -> nn.Module | None:
    """The base model ``folded.json`` records (``given`` when passed), first built on the meta device to check
    its size against the ``held`` bytes of the weights file (:func:`_check_base_size`); :class:`LoadError`
    naming ``path`` when its builder refuses the recorded name or arguments."""
    if given is not None:
        return given
    try:
        try:
            with torch.device("meta"):  # sizes first: the recorded arguments must not allocate without bound
                sized = _build_recorded_base(base, path)
        except NotImplementedError:  # an operation the meta device lacks: built for real, unchecked
            sized = None
        if sized is not None:
            _check_base_size(sized, base, path, held)
        return _build_recorded_base(base, path)
    except (TypeError, ValueError, KeyError, RuntimeError) as err:
        if isinstance(err, LoadError):
            raise
        raise LoadError(f"{path}: base {base.get('kind')} model {base.get('name', base.get('class'))!r} cannot be "
                        f"built from its recorded arguments ({type(err).__name__}: {str(err).strip()[:200]}); the file "
                        "was edited, or that library differs: pass the base, linearize.load_folded(directory, "
                        "base=...)") from None


def _check_base_size(sized: nn.Module, base: dict[str, Any], path: Path, held: int) -> None:
    """:class:`LoadError` naming ``path`` and the base's recorded arguments when the base ``sized`` (built on the
    meta device) holds more than ``BASE_SIZE_FACTOR`` times the ``held`` bytes of the weights file (and more
    than ``BASE_FLOOR_BYTES``)."""
    tensors = {**dict(sized.named_parameters()), **dict(sized.named_buffers())}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size > max(BASE_SIZE_FACTOR * held, BASE_FLOOR_BYTES):
        field = "config" if base.get("kind") == "transformers" else "kwargs"
        record = base.get(field) if isinstance(base.get(field), dict) else {}
        numbers = ", ".join(f"{k} {v}" for v, k in sorted(((v, k) for k, v in record.items() if type(v) is int),
                                                          reverse=True)[:3])
        name, largest = max(tensors.items(), key=lambda kv: kv[1].numel())
        raise LoadError(f"{path}: base.{field} (largest numbers: {numbers or 'none'}) build a "
                        f"{base.get('name', base.get('class'))} of {size / 2**20:.0f} MiB ({name} of shape "
                        f"{list(largest.shape)}), over {BASE_SIZE_FACTOR} times the {held / 2**20:.1f} MiB of its "
                        "weights file: folded.json was edited; save the model again with linearize.save_folded, or "
                        "pass the base, linearize.load_folded(directory, base=...)")


def _build_recorded_base(base: dict[str, Any], path: Path) -> nn.Module | None:
    """A fresh base model from its record in ``folded.json`` (None for ``"plain"``: the caller passes it)."""
    kind = base.get("kind")
    if kind == "transformers":
        transformers = require("transformers", what="a saved Hugging Face base model")

        cls = getattr(transformers, str(base.get("class")), None)
        if not (isinstance(cls, type) and hasattr(cls, "config_class")):
            raise LoadError(f"{path}: unknown transformers class {base.get('class')!r}")
        return cls(cls.config_class.from_dict(base["config"]))
    if kind == "torchvision":
        import torchvision

        builder = torchvision.models.get_model_builder(str(base["name"]))
        # bare: segmentation and detection builders fetch ImageNet weights for their backbone by default
        bare = {"weights_backbone": None} if "weights_backbone" in inspect.signature(builder).parameters else {}
        return builder(weights=None, **bare, **base.get("kwargs", {}))
    if kind == "timm":
        import timm

        return timm.create_model(str(base["name"]), pretrained=False, **base.get("kwargs", {}))
    if kind == "plain":
        return None
    raise LoadError(f"{path}: unknown base kind {kind!r}")


# ----------------------------------------------------------------------------- probe


def _float32_twin(model: nn.Module) -> nn.Module:
    """A float32 CPU copy of ``model`` in eval mode: the probe's outputs do not depend on the device (TF32),
    half-precision rounding or thread count beyond float32 rounding, and running it leaves ``model``'s
    buffers as they are. Costs a float32 copy of the model in CPU memory while it runs (the parameters and
    buffers are copied straight to the CPU: none is duplicated on an accelerator)."""

    def cpu32(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype, copy=True)

    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(cpu32(p), p.requires_grad and p.is_floating_point())
    for b in model.buffers():
        memo[id(b)] = cpu32(b)
    return copy.deepcopy(model, memo).eval()


def _probe(model: nn.Module, example_inputs: Any) -> tuple[dict[str, torch.Tensor], str]:
    """Tensors of a probe (one input row, else the whole input, and the floating outputs of a float32 CPU
    copy of ``model`` on it) and ``""``; or no tensors and why (no input to guess, inputs that are not all
    tensors, a guessed input the model refused). Raises ``ValueError`` when given ``example_inputs`` fail."""
    from .example_inputs import guess_example_inputs
    from .inputs import slice_rows, as_call, float_outputs, map_tensors, num_rows

    try:
        inputs = guess_example_inputs(model) if example_inputs is None else example_inputs
    except ValueError as err:
        return {}, f"no input to guess: {err}"
    args, kwargs = as_call(inputs)
    if not all(isinstance(v, torch.Tensor) for v in (*args, *kwargs.values())) or not (args or kwargs):
        return {}, "its inputs are not all tensors"
    inputs = map_tensors(inputs, lambda t: t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu())
    try:
        twin, failed = _float32_twin(model), None
    except Exception as err:  # noqa: BLE001 -- a model holding something copy.deepcopy refuses
        return {}, f"the model cannot be copied ({type(err).__name__}: {str(err).strip()[:200]})"
    for candidate in ((slice_rows(inputs, 0, 1), inputs) if num_rows(inputs) > 1 else (inputs,)):
        args, kwargs = as_call(candidate)  # one row, else the whole input (a batch not along dim 0 everywhere)
        try:
            with torch.no_grad():  # on copies: a forward that writes into its input changes no saved input
                outputs = float_outputs(twin(*[v.clone() for v in args], **{k: v.clone() for k, v in kwargs.items()}))
        except Exception as err:  # noqa: BLE001 -- any failure of the user's forward; theirs is re-raised
            failed = err
            continue
        tensors = {f"{_PROBE}arg.{i}": v for i, v in enumerate(args)}
        tensors |= {f"{_PROBE}kwarg.{k}": v for k, v in kwargs.items()}
        tensors |= {f"{_PROBE}output.{i}": v for i, v in enumerate(outputs)}
        return {k: v.detach().contiguous().clone() for k, v in tensors.items()}, ""
    if example_inputs is not None:
        raise ValueError(f"save_folded: a float32 CPU copy of the model (the probe load_folded checks) fails on its "
                         f"example_inputs ({type(failed).__name__}: {str(failed).strip()[:300]}); pass inputs it "
                         "accepts, or none to guess them") from failed
    return {}, f"it fails on a guessed input ({type(failed).__name__})"


def _probe_parts(probe: dict[str, torch.Tensor], path: Path) -> tuple[list[torch.Tensor], dict, list[torch.Tensor]]:
    """Positional inputs, keyword inputs and outputs of a saved probe; :class:`LoadError` if malformed."""
    parts: dict[str, dict[str, torch.Tensor]] = {"arg": {}, "kwarg": {}, "output": {}}
    for key, v in probe.items():
        kind, _, name = key[len(_PROBE):].partition(".")
        if kind not in parts or not name or (kind != "kwarg" and not name.isdigit()) or \
                (kind == "output" and not v.is_floating_point()):
            raise LoadError(f"{path}: malformed probe tensor {key!r} in the weights file; save the model again with "
                            "linearize.save_folded(model, dir)")
        parts[kind][name] = v

    def ordered(kind: str) -> list[torch.Tensor]:
        items = sorted(parts[kind].items(), key=lambda kv: int(kv[0]))
        if [int(k) for k, _ in items] != list(range(len(items))):
            raise LoadError(f"{path}: probe {kind}s numbered {[k for k, _ in items]}, not 0..n-1; save the model "
                            "again with linearize.save_folded(model, dir)")
        return [v for _, v in items]

    return ordered("arg"), parts["kwarg"], ordered("output")


def _check_probe(model: nn.Module, probe: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse (:class:`LoadError`) a rebuilt ``model`` whose float32 CPU copy does not give the probe's
    outputs (within 1e-4 of their scale) on its input."""
    from .inputs import float_outputs, max_difference

    args, kwargs, saved = _probe_parts(probe, path)
    if not saved:
        raise LoadError(f"{path}: {FOLDED_CONFIG} says a probe was saved, but the weights file holds no probe "
                        "output; save the model again with linearize.save_folded(model, dir)")
    fix = ("its base was built differently from the model folded (a timm or torchvision builder argument no save "
           "records, such as global_pool or img_size, or another version of that library): build the original "
           "architecture and pass it, linearize.load_folded(directory, base=...); check=False loads without this "
           "check (for a model whose eval-mode forward is random)")
    try:
        with torch.no_grad():
            got = float_outputs(_float32_twin(model)(*args, **kwargs))
        if [t.shape for t in got] != [t.shape for t in saved]:
            raise ValueError(f"output shapes {[tuple(t.shape) for t in got]}, saved {[tuple(t.shape) for t in saved]}")
        err, scale = max_difference(saved, got)
    except Exception as e:  # noqa: BLE001 -- the rebuilt model failing on the saved probe is the finding
        raise LoadError(f"{path}: the rebuilt model fails on the probe saved with it ({type(e).__name__}: "
                        f"{str(e).strip()[:200]}); {fix}") from None
    if err > 1e-4 * max(scale, torch.finfo(torch.float32).tiny):
        raise LoadError(f"{path}: the rebuilt model does not compute what the saved one did on the probe saved with "
                        f"it (largest difference {err:.3g} at output scale {scale:.3g}); {fix}")


# ----------------------------------------------------------------------------- save / load


def save_folded(model: nn.Module, directory: str | os.PathLike, *, builder: str | None = None,
                builder_kwargs: dict[str, Any] | None = None, example_inputs: Any = None,
                probe: bool = True) -> Path:
    """Write a folded ``model`` to ``directory`` as ``folded.json`` + its weights (no pickle).

    ``example_inputs`` (as for ``linearize.fold``; else guessed): its first row (else all of it) and the
    outputs of a float32 CPU copy of the model on it are saved as the probe :func:`load_folded` checks
    the rebuilt model against. A model for which no probe can be made (no input to guess, e.g. one with
    two inputs; inputs that are not all tensors; a model ``copy.deepcopy`` refuses) raises ``ValueError``
    naming the fix; ``probe=False`` saves it without one (then nothing checks the rebuilt model).

    The weights go to a file named by their checksum (:func:`folded_weights_name`), ``folded.json``
    last: a save interrupted at any point (an ``OSError``, a kill) leaves the previous save loadable.
    Concurrent saves into one folder take turns on its save lock (``directory/.linearize.lock``, at most
    600 s: then ``TimeoutError``): it always holds one complete save, the last one.

    ``builder`` (``"torchvision:resnet18"``, ``"timm:resnet18"``) and ``builder_kwargs`` name how to
    build the base of a torchvision model (required: ``ValueError`` without; HF and timm models are
    recognised by themselves); models made only of ``torch.nn`` layers need none; for your own classes,
    and for ``builder="plain"`` (a torchvision class your own code changed), pass ``base=`` to
    :func:`load_folded`.
    Raises ``ValueError`` for a module whose class is neither allow-listed nor rebuildable from the base.

    Example::

        linearize.save_folded(linearize.fold(model, x), "deploy/")
    """
    from .serialization import extra_states, saved_tensors, unwrap_model

    model = unwrap_model(model)
    refuse_sharded(model, "save_folded")
    extra = extra_states(model)
    modules = []
    for name, module in model.named_modules():
        cls = _class_name(module)
        entry: dict[str, Any] = {"name": name, "class": cls, "children": list(module._modules)}
        if _allowed(cls) is type(module):
            try:
                entry["args"] = _spec(module)
            except ValueError as err:
                raise ValueError(f"save_folded: module {name or '<root>'!r} ({cls}): {err}") from None
        elif isinstance(module.__dict__.get(ORIGIN), str) and module.__dict__[ORIGIN] != name:
            entry["origin"] = module.__dict__[ORIGIN]  # where the base has it: fold moved it
        modules.append(entry)
    tensors = saved_tensors(model, gated=True)
    clash = next((k for k in tensors if k.startswith(_PROBE)), None)
    if clash is not None:
        raise ValueError(f"save_folded: the state key {clash!r} uses the prefix {_PROBE!r} of the saved probe; "
                         "rename that module")
    base = _base_of(model, builder, builder_kwargs, needs_base=any("args" not in m for m in modules))
    if not probe:
        if example_inputs is not None:
            raise ValueError("save_folded: example_inputs make the probe, which probe=False leaves out: pass one of "
                             "them, not both")
        probe_tensors, no_probe = {}, "probe=False"
    else:
        probe_tensors, no_probe = _probe(model, example_inputs)
        if not probe_tensors:
            fix = ("pass probe=False to save it without that check" if example_inputs is not None else
                   "pass example_inputs=<the inputs it takes> (as for linearize.fold: a tensor, a tuple of them "
                   "for several inputs, or a dict of keyword inputs), or probe=False to save it without that check")
            raise ValueError(f"save_folded: no probe for load_folded to check the rebuilt {type(model).__name__} "
                             f"with ({no_probe}): a base built otherwise would load unchecked; {fix}")
    data = safetensors.torch.save(tensors | probe_tensors, {"format": "pt"})
    digest = hashlib.sha256(data).hexdigest()
    name = folded_weights_name(digest)
    meta = {"format": FORMAT_VERSION, "base": base, "modules": modules,
            "weights": {"file": name, "bytes": len(data), "sha256": digest},
            "probe": {"saved": bool(probe_tensors), "why_not": no_probe}, **({"extra_state": extra} if extra else {})}
    directory = Path(directory)
    check_folder(directory, "save_folded: directory")
    directory.mkdir(parents=True, exist_ok=True)
    with save_lock(directory) as outermost:
        atomic_write(directory / name, data)
        atomic_write(directory / FOLDED_CONFIG, json.dumps(meta, indent=1))
        if outermost:
            remove_stale(directory, {name, FOLDED_CONFIG},
                         lambda n: n == FOLDED_CONFIG or _WEIGHTS_FILE.fullmatch(n) is not None)
    return directory


def folded_weights_name(sha256: str) -> str:
    """File name of the folded weights whose SHA-256 hex digest is ``sha256``.

    Example:
        >>> folded_weights_name("0123456789abcdef" * 4)
        'folded-0123456789abcdef.safetensors'
    """
    return f"folded-{sha256[:16]}.safetensors"


def _rebuild(meta: dict[str, Any], base: nn.Module | None, path: Path,
             shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    from .folding.layers import get_path

    built: dict[str, nn.Module] = {}
    before = {} if base is None else dict(base.named_modules(remove_duplicate=False))  # rebuilding rearranges base
    placed: dict[int, str] = {}  # id of every module placed -> its path: none may sit at two
    for entry in meta["modules"]:
        name, cls_name = entry["name"], entry["class"]
        cls = _allowed(cls_name)
        where = name or "<root>"
        same = None if base is None else (base if not name else get_path(base, name))
        if same is not None and cls is type(same) and "args" in entry:
            try:  # the base's own module when it is the same (keeps arguments a description may miss)
                same = same if _spec(same) == entry["args"] else None
            except ValueError:
                same = None
        else:
            same = None
        if same is not None:
            module = same
        elif cls is not None and "args" in entry:
            try:
                with torch.device("meta"):  # sizes first: arguments must not allocate what the weights do not hold
                    sized = _build(cls, entry["args"])
            except (TypeError, ValueError, KeyError, RuntimeError) as err:
                raise LoadError(f"{path}: module {where!r} ({cls_name}): bad arguments ({err})") from None
            _check_shapes(sized, name, shapes, path)
            module = _build(cls, entry["args"])
        else:
            module = None if base is None else (base if not name else get_path(base, name))
            origin = entry.get("origin", name)  # none saved: the same path in the model folded (its parent may be new)
            if base is not None and isinstance(origin, str) and (module is None or _class_name(module) != cls_name):
                module = before.get(origin)  # a module fold moved: the base's at its old path
            if module is None:
                hint = ("pass the base model: linearize.load_folded(directory, base=YourModel(...))"
                        if base is None else "the base model given has no module there")
                raise LoadError(f"{path}: module {where!r} has class {cls_name}, which load_folded does not "
                                f"build from a description (allowed: torch.nn layers, linearize fold modules); "
                                f"{hint}")
            if _class_name(module) != cls_name:
                raise LoadError(f"{path}: module {where!r} is a {cls_name} in the save but a "
                                f"{_class_name(module)} in the base model; build the same architecture")
            module.__dict__[ORIGIN] = origin if isinstance(origin, str) and module is before.get(origin) else name
        if id(module) in placed:
            raise LoadError(f"{path}: module {where!r} would be the base's module already at "
                            f"{placed[id(module)]!r} (an 'origin' used twice)")
        placed[id(module)] = name
        for child in list(module._modules):
            if child not in entry["children"]:
                del module._modules[child]
        if name:
            parent, _, attr = name.rpartition(".")
            built[parent].__dict__.pop(attr, None)  # a plain attribute there (self.act = F.relu) becomes the module
            built[parent].add_module(attr, module)
        built[name] = module
    from .dispatch import attach_owner
    from .injection import CallSites

    for name, module in built.items():
        owner = built.get(name.rpartition(".")[0])
        if isinstance(module, CallSites):
            attach_owner(owner)  # counts its calls per forward, as convert does
        if isinstance(module, FunctionalSites):
            if name.rpartition(".")[2] != FUNCTIONAL_ATTR:
                raise LoadError(f"{path}: functional sites at {name!r}, not at <owner>.{FUNCTIONAL_ATTR}")
            if set(module._modules) != {slot for slot in module.slots if slot is not None}:
                raise LoadError(f"{path}: functional sites {name!r}: slots {module.slots} do not name its modules "
                                f"{sorted(module._modules)}; save the model again with linearize.save_folded")
            install_functional_sites(owner, module)  # the owner's calls go to the plain modules again
    from .injection import settle_placed_modules

    settle_placed_modules(built[""])  # a base's encoder layer reused around a folded activation
    return built[""]


# builder kwargs that fetch or read weights or other files: load_folded builds the bare model (weights=None,
# pretrained=False) and loads the saved weights, so a folded.json holding one is refused before anything is opened
_RESERVED_KWARGS = {"torchvision": ("weights", "weights_backbone", "progress"),
                    "timm": ("pretrained", "checkpoint_path", "pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")}
# a torchvision or timm model name a save records (and a timm architecture or backbone in a transformers config): a
# registered name, never a source prefix ('hf-hub:ORG/NAME', 'local-dir:PATH') or a path, with which timm fetches
# from the Hugging Face Hub or reads any folder of the machine
_MODEL_NAME = re.compile(r"[\w.-]+", re.ASCII)


def _config_fetch(config: dict[str, Any]) -> tuple[str, str] | None:
    """The field of a transformers base ``config`` (nested configs included) that would make building the model
    fetch or read files, and why; None when none does. A timm ``architecture`` (``TimmWrapperModel``) or
    ``backbone`` (``TimmBackbone``) must be a plain model name, ``model_args`` (kwargs to ``timm.create_model``)
    hold no reserved kwarg, and a ``backbone`` outside a timm backbone's config (transformers looks it up on the
    Hub or in a folder; a save records a ``backbone_config`` instead) is refused. Only the config and its
    sub-configs (dicts with a ``model_type`` or under a ``*_config`` key) are read so: label maps hold such words as data."""
    stack: list[tuple[str, Any]] = [("base.config", config)]
    while stack:
        field, value = stack.pop()
        if isinstance(value, list):
            stack.extend((f"{field}[{i}]", v) for i, v in enumerate(value))
            continue
        if not isinstance(value, dict):
            continue
        stack.extend((f"{field}.{k}", v) for k, v in value.items())
        if field != "base.config" and "model_type" not in value and not field.endswith("_config"):
            continue  # not a (sub)config: a label map (id2label, label2id) or other data holds these words as data
        for key in ("architecture", "backbone"):
            name = value.get(key)
            if key == "backbone" and name is not None and value.get("model_type") != "timm_backbone":
                return f"{field}.backbone", ("names a backbone, which would make transformers fetch or read its "
                                             "config (a Hub repository or a folder; a save records a backbone_config "
                                             "instead)")
            if name is not None and not (isinstance(name, str) and _MODEL_NAME.fullmatch(name)):
                return f"{field}.{key}", (f"{name!r:.80} is not a plain timm model name (a source such as 'hf-hub:' "
                                          "or 'local-dir:', or a path, would make timm fetch or read files)")
        model_args = value.get("model_args")
        reserved = [k for k in _RESERVED_KWARGS["timm"] if k in model_args] if isinstance(model_args, dict) else []
        if reserved:
            return f"{field}.model_args", f"holds {reserved}, which would make timm fetch or read weights or other files"
    return None


def _check_description(meta: dict[str, Any], path: Path) -> None:
    """Raise :class:`LoadError` naming ``path`` and the field when ``folded.json``'s modules, base, probe or extra
    state are not of the structure :func:`save_folded` writes (its top level checked already)."""

    def bad(field: str, what: str) -> LoadError:
        return LoadError(f"{path}: {field} {what}; the file is damaged or was edited: save the model again with "
                         "linearize.save_folded(model, dir)")

    names: set[str] = set()
    for i, entry in enumerate(meta["modules"]):
        field = f"modules[{i}]"
        if not isinstance(entry, dict):
            raise bad(field, f"is a {type(entry).__name__}, not an object")
        for key, kind in (("name", str), ("class", str), ("children", list)):
            if not isinstance(entry.get(key), kind):
                noun = "string" if kind is str else "list"
                raise bad(f"{field}.{key}", f"must be a {noun}, got {entry.get(key)!r:.80}")
        if not all(isinstance(c, str) for c in entry["children"]):
            raise bad(f"{field}.children", "must be a list of names")
        if "args" in entry and not isinstance(entry["args"], dict):
            raise bad(f"{field}.args", "must be an object")
        if "origin" in entry and not isinstance(entry["origin"], str):
            raise bad(f"{field}.origin", "must be a module path")
        name = entry["name"]
        if name in names or (i and name.rpartition(".")[0] not in names):
            raise bad(f"{field}.name", f"{name!r} is a module named twice, or before its parent")
        names.add(name)
    base = meta.get("base")
    if base is not None:
        if not isinstance(base, dict):
            raise bad("base", "must be an object")
        kind = base.get("kind")
        if kind in ("torchvision", "timm"):
            kwargs = base.get("kwargs", {})
            if not isinstance(base.get("name"), str) or not isinstance(kwargs, dict):
                raise bad("base", f"of kind {kind} must hold a builder name and kwargs (an object)")
            if not _MODEL_NAME.fullmatch(base["name"]):
                raise bad("base.name", f"{base['name']!r:.80} is not a plain {kind} model name (letters, digits, "
                          "'_', '.', '-'; a timm source such as 'hf-hub:' or 'local-dir:', or a path, would make the "
                          "builder fetch or read files)")
            reserved = [k for k in _RESERVED_KWARGS[kind] if k in kwargs]
            if reserved:
                raise bad("base.kwargs", f"holds {reserved}, which would make {kind} fetch or read weights or "
                          "other files (load_folded builds the bare model and loads the saved weights)")
        elif kind == "transformers":
            if not (isinstance(base.get("class"), str) and isinstance(base.get("config"), dict)):
                raise bad("base", "of kind transformers must hold a class name and a config (an object)")
            fetch = _config_fetch(base["config"])
            if fetch is not None:
                raise bad(*fetch)
    if not isinstance(meta.get("probe", {}), (dict, type(None))):
        raise bad("probe", "must be an object")


def _read_folded(directory: Path, tries: int = 10) -> tuple[dict, bytes, Path]:
    """``folded.json``, checked, and the weights bytes it names (re-read when a concurrent save replaced the pair)."""
    path = directory / FOLDED_CONFIG
    if not path.exists():  # a folder or FIFO there is refused by name when read
        check_given_folder(directory, "a folded save")
        if (directory / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{directory} holds a linearize sidecar ({CONFIG_NAME}), not a folded save: "
                                    "load it with linearize.from_pretrained(model, directory)")
        raise FileNotFoundError(f"{directory} has no {FOLDED_CONFIG}; write one with linearize.save_folded(model, dir)")
    for attempt in range(tries):
        text = read_file(path, MAX_JSON_BYTES, FOLDED_CONFIG)
        try:
            meta = parse_json(text, path)
            ok = (meta.get("format") == FORMAT_VERSION and isinstance(meta.get("modules"), list) and meta["modules"]
                  and isinstance(meta["modules"][0], dict) and meta["modules"][0].get("name") == ""
                  and isinstance(meta.get("extra_state", {}), dict))
        except (LoadError, AttributeError):
            ok = False
        if not ok:
            raise LoadError(f"{path}: not a folded-model description of format {FORMAT_VERSION}; save it again with "
                            "linearize.save_folded(model, dir)")
        _check_description(meta, path)
        w = meta.get("weights") if isinstance(meta.get("weights"), dict) else {}
        if not isinstance(w.get("file"), str) or not _WEIGHTS_FILE.fullmatch(w["file"]):
            raise LoadError(f"{path}: names no weights file of the form folded-<checksum>.safetensors; save the "
                            "model again with linearize.save_folded(model, dir)")
        weights, size = directory / w["file"], w.get("bytes")
        try:  # a regular file of the recorded size, checked before reading; a save may remove it meanwhile
            data = read_file(weights, size, "folded weights file") if type(size) is int and size >= 0 else None
        except (FileNotFoundError, LoadError):
            data = None
        if data is not None and len(data) == size and hashlib.sha256(data).hexdigest() == w.get("sha256"):
            return meta, data, weights
        if attempt + 1 == tries or read_file(path, MAX_JSON_BYTES, FOLDED_CONFIG) == text:  # no save racing this read
            break
    raise LoadError(f"{weights}: missing, truncated or modified (size or SHA-256 differ from {FOLDED_CONFIG}); "
                    "save the model again with linearize.save_folded(model, dir)")


def load_folded(directory: str | os.PathLike, base: nn.Module | None = None, *, check: bool = True) -> nn.Module:
    """Rebuild the folded model saved by :func:`save_folded` in ``directory`` and load its weights strictly.

    ``base``: a model of the original architecture (its weights do not matter), needed when ``folded.json``
    names classes of your own (a plain base) or when the model was built with arguments the save does not
    record; the folded model is rebuilt in a copy of it, so ``base`` is left as it is (a base that cannot be
    copied, holding a lock say, is rebuilt in itself, with a warning). ``check``: run a float32 CPU copy of the rebuilt model on the probe saved with it and refuse
    other outputs (beyond 1e-4 of the output scale). Runs no code from the files. Raises ``FileNotFoundError``
    and :class:`LoadError` naming the file (damaged, tampered with, unknown class, other outputs).

    Example::

        model = linearize.load_folded("deploy/").eval()
    """
    directory = Path(directory)
    path = directory / FOLDED_CONFIG
    meta, data, weights = _read_folded(directory)
    tensors = safetensors.torch.load(data)
    base = _copy_of_base(base)
    model = _rebuild(meta, _build_base(meta.get("base") or {}, base, path, len(data)), path,
                     {k: tuple(t.shape) for k, t in tensors.items()})
    probe = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith(_PROBE)]}
    _fit(model, tensors)
    try:  # the extra states (get_extra_state) saved in folded.json, through the modules' set_extra_state
        model.load_state_dict(tensors | meta.get("extra_state", {}), strict=True)
    except Exception as err:  # noqa: BLE001 -- RuntimeError: names, shapes; a set_extra_state refusing a value
        raise LoadError(f"{weights}: does not fit the rebuilt model ({type(err).__name__}: {str(err).strip()[:500]}); "
                        "the base model differs from the one folded: build the original architecture with the "
                        "arguments it had and pass it, linearize.load_folded(directory, base=...)") from None
    mark_folded(model)  # its own save_pretrained would reload as the original layers: guarded
    if check and (probe or (meta.get("probe") or {}).get("saved")):
        _check_probe(model, probe, path)
    return model.eval()


def _copy_of_base(base: nn.Module | None) -> nn.Module | None:
    """A copy of ``base`` for :func:`load_folded` to rebuild in, so that the caller's model (say the original, kept to
    compare with) stays as it is; ``base`` itself, with a warning saying so, when it cannot be copied."""
    if base is None:
        return None
    try:
        return copy.deepcopy(base)
    except Exception as err:  # noqa: BLE001 -- a lock, an open file, a C++ handle held by the model
        warnings.warn(f"load_folded: base ({type(base).__name__}) cannot be copied ({type(err).__name__}: {err}), so "
                      "the folded model is rebuilt in it: the model you passed now is the folded model. Pass a freshly "
                      "built one to keep yours as it is", stacklevel=3)
        return base


def _check_shapes(module: nn.Module, name: str, shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """``LoadError`` unless every tensor that ``module`` (built on the meta device from its saved arguments)
    holds itself is in the weights file with the same shape: the strict load would refuse it anyway, after
    allocating whatever the arguments ask for."""
    for key, t in module.state_dict().items():
        if "." in key:  # a child's: its own entry checks it
            continue
        full = f"{name}.{key}" if name else key
        if shapes.get(full) != tuple(t.shape):
            held = "no such tensor" if full not in shapes else f"shape {list(shapes[full])}"
            raise LoadError(f"{path}: module {name or '<root>'!r} ({type(module).__name__}): its arguments make "
                            f"{key!r} of shape {list(t.shape)}, the weights file has {held}; the save is damaged "
                            "or was edited: save it again with linearize.save_folded")


def _fit(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Give the rebuilt ``model`` the saved tensors' floating dtypes (it is built in float32; when they
    share one dtype, its unsaved floating buffers take it too) and the
    parameters fold filled that its base leaves empty (a conv subclass built with ``bias=False`` that fold
    gave its BatchNorm's shift): the strict load then checks every name and shape."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for key, saved in tensors.items():
        owner, _, attr = key.rpartition(".")
        module = modules.get(owner)
        if module is None:
            continue
        if attr in module._parameters and module._parameters[attr] is None:
            module.register_parameter(attr, nn.Parameter(torch.empty_like(saved), saved.is_floating_point()))
        target = module._parameters.get(attr, module._buffers.get(attr))
        if target is not None and target.is_floating_point() and saved.is_floating_point():
            target.data = target.data.to(saved.dtype)  # in place: a tied parameter stays one
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:  # a model in one dtype: its unsaved buffers too (timm BlurPool2d's persistent=False filter)
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point():
                t.data = t.data.to(*dtypes)
