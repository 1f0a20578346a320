"""The course as a learner's map: what each chapter asks of the learner, and how long.

:func:`chapter_map` reads the committed notebooks (no kernel): each chapter's core
prose and its optional sections (a markdown cell with metadata
``{"dtlab": {"optional": true}}`` opens one; it runs to the next level-1/2 heading
without the flag), the exercises it checks and the predictions it asks. From them
:func:`minutes` prices a chapter by reading-speed arithmetic plus the time its cells
take to run; :func:`index_table` writes the index's table, which
``python -m dtlab.lab.lessons.course notebooks`` puts into ``notebooks/index.ipynb``
(``tests/test_learner_path.py`` keeps the committed index equal to it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import sys

__all__ = [
    "DIFFICULTY",
    "RUN_SECONDS",
    "Chapter",
    "chapter_map",
    "index_table",
    "minutes",
    "write_index",
]

# Reading speed for technical prose with formulas: well below the ~240 words a
# minute of plain text (Brysbaert 2019's meta-analysis of silent reading).
WORDS_PER_MINUTE = 150
# What an exercise costs a learner who writes it (reading the spec, writing,
# one failed check and its fix), by difficulty; a prediction is a minute or two.
EXERCISE_MINUTES = {"warm-up": 8, "core": 15, "stretch": 25}
PREDICTION_MINUTES = 2

DIFFICULTY = {
    "zero2_bytes": "warm-up",
    "min_gpus": "core",
    "ring_reduce_scatter": "core",
    "ring_all_reduce": "core",
    "grad_hooks": "warm-up",
    "overlapped_hooks": "core",
    "bucketed_hooks": "stretch",
    "no_sync_accumulation": "core",
    "torch_ddp": "warm-up",
    "zero1_step": "core",
    "zero2_hooks": "core",
    "fsdp_unit": "stretch",
    "fully_shard": "core",
    "column_parallel": "core",
    "row_parallel": "core",
    "sequence_parallel": "stretch",
    "one_f_one_b": "stretch",
    "pipeline_executor": "stretch",
    "loss_scaler": "core",
    "underflow": "warm-up",
    "autocast_step": "core",
    "layout_defence": "core",
    "rank_order": "warm-up",
    "checkpointing": "core",
    "accumulation": "warm-up",
    "step_time": "core",
    "zero_states": "core",
    "ddp_wire_bytes": "warm-up",
    "drill": "stretch",
    "merge_attention": "stretch",
    "moe_dispatch": "core",
    "all_to_all_splits": "core",
    "delayed_scaling_update": "core",
    "split_backward": "stretch",
    "assign_owners": "warm-up",
    "diloco_sync": "core",
    "load_plan": "core",
}
"""Every exercise's difficulty: warm-up (one formula or one wrapper), core (the
mechanism itself), stretch (a mechanism with a subtle case: overlap, a schedule,
a numerically careful merge)."""

# Seconds each chapter's cells take to run on two CPU cores, measured under nbval
# with the references substituted (`make test`'s notebook run, one chapter at a
# time, 2026-12-03, rounded up to 5 s).
RUN_SECONDS = {
    "00": 10,
    "01": 40,
    "02": 105,
    "03": 60,
    "04": 70,
    "05": 80,
    "06": 75,
    "07": 65,
    "08": 55,
    "09": 30,
    "10": 25,
    "11": 40,
    "12": 40,
    "13": 35,
}


@dataclasses.dataclass(frozen=True)
class Chapter:
    """One chapter as the learner meets it."""

    number: str
    path: pathlib.Path
    title: str
    core_words: int
    optional_words: int
    optional_sections: tuple[str, ...]
    exercises: tuple[str, ...]
    predictions: tuple[str, ...]


def words(markdown: str) -> int:
    """Words of prose: formulas ($...$) and fenced code are not read as prose."""
    text = re.sub(r"\$\$.*?\$\$|\$[^$]*\$", " ", markdown, flags=re.S)
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    return len(re.findall(r"[A-Za-z][A-Za-z'’-]*", text))


def _heading(src: str) -> str:
    first = src.strip().splitlines()[0] if src.strip() else ""
    return re.sub(r"^#+\s*", "", first).strip()


def read_chapter(path: pathlib.Path) -> Chapter:
    cells = json.loads(path.read_text())["cells"]
    optional, core, extra, sections = False, 0, 0, []
    exercises, predictions = [], []
    title = ""
    for cell in cells:
        src = "".join(cell["source"])
        meta = (cell.get("metadata") or {}).get("dtlab") or {}
        if cell["cell_type"] == "markdown":
            if not title and src.lstrip().startswith("# "):
                title = re.sub(r"^\d\d\s*·\s*", "", _heading(src))
            if meta.get("optional"):
                optional = True
                sections.append(re.sub(r"^Optional:\s*", "", _heading(src)))
            elif re.match(r"#{1,2} ", src.lstrip()):
                optional = False
            if optional:
                extra += words(src)
            else:
                core += words(src)
            continue
        for name in re.findall(r"\bcheck_(\w+)\(", src):
            if name not in exercises:
                exercises.append(name)
        for key in re.findall(r"\bpredict\(\s*[\"'](\w+)[\"']", src):
            if key not in predictions:
                predictions.append(key)
    return Chapter(
        path.name[:2],
        path,
        title,
        core,
        extra,
        tuple(sections),
        tuple(exercises),
        tuple(predictions),
    )


def chapter_map(notebooks="notebooks") -> list[Chapter]:
    """Every numbered chapter in ``notebooks``, in order."""
    paths = sorted(pathlib.Path(notebooks).glob("[0-9][0-9]_*.ipynb"))
    return [read_chapter(p) for p in paths]


def minutes(chapter: Chapter) -> tuple[int, int]:
    """``(core, optional)`` minutes: prose at :data:`WORDS_PER_MINUTE`, each
    exercise by its difficulty, each prediction, and the chapter's run time; the
    optional sections' prose on its own. Rounded up to 5 minutes."""
    core = chapter.core_words / WORDS_PER_MINUTE
    core += sum(EXERCISE_MINUTES[DIFFICULTY[e]] for e in chapter.exercises)
    core += PREDICTION_MINUTES * len(chapter.predictions)
    core += RUN_SECONDS.get(chapter.number, 60) / 60
    optional = chapter.optional_words / WORDS_PER_MINUTE
    return 5 * math.ceil(core / 5), 5 * math.ceil(optional / 5)


