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


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """Every import statement of a file, function-level ones included, as ``(module, names)``:
    the absolute module name and, for ``from module import a, b``, ``[a, b]`` (else ``[]``)."""
    package = ["torch_dcp", *path.relative_to(ROOT).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            found.append((".".join(base + ([node.module] if node.module else [])), [a.name for a in node.names]))
    return found


def _imported(path: Path) -> set[str]:
    """Absolute names of the modules (and ``from`` targets) a file imports."""
    return {n for mod, names in _imports(path) for n in [mod, *(f"{mod}.{a}" for a in names)]}


def _module_name(path: Path) -> str:
    return ".".join(["torch_dcp", *path.relative_to(ROOT).with_suffix("").parts]).removesuffix(".__init__")


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
    modules = [_module_name(p) for p in _core_files()]
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
    assert "torch_dcp.executor.executor" in loaded and "torch_dcp.sim.simulate" in loaded
    assert not [m for m in loaded if m.startswith("torch_dcp.benchmarks")]
    assert not [m for m in loaded if m.split(".")[0] == "matplotlib"]
    assert "torch_dcp.integrations" in loaded  # the package's own __init__, importing no framework
    assert not [m for m in loaded if m.split(".")[0] in ("torchtitan", "transformers")
                or m in ("torch_dcp.integrations.torchtitan", "torch_dcp.integrations.hf")]


def test_planning_imports_no_compiler_or_kernel_modules():
    """``import torch_dcp`` and planning (what a planning worker or a CLI does) import neither
    ``torch._dynamo`` (through FlexAttention or a ``torch.compile`` hint) nor Triton nor the flex
    kernel: they cost over a second per process, paid by every planning worker at its start."""
    code = (
        "import json, sys\n"
        "import torch_dcp\n"
        "from torch_dcp.data import plan_worker\n"
        "b = torch_dcp.BatchSpec([100, 50, 30], torch_dcp.Causal(), n_heads=4, n_kv_heads=2, head_dim=16)\n"
        "torch_dcp.plan(b, 4, planner='dcp', block_size=16).validate()\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT.parent)
    loaded = set(json.loads(res.stdout.strip().splitlines()[-1]))
    assert "torch_dcp.executor.kernels" in loaded and "torch_dcp.context" in loaded
    heavy = {"torch._dynamo", "triton", "torch_dcp.executor.kernels.flex", "torch_dcp.executor.triton_merge"}
    assert not heavy & loaded, sorted(heavy & loaded)


def _import_graph(folder: Path) -> dict[str, set[str]]:
    """module -> the modules of ``folder`` it imports by name (module-level and function-level
    imports alike; ``from package import submodule`` counts as the submodule). The parent
    packages Python runs before a submodule are not counted: only the imports written."""
    modules = {_module_name(p): p for p in sorted(folder.rglob("*.py"))}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for mod, names in _imports(path):
            subs = {f"{mod}.{a}" for a in names} & modules.keys()
            targets |= subs or ({mod} & modules.keys())
        graph[name] = targets - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (``[a, b, ..., a]``), or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_executor_modules_import_no_circle_and_no_kernel_imports_the_registry():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    graph = _import_graph(ROOT / "executor")
    registry = "torch_dcp.executor.kernels"
    kernels = sorted(m for m in graph if m.startswith(registry + "."))
    assert {f"{registry}.{k}" for k in ("base", "sdpa", "flex", "varlen", "flash_attn")} <= set(kernels)
    assert f"{registry}.flex" in graph[registry] and f"{registry}.varlen" in graph[f"{registry}.flash_attn"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    assert not [m for m in kernels if registry in graph[m]]
    assert "torch_dcp.executor.make" not in graph["torch_dcp.executor.executor"]
