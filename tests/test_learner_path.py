"""The learner's path, kept by the notebooks' own metadata (DESIGN.md, "The
learner's rhythm"): no answer revealed before its exercise's check, predictions
that name real questions, optional sections marked, a core path a learner can
finish in about 90 minutes with few visible checks, and an index whose map is the
chapters' own."""

import json
import pathlib
import re

import pytest

from dtlab.exercises import REGISTRY
from dtlab.lab.lessons import course
from dtlab.lab.predictions import questions

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CLAIMS = ROOT / "tests" / "claims"

# The budgets of the issue "The learner's path", enforced on each chapter already
# reshaped into the rhythm; the rest keep their structure checked.
MAX_CORE_WORDS, MAX_CONFIRMS, MIN_PREDICTIONS = 2500, 8, 2
RESHAPED = {f"{n:02d}" for n in range(14)}  # every chapter, 00 to 13
PREDICTING = {"01", "02", "03", "04", "05", "06", "07", "08", "09", "11", "12", "13"}


def cells_with_metadata(path: pathlib.Path):
    """``(index, cell, source, dtlab metadata)`` of every cell."""
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        meta = (cell.get("metadata") or {}).get("dtlab") or {}
        yield i, cell, "".join(cell["source"]), meta


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_no_answer_is_revealed_before_its_check(path):
    checked = {}
    for i, cell, src, meta in cells_with_metadata(path):
        if cell["cell_type"] != "code":
            continue
        for name in re.findall(r"\bcheck_(\w+)\(", src):
            checked.setdefault(name, i)
        reveals = meta.get("reveals")
        for name in [reveals] if isinstance(reveals, str) else reveals or []:
            assert name in checked, f"{path.name}: cell {i} reveals {name} unchecked"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_predictions_name_questions_of_their_own_chapter(path):
    known = questions()
    for key in course.read_chapter(path).predictions:
        assert key in known, f"{path.name}: predict({key!r}) asks no declared question"
        assert known[key].chapter == path.name[:2], (path.name, key)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_a_reshaped_chapter_fits_the_learners_budget(path):
    nn = path.name[:2]
    if nn not in RESHAPED:
        pytest.skip(f"chapter {nn} is not reshaped into the rhythm yet")
    chapter = course.read_chapter(path)
    confirms = sum(
        len(re.findall(r"\bconfirm\(", src))
        for _, cell, src, _ in cells_with_metadata(path)
        if cell["cell_type"] == "code"
    )
    assert chapter.core_words <= MAX_CORE_WORDS, f"{nn}: {chapter.core_words} words"
    assert confirms <= MAX_CONFIRMS, f"{nn}: {confirms} visible checks"
    if nn in PREDICTING:
        assert len(chapter.predictions) >= MIN_PREDICTIONS, nn


def test_every_exercise_has_a_difficulty_for_the_map():
    assert set(REGISTRY) <= set(course.DIFFICULTY), set(REGISTRY) - set(
        course.DIFFICULTY
    )
    assert set(course.DIFFICULTY.values()) <= set(course.EXERCISE_MINUTES)


def test_the_index_map_is_the_chapters_own():
    # `python -m dtlab.lab.lessons.course notebooks` rewrites it
    index = "".join(
        json.loads((NOTEBOOKS / "index.ipynb").read_text())["cells"][0]["source"]
    )
    table = course.index_table(course.chapter_map(NOTEBOOKS))
    assert f"{course.BEGIN}\n{table}\n{course.END}" in index


def test_every_claims_file_belongs_to_a_chapter():
    chapters = {p.name[:2] for p in CHAPTERS}
    for path in CLAIMS.glob("*.py"):
        assert re.fullmatch(r"ch\d\d\.py", path.name), path.name
        assert path.name[2:4] in chapters, path.name


def test_the_readme_gives_each_chapter_its_minutes():
    readme = (ROOT / "README.md").read_text()
    for chapter in course.chapter_map(NOTEBOOKS):
        core, extra = course.minutes(chapter)
        shown = f"{core} + {extra}" if extra else f"{core}"
        assert re.search(
            rf"^\| {chapter.number} \| [^|]+ \| {re.escape(shown)} \|", readme, re.M
        ), f"README: chapter {chapter.number} takes {shown} minutes"
