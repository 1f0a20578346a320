"""``dtlab bench cluster``: the cluster start, stop and dashboard lag rows, from
synthetic results (the table) and from one real, small run."""

import pytest

from dtlab.bench import assemble, format_table
from dtlab.bench.cluster import summary

PHASES = (
    "controller",
    "engines launched",
    "engines registered",
    "torch imported",
    "process group",
)


def _start(ready: float) -> dict:
    phases = {"controller": 0.5, "engines registered": ready - 0.5}
    return {
        "world_size": 4,
        "ready_s": ready,
        "stop_s": 0.2,
        "first_run_s": 0.05,
        "phases": phases,
        "engines": 4,
    }


def test_the_median_start_and_the_lag_become_rows_against_their_goals():
    raw = {
        "starts": [_start(2.5), _start(2.1), _start(3.9)],
        "lag": {"median_s": 0.21, "max_s": 0.44},
    }
    r = summary(raw)
    assert r["ready_s"] == 2.5 and r["phases"]["controller"] == 0.5
    rows = {x["what"]: x for x in assemble({"results": {"cluster": r}})}
    start, stop = rows["cluster start"], rows["cluster stop"]
    lag = rows["dashboard lag"]
    assert (start["dtlab"], start["reference"], start["unit"]) == (2.5, 3.0, "s")
    assert "controller 0.50" in start["note"]
    assert stop["dtlab"] == 0.2 and stop["reference"] == 1.0
    assert lag["dtlab"] == 0.21 and "max 0.44 s" in lag["note"]
    assert "dashboard lag" in format_table(list(rows.values()))


@pytest.mark.cluster
@pytest.mark.slow
def test_a_small_real_run_measures_every_phase():
    from dtlab.bench.cluster import run

    r = run(world_size=2, repeats=1, steps=3)
    print(
        f"\ncluster start {r['ready_s']:.2f}s {r['phases']}, stop "
        f"{r['stop_s']:.2f}s, lag median {r['lag_median_s']:.3f}s "
        f"max {r['lag_max_s']:.3f}s"
    )
    assert tuple(r["phases"]) == PHASES
    assert 0 < r["ready_s"] and 0 < r["stop_s"] < 5
    assert r["lag"]["events"] > 0 and 0 < r["lag_median_s"] <= r["lag_max_s"]
