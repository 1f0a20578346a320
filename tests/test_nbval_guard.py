"""The notebook harness itself: a cell that outlives nbval's timeout fails, and no
process the notebook started survives it."""

import os
import subprocess
import sys
import uuid

import nbformat

from tests.nbval_guard import TAG, tagged_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_cell_that_overruns_its_timeout_fails_and_leaves_no_process(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        # stands in for an ipyparallel engine: a child of the kernel that would
        # outlive it, since nbval stops kernels with SIGKILL (engines inherit the
        # kernel's environment and, like them, runs in a session of its own)
        nbformat.v4.new_code_cell(
            "import subprocess, sys\n"
            "child = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(600)'], start_new_session=True)\n"
            "print(child.pid)"
        ),
        # like a blocking ipyparallel call, this cell ignores nbval's interrupt at
        # 5 s, then finishes at 8 s, inside nbval's 5 s grace for output: nbval
        # alone reports it as passed
        nbformat.v4.new_code_cell(
            "import signal, time\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "time.sleep(8)"
        ),
        nbformat.v4.new_code_cell("print('after')"),
    ]
    path = tmp_path / "overrun.ipynb"
    nbformat.write(nb, path)
    tag = uuid.uuid4().hex
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env",
         "--nbval-cell-timeout=5", "-p", "tests.nbval_guard", "-p",
         "no:cacheprovider", str(path)],
        cwd=ROOT, env={**os.environ, TAG: tag}, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "1 failed" in out, out
    assert "Cell 1" in out and "swallowed the interrupt" in out, out
    assert tagged_processes(tag) == [], "a process outlived the notebook"
