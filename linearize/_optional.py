"""Optional dependencies: one place that knows which extra of ``linearize`` provides which package.

The core install (``pip install linearize``: torch, torchvision, numpy, safetensors, tqdm, ninja for the
CPU kernel's build and filelock for that build's and the saves' locks) converts, sparsifies, freezes and folds. Everything else
is an extra, imported only where it is used, through :func:`require`, so that a missing package
fails with an :class:`ImportError` naming it and the extra to install::

    >>> from linearize._optional import require
    >>> np = require("numpy")                         # a core package: just the module
    >>> require("matplotlib", what="the HTML report")  # doctest: +SKIP
    ImportError: linearize: the HTML report needs matplotlib, which is not installed here:
    pip install "linearize[report]" (or pip install matplotlib)
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtra", "require"]

# top-level import name -> (distribution on PyPI, the extra of linearize that installs it); pyproject.toml's
# [project.optional-dependencies] must list each distribution under that extra (tests/test_install.py checks)
EXTRAS: dict[str, tuple[str, str]] = {
    "transformers": ("transformers", "hf"),
    "accelerate": ("accelerate", "hf"),
    "matplotlib": ("matplotlib", "report"),
    "scipy": ("scipy", "report"),
    "sklearn": ("scikit-learn", "report"),
    "threadpoolctl": ("threadpoolctl", "report"),
    "datasets": ("datasets", "recipes"),
    "sacrebleu": ("sacrebleu", "recipes"),
    "tokenizers": ("tokenizers", "recipes"),
    "tensorboard": ("tensorboard", "recipes"),
    "ot": ("pot", "dev"),
    "torch_pruning": ("torch-pruning", "prune"),
}


class MissingExtra(ImportError):
    """An optional package is not installed; the message names it and the extra that installs it."""


def _message(top: str, what: str | None) -> str:
    dist, extra = EXTRAS[top]
    need = f"{what} needs" if what else "this needs"
    return (f'linearize: {need} {dist}, which is not installed here: pip install "linearize[{extra}]" '
            f'(or pip install {dist}; "linearize[all]" installs every extra)')


def require(*names: str, what: str | None = None) -> ModuleType:
    """Import each module of ``names`` (dotted names allowed) and return the last one.

    A module of an optional package (a key of :data:`EXTRAS`) that is not installed raises
    :class:`MissingExtra` naming the package and ``pip install "linearize[<extra>]"``; ``what`` says
    what needed it ("the HTML report"). Other import errors propagate unchanged.

    Example: ``milp = require("scipy.optimize", what="compress").milp``
    """
    module: ModuleType | None = None
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            top = (err.name or name).partition(".")[0]
            if top not in EXTRAS or not name.startswith(top):
                raise
            raise MissingExtra(_message(top, what), name=top) from err
    if module is None:
        raise TypeError("require() needs at least one module name")
    return module
