"""Hugging Face save paths of converted models: ``model.save_pretrained`` and Trainer checkpoints.

``linearize.convert`` of a Hugging Face model records the linearize manifest (format, config,
sites) in ``model.config.linearize``, so the ``config.json`` that ``model.save_pretrained(dir)``
(and every Trainer ``checkpoint-N/``) writes carries it; the unit tensors are already in the
model's state dict (``<site>.slope``, ``<site>.frozen``) and therefore in ``model.safetensors``.
No separate sidecar is needed:

    model = linearize.from_pretrained(AutoModel, dir)            # loaded without a warning table

restores the model bit-identically, with the checks of :mod:`linearize.serialization` (manifest
structure, unit tensors finite in ``[0, 1]``, frozen channels at their value). Given a model
instance instead of a class, ``linearize.from_pretrained(model, dir)`` loads the folder's weights into
it as well (:func:`load_weights`), not only its units.

A plain ``AutoModel.from_pretrained(dir)`` (or ``BertModel.from_pretrained(dir)``, any class) would
build the original activations and drop the units: another function. It fails instead: the
converted model's config also holds a *load guard*, ``quantization_config = {"linearize": <how to
load>}`` without a ``quant_method``, which every ``from_pretrained`` of transformers refuses with
``ValueError: The model's quantization config ... has no `quant_method` attribute`` before it reads
a weight; ``config.json`` shows why and the fix. :func:`load_plain` lifts the guard for its own
load. (A model that is really quantized keeps its ``quantization_config`` and gets no guard; a
stripped reload of it, or of a save made before the guard existed, is still refused by
:func:`linearize.convert` through :func:`refuse_stripped`.)
"""

from __future__ import annotations

import copy
import json
import os
import re
import weakref
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ._files import LoadError, check_regular, read_json, safe_torch_load

__all__ = ["CONFIG_KEY", "GUARD_KEY", "is_guard", "lift_guard", "is_hf_model", "mark", "unmark", "refuse_stripped",
           "has_manifest", "has_weights", "weights_file", "unreadable_weights_file", "read_unit_tensors", "stored_names",
           "load_plain", "load_weights", "variant_name", "weight_variants"]

CONFIG_KEY = "linearize"
GUARD_KEY = "quantization_config"  # transformers refuses to load a config whose entry has no quant_method
GUARD = {CONFIG_KEY: "saved after linearize.convert: transformers alone would drop its linearizable units and "
                     "load another function. Load it with linearize.from_pretrained(<ModelClass>, <this folder>)."}
FOLDED_MESSAGE = ("a model folded by linearize.fold: transformers alone would rebuild the original layers, another "
                  "function. Save it with linearize.save_folded(model, dir), load it with linearize.load_folded(dir).")
GATED_MESSAGE = ("part of a gated (dgn/dlgn) split made by linearize.convert: transformers alone would load another "
                 "function. Save the split with linearize.save_pretrained(gated, dir) and load it with "
                 "linearize.from_pretrained(fresh_model, dir).")
HF_CONFIG = "config.json"
_SAFE = "model.safetensors"
_SAFE_INDEX = "model.safetensors.index.json"
_BIN = "pytorch_model.bin"
_BIN_INDEX = "pytorch_model.bin.index.json"


def is_hf_model(model: object) -> bool:
    """True for a Hugging Face ``PreTrainedModel`` (a ``config`` with ``to_dict`` and a ``save_pretrained``)."""
    return (isinstance(model, nn.Module) and callable(getattr(model, "save_pretrained", None))
            and callable(getattr(getattr(model, "config", None), "to_dict", None)))


def hf_models(model: nn.Module) -> list[nn.Module]:
    """``model`` and every Hugging Face model inside it (the encoder and decoder of an
    ``EncoderDecoderModel``, the value network of a gated split), outermost first."""
    return [m for m in model.modules() if is_hf_model(m)]


def _guard(config: Any, message: str) -> None:
    if getattr(config, GUARD_KEY, None) is None or is_guard(getattr(config, GUARD_KEY)):  # a quantized model keeps its own
        setattr(config, GUARD_KEY, {CONFIG_KEY: message})


