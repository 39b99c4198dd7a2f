"""Save and load converted models as a sidecar: the config as JSON plus the unit tensors and weights.

``from_pretrained`` of a Hugging Face model (or a torchvision builder) rebuilds the original
activations, so the units cannot live in the base model's own checkpoint. The sidecar holds:

- ``linearize_config.json``, the manifest: the :class:`LinearizeConfig`, the site list (name,
  kind, channels, channel dim), the format version, the name, size and SHA-256 of the tensor file,
  ``base``: where the model's own weights are (see below), and ``extra_state``: the modules' non-tensor
  ``get_extra_state`` values (JSON data; given back through ``set_extra_state``), where there are any;
- ``linearize_units-<first 16 hex digits of its SHA-256>.safetensors``: in ``"prelu"`` mode the
  unit tensors (``<site>.slope``, ``<site>.frozen``, and ``<site>.alpha``, ``<site>.beta`` for a unit
  with an affine linear end; saves without them load with the identity end) and, for a model that is not a Hugging Face
  model, all its other weights (``__linearize_model__.<state dict key>``; ``base: {"saved": true}``);
  in gated modes the whole gated model (its feature network is new weights).

A Hugging Face model's weights belong in its own ``model.save_pretrained(directory)`` (whose
``config.json`` carries the units as well, see :mod:`linearize.hf`): when the folder holds that save of the
same weights, its sidecar records only their digests (``base: {"saved": false, "tensors": {key: digest}}``);
beside an older one it keeps the weights itself. Beside a save whose ``config.json`` carries units, the
manifest's ``supersedes`` records that save's tensors (a SHA-256 of their digests): while the folder
still holds them, the sidecar is the newer save, and a load takes it over them. Loading re-converts a
freshly built model with the saved config and copies the tensors in, so outputs are bit-identical: the weights
come from the sidecar, or from the Hugging Face save in the folder; units are never put on other
weights without a word (see :func:`from_pretrained`).

Atomic pair: a save writes the tensor file under its new (content-derived) name, then replaces the
manifest (each file through a temporary sibling and a rename, flushed to disk), and only then
removes the previous tensor file. Interrupted anywhere (disk full, a crash, a kill), the directory
still loads the previous save, unchanged; a first save that fails leaves nothing that loads.

Concurrent saves: saves into one folder (every DDP rank without a main-process guard, threads) take
turns on the folder's save lock (:func:`linearize._files.save_lock`, ``.linearize.lock`` in the
folder, released by the OS when its holder dies), so the folder always ends up holding one of them,
whole: the last writer's. Loads take no lock (a read-only folder loads): they see the manifest
before or after its rename, and a reader whose tensor file a save removed meanwhile re-reads it.

Validated loads: the manifest's structure, the tensor file's size and checksum (a flipped bit is
caught), the safetensors decoding, and each unit's tensors (floating point, of the unit's shape,
slopes finite in ``[0, 1]``, frozen values 0, 1 or NaN = free, with the slope at its frozen value)
are checked before the model is touched; any failure raises :class:`LoadError` (a ``ValueError``)
naming the file and the unit. ``save_pretrained`` refuses a state that would not load back.
Format 1 sidecars (``linearize_units.safetensors``, no checksum) and format 2 sidecars (no
``base``: the units only) still load, with the same checks but the checksum (format 1); loaded into a
model instance, their units go on its own weights, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from ._files import (MAX_JSON_BYTES, LoadError, atomic_write, check_folder, check_given_folder, parse_json, read_file,
                     read_json, remove_stale, save_lock)
from .config import LinearizeConfig
from .distributed import refuse_sharded
from .manifest import CONFIG_NAME, FOLDED_CONFIG, FORMAT_VERSION, clean_name as _clean, site_records as _sites
from .unit import units

__all__ = ["save_pretrained", "from_pretrained", "load_unit_tensors", "unwrap_model", "LoadError", "UnitsOnlyWarning"]

LEGACY_WEIGHTS_NAME = "linearize_units.safetensors"  # format 1: a fixed name, no checksum
SIDECAR_FORMAT = 3  # format 2 (manifest.FORMAT_VERSION, still that of an HF config.json) + "base"
MODEL_PREFIX = "__linearize_model__."  # the model's own weights in the tensor file of a format 3 save
_WEIGHTS_RE = re.compile(r"linearize_units-([0-9a-f]{16})\.safetensors")
_SITE_KEYS = {"name", "kind", "num_channels", "channel_dim"}
_READ_TRIES = 10  # manifest re-reads when concurrent saves swap the pair under a reader
_MAX_UNITS_BYTES = 2**32  # the largest tensor file of a format-1 sidecar (later formats record its size)
_SAVE_AGAIN = "Save the model again with linearize.save_pretrained(model, directory)."


class UnitsOnlyWarning(UserWarning):
    """A sidecar written before saves held the model's weights (formats 1 and 2) was loaded into a model
    instance: its units went on the weights the instance had. A caller that loads the right weights itself
    right after may filter this category."""


# a unit's affine linear end, saved where set, and end_fixed where it is fixed (LinearizableActivation.set_linear_end)
END_KEYS = ("alpha", "beta", "end_fixed")


def weights_name(sha256: str) -> str:
    """File name of the tensor file whose SHA-256 hex digest is ``sha256``."""
    return f"linearize_units-{sha256[:16]}.safetensors"


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip ``torch.compile`` (``_orig_mod``) and DDP/DataParallel (``module``) wrappers."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


def saved_tensors(model: nn.Module, gated: bool, base: bool = False) -> dict[str, torch.Tensor]:
    """The CPU tensors a save writes of ``model`` (unwrapped by the caller, :func:`unwrap_model`): gated modes
    the whole state dict, by its keys (a submodule of the user's named ``module`` keeps its name); ``"prelu"``
    mode the units' (``<site>.slope``, ``<site>.frozen``, named as their sites) and with ``base`` the model's
    other weights (``MODEL_PREFIX + <state dict key>``). Raises ``ValueError`` when two tensors get one name."""
    if gated:  # without the non-tensor extra states (extra_states: the manifest keeps them)
        items = [(k, t) for k, t in model.state_dict().items() if isinstance(t, torch.Tensor)]
    else:
        items = [(_clean(f"{n}.{k}"), t) for n, u in units(model) for k, t in _unit_items(u)]
        clash = next((k for k, _ in items if k.startswith(MODEL_PREFIX)), None)
        if clash is not None:
            raise ValueError(f"cannot save unit tensor {clash!r}: its name starts with {MODEL_PREFIX!r}, the prefix "
                             "of the model's own weights in the save; rename that module")
        if base:
            items += [(MODEL_PREFIX + k, t) for k, t in _base_state(model).items()]
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in items:
        if name in tensors:
            raise ValueError(f"cannot save tensor {name!r}: two tensors of the model have that name once a wrapper's "
                             "prefix (module., _orig_mod.) is removed from a unit's; rename one of those modules")
        if t.data_ptr() in seen and t.numel():  # tied weights: safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t.detach().cpu().contiguous()
    return tensors


def _unit_items(unit: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A unit's saved tensors by key: ``slope``, ``frozen`` and, where set, its affine linear end ``alpha``,
    ``beta`` (a unit without one, and every save before it existed, has the identity end), with ``end_fixed``
    where those are fixed buffers, not parameters."""
    fixed = getattr(unit, "end_fixed", None)
    return ([("slope", unit.slope), ("frozen", unit.frozen)] + list(zip(("alpha", "beta"), unit.linear_end or ()))
            + ([] if fixed is None else [("end_fixed", fixed)]))


def _base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` without its units' slopes and frozen values (and without the non-tensor
    entries of ``get_extra_state``): the weights the units act on."""
    own = {id(t) for _, u in units(model) for _, t in _unit_items(u)}
    return {k: t for k, t in model.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor) and id(t) not in own}


def extra_states(model: nn.Module) -> dict[str, Any]:
    """The non-tensor entries of ``model.state_dict()`` (what modules return from ``get_extra_state``) by key,
    for a save to keep as JSON. Raises ``ValueError`` naming the module when one is not plain JSON data that
    reads back equal (a save runs no code to rebuild other objects)."""
    out: dict[str, Any] = {}
    modules = dict(model.named_modules())
    for key, value in model.state_dict().items():
        if isinstance(value, torch.Tensor):
            continue
        try:
            same = json.loads(json.dumps(value, allow_nan=False)) == value
        except (TypeError, ValueError, RecursionError):
            same = False
        if not same:
            name = key.rpartition(".")[0]
            raise ValueError(
                f"cannot save the extra state of module {name or '<root>'!r} ({type(modules.get(name)).__name__}): "
                f"get_extra_state returned a {type(value).__name__} that is not plain JSON data (numbers, strings, "
                "booleans, None, lists and dicts with string keys, read back equal), and a save runs no code to "
                "rebuild other objects; return such data (or a tensor) from get_extra_state")
        out[key] = value
    return out


def load_extra_states(model: nn.Module, extra: dict[str, Any], path: Path) -> None:
    """Give ``model``'s modules the saved non-tensor extra states ``extra`` (:func:`extra_states`) through their
    ``set_extra_state``; :class:`LoadError` naming ``path`` when the model's modules hold others, or refuse them."""
    want = sorted(k for k, v in model.state_dict().items() if not isinstance(v, torch.Tensor))
    if want != sorted(extra):
        raise LoadError(f"{path}: the model holds extra state (get_extra_state) {want[:5]}, the save "
                        f"{sorted(extra)[:5]}: another architecture, or a save by a linearize that dropped it. Build "
                        "the same architecture, or save the model again.")
    try:  # each module's own set_extra_state (a load_state_dict would run every module's versioned loading)
        for key, value in extra.items():
            model.get_submodule(key.rpartition(".")[0]).set_extra_state(value)
    except Exception as err:  # noqa: BLE001 -- the module's own set_extra_state refusing a saved value
        raise LoadError(f"{path}: set_extra_state refused the saved extra state ({type(err).__name__}: "
                        f"{str(err).strip()[:200]}); the file was edited, or the module changed since the save. "
                        "Save the model again.") from None


def _unit_keys(model: nn.Module) -> list[str]:
    """The names of the unit tensors a ``"prelu"`` save of ``model`` writes."""
    return [_clean(f"{n}.{k}") for n, u in units(model) for k, _ in _unit_items(u)]


def _exact_digest(t: torch.Tensor) -> str:
    """A tensor's dtype, shape and :func:`_tensor_digest`: the same for the same stored tensor only."""
    return f"{t.dtype} {list(t.shape)} {_tensor_digest(t)}"


def _fingerprint(exact: dict[str, str]) -> str:
    """SHA-256 of :func:`_exact_digest` by tensor name: which Hugging Face save a sidecar was written beside."""
    return hashlib.sha256(json.dumps(sorted(exact.items())).encode()).hexdigest()


def _stored_digests(directory: Path, keys: list[str], variant: str | None = None) -> dict[str, tuple[str, str]]:
    """``{key: (value digest, exact digest)}`` of the tensors ``keys`` in the Hugging Face weights (of ``variant``)
    of ``directory`` as stored (their dtype, not that of a model they were loaded into), absent ones left out;
    ``{}`` when they cannot be read."""
    from . import hf

    try:
        return hf.read_unit_tensors(directory, keys, lambda t: (_value_digest(t), _exact_digest(t)), variant)[0]
    except (OSError, LoadError):  # damaged or missing files: they hold nothing of the model
        return {}


def _holds(stored: dict[str, tuple[str, str]], model: nn.Module, digests: dict[str, str]) -> bool:
    """Whether the tensors ``stored`` in a Hugging Face save (:func:`_stored_digests`) are the weights of ``model``
    (their ``digests``): each of them is there with its value, or is tied to one that is (a save keeps one of
    tied weights)."""
    state = _base_state(model)
    there = {id(t) for k, t in state.items() if k in stored and stored[k][0] == digests[k]}
    return all(id(t) in there and (k not in stored or stored[k][0] == digests[k]) for k, t in state.items())


def _value_digest(t: torch.Tensor) -> str:
    """:func:`_tensor_digest` of a tensor's values, floating ones in float64: the same for an exact copy in
    another floating dtype (bfloat16 weights loaded as float32), another for any other value."""
    t = t.detach()
    return _tensor_digest(t.to("cpu", torch.float64) if t.is_floating_point() else t)


def unit_problem(slope: torch.Tensor, frozen: torch.Tensor, num_channels: int,
                  end: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> str | None:
    """What is wrong with a unit's ``slope`` and ``frozen`` tensors and its affine linear ``end`` (``alpha``,
    ``beta``: both or neither) (None when nothing is).

    A unit holds floating ``[C]`` tensors; slopes are finite and in ``[0, 1]``; frozen channels
    hold 0 or 1 (NaN marks a free channel) and their slope equals the frozen value; ``alpha`` and
    ``beta`` are finite.
    """
    if (end[0] is None) != (end[1] is None):
        return f"it has {'alpha' if end[0] is not None else 'beta'} without {'beta' if end[0] is not None else 'alpha'}"
    named = [("slope", slope), ("frozen", frozen)] + ([] if end[0] is None else [("alpha", end[0]), ("beta", end[1])])
    for what, t in named:
        if not t.is_floating_point():
            return f"{what} has dtype {t.dtype}, expected a floating-point tensor"
        if tuple(t.shape) != (num_channels,):
            return f"{what} has shape {tuple(t.shape)}, expected ({num_channels},)"
    slope, frozen = slope.detach().float().cpu(), frozen.detach().float().cpu()

    def first(mask: torch.Tensor) -> int:
        return int(mask.nonzero()[0, 0])

    for what, t in named[2:]:
        if not bool(torch.isfinite(t.detach()).all()):
            i = first(~torch.isfinite(t.detach().cpu()))
            return f"{what} (affine linear end) holds a non-finite value at channel {i}"

    bad = ~torch.isfinite(slope)
    if bad.any():
        i = first(bad)
        return f"slope holds {int(bad.sum())} non-finite value(s), e.g. {float(slope[i])} at channel {i}"
    if ((slope < 0) | (slope > 1)).any():
        i = first((slope < 0) | (slope > 1))
        return f"slope {float(slope[i])} at channel {i} lies outside [0, 1]"
    held = ~torch.isnan(frozen)
    if (held & (frozen != 0) & (frozen != 1)).any():
        i = first(held & (frozen != 0) & (frozen != 1))
        return f"frozen value {float(frozen[i])} at channel {i}: a frozen channel holds 0 or 1 (NaN marks a free one)"
    if (held & (slope != frozen)).any():
        i = first(held & (slope != frozen))
        return f"channel {i} is frozen at {float(frozen[i]):g} but its slope is {float(slope[i])}"
    return None


def _tensor_digest(t: torch.Tensor) -> str:
    """First 16 hex digits of the SHA-256 of a tensor's bytes (names the tensor a damaged file changed)."""
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()[:16]


def _with_versions(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` with ``model``'s state-dict metadata (each module's version), which a safetensors file does not
    keep and some modules' ``_load_from_state_dict`` require (torchvision's MNASNet)."""
    out = OrderedDict(state)
    out._metadata = getattr(model.state_dict(), "_metadata", None)  # type: ignore[attr-defined]
    return out


def save_pretrained(model: nn.Module, directory: str | os.PathLike, *, weights: bool = True) -> Path:
    """Write the linearize sidecar of a converted ``model`` into ``directory`` (created if needed).

    What it holds gets the model back: the units and all the model's other weights (the save is as large
    as the model), except for a Hugging Face model whose own ``model.save_pretrained(directory)`` of the same
    weights is in the folder already (an older one is not: then they are saved here): then the sidecar
    records their digests, so that :func:`from_pretrained` refuses to put
    the units on other weights. ``weights=False`` records digests
    for any model: for a caller that saves the weights itself and loads them into the instance before
    :func:`from_pretrained` (the CIFAR recipe's ``model.safetensors``). Gated modes: the whole model.

    Atomic as a pair: until the new manifest is in place the directory loads the previous save,
    unchanged; a failed save removes what it wrote and re-raises. Concurrent saves into one folder (every
    DDP rank, threads) take turns on its save lock (``directory/.linearize.lock``, waiting at most 600 s:
    then ``TimeoutError``), so the folder always holds one complete save, the last one. Returns the
    directory.

    Raises ``ValueError`` for a model that was never converted, or whose units hold a state that
    would not load back (a slope outside ``[0, 1]`` or not finite, a frozen channel off its value).

    Example:
        >>> import tempfile
        >>> model, fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        >>> _ = linearize.convert(model, example_inputs=torch.randn(1, 4))[1].slope.data.fill_(0.5)
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     _ = linearize.save_pretrained(model, directory)
        ...     loaded = linearize.from_pretrained(fresh, directory, example_inputs=torch.randn(1, 4))
        >>> x = torch.randn(3, 4); torch.equal(loaded(x), model(x)) and loaded is fresh
        True
    """
    model = unwrap_model(model)
    config = getattr(model, "linearize_config", None)
    if not isinstance(config, LinearizeConfig):
        raise ValueError("save_pretrained needs a model converted with linearize.convert")
    refuse_sharded(model, "save_pretrained")  # FSDP2: a rank holds a shard of each weight
    gated = config.mode != "prelu"
    if not gated:
        for name, unit in units(model):
            problem = unit_problem(unit.slope, unit.frozen, unit.num_channels, unit.linear_end or (None, None))
            if problem:
                raise ValueError(
                    f"cannot save unit {_clean(name)!r}: {problem}. A saved sidecar must load back: slopes "
                    "finite in [0, 1], frozen channels at their value (linearize.project_slopes(model) "
                    "clamps the slopes and restores frozen channels)"
                )
    from . import hf

    if not isinstance(weights, bool):
        raise TypeError(f"save_pretrained: weights must be True or False, got {weights!r}")
    extra = extra_states(model)
    # the weights saved elsewhere (model.save_pretrained's files in this folder, when they hold the model's
    # weights, or the caller's own): only their digests here; an HF model saved into a folder without its own
    # weights, or beside an older save of them, keeps them here (the only save of them)
    beside = not gated and hf.is_hf_model(model) and hf.has_weights(directory)
    digests = {k: _value_digest(t) for k, t in _base_state(model).items()} if beside or not (gated or weights) else {}
    stored = _stored_digests(Path(directory), [*digests, *_unit_keys(model)]) if beside else {}
    elsewhere = not gated and (not weights or (beside and _holds(stored, model, digests)))
    tensors = saved_tensors(model, gated, base=not elsewhere)
    # the HF save this sidecar is written after (the load refuses a folder whose two saves differ, unless the
    # HF save is still this one: then the sidecar is the newer save): that of the default variant, or where there
    # is none the one variant save there (model.save_pretrained(d, variant="fp16"))
    variants = [] if beside or gated or not hf.is_hf_model(model) else hf.weight_variants(directory)
    if len(variants) == 1:
        stored = _stored_digests(Path(directory), [*_base_state(model), *_unit_keys(model)], variants[0])
    supersedes = _fingerprint({k: stored[k][1] for k in (k.removeprefix(MODEL_PREFIX) for k in tensors)
                               if k in stored}) if (beside or len(variants) == 1) and hf.has_manifest(directory) else None
    data = safetensors.torch.save(tensors, {"format": "pt"})
    digest = hashlib.sha256(data).hexdigest()
    name = weights_name(digest)
    meta = {
        "format": SIDECAR_FORMAT,
        "config": config.to_dict(),
        "sites": _sites(model),
        "weights": {"file": name, "bytes": len(data), "sha256": digest,
                    "tensors": {k: _tensor_digest(t) for k, t in tensors.items()}},
        "base": {"saved": False, "tensors": digests} if elsewhere else {"saved": True},
        **({"supersedes": supersedes} if supersedes else {}),
        **({"extra_state": extra} if extra else {}),
    }
    directory = Path(directory)
    check_folder(directory, "save_pretrained: directory")
    directory.mkdir(parents=True, exist_ok=True)
    with save_lock(directory) as outermost:
        existed = (directory / name).exists()  # the same tensors saved before: the old manifest may name it
        try:
            atomic_write(directory / name, data)
            atomic_write(directory / CONFIG_NAME, json.dumps(meta, indent=2))
        except BaseException:
            if not existed and _manifest_file(directory) != name:  # not committed: remove what this save wrote
                (directory / name).unlink(missing_ok=True)
            raise
        if outermost:
            remove_stale(directory, {name, CONFIG_NAME},
                         lambda n: n in (CONFIG_NAME, LEGACY_WEIGHTS_NAME) or _WEIGHTS_RE.fullmatch(n) is not None)
    return directory


def _manifest_file(directory: Path) -> str | None:
    """The tensor file named by the manifest in ``directory`` (None when unreadable)."""
    try:
        return read_json(directory / CONFIG_NAME, "sidecar config")["weights"]["file"]
    except (OSError, ValueError, KeyError, TypeError):  # LoadError is a ValueError
        return None


def _parse_manifest(raw: bytes, path: Path, weights: bool = True) -> dict[str, Any]:
    """The checked contents of ``linearize_config.json``: ``format``, ``config`` (a
    :class:`LinearizeConfig`), ``sites``, ``weights`` (``file``, ``bytes``, ``sha256``; the last
    two None for format 1) and ``base`` (format 3: ``{"saved": true}``, or ``{"saved": false,
    "tensors": {key: digest}}``; None before). Raises :class:`LoadError` naming ``path``.

    ``weights=False``: the manifest an HF ``config.json`` carries (``linearize`` key), whose tensors
    are in the model's own weights: no ``weights`` entry (returned as None)."""

    def bad(what: str) -> LoadError:
        return LoadError(f"{path}: {what}. The sidecar config is damaged or was edited. {_SAVE_AGAIN}")

    try:
        meta = parse_json(raw, path)
    except LoadError as err:
        raise LoadError(f"{err}. {_SAVE_AGAIN}") from None
    if not isinstance(meta, dict):
        raise bad(f"expected a JSON object, got {type(meta).__name__}")
    fmt = meta.get("format")
    formats = (1, FORMAT_VERSION, SIDECAR_FORMAT) if weights else (1, FORMAT_VERSION)
    if fmt not in formats or isinstance(fmt, bool):
        raise LoadError(f"{path}: unsupported sidecar format {fmt!r}; this linearize reads formats "
                        f"{', '.join(map(str, formats))}. If a newer linearize wrote it, upgrade linearize; else "
                        f"the file is damaged. {_SAVE_AGAIN}")
    missing = [k for k in ("config", "sites", "weights")[: 3 if fmt >= 2 and weights else 2] if k not in meta]
    if missing:
        raise bad(f"missing {', '.join(map(repr, missing))}")
    if not isinstance(meta["config"], dict):
        raise bad("'config' is not a JSON object")
    try:
        # a sidecar written before LinearizeConfig.gates existed converted gates: keep that
        config = LinearizeConfig.from_dict({"gates": "include", **meta["config"]})
    except (TypeError, ValueError) as err:
        raise bad(f"invalid 'config' ({err})") from None
    sites = meta["sites"]
    if not isinstance(sites, list) or not all(_valid_site(s) for s in sites):
        raise bad("'sites' must be a list of {name, kind, num_channels >= 1, channel_dim} (and map_shape, element units)")
    if len({s["name"] for s in sites}) != len(sites):
        raise bad("'sites' names a unit twice")
    if not weights:
        return {"format": fmt, "config": config, "sites": sites, "weights": None, "base": None, "supersedes": None,
                "extra_state": {}}
    if fmt == 1:
        return {"format": fmt, "config": config, "sites": sites, "base": None, "supersedes": None, "extra_state": {},
                "weights": {"file": LEGACY_WEIGHTS_NAME, "bytes": None, "sha256": None}}
    w = meta["weights"]
    if not (isinstance(w, dict) and isinstance(w.get("file"), str) and isinstance(w.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", w["sha256"]) and w["file"] == weights_name(w["sha256"])
            and type(w.get("bytes")) is int and w["bytes"] >= 0 and isinstance(w.get("tensors", {}), dict)
            and all(isinstance(d, str) for d in w.get("tensors", {}).values())):
        raise bad("'weights' must be {file: linearize_units-<sha256[:16]>.safetensors, bytes, sha256, "
                  "tensors: {name: digest}}")
    base = meta.get("base")
    if fmt == SIDECAR_FORMAT and not (
        isinstance(base, dict) and (base == {"saved": True} or (
            set(base) == {"saved", "tensors"} and base["saved"] is False and isinstance(base["tensors"], dict)
            and all(isinstance(d, str) for d in base["tensors"].values())))):
        raise bad("'base' must be {saved: true} or {saved: false, tensors: {name: digest}}")
    supersedes = meta.get("supersedes")
    if supersedes is not None and not (isinstance(supersedes, str) and re.fullmatch(r"[0-9a-f]{64}", supersedes)):
        raise bad("'supersedes' must be a SHA-256 (64 hex digits)")
    extra = meta.get("extra_state", {})
    if not isinstance(extra, dict):
        raise bad("'extra_state' must be {state dict key: value}")
    return {"format": fmt, "config": config, "sites": sites, "weights": w,
            "base": base if fmt == SIDECAR_FORMAT else None, "supersedes": supersedes, "extra_state": extra}


def _read_hf_manifest(directory: Path) -> dict[str, Any]:
    """The checked linearize manifest in ``directory/config.json`` (an HF save of a converted model)."""
    from .hf import CONFIG_KEY, HF_CONFIG

    path = directory / HF_CONFIG
    config = read_json(path, "Hugging Face config")
    block = config.get(CONFIG_KEY) if isinstance(config, dict) else None
    return _parse_manifest(json.dumps(block).encode(), path, weights=False)


def _valid_site(site: Any) -> bool:
    if not isinstance(site, dict):
        return False
    shape = site.get("map_shape")  # element-level units: one slope per position of this map
    return ((set(site) == _SITE_KEYS or (set(site) == _SITE_KEYS | {"map_shape"} and isinstance(shape, list)
                                          and all(type(n) is int and n >= 1 for n in shape)
                                          and math.prod(shape) == site["num_channels"]))
            and isinstance(site["name"], str) and isinstance(site["kind"], str)
            and type(site["num_channels"]) is int and site["num_channels"] >= 1 and type(site["channel_dim"]) is int)


def _sites_differ(model: nn.Module, found: list[dict], saved_sites: list[dict], directory: Path) -> ValueError:
    """The error for a model whose converted sites are not the saved ones; a save holding one unit per
    iteration of a loop that this version gives one shared unit (:func:`_split_loops`) is named as such."""
    saved = {s["name"]: s for s in saved_sites}
    split = _split_loops(model, found, set(saved))
    if split:
        return ValueError(
            f"the save in {directory} holds one unit per iteration of a loop (units {split[0][1][:5]} for the "
            f"model's {split[0][0]!r}{f', and {len(split) - 1} more loop(s)' if len(split) > 1 else ''}), as an "
            "earlier linearize version converted it; this version gives a loop whose iterations nothing tells "
            "apart (one activation over weights: a ParameterList, an RNN over parameters) one shared unit, so the "
            "saved per-iteration slopes fit no unit of this model. Fix: convert the original model again with this "
            "version (and train its units), or load the save with the linearize version that wrote it")
    diff = [s["name"] for s in found if saved.get(s["name"]) != s] + sorted(set(saved) - {s["name"] for s in found})
    return ValueError(f"the model does not match the saved one in {directory}: {len(diff)} site(s) differ, e.g. "
                      f"{diff[:5]}. Build the same architecture (same config) before loading.")


def _split_loops(model: nn.Module, found: list[dict], saved: set[str]) -> list[tuple[str, list[str]]]:
    """``(unit, saved units)`` for each unit of the converted ``model`` that a loop's iterations share while the
    ``saved`` unit names hold one per iteration, as linearize wrote them before loops were told apart: a
    functional loop's ``<owner>.linearize_functional.<kind>_0`` (its owner's sites repeat) saved as ``..._0``,
    ``..._1`` ...; an activation module's ``<name>`` saved as ``<name>.calls.0``, ``<name>.calls.1`` ...."""
    modules = dict(model.named_modules())
    names = {s["name"] for s in found}
    split = []
    for name in sorted(names):
        head, _, last = name.rpartition(".")
        stem = name[:-1] if last.endswith("_0") and getattr(modules.get(head), "repeat", False) else f"{name}.calls."
        calls = sorted((n for n in saved if n.startswith(stem) and n[len(stem):].isdigit()),
                       key=lambda n: int(n[len(stem):]))
        if len(calls) > 1 and not (set(calls) - {name}) & names:
            split.append((name, calls))
    return split


def _map_mismatch(found: list[dict], saved: list[dict], directory: Path) -> ValueError | None:
    """The error for element-level units converted at another map shape than the saved ones (the probe of
    :func:`from_pretrained` ran on inputs of another size), naming both shapes and the fix; else ``None``."""
    shapes = {s["name"]: s.get("map_shape") for s in saved}
    for site in found:
        want, got = shapes.get(site["name"]), site.get("map_shape")
        if want is not None and got is not None and want != got:
            return ValueError(
                f"the element-level unit {site['name']!r} in {directory} was saved for a {want} map (one slope per "
                f"position), but the model converted for loading gives it a {got} map: example_inputs set the map "
                f"shapes. Pass example_inputs of the size the model was saved at (batch, then the input's "
                f"shape at conversion) to linearize.from_pretrained")
    return None


def _read_sidecar(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """``(manifest, tensors, tensor file)`` of the sidecar in ``directory``, checked as a pair.

    The tensor file must have the size and SHA-256 the manifest recorded. When it does not (or is
    gone) and the manifest changed meanwhile, a save swapped the pair while we read: read again.
    """
    config_path = directory / CONFIG_NAME
    for attempt in range(_READ_TRIES):
        raw = read_file(config_path, MAX_JSON_BYTES, "sidecar config")
        meta = _parse_manifest(raw, config_path)
        w = meta["weights"]
        path = directory / w["file"]
        data, problem = _read_tensor_file(path, w)
        if problem is None:
            break
        if attempt + 1 < _READ_TRIES and read_file(config_path, MAX_JSON_BYTES, "sidecar config") != raw:
            continue
        raise LoadError(f"{path}: {problem}; refusing to load it. Restore the directory from a backup, or save "
                        "the model again with linearize.save_pretrained(model, directory).")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as err:  # a decoder of arbitrary bytes: any error means a damaged file
        raise LoadError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err}); it is "
                        f"truncated or damaged. {_SAVE_AGAIN}") from err
    return meta, tensors, path


