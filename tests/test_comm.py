"""Every comm op: its result against torch.distributed's, and its recorded bytes
against the ring formulas (dtlab.estimate.wire_bytes)."""

import pytest
import torch

from dtlab import comm, telemetry
from dtlab.estimate import wire_bytes
from dtlab.launch import spawn

pytestmark = pytest.mark.cluster


def _every_op():
    import torch.distributed as dist

    from dtlab.topology import Layout, Topology

    r, n = dist.get_rank(), dist.get_world_size()
    rec = telemetry.Recorder(r)
    out = {}
    with telemetry.use(rec):
        rec.step = 3
        x = torch.arange(6, dtype=torch.float32) + 10 * r
        comm.all_reduce(x, tag="ar")
        out["all_reduce"] = x

        full = torch.arange(4 * n, dtype=torch.float32) * (r + 1)
        shard = torch.empty(4)
        comm.reduce_scatter(shard, full)
        out["reduce_scatter"] = shard

        gathered = torch.empty(3 * n, dtype=torch.float64)
        comm.all_gather(gathered, torch.full((3,), float(r), dtype=torch.float64))
        out["all_gather"] = gathered

        b = torch.full((5,), float(r), dtype=torch.bfloat16)
        comm.broadcast(b, src=2)
        out["broadcast"] = b

        # point to point round a ring, async sends and receives posted together
        nxt = torch.empty(2)
        reqs = [comm.isend(torch.full((2,), float(r)), (r + 1) % n),
                comm.irecv(nxt, (r - 1) % n)]  # fmt: skip
        for q in reqs:
            q.wait()
        out["ring_p2p"] = nxt
        # blocking send/recv between pairs (0<->1, 2<->3)
        peer = r ^ 1
        y = torch.full((3,), float(r))
        if r % 2 == 0:
            comm.send(y, peer)
            comm.recv(y, peer)
        else:
            z = torch.empty(3)
            comm.recv(z, peer)
            comm.send(y, peer)
            y = z
        out["send_recv"] = y

        w = comm.all_reduce(torch.ones(4), async_op=True)
        w.wait()
        comm.barrier()

        # the ring all-reduce from send/recv, on the world and on 2-rank axes,
        # with a size that does not divide evenly
        topo = Topology(Layout(dp=2, tp=2))
        for name, group in (("world", None), ("tp", topo.axis("tp"))):
            g = torch.Generator().manual_seed(100 + r)
            t = torch.randn(1001, generator=g)
            expected = t.clone()
            dist.all_reduce(expected, group=topo.group("tp") if group else None)
            comm.ring_all_reduce(t, group)
            out[f"ring_{name}"] = (t, expected)
    try:
        comm.all_gather(torch.empty(5), torch.empty(3))
    except ValueError as exc:
        out["mismatch"] = str(exc)
    out["events"] = rec.events
    return out


@pytest.fixture(scope="module")
def results(lab_cluster):
    return lab_cluster(4).run(_every_op)


def test_results_match_torch(results):
    n = 4
    for r, out in enumerate(results):
        torch.testing.assert_close(
            out["all_reduce"], sum(torch.arange(6.0) + 10 * k for k in range(n)),
            rtol=0, atol=0,
        )  # fmt: skip
        total = sum(torch.arange(4.0 * n) * (k + 1) for k in range(n))
        assert torch.equal(out["reduce_scatter"], total[4 * r : 4 * r + 4])
        assert torch.equal(
            out["all_gather"],
            torch.arange(n, dtype=torch.float64).repeat_interleave(3),
        )
        assert out["broadcast"].dtype == torch.bfloat16
        assert torch.equal(
            out["broadcast"], torch.full((5,), 2.0, dtype=torch.bfloat16)
        )
        assert torch.equal(out["ring_p2p"], torch.full((2,), float((r - 1) % n)))
        assert torch.equal(out["send_recv"], torch.full((3,), float(r ^ 1)))


def test_ring_all_reduce_equals_dist_all_reduce(results):
    for out in results:
        for name in ("world", "tp"):
            got, expected = out[f"ring_{name}"]
            # the ring adds in a different order than gloo: equal up to rounding
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_recorded_bytes_follow_the_ring_formulas(results):
    for r, out in enumerate(results):
        events = telemetry.comm_events(out["events"])
        by_op = {}
        for e in events:
            assert e["rank"] == r
            assert e["t_end"] >= e["t_start"]
            by_op.setdefault(e["op"], []).append(e)
        ar = by_op["all_reduce"][0]
        assert ar["step"] == 3 and ar["tag"] == "ar" and ar["axis"] == "world"
        assert ar["payload_bytes"] == 6 * 4 and ar["numel"] == 6
        assert ar["wire_bytes"] == 2 * 3 / 4 * 24  # 2(N-1)/N·S
        rs = by_op["reduce_scatter"][0]
        assert rs["payload_bytes"] == 16 * 4 and rs["wire_bytes"] == 3 / 4 * 64
        ag = by_op["all_gather"][0]
        assert ag["dtype"] == "float64"
        assert ag["payload_bytes"] == 12 * 8 and ag["wire_bytes"] == 3 / 4 * 96
        bc = by_op["broadcast"][0]
        assert bc["dtype"] == "bfloat16" and bc["payload_bytes"] == 10
        assert by_op["barrier"][0]["wire_bytes"] == 0
        # p2p: sends count their bytes, receives count none
        sends = [e for e in by_op["send"] if e["tag"] is None]
        recvs = [e for e in by_op["recv"] if e["tag"] is None]
        assert sum(e["wire_bytes"] for e in sends) == 2 * 4 + 3 * 4
        assert all(e["wire_bytes"] == 0 for e in recvs)
        # each p2p event names the other side: the ring's next rank, then the pair
        assert [e["peer"] for e in sends] == [(r + 1) % 4, r ^ 1]
        assert [e["peer"] for e in recvs] == [(r - 1) % 4, r ^ 1]
        # the async all-reduce was recorded when waited on
        assert len(by_op["all_reduce"]) == 2
        # ring all-reduce on the world: 2(N-1) sends of ~S/N each
        ring = [e for e in by_op["send"] if e["tag"] == "ring" and e["axis"] == "world"]
        assert len(ring) == 2 * 3
        sent = sum(e["wire_bytes"] for e in ring)
        assert abs(sent - wire_bytes("all_reduce", 1001 * 4, 4)) <= 2 * 3 * 4
        ring_tp = [e for e in by_op["send"] if e["tag"] == "ring" and e["axis"] == "tp"]
        assert len(ring_tp) == 2 and sum(e["wire_bytes"] for e in ring_tp) == 1001 * 4


def _spawned_all_reduce(scale):
    import torch.distributed as dist

    x = torch.full((3,), float(dist.get_rank() + 1) * scale)
    comm.all_reduce(x)
    return x


def test_comm_runs_under_spawn_too():
    out = spawn(_spawned_all_reduce, 2, 2.0, timeout=30)
    assert all(torch.equal(x, torch.full((3,), 6.0)) for x in out)


def test_size_mismatch_is_a_clear_error(results):
    for out in results:
        assert "expected 4 x input (3)" in out["mismatch"]
