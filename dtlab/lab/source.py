"""The mechanism on the page: a chapter shows the lines of dtlab's own code that do
the thing it teaches, read from the library at the moment the cell runs, so the page
can never drift from the code.

    from dtlab.lab.source import show
    from dtlab.ddp.reducer import DistributedDataParallel
    show(DistributedDataParallel._launch, mark=["all_reduce"])

Runs in the notebook's kernel.
"""

from __future__ import annotations

import html
import inspect
import textwrap

__all__ = ["source_lines", "show"]


def source_lines(obj, *, start: str | None = None, stop: str | None = None):
    """``(first line number, [lines])`` of ``obj``'s source (a function, method,
    class or module), dedented; ``start``/``stop``: keep from the first line that
    contains ``start`` to the first later one that contains ``stop`` (inclusive)."""
    lines, first = inspect.getsourcelines(obj)
    lines = textwrap.dedent("".join(lines)).splitlines()
    if start is not None:
        at = next((i for i, line in enumerate(lines) if start in line), None)
        if at is None:
            raise ValueError(f"{start!r} is not in the source of {obj!r}")
        lines, first = lines[at:], first + at
    if stop is not None:
        end = next((i for i, line in enumerate(lines) if stop in line), None)
        if end is None:
            raise ValueError(f"{stop!r} is not in the source of {obj!r}")
        lines = lines[: end + 1]
    return first, lines


def show(obj, *, start=None, stop=None, mark=(), max_lines: int = 60):
    """Display ``obj``'s source with line numbers and the file it comes from;
    lines containing any string of ``mark`` are highlighted (what the narration
    points at); a mark that is on no line is refused, so the page cannot point
    at code that has moved. Refuses more than ``max_lines`` lines: a page shows a
    mechanism, not a file. Returns the displayed text (for tests)."""
    from IPython.display import HTML, display

    first, lines = source_lines(obj, start=start, stop=stop)
    unmarked = [m for m in mark if not any(m in line for line in lines)]
    if unmarked:
        raise ValueError(
            f"{unmarked} mark no line of {getattr(obj, '__qualname__', obj)}: the "
            "narration points at code that is not there (the code moved or changed)"
        )
    if len(lines) > max_lines:
        raise ValueError(
            f"{len(lines)} lines of {getattr(obj, '__qualname__', obj)}: show at most "
            f"{max_lines} (narrow it with start=/stop=)"
        )
    where = inspect.getsourcefile(obj) or "?"
    where = where[where.rfind("dtlab/") :] if "dtlab/" in where else where
    rows, text = [], []
    for n, line in enumerate(lines, start=first):
        hot = any(m in line for m in mark)
        style = "background:#fff3bf;" if hot else ""
        rows.append(
            f'<div style="{style}"><span style="color:#999;display:inline-block;'
            f'width:3.5em">{n}</span>{html.escape(line) or "&nbsp;"}</div>'
        )
        text.append(f"{n:5d}{' >' if hot else '  '} {line}")
    head = f"<div style='color:#666;margin-bottom:4px'>{html.escape(where)}</div>"
    body = "".join(rows)
    display(HTML(f"{head}<pre style='font-size:12px;line-height:1.35'>{body}</pre>"))
    return "\n".join(text)
