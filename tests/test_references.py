"""Docstrings and pages that cannot lie: every cross-reference a docstring in
``dtlab/`` makes (``:mod:``, ``:class:``, ``:func:``, ``:meth:``, ``:data:``,
``:attr:``, ``:exc:``) names something that exists, and every ``show(...)`` a chapter
makes shows code that exists, starting, stopping and marked where the page says.

Resolution follows Sphinx's habits: ``~`` only shortens the displayed name; a name
starting with ``.`` is looked up from the referring module and its package; an
unqualified name is looked up in the referring module, then as an absolute path.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import pathlib
import re
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
REF = re.compile(r":(mod|class|func|meth|data|attr|exc):`([^`]+)`")


def _modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "dtlab").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


KINDS = {
    "mod": lambda o: isinstance(o, types.ModuleType),
    "class": lambda o: isinstance(o, type),
    "exc": lambda o: isinstance(o, type) and issubclass(o, BaseException),
    "func": lambda o: callable(o) and not isinstance(o, type),
    "meth": lambda o: callable(o) or isinstance(o, property | None.__class__),
    "attr": lambda o: True,
    "data": lambda o: True,
}
"""What each role must name (a method may be a property; an instance attribute
resolves to None)."""


def _interpretations(dotted: str):
    """Every object ``dotted`` can name: for each importable module prefix, the
    attributes after it (a package's attribute may shadow its submodule of the same
    name, as ``dtlab.moe.expert_parallel`` does)."""
    parts = dotted.split(".")
    found = False
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif _instance_attribute(obj, attr):
                obj = None  # an attribute of the instances: nothing to look into
            else:
                break
        else:
            found = True
            yield obj
        if cut < len(parts):
            break  # a shorter prefix is only a package above the module found
    if not found:
        raise LookupError(f"nothing named {dotted!r}")


def _resolve_absolute(dotted: str, kind: str = "attr"):
    """The object ``dotted`` names in the role ``kind``, or raise LookupError."""
    objs = list(_interpretations(dotted))
    for obj in objs:
        if KINDS[kind](obj):
            return obj
    raise LookupError(f"{dotted!r} names a {type(objs[0]).__name__}, not a {kind}")


def _instance_attribute(cls, attr: str) -> bool:
    """Whether instances of ``cls`` get ``attr``: assigned as ``self.attr`` in its
    (or a base's) source, or annotated."""
    if not isinstance(cls, type):
        return False
    for klass in cls.__mro__:
        if attr in getattr(klass, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{attr}\b\s*(:[^=]*)?=", source):
            return True
    return False


def _resolve(target: str, module: str, scope: str = "", kind: str = "attr"):
    target = re.sub(r"\s+", "", target).lstrip("~").removesuffix("()")
    if "<" in target:  # "text <target>"
        target = target[target.index("<") + 1 : target.index(">")]
    candidates = []
    while scope:  # a method or attribute of the class the docstring is in
        candidates.append(f"{module}.{scope}.{target}")
        scope = scope.rpartition(".")[0]
    if target.startswith("."):
        pkg = module.rsplit(".", 1)[0] if not _is_package(module) else module
        stripped = target.lstrip(".")
        candidates += [f"{module}.{stripped}", f"{pkg}.{stripped}"]
        up = target[: len(target) - len(stripped)]
        if len(up) > 1:  # ..name: one package up per extra dot
            base = pkg.rsplit(".", len(up) - 1)[0]
            candidates.append(f"{base}.{stripped}")
    else:
        candidates += [f"{module}.{target}", target]
        pkg = module.rsplit(".", 1)[0]
        candidates.append(f"{pkg}.{target}")
    errors = []
    for c in candidates:
        try:
            return _resolve_absolute(c, kind)
        except LookupError as e:
            errors.append(str(e))
    raise LookupError("; ".join(errors))


def _is_package(module: str) -> bool:
    return (ROOT / module.replace(".", "/") / "__init__.py").exists()


def _references():
    """``(module, enclosing class path or "", kind, target)`` of every reference."""

    def walk(node, module, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.ClassDef):
                inner = f"{scope}.{child.name}" if scope else child.name
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(child, clean=False) or ""
                for kind, target in REF.findall(doc):
                    yield module, inner, kind, target
            elif isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant):
                if isinstance(child.value.value, str):  # attribute docstrings
                    for kind, target in REF.findall(child.value.value):
                        yield module, scope, kind, target
            yield from walk(child, module, inner)

    for module in _modules():
        mod = importlib.import_module(module)
        tree = ast.parse(pathlib.Path(mod.__file__).read_text(encoding="utf-8"))
        for kind, target in REF.findall(ast.get_docstring(tree, clean=False) or ""):
            yield module, "", kind, target
        yield from walk(tree, module, "")


def test_every_docstring_reference_resolves():
    broken, count = [], 0
    for module, scope, kind, target in sorted(set(_references())):
        count += 1
        if target.split(".")[0] in ("torch", "ipyparallel", "IPython", "plotly"):
            if target.startswith(("torch", "ipyparallel", "IPython", "plotly")):
                try:
                    _resolve_absolute(target.lstrip("~"), kind)
                except LookupError as e:
                    broken.append(f"{module}: :{kind}:`{target}`: {e}")
                continue
        try:
            _resolve(target, module, scope, kind)
        except LookupError as e:
            broken.append(f"{module}: :{kind}:`{target}`: {e}")
    assert count > 500, f"only {count} references found: is the pattern right?"
    assert not broken, f"{len(broken)} of {count} references name nothing:\n" + (
        "\n".join(broken)
    )


# ---- the chapters' show(...) ------------------------------------------------------
def _code_cells(path: pathlib.Path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        if src.lstrip().startswith("%%"):
            continue  # a cell magic: its body runs on the engines
        lines = [
            "" if line.lstrip().startswith(("%", "!")) else line
            for line in src.splitlines()
        ]
        yield "\n".join(lines)


def _show_calls(path: pathlib.Path):
    """``(namespace of the chapter's imports, [show call nodes])``."""
    namespace: dict = {}
    calls = []
    for src in _code_cells(path):
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "show"
                and node.args
            ):
                calls.append(node)
    return namespace, calls


NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_shown_mechanism_exists_and_is_marked_where_the_page_says(path):
    from dtlab.lab.source import source_lines

    namespace, calls = _show_calls(path)
    problems = []
    for call in calls:
        what = ast.unparse(call)
        try:
            obj = eval(compile(ast.Expression(call.args[0]), "show", "eval"), namespace)
        except NameError:
            continue  # something the chapter itself defined: nbval runs it
        except AttributeError as e:
            problems.append(f"{what}: {e}")
            continue
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        try:
            _, lines = source_lines(
                obj, start=kwargs.get("start"), stop=kwargs.get("stop")
            )
        except ValueError as e:
            problems.append(f"{what}: {e}")
            continue
        for m in kwargs.get("mark", ()):
            if not any(m in line for line in lines):
                problems.append(f"{what}: the mark {m!r} is on no shown line")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "kind, target, module, right",
    [
        ("func", "dtlab.pipeline.simulate", "dtlab", True),
        ("mod", "dtlab.pipeline.simulate", "dtlab", False),  # a function
        ("mod", "dtlab.pipeline.simulator", "dtlab", True),
        ("func", "dtlab.moe.expert_parallel", "dtlab", True),  # shadows its module
        ("mod", "~dtlab.moe.expert_parallel", "dtlab", True),
        ("class", "dtlab.tensor_parallel.TensorParallelGPT", "dtlab", False),
        ("func", "no_such_thing", "dtlab.comm", False),
        ("meth", "Reducer.finish", "dtlab.zero.reduce", True),
        ("meth", "Reducer.finnish", "dtlab.zero.reduce", False),
        ("class", ".Reducer", "dtlab.zero.reduce", True),
    ],
)
def test_the_resolver_judges_both_ways(kind, target, module, right):
    try:
        _resolve(target, module, "", kind)
        found = True
    except LookupError:
        found = False
    assert found == right, (kind, target, module)
