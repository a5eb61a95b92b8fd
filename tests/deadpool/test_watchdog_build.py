"""The first build's own progress bound: a stage's build is one long call, as long as its size."""

from deadpool.control.liveness import Liveness
from deadpool.model import stage_params
from deadpool.rank.watchdog import build_phase, phase_bound


def test_a_long_build_is_not_a_hang_until_its_own_bound():
    now = [0.0]
    live = Liveness(3.0, 10.0, 60.0, clock=lambda: now[0])
    gpt_1b = stage_params({"name": "gpt_1b", "vocab_size": 50304, "d_model": 2048, "n_layers": 24,
                           "n_heads": 16, "ffn_mult": 4, "max_seq_len": 1024}, 1, 1, 0)
    phase = build_phase(gpt_1b, 60.0)
    bound = phase_bound(phase, 60.0)
    assert bound > 60.0 + 200  # 1.4 B parameters at 5 M/s on top of the progress bound
    live.update(0, 1, 1, 0, phase)
    for t in (61.0, bound - 1):  # a plain phase is hung at 61 s; the build is not
        now[0] = t
        live.update(0, int(t) + 1, 1, 0, phase)  # beats go on, progress does not
        assert not live.stalled(0)
    now[0] = bound + 1
    assert live.stalled(0)  # a build hung past its own bound is still found
    live.update(1, 1, 1, 0, "forward")
    now[0] += 61
    assert live.stalled(1)
    assert phase_bound("forward", 60.0) == 60.0 and phase_bound("build/10", 60.0) == 60.0
