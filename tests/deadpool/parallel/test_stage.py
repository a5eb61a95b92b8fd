"""Stages are exact slices of the single-process model."""

import pytest
import torch

from deadpool.model import build_model, model_config
from deadpool.parallel.stage import build_stage, layer_range
from deadpool.parallel.tensor import shard

TINY = dict(vocab_size=64, d_model=32, n_layers=5, n_heads=4, ffn_mult=2, max_seq_len=8)
# grouped-query attention: each tp rank's qkv slice is three separate row blocks (q, k, v heads)
GQA = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_mult=2,
           max_seq_len=8)


def test_layers_split_contiguously_earlier_stages_take_the_extra():
    assert [list(layer_range(5, 3, s)) for s in range(3)] == [[0, 1], [2, 3], [4]]
    assert [list(layer_range(4, 4, s)) for s in range(4)] == [[0], [1], [2], [3]]
    assert list(layer_range(4, 1, 0)) == [0, 1, 2, 3]


def assert_stages_are_slices(cfg, pp, tp):
    full = dict(build_model(cfg, 7).named_parameters())
    seen = set()
    for s in range(pp):
        for r in range(tp):
            stage = build_stage(cfg, 7, pp_rank=s, pp=pp, tp_rank=r, tp=tp)
            assert stage.is_first == (s == 0) and stage.is_last == (s == pp - 1)
            for name, p in stage.named_parameters():
                assert torch.equal(p, shard(name, full[name].detach(), r, tp, cfg)), (name, s, r)
                seen.add(name)
    assert seen == set(full)  # every parameter lives on some stage


@pytest.mark.parametrize("pp,tp", [(1, 1), (2, 2), (3, 4), (5, 1)])
def test_stage_parameters_equal_slices_of_build_model(pp, tp):
    assert_stages_are_slices(TINY, pp, tp)


@pytest.mark.parametrize("pp,tp", [(1, 2), (1, 4), (2, 1), (2, 4)])
def test_gqa_stage_parameters_equal_slices_of_build_model(pp, tp):
    assert_stages_are_slices(GQA, pp, tp)


def test_a_wrong_index_map_is_caught(monkeypatch):
    """The equality above can fail: a stage whose index map is off by one tp rank (the slice
    of the next rank) or by one row differs from the single-process model's slice."""
    import deadpool.parallel.stage as stage_mod

    right = stage_mod.shard_segments
    for wrong in (lambda n, shape, r, tp, cfg: right(n, shape, (r + 1) % tp, tp, cfg),
                  lambda n, shape, r, tp, cfg: ([s + shape[-1] for s in right(n, shape, r, tp, cfg)[0]],
                                                right(n, shape, r, tp, cfg)[1])):
        monkeypatch.setattr(stage_mod, "shard_segments", wrong)
        with pytest.raises(AssertionError):
            assert_stages_are_slices(GQA, 1, 2)


def test_a_stage_draws_only_the_elements_it_holds(monkeypatch):
    """Each tp rank computes its own slice, never the full parameter (the draws counted)."""
    import deadpool.init_rng as init_rng

    drawn = []
    real = init_rng.normal_pairs
    monkeypatch.setattr(init_rng, "normal_pairs",
                        lambda pairs, *a, **k: drawn.append(2 * len(pairs)) or real(pairs, *a, **k))
    for r in range(4):
        drawn.clear()
        stage = build_stage(GQA, 7, pp_rank=0, pp=2, tp_rank=r, tp=4)
        held = sum(p.numel() for n, p in stage.named_parameters() if not n.endswith("norm.weight"))
        assert sum(drawn) == held


def test_ffn_multiple_of_is_optional_and_sets_the_swiglu_width():
    assert model_config(TINY).ffn_hidden == 64  # int(2*2*32/3) = 42 -> 64
    cfg = dict(TINY, ffn_multiple_of=256)
    assert model_config(cfg).ffn_hidden == 256
    assert build_model(cfg, 0).blocks[0].ffn.up.weight.shape == (256, 32)
    stage = build_stage(cfg, 0, pp_rank=0, pp=1, tp_rank=1, tp=2)
    assert stage.blocks["0"].ffn.up.weight.shape == (128, 32)


def test_one_stage_forward_matches_build_model():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
    stage = build_stage(TINY, 3, pp_rank=0, pp=1, tp_rank=0, tp=1)
    assert stage.activation_shape(2, 8) == (2, 8, 32)
    torch.testing.assert_close(stage(x, None, y), build_model(TINY, 3)(x, y), rtol=1e-5, atol=1e-6)


def test_layouts_that_do_not_split_evenly_are_refused():
    with pytest.raises(ValueError, match="n_heads"):
        build_stage(TINY, 0, pp_rank=0, pp=1, tp_rank=0, tp=3)
    with pytest.raises(ValueError, match="n_layers"):
        build_stage(TINY, 0, pp_rank=0, pp=6, tp_rank=0, tp=1)
