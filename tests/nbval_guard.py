"""A pytest plugin for running the chapters under nbval without its two hazards.

1. A cell that hangs inside a blocking ipyparallel call can swallow the interrupt
   nbval sends at its cell timeout, finish later without an error, and be reported
   as PASSED. This plugin fails any cell during which nbval recorded a timeout.
2. nbval stops a notebook's kernel with SIGKILL, so the kernel's own clean-up (which
   stops its ipyparallel cluster) never runs and engines outlive the test. Every
   process started under this session carries ``DTLAB_TEST_SESSION`` in its
   environment; after each notebook and at the end, every such process that is
   not pytest itself is killed.

3. A chapter's claims belong to the suite, not to the learner's page: every
   assertion the tests need about a chapter's live numbers lives in
   ``tests/claims/chNN.py`` and runs in the chapter's own kernel, as one more cell
   inserted just before the chapter's last code cell (the one that stops its
   cluster), so it reads every variable the chapter made while its engines are
   still up. The page keeps only the few checks a learner wants to read.
4. No chapter writes into the learner's home: ``DTLAB_HOME`` (where the
   prediction log lives) points into a temporary folder for the session.

Use: ``pytest --nbval-lax -p tests.nbval_guard notebooks``.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import uuid
from collections import defaultdict

import nbformat
import psutil
import pytest

TAG = "DTLAB_TEST_SESSION"
CLAIMS = pathlib.Path(__file__).resolve().parent / "claims"


def pytest_configure(config):
    # inherited by kernels, controllers and engines (a caller may choose the tag);
    # under pytest-xdist each worker has its own, so one worker's clean-up never
    # kills the other worker (psutil reads a process's environment as it started)
    if getattr(config, "workerinput", None) is not None:  # an xdist worker
        os.environ[TAG] = uuid.uuid4().hex
    else:
        os.environ.setdefault(TAG, uuid.uuid4().hex)
    if "DTLAB_HOME" not in os.environ:
        os.environ["DTLAB_HOME"] = tempfile.mkdtemp(prefix="dtlab-home-")


def claims_file(notebook: pathlib.Path) -> pathlib.Path:
    """``tests/claims/ch03.py`` for ``notebooks/03_zero.ipynb``."""
    return CLAIMS / f"ch{notebook.name[:2]}.py"


def claims_source(path: pathlib.Path) -> str:
    """The cell that runs a claims file in the chapter's kernel: compiled under its
    own path, so a failing assertion's traceback names the file and line."""
    return (
        f"exec(compile(open({str(path)!r}).read(), {str(path)!r}, 'exec'))"
        "  # tests/claims: the suite's checks, run in the chapter's kernel"
    )


def _insert_claims(items):
    """Put each chapter's claims cell just before its last code cell."""
    from nbval.plugin import IPyNbCell

    last = {}
    for i, item in enumerate(items):
        if isinstance(item, IPyNbCell):
            last[item.parent] = i
    for parent, i in sorted(last.items(), key=lambda kv: -kv[1]):
        path = claims_file(pathlib.Path(str(parent.fspath)))
        if not path.exists():
            continue
        cell = nbformat.v4.new_code_cell(claims_source(path))
        options = defaultdict(bool, check=False)
        claim = IPyNbCell.from_parent(
            parent, name=f"claims {path.name}", cell_num=-1, cell=cell, options=options
        )
        items.insert(i, claim)


def tagged_processes(tag: str | None = None) -> list[psutil.Process]:
    """Processes (other than this one and its ancestors) started under ``tag``."""
    tag = tag or os.environ.get(TAG)
    if not tag:
        return []
    me = psutil.Process()
    skip = {me.pid} | {p.pid for p in me.parents()}
    found = []
    for proc in psutil.process_iter():
        if proc.pid in skip:
            continue
        try:
            if proc.environ().get(TAG) == tag:
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def reap(tag: str | None = None) -> list[int]:
    """Kill every process of this session; return their pids."""
    procs = tagged_processes(tag)
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    return [p.pid for p in procs]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    parent = getattr(item, "parent", None)
    timed_out_before = getattr(parent, "timed_out", False)
    outcome = yield
    if (
        not timed_out_before
        and getattr(parent, "timed_out", False)
        and outcome.excinfo is None
    ):
        outcome.force_exception(
            pytest.fail.Exception(
                "the cell passed its --nbval-cell-timeout and was interrupted; it "
                "only finished afterwards (a blocking call swallowed the interrupt)",
                pytrace=False,
            )
        )


def pytest_collection_modifyitems(items):
    _insert_claims(items)
    # remember the last cell of each notebook, to reap right after it
    last = {}
    for item in items:
        last[getattr(item, "parent", None)] = item
    for item in last.values():
        item._dtlab_last_cell = True


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    # after nbval has stopped the notebook's kernel: nothing it started may remain
    if getattr(item, "_dtlab_last_cell", False):
        reap()


def pytest_unconfigure(config):
    if getattr(config, "workerinput", None) is None and config.getoption(
        "numprocesses", None
    ):
        return  # xdist's controller: its workers (which carry its tag) reaped theirs
    reap()
