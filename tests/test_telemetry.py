import json
import os
import tempfile

import torch

from dtlab import comm, telemetry


def test_off_records_nothing_and_is_the_default():
    assert telemetry.current() is telemetry.OFF
    assert not telemetry.OFF.enabled
    telemetry.OFF.emit("comm", op="x")
    with telemetry.OFF.span("F"):
        pass
    assert telemetry.OFF.events == []


def test_use_restores_the_previous_recorder():
    a, b = telemetry.Recorder(0), telemetry.Recorder(1)
    with telemetry.use(a):
        with telemetry.use(b):
            assert telemetry.current() is b
        assert telemetry.current() is a
    assert telemetry.current() is telemetry.OFF


def test_span_memory_and_step_fields():
    rec = telemetry.Recorder(3)
    rec.step = 7
    with rec.span("F", stage=1, microbatch=2):
        pass
    rec.memory("after_forward", params=100, activations=40, peak=140)
    span, mem = rec.events
    assert span["kind"] == "span" and span["name"] == "F"
    assert (span["rank"], span["step"], span["stage"], span["microbatch"]) == (
        3,
        7,
        1,
        2,
    )
    assert span["t_end"] >= span["t_start"] >= 0
    assert mem["kind"] == "memory" and mem["phase"] == "after_forward"
    assert mem["params"] == 100 and mem["peak"] == 140


def test_jsonl_sink_round_trips(tmp_path):
    rec = telemetry.Recorder(1, [telemetry.JsonlSink(tmp_path, 1)])
    rec.emit("comm", op="all_reduce", payload_bytes=8, wire_bytes=8.0)
    rec.memory("step", params=1)
    rec.close()
    events = telemetry.read_jsonl(tmp_path / "rank1.jsonl")
    assert [e["kind"] for e in events] == ["comm", "memory"]
    assert events[0]["op"] == "all_reduce" and events[0]["rank"] == 1


def test_memory_sink_is_bounded():
    sink = telemetry.MemorySink(maxlen=5)
    rec = telemetry.Recorder(0, [sink])
    for i in range(12):
        rec.emit("x", i=i)
    assert [e["i"] for e in sink.events] == list(range(7, 12))


def test_chrome_trace(tmp_path):
    rec = telemetry.Recorder(2)
    with rec.span("B", stage=0, microbatch=1):
        pass
    rec.emit(
        "comm", op="all_reduce", axis="dp", dtype="float32", numel=4,
        payload_bytes=16, wire_bytes=24.0, t_start=0.001, t_end=0.002, tag=None,
    )  # fmt: skip
    rec.memory("step", params=10, grads=10)
    path = telemetry.write_chrome_trace(tmp_path / "trace.json", rec.events)
    trace = json.loads(open(path).read())["traceEvents"]
    complete = [e for e in trace if e["ph"] == "X"]
    assert {e["name"] for e in complete} == {"B", "all_reduce"}
    ar = next(e for e in complete if e["name"] == "all_reduce")
    assert ar["pid"] == 2 and ar["tid"] == 1
    assert abs(ar["ts"] - 1000.0) < 1e-6 and abs(ar["dur"] - 1000.0) < 1e-6
    counters = [e for e in trace if e["ph"] == "C"]
    assert counters[0]["args"] == {"params": 10, "grads": 10}


def test_traffic_summary():
    events = [
        {"kind": "comm", "op": "all_reduce", "axis": "dp", "payload_bytes": 8,
         "wire_bytes": 12.0},
        {"kind": "comm", "op": "all_reduce", "axis": "dp", "payload_bytes": 8,
         "wire_bytes": 12.0},
        {"kind": "comm", "op": "send", "axis": "pp", "payload_bytes": 4,
         "wire_bytes": 4.0},
        {"kind": "span", "name": "F"},
    ]  # fmt: skip
    table = telemetry.traffic(events, by=("axis", "op"))
    assert table[("dp", "all_reduce")] == {"calls": 2, "payload_bytes": 16,
                                           "wire_bytes": 24.0}  # fmt: skip
    assert table[("pp", "send")]["calls"] == 1


def test_comm_on_a_one_rank_world_records_no_wire_bytes():
    # a one-rank world through the real torch.distributed: without a recorder comm
    # still works; with one, an all-reduce is recorded with nothing on the wire

    import torch.distributed as dist

    from dtlab.launch import init_process_group

    path = os.path.join(tempfile.mkdtemp(), "store")
    init_process_group(0, 1, store_file=path, timeout=10)
    try:
        x = torch.ones(3)
        comm.all_reduce(x)
        assert torch.equal(x, torch.ones(3))
        rec = telemetry.Recorder(0)
        with telemetry.use(rec):
            comm.all_reduce(x)
            comm.ring_all_reduce(x)  # one rank: nothing to send
        (event,) = rec.events
        assert event["wire_bytes"] == 0.0  # within one rank nothing crosses
    finally:
        dist.destroy_process_group()
