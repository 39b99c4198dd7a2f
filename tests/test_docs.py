"""The documentation runs as written: every ```python block of README.md and docs/*.md is executed (a page's
blocks in order, in one namespace, in a fresh process, from an empty folder), and every ``linearize``
subcommand and recipe flag named in a ```bash block exists (read from the commands' own ``--help``).

Blocks that need something a test machine lacks (a dataset, a download, a GPU, an undefined model) are tagged
```python no-run and are only compiled; there may be at most ``MAX_NO_RUN`` of them in all.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_NO_RUN = 6
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)

# runs pages, each in a fresh namespace and from its own folder; prints one JSON line per page:
# {"page": ..., "ok": bool, "block": line of the failing block, "error": ..., "seconds": ...}
RUNNER = r"""
import json, os, sys, time, traceback, warnings
warnings.simplefilter("ignore")
for page, folder, blocks in json.loads(open(sys.argv[1], encoding="utf-8").read()):
    os.chdir(folder)
    names, result, start = {"__name__": "__main__"}, {"page": page, "ok": True}, time.perf_counter()
    for line, code in blocks:
        try:
            exec(compile(code, f"{page}:{line}", "exec"), names)
        except BaseException:
            result = {"page": page, "ok": False, "block": line, "error": traceback.format_exc()[-3000:]}
            break
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result), flush=True)
"""


def code_blocks(page: Path) -> list[tuple[str, int, str]]:
    """``(info string, line of the block's first code line, code)`` of every fenced block of ``page``."""
    text = page.read_text(encoding="utf-8")
    return [(m.group(1).strip(), text.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in FENCE.finditer(text)]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_fenced_block_is_tagged_and_few_python_blocks_are_not_run():
    untagged = [f"{_name(p)}:{line}" for p in PAGES for tag, line, _ in code_blocks(p) if not tag]
    assert not untagged, f"code blocks without a language tag (python, python no-run, bash, text): {untagged}"
    no_run = [f"{_name(p)}:{line}" for p in PAGES for tag, line, _ in code_blocks(p) if tag == "python no-run"]
    assert len(no_run) <= MAX_NO_RUN, f"{len(no_run)} python blocks are not run (at most {MAX_NO_RUN}): {no_run}"
    for page in PAGES:  # a block that is not run still compiles
        for tag, line, code in code_blocks(page):
            if tag.startswith("python"):
                compile(code, f"{_name(page)}:{line}", "exec")


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    unlinked = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            path = target.split("#", 1)[0]
            if path and "://" not in path and not (page.parent / path).exists():
                broken.append(f"{_name(page)} -> {target}")
    assert not broken, f"links to missing files: {broken}"


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory) -> dict[str, dict]:
    """Every page with python blocks, run in two processes (one import of torch each), each page from its own
    empty folder (holding a link to ``recipes/``: pages speak from the repository root). docs/extending.md
    registers a fold rule and a measure for good, so it runs last in its process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    pages = sorted((p for p in PAGES if any(tag == "python" for tag, _, _ in code_blocks(p))),
                   key=lambda p: p.name == "extending.md")
    jobs: list[list] = [[], []]
    for i, page in enumerate(pages):
        folder = tmp_path_factory.mktemp(page.stem)
        (folder / "recipes").symlink_to(ROOT / "recipes")
        blocks = [(line, code) for tag, line, code in code_blocks(page) if tag == "python"]
        jobs[i % 2].append((_name(page), str(folder), blocks))
    procs = []
    for k, job in enumerate(jobs):
        spec = tmp_path_factory.getbasetemp() / f"docs-job-{k}.json"
        spec.write_text(json.dumps(job), encoding="utf-8")
        procs.append((job, subprocess.Popen([sys.executable, "-c", RUNNER, str(spec)], env=env, text=True,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    results = {}
    for job, proc in procs:
        out, err = proc.communicate(timeout=600)
        for line in out.splitlines():
            if line.startswith('{"page"'):
                result = json.loads(line)
                results[result["page"]] = result
        for page, _, _ in job:  # a page after a crash of its process
            results.setdefault(page, {"ok": False, "block": None, "error": err[-3000:]})
    return results


@pytest.mark.parametrize("page", [_name(p) for p in PAGES if any(t == "python" for t, _, _ in code_blocks(p))])
def test_python_blocks_of_the_page_run_as_written(page_runs, page):
    result = page_runs[page]
    assert result["ok"], f"{page}: the block at line {result['block']} failed:\n{result['error']}"


def _commands(page: Path) -> list[list[str]]:
    """The commands of the page's ```bash blocks, continuation lines joined, as argv lists."""
    commands = []
    for tag, _, code in code_blocks(page):
        if tag != "bash":
            continue
        for line in code.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line):
                    try:
                        commands.append(shlex.split(part))
                    except ValueError:
                        commands.append(part.split())
    return commands


