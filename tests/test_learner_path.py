"""The learner's path, kept by the notebooks' own metadata (DESIGN.md, "The
learner's rhythm"): no answer revealed before its exercise's check, predictions
that name real questions, optional sections marked, and a core path a learner can
finish in about 90 minutes, with few visible checks."""

import json
import pathlib
import re

import pytest

from dtlab.lab.predictions import questions

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CLAIMS = ROOT / "tests" / "claims"

# The budgets of the issue "The learner's path", enforced on each chapter already
# reshaped into the rhythm; the rest keep their structure checked.
MAX_CORE_WORDS, MAX_CONFIRMS, MIN_PREDICTIONS = 2500, 8, 2
RESHAPED: set[str] = set()
PREDICTING = {"01", "02", "03", "04", "05", "06", "07", "08", "09", "11"}


def words(markdown: str) -> int:
    """Words of prose: formulas ($...$) and code spans are not read as prose."""
    text = re.sub(r"\$\$.*?\$\$|\$[^$]*\$", " ", markdown, flags=re.S)
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    return len(re.findall(r"[A-Za-z][A-Za-z'’-]*", text))


def walk(path: pathlib.Path) -> dict:
    """One chapter as the learner meets it: core prose, visible checks, the
    predictions made, each check's and reveal's cell, the optional sections."""
    cells = json.loads(path.read_text())["cells"]
    optional = False
    found = {"words": 0, "confirms": 0, "predicts": [], "checks": {}, "reveals": []}
    found["optional"] = []
    for i, cell in enumerate(cells):
        src = "".join(cell["source"])
        meta = (cell.get("metadata") or {}).get("dtlab") or {}
        if cell["cell_type"] == "markdown":
            if meta.get("optional"):
                optional = True
                found["optional"].append(src.strip().splitlines()[0])
            elif re.match(r"#{1,2} ", src.lstrip()):
                optional = False
            if not optional:
                found["words"] += words(src)
            continue
        found["confirms"] += len(re.findall(r"\bconfirm\(", src))  # optional too
        found["predicts"] += re.findall(r"\bpredict\(\s*[\"'](\w+)[\"']", src)
        for name in re.findall(r"\bcheck_(\w+)\(", src):
            found["checks"].setdefault(name, i)
        reveals = meta.get("reveals")
        for name in [reveals] if isinstance(reveals, str) else reveals or []:
            found["reveals"].append((name, i))
    return found


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_no_answer_is_revealed_before_its_check(path):
    found = walk(path)
    for name, at in found["reveals"]:
        assert name in found["checks"], f"{path.name}: reveals {name}, never checked"
        assert found["checks"][name] < at, f"{path.name}: cell {at} reveals {name}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_predictions_name_questions_of_their_own_chapter(path):
    known = questions()
    for key in walk(path)["predicts"]:
        assert key in known, f"{path.name}: predict({key!r}) asks no declared question"
        assert known[key].chapter == path.name[:2], (path.name, key)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_a_reshaped_chapter_fits_the_learners_budget(path):
    nn = path.name[:2]
    if nn not in RESHAPED:
        pytest.skip(f"chapter {nn} is not reshaped into the rhythm yet")
    found = walk(path)
    assert found["words"] <= MAX_CORE_WORDS, f"{nn}: {found['words']} words of core"
    assert found["confirms"] <= MAX_CONFIRMS, f"{nn}: {found['confirms']} checks"
    if nn in PREDICTING:
        assert len(set(found["predicts"])) >= MIN_PREDICTIONS, nn


def test_every_claims_file_belongs_to_a_chapter():
    chapters = {p.name[:2] for p in CHAPTERS}
    for path in CLAIMS.glob("*.py"):
        assert re.fullmatch(r"ch\d\d\.py", path.name), path.name
        assert path.name[2:4] in chapters, path.name
