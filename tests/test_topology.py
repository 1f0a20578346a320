import pytest

from dtlab.launch import spawn
from dtlab.topology import Layout, Topology, layouts_for, padded_vocab


def test_world_size_is_the_product():
    assert Layout(dp=2, tp=2, pp=2).world_size == 8
    assert Layout().world_size == 1


@pytest.mark.parametrize(
    "kwargs", [dict(dp=0), dict(tp=-1), dict(pp=1.5), dict(dp=True), dict(tp="2")]
)
def test_sizes_must_be_positive_integers(kwargs):
    with pytest.raises(ValueError, match="positive integer"):
        Layout(**kwargs)


def test_rank_order_is_tp_fastest_then_dp_then_pp():
    layout = Layout(dp=2, tp=2, pp=2)
    # Megatron's order, written out by hand for all 8 ranks: (pp, dp, tp)
    expected = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]  # fmt: skip
    for rank, (pp, dp, tp) in enumerate(expected):
        assert layout.coords(rank) == {"pp": pp, "dp": dp, "cp": 0, "tp": tp}
        assert layout.rank(pp=pp, dp=dp, tp=tp) == rank


def test_context_parallel_ranks_sit_between_tp_and_dp():
    layout = Layout(dp=2, tp=2, cp=2)
    assert layout.world_size == 8
    # (dp, cp, tp) for ranks 0..7: tp fastest, then cp, then dp
    expected = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]  # fmt: skip
    for rank, (dp, cp, tp) in enumerate(expected):
        assert layout.coords(rank) == {"pp": 0, "dp": dp, "cp": cp, "tp": tp}
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # the dense weights' replicas: every dp and cp index of one tp slice
    assert layout.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_expert_parallel_groups_are_carved_out_of_the_replicas():
    layout = Layout(dp=4, ep=2)
    assert layout.world_size == 4  # ep adds no ranks
    assert layout.groups("ep") == [[0, 1], [2, 3]]  # each splits the experts
    assert layout.groups("edp") == [[0, 2], [1, 3]]  # each holds the same experts
    assert Layout(dp=2, tp=2, ep=2).groups("ep") == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="ep=3 does not divide dp\\*cp=4"):
        Layout(dp=4, ep=3)
    assert str(Layout(dp=2, cp=2, ep=2)) == "dp2·tp1·pp1·cp2·ep2"


def test_groups_per_axis():
    layout = Layout(dp=2, tp=2, pp=2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # every rank is in exactly one group of each axis
    for axis in ("tp", "dp", "pp"):
        members = sorted(r for g in layout.groups(axis) for r in g)
        assert members == list(range(8))
    assert layout.group_of("dp", 5) == [5, 7]


def test_validation_names_the_factor():
    with pytest.raises(ValueError, match="world has 8"):
        Layout(dp=2, tp=2).validate(8)
    with pytest.raises(ValueError, match="tp=4 does not divide n_heads=6"):
        Layout(tp=4).validate(4, n_heads=6)
    with pytest.raises(ValueError, match="pp=3 does not divide n_layers=4"):
        Layout(pp=3).validate(3, n_layers=4)
    with pytest.raises(ValueError, match="chunks=2"):
        Layout(pp=2).validate(2, n_layers=6, chunks=2)
    with pytest.raises(ValueError, match="microbatches >= pp"):
        Layout(pp=4).validate(4, microbatches=2, schedule="1f1b")
    Layout(pp=4).validate(4, microbatches=2, schedule="gpipe")  # allowed, big bubble
    with pytest.raises(ValueError, match="outside"):
        Layout(dp=2).coords(2)
    with pytest.raises(ValueError, match="unknown axis"):
        Layout().size("sp")


def test_layouts_for_lists_only_valid_factorisations():
    got = {(lt.dp, lt.tp, lt.pp) for lt in layouts_for(4)}
    assert got == {(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4)}
    got = {(lt.dp, lt.tp, lt.pp) for lt in layouts_for(4, n_heads=2, n_layers=2)}
    assert got == {(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)}


def test_padded_vocab():
    assert padded_vocab(50257, 4) == 50260
    assert padded_vocab(64, 4) == 64


def test_topology_without_a_world_does_rank_math():
    topo = Topology(Layout(), 0)
    assert topo.axis("dp").size == 1 and topo.group("dp") is None
    a, b = Topology(Layout(dp=2, tp=2), 3), Topology(Layout(tp=4), 3)
    assert a.coords == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}  # both coexist
    assert b.coords == {"pp": 0, "dp": 0, "cp": 0, "tp": 3}


def _groups_on_world():
    import torch
    import torch.distributed as dist

    topo = Topology(Layout(dp=2, tp=2))
    second = Topology(Layout(tp=4))  # a second topology in the same process
    out = {}
    for axis in ("tp", "dp"):
        x = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(x, group=topo.group(axis))
        out[axis] = (topo.axis(axis).ranks, topo.axis(axis).index, x.item())
    x = torch.ones(1)
    dist.all_reduce(x, group=second.group("tp"))
    out["second"] = x.item()
    return out


def test_process_groups_on_a_live_world():
    results = spawn(_groups_on_world, 4, timeout=30)
    layout = Layout(dp=2, tp=2)
    for rank, out in enumerate(results):
        for axis in ("tp", "dp"):
            ranks, index, total = out[axis]
            assert list(ranks) == layout.group_of(axis, rank)
            assert ranks[index] == rank
            assert total == sum(ranks)  # the all-reduce stayed inside the group
        assert out["second"] == 4.0


def test_factorisations_beyond_3d_fold_ep_into_dp_cp():
    from dtlab.topology import factorisations

    three_d = factorisations(4)
    assert {(lt.dp, lt.tp, lt.pp) for lt in three_d} == {
        (4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4),
    }  # fmt: skip
    beyond = factorisations(4, beyond_3d=True)
    assert all(lt.world_size == 4 and (lt.dp * lt.cp) % lt.ep == 0 for lt in beyond)
    assert Layout(dp=2, cp=2, ep=4) in beyond and Layout(cp=4, ep=2) in beyond
    assert len(set(beyond)) == len(beyond) == 20
