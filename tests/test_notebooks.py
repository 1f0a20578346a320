"""The chapters as files: committed clean, all listed in the index, and every one
that starts a cluster also stops it."""

import json
import pathlib
import re

import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _cells(path):
    return json.loads(path.read_text())["cells"]


@pytest.mark.parametrize("path", [*CHAPTERS, NOTEBOOKS / "index.ipynb"], ids=str)
def test_committed_without_outputs(path):
    for cell in _cells(path):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, path.name


def test_the_index_lists_every_chapter_and_only_real_ones():
    text = "".join("".join(c["source"]) for c in _cells(NOTEBOOKS / "index.ipynb"))
    linked = set(re.findall(r"\]\(([0-9]{2}_[a-z0-9_]+\.ipynb)\)", text))
    assert linked == {p.name for p in CHAPTERS}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapters_that_start_a_cluster_stop_it_and_bound_their_waits(path):
    code = "\n".join(
        "".join(c["source"]) for c in _cells(path) if c["cell_type"] == "code"
    )
    if "start(" not in code:
        return
    last = "".join(
        next(c for c in reversed(_cells(path)) if c["cell_type"] == "code")["source"]
    )
    assert "stop()" in last, f"{path.name}: the last code cell must stop the cluster"
    # blocking ipyparallel calls swallow interrupts (DESIGN.md): none in chapters
    assert ".apply_sync(" not in code and ".get()" not in code, path.name
