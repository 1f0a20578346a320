"""The library's house rules, read from the source (no import needed):

- no import cycle between dtlab's modules (a package's ``__init__`` importing its own
  children is not a cycle);
- the core (everything but ``dtlab/lab/`` and the command line) never imports the
  notebook layer or its packages (ipyparallel, ipywidgets, plotly, anywidget,
  IPython): it must run under torchrun on a machine without them;
- no private name (``_x``) is imported from another module, in the library or in the
  tests: they test through the public API;
- no module of ``dtlab/`` is longer than 500 lines (one concept per file);
- the public names other code and the notebooks rely on still import.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAB_PACKAGES = ("ipyparallel", "ipywidgets", "plotly", "anywidget", "IPython")
MAX_LINES = 500


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted((ROOT / "dtlab").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path):
    """``(module, imported name or None)`` for every import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                yield module, alias.name


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        for module, what in _imports(name, path):
            target = f"{module}.{what}" if f"{module}.{what}" in MODULES else module
            if target in MODULES and target != name:
                edges.setdefault(name, set()).add(target)
    return edges


def _related(a: str, b: str) -> bool:
    return a.startswith(b + ".") or b.startswith(a + ".")


def test_no_import_cycle():
    edges = _edges()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if _related(node, nxt):
                continue  # a package and its own children
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for module in MODULES:
        if module not in state:
            visit(module, [])
    assert not cycles, f"import cycles: {cycles}"


def test_the_core_never_imports_the_notebook_layer():
    bad = []
    for name, path in MODULES.items():
        if name.startswith("dtlab.lab") or name == "dtlab.cli":
            continue
        for module, _ in _imports(name, path):
            if module.startswith("dtlab.lab") or module.split(".")[0] in LAB_PACKAGES:
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, bad


def test_no_private_name_is_imported_across_modules():
    files = {name: path for name, path in MODULES.items()}
    for path in sorted((ROOT / "tests").glob("*.py")):
        files[f"tests.{path.stem}"] = path
    bad = []
    for name, path in files.items():
        for module, what in _imports(name, path):
            if not module.startswith("dtlab") or what is None:
                continue
            if what.startswith("_") and not what.startswith("__"):
                bad.append(f"{path.relative_to(ROOT)}: {what} from {module}")
    assert not bad, bad


def test_no_module_is_longer_than_500_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in MODULES.values()
        if (n := path.read_text(encoding="utf-8").count("\n")) > MAX_LINES
    }
    assert not long, long


@pytest.mark.parametrize(
    "module, names",
    [
        ("dtlab.zero", ["ShardedOptimizer", "FullyShardedDataParallel", "STAGES"]),
        ("dtlab.ddp", ["DistributedDataParallel", "DataParallel", "Bucket", "MB"]),
        (
            "dtlab.pipeline",
            ["one_f_one_b", "gpipe", "zb_h1", "Pipeline", "build_stages", "simulate"],
        ),
        (
            "dtlab.tensor_parallel",
            ["ColumnParallelLinear", "RowParallelLinear", "copy_to_tp", "TPRandom"],
        ),
        ("dtlab.train", ["TrainConfig", "Trainer", "train", "default_device"]),
        ("dtlab.parallelize", ["parallelize", "Parallelized"]),
        ("dtlab.config", ["TrainConfig", "check_composition", "check_strategy"]),
        ("dtlab.estimate", ["layout_memory", "layout_traffic", "plan", "wire_bytes"]),
        ("dtlab.memory", ["MemoryTracker", "SavedBytes", "count_bytes"]),
        ("dtlab.events", ["Kind", "Span", "STRATEGIES", "PRECISIONS", "SCHEDULES"]),
    ],
)
def test_public_contract_names_still_import(module, names):
    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module} lost {missing}"