def index_table(chapters: list[Chapter]) -> str:
    """The index's map: one row per chapter (minutes core + optional, the
    exercises with their difficulty, the predictions), then each chapter's optional
    sections."""
    rows = [
        "| # | chapter | minutes (core + optional) | exercises | predictions |",
        "|---|---------|---------------------------|-----------|-------------|",
    ]
    for c in chapters:
        core, extra = minutes(c)
        ex = ", ".join(f"`{e}` ({DIFFICULTY[e]})" for e in c.exercises) or "—"
        more = f" + {extra}" if extra else ""
        rows.append(
            f"| {c.number} | [{c.title}]({c.path.name}) | {core}{more} | {ex} "
            f"| {len(c.predictions)} |"
        )
    total = sum(minutes(c)[0] for c in chapters)
    extra = sum(minutes(c)[1] for c in chapters)
    rows.append(f"| | **all chapters** | **{total} + {extra}** | | |")
    lines = ["\n".join(rows), "", "**Optional sections**, for a second pass:", ""]
    for c in chapters:
        if c.optional_sections:
            lines.append(f"- {c.number}: " + "; ".join(c.optional_sections))
    return "\n".join(lines)


BEGIN, END = "<!-- course map: begin -->", "<!-- course map: end -->"


def write_index(notebooks="notebooks") -> bool:
    """Rewrite the map between the markers in ``notebooks/index.ipynb``; True when
    it changed."""
    path = pathlib.Path(notebooks) / "index.ipynb"
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if BEGIN in src and END in src:
            head, rest = src.split(BEGIN, 1)
            _, tail = rest.split(END, 1)
            table = index_table(chapter_map(notebooks))
            new = f"{head}{BEGIN}\n{table}\n{END}{tail}"
            if new == src:
                return False
            lines = new.split("\n")
            cell["source"] = [line + "\n" for line in lines[:-1]] + [lines[-1]]
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
            return True
    raise ValueError(f"{path} has no {BEGIN} ... {END} markers")


if __name__ == "__main__":
    changed = write_index(sys.argv[1] if len(sys.argv) > 1 else "notebooks")
    print("index rewritten" if changed else "index already up to date")
