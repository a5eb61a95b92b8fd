import pytest

from deadpool.topology import ParallelDims


def test_coords_roundtrip_and_axis_groups():
    dims = ParallelDims(dp=2, tp=2, pp=2, ranks_per_node=2)
    assert dims.world_size == 8
    for r in range(8):
        c = dims.coords(r)
        assert dims.rank_of(c["pp"], c["dp"], c["tp"]) == r
    assert dims.axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.axis_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.axis_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("kwargs,msg", [({"dp": 0}, "dp"), ({"dp": 3, "ranks_per_node": 2}, "multiple"),
                                        ({"dp": 1, "tp": 4, "ranks_per_node": 2}, "inside one node")])
def test_bad_layouts_are_rejected_with_a_clear_message(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        ParallelDims(**kwargs)

