"""The ``Example:`` blocks of the main entry points run as doctests (with ``torch``, ``nn`` and
``linearize`` in their globals), so the documented calls and printed results stay true."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch
from torch import nn

import linearize

ENTRY_POINTS = [  # (module, object): each must carry at least one doctest example
    ("linearize.conversion", "convert"),
    ("linearize.freezing", "freeze"),
    ("linearize.folding.core", "fold"),
    ("linearize.sparsifier", "Sparsifier"),
    ("linearize.reporting", "report"),
    ("linearize.measures.paths", "average_path_length"),
    ("linearize.measures.affinity", "affinity_score"),
    ("linearize.measures.regions", "linear_regions"),
    ("linearize.measures.regions", "absolute_deviation"),
    ("linearize.measures.relus", "count_relus"),
    ("linearize.stability", "stable_units"),
    ("linearize.compression", "compress"),
    ("linearize.serialization", "save_pretrained"),
]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize("module_name, name", ENTRY_POINTS, ids=[n for _, n in ENTRY_POINTS])
def test_example_runs(module_name, name):
    module = importlib.import_module(module_name)
    globs = {**vars(module), "torch": torch, "nn": nn, "linearize": linearize}
    tests = doctest.DocTestFinder(recurse=False).find(getattr(module, name), name, module=module, globs=globs)
    assert any(t.examples for t in tests), f"{module_name}.{name} has no Example: block"
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