# configs marked by convert in this process ({id: weakref}): a model built from one of them is a fresh
# model, not a stripped load (a save, read back by a plain from_pretrained, is a new config object)
_MARKED_HERE: dict[int, weakref.ref] = {}


def _marked_here(config: Any) -> bool:
    ref = _MARKED_HERE.get(id(config))
    return ref is not None and ref() is config


def _remember(config: Any) -> None:
    key = id(config)
    try:
        _MARKED_HERE[key] = weakref.ref(config, lambda _, key=key: _MARKED_HERE.pop(key, None))
    except TypeError:  # a config type without weak references: nothing remembered, the guard stays strict
        pass


def mark(model: nn.Module) -> None:
    """Record the linearize manifest of a converted HF model in ``config.linearize`` and the load
    guard that makes a plain ``from_pretrained`` of its saves fail (see the module docstring), on
    ``model`` and on every HF model inside it that holds units (each saves on its own).

    Called by :func:`linearize.convert` (gated modes: the guard only, their saves go through
    :func:`linearize.save_pretrained`); a no-op for other models.
    """
    from .manifest import FORMAT_VERSION, site_records
    from .unit import units

    config = getattr(model, "linearize_config", None)
    if config is None:
        return
    done: set[int] = set()
    for m in hf_models(model):  # outermost first; a head model shares its config with its base model
        if id(m.config) in done:
            continue
        done.add(id(m.config))
        if config.mode != "prelu":
            _guard(m.config, GATED_MESSAGE)
        elif units(m):
            setattr(m.config, CONFIG_KEY, {"format": FORMAT_VERSION, "config": config.to_dict(), "sites": site_records(m)})
            _guard(m.config, GUARD[CONFIG_KEY])
            _remember(m.config)


def mark_folded(model: nn.Module) -> None:
    """On a model returned by :func:`linearize.fold`: drop the manifest (it has no units) and guard
    its HF models with the fold message (a plain reload would rebuild the original layers, not the
    folded ones; :func:`linearize.save_folded` / :func:`linearize.load_folded` keep them)."""
    for m in hf_models(model):
        if hasattr(m.config, CONFIG_KEY):
            delattr(m.config, CONFIG_KEY)
        _guard(m.config, FOLDED_MESSAGE)


def is_guard(value: object) -> bool:
    """True for a load guard of :func:`mark` or :func:`mark_folded` (a ``quantization_config`` value)."""
    return isinstance(value, dict) and set(value) == {CONFIG_KEY}


def _configs(config: Any) -> list[Any]:
    """``config`` and the model configs nested in it (``encoder``, ``decoder``, ``text_config`` ...)."""
    nested = [v for v in vars(config).values() if callable(getattr(v, "to_dict", None)) and hasattr(v, "model_type")]
    return [config] + [c for v in nested for c in _configs(v)]


def lift_guard(config: Any) -> None:
    """Remove the load guards of ``config`` (a transformers config) and of the configs nested in it."""
    for c in _configs(config) if config is not None else []:
        if is_guard(getattr(c, GUARD_KEY, None)):
            delattr(c, GUARD_KEY)


def unmark(model: nn.Module) -> None:
    """Remove ``config.linearize`` and the load guards (before a restore re-converts the model)."""
    for m in hf_models(model):
        if hasattr(m.config, CONFIG_KEY):
            delattr(m.config, CONFIG_KEY)
        lift_guard(m.config)


def refuse_stripped(model: nn.Module) -> None:
    """Raise :class:`LoadError` when ``model`` was saved converted but loaded without its units.

    A model whose ``config`` carries a linearize manifest but that holds no units was loaded by a
    plain ``from_pretrained``: it computes another function than the one saved. A config that
    ``convert`` marked in this process is not one read from a save: a second model built from that
    same config object is a fresh model and converts.
    """
    from .unit import units

    config = getattr(model, "config", None)
    if getattr(config, CONFIG_KEY, None) is not None and not _marked_here(config) and not units(model):
        where = getattr(model.config, "_name_or_path", "") or "DIR"
        raise LoadError(
            f"{type(model).__name__} (config from {where!r}) was saved after linearize.convert, but it was "
            "built from that config or loaded by a plain from_pretrained, without its linearizable units (its "
            "activations are the original ones: another function, or fresh units). Load it with "
            f"linearize.from_pretrained({type(model).__name__}, {where!r}) instead."
        )


