"""The counter-based initial values: a function of (seed, name, flat index) alone, so any slice,
chunking, thread count or device gives the bits of the full draw; and normal with the stated
standard deviation."""

import math

import pytest
import torch

import deadpool.init_rng as rng
from deadpool.init_rng import fill_normal_, normal_at, param_key, splitmix64

KEY = param_key(7, "blocks.0.attn.qkv.weight")


def test_the_tensor_hash_is_splitmix64_with_wrapping_int64():
    """Catches an arithmetic (sign-extending) shift or a saturating multiply in ``_mix_``."""
    xs = [0, 1, 2**31, 2**40 + 3, (1 << 64) - 1, 0x9E3779B97F4A7C15, 12345678901234567]
    got = rng._mix_(torch.tensor([rng._int64(x) for x in xs], dtype=torch.int64)).tolist()
    assert got == [rng._int64(splitmix64(x)) for x in xs]


def full(n=19_200, **kw):
    return fill_normal_(torch.empty(n), KEY, 0.02, [0], n, **kw)


@pytest.mark.parametrize("chunk,threads", [(1000, 3), (999, 2), (1 << 18, 1)])
def test_any_slice_chunking_or_thread_count_gives_the_bits_of_the_full_draw(chunk, threads):
    ref = full()
    assert torch.equal(full(chunk=chunk, threads=threads), ref)
    rows = ref.view(200, 96)
    # column blocks of every row (a row-parallel slice), odd ends included
    for c0, w in ((48, 48), (1, 37), (95, 1), (0, 96)):
        out = torch.empty(200, w)
        fill_normal_(out, KEY, 0.02, range(c0, 19_200, 96), w, chunk=chunk, threads=threads)
        assert torch.equal(out, rows[:, c0:c0 + w]), (c0, w)
    # runs of rows out of order (q, k and v heads of a fused weight)
    starts = [96 * r for r in (100, 101, 10, 11, 199)]
    out = fill_normal_(torch.empty(5, 96), KEY, 0.02, starts, 96, chunk=chunk, threads=threads)
    assert torch.equal(out, rows[[100, 101, 10, 11, 199]])
    idx = torch.tensor([19_199, 3, 4, 17, 0])
    assert torch.equal(normal_at(idx.clone(), KEY, 0.02), ref[idx])


def test_the_draw_depends_on_seed_and_name_and_fills_other_dtypes():
    a = full(1000)
    b = fill_normal_(torch.empty(1000), param_key(8, "blocks.0.attn.qkv.weight"), 0.02, [0], 1000)
    c = fill_normal_(torch.empty(1000), param_key(7, "blocks.1.attn.qkv.weight"), 0.02, [0], 1000)
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert abs(torch.corrcoef(torch.stack((a, b, c)))[0, 1:]).max() < 0.15
    half = fill_normal_(torch.empty(1000, dtype=torch.bfloat16), KEY, 0.02, [0], 1000)
    assert torch.equal(half, a.to(torch.bfloat16))
    with pytest.raises(ValueError, match="runs"):
        fill_normal_(torch.empty(10), KEY, 0.02, [0], 11)


def test_the_polynomials_match_log_cos_and_sin():
    u = torch.cat((torch.linspace(2.0 ** -24, 1 - 2.0 ** -24, 20_001), 1 - torch.arange(1, 64) * 2.0 ** -24))
    torch.testing.assert_close(rng._ln_(u.clone()).double(), u.double().log(), rtol=2e-7, atol=1e-7)
    assert (rng._ln_(u.clone()) < 0).all()  # so sqrt(-2 ln u) is never NaN
    x = torch.linspace(0, math.pi / 2, 10_001)
    c, s = rng._cos_sin_(x.clone())
    torch.testing.assert_close(c.double(), x.double().cos(), rtol=0, atol=3e-7)
    torch.testing.assert_close(s.double(), x.double().sin(), rtol=0, atol=3e-7)


def test_the_values_are_normal_with_the_given_std():
    from scipy import stats

    z = full(200_000).double() / 0.02
    assert abs(z.mean()) < 5 / math.sqrt(len(z)) and abs(z.std() - 1) < 0.01
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-3
    assert z.abs().max() <= math.sqrt(48 * math.log(2))
    # the two halves of each Box-Muller pair, and neighbouring pairs, are uncorrelated
    pairs = z.view(-1, 2)
    assert abs(torch.corrcoef(pairs.T)[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack((z[:-2], z[2:])))[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack((pairs[:, 0] ** 2, pairs[:, 1] ** 2)))[0, 1]) < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_the_bits_of_the_cpu():
    ref = full()
    chunked = fill_normal_(torch.empty(19_200, device="cuda"), KEY, 0.02, [0], 19_200, chunk=4096)
    assert torch.equal(chunked.cpu(), ref)
    out = torch.empty(200, 37, device="cuda")
    fill_normal_(out, KEY, 0.02, range(1, 19_200, 96), 37, chunk=1000)
    assert torch.equal(out.cpu(), ref.view(200, 96)[:, 1:38])
    on_gpu = fill_normal_(torch.empty(19_200, device="cuda"), KEY, 0.02, [0], 19_200)
    assert torch.equal(on_gpu.cpu(), ref)