def _read_tensor_file(path: Path, weights: dict[str, Any]) -> tuple[bytes | None, str | None]:
    """``(its bytes, None)`` when the sidecar's tensor file ``path`` matches the manifest's record ``weights``,
    else ``(None, what is wrong)``. Only a regular file of at most the recorded size is read (not a link to
    ``/dev/zero``, a FIFO, or a file grown huge)."""
    limit = _MAX_UNITS_BYTES if weights["bytes"] is None else weights["bytes"]
    try:
        data = read_file(path, limit, "sidecar tensor file")
    except FileNotFoundError:
        return None, f"is missing, though {CONFIG_NAME} names it"
    except LoadError as err:  # a folder, FIFO or device, or larger than the manifest recorded: not read
        return None, f"is not the file {CONFIG_NAME} recorded ({err})"
    problem = _pair_problem(data, weights)
    return (data, None) if problem is None else (None, problem)


def _pair_problem(data: bytes, weights: dict[str, Any]) -> str | None:
    """What is wrong with the tensor file's bytes ``data`` against the manifest's record."""
    if weights["bytes"] is not None and len(data) != weights["bytes"]:
        return f"has {len(data)} bytes, {CONFIG_NAME} recorded {weights['bytes']} at save time (truncated?)"
    if weights["sha256"] is not None and hashlib.sha256(data).hexdigest() != weights["sha256"]:
        changed = _changed_tensors(data, weights.get("tensors") or {})
        where = f" (changed: {', '.join(changed[:5])})" if changed else ""
        return (f"does not match the SHA-256 recorded at save time{where}: it was damaged (e.g. a flipped bit) "
                "or modified")
    return None


