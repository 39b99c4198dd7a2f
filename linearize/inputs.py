"""Inputs and data: the one convention every linearize function reads.

Two notions, used by name throughout the package:

**Example inputs** are the arguments of *one* call of the model (:func:`call_model`):

- a tensor ``x``: ``model(x)``;
- a tuple or list: positional arguments, ``model(*args)``;
- a mapping (a dict, tokenizer output): keyword arguments, ``model(**kwargs)``.

``convert``, ``fold`` and ``average_path_length`` take example inputs.

**Data** are samples, in one batch or several (:class:`Batches`). A *batch* is

- a tensor (or NumPy array) ``[N, ...]``: the model's single input;
- a mapping of keyword arguments whose tensors have ``N`` rows;
- a tuple ``(inputs, *targets)``: only ``inputs`` (element 0, itself a tensor, a mapping, or a
  tuple of positional arguments) is fed to the model; targets are ignored. ``(x,)`` is ``x``.

Data is one batch, or any other iterable of batches: a list, a ``DataLoader``, a generator.
Inside an iterable a list batch is read like a tuple (a ``DataLoader`` collates ``(x, y)`` samples
into ``[x, y]``). At the top level a tuple is one batch and a list is a list of batches.
``freeze(data=)``, ``stable_units``, ``compress``, ``report``, ``measures.affinity_signature`` and
``gated.gate_statistics`` take data.

Example:
    >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    >>> data = Batches.of([(x[:10], y[:10]), (x[10:], y[10:])])
    >>> len(data), data.num_samples, [tuple(b.shape) for b in data]
    (2, 16, [(10, 4), (6, 4)])
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ._files import read_regular

__all__ = [
    "Batches", "call_model", "as_call", "eval_mode", "float_outputs", "max_difference", "output_tensors", "hooks",
    "model_device", "map_tensors", "to_device", "record_preactivations", "describe_inputs", "is_empty_batch",
]

DATA_FORMS = (
    "a tensor batch, a mapping of keyword arguments, an (inputs, *targets) tuple, or an iterable "
    "of such batches (a list, a DataLoader, a generator)"
)


# ----------------------------------------------------------------------------- example inputs


def as_call(example_inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of one call: a mapping gives keyword arguments, a tuple/list positional
    ones, anything else is the single positional argument."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def call_model(model: nn.Module, example_inputs: Any) -> Any:
    """Run ``model`` on example inputs: a tensor, a tuple/list of positional args or a mapping of kwargs.

    Example:
        >>> call_model(nn.Linear(4, 2), {"input": torch.randn(3, 4)}).shape
        torch.Size([3, 2])
    """
    args, kwargs = as_call(example_inputs)
    return model(*args, **kwargs)


def model_device(model: nn.Module) -> torch.device | None:
    """Device of the model's first parameter (or buffer); ``None`` for a model with neither."""
    return next((t.device for t in (*model.parameters(), *model.buffers())), None)


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a model output or of example inputs (a tensor, or nested in mappings such as
    ``ModelOutput`` or a tokenizer's ``BatchEncoding``, tuples and lists), in order.

    Example:
        >>> [t.dtype for t in output_tensors({"logits": torch.ones(2, 3), "ids": (torch.ones(2, dtype=torch.long),)})]
        [torch.float32, torch.int64]
    """
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in output_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in output_tensors(v)]
    return []


def is_empty_batch(inputs: Any) -> bool:
    """Whether a tensor of example ``inputs`` (nested in mappings, tuples and lists too) has no rows.

    Example:
        >>> is_empty_batch({"x": torch.ones(0, 4)}), is_empty_batch((torch.ones(2, 4),))
        (True, False)
    """
    return any(t.ndim > 0 and t.shape[0] == 0 for t in output_tensors(inputs))


def describe_inputs(inputs: Any) -> str:
    """Example inputs in a line for messages: their structure and tensor shapes (any mapping as ``{...}``).

    Example:
        >>> describe_inputs({"x": torch.ones(2, 4), "mask": (torch.ones(2), 3)})
        '{x: Tensor(2, 4), mask: (Tensor(2,), int)}'
    """
    if isinstance(inputs, torch.Tensor):
        return f"Tensor{tuple(inputs.shape)}"
    if isinstance(inputs, Mapping):
        return "{" + ", ".join(f"{k}: {describe_inputs(v)}" for k, v in inputs.items()) + "}"
    if isinstance(inputs, (tuple, list)):
        return "(" + ", ".join(describe_inputs(v) for v in inputs) + ")"
    return type(inputs).__name__


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # linearize's own code, whose errors name the fix


@contextmanager
def inputs_fit(inputs: Any, what: str = "example_inputs",
               fix: str = "pass a batch shaped like its real inputs") -> Iterator[None]:
    """Run a block that calls the model on ``inputs``: the model's own error there (a shape mismatch deep in
    torch) is raised again as a ``ValueError`` naming ``what``, the inputs' shapes and ``fix``; linearize's own
    errors (its own classes, or raised in its code: they name their fix; a RuntimeError or IndexError raised
    there is torch's, from an op linearize called for the model) and out-of-memory pass unchanged.

    Example:
        >>> with inputs_fit(torch.ones(2, 7)):
        ...     nn.Linear(4, 2)(torch.ones(2, 7))
        Traceback (most recent call last):
        ...
        ValueError: example_inputs Tensor(2, 7) do not fit the model (RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x7 and 4x2)); pass a batch shaped like its real inputs
    """
    try:
        yield
    except Exception as exc:
        innermost = exc.__traceback__
        while innermost is not None and innermost.tb_next is not None:
            innermost = innermost.tb_next
        ours = type(exc).__module__.split(".")[0] == "linearize" or (
            innermost is not None and innermost.tb_frame.f_code.co_filename.startswith(_PACKAGE)
            and not isinstance(exc, (RuntimeError, IndexError)))
        if ours or isinstance(exc, torch.OutOfMemoryError):
            raise
        raise ValueError(f"{what} {describe_inputs(inputs)} do not fit the model ({type(exc).__name__}: {exc}); "
                         f"{fix}") from exc


def float_outputs(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model output (:func:`output_tensors`), in order."""
    return [t for t in output_tensors(out) if t.is_floating_point()]


