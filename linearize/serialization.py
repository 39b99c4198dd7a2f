"""Save and load converted models as a sidecar: the config as JSON plus the unit tensors.

``from_pretrained`` of a Hugging Face model (or a torchvision builder) rebuilds the original
activations, so the units cannot live in the base model's own checkpoint. The sidecar holds:

- ``linearize_config.json``, the manifest: the :class:`LinearizeConfig`, the site list (name,
  kind, channels, channel dim), the format version, and the name, size and SHA-256 of the tensor file;
- ``linearize_units-<first 16 hex digits of its SHA-256>.safetensors``: in ``"prelu"`` mode only the
  unit tensors (``<site>.slope``, ``<site>.frozen``); in gated modes the whole gated model (its
  feature network is new weights).

Loading re-converts a freshly built base model with the saved config and copies the tensors in,
so outputs are bit-identical.

Atomic pair: a save writes the tensor file under its new (content-derived) name, then replaces the
manifest (each file through a temporary sibling and a rename, flushed to disk), and only then
removes the previous tensor file. Interrupted anywhere (disk full, a crash), the directory still
loads the previous save, unchanged; a first save that fails leaves nothing that loads. A reader
that races a save re-reads the manifest. One writer per directory at a time.

Validated loads: the manifest's structure, the tensor file's size and checksum (a flipped bit is
caught), the safetensors decoding, and each unit's tensors (floating point, of the unit's shape,
slopes finite in ``[0, 1]``, frozen values 0, 1 or NaN = free, with the slope at its frozen value)
are checked before the model is touched; any failure raises :class:`LoadError` (a ``ValueError``)
naming the file and the unit. ``save_pretrained`` refuses a state that would not load back.
Format 1 sidecars (``linearize_units.safetensors``, no checksum) still load, with the same checks
but the checksum.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from ._files import LoadError, atomic_write
from .config import LinearizeConfig
from .manifest import FORMAT_VERSION, clean_name as _clean, site_records as _sites
from .unit import units

__all__ = ["save_pretrained", "from_pretrained", "load_unit_tensors", "unwrap_model", "LoadError"]

CONFIG_NAME = "linearize_config.json"
LEGACY_WEIGHTS_NAME = "linearize_units.safetensors"  # format 1: a fixed name, no checksum
_WEIGHTS_RE = re.compile(r"linearize_units-([0-9a-f]{16})\.safetensors")
_SITE_KEYS = {"name", "kind", "num_channels", "channel_dim"}
_READ_TRIES = 3  # manifest re-reads when a concurrent save swaps the pair under a reader
_SAVE_AGAIN = "Save the model again with linearize.save_pretrained(model, directory)."


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


def _tensors(model: nn.Module, gated: bool) -> dict[str, torch.Tensor]:
    if gated:
        items = model.state_dict().items()
    else:
        items = ((f"{n}.{k}", t) for n, u in units(model) for k, t in (("slope", u.slope), ("frozen", u.frozen)))
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in items:
        if t.data_ptr() in seen and t.numel():  # tied weights: safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[_clean(name)] = t.detach().cpu().contiguous()
    return tensors


def _unit_problem(slope: torch.Tensor, frozen: torch.Tensor, num_channels: int) -> str | None:
    """What is wrong with a unit's ``slope`` and ``frozen`` tensors (None when nothing is).

    A unit holds floating ``[C]`` tensors; slopes are finite and in ``[0, 1]``; frozen channels
    hold 0 or 1 (NaN marks a free channel) and their slope equals the frozen value.
    """
    for what, t in (("slope", slope), ("frozen", frozen)):
        if not t.is_floating_point():
            return f"{what} has dtype {t.dtype}, expected a floating-point tensor"
        if tuple(t.shape) != (num_channels,):
            return f"{what} has shape {tuple(t.shape)}, expected ({num_channels},)"
    slope, frozen = slope.detach().float().cpu(), frozen.detach().float().cpu()

    def first(mask: torch.Tensor) -> int:
        return int(mask.nonzero()[0, 0])

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


def save_pretrained(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write the linearize sidecar of a converted ``model`` into ``directory`` (created if needed).

    Atomic as a pair: until the new manifest is in place the directory loads the previous save,
    unchanged; a failed save removes what it wrote and re-raises. Returns the directory.

    Raises ``ValueError`` for a model that was never converted, or whose units hold a state that
    would not load back (a slope outside ``[0, 1]`` or not finite, a frozen channel off its value).

    Example:
        >>> import tempfile
        >>> model, fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        >>> _ = fresh.load_state_dict(model.state_dict())  # the base weights: your own checkpoint
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
    gated = config.mode != "prelu"
    if not gated:
        for name, unit in units(model):
            problem = _unit_problem(unit.slope, unit.frozen, unit.num_channels)
            if problem:
                raise ValueError(
                    f"cannot save unit {_clean(name)!r}: {problem}. A saved sidecar must load back: slopes "
                    "finite in [0, 1], frozen channels at their value (linearize.project_slopes(model) "
                    "clamps the slopes and restores frozen channels)"
                )
    tensors = _tensors(model, gated)
    data = safetensors.torch.save(tensors, {"format": "pt"})
    digest = hashlib.sha256(data).hexdigest()
    name = weights_name(digest)
    meta = {
        "format": FORMAT_VERSION,
        "config": config.to_dict(),
        "sites": _sites(model),
        "weights": {"file": name, "bytes": len(data), "sha256": digest,
                    "tensors": {k: _tensor_digest(t) for k, t in tensors.items()}},
    }
    directory = Path(directory)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    existed = (directory / name).exists()  # the same tensors saved before: the old manifest may name it
    try:
        atomic_write(directory / name, data)
        atomic_write(directory / CONFIG_NAME, json.dumps(meta, indent=2))
    except BaseException:
        if not existed and _manifest_file(directory) != name:  # not committed: remove what this save wrote
            (directory / name).unlink(missing_ok=True)
            if created:
                with contextlib.suppress(OSError):
                    directory.rmdir()
        raise
    _remove_stale(directory, keep=name)
    return directory


def _manifest_file(directory: Path) -> str | None:
    """The tensor file named by the manifest in ``directory`` (None when unreadable)."""
    try:
        return json.loads((directory / CONFIG_NAME).read_text())["weights"]["file"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_stale(directory: Path, keep: str) -> None:
    """Remove tensor files other than ``keep`` and temporary files left by interrupted saves (best effort)."""
    for path in directory.iterdir():
        n = path.name
        ours = n == LEGACY_WEIGHTS_NAME or _WEIGHTS_RE.fullmatch(n) is not None
        temp = n.endswith(".tmp") and n.startswith((f".{CONFIG_NAME}.", ".linearize_units-"))
        if n != keep and (ours or temp):
            with contextlib.suppress(OSError):  # e.g. held open by a reader on Windows: removed next save
                path.unlink()


def _parse_manifest(raw: bytes, path: Path, weights: bool = True) -> dict[str, Any]:
    """The checked contents of ``linearize_config.json``: ``format``, ``config`` (a
    :class:`LinearizeConfig`), ``sites`` and ``weights`` (``file``, ``bytes``, ``sha256``; the last
    two None for format 1). Raises :class:`LoadError` naming ``path``.

    ``weights=False``: the manifest an HF ``config.json`` carries (``linearize`` key), whose tensors
    are in the model's own weights: no ``weights`` entry (returned as None)."""

    def bad(what: str) -> LoadError:
        return LoadError(f"{path}: {what}. The sidecar config is damaged or was edited. {_SAVE_AGAIN}")

    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad("the file is empty" if not raw.strip() else f"not valid JSON ({err})") from None
    if not isinstance(meta, dict):
        raise bad(f"expected a JSON object, got {type(meta).__name__}")
    fmt = meta.get("format")
    if fmt not in (1, FORMAT_VERSION) or isinstance(fmt, bool):
        raise LoadError(f"{path}: unsupported sidecar format {fmt!r}; this linearize reads formats 1 and "
                        f"{FORMAT_VERSION}. If a newer linearize wrote it, upgrade linearize; else the file is "
                        f"damaged. {_SAVE_AGAIN}")
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
        raise bad("'sites' must be a list of {name, kind, num_channels >= 1, channel_dim}")
    if len({s["name"] for s in sites}) != len(sites):
        raise bad("'sites' names a unit twice")
    if not weights:
        return {"format": fmt, "config": config, "sites": sites, "weights": None}
    if fmt == 1:
        return {"format": fmt, "config": config, "sites": sites,
                "weights": {"file": LEGACY_WEIGHTS_NAME, "bytes": None, "sha256": None}}
    w = meta["weights"]
    if not (isinstance(w, dict) and isinstance(w.get("file"), str) and isinstance(w.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", w["sha256"]) and w["file"] == weights_name(w["sha256"])
            and type(w.get("bytes")) is int and w["bytes"] >= 0 and isinstance(w.get("tensors", {}), dict)
            and all(isinstance(d, str) for d in w.get("tensors", {}).values())):
        raise bad("'weights' must be {file: linearize_units-<sha256[:16]>.safetensors, bytes, sha256, "
                  "tensors: {name: digest}}")
    return {"format": fmt, "config": config, "sites": sites, "weights": w}


def _read_hf_manifest(directory: Path) -> dict[str, Any]:
    """The checked linearize manifest in ``directory/config.json`` (an HF save of a converted model)."""
    from .hf import CONFIG_KEY, HF_CONFIG

    path = directory / HF_CONFIG
    block = json.loads(path.read_text(encoding="utf-8")).get(CONFIG_KEY)
    return _parse_manifest(json.dumps(block).encode(), path, weights=False)


def _valid_site(site: Any) -> bool:
    return (isinstance(site, dict) and set(site) == _SITE_KEYS and isinstance(site["name"], str)
            and isinstance(site["kind"], str) and type(site["num_channels"]) is int and site["num_channels"] >= 1
            and type(site["channel_dim"]) is int)


def _read_sidecar(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """``(manifest, tensors, tensor file)`` of the sidecar in ``directory``, checked as a pair.

    The tensor file must have the size and SHA-256 the manifest recorded. When it does not (or is
    gone) and the manifest changed meanwhile, a save swapped the pair while we read: read again.
    """
    config_path = directory / CONFIG_NAME
    for attempt in range(_READ_TRIES):
        raw = config_path.read_bytes()
        meta = _parse_manifest(raw, config_path)
        w = meta["weights"]
        path = directory / w["file"]
        try:
            data: bytes | None = path.read_bytes()
        except FileNotFoundError:
            data = None
        problem = _pair_problem(data, w)
        if problem is None:
            break
        if attempt + 1 < _READ_TRIES and config_path.read_bytes() != raw:
            continue
        raise LoadError(f"{path}: {problem}; refusing to load it. Restore the directory from a backup, or save "
                        "the model again with linearize.save_pretrained(model, directory).")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as err:  # a decoder of arbitrary bytes: any error means a damaged file
        raise LoadError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err}); it is "
                        f"truncated or damaged. {_SAVE_AGAIN}") from err
    return meta, tensors, path


