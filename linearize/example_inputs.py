"""A probe input derived from what a model says about itself, for ``convert`` without ``example_inputs``.

``linearize.convert`` runs one probe forward to find the activation call sites. When the user
gives no input, :func:`guess_example_inputs` builds a small one (batch 2) from:

- a Hugging Face ``config`` and ``main_input_name``: token ids below ``vocab_size`` (8 tokens, at
  most ``max_position_embeddings``; ``token_type_ids`` below ``type_vocab_size``), with
  ``decoder_input_ids`` for encoder-decoders; ``pixel_values`` of ``num_channels`` x
  ``image_size``; ``input_features`` of Whisper-like models (``num_mel_bins`` x twice
  ``max_source_positions``); raw audio ``input_values`` long enough for the feature encoder's
  ``conv_kernel``/``conv_stride`` (wav2vec2-like) or ``max_length`` x ``num_mel_bins`` frames
  (Audio Spectrogram Transformer); text and image inputs together for CLIP-like models;
- otherwise the model's first input layer in registration order (the first ``Conv1d/2d/3d``,
  ``Linear`` or ``Embedding``; registration order is forward order in torchvision, timm and HF
  models, and parameters held by the root, like ViT's ``class_token``, do not count): its input
  channels, features or vocabulary. The image size of a convolutional model is, in this order,
  ``model.image_size`` (torchvision ViT), the ``img_size`` of its first module that has one
  (timm patch embeddings, which refuse other sizes), timm's ``pretrained_cfg["input_size"]``
  (or ``default_cfg``), the smallest size torchvision's registered weights of the model's
  builders accept (``weights.meta["min_size"]``, e.g. 75 px for Inception v3, 63 px for AlexNet;
  at least 32 px, so that a stride-32 backbone keeps one position), and else 224.

Inputs are random (seeded), on the device and in the floating dtype of the model's parameters.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["guess_example_inputs", "guessed_input_error", "input_layer", "load_example_inputs"]

BATCH = 2
SEQ_LEN = 8  # tokens of a guessed text input
MIN_IMAGE = 32  # smallest guessed image side
_INPUT_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.Embedding)
_FIX = ("pass example_inputs= to linearize.convert (a tensor, a tuple of positional arguments or a dict "
        "of keyword arguments; on the command line: --input-shape 2,3,224,224 or --example-inputs FILE.safetensors)")


def input_layer(model: nn.Module) -> nn.Module | None:
    """The first ``Conv1d/2d/3d``, ``Linear`` or ``Embedding`` of ``model`` in registration order, or ``None``.

    Example:
        >>> input_layer(nn.Sequential(nn.Flatten(), nn.Linear(4, 2), nn.ReLU()))
        Linear(in_features=4, out_features=2, bias=True)
    """
    return next((m for m in model.modules() if isinstance(m, _INPUT_LAYERS)), None)


def guess_example_inputs(model: nn.Module) -> Any:
    """A small probe batch for ``model``: a tensor, or a dict of keyword inputs for Hugging Face models.

    See the module docstring for where each size comes from.

    Raises:
        ValueError: nothing in the model tells its input (the message names the model and the fix).

    Example:
        >>> import torchvision
        >>> guess_example_inputs(torchvision.models.vit_b_16()).shape
        torch.Size([2, 3, 224, 224])
    """
    gen = torch.Generator().manual_seed(0)
    param = next(model.parameters(), None)
    float_kw: dict[str, Any] = {"generator": gen}
    if param is not None and param.is_floating_point():
        float_kw["dtype"] = param.dtype
    config = getattr(model, "config", None)
    if config is not None and getattr(model, "main_input_name", None) is not None:
        inputs = _from_hf_config(model, config, gen, float_kw)
    else:
        inputs = _from_input_layer(model, gen, float_kw)
    device = param.device if param is not None else None
    if device is not None and device.type != "cpu":
        inputs = {k: v.to(device) for k, v in inputs.items()} if isinstance(inputs, dict) else inputs.to(device)
    return inputs


def guessed_input_error(model: nn.Module, inputs: Any, err: BaseException) -> ValueError:
    """The error to raise when ``model`` fails on the input :func:`guess_example_inputs` built for it
    (a first layer that is not the first one called, a model that takes several inputs, ...)."""
    if isinstance(inputs, dict):
        shown = "{" + ", ".join(f"{k}: {tuple(v.shape)}" for k, v in inputs.items()) + "}"
    else:
        shown = f"a tensor of shape {tuple(inputs.shape)}"
    first = input_layer(model)
    source = f" (from its layer {type(first).__name__})" if first is not None else ""
    return ValueError(f"linearize guessed the input of {type(model).__name__} as {shown}{source}, and the model's "
                      f"forward failed on it: {type(err).__name__}: {str(err).strip()[:300]}. {_FIX[0].upper()}{_FIX[1:]}")


# audio inputs guessed from the config: what the config must hold
_AUDIO_NEEDS = {
    "input_features": "config.num_mel_bins (Whisper-like)",
    "input_values": "config.conv_kernel and conv_stride (wav2vec2-like) or num_mel_bins and max_length (AST-like)",
}


def _unknown(model: nn.Module, why: str) -> ValueError:
    return ValueError(f"cannot guess an input for {type(model).__name__}: {why}; {_FIX}")


def _from_input_layer(model: nn.Module, gen: torch.Generator, float_kw: dict) -> torch.Tensor:
    first = input_layer(model)
    if isinstance(first, (nn.Conv2d, nn.Conv3d)):
        size = _image_size(model)
        frames = (8,) if isinstance(first, nn.Conv3d) else ()  # video: 8 frames
        return torch.randn(BATCH, first.in_channels, *frames, *size, **float_kw)
    if isinstance(first, nn.Conv1d):
        return torch.randn(BATCH, first.in_channels, 64, **float_kw)
    if isinstance(first, nn.Linear):
        return torch.randn(BATCH, first.in_features, **float_kw)
    if isinstance(first, nn.Embedding):
        return torch.randint(0, first.num_embeddings, (BATCH, SEQ_LEN), generator=gen)
    raise _unknown(model, "it has no Conv, Linear or Embedding layer to read an input shape from")


def _pair(size: Any) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    size = tuple(int(s) for s in size)
    return (size[-2], size[-1]) if len(size) >= 2 else (size[0], size[0])


def _timm_input_size(model: nn.Module) -> tuple[int, ...] | None:
    for attr in ("pretrained_cfg", "default_cfg"):
        cfg = getattr(model, attr, None)
        if isinstance(cfg, dict) and cfg.get("input_size"):
            return tuple(cfg["input_size"])
    return None


def _image_size(model: nn.Module) -> tuple[int, int]:
    """Height and width of a guessed image input (the order of the module docstring)."""
    if getattr(model, "image_size", None) is not None:
        return _pair(model.image_size)
    fixed = next((m.img_size for m in model.modules() if getattr(m, "img_size", None) is not None), None)
    if fixed is not None:
        return _pair(fixed)
    timm_size = _timm_input_size(model)
    if timm_size:
        return _pair(timm_size)
    smallest = _torchvision_min_size(type(model))
    return (max(smallest[0], MIN_IMAGE), max(smallest[1], MIN_IMAGE)) if smallest else (224, 224)


def _torchvision_min_size(cls: type) -> tuple[int, int] | None:
    """The largest ``min_size`` of the registered weights of the torchvision builders defined next to ``cls``."""
    if not cls.__module__.startswith("torchvision.models."):
        return None
    import torchvision.models as tvm

    sizes = [
        weights.meta["min_size"]
        for name in tvm.list_models()
        if tvm.get_model_builder(name).__module__ == cls.__module__
        for weights in tvm.get_model_weights(name)
        if "min_size" in weights.meta
    ]
    return (max(h for h, _ in sizes), max(w for _, w in sizes)) if sizes else None


def _forward_accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _token_ids(config: Any, gen: torch.Generator) -> torch.Tensor:
    vocab = int(getattr(config, "vocab_size", None) or 100)
    positions = getattr(config, "max_position_embeddings", None)
    length = min(SEQ_LEN, int(positions)) if isinstance(positions, int) and positions > 0 else SEQ_LEN
    high = min(vocab, 100)  # ids 0-2 are often special tokens (padding, start, end)
    return torch.randint(3 if high > 3 else 0, high, (BATCH, length), generator=gen)


def _pixels(config: Any, float_kw: dict) -> torch.Tensor:
    size = _pair(getattr(config, "image_size", None) or 224)
    return torch.randn(BATCH, int(getattr(config, "num_channels", None) or 3), *size, **float_kw)


def _audio_length(config: Any, frames: int = 8) -> int:
    """Samples a wav2vec2-like feature encoder (``conv_kernel``, ``conv_stride``) turns into ``frames`` frames."""
    length = frames
    for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride))):
        length = (length - 1) * stride + kernel
    return length


def _from_hf_config(model: nn.Module, config: Any, gen: torch.Generator, float_kw: dict) -> dict[str, torch.Tensor]:
    main = model.main_input_name
    text_config, vision_config = getattr(config, "text_config", None), getattr(config, "vision_config", None)
    if main == "input_ids" and text_config is not None and vision_config is not None and _forward_accepts(model, "pixel_values"):
        return {"input_ids": _token_ids(text_config, gen), "pixel_values": _pixels(vision_config, float_kw)}
    if main == "input_ids":
        encoder = getattr(config, "encoder", None)  # EncoderDecoderModel: the encoder's own vocabulary
        inputs = {"input_ids": _token_ids(encoder if callable(getattr(encoder, "to_dict", None)) else config, gen)}
        types = getattr(config, "type_vocab_size", None)
        if isinstance(types, int) and types > 1 and _forward_accepts(model, "token_type_ids"):
            inputs["token_type_ids"] = torch.randint(0, types, inputs["input_ids"].shape, generator=gen)
    elif main == "pixel_values":
        inputs = {"pixel_values": _pixels(config, float_kw)}
    elif main == "input_features" and getattr(config, "num_mel_bins", None):
        frames = 2 * int(getattr(config, "max_source_positions", 1500))  # Whisper: two stride-2 convs
        inputs = {"input_features": torch.randn(BATCH, config.num_mel_bins, frames, **float_kw)}
    elif main == "input_values" and getattr(config, "conv_kernel", None) and getattr(config, "conv_stride", None):
        inputs = {"input_values": torch.randn(BATCH, _audio_length(config), **float_kw)}
    elif main == "input_values" and getattr(config, "num_mel_bins", None) and getattr(config, "max_length", None):
        inputs = {"input_values": torch.randn(BATCH, config.max_length, config.num_mel_bins, **float_kw)}
    elif main in _AUDIO_NEEDS:
        raise _unknown(model, f"its main input {main!r} is guessed only from {_AUDIO_NEEDS[main]}, "
                       "which its config lacks")
    else:
        raise _unknown(model, f"its main input {main!r} is not one of input_ids, pixel_values, "
                       "input_features or input_values")
    if getattr(config, "is_encoder_decoder", False) and _forward_accepts(model, "decoder_input_ids"):
        decoder = getattr(config, "decoder", None)  # EncoderDecoderModel: the decoder's own vocabulary
        inputs["decoder_input_ids"] = _token_ids(decoder if decoder is not None else config, gen)
    return inputs


def load_example_inputs(path: str | os.PathLike) -> Any:
    """Inputs saved in a safetensors file (never a pickle): one tensor as the positional input,
    several as keyword inputs by name.

    Example:
        >>> from safetensors.torch import save_file
        >>> save_file({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, "inputs.safetensors")  # doctest: +SKIP
        >>> load_example_inputs("inputs.safetensors")["input_ids"].shape  # doctest: +SKIP
        torch.Size([2, 8])
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"example inputs {path}: no such file (a .safetensors file of input tensors)")
    try:
        tensors = load_file(path)
    except SafetensorError as err:
        raise ValueError(f"example inputs {path} is not a safetensors file ({err}); write one with "
                         "safetensors.torch.save_file({'input_ids': ids, ...}, path)") from err
    if not tensors:
        raise ValueError(f"example inputs {path} holds no tensor")
    return next(iter(tensors.values())) if len(tensors) == 1 else tensors
