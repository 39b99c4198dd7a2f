"""The files ``linearize report`` reads: a model (with its checkpoint or sidecar) and data.

Data: ``digits`` (scikit-learn), an image folder, a tar archive of images (the CIFAR-10 JPEG
``.tar.gz``; its ``test/`` split when there is one), or a JSONL(.gz) text file tokenized with a Hugging
Face model's tokenizer. Images are picked with seed 0, decoded to RGB and normalized.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Mapping

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .._files import LoadError, open_regular
from .._optional import require
from ..inputs import (MAX_TOTAL_PIXELS, Batches, call_model, check_total_bytes, describe_inputs, eval_mode,
                      image_size, read_image_file, read_tar_image)
from ..unit import units

from . import InputMismatch, reading

__all__ = ["load_model_and_data", "load_data", "check_model_takes"]

_IMAGE_EXT = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")
MAX_TEXT_BYTES = 2**28  # what the records a report reads from a JSONL(.gz) file may take, decompressed (256 MiB)
_NORMS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


# RuntimeError messages that are not the input's fault: the CPU allocator's out of memory
_NOT_THE_INPUT = ("can't allocate memory", "out of memory", "DefaultCPUAllocator")


def check_model_takes(model: nn.Module, inputs: Any, model_arg: str, given: str, fix: str) -> None:
    """Run ``model`` once on ``inputs`` (eval mode, no grad); an error of the kind a wrong input raises (a
    ``RuntimeError``, ``ValueError``, ``TypeError`` or ``IndexError``; not out of memory, recursion or a missing
    ``forward``) becomes an
    :class:`InputMismatch` naming the model, the input (``given``: the flags it came from) and ``fix``, in one line.
    Anything else (a bug in the model's code, out of memory, Ctrl-C) keeps its own traceback."""
    try:
        with torch.no_grad(), eval_mode(model):
            call_model(model, inputs)
    except (torch.OutOfMemoryError, MemoryError, RecursionError, NotImplementedError):
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        if isinstance(err, RuntimeError) and any(s in str(err) for s in _NOT_THE_INPUT):
            raise
        why = " ".join(str(err).split())  # one line, whatever the message held
        raise InputMismatch(
            f"the model {model_arg} ({type(model).__name__}) fails on the input of {given}, "
            f"{describe_inputs(inputs)}: {type(err).__name__}: {why[:300]}{'...' if len(why) > 300 else ''}; "
            f"{fix} (if that input is right, the model itself fails: call it in Python to see where)") from err


def load_model_and_data(args: argparse.Namespace) -> tuple[nn.Module, Any]:
    """The model and data of ``linearize report``'s arguments; a model without units is converted (slopes 0)."""
    import linearize

    from .._files import safe_torch_load
    from ..models import load_model

    spec = Path(args.model)
    hf_dir = spec.is_dir()
    trust = args.trust_pickle
    with reading(args.model):
        model = load_model(spec, args.num_classes, trust_pickle=trust)
    with reading(f"--data {args.data}"):
        data = load_data(args, model, spec if hf_dir else None)
    example = Batches.of(data).limit(samples=2).concat()
    with reading(f"--checkpoint {args.checkpoint}"):
        state = safe_torch_load(args.checkpoint, trust_pickle=trust, what="--checkpoint") if args.checkpoint else None
        if state is not None and not isinstance(state, Mapping):
            raise LoadError(f"--checkpoint {args.checkpoint} holds a {type(state).__name__}, not a state_dict; "
                            "a whole pickled model goes in MODEL (with --trust-pickle)")
    check_model_takes(model, example, args.model, f"--data {args.data}",
                      "give data of the kind the model takes (--data; for images --image-size and --normalize)")
    if hf_dir and (spec / "linearize_config.json").is_file():
        with reading(args.model):
            model = linearize.from_pretrained(model, spec, example_inputs=example)
    elif args.units:
        with reading(f"--units {args.units}"):
            model = linearize.from_pretrained(model, args.units, example_inputs=example)
    converted = bool(units(model)) or getattr(model, "linearize_config", None) is not None
    if not converted and state is not None and any(k.endswith(".slope") for k in state):
        model, converted = linearize.convert(model, example_inputs=example), True
    if state is not None:
        with reading(f"--checkpoint {args.checkpoint}"):
            check_state_fits(model, state, f"--checkpoint {args.checkpoint}",
                             args.model + (f" --num-classes {args.num_classes}" if args.num_classes else ""))
        model.load_state_dict(state)
        from ..serialization import unit_problem

        for name, unit in units(model):  # the checks of linearize.from_pretrained, on the loaded slopes
            problem = unit_problem(unit.slope, unit.frozen, unit.num_channels)
            if problem:
                raise LoadError(f"--checkpoint {args.checkpoint}: unit {name!r}: {problem}; refusing to report "
                                "on it (slopes must be finite in [0, 1], frozen channels at their value)")
    if not converted:
        print(f"{type(model).__name__} has no linearizable units: converting it (every channel nonlinear)")
        model = linearize.convert(model, example_inputs=example)
    return model.eval(), data


def check_state_fits(model: nn.Module, state: Mapping[str, Any], given: str, model_arg: str) -> None:
    """:class:`~linearize.LoadError` naming ``given`` (e.g. ``"--checkpoint ckpt.pt"``), ``model_arg`` (the model as
    the command line built it), the first mismatch and the fix, when the state_dict ``state`` does not fit ``model``:
    keys it lacks or has beyond the model's, or a tensor of another shape (a head of another size, another
    architecture), where ``load_state_dict`` would raise torch's multi-line error."""
    own = model.state_dict()
    shapes = [f"{k} {list(v.shape)} vs {list(own[k].shape)}" for k, v in state.items()
              if k in own and isinstance(v, torch.Tensor) and isinstance(own[k], torch.Tensor) and v.shape != own[k].shape]
    missing, unexpected = [k for k in own if k not in state], [k for k in state if k not in own]
    problems = [f"{len(shapes)} tensor(s) of another shape, e.g. {shapes[0]}"] if shapes else []
    problems += [f"{len(missing)} key(s) missing, e.g. {missing[0]}"] if missing else []
    problems += [f"{len(unexpected)} unexpected key(s), e.g. {unexpected[0]}"] if unexpected else []
    if problems:
        raise LoadError(f"{given} does not fit {model_arg} ({'; '.join(problems)}): pass the MODEL (and "
                        "--num-classes) it was trained with")


def load_data(args: argparse.Namespace, model: nn.Module, hf_dir: Path | None) -> Any:
    """``--data``: digits, images (a folder or a tar archive) or JSONL text (``hf_dir``: the model's tokenizer)."""
    src, n = args.data, args.num_samples
    if src == "digits":
        load_digits = require("sklearn.datasets", what="--data digits").load_digits

        x = torch.tensor(load_digits().data[:n], dtype=torch.float32) / 16.0
        from ..example_inputs import input_layer

        return x.view(-1, 1, 8, 8) if isinstance(input_layer(model), nn.Conv2d) else x
    path = Path(src)
    if not path.exists():
        raise FileNotFoundError(f"--data {src}: no such file or directory (or use 'digits')")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        if hf_dir is None:
            raise ValueError("JSONL text data needs a Hugging Face model directory (for its tokenizer)")
        return _load_text(path, n, args.text_field, Path(args.tokenizer) if args.tokenizer else hf_dir,
                          args.max_length, model)
    norm = args.normalize if args.normalize != "auto" else ("cifar10" if name.endswith((".tar.gz", ".tgz")) else "imagenet")
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        images = _tar_images(path, n)
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in _IMAGE_EXT)
        if not files:
            raise ValueError(f"no images ({', '.join(_IMAGE_EXT)}) under {path}")
        pick = np.random.default_rng(0).permutation(len(files))[:n]
        chosen = [files[i] for i in sorted(pick)]
        check_total_bytes((os.stat(f).st_size for f in chosen), f"--data {src}")
        images = [(str(f), read_image_file(f)) for f in chosen]
    else:
        raise ValueError(f"--data {src}: expected 'digits', an image folder, a .tar.gz of images or a .jsonl file")
    return _decode(images, args.image_size, norm, src)


