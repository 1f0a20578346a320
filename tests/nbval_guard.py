"""A pytest plugin for running the chapters under nbval without its two hazards.

1. A cell that hangs inside a blocking ipyparallel call can swallow the interrupt
   nbval sends at its cell timeout, finish later without an error, and be reported
   as PASSED. This plugin fails any cell during which nbval recorded a timeout.
2. nbval stops a notebook's kernel with SIGKILL, so the kernel's own clean-up (which
   stops its ipyparallel cluster) never runs and engines outlive the test. Every
   process started under this session carries ``DTLAB_TEST_SESSION`` in its
   environment; after each notebook and at the end, every such process that is
   not pytest itself is killed.

Use: ``pytest --nbval-lax -p tests.nbval_guard notebooks``.
"""

from __future__ import annotations

import os
import uuid

import psutil
import pytest

TAG = "DTLAB_TEST_SESSION"


def pytest_configure(config):
    # inherited by kernels, controllers and engines (a caller may choose the tag)
    os.environ.setdefault(TAG, uuid.uuid4().hex)


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
    reap()
