"""What every exercise shares: the verdict a checker gives, the stub a learner has
not filled in yet, and the registry of exercises, each with its reference solution
and its catalogue of wrong solutions.

Used by every chapter's exercises (chapter 01 introduces them). A chapter module
declares an exercise by decorating its *judge*::

    @exercise("ring_reduce_scatter", chapter=1, reference=ring_reduce_scatter,
              measures="values; ops, peers and bytes of every send")
    def check_ring_reduce_scatter(solution, cluster=None):
        ...                 # raise ExerciseFailed(...) or return what was verified

and each mistake learners really make by decorating a wrong solution::

    @mistake("ring_reduce_scatter", expect="a direct exchange")
    def sends_each_chunk_to_its_owner(output, input): ...

The decorated checker is what a notebook calls. It reports a stub (a body that only
raises ``NotImplementedError``) as *not attempted yet* instead of failing, and when
the test command sets ``DTLAB_SUBSTITUTE_SOLUTIONS=1`` it runs the reference in the
stub's place, so every checker still runs end to end.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "SUBSTITUTE_ENV",
    "ExerciseFailed",
    "NotAttempted",
    "Mistake",
    "Exercise",
    "Report",
    "REGISTRY",
    "exercise",
    "mistake",
    "is_stub",
    "substituting",
    "attempt",
]

SUBSTITUTE_ENV = "DTLAB_SUBSTITUTE_SOLUTIONS"
"""When set (to anything but ``0``/``false``/``no``), a stub is replaced by the
reference solution: the notebooks' test command sets it for nbval."""


class ExerciseFailed(AssertionError):
    """A checker's verdict: what is wrong, measured from what the ranks did, and a
    hint at the fix."""


class NotAttempted(NotImplementedError):
    """The exercise's function is still a stub (``raise NotImplementedError``)."""


def substituting() -> bool:
    """Whether stubs are replaced by the reference (the test command's switch)."""
    return os.environ.get(SUBSTITUTE_ENV, "").lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Mistake:
    """A wrong solution learners really write, and a fragment of the message the
    checker must give it (the test proves the checker rejects it with that)."""

    solution: Callable
    expect: str

    @property
    def name(self) -> str:
        return self.solution.__name__

    @property
    def why(self) -> str:
        """What is wrong with it, in words (its docstring)."""
        return inspect.getdoc(self.solution) or ""


@dataclass
class Exercise:
    """One exercise: its checker, its reference, what the checker measures, and the
    wrong solutions it is proven to reject."""

    name: str
    chapter: int
    measures: str
    reference: Callable
    judge: Callable
    local: bool = False
    checker: Callable | None = None
    mistakes: list[Mistake] = field(default_factory=list)


PASSED, SUBSTITUTED, NOT_YET = "passed", "reference substituted", "not attempted yet"


@dataclass(frozen=True)
class Report:
    """What a checker found: ``status`` is ``passed``, ``not attempted yet`` or
    ``reference substituted``; ``lines`` say what was verified."""

    name: str
    status: str
    lines: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def attempted(self) -> bool:
        return self.status != NOT_YET

    def __str__(self) -> str:
        if self.status == NOT_YET:
            return (
                f"… {self.name}: not attempted yet. Write the function, then run "
                f"this cell again (dtlab.exercises.solution({self.name!r}) shows one "
                "solution)."
            )
        mark = "✓" if self.status == PASSED else "✓ (reference substituted)"
        return "\n".join(
            [f"{mark} {self.name}", *(f"  ✓ {line}" for line in self.lines)]
        )


REGISTRY: dict[str, Exercise] = {}
"""Every exercise by name, in the order the chapters declare them."""


def exercise(
    name: str, *, chapter: int, reference: Callable, measures: str, local=False
):
    """Declare the decorated judge as the checker of exercise ``name``.

    ``judge(solution, cluster=None, **options)`` raises :class:`ExerciseFailed` or
    returns the lines of what it verified. The returned checker handles stubs and
    substitution, prints its :class:`Report` and returns it. ``local``: the
    exercise runs in this process (a pure function); its checker ignores
    ``cluster``.
    """
    if name in REGISTRY:
        raise ValueError(f"exercise {name!r} is declared twice")

    def declare(judge: Callable) -> Callable:
        ex = Exercise(name, chapter, measures, reference, judge, local)

        @functools.wraps(judge)
        def checker(solution, cluster=None, **options) -> Report:
            report = _run(ex, solution, cluster, options)
            print(report)
            return report

        checker.exercise = ex
        ex.checker = checker
        REGISTRY[name] = ex
        return checker

    return declare


def mistake(name: str, expect: str):
    """Add the decorated wrong solution to exercise ``name``'s catalogue: its
    checker must reject it with a message containing ``expect``."""

    def add(solution: Callable) -> Callable:
        if name not in REGISTRY:
            raise ValueError(f"no exercise {name!r}: declare it before its mistakes")
        REGISTRY[name].mistakes.append(Mistake(solution, expect))
        return solution

    return add


def _run(ex: Exercise, solution, cluster, options) -> Report:
    if is_stub(solution):
        if not substituting():
            return Report(ex.name, NOT_YET)
        return Report(
            ex.name, SUBSTITUTED, tuple(_judge(ex, ex.reference, cluster, options))
        )
    try:
        lines = _judge(ex, solution, cluster, options)
    except NotImplementedError:  # a stub the source did not show (a %%px cell)
        if not substituting():
            return Report(ex.name, NOT_YET)
        return Report(
            ex.name, SUBSTITUTED, tuple(_judge(ex, ex.reference, cluster, options))
        )
    return Report(ex.name, PASSED, tuple(lines))


def _judge(ex: Exercise, solution, cluster, options) -> list[str]:
    return list(ex.judge(solution, cluster, **options) or ())


def attempt(solution: Callable, *args, **kwargs):
    """Call the learner's ``solution`` in this process: an error it raises becomes an
    :class:`ExerciseFailed` that names it (``NotImplementedError`` stays: not
    attempted yet)."""
    try:
        return solution(*args, **kwargs)
    except (ExerciseFailed, NotImplementedError):
        raise
    except Exception as exc:  # noqa: BLE001 - the learner's error, reported as such
        raise ExerciseFailed(
            f"your function raised {type(exc).__name__}: {exc}"
        ) from exc


# ---- is it a stub? -------------------------------------------------------------------
def is_stub(obj) -> bool:
    """True for a function whose body (after its docstring, ``pass`` or ``...``) is
    only ``raise NotImplementedError`` (or :class:`NotAttempted`), and for a class
    whose own methods are all such stubs. Anything whose source cannot be read is
    not a stub here (the checker then finds out when it runs)."""
    if isinstance(obj, type):
        methods = [
            getattr(v, "__func__", v)
            for v in vars(obj).values()
            if inspect.isfunction(getattr(v, "__func__", v))
        ]
        return bool(methods) and all(is_stub(m) for m in methods)
    fn = getattr(obj, "__func__", obj)
    if not inspect.isfunction(fn):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    body = [s for s in node.body if not _is_filler(s)]
    return len(body) == 1 and _raises_not_implemented(body[0])


def _is_filler(stmt) -> bool:
    if isinstance(stmt, ast.Pass):
        return True
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)


def _raises_not_implemented(stmt) -> bool:
    if not isinstance(stmt, ast.Raise) or stmt.exc is None:
        return False
    exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
    name = exc.attr if isinstance(exc, ast.Attribute) else getattr(exc, "id", "")
    return name in ("NotImplementedError", "NotAttempted")
