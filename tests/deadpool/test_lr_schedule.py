"""The learning-rate schedule against formulas written out independently here."""

import math

import pytest

from deadpool.rank.lr_schedule import check, lr_at

PEAK, TOTAL = 3e-3, 40


def cfg(kind, warmup=5, min_ratio=0.1, decay_ratio=0.25):
    return {"lr": PEAK, "num_steps": TOTAL, "lr_schedule": kind, "warmup_steps": warmup,
            "min_lr_ratio": min_ratio, "wsd_decay_ratio": decay_ratio}


def reference(kind, step, warmup=5, min_ratio=0.1, decay_ratio=0.25):
    """Written from the definitions: linear warm-up to the peak over ``warmup`` steps; cosine
    from the peak (first step after warm-up) to the floor (last step); wsd stable, then a
    straight line from the peak to the floor ending at the last step."""
    floor = PEAK * min_ratio
    if step < warmup:
        return PEAK * (step + 1) / warmup
    if kind == "constant":
        return PEAK
    last = TOTAL - 1
    if kind == "cosine":
        t = (step - warmup) / (last - warmup)
        return floor + (PEAK - floor) * (1 + math.cos(math.pi * t)) / 2
    n_decay = round(decay_ratio * TOTAL)  # the last n_decay steps decay, the last one at floor
    first = TOTAL - n_decay
    if step < first:
        return PEAK
    return PEAK - (PEAK - floor) * (step - first + 1) / n_decay


@pytest.mark.parametrize("kind", ["constant", "cosine", "wsd"])
@pytest.mark.parametrize("warmup", [0, 5])
def test_schedule_matches_the_reference_formula(kind, warmup):
    for s in range(TOTAL):
        assert lr_at(s, cfg(kind, warmup)) == pytest.approx(reference(kind, s, warmup), rel=1e-12)


def test_landmarks():
    c = cfg("cosine")
    assert lr_at(0, c) == PEAK / 5 and lr_at(4, c) == PEAK and lr_at(5, c) == PEAK
    assert lr_at(TOTAL - 1, c) == pytest.approx(PEAK * 0.1)
    w = cfg("wsd")
    assert lr_at(TOTAL - 11, w) == PEAK and lr_at(TOTAL - 10, w) < PEAK
    assert lr_at(TOTAL - 1, w) == pytest.approx(PEAK * 0.1)
    # a pure function of the step: asking again, or in another order, gives the same bits
    assert [lr_at(s, c) for s in reversed(range(TOTAL))][::-1] == [lr_at(s, c) for s in range(TOTAL)]


def test_old_configs_without_the_keys_run_at_a_constant_rate():
    assert all(lr_at(s, {"lr": PEAK, "num_steps": TOTAL}) == PEAK for s in range(TOTAL))


@pytest.mark.parametrize("bad,msg", [({"lr_schedule": "step"}, "lr_schedule"),
                                     ({"min_lr_ratio": -0.1}, "min_lr_ratio"),
                                     ({"warmup_steps": -2}, "warmup_steps")])
def test_check_names_the_field(bad, msg):
    with pytest.raises(ValueError, match=msg):
        check({**cfg("cosine"), **bad})
