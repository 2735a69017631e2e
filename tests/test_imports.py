"""The library does not import its benchmarks (torch_dcp.benchmarks) nor their tooling
(argparse, tqdm, matplotlib).

torch itself imports argparse and, when installed, tqdm (torch.hub), so a run-time look at
``sys.modules`` can only show that no benchmark module and no matplotlib is loaded; the
static check reads every core module's imports, function-level ones included.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import torch_dcp

ROOT = Path(torch_dcp.__file__).parent
TOOLING = {"argparse", "tqdm", "matplotlib"}


def _core_files() -> list[Path]:
    """The package without its benchmarks and its framework integrations (each imports its
    framework: torch_dcp.integrations.torchtitan imports torchtitan, .hf transformers); the integrations
    package's own ``__init__`` is core."""
    def core(p: Path) -> bool:
        parts = p.relative_to(ROOT).parts
        return "benchmarks" not in parts and (parts[0] != "integrations" or parts[1:] == ("__init__.py",))

    return [p for p in sorted(ROOT.rglob("*.py")) if core(p)]


def _imported(path: Path) -> set[str]:
    """Absolute names of the modules (and ``from`` targets) a file imports."""
    package = ["torch_dcp", *path.relative_to(ROOT).parent.parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return names


def test_core_sources_import_no_benchmark_code():
    files = _core_files()
    assert ROOT / "executor" / "executor.py" in files and len(files) > 20
    bad = {}
    for path in files:
        hits = {n for n in _imported(path)
                if n.split(".")[0] in TOOLING or n == "torch_dcp.benchmarks" or n.startswith("torch_dcp.benchmarks.")}
        if hits:
            bad[str(path.relative_to(ROOT))] = sorted(hits)
    assert not bad


def test_importing_the_core_loads_no_benchmark_module():
    modules = [".".join(["torch_dcp", *p.relative_to(ROOT).with_suffix("").parts]).removesuffix(".__init__")
               for p in _core_files()]
    code = (
        "import importlib, json, sys\n"
        "import torch_dcp, torch_dcp.executor, torch_dcp.planners, torch_dcp.data\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent)
    loaded = json.loads(res.stdout.strip().splitlines()[-1])
    assert "torch_dcp.executor.executor" in loaded and "torch_dcp.simulate" in loaded
    assert not [m for m in loaded if m.startswith("torch_dcp.benchmarks")]
    assert not [m for m in loaded if m.split(".")[0] == "matplotlib"]
    assert "torch_dcp.integrations" in loaded  # the package's own __init__, importing no framework
    assert not [m for m in loaded if m.split(".")[0] in ("torchtitan", "transformers")
                or m in ("torch_dcp.integrations.torchtitan", "torch_dcp.integrations.hf")]
