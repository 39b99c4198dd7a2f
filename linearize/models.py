"""Build models by name for the command line: Hugging Face directories, pickled modules, torchvision builders."""

from __future__ import annotations

import importlib.util
import argparse
import pickle
from pathlib import Path
from typing import Callable

from torch import nn

from ._files import LoadError, check_regular, safe_torch_load
from .hf import has_manifest, unreadable_weights_file
from ._optional import require


def load_model(spec: str | Path, num_classes: int | None = None, *, trust_pickle: bool = False) -> nn.Module:
    """A model from ``spec``.

    - a Hugging Face model directory (its ``config.architectures`` class, else ``AutoModel``),
      loaded offline (``transformers`` reads weights without unpickling code, and no remote code);
    - a ``.pt``/``.pth`` file holding a whole pickled ``nn.Module``: only with ``trust_pickle=True``
      (``--trust-pickle``), since unpickling a module runs code from the file; without it the file
      is read with ``torch.load(weights_only=True)`` and refused with a
      :class:`~linearize._files.LoadError` that names the file and the flag;
    - a torchvision builder name (``"resnet18"``), else a timm model name when timm is installed
      (``"convnext_atto"``), randomly initialized, with ``num_classes`` outputs.
    """
    path = Path(spec)
    if path.is_dir():
        transformers = require("transformers", what="a Hugging Face model directory")

        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        check_regular(path / "config.json", "Hugging Face config")  # a FIFO: refused by name, not waited on
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        arch = (getattr(config, "architectures", None) or [None])[0]
        cls = getattr(transformers, arch, None) if arch else None
        if has_manifest(path):  # saved converted: restore its units (a plain load is refused)
            from .serialization import from_pretrained

            return _weights_read(lambda: from_pretrained(cls or transformers.AutoModel, path, local_files_only=True),
                                 path)
        return _weights_read(lambda: (cls or transformers.AutoModel).from_pretrained(path, local_files_only=True), path)
    if path.suffix in (".pt", ".pth") and path.is_file():
        model = safe_torch_load(path, trust_pickle=trust_pickle)
        if not isinstance(model, nn.Module):
            raise TypeError(f"{path} holds a {type(model).__name__}, not a pickled nn.Module (a state_dict "
                            "needs a builder name as MODEL and --checkpoint)")
        return model
    import torchvision

    kwargs = {"num_classes": num_classes} if num_classes else {}
    if str(spec) in torchvision.models.list_models():
        return torchvision.models.get_model(str(spec), weights=None, **kwargs)
    if importlib.util.find_spec("timm") is not None:
        import timm

        if timm.is_model(str(spec)):
            return timm.create_model(str(spec), pretrained=False, **kwargs)
    raise ValueError(
        f"{str(spec)!r} is neither a Hugging Face model directory, a .pt file, a torchvision builder "
        "(e.g. resnet18, mobilenet_v2, vgg11_bn) nor a timm model name (with timm installed)"
    )


def _weights_read(load: Callable[[], nn.Module], directory: Path) -> nn.Module:
    """``load()``, a ``from_pretrained`` of the Hugging Face ``directory``; a weights file its decoders refuse
    (cut short, damaged, or a ``.bin`` holding more than tensors: safetensors' and the unpickler's errors, torch's
    ``OSError`` that names no file) as a :class:`LoadError` naming the file (of a sharded save, the shard)."""
    from safetensors import SafetensorError

    try:
        return load()
    except (SafetensorError, pickle.UnpicklingError, EOFError, OSError) as err:
        if isinstance(err, OSError) and (err.errno is None or err.filename is not None):
            raise  # transformers' own (no errno: a file it did not find) or one naming its file: they say it
        detail = "torch.load(weights_only=True) refuses it" \
            if isinstance(err, pickle.UnpicklingError) else (str(err).splitlines() or ["it ends too early"])[0]
        file = unreadable_weights_file(directory) or directory
        raise LoadError(f"{file}: not a readable weights file ({type(err).__name__}: {detail}); it is truncated (an "
                        "interrupted download or copy), damaged or crafted. Download it again, or save the model "
                        "again with model.save_pretrained(dir).") from err


def add_trust_pickle(parser: argparse.ArgumentParser) -> None:
    """The ``--trust-pickle`` option: without it, ``.pt`` files are read with ``torch.load(weights_only=True)``."""
    parser.add_argument("--trust-pickle", action="store_true",
                        help="fully unpickle .pt files (needed for a pickled nn.Module). Unpickling runs code "
                        "from the file: only for files from a source you trust")
