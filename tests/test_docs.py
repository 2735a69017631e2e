"""The README and docs/*.md: their runnable snippets run, their links resolve, the README's CPU
commands are run by a named test or CI, and the pages stay short.

A fenced ```python block is runnable when its first line is a marker comment:

* ``# runnable``: one process; executed in this test's process (``runpy``, as ``__main__``,
  in a temporary working directory);
* ``# runnable: N ranks``: a script the page tells users to start with ``torchrun``; it is
  written to a file and run on N gloo ranks of the test harness (processes forked from
  tests/spawn.py's fork server, which imported torch and torch_dcp once), each with the
  environment torchrun gives a rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), run as ``__main__`` in the script's
  folder, with a time limit. The multi-rank scripts run side by side, each on its own port.
  torchrun itself runs the README's main-job commands (tests/test_train.py).

Any other block is illustration (e.g. a multi-node or GPU job). A snippet that raises, exits
non-zero or outlives its limit fails the suite. The test prints how many snippets ran and
asserts a minimum count, so it cannot pass by finding none.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import runpy
import socket
import sys
import time
import traceback
from pathlib import Path

import pytest

import spawn

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^# runnable(?::\s*(\d+) ranks)?\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")

#: at least this many runnable snippets (README: 2; docs: the rest): a page that loses its
#: marker, or a parser that finds none, fails here
MIN_SINGLE, MIN_RANKS = 5, 3

#: every command line of the README's ```bash blocks (its CPU commands), with the test or CI
#: step that runs it: ``tests/FILE.py::TEST`` (the test must exist) or ``.ci/run: TEXT`` (TEXT
#: must appear in .ci/run). Comments after ``#`` are not part of a command.
README_COMMANDS = {
    "pip install torch==2.13.0 && pip install -e '.[dev,torchtitan,hf,trl]'":
        [".ci/run: pip install --quiet torch==2.13.0", ".ci/run: pip install --quiet -e '.[dev,torchtitan,hf,trl]'"],
    "torchrun --standalone --nproc-per-node 4 recipes/train_llama.py":
        ["tests/test_train.py::test_dcp_fsdp_matches_single_process"],
    "torchrun --standalone --nproc-per-node 4 recipes/train_llama.py --tp 2":
        ["tests/test_train.py::test_tensor_parallel_dcp_matches_tensor_parallel_alone"],
    "python -m pytest -q": [".ci/run: python -m pytest -q"],
}


def _blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """The fenced blocks of a page: (language, first line number, lines)."""
    out, lang, start, body = [], None, 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if lang is None and m:
            lang, start, body = m.group(1), n + 1, []
        elif lang is not None and line.rstrip() == "```":
            out.append((lang, start, body))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{path.name}: a fenced block opened at line {start - 1} is never closed"
    return out


def _snippets() -> tuple[list[tuple[str, str]], list[tuple[str, int, str]]]:
    """(name, code) of the single-process snippets and (name, ranks, code) of the multi-rank ones."""
    single, ranks = [], []
    for page in PAGES:
        for lang, start, body in _blocks(page):
            if lang != "python" or not body:
                continue
            m = MARKER.match(body[0])
            if m:
                name = f"{page.relative_to(ROOT)}:{start}"
                code = "\n".join(body) + "\n"
                (ranks.append((name, int(m.group(1)), code)) if m.group(1) else single.append((name, code)))
    return single, ranks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_ranks(script: Path, world: int) -> list:
    """``world`` ranks of ``script`` as torchrun would start them, forked from the harness's fork
    server; their output goes to ``script``'s ``.log``."""
    spawn._forkserver()
    ctx = multiprocessing.get_context("forkserver")
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    procs = [ctx.Process(target=_snippet_rank, args=(str(script), rank, env)) for rank in range(world)]
    for proc in procs:
        proc.start()
    return procs