def has_manifest(directory: str | os.PathLike) -> bool:
    """True when ``directory/config.json`` carries a linearize manifest; :class:`LoadError` naming it when it is a
    folder, FIFO, device or socket (not taken for a missing one)."""
    path = Path(directory) / HF_CONFIG
    if not path.exists():
        return False
    check_regular(path, "Hugging Face config")
    try:
        config = read_json(path, "Hugging Face config")
    except (OSError, LoadError):
        return False
    return isinstance(config, dict) and CONFIG_KEY in config  # a JSON string or list is no HF config


def has_weights(directory: str | os.PathLike, variant: str | None = None) -> bool:
    """True when ``directory`` holds the weights of a Hugging Face save beside its ``config.json``
    (``model.safetensors``, ``pytorch_model.bin``, or the index of their shards; of ``variant``:
    :func:`variant_name`)."""
    return (Path(directory) / HF_CONFIG).is_file() and weights_file(directory, variant) is not None


def variant_name(name: str, variant: str | None) -> str:
    """The name transformers gives the weights file ``name`` of ``variant`` (``save_pretrained(variant=)``): the
    variant before the last suffix; ``name`` itself for ``None``.

    Example:
        >>> variant_name("model.safetensors", "fp16"), variant_name("pytorch_model.bin.index.json", "fp16")
        ('model.fp16.safetensors', 'pytorch_model.bin.index.fp16.json')
    """
    if variant is None:
        return name
    stem, suffix = name.rsplit(".", 1)
    return f"{stem}.{variant}.{suffix}"


def weight_variants(directory: str | os.PathLike) -> list[str]:
    """The variants (``save_pretrained(variant=)``) whose weights :func:`weights_file` finds in ``directory``, sorted.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "model.fp16.safetensors").write_bytes(b"")
        >>> weight_variants(d)
        ['fp16']
    """
    directory = Path(directory)
    found = set()
    for name in (_SAFE, _SAFE_INDEX, _BIN, _BIN_INDEX):
        stem, _, suffix = name.rpartition(".")
        found |= {p.name[len(stem) + 1:-len(suffix) - 1] for p in directory.glob(f"{stem}.*.{suffix}")}
    shard = re.compile(r".*-\d+-of-\d+")  # a shard's name (model.fp16-00001-of-00002.safetensors), not a variant
    return sorted(v for v in found if v and not shard.fullmatch(v) and weights_file(directory, v) is not None)


def weights_file(directory: str | os.PathLike, variant: str | None = None) -> Path | None:
    """The file of ``directory`` transformers reads a model's weights from, in its order of preference:
    ``model.safetensors``, the index of its shards, ``pytorch_model.bin``, the index of its shards (those of
    ``variant``: :func:`variant_name`); ``None`` when there is none."""
    directory = Path(directory)
    return next((directory / variant_name(n, variant) for n in (_SAFE, _SAFE_INDEX, _BIN, _BIN_INDEX)
                 if (directory / variant_name(n, variant)).is_file()), None)


def unreadable_weights_file(directory: str | os.PathLike) -> Path | None:
    """The weights file of ``directory`` to name when reading its weights failed: for a sharded save, the first
    shard named by its index that is missing or does not decode (a ``.safetensors`` shard: its header and
    length, a ``.bin`` one: ``torch.load(weights_only=True)``); else :func:`weights_file` (the single file, or
    the index when every shard decodes). Only on that failure: a ``.bin`` shard is read whole."""
    import safetensors

    found = weights_file(directory)
    if found is None or found.name not in (_SAFE_INDEX, _BIN_INDEX):
        return found
    try:
        shards = dict.fromkeys(_weight_files(Path(directory)).values())
    except LoadError:
        return found  # the index itself is damaged
    for shard in shards:
        try:
            check_regular(shard, "weights file")  # safe_open and torch.load open it by name: a FIFO would block
            if shard.suffix == ".safetensors":
                with safetensors.safe_open(str(shard), framework="pt"):
                    pass
            else:
                safe_torch_load(shard)
        except Exception:  # a decoder of arbitrary bytes, a missing file
            return shard
    return found