def _tar_images(path: Path, n: int) -> list[tuple[str, bytes]]:
    import tarfile
    import zlib

    tar = None
    try:
        tar = tarfile.open(path)
        members = [m for m in tar.getmembers() if m.isfile() and m.name.lower().endswith(_IMAGE_EXT)]
    except (tarfile.TarError, EOFError, zlib.error) as err:
        if tar is not None:
            tar.close()
        reason = str(err).splitlines()[-1].strip(" -") if str(err) else type(err).__name__
        raise ValueError(f"{path}: not a readable tar archive of images ({reason}); is it empty or cut short? "
                         "Give an image folder, a complete .tar.gz of images, or 'digits'") from None
    with tar:
        if not members:
            raise ValueError(f"{path} holds no images")
        test = [m for m in members if "/test/" in f"/{m.name}"]
        members = test or members  # the held-out split when there is one
        pick = np.random.default_rng(0).permutation(len(members))[:n]
        check_total_bytes((members[i].size for i in pick), f"--data {path}")
        return [(where, read_tar_image(tar, members[i], where))
                for i in sorted(pick) for where in [f"{path}:{members[i].name}"]]


def _decode(images: list[tuple[str, bytes]], size: int | None, norm: str, source: str) -> torch.Tensor:
    """``(where, encoded image)`` pairs of ``--data source`` as one float batch (resized to ``size``, normalized
    by ``norm``), decoded into one preallocated tensor; ``ValueError`` from the image headers, before decoding, when
    one image or all of them together would decode to too many pixels (:data:`~linearize.inputs.MAX_IMAGE_PIXELS`,
    :data:`~linearize.inputs.MAX_TOTAL_PIXELS`) or their sizes differ without ``size``, and naming the image and the
    fix when one is damaged (cut short by an interrupted copy)."""
    from PIL import Image

    sizes = [image_size(raw, where) for where, raw in images]  # from the headers: refuses one huge image
    if size is None and len(set(sizes)) > 1:
        (w0, h0), (i, (w, h)) = sizes[0], next((i, s) for i, s in enumerate(sizes) if s != sizes[0])
        raise ValueError(f"--data {source}: images have different sizes ({images[0][0]} is {w0} x {h0}, "
                         f"{images[i][0]} is {w} x {h}): pass --image-size to resize each one")
    width, height = (size, size) if size else sizes[0]
    total = len(images) * width * height
    if total > MAX_TOTAL_PIXELS:
        fits = MAX_TOTAL_PIXELS // (width * height)  # samples of this size that fit
        raise ValueError(
            f"--data {source}: its {len(images)} images of {width} x {height} would decode to {total:,} pixels "
            f"together ({total * 12 / 2**30:.1f} GiB as float32 RGB), more than the {MAX_TOTAL_PIXELS:,} one report "
            f"reads at once: pass {'a smaller ' if size else ''}--image-size (each image is resized as it is "
            f"decoded; e.g. --image-size 224){f' or --num-samples {fits} or fewer' if fits >= 2 else ''}")
    x = torch.empty(len(images), 3, height, width)  # filled in place: no second copy of the batch
    for i, (where, raw) in enumerate(tqdm(images, desc="images", leave=False)):
        try:
            img = Image.open(io.BytesIO(raw)).convert("RGB")
        except (OSError, ValueError, SyntaxError) as err:  # PIL: truncated or corrupt data
            raise ValueError(f"{where}: damaged image, it cannot be decoded ({err}): replace it or remove it from "
                             "the data") from None
        if size:
            img = img.resize((size, size), Image.BILINEAR)
        x[i].copy_(torch.from_numpy(np.array(img)).permute(2, 0, 1)).div_(255.0)
    if norm != "none":
        mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in _NORMS[norm])
        x.sub_(mean).div_(std)
    return x


