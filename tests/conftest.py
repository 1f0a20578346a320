"""Shared test set-up: one torch thread, and no cluster left behind; the machine's
capabilities in the run's header (dtlab.capabilities)."""

import os
import tempfile

import pytest
import torch

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# the learner's prediction log (dtlab.lab.predictions) of chapters run by the tests
# (the browser test's kernels included) goes to a folder of the run's own
os.environ.setdefault("DTLAB_HOME", tempfile.mkdtemp(prefix="dtlab-home-"))
torch.set_num_threads(1)

# every chapter's catalogue of wrong solutions, registered for every test
import tests.mistakes  # noqa: E402, F401


def pytest_report_header(config):
    from dtlab.capabilities import LACKS_ENV, report

    told = os.environ.get(LACKS_ENV)
    lines = [f"{LACKS_ENV}={told} (the probes answer as if these were missing)"]
    lines = lines if told else []
    return lines + [f"capability {k}: {v}" for k, v in report().items()]


@pytest.fixture(scope="session", autouse=True)
def _stop_every_cluster():
    yield
    try:
        from dtlab.lab import stop_all
    except ImportError:  # the lab extra is not installed
        return
    stop_all()


_clusters: dict = {}


@pytest.fixture(scope="session")
def lab_cluster():
    """``lab_cluster(n)``: a live CPU cluster of n engines, shared by the session
    (starting one costs seconds; each test's run resets it if a previous test broke
    its process group). Stopped at the end of the session."""
    pytest.importorskip("ipyparallel")
    from dtlab.lab import LabCluster

    def get(n: int):
        c = _clusters.get(n)
        if c is None or not c.running:
            c = _clusters[n] = LabCluster(n, backend="gloo", timeout=20).start()
        return c

    yield get
    for c in _clusters.values():
        c.stop()
    _clusters.clear()


@pytest.fixture(scope="module", autouse=True)
def _fresh_process_groups_per_module():
    """Every process group holds gloo threads and sockets on every engine until the
    world is torn down, and each test module builds its own topologies: after a
    module, reset the shared clusters (0.4 s each) so groups do not pile up. Without
    this, engines of a long session held 600+ threads and took a core between
    them even while idle."""
    yield
    for n, c in list(_clusters.items()):
        if not c.running:
            continue
        try:
            c.reset()
        except Exception:  # a broken cluster: the next lab_cluster(n) starts anew
            c.stop()
            del _clusters[n]