def _flags(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def _help(argv: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    run = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"{' '.join(argv)} --help failed:\n{run.stderr[-2000:]}"
    return run.stdout


def _cli_help(argv: list[str]) -> str:
    """What ``linearize ARGV --help`` prints (in this process: the parser only)."""
    from linearize.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main([*argv[:1], "--help", *argv[1:]])  # --help first: `report --compare` wants its runs before it
    assert exit_info.value.code == 0, f"linearize {' '.join(argv)} --help failed"
    return out.getvalue()


def _named(flag: str, help_text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def test_cli_subcommands_and_flags_in_bash_blocks_exist():
    subcommands = set(re.findall(r"^    (\w+) ", _cli_help([]), re.M))
    assert {"demo", "inspect", "report"} <= subcommands
    seen, wrong = 0, []
    for page in PAGES:
        for argv in _commands(page):
            if argv[:1] != ["linearize"]:
                continue
            seen += 1
            if argv[1:] in (["--help"], ["--version"]):
                continue
            if len(argv) < 2 or argv[1] not in subcommands:
                wrong.append(f"{_name(page)}: {' '.join(argv[:2])}")
                continue
            # `linearize report --compare ...` is its own parser (linearize.comparison)
            text = _cli_help([argv[1], "--compare"] if "--compare" in argv else [argv[1]])
            wrong += [f"{_name(page)}: linearize {argv[1]} {f}" for f in _flags(argv[2:]) if not _named(f, text)]
    assert seen >= 5, "the docs should show the command line"
    assert not wrong, f"unknown subcommands or flags: {wrong}"


def test_recipe_flags_in_bash_blocks_exist():
    """Every flag after a ``recipes/...`` script in a bash block is in that script's ``--help``."""
    uses: dict[str, set[str]] = {}
    for page in PAGES:
        for argv in _commands(page):
            script = next((i for i, a in enumerate(argv) if a.startswith("recipes/")), None)
            if script is not None:
                uses.setdefault(argv[script], set()).update(_flags(argv[script + 1:]))
    assert "recipes/cifar.py" in uses and "recipes/wmt14.py" in uses
    wrong = []
    for script, flags in sorted(uses.items()):
        assert (ROOT / script).exists(), f"the docs run {script}, which does not exist"
        text = _help([script])
        wrong += [f"{script} {f}" for f in sorted(flags) if not _named(f, text)]
    assert not wrong, f"flags the recipes do not take: {wrong}"


def test_ci_runs_the_readme_set_up_commands():
    """.ci/run runs exactly the README's two set-up commands (its first bash block), as they are written."""
    readme = ROOT / "README.md"
    first = next(code for tag, _, code in code_blocks(readme) if tag == "bash")
    commands = [line.strip() for line in first.splitlines() if line.strip()]
    assert commands == ['pip install -e ".[dev]" && linearize demo', "pytest"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert all(command in ci for command in commands), f".ci/run does not run {commands}"
