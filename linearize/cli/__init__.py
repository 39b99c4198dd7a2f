"""``linearize`` command line: ``linearize demo``, ``linearize inspect``, ``linearize report``.

The ``report`` subcommand's options and run are in :mod:`linearize.cli.report`;
the files it reads (image folders and archives, JSONL text, checkpoints) are :mod:`linearize.cli.readers`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..checks import arg_type, check_fraction, check_positive_int


class InputMismatch(ValueError):
    """The model's forward fails on the input a command built from its flags (:func:`main` prints it, no traceback)."""


class InputError(ValueError):
    """A file, folder or name a command was given cannot be read as what it should be (:func:`main` prints it
    in one line, no traceback)."""


@contextmanager
def reading(what: str) -> Iterator[None]:
    """Turn the errors of reading the user's input ``what`` (e.g. ``"--data cifar.tar.gz"``) into :class:`InputError`:
    a missing or unreadable file, a damaged or crafted one, a name that is no model. Only around reading the
    input: a failure later (a bug, out of memory) keeps its traceback.

    Example:
        >>> try:
        ...     with reading("--history h.json"):
        ...         raise ValueError("not valid JSON")
        ... except InputError as err:
        ...     print(err)
        --history h.json: not valid JSON
    """
    import tarfile
    import zlib

    try:
        yield
    except (OSError, ValueError, EOFError, tarfile.TarError, zlib.error) as err:
        if isinstance(err, (InputMismatch, InputError)):
            raise
        text = str(err) if not isinstance(err, OSError) or err.filename is None else \
            f"{err.filename}: {err.strerror or err}"
        if not what.strip():  # a blank name: shown quoted
            what = repr(what)
        named = what.split()[-1] in text  # the message names the input already
        raise InputError(text if named else f"{what}: {text}") from err


def _inspect(args: argparse.Namespace) -> int:
    from ..conversion import dry_run
    from ..models import load_model

    with reading(args.model):
        model = load_model(args.model, trust_pickle=args.trust_pickle)
    with reading(f"--example-inputs {args.example_inputs}" if args.example_inputs else "--input-shape"):
        inputs = example_inputs_from_args(args)
    if inputs is not None:
        from .readers import check_model_takes

        given = "--input-shape " + ",".join(map(str, args.input_shape)) if args.input_shape else \
            f"--example-inputs {args.example_inputs}"
        check_model_takes(model, inputs, args.model, given, "give the input its forward takes, e.g. --input-shape "
                          "1,3,224,224 for an image classifier, or its tensors with --example-inputs FILE")
    print(dry_run(model, example_inputs=inputs))
    return 0


MAX_THREADS = 1024  # torch threads a command may ask for (more than any machine's cores; torch overflows far above)
MAX_INPUT_ELEMENTS = 2**26  # 256 MiB of float32: the probe input of --input-shape is one small batch


def input_shape(text: str) -> tuple[int, ...]:
    """An ``argparse`` ``type=`` for ``--input-shape``: ``"1,3,224,224"`` as a tuple of positive ints."""
    try:
        shape = tuple(int(s) for s in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--input-shape {text!r}: expected positive sizes separated by commas, "
                                         "e.g. 1,3,224,224")
    if len(shape) > 8 or math.prod(shape) > MAX_INPUT_ELEMENTS:
        raise argparse.ArgumentTypeError(
            f"--input-shape {text!r}: {math.prod(shape):,} values in {len(shape)} dims; the probe input is one small "
            f"batch (at most 8 dims and {MAX_INPUT_ELEMENTS:,} values), e.g. 1,3,224,224")
    return shape


def add_input_options(parser: argparse.ArgumentParser) -> None:
    """``--input-shape`` / ``--example-inputs``: the probe input of models whose input convert cannot guess."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--input-shape", type=input_shape, metavar="N,C,H,W",
                       help="probe the model with a float tensor of this shape (random normal), e.g. 1,3,224,224")
    group.add_argument("--example-inputs", metavar="FILE",
                       help="probe the model with the tensors of a .safetensors file: one tensor is the positional "
                       "input, several are keyword inputs by name (default: guessed from the model)")


def example_inputs_from_args(args: argparse.Namespace) -> Any:
    """The probe input that ``--input-shape`` / ``--example-inputs`` ask for, or ``None`` (convert guesses one)."""
    if args.input_shape is not None:
        import torch

        return torch.randn(args.input_shape, generator=torch.Generator().manual_seed(0))
    if args.example_inputs is not None:
        from ..example_inputs import load_example_inputs

        return load_example_inputs(args.example_inputs)
    return None


def _demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    run_demo(epochs=args.epochs, target=args.target, seed=args.seed, threads=args.threads)
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("linearize")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="linearize",
        description="Find out how much of a trained network's nonlinearity is needed, and remove the rest.",
        epilog="linearize report --compare RUN_A RUN_B ... [--out compare.html]: several run directories "
        "(baseline and linearized) side by side on one HTML page.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser("demo", help="train, linearize, freeze and fold a small net on sklearn digits (no download)")
    demo.add_argument("--epochs", type=arg_type(check_positive_int, "--epochs", 1, 10_000), default=30,
                      help="training epochs of the baseline (default 30)")
    demo.add_argument("--target", type=arg_type(check_fraction, "--target"), default=0.10,
                      help="nonlinear fraction to reach, in (0, 1] (default 0.10)")
    demo.add_argument("--seed", type=arg_type(check_positive_int, "--seed", 0, 2**32 - 1), default=0)
    demo.add_argument("--threads", type=arg_type(check_positive_int, "--threads", 1, MAX_THREADS), default=1,
                      help="torch threads (default 1: the demo's ops are small)")
    demo.set_defaults(func=_demo)

    inspect = sub.add_parser("inspect", help="list the activation call sites convert would swap (dry run)")
    inspect.add_argument("model", help="a torchvision builder name (resnet18, vit_b_16), a timm model name "
                         "(timm installed), a Hugging Face model directory, or a .pt file holding a whole pickled "
                         "nn.Module (needs --trust-pickle); builders make randomly initialized models")
    from ..models import add_trust_pickle

    add_trust_pickle(inspect)
    add_input_options(inspect)
    inspect.set_defaults(func=_inspect)

    from .report import register_cli

    register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``linearize`` console script."""
    from .._optional import MissingExtra

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["report"] and any(a == "--compare" or a.startswith("--compare=") for a in argv):
            from ..comparison import main as compare_main  # `linearize report --compare RUN_A RUN_B ...`

            with reading("--compare"):  # it reads the runs' files and writes one page
                return compare_main(argv[1:])
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except MissingExtra as err:  # an optional package this command needs: say which extra, no traceback
        print(err, file=sys.stderr)
        return 2
    except (InputMismatch, InputError) as err:  # the input the flags named: the flags are the fix
        print(f"linearize {argv[0]}: error: {err}", file=sys.stderr)
        return 2
