"""The notebook harness itself: a cell that outlives nbval's timeout fails, and no
engine survives the notebook."""

import os
import subprocess
import sys
import uuid

import nbformat
import pytest

from tests.nbval_guard import TAG, tagged_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.cluster


def test_a_cell_that_overruns_its_timeout_fails_and_leaves_no_engines(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from dtlab.lab import start\ncluster = start(world_size=2)"
        ),
        # a blocking ipyparallel call: nbval's interrupt at 20 s does not stop it,
        # and it finishes at 23 s, inside nbval's 5 s grace for output, so nbval
        # alone would report this cell as passed
        nbformat.v4.new_code_cell(
            "import time\ncluster.view.apply_sync(time.sleep, 23)\nprint('done')"
        ),
        nbformat.v4.new_code_cell("cluster.stop()"),
    ]
    path = tmp_path / "overrun.ipynb"
    nbformat.write(nb, path)
    tag = uuid.uuid4().hex
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env",
         "--nbval-cell-timeout=20", "-p", "tests.nbval_guard", "-p",
         "no:cacheprovider", str(path)],
        cwd=ROOT, env={**os.environ, TAG: tag}, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "1 failed" in out, out
    assert "Cell 1" in out and "swallowed the interrupt" in out, out
    assert tagged_processes(tag) == [], "engines outlived the notebook"
