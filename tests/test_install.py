"""The core install and its extras: pyproject's dependency lists, and a missing optional package failing
with an ImportError that names it and the extra to install.

The extras are hidden from a subprocess by an import hook (as if not installed); the real core-only
venv check is ``tests/core_install_check.py``, run by ``.ci/run`` in a venv holding ``pip install .``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from linearize._optional import EXTRAS

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
CORE = {"torch", "torchvision", "numpy", "safetensors", "tqdm", "ninja", "filelock"}

HIDE = """
import sys
for name in {hidden!r}:  # as if not installed: importing raises ModuleNotFoundError, find_spec gives None
    sys.modules[name] = None
"""

def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def _extra(extra: str, seen: frozenset = frozenset()) -> set[str]:
    """The distributions an extra installs, following ``linearize[...]`` self-references."""
    names: set[str] = set()
    for req in PYPROJECT["optional-dependencies"][extra]:
        if _name(req) == "linearize":
            for inner in re.search(r"\[(.*)\]", req).group(1).split(","):
                if inner.strip() not in seen:
                    names |= _extra(inner.strip(), seen | {extra})
        else:
            names.add(_name(req))
    return names


def test_core_dependencies_are_the_light_core():
    assert {_name(r) for r in PYPROJECT["dependencies"]} == CORE


def test_each_optional_package_is_in_the_extra_its_error_names_and_all_holds_every_extra():
    for module, (dist, extra) in EXTRAS.items():
        assert dist in _extra(extra), f"{module}: {dist} is not in linearize[{extra}]"
    assert {"hf", "report", "recipes", "all", "dev"} <= PYPROJECT["optional-dependencies"].keys()
    every = set().union(*(_extra(e) for e in ("hf", "report", "recipes")))
    assert _extra("all") == every and every <= _extra("dev") and "pytest" in _extra("dev")


def _run_hidden(hidden: set[str], code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LINEARIZE_CPU_KERNEL": "0"}
    return subprocess.run([sys.executable, "-c", HIDE.format(hidden=sorted(hidden)) + code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("hidden, code, package, extra", [
    ({"transformers"}, "import linearize.integrations", "transformers", "hf"),
    ({"scipy"}, "import linearize; linearize.measures.affinity_score", "scipy", "report"),
    ({"matplotlib"}, "from linearize import plots; plots.figure(2)", "matplotlib", "report"),
])
def test_a_missing_extra_names_the_package_and_the_install_command(hidden, code, package, extra):
    proc = _run_hidden(hidden, code)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("linearize._optional.MissingExtra") or "MissingExtra" in last, proc.stderr[-2000:]
    assert package in last and f'pip install "linearize[{extra}]"' in last, last


def test_cli_demo_without_scikit_learn_says_which_extra_without_a_traceback():
    proc = _run_hidden({"sklearn"}, "import sys; from linearize.cli import main; sys.exit(main(['demo']))")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "scikit-learn" in proc.stderr and 'pip install "linearize[report]"' in proc.stderr


def test_the_core_runs_without_any_extra():
    """convert + Sparsifier + freeze + fold on torchvision's resnet18 with every extra hidden."""
    proc = _run_hidden(set(EXTRAS), "import runpy; runpy.run_path('tests/core_install_check.py', run_name='__main__')")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "core install OK" in proc.stdout


def test_the_package_ships_its_license_types_marker_and_version(capsys):
    from importlib.metadata import version

    from linearize.cli import main

    assert PYPROJECT["license"] == "Apache-2.0" and PYPROJECT["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert (REPO / "linearize" / "py.typed").is_file()
    assert "py.typed" in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["linearize"]
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"linearize {version('linearize')}"