def _pair_problem(data: bytes | None, weights: dict[str, Any]) -> str | None:
    """What is wrong with the tensor file's bytes ``data`` (None: missing) against the manifest's record."""
    if data is None:
        return f"is missing, though {CONFIG_NAME} names it"
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
    expected = {f"{s['name']}.{k}" for s in sites for k in ("slope", "frozen")}
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
        problem = _unit_problem(tensors[f"{name}.slope"], tensors[f"{name}.frozen"], site["num_channels"])
        if problem:
            raise LoadError(f"{path}: unit {name!r}: {problem}. The file is damaged or was not written by "
                            f"linearize.save_pretrained; refusing to load it. {_SAVE_AGAIN}")


def _check_state_tensors(tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse (:class:`LoadError`) a gated model's saved tensors that do not fit the rebuilt model."""
    missing, extra = sorted(set(state) - set(tensors)), sorted(set(tensors) - set(state))
    if missing or extra:
        raise LoadError(f"{path}: the saved gated model does not match the rebuilt one (missing {missing[:5]}, "
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


def _load_checked(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """``(manifest, tensors, tensor file)`` of the sidecar in ``directory``, with every check that
    needs no model (manifest, size, checksum, decoding, unit tensors in ``"prelu"`` mode)."""
    if not (directory / CONFIG_NAME).is_file():
        raise FileNotFoundError(
            f"{directory} has no linearize sidecar ({CONFIG_NAME}); "
            "write one with linearize.save_pretrained(model, directory)"
        )
    meta, tensors, path = _read_sidecar(directory)
    if meta["config"].mode == "prelu":
        _check_unit_tensors(tensors, meta["sites"], path)
    return meta, tensors, path


def _load_hf_checked(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """``(manifest, unit tensors, weights file)`` of a converted HF model saved with its own
    ``save_pretrained`` (manifest in ``config.json``, units in its weights), checked as a sidecar is."""
    from . import hf

    meta = _read_hf_manifest(directory)
    if meta["config"].mode != "prelu":
        raise LoadError(f"{directory / hf.HF_CONFIG}: gated mode {meta['config'].mode!r} is saved with "
                        "linearize.save_pretrained(model, directory) only")
    keys = [f"{s['name']}.{k}" for s in meta["sites"] for k in ("slope", "frozen")]
    tensors, path = hf.read_unit_tensors(directory, keys)
    _check_unit_tensors(tensors, meta["sites"], path)
    return meta, tensors, path


def _check_agree(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a directory whose HF weights hold unit tensors other than the sidecar's: one of them
    was saved later (``model.save_pretrained`` into a folder with an older sidecar)."""
    from . import hf

    if not hf.has_manifest(directory):
        return
    found, path = hf.read_unit_tensors(directory, sorted(tensors))
    differ = sorted(k for k, t in found.items()
                    if t.shape != tensors[k].shape or not torch.equal(t.to(tensors[k].dtype).nan_to_num(-1.0),
                                                                      tensors[k].nan_to_num(-1.0)))
    if differ:
        raise LoadError(f"{path} and {directory / CONFIG_NAME} hold different unit tensors (e.g. {differ[:3]}): "
                        "one of them is stale (saved at another time). Save the model again with both "
                        "model.save_pretrained(directory) and linearize.save_pretrained(model, directory), or "
                        f"remove {CONFIG_NAME} to load the units of model.save_pretrained.")


def from_pretrained(model: nn.Module | type, directory: str | os.PathLike, example_inputs: Any = None,
                    **hf_kwargs: Any) -> nn.Module:
    """Re-convert a freshly built base ``model`` with the saved config and load the saved units.

    Args:
        model: the same architecture the sidecar was saved from, *not* converted; or a Hugging
            Face model class (``AutoModel``, ``BertModel`` ...), loaded from ``directory`` with
            ``from_pretrained(directory, **hf_kwargs)`` (the unit tensors it holds are expected).
        directory: a folder written by :func:`save_pretrained`, or by ``model.save_pretrained`` /
            a Trainer checkpoint of a converted HF model (its ``config.json`` carries the manifest).
        example_inputs: the probe input for ``convert`` (needed for models whose input
            ``convert`` cannot guess).

    Returns the converted model (the same object in ``"prelu"`` mode). Raises ``FileNotFoundError``
    when the sidecar is missing, :class:`LoadError` (a ``ValueError``) naming the file and the unit
    when the sidecar is damaged, tampered with or inconsistent (checked before ``model`` is
    converted), and ``ValueError`` when its sites do not match the model.

    Example::

        model.save_pretrained("out")                      # a converted HF model (or a Trainer)
        model = linearize.from_pretrained(AutoModel, "out")
    """
    from . import hf
    from .conversion import convert

    directory = Path(directory)
    if (directory / CONFIG_NAME).is_file() or not hf.has_manifest(directory):
        meta, tensors, path = _load_checked(directory)
        if meta["config"].mode == "prelu":
            _check_agree(directory, tensors)
    else:
        meta, tensors, path = _load_hf_checked(directory)
    if isinstance(model, type):
        keys = [f"{s['name']}.{k}" for s in meta["sites"] for k in ("slope", "frozen")]
        model = hf.load_plain(model, directory, keys, hf_kwargs)
    elif hf_kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(hf_kwargs)} (only with a model class)")
    config = meta["config"]
    hf.unmark(model)
    model = convert(model, config, example_inputs=example_inputs)
    found = _sites(model)
    saved_name = {s["name"]: s["name"] for s in found}
    if found != meta["sites"]:
        saved_name = _base_model_names(model, found, meta["sites"], config.mode)
    if saved_name is None:
        saved = {s["name"]: s for s in meta["sites"]}
        diff = [s["name"] for s in found if saved.get(s["name"]) != s] + sorted(
            set(saved) - {s["name"] for s in found}
        )
        raise ValueError(
            f"the model does not match the saved one in {directory}: {len(diff)} site(s) differ, e.g. {diff[:5]}. "
            "Build the same architecture (same config) before loading."
        )
    if config.mode != "prelu":
        _check_state_tensors(tensors, model.state_dict(), path)
        model.load_state_dict(tensors, strict=True)
        return model
    with torch.no_grad():
        for name, unit in units(model):
            key = saved_name.get(_clean(name))
            if key is not None:
                unit.slope.copy_(tensors[f"{key}.slope"])
                unit.frozen.copy_(tensors[f"{key}.frozen"])
    return model


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
