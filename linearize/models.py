"""Build models by name for the command line: torchvision builders and Hugging Face directories."""

from __future__ import annotations

from pathlib import Path

from torch import nn


def load_model(spec: str, checkpoint: str | None = None) -> nn.Module:
    """A model from ``spec``: a torchvision builder name (``"resnet18"``, random init unless
    ``checkpoint`` gives a ``state_dict`` file) or a Hugging Face model directory (loaded offline).
    """
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{spec} is a directory without config.json: not a Hugging Face model")
        from transformers import AutoModel

        return AutoModel.from_pretrained(path, local_files_only=True)
    import torch
    import torchvision

    try:
        model = torchvision.models.get_model(spec, weights=None)
    except ValueError as err:
        raise ValueError(
            f"{spec!r} is neither a Hugging Face model directory nor a torchvision builder "
            f"(e.g. {', '.join(sorted(torchvision.models.list_models())[:5])}, ...)"
        ) from err
    if checkpoint is not None:
        model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
    return model.eval()