def _changed_tensors(data: bytes, digests: dict[str, str]) -> list[str]:
    """Names of the tensors whose bytes differ from their digest at save time ([] if undecodable)."""
    try:
        tensors = safetensors.torch.load(data)
    except Exception:  # the header itself is damaged: the caller reports the file as a whole
        return []
    return sorted(k for k, d in digests.items() if k not in tensors or _tensor_digest(tensors[k]) != d)


def _check_unit_tensors(tensors: dict[str, torch.Tensor], sites: list[dict], path: Path) -> None:
    """Refuse (:class:`LoadError`) unit tensors that a saved unit cannot hold."""
    expected = {f"{s['name']}.{k}" for s in sites for k in ("slope", "frozen") + END_KEYS}
    extra = sorted(set(tensors) - expected)
    if extra:
        raise LoadError(f"{path}: tensors {extra[:5]} belong to no unit of {CONFIG_NAME}; the pair is "
                        f"inconsistent. {_SAVE_AGAIN}")
    for site in sites:
        name = site["name"]
        for key in ("slope", "frozen"):
            if f"{name}.{key}" not in tensors:
                raise LoadError(f"{path}: unit {name!r} has no {key!r} tensor ({name}.{key}); the file is "
                                f"incomplete. {_SAVE_AGAIN}")
        problem = unit_problem(tensors[f"{name}.slope"], tensors[f"{name}.frozen"], site["num_channels"],
                                (tensors.get(f"{name}.alpha"), tensors.get(f"{name}.beta")))
        if problem:
            raise LoadError(f"{path}: unit {name!r}: {problem}. The file is damaged or was not written by "
                            f"linearize.save_pretrained; refusing to load it. {_SAVE_AGAIN}")