def _load_text(path: Path, n: int, text_field: str | None, tokenizer_dir: Path, max_length: int, model: nn.Module) -> dict:
    transformers = require("transformers", what="a text model's report")

    texts = _read_texts(path, n, text_field)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"no tokenizer found in {tokenizer_dir}: pass --tokenizer DIR") from err
    batch = dict(tok(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"))
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        batch["decoder_input_ids"] = batch["input_ids"].clone()
    return batch


def _read_texts(path: Path, n: int, text_field: str | None) -> list[str]:
    """The texts of the first ``n`` records of the JSONL(.gz) file ``path``; ``ValueError`` naming it when it is no
    regular file (a FIFO or device is refused, never waited on), when those records take more than
    :data:`MAX_TEXT_BYTES` (a line without end, a gzip bomb), and naming the line of a record that is not one JSON
    object with a text in the field ``text_field`` (default: ``text``, ``sentence`` or ``translation.en``)."""
    def check(info: os.stat_result) -> int:
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a FIFO, device or socket)"
            raise ValueError(f"{path} is {kind}: refusing to read it; --data takes a JSONL(.gz) text file")
        return info.st_size

    f, _ = open_regular(path, check)
    with f:
        stream = gzip.GzipFile(fileobj=f) if path.name.lower().endswith(".gz") else f
        texts: list[str] = []
        try:
            for number, record in _records(stream, MAX_TEXT_BYTES):
                texts.append(_record_text(record, text_field, f"{path}, line {number}"))
                if len(texts) == n:
                    break
        except OverflowError:
            raise ValueError(f"{path}: more than {MAX_TEXT_BYTES:,} bytes read before its first {n} records "
                             "were found (a line without end, or a compressed file that expands without end): "
                             "refusing to read on; give a JSONL file of one short record per line") from None
    return texts


_TEXT_BLOCK = 2**20  # the bytes _records reads at a time
_LINE_ENDS = (b"\n", b"\r")  # a CR alone (old-Mac line ends) ends a record too: a JSON text holds no raw CR
_LINE_END = re.compile(rb"[\r\n]")
_BLANKS = re.compile(rb"[ \t\n\r\x0b\x0c]*")  # what bytes.strip() and isspace() take for blank


def _records(stream: BinaryIO, limit: int) -> Iterator[tuple[int, bytearray]]:
    """The line number and bytes of each record of ``stream`` that is not blank, read in blocks of
    ``_TEXT_BLOCK`` bytes; ``OverflowError`` once more than ``limit`` bytes are read. A line ends at LF, CR or
    CR LF. Blank lines are skipped in bulk (searched and counted by bytes methods, without a Python turn each),
    and memory stays within about ``limit``: only an unfinished record is kept between blocks."""
    def line_ends(start: int, stop: int) -> int:
        lf = buf.count(b"\n", start, stop)
        if buf.find(b"\r", start, stop) < 0:  # (counting CR LF pairs takes the longest)
            return lf
        return lf + buf.count(b"\r", start, stop) - (buf.count(b"\r\n", start, stop) if lf else 0)

    buf, number, read = bytearray(), 0, 0  # buf starts at a record's start (or at a CR whose LF may follow)
    while True:
        block = stream.read(min(_TEXT_BLOCK, limit + 1 - read))
        read += len(block)
        over = read > limit
        if over:
            block = block[:-1]  # what a record may hold is read; one more byte shows there is more
        buf += block
        if block or over:  # records up to the last line end are complete (the new block holds it, or buf[0])
            end = max(buf.rfind(e, max(0, len(buf) - len(block) - 1)) for e in _LINE_ENDS) + 1
            if end == len(buf) and buf.endswith(b"\r") and not over:
                end -= 1  # an LF in the next block ends the same line
        else:  # the end of the file ends the last record
            end = len(buf)
        pos = 0
        first = end if not end or buf.isspace() else _BLANKS.match(buf, 0, end).end()  # blank lines at once
        while first < end:  # the first byte of a record that is not blank
            start = max(buf.rfind(e, pos, first) for e in _LINE_ENDS) + 1
            found = _LINE_END.search(buf, first, end)  # the nearer of LF and CR, in one scan
            stop = found.start() if found else end
            number += line_ends(pos, start)
            yield number + 1, buf[start:stop]
            pos = stop
            first = _BLANKS.match(buf, pos, end).end()
        number += line_ends(pos, end)
        del buf[:end]
        if over:
            raise OverflowError(f"more than {limit} bytes")
        if not block:
            return


def _record_text(line: bytes, text_field: str | None, where: str) -> str:
    """The text of the JSONL record ``line`` (``where``: its file and line); ``ValueError`` naming ``where`` and
    the form a record takes when it is not one JSON object with a text in ``text_field`` (or the default fields)."""
    form = ("a JSONL record is one JSON object per line with its text in a field: text, sentence or translation.en, "
            "or the field --text-field names")
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        problem = f"not valid JSON ({err})"
    except RecursionError:
        problem = "not valid JSON for this reader: it nests deeper than Python can parse"
    except ValueError:  # Python's limit on converting long digit strings to int
        problem = ("not valid JSON for this reader: it holds an integer of more than "
                   f"{sys.get_int_max_str_digits():,} digits")
    else:
        if not isinstance(record, dict):
            problem = f"a JSON {type(record).__name__}, not an object"
        else:
            try:
                return _text_of(record, text_field)
            except KeyError as err:
                problem = err.args[0]
    raise ValueError(f"{where}: {problem}; {form}")


def _text_of(record: dict, text_field: str | None) -> str:
    """The text of a JSONL ``record``; ``KeyError`` with the message when it has none, or one that is not a
    string (null, a list, an object: never their Python text)."""
    if text_field is None:
        for key in ("text", "sentence"):
            if key in record:
                return _string(record[key], key)
        tr = record.get("translation")
        if isinstance(tr, dict) and tr:
            return _string(tr.get("en", next(iter(tr.values()))), "translation")
        raise KeyError(f"no text field in the record (its keys: {list(record)[:10]}): pass --text-field")
    value: Any = record
    for key in text_field.split("."):
        if not isinstance(value, dict) or key not in value:
            raise KeyError(f"no field {text_field!r} in the record (its keys: {list(record)[:10]})")
        value = value[key]
    return _string(value, text_field)


def _string(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise KeyError(f"its field {key!r} holds a JSON {type(value).__name__}, not a string")
    return value