def _snippet_rank(script: str, rank: int, env: dict) -> None:
    """One rank: torchrun's environment, the script as ``__main__`` in its folder; exit status
    0 when it returns (or exits 0), 1 with its traceback in the log when it raises."""
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    log = os.open(str(Path(script).with_suffix(".log")), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(os.path.dirname(script))
    sys.argv = [script]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException:  # noqa: BLE001 -- a snippet's failure is the rank's exit status
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def test_snippets_run(tmp_path, monkeypatch, capsys):
    single, ranks = _snippets()
    t0 = time.perf_counter()
    jobs = []
    for i, (name, world, code) in enumerate(ranks):  # start the multi-rank scripts first: they run meanwhile
        script = tmp_path / f"snippet{i}.py"
        script.write_text(code)
        jobs.append((name, _start_ranks(script, world), script.with_suffix(".log")))
    failures = []
    monkeypatch.chdir(tmp_path)
    for i, (name, code) in enumerate(single):
        script = tmp_path / f"single{i}.py"
        script.write_text(code)
        try:
            runpy.run_path(str(script), run_name="__main__")
        except BaseException as err:  # noqa: BLE001 -- a snippet's SystemExit too
            failures.append(f"{name}: {type(err).__name__}: {err}")
    t_single = time.perf_counter() - t0
    for name, procs, log in jobs:
        codes = []
        for proc in procs:
            proc.join(timeout=max(1.0, 240 - (time.perf_counter() - t0)))
            if proc.exitcode is None:
                proc.kill()
                proc.join()
                codes.append("timeout")
            else:
                codes.append(proc.exitcode)
        if any(c != 0 for c in codes):
            failures.append(f"{name}: rank exit codes {codes}:\n" + log.read_text()[-3000:])
    elapsed = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\ndocs snippets: {len(single)} single-process ({t_single:.1f} s), {len(ranks)} multi-rank "
              f"({sum(w for _, w, _ in ranks)} ranks in all), {elapsed:.1f} s in all")
    assert not failures, "\n\n".join(failures)
    assert len(single) >= MIN_SINGLE and len(ranks) >= MIN_RANKS, (len(single), len(ranks))


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    inside, out = False, set()
    for line in path.read_text().splitlines():
        if FENCE.match(line) or line.rstrip() == "```":
            inside = not inside
        elif not inside and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def test_links_resolve():
    """Every relative link and image of the README and docs/*.md names an existing file, and
    its #anchor a heading of that page."""
    bad, n = [], 0
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            n += 1
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.name}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.name}: {target}: no heading #{anchor} in {dest.name}")
    assert not bad, "\n".join(bad)
    assert n >= 20, n


def test_readme_cpu_commands_are_run_by_a_test_or_ci():
    """Every command of the README's ```bash blocks is in README_COMMANDS, and what it names
    exists: the test function in its file, the text in .ci/run."""
    ci = (ROOT / ".ci" / "run").read_text()
    seen = []
    for lang, start, body in _blocks(ROOT / "README.md"):
        if lang != "bash":
            continue
        for line in body:
            cmd = line.split("#", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            if cmd:
                seen.append(cmd)
                assert cmd in README_COMMANDS, f"README.md: {cmd!r} is run by no test or CI step (README_COMMANDS)"
    assert len(seen) >= 4, seen
    for cmd in seen:
        for where in README_COMMANDS[cmd]:
            if where.startswith(".ci/run: "):
                assert where.removeprefix(".ci/run: ") in ci, (cmd, where)
            else:
                file, _, test = where.partition("::")
                assert re.search(rf"^def {re.escape(test)}\(", (ROOT / file).read_text(), re.M), (cmd, where)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_stay_short(page):
    """The README is a front page (<= 160 lines); a topic page stays under ~400 lines.
    docs/benchmark.md is the benchmarks' generated tables, exempt."""
    limit = 160 if page.name == "README.md" else (None if page.name == "benchmark.md" else 400)
    if limit is not None:
        assert len(page.read_text().splitlines()) <= limit, page.name