def _check_state_tensors(tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor], path: Path,
                         what: str = "gated model") -> None:
    """Refuse (:class:`LoadError`) saved tensors (of a gated model, or a model's own weights) that do not fit
    the rebuilt model's ``state``."""
    missing, extra = sorted(set(state) - set(tensors)), sorted(set(tensors) - set(state))
    if missing or extra:
        raise LoadError(f"{path}: the saved {what} does not match the rebuilt one (missing {missing[:5]}, "
                        f"unexpected {extra[:5]}). Build the same architecture (same config) before loading.")
    for key, t in tensors.items():
        ref = state[key]
        if tuple(t.shape) != tuple(ref.shape) or t.is_floating_point() != ref.is_floating_point() or (
            not t.is_floating_point() and t.dtype != ref.dtype
        ):
            raise LoadError(f"{path}: tensor {key!r} is {t.dtype} {tuple(t.shape)}, the model expects "
                            f"{ref.dtype} {tuple(ref.shape)}. Build the same architecture (same config) "
                            "before loading.")


def load_unit_tensors(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The saved tensors of the sidecar in ``directory``, checked, without building a model.

    ``"prelu"`` mode: ``{"<site>.slope", "<site>.frozen"}`` for every saved site; gated modes: the
    gated model's state dict. Raises ``FileNotFoundError`` and :class:`LoadError` as
    :func:`from_pretrained` does (the file names vary between saves: read them through this).
    """
    return _load_checked(Path(directory))[1]


def _load_checked(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor] | None,
                                            Path]:
    """``(manifest, tensors, model weights, tensor file)`` of the sidecar in ``directory``, with every check
    that needs no model (manifest, size, checksum, decoding, unit tensors in ``"prelu"`` mode). In
    ``"prelu"`` mode ``tensors`` are the units'; the model weights are the model's own weights a format 3
    save holds (``MODEL_PREFIX`` removed), None when it holds none."""
    if not (directory / CONFIG_NAME).exists():  # a folder or FIFO there is refused by name when read
        check_given_folder(directory, "a linearize save")
        if (directory / FOLDED_CONFIG).is_file():
            raise FileNotFoundError(f"{directory} holds a folded save ({FOLDED_CONFIG}), not a linearize sidecar: "
                                    "load it with linearize.load_folded(directory)")
        raise FileNotFoundError(
            f"{directory} has no linearize sidecar ({CONFIG_NAME}); "
            "write one with linearize.save_pretrained(model, directory)"
        )
    meta, tensors, path = _read_sidecar(directory)
    state = None
    if meta["config"].mode == "prelu":
        if meta["base"] == {"saved": True}:
            state = {k[len(MODEL_PREFIX):]: tensors.pop(k) for k in [k for k in tensors if k.startswith(MODEL_PREFIX)]}
        _check_unit_tensors(tensors, meta["sites"], path)
    return meta, tensors, state, path


def _load_hf_checked(directory: Path, variant: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """``(manifest, unit tensors, weights file)`` of a converted HF model saved with its own
    ``save_pretrained`` (manifest in ``config.json``, units in its weights of ``variant``), checked as a sidecar
    is."""
    from . import hf

    meta = _read_hf_manifest(directory)
    if meta["config"].mode != "prelu":
        raise LoadError(f"{directory / hf.HF_CONFIG}: gated mode {meta['config'].mode!r} is saved with "
                        "linearize.save_pretrained(model, directory) only")
    keys = [f"{s['name']}.{k}" for s in meta["sites"] for k in ("slope", "frozen") + END_KEYS]
    tensors, path = hf.read_unit_tensors(directory, keys, variant=variant)  # alpha / beta only where saved
    missing = [s["name"] for s in meta["sites"] if f"{s['name']}.slope" not in tensors]
    if missing:
        _refuse_renamed_units(missing, hf.stored_names(directory, variant), path)
    _check_unit_tensors(tensors, meta["sites"], path)
    return meta, tensors, path


def _refuse_renamed_units(missing: list[str], stored: list[str], path: Path) -> None:
    """:class:`LoadError` naming the fix when a unit of ``missing`` (names the manifest lists, whose tensors
    ``path`` lacks) is among the tensor names ``stored`` under another module path: transformers' own
    ``save_pretrained`` renames some architectures' modules on save (Mixtral: ``mlp`` -> ``block_sparse_moe``)."""
    elsewhere = [k[:-len(".slope")].split(".") for k in stored if k.endswith(".slope")]
    for name in missing:
        parts = name.split(".")
        like = [k for k in elsewhere if len(k) == len(parts) and k[-1] == parts[-1]]
        if like:
            found = ".".join(max(like, key=lambda k: sum(a == b for a, b in zip(k, parts))))
            raise LoadError(f"{path}: unit {name!r} is stored as {found!r}: transformers' save_pretrained renames "
                            "module paths on save for this architecture (its checkpoint key conversion), and "
                            "linearize cannot map them back. Save the converted model with "
                            "linearize.save_pretrained(model, directory), which writes its units under their own "
                            "names in a sidecar, and load that folder.")


def _check_agree(directory: Path, tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor] | None,
                 supersedes: str | None, variant: str | None) -> None:
    """Refuse a directory whose HF weights (of ``variant``) hold unit tensors, or model weights (``state``: those
    the sidecar holds, compared by name), other than the sidecar's: one of them was saved later
    (``model.save_pretrained`` into a folder with an older sidecar), unless they are still those the sidecar was
    saved beside (``supersedes``, their :func:`_fingerprint`): then the sidecar is the newer save. A folder with no
    HF weights of ``variant`` (only those of other variants) has none to agree with when the sidecar holds the
    weights (``state``)."""
    from . import hf

    if not hf.has_manifest(directory) or (state is not None and hf.weights_file(directory, variant) is None):
        return
    ours = {**tensors, **(state or {})}
    found, path = hf.read_unit_tensors(directory, sorted(ours), variant=variant)
    if supersedes is not None and _fingerprint({k: _exact_digest(t) for k, t in found.items()}) == supersedes:
        return
    differ = sorted(k for k, t in found.items()
                    if t.shape != ours[k].shape or not torch.equal(t.to(ours[k].dtype).nan_to_num(-1.0),
                                                                   ours[k].nan_to_num(-1.0)))
    if differ:
        what = "unit tensors" if any(k in tensors for k in differ) else "weights"
        raise LoadError(f"{path} and {directory / CONFIG_NAME} hold different {what} (e.g. {differ[:3]}): "
                        "one of them is stale (saved at another time). Save the model again with both "
                        "model.save_pretrained(directory) and linearize.save_pretrained(model, directory), or "
                        f"remove {CONFIG_NAME} to load the model of model.save_pretrained.")


