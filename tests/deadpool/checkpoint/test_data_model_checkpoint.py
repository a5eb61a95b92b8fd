import torch

from deadpool import checkpoint
from deadpool.data import SyntheticCorpus
from deadpool.model import build_model, build_optimizer
from deadpool.snapshot import state_tensors

TINY = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, ffn_mult=2, max_seq_len=16)


def test_batches_are_a_pure_function_of_seed_step_and_rank():
    a, b = SyntheticCorpus(64, seed=3, num_tokens=4096), SyntheticCorpus(64, seed=3, num_tokens=4096)
    x1, y1 = a.batch(7, 1, 4, 8)
    x2, y2 = b.batch(7, 1, 4, 8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(a.batch(7, 2, 4, 8)[0], x1)
    assert not torch.equal(a.batch(8, 1, 4, 8)[0], x1)


def test_model_init_is_identical_for_every_process_with_the_seed():
    m1, m2 = build_model(TINY, 5), build_model(TINY, 5)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


def test_loss_falls_on_the_synthetic_corpus():
    torch.manual_seed(0)
    model = build_model(TINY, 0)
    opt = build_optimizer(model, 1e-2, 0.0)
    corpus = SyntheticCorpus(64, seed=0, num_tokens=8192)
    losses = []
    for step in range(40):
        x, y = corpus.batch(step, 0, 8, 16)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_dcp_checkpoint_roundtrip(tmp_path):
    model = build_model(TINY, 1)
    opt = build_optimizer(model, 1e-2, 0.0)
    state = dict(state_tensors(model, opt))
    header = {"step": 4, "rng_cpu": checkpoint.encode_rng_state(torch.get_rng_state())}
    checkpoint.save_rank_state(tmp_path, 4, 0, state, header)
    checkpoint.write_meta(tmp_path, 4, 1, "test")
    saved = {k: v.clone() for k, v in state.items()}
    with torch.no_grad():
        for v in state.values():
            v.zero_()
    step_dir = checkpoint.latest_step_dir(tmp_path)
    h = checkpoint.load_rank_state(step_dir, 0, state)
    assert h["step"] == 4 and h["rng_cpu"] == header["rng_cpu"]
    for k in saved:
        assert torch.equal(saved[k], state[k]), k
