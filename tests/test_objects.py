"""dtlab.objects: bytes and Python objects between ranks through dtlab.comm, each
rank's own length (an empty one included), in rank order."""

from dtlab.launch import spawn


def _gather(_):
    import torch.distributed as dist

    from dtlab.objects import all_gather_bytes, all_gather_objects

    r = dist.get_rank()
    return (
        all_gather_bytes(bytes(range(3 * r)), tag="t"),  # rank 0 sends nothing
        all_gather_objects({"rank": r, "xs": list(range(r))}, tag="t"),
    )


def test_every_rank_gets_every_ranks_bytes_and_objects_in_rank_order():
    out = spawn(_gather, 3, None, timeout=60)
    want_bytes = [b"", bytes(range(3)), bytes(range(6))]
    want_objects = [{"rank": r, "xs": list(range(r))} for r in range(3)]
    assert out == [(want_bytes, want_objects)] * 3
