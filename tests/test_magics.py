"""The conveniences a learner expects of a notebook cluster, in a real Jupyter
kernel: ``%%rank`` targets ranks by rank, ``%ranks on`` sends every cell to the
ranks, each rank's output streams into an area of its own under the cell,
``%push`` / ``%pull`` move variables, ``%status`` and the status widget show every
rank; and the parts that need no kernel (parsing ranks, the status table)."""

from __future__ import annotations

import re

import pytest

from tests.kernels import execute, execute_messages, start_kernel

pytest.importorskip("jupyter_client")


def test_ranks_are_parsed_by_rank_and_refused_by_name():
    from dtlab.lab.kernel.magics import parse_ranks

    assert parse_ranks("0,2", 4) == [0, 2]
    assert parse_ranks("1-3", 4) == [1, 2, 3]
    assert parse_ranks("all", 4) == parse_ranks("", 4) == [0, 1, 2, 3]
    assert parse_ranks("3, 0-1", 4) == [0, 1, 3]
    with pytest.raises(ValueError, match=r"ranks \[7\] are not in this world of 4"):
        parse_ranks("7", 4)
    with pytest.raises(ValueError, match="write ranks as 0,2"):
        parse_ranks("one", 4)


def _areas(messages) -> dict[str, list[tuple[float, str]]]:
    """``{display_id: [(arrival, text/plain), ...]}`` of a cell's output areas."""
    areas: dict[str, list] = {}
    for m in messages:
        if m["msg_type"] in ("display_data", "update_display_data"):
            display_id = m["content"]["transient"]["display_id"]
            text = m["content"]["data"]["text/plain"]
            areas.setdefault(display_id, []).append((m["received"], text))
    return areas


def _final(messages) -> list[str]:
    """The last text of each area, ordered by rank."""
    return sorted(shown[-1][1] for shown in _areas(messages).values())


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_kernel()
    execute(
        kc, "from dtlab.lab import start\ncluster = start(world_size=2, timeout=10)"
    )
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=False)


@pytest.mark.cluster
@pytest.mark.slow
def test_a_cell_on_chosen_ranks_with_one_area_per_rank_streamed(kernel):
    assert _final(execute_messages(kernel, "%%rank 1\nprint('hi from', rank)")) == [
        "[rank 1]\nhi from 1"
    ]
    messages = execute_messages(
        kernel,
        """
        %%rank all
        import time
        for i in range(3):
            print(f"rank {rank} line {i}", flush=True)
            time.sleep(0.8)
        rank * 100
        """,
    )
    areas = _areas(messages)
    assert len(areas) == 2  # one area per rank, not one interleaved stream
    assert _final(messages) == [
        "[rank 0]\nrank 0 line 0\nrank 0 line 1\nrank 0 line 2\n0",
        "[rank 1]\nrank 1 line 0\nrank 1 line 1\nrank 1 line 2\n100",
    ]
    end = messages[-1]["received"]
    for shown in areas.values():
        first = shown[0]
        # streamed: the first line was shown well before the cell ended
        assert "line 0" in first[1] and "line 2" not in first[1]
        assert end - first[0] > 1.0
    # cluster.run's output is grouped the same way
    out = _final(
        execute_messages(
            kernel,
            "import torch.distributed as dist\n"
            "_ = cluster.run(lambda: print('run on', dist.get_rank()))",
        )
    )
    assert out == ["[rank 0]\nrun on 0", "[rank 1]\nrun on 1"]


@pytest.mark.cluster
@pytest.mark.slow
def test_every_cell_on_the_ranks_push_pull_and_errors(kernel):
    execute(kernel, "%ranks on")
    execute(kernel, "x = rank * 10")  # runs on the ranks
    execute(kernel, "%%local\ny = 5")  # runs here
    execute(kernel, "%ranks off")
    assert execute(kernel, "print('x' in dir(), y)") == "False 5\n"
    execute(kernel, "%pull x")
    assert execute(kernel, "print(x)") == "[0, 10]\n"
    execute(kernel, "%push y")
    assert _final(execute_messages(kernel, "%%rank 0\nprint(y + rank)")) == [
        "[rank 0]\n5"
    ]
    assert execute(kernel, "cluster.push(z=3); print(cluster.pull('z'))") == "[3, 3]\n"
    bad = execute_messages(kernel, "%%rank 7\npass", errors=False)
    assert "ranks [7] are not in this world of 2" in _error(bad)
    failed = execute_messages(
        kernel, "%%rank 0\nraise ValueError('bad cell')", errors=False
    )
    assert "rank 0: ValueError: bad cell" in _error(failed)
    # the next cell resets the group by itself
    assert _final(execute_messages(kernel, "%%rank all\nprint(dist.get_world_size())"))


def _error(messages) -> str:
    text = "\n".join(
        "\n".join(m["content"]["traceback"])
        for m in messages
        if m["msg_type"] == "error"
    )
    print(text)
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # without IPython's colours


@pytest.mark.cluster
@pytest.mark.slow
def test_status_as_text_and_as_a_widget(kernel):
    (shown,) = [
        m["content"]["data"]["text/plain"]
        for m in execute_messages(kernel, "%status")
        if m["msg_type"] == "display_data"
    ]
    header, *rows = shown.splitlines()
    for column in ("rank", "pid", "host", "device", "memory", "doing", "heartbeat"):
        assert column in header
    assert len(rows) == 2 and all(" MiB " in r and "running" in r for r in rows)
    out = execute(
        kernel,
        """
        import time
        from dtlab.lab.kernel.status import status_widget
        w = status_widget(cluster, interval=0.2)
        before = w.value
        time.sleep(1.0)
        print("<table>" in w.value, w.value != before, cluster.status()[1].state)
        """,
    )
    assert out == "True True running\n"  # refreshed (the heartbeat ages change)