def max_difference(ref: list[torch.Tensor], new: list[torch.Tensor]) -> tuple[float, float]:
    """``(error, scale)``: the largest ``|ref - new|`` and the largest finite ``|ref|`` over paired tensors of
    one shape, in float64 (``(0.0, 0.0)`` for none). Equal values are no error, NaN and inf included; NaN or
    inf on one side only is an infinite one.

    Example:
        >>> max_difference([torch.tensor([1.0, -4.0, float("nan")])], [torch.tensor([1.5, -4.0, float("nan")])])
        (0.5, 4.0)
    """
    err = scale = 0.0
    for a, b in zip(ref, new, strict=True):
        if a.shape != b.shape:  # broadcasting would compare other elements, or none (an empty side)
            raise ValueError(f"max_difference compares tensors of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
        if not a.numel():
            continue
        a, b = a.detach().double(), b.detach().to(a.device).double()
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        diff = torch.where(same, 0.0, (a - b).abs()).nan_to_num(nan=math.inf, posinf=math.inf)
        err = max(err, float(diff.max()))
        scale = max(scale, float(a.abs().nan_to_num(nan=0.0, posinf=0.0).max()))
    return err, scale


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it, through mappings (rebuilt as dicts), tuples,
    lists and named tuples (rebuilt with their own type); anything else is kept as it is.

    Example:
        >>> map_tensors({"x": torch.ones(2), "n": 3}, lambda t: t * 2)
        {'x': tensor([2., 2.]), 'n': 3}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple takes its fields as arguments
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def to_device(inputs: Any, device: torch.device | None) -> Any:
    """``inputs`` with every tensor (in tuples, lists and mappings too) moved to ``device`` (:func:`map_tensors`)."""
    return inputs if device is None else map_tensors(inputs, lambda t: t.to(device))


# ----------------------------------------------------------------------------- data


def _tensor(x: Any) -> Any:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _leaves(inputs: Any) -> list[torch.Tensor]:
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    return [v for v in values if isinstance(v, torch.Tensor)]


def _model_inputs(batch: Any, where: str) -> Any:
    """The example inputs of one data batch (targets dropped, arrays as tensors)."""
    batch = _tensor(batch)
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise ValueError(f"{where} is an empty {type(batch).__name__}: a batch tuple is (inputs, *targets)")
        inputs = _tensor(batch[0])
        if isinstance(inputs, (tuple, list)):
            inputs = type(inputs)(_tensor(v) for v in inputs)
        where = f"element 0 (the inputs) of the (inputs, *targets) {type(batch).__name__} {where}"
    else:
        inputs = batch
    if isinstance(inputs, Mapping):
        inputs = {k: _tensor(v) for k, v in inputs.items()}
    elif not isinstance(inputs, (torch.Tensor, tuple, list)):
        raise TypeError(
            f"{where} is a {type(inputs).__name__}: data must be {DATA_FORMS}; the inputs of a batch are "
            "a tensor, a mapping of keyword arguments or a tuple of positional arguments"
        )
    if not _leaves(inputs):
        raise TypeError(f"{where} holds no tensor (got {type(inputs).__name__}): data must be {DATA_FORMS}")
    return inputs


def num_rows(inputs: Any) -> int:
    """Samples in one batch of model inputs: dim 0 of its first tensor (a 0-dim tensor is 1 sample)."""
    first = _leaves(inputs)[0]
    return first.shape[0] if first.ndim else 1


def slice_rows(inputs: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a batch: tensors with the batch's row count are sliced, others kept."""
    n = num_rows(inputs)

    def cut(v: Any) -> Any:
        return v[start:stop] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == n else v

    if isinstance(inputs, torch.Tensor):
        return cut(inputs)
    if isinstance(inputs, Mapping):
        return {k: cut(v) for k, v in inputs.items()}
    return type(inputs)(cut(v) for v in inputs)


def _cat(parts: list[Any]) -> Any:
    """One batch of the rows of all ``parts`` (tensors with the batch's row count concatenated)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    rows = [num_rows(p) for p in parts]

    def join(values: list[Any]) -> Any:
        if all(isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == r for v, r in zip(values, rows)):
            return torch.cat(values)
        return values[0]

    if isinstance(first, torch.Tensor):
        return join(parts)
    if isinstance(first, Mapping):
        return {k: join([p[k] for p in parts]) for k in first}
    return type(first)(join(list(vs)) for vs in zip(*parts))


class _Derived:
    """A re-iterable view: ``fn(iterator of the parent's model inputs)`` on every iteration."""

    def __init__(self, parent: Batches, fn: Callable[[Iterator[Any]], Iterator[Any]]) -> None:
        self.parent, self.fn = parent, fn

    def __iter__(self) -> Iterator[Any]:
        return self.fn(iter(self.parent))


class Batches:
    """Data (see the module docstring) read once into a re-iterable sequence of model inputs.

    Iterating yields the example inputs of each batch (a tensor, a dict of keyword arguments or a
    tuple of positional arguments; targets dropped) and can be repeated. A list or a
    ``DataLoader`` is re-iterated each time (a shuffling loader gives its batches in a new order);
    a one-shot iterator (a generator) is read lazily and its batches are kept in memory as they
    come, so that later passes replay them: pass a ``DataLoader`` to stream large data.
    ``len()`` is the number of batches, :attr:`num_samples` the number of samples (both read the
    data once).

    Example:
        >>> data = Batches.of((torch.randn(8, 4), torch.zeros(8)))  # an (inputs, targets) pair
        >>> data.num_samples, [tuple(b.shape) for b in data.split(3)]
        (8, [(3, 4), (3, 4), (2, 4)])
    """

    def __init__(self, source: Iterable[Any], name: str = "data", parsed: bool = False) -> None:
        self._source = source
        self._parsed = parsed  # items of ``source`` are model inputs already
        self.name = name
        self._iterator = source if isinstance(source, Iterator) else None
        self._cache: list[Any] = []
        self._exhausted = False
        self._num_samples: int | None = None

    @classmethod
    def of(cls, data: Any, name: str = "data") -> Batches:
        """``data`` as :class:`Batches` (returned as is when it already is one).

        Raises ``TypeError`` naming the type for anything that is not data (a string, a number,
        ``None``), ``ValueError`` for an empty tensor; an empty iterable raises when iterated.
        """
        if isinstance(data, Batches):
            return data
        if isinstance(data, (str, bytes)) or data is None:
            raise TypeError(f"{name} must be {DATA_FORMS}; got {type(data).__name__}")
        if isinstance(data, (torch.Tensor, np.ndarray, Mapping, tuple)):
            inputs = _model_inputs(data, name)
            if isinstance(inputs, torch.Tensor) and (inputs.numel() == 0 or num_rows(inputs) == 0):
                raise ValueError(f"{name} is an empty tensor of shape {tuple(inputs.shape)}: pass at least one sample")
            return cls([inputs], name, parsed=True)
        if not isinstance(data, Iterable):
            raise TypeError(f"{name} must be {DATA_FORMS}; got {type(data).__name__}")
        return cls(data, name)

    def _raw(self) -> Iterator[Any]:
        if self._iterator is None:
            yield from self._source
            return
        i = 0
        while True:
            if i < len(self._cache):
                yield self._cache[i]
                i += 1
            elif self._exhausted:
                return
            else:
                try:
                    self._cache.append(next(self._iterator))
                except StopIteration:
                    self._exhausted = True

    def __iter__(self) -> Iterator[Any]:
        empty = True
        for i, batch in enumerate(self._raw()):
            empty = False
            yield batch if self._parsed else _model_inputs(batch, f"batch {i} of {self.name}")
        if empty:
            raise ValueError(
                f"{self.name} yielded no batches (empty loader, list or generator): pass at least one batch"
            )

    def __len__(self) -> int:
        if self._iterator is None and hasattr(self._source, "__len__"):  # a list, a DataLoader
            return len(self._source)
        return sum(1 for _ in self)

    @property
    def num_samples(self) -> int:
        """Samples in all batches (rows of each batch's first tensor)."""
        if self._num_samples is None:
            self._num_samples = sum(num_rows(b) for b in self)
        return self._num_samples

    def _derive(self, fn: Callable[[Iterator[Any]], Iterator[Any]]) -> Batches:
        return Batches(_Derived(self, fn), self.name, parsed=True)

    def limit(self, *, samples: int | None = None, batches: int | None = None) -> Batches:
        """The first ``batches`` batches and at most ``samples`` samples (the last batch cut);
        data is read no further than needed."""

        def head(it: Iterator[Any]) -> Iterator[Any]:
            left = samples
            if batches == 0 or (left is not None and left <= 0):
                return
            for i, inputs in enumerate(it, 1):  # stops without reading a batch beyond the limit
                n = num_rows(inputs)
                if left is not None and n > left:
                    inputs, n = slice_rows(inputs, 0, left), left
                yield inputs
                if left is not None:
                    left -= n
                if i == batches or (left is not None and left <= 0):
                    return

        return self._derive(head)

    def split(self, batch_size: int) -> Batches:
        """The same samples in batches of at most ``batch_size`` (larger batches are cut)."""

        def chunks(it: Iterator[Any]) -> Iterator[Any]:
            for inputs in it:
                n = num_rows(inputs)
                if n <= batch_size:
                    yield inputs
                else:
                    yield from (slice_rows(inputs, i, i + batch_size) for i in range(0, n, batch_size))

        return self._derive(chunks)

    def to(self, device: torch.device | None) -> Batches:
        """Every tensor moved to ``device`` as the batches are read (``None``: unchanged)."""
        return self if device is None else self._derive(lambda it: (to_device(b, device) for b in it))

    def cached(self) -> Batches:
        """The batches read now, once, and kept in memory: later passes replay them (a shuffling
        or augmenting loader gives the same samples to every measure)."""
        return Batches(list(self), self.name, parsed=True)

    def concat(self) -> Any:
        """All samples as one batch of model inputs (tensors concatenated along dim 0)."""
        return _cat(list(self))


# ----------------------------------------------------------------------------- modes and hooks


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Every module in eval mode inside the block; each module's own flag restored on exit.

    ``model.train(was_training)`` would set every submodule to the root's flag, switching a
    BatchNorm that was deliberately kept in eval mode back to training.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> _ = net[1].eval()  # a frozen BatchNorm inside a model in training mode
        >>> with eval_mode(net):
        ...     pass
        >>> net.training, net[1].training
        (True, False)
    """
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, flag in flags:
            m.training = flag


@contextmanager
def hooks() -> Iterator[list]:
    """A list to append hook handles to; every handle is removed on exit, on an exception too.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> with hooks() as handles:
        ...     handles.append(net.register_forward_hook(lambda m, a, out: None))
        >>> len(net._forward_hooks)
        0
    """
    handles: list = []
    try:
        yield handles
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- pre-activations


def site_channel_dim(module: nn.Module, ndim: int) -> int:
    """Channel dim of a site's input with ``ndim`` dims (batch included): a unit's own
    ``channel_dim``, else 1 (0 for 1-d inputs)."""
    dim = getattr(module, "channel_dim", None)
    if isinstance(dim, int):
        return dim % ndim
    return 1 if ndim > 1 else 0


def record_preactivations(
    model: nn.Module,
    data: Any,
    sites: list[tuple[str, nn.Module]],
    per_channel: bool,
    progress: bool = False,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Min and max of the input of every site over ``data`` (eval mode, no grad).

    Returns ``{name: (min, max)}`` per channel (``[C]``, reduced over samples and positions) when
    ``per_channel``, else per neuron (the site's input shape without the batch dim, which must then
    be the same for every batch). Raises ``ValueError`` naming the site on a NaN.
    """
    stats: dict[str, list[torch.Tensor]] = {}

    def hook_for(name: str, module: nn.Module):
        def hook(mod, args):
            x = args[0].detach()
            if torch.isnan(x).any():
                raise ValueError(f"NaN in the pre-activation of site {name!r}: check the model and data")
            if per_channel:
                dim = site_channel_dim(module, x.ndim)
                flat = x.movedim(dim, -1).reshape(-1, x.shape[dim])
                lo, hi = flat.amin(0), flat.amax(0)
            else:
                lo, hi = x.amin(0), x.amax(0)
            if name in stats:
                old_lo, old_hi = stats[name]
                if old_lo.shape != lo.shape:
                    raise ValueError(
                        f"site {name!r} saw inputs of different shapes {tuple(old_lo.shape)} and "
                        f"{tuple(lo.shape)}: use per_channel=True for variable-length inputs"
                    )
                lo, hi = torch.minimum(old_lo, lo), torch.maximum(old_hi, hi)
            stats[name] = [lo, hi]

        return hook

    batches = Batches.of(data)
    with hooks() as handles, eval_mode(model), torch.no_grad():
        handles += [m.register_forward_pre_hook(hook_for(n, m)) for n, m in sites]
        it: Iterable[Any] = batches.to(model_device(model))
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(it, desc="recording pre-activations", leave=False)
        for inputs in it:
            if num_rows(inputs):
                with inputs_fit(inputs, "data batch"):
                    call_model(model, inputs)
    missing = [n for n, _ in sites if n not in stats]
    if missing:
        raise ValueError(f"sites {missing} were never called on the data")
    return {n: (lo.cpu(), hi.cpu()) for n, (lo, hi) in stats.items()}


MAX_IMAGE_PIXELS = 50_000_000  # what an image file may decode to (PIL warns above 89M pixels, refuses above 179M)
# the largest image file read: MAX_IMAGE_PIXELS stored raw as 8-bit RGBA, plus 1 MiB of headers and metadata
MAX_IMAGE_BYTES = 4 * MAX_IMAGE_PIXELS + 2**20
# what all the images of one data set read at once (the CLI report's --data) may decode to together: 768 MiB as
# float32 RGB; 512 ImageNet-sized samples (224 x 224) take 38% of it
MAX_TOTAL_PIXELS = 2**26
# what the image files read at once for one data set may hold together (a file of a few pixels may carry up to
# MAX_IMAGE_BYTES of metadata, or be sparse on disk): 512 photos of 2 MB each fit
MAX_TOTAL_BYTES = 2**30


def read_tar_image(tar: Any, member: Any, where: str) -> bytes:
    """The bytes of image ``member`` of the open ``tarfile`` ``tar``; ``ValueError`` naming ``where`` (the
    archive and member) before reading when the member is larger than an image file can be
    (:data:`MAX_IMAGE_BYTES`: a small ``.tar.gz`` can hold gigabytes of zeros, a gzip bomb) or is no regular
    file (a link would be read through to a member whose size was never checked).

    Example:
        >>> import io, tarfile
        >>> buf = io.BytesIO()
        >>> with tarfile.open(fileobj=buf, mode="w") as t:
        ...     info = tarfile.TarInfo("a.png"); info.size = 3; t.addfile(info, io.BytesIO(b"abc"))
        >>> with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as t:
        ...     read_tar_image(t, t.getmember("a.png"), "x.tar:a.png")
        b'abc'
    """
    if not member.isfile():  # extractfile follows a link to its target, whose size this header does not state
        raise ValueError(f"{where} is a {'link' if member.issym() or member.islnk() else 'member that is no file'}, "
                         "not an image file: links are not followed; store the image itself in the archive")
    if member.size > MAX_IMAGE_BYTES:
        raise ValueError(f"{where} is {member.size:,} bytes, more than any image file of at most "
                         f"{MAX_IMAGE_PIXELS:,} pixels can be ({MAX_IMAGE_BYTES:,}): refusing to read it (a gzip "
                         "bomb, or not the data meant); remove it from the archive or resize it first")
    return tar.extractfile(member).read()


def read_image_file(path: str | os.PathLike) -> bytes:
    """The bytes of the image file ``path``; ``ValueError`` naming it before reading when it is no regular
    file (a FIFO, socket or device would block, fail obscurely or never end; a directory) or larger than an
    image file can be (:data:`MAX_IMAGE_BYTES`). A symbolic link is followed and its target checked.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.png"; _ = p.write_bytes(b"abc")
        >>> read_image_file(p)
        b'abc'
    """
    return read_regular(path, lambda info: _check_image_file(path, info), MAX_IMAGE_BYTES)


def _check_image_file(path: str | os.PathLike, info: os.stat_result) -> int:
    """The size of the image file ``path`` from its ``stat`` ``info``; ``ValueError`` when no image file can be it."""
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise ValueError(f"{path} is {kind}: it is no image file; remove it from the image folder")
    if info.st_size > MAX_IMAGE_BYTES:
        raise ValueError(f"{path} is {info.st_size:,} bytes, more than any image file of at most "
                         f"{MAX_IMAGE_PIXELS:,} pixels can be ({MAX_IMAGE_BYTES:,}): refusing to read it; "
                         "remove it from the folder or resize it first")
    return info.st_size


def check_total_bytes(sizes: Iterable[int], where: str) -> None:
    """``ValueError`` naming ``where`` when image files of these byte ``sizes``, read together, exceed
    :data:`MAX_TOTAL_BYTES` (checked from their sizes on disk or in the archive's headers, before any is read).

    Example:
        >>> check_total_bytes([1000] * 512, "--data images")
    """
    sizes = list(sizes)
    total = sum(sizes)
    if total > MAX_TOTAL_BYTES:
        raise ValueError(f"{where}: the {len(sizes)} image files sampled hold {total:,} bytes together, more than "
                         f"{MAX_TOTAL_BYTES:,}: refusing to read "
                         "them; sample fewer (--num-samples) or use smaller files")


def image_size(data: bytes, where: str, max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """``(width, height)`` of an encoded image (PNG, JPEG, ...) read from its header, before any decoding;
    ``ValueError`` naming ``where`` when it is no image, or when it would decode to more than ``max_pixels``
    pixels (a few bytes of PNG can claim 12000 x 12000: a decompression bomb).

    Example:
        >>> import io; from PIL import Image
        >>> buf = io.BytesIO(); Image.new("RGB", (40, 30)).save(buf, "PNG")
        >>> image_size(buf.getvalue(), "a.png")
        (40, 30)
    """
    import io
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings():  # PIL's own warning about large images: the refusal below says more
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                width, height = img.size
    except Exception as e:  # PIL's UnidentifiedImageError, DecompressionBombError, a truncated header
        raise ValueError(f"{where} is not an image that can be read ({type(e).__name__}: {e}): a damaged image or "
                         "another file; replace it or remove it") from None
    if width * height > max_pixels:
        raise ValueError(f"{where} is a {width} x {height} image ({width * height:,} pixels, more than {max_pixels:,}): "
                         "refusing to decode it (a decompression bomb, or not the data meant); resize it first")
    return width, height