def from_pretrained(model: nn.Module | type, directory: str | os.PathLike, example_inputs: Any = None,
                    **hf_kwargs: Any) -> nn.Module:
    """Re-convert a freshly built base ``model`` with the saved config and load the saved model into it.

    The weights the units act on come from the save, never silently from ``model``: those a sidecar holds
    (a model that is not a Hugging Face model, gated modes), else the Hugging Face save in ``directory``
    (``model.save_pretrained``: loaded into a ``model`` instance too, through transformers). Without
    either (the sidecar of a Hugging Face model alone) the instance's weights must be those the units
    were saved with (their digests); a sidecar of formats 1 and 2 (units only) loads onto them with a
    warning. Loads take no lock: a save racing the load is seen whole, before or after.

    Args:
        model: the same architecture the sidecar was saved from, *not* converted; or a Hugging
            Face model class (``AutoModel``, ``BertModel`` ...), loaded from ``directory`` with
            ``from_pretrained(directory, **hf_kwargs)`` (the unit tensors it holds are expected).
            ``subfolder=`` (any ``model``) names the folder inside ``directory`` that holds the save;
            ``variant=`` (any ``model``) reads the weights and units of that variant, as transformers does
            (``model.<variant>.safetensors``, ``pytorch_model.<variant>.bin`` or their shards).
        directory: a folder written by :func:`save_pretrained`, or by ``model.save_pretrained`` /
            a Trainer checkpoint of a converted HF model (its ``config.json`` carries the manifest).
        example_inputs: the probe input for ``convert`` (needed for models whose input
            ``convert`` cannot guess).

    Returns the converted model (the same object in ``"prelu"`` mode). Raises ``FileNotFoundError``
    when the sidecar is missing, :class:`LoadError` (a ``ValueError``) naming the file and the unit
    when the sidecar is damaged, tampered with or inconsistent (checked before ``model`` is
    converted) or the weights do not fit (another architecture, other weights than those the units
    were saved with), and ``ValueError`` when its sites do not match the model.

    Example::

        model.save_pretrained("out")                      # a converted HF model (or a Trainer)
        model = linearize.from_pretrained(AutoModel, "out")
    """
    from . import hf
    from .conversion import convert

    if not isinstance(model, (nn.Module, type)):
        fix = f"pass the model it builds, e.g. {model.__name__}()" if callable(model) and hasattr(model, "__name__") \
            else "pass the freshly built, unconverted model"
        raise TypeError(f"linearize.from_pretrained: model must be an nn.Module or a Hugging Face model class, got "
                        f"{type(model).__name__} {model!r:.80}: {fix}")
    variant = hf_kwargs.pop("variant", None)
    if variant is not None and (not isinstance(variant, str) or not variant or set(variant) & {"/", "\\", os.sep}):
        raise ValueError(f"linearize.from_pretrained: variant={variant!r} is not a variant name (as in "
                         "model.<variant>.safetensors, e.g. 'fp16'): pass the name save_pretrained(variant=) was given")
    directory = Path(directory) / (hf_kwargs.pop("subfolder", None) or "")  # the save is there, for every file read
    if variant is not None and hf.weights_file(directory, variant) is None:
        raise FileNotFoundError(f"{directory} holds no weights of variant {variant!r} ("
                                f"{hf.variant_name('model.safetensors', variant)}, "
                                f"{hf.variant_name('pytorch_model.bin', variant)} or their shards): pass the variant "
                                "its model.save_pretrained(variant=) was given, or none")
    if (directory / CONFIG_NAME).exists() or not hf.has_manifest(directory):
        meta, tensors, state, path = _load_checked(directory)
        if meta["config"].mode == "prelu":
            _check_agree(directory, tensors, state, meta["supersedes"], variant)
    else:
        meta, tensors, path = _load_hf_checked(directory, variant)
        state = None
    config = meta["config"]
    keys = [f"{s['name']}.{k}" for s in meta["sites"] for k in ("slope", "frozen") + END_KEYS]
    weights_from_folder = isinstance(model, type) or config.mode != "prelu" or state is not None
    if isinstance(model, type):
        built_from = variant  # a sidecar holding the weights beside variant saves only: built from one, then replaced
        if state is not None and variant is None and hf.weights_file(directory) is None:
            built_from = next(iter(hf.weight_variants(directory)), None)
        model = hf.load_plain(model, directory, keys, {**hf_kwargs, "variant": built_from})
    elif hf_kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(hf_kwargs)} (only with a model class)")
    elif not weights_from_folder and hf.is_hf_model(model) and hf.has_weights(directory, variant):
        hf.load_weights(model, directory, keys, variant)  # the folder's own weights, not the instance's
        weights_from_folder = True
    hf.unmark(model)
    model = convert(model, config, example_inputs=example_inputs)
    found = _sites(model)
    saved_name = {s["name"]: s["name"] for s in found}
    if found != meta["sites"]:
        saved_name = _base_model_names(model, found, meta["sites"], config.mode)
    if saved_name is None:
        raise _map_mismatch(found, meta["sites"], directory) or _sites_differ(model, found, meta["sites"], directory)
    if config.mode != "prelu":
        _check_state_tensors(tensors, {k: t for k, t in model.state_dict().items() if isinstance(t, torch.Tensor)},
                             path)
        model.load_state_dict(_with_versions(tensors, model), strict=False)  # every tensor checked above
        load_extra_states(model, meta["extra_state"], directory / CONFIG_NAME)
        return model
    if state is not None:
        plain = unwrap_model(model)
        _check_state_tensors(state, _base_state(plain), path, what="model")
        plain.load_state_dict(_with_versions(state, plain), strict=False)  # every key but the units' checked above
    elif not weights_from_folder or (meta["base"] or {}).get("saved") is False:  # digests: check any weights
        _check_base(unwrap_model(model), meta, directory, cross=found != meta["sites"], from_folder=weights_from_folder,
                    variant=variant)
    with torch.no_grad():
        for name, unit in units(model):
            key = saved_name.get(_clean(name))
            if key is not None:
                unit.slope.copy_(tensors[f"{key}.slope"])
                unit.frozen.copy_(tensors[f"{key}.frozen"])
                unit.set_linear_end(tensors.get(f"{key}.alpha"), tensors.get(f"{key}.beta"),  # None: identity
                                    trainable=f"{key}.end_fixed" not in tensors)
    load_extra_states(unwrap_model(model), meta["extra_state"],
                      directory / (CONFIG_NAME if meta["weights"] is not None else hf.HF_CONFIG))
    return model


