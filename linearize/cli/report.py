"""The ``linearize report`` subcommand: its options (:func:`register_cli`) and its run (:func:`run_cli`),
over :func:`linearize.report` and the file readers of :mod:`linearize.cli.readers`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from .._files import check_folder
from ..checks import arg_type, check_positive, check_positive_int, check_tol
from ..history import read_history
from ..models import add_trust_pickle
from ..report_measures import MEASURES, REGIONS_MAX_REGIONS, REGIONS_SECONDS
from ..reporting import report
from . import reading
from .readers import load_model_and_data


MAX_CLASSES = 100_000  # --num-classes: more is a typo (ImageNet-21k has 21,841; regnet_y_128gf's head at 1e5: 3 GB)


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand to a ``linearize`` argument parser; returns its parser."""
    p = subparsers.add_parser(
        "report",
        help="measure where a model's nonlinearity sits; write report.json, PNG plots and report.html",
        description="Load a model, run the linearize measures on data and write report.json, PNG plots "
        "and a self-contained report.html into --output-dir. A model without units is converted first "
        "(slopes 0: every channel nonlinear).",
    )
    p.add_argument("model", help="a torchvision builder name (resnet18), a Hugging Face model directory "
                   "(with linearize_config.json if saved by linearize.save_pretrained), or a .pt file "
                   "holding a whole pickled nn.Module (needs --trust-pickle)")
    p.add_argument("--data", required=True, help="'digits' (sklearn demo data), an image folder, the CIFAR-10 "
                   ".tar.gz of JPEGs, or a JSONL(.gz) text file (Hugging Face models)")
    p.add_argument("--checkpoint", help="state_dict file for a torchvision model (plain or converted)")
    p.add_argument("--num-classes", type=arg_type(check_positive_int, "--num-classes", 1, MAX_CLASSES),
                   help="output classes of the torchvision model (default: builder's)")
    p.add_argument("--units", help="directory written by linearize.save_pretrained for a torchvision model")
    p.add_argument("--history", help="sparsifier history JSON (Sparsifier.save_history)")
    p.add_argument("--output-dir", default="linearize-report", help="where to write (default linearize-report)")
    p.add_argument("--num-samples", type=arg_type(check_positive_int, "--num-samples", 2), default=512,
                   help="samples used, at least 2 (default 512)")
    p.add_argument("--segments", type=arg_type(check_positive_int, "--segments", 0), default=16,
                   help="segments for linear regions (default 16; 0 skips them)")
    p.add_argument("--max-regions", type=_or_none(arg_type(check_positive_int, "--max-regions")),
                   default=REGIONS_MAX_REGIONS, metavar="N",
                   help=f"linear regions: stop a segment after N regions ('none': no limit; default {REGIONS_MAX_REGIONS})")
    p.add_argument("--regions-seconds", type=_or_none(arg_type(check_positive, "--regions-seconds")),
                   default=REGIONS_SECONDS, metavar="S",
                   help=f"linear regions: stop all segments after S seconds ('none': no limit; default {REGIONS_SECONDS:g}); "
                   "a stopped walk is reported as partial")
    p.add_argument("--paths", choices=["pairs", "loops"], default="pairs", help="segments between samples or translation loops")
    p.add_argument("--tol", type=arg_type(check_tol, 1.0, "--tol"), default=0.0,
                   help="in [0, 1): a channel is linear when a >= 1 - tol (default 0)")
    p.add_argument("--batch-size", type=arg_type(check_positive_int, "--batch-size"), default=128,
                   help="forward batch size (default 128)")
    p.add_argument("--normalize", choices=["auto", "cifar10", "imagenet", "none"], default="auto",
                   help="image normalization (auto: cifar10 for the .tar.gz, imagenet for folders)")
    p.add_argument("--image-size", type=arg_type(check_positive_int, "--image-size"),
                   help="resize images to this square size")
    p.add_argument("--text-field", help="JSONL field with the text, dotted for nesting (default: text, sentence or translation.en)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model directory)")
    p.add_argument("--max-length", type=arg_type(check_positive_int, "--max-length"), default=64,
                   help="tokens per text (default 64)")
    p.add_argument("--skip", nargs="+", default=[], choices=list(MEASURES), metavar="MEASURE",
                   help=f"measures not to run, of: {', '.join(MEASURES)}")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_trust_pickle(p)
    p.set_defaults(func=run_cli)
    return p


def _or_none(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An ``argparse`` ``type=``: ``'none'`` (no limit) as ``None``, anything else through ``parse``."""
    def wrapped(text: str) -> object:
        return None if text.strip().lower() == "none" else parse(text)

    wrapped.__name__ = parse.__name__  # argparse names the type in its "invalid" message
    return wrapped


def run_cli(args: argparse.Namespace) -> int:
    """Run the ``report`` subcommand; prints each measure's summary line and where the files went."""
    with reading(f"--output-dir {args.output_dir}"):  # before anything runs: a report is not measured to be lost
        check_folder(args.output_dir, "--output-dir")
    model, data = load_model_and_data(args)
    if args.history:
        with reading(f"--history {args.history}"):  # checked before any measure runs
            read_history(args.history)
    rep = report(model, data, history=args.history, tol=args.tol, max_samples=args.num_samples,
                 segments=args.segments, paths=args.paths, batch_size=args.batch_size,
                 skip=args.skip, progress=not args.no_progress, max_regions=args.max_regions,
                 regions_seconds=args.regions_seconds)
    written = rep.save(args.output_dir)
    for name, measure in MEASURES.items():
        line = None if measure.summary is None or rep[name] is None else measure.summary(rep[name])
        if line:
            print(line)
    for what, reason in rep.skipped.items():
        print(f"skipped {what}: {reason}")
    print(f"wrote {', '.join(sorted(written))} to {Path(args.output_dir).resolve()}")
    return 0