def _weight_files(directory: Path, variant: str | None = None) -> dict[str, Path]:
    """Which file of an HF save (of ``variant``) holds each tensor name (``{}``: unsharded)."""
    for index in (variant_name(_SAFE_INDEX, variant), variant_name(_BIN_INDEX, variant)):
        if (directory / index).is_file():
            try:
                weight_map = read_json(directory / index, "shard index")["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("weight_map must map tensor names to file names")
            except (LoadError, KeyError, TypeError) as err:
                raise LoadError(f"{directory / index}: not a valid shard index ({err})") from None
            return {k: directory / v for k, v in weight_map.items()}
    return {}


def stored_names(directory: Path, variant: str | None = None) -> list[str]:
    """The tensor names of the HF weights in ``directory`` (of ``variant``): those of the shard index, or of
    ``model.safetensors`` (its header only); ``[]`` for an unsharded ``pytorch_model.bin`` (not read for this)."""
    import safetensors

    files = _weight_files(directory, variant)
    if files:
        return sorted(files)
    path = directory / variant_name(_SAFE, variant)
    if not path.is_file():
        return []
    check_regular(path, "weights file")
    with safetensors.safe_open(str(path), framework="pt") as f:
        return sorted(f.keys())


def read_unit_tensors(directory: Path, keys: list[str], each: Callable[[torch.Tensor], Any] | None = None,
                      variant: str | None = None) -> tuple[dict[str, Any], Path]:
    """The tensors ``keys`` of the HF weights in ``directory`` (absent ones left out), and the file read.

    Reads ``model.safetensors`` (or its shards) without touching other tensors, in their stored dtype, or
    ``pytorch_model.bin`` with ``torch.load(weights_only=True)``; those of ``variant`` (``model.fp16.safetensors``
    ...: :func:`variant_name`) when given. ``each``: what to keep of each tensor as it is read (a digest: the
    tensors are then not all held at once).
    """
    import safetensors

    files = _weight_files(directory, variant)
    safe, binary = variant_name(_SAFE, variant), variant_name(_BIN, variant)
    if not files:
        single = next((directory / n for n in (safe, binary) if (directory / n).is_file()), None)
        if single is None:
            raise FileNotFoundError(f"{directory} has a linearize manifest in {HF_CONFIG} but no weights "
                                    f"({safe} or {binary}); save the model again with model.save_pretrained(dir"
                                    + (f", variant={variant!r})" if variant is not None else ")"))
        files = dict.fromkeys(keys, single)
    keep = each or (lambda t: t)
    out: dict[str, Any] = {}
    by_file: dict[Path, list[str]] = {}
    for k in keys:
        if k in files:
            by_file.setdefault(files[k], []).append(k)
    path = next(iter(by_file), directory / safe)
    for path, names in by_file.items():
        check_regular(path, "weights file")  # safe_open and torch.load open it by name: a FIFO would block
        try:
            if path.suffix == ".safetensors":
                with safetensors.safe_open(str(path), framework="pt") as f:
                    present = set(f.keys())
                    out.update({k: keep(f.get_tensor(k)) for k in names if k in present})
            else:
                state = safe_torch_load(path)
                out.update({k: keep(state[k]) for k in names if k in state})
        except (OSError, LoadError):
            raise
        except Exception as err:  # a decoder of arbitrary bytes
            raise LoadError(f"{path}: not a readable weights file ({type(err).__name__}: {err}); it is truncated "
                            "or damaged. Save the model again with model.save_pretrained(dir).") from err
    return out, path


def _drop_guards(config: dict) -> dict:
    """A ``config.json`` dict without load guards (nested model configs included)."""
    out = {k: (_drop_guards(v) if isinstance(v, dict) else v) for k, v in config.items()}
    if is_guard(out.get(GUARD_KEY)):
        del out[GUARD_KEY]
    return out


def _unguarded_view(directory: Path, into: Path) -> Path:
    """``into``: links to every file of ``directory`` but ``config.json``, which is written there
    without load guards, so that transformers loads it the usual way (all its keyword arguments)."""
    for f in directory.iterdir():
        if f.name != HF_CONFIG:
            # not resolved: a link loop (or a broken link) among the files is read only if transformers asks for it
            (into / f.name).symlink_to(f.absolute(), target_is_directory=f.is_dir())
    config = read_json(directory / HF_CONFIG, "Hugging Face config")
    (into / HF_CONFIG).write_text(json.dumps(_drop_guards(config)), encoding="utf-8")
    return into


def load_plain(cls: type, directory: Path, keys: list[str], kwargs: dict[str, Any]) -> nn.Module:
    """``cls.from_pretrained(directory, **kwargs)`` with the unit tensors ``keys`` expected.

    The model is built with its original activations (the units are restored afterwards); the unit
    keys are declared in ``_keys_to_ignore_on_load_unexpected`` of a throw-away subclass, so
    transformers reports only real problems (no UNEXPECTED table for the units). ``Auto*`` classes
    are resolved from the saved config first. transformers reads the folder through a view without
    the load guard (links to the weights); a ``config=`` object is copied before its guard is lifted.
    """
    if not callable(getattr(cls, "from_pretrained", None)):
        raise TypeError(f"linearize.from_pretrained got the class {cls.__name__}, which has no from_pretrained: "
                        f"pass a freshly built instance, e.g. {cls.__name__}(), or a Hugging Face model class")
    if kwargs.get("config") is not None and not isinstance(kwargs["config"], (str, os.PathLike)):
        config = copy.deepcopy(kwargs["config"])  # the caller's object keeps its guard
        lift_guard(config)
        kwargs = {**kwargs, "config": config}
    with tempfile.TemporaryDirectory(prefix="linearize-load-") as tmp:
        view = _unguarded_view(directory, Path(tmp))
        if hasattr(cls, "_model_mapping"):  # an Auto class
            from transformers import AutoConfig
            from transformers.models.auto.auto_factory import _get_model_class

            config = kwargs.get("config")
            if config is None or isinstance(config, (str, os.PathLike)):
                config = AutoConfig.from_pretrained(str(config or view))
            cls = _get_model_class(config, cls._model_mapping)
        pattern = r"(^|\.)(" + "|".join(re.escape(k) for k in keys) + r")$"  # no keys: matches every key
        ignore = set(cls._keys_to_ignore_on_load_unexpected or []) | ({pattern} if keys else set())
        sub = type(cls.__name__, (cls,), {"_keys_to_ignore_on_load_unexpected": ignore,
                                          "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        model = sub.from_pretrained(str(view), **kwargs)
    model.__class__ = cls
    for m in hf_models(model):
        m.config._name_or_path = str(directory)
    own = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
    if isinstance(own, set):
        own.discard(pattern)
    return model


def load_weights(model: nn.Module, directory: Path, keys: list[str], variant: str | None = None) -> None:
    """Load the weights (of ``variant``) of the Hugging Face save in ``directory`` into ``model``, an unconverted
    instance of that architecture, in place (its config and dtype stay; the unit tensors ``keys`` are left for
    the caller).

    transformers reads them into a second model (:func:`load_plain` of ``type(model)``: shards, renamed and
    tied keys as in any ``from_pretrained``), whose state is copied into ``model``: a second copy of the model
    in memory while it runs. Raises ``ValueError`` when ``model`` is another architecture (names or shapes).
    """
    saved = load_plain(type(model), directory, keys, {"variant": variant}).state_dict()
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    shapes = sorted(k for k in set(own) & set(saved) if own[k].shape != saved[k].shape)
    if missing or extra or shapes:
        name = type(model).__name__
        raise ValueError(f"the {name} given does not fit the weights saved in {directory} (missing {missing[:5]}, "
                         f"unexpected {extra[:5]}, other shapes {shapes[:5]}): build it from {directory / HF_CONFIG}, "
                         f"or pass its class, linearize.from_pretrained({name}, {str(directory)!r})")
    model.load_state_dict(saved)