def _check_base(model: nn.Module, meta: dict[str, Any], directory: Path, cross: bool, from_folder: bool,
                variant: str | None) -> None:
    """Refuse (:class:`LoadError`) to put the saved units on weights of ``model`` other than those they were
    saved with (the digests of a format 3 sidecar of a Hugging Face model); warn for a save that recorded
    none (formats 1 and 2). ``cross``: the units of a head model loaded into its base model (or the
    reverse): only the weights both have are compared, without the ``base_model_prefix``. ``from_folder``:
    the weights were loaded from the Hugging Face save in ``directory`` (its ``variant``; it may be older than
    the sidecar): they are compared as stored there, whatever dtype the model holds them in."""
    if meta["base"] is None:
        warnings.warn(f"{directory}: this save holds the units only (written by an older linearize, sidecar format "
                      f"{meta['format']}): they were loaded onto the weights {type(model).__name__} has now. If those "
                      "are not the weights the units were trained with, load those first (model.load_state_dict); "
                      "linearize.save_pretrained(model, directory) now saves what is needed.", UnitsOnlyWarning,
                      stacklevel=3)
        return
    lead = (getattr(model, "base_model_prefix", "") or "") + "."

    def plain(key: str) -> str:
        return key[len(lead):] if cross and lead != "." and key.startswith(lead) else key

    saved = {plain(k): d for k, d in meta["base"]["tensors"].items()}
    own = {plain(k): t for k, t in _base_state(model).items()}
    stored: dict[str, str] = {}
    if from_folder:  # the folder's tensors as stored: the model may hold them cast (dtype=torch.bfloat16)
        digests = _stored_digests(directory, sorted(meta["base"]["tensors"]), variant)
        stored = {plain(k): d[0] for k, d in digests.items()}
        # one of tied weights is stored: the others, cast to half precision, have no digest to compare
        own = {k: t for k, t in own.items() if k in stored or t.dtype not in (torch.float16, torch.bfloat16)}
        saved = {k: d for k, d in saved.items() if k in own}
    common = sorted(set(saved) & set(own))
    other = sorted(set(saved) ^ set(own))
    differ = [k for k in common if (stored.get(k) or _value_digest(own[k])) != saved[k]]
    if differ or (other and not (cross and common)):
        found = f"{len(differ)} of them differ, e.g. {differ[:3]}" if differ else f"other names: {other[:5]}"
        if from_folder:
            raise LoadError(
                f"{directory / CONFIG_NAME}: the Hugging Face weights in {directory} are not those the units were "
                f"saved with ({found}): the model was trained further after model.save_pretrained(directory), and "
                "only linearize.save_pretrained(model, directory) ran since. Save both again from the model in "
                "memory (model.save_pretrained(directory), then linearize.save_pretrained(model, directory)), or "
                "load an earlier pair.")
        raise LoadError(
            f"{directory / CONFIG_NAME}: the weights of the {type(model).__name__} given are not those the units "
            f"were saved with ({found}); this sidecar holds the units only (a Hugging Face model's weights are in "
            "its own save, other models' where save_pretrained(..., weights=False) left them to the caller). Load "
            "the weights saved with them first: keep the model's own save in that folder "
            "(model.save_pretrained(directory), then linearize.from_pretrained(ModelClass, directory)), or "
            "model.load_state_dict(...) of the weights you trained, in their dtype.")


def _base_model_names(model: nn.Module, found: list[dict], saved: list[dict], mode: str) -> dict[str, str] | None:
    """``{model site: saved site}`` when the save and the model differ by a Hugging Face
    ``base_model_prefix``, as ``transformers`` loads across head and base classes: units of a head model
    (``transformer.h.0.mlp.act``) into its base model (``h.0.mlp.act``), the reverse, or one head into
    another (a masked-LM save into a token classifier: the ``bert.*`` sites match). Every model site
    under the base must match a saved one exactly; a head's own sites keep their initial slopes (the
    original function) and saved sites the model lacks (a pooler, another head) are ignored, both with a
    warning, as ``transformers`` initialises a new head. ``None`` when they differ otherwise (prelu only)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if mode != "prelu" or not prefix:
        return None
    lead = prefix + "."
    saved_by_name = {s["name"]: s for s in saved}
    is_head = any(s["name"].startswith(lead) for s in found)
    saved_head = any(s["name"].startswith(lead) for s in saved)
    names, fresh = {}, []
    for site in found:
        if is_head and not site["name"].startswith(lead):
            fresh.append(site["name"])
            continue
        base_name = site["name"][len(lead):] if is_head else site["name"]
        key = lead + base_name if saved_head else base_name
        if saved_by_name.get(key) != dict(site, name=key):
            return None
        names[site["name"]] = key
    if not names:
        return None
    ignored = sorted(set(saved_by_name) - set(names.values()))
    if fresh or ignored:
        saved_kind = "head" if saved_head else "base"
        warnings.warn(f"loading the units of a {saved_kind} model into {type(model).__name__}: "
                      f"{len(fresh)} unit(s) of the model are not in the save and keep their initial slopes (the "
                      f"original function) {fresh[:5]}; {len(ignored)} saved unit(s) are not in the model and are "
                      f"ignored {ignored[:5]}", stacklevel=3)
    return names
