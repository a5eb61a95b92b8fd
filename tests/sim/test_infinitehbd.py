"""The real InfiniteHBD half-trace: reading it, replaying it, fitting a generator on it, predicting."""

import json
import math
import time

import numpy as np
import pytest

from sim import fit_trace, infinitehbd, predict_trace
from sim.infinitehbd import Episode
from sim.simulate import run_one
from sim.trace import DAY_S


@pytest.fixture(scope="module")
def episodes():
    return infinitehbd.load()


def test_half_trace_counts_as_its_readme_says(episodes):
    """621 events: 312 fault starts on 159 servers, 3 still open at day 174 (ending there)."""
    assert len(episodes) == 312
    assert len({ep.server for ep in episodes}) == 159
    open_ = [ep for ep in episodes if ep.censored]
    assert len(open_) == 3 and all(ep.end_d == infinitehbd.HORIZON_DAYS for ep in open_)
    assert max(ep.start_d for ep in episodes) < 174.0
    assert (infinitehbd.HALF_TRACE.parent / "LICENSE").exists() and (infinitehbd.HALF_TRACE.parent / "NOTICE").exists()


def test_pairing_rejects_an_end_without_a_start(tmp_path):
    ev = [{"node_id": "a", "event_time": 1.0, "event_type": "fault_end",
           "fault_type": {"Level": "Hardware Failure", "Class": "GPU", "Desc": "x"}}]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(ev))
    with pytest.raises(ValueError, match="none open"):
        infinitehbd.load(p)


def test_to_trace_puts_the_job_spares_and_outside_servers_by_a_seeded_shuffle(episodes):
    tr = infinitehbd.to_trace(episodes, 368, 32, seed=0)
    assert len(tr) == 312 and tr.num_nodes == 400
    perm = infinitehbd.server_permutation(0)
    # a server's faults all land on the slot that the shuffle gave it, with the trace's repair time
    ep = episodes[0]
    slot = int(np.where(perm == ep.server)[0][0])
    i = int(np.argmin(np.abs(tr.time_s - ep.start_d * DAY_S) + (tr.node != slot) * 1e12))
    assert tr.node[i] == slot and tr.duration_s[i] == pytest.approx(ep.repair_d * DAY_S)
    other = infinitehbd.to_trace(episodes, 368, 32, seed=1)
    assert not np.array_equal(np.sort(tr.node[tr.node < 368]), np.sort(other.node[other.node < 368]))


def test_fault_classes_map_to_what_the_strategy_must_do():
    assert infinitehbd.cause_of("Hardware Failure", "Parameter Plane Cable") == "network_switch_cable"  # a hang
    assert infinitehbd.cause_of("Hardware Failure", "Power Supply") == "psu"  # the host goes down
    assert infinitehbd.cause_of("Hardware Failure", "GPU") == "faulty_gpu"  # a process exits
    assert "software_bug" in infinitehbd.TRANSIENT


def test_a_link_fault_is_detected_as_a_hang_a_gpu_fault_as_a_crash(layout, calib, strategy_cfgs):
    """Two single-fault traces from real classes: the link fault waits detect_hang_s, the GPU fault
    detect_crash_s (the calibration's lists decide)."""
    lay = layout()
    c = calib | {"detect_crash_s": 5.0, "detect_hang_s": 60.0}
    T = 1.0
    det = {}
    for cls in ("Parameter Plane Cable", "GPU"):
        ep = Episode(0, 0.1, 0.2, "Hardware Failure", cls, "", False)
        tr = infinitehbd.to_trace([ep], 8, 2, seed=0, horizon_d=T, population=10)
        r = run_one("deadpool", strategy_cfgs("deadpool"), c, lay, tr, T * DAY_S, 1e9)
        det[cls] = r["badput_detection_h"] * 3600 if r["failures"] else None
    hit = [k for k, v in det.items() if v is not None]
    for k in hit:  # the fault lands on a job slot for seed 0 in both runs (same server, same slot)
        assert det[k] == pytest.approx(60.0 if k == "Parameter Plane Cable" else 5.0)
    assert hit


@pytest.mark.slow
def test_replay_every_strategy_on_the_half_trace_in_seconds():
    from sim.replay_trace import replay

    t0 = time.perf_counter()
    rows, tl, servers = replay(seeds=1)
    assert time.perf_counter() - t0 < 60
    by = {r["strategy"]: r for r in rows}
    assert {"deadpool", "checkpoint_restart", "injob_restart", "trainmover", "elastic_spares"} <= set(by)
    for r in rows:
        assert abs(r["accounting_error_s"]) < 1e-6 * 174 * DAY_S
        assert 0 < r["failures"] <= 312
    # the spare-holding strategies see the same failures (same slots until a swap moves nodes)
    assert by["deadpool"]["failures"] == by["inmem_restart"]["failures"]
    assert {t["strategy"] for t in tl} >= set(by) and servers


def _synthetic(rng, n_servers=400, horizon=174.0, shape=0.6, rate=0.005, k=None, repair=(0.5, 2.0)):
    """Episodes from a known model: gamma(shape) per-server rates, exponential (k None) or Weibull
    renewal times, Weibull repairs (shape, scale)."""
    lam = rng.gamma(shape, rate / shape, n_servers)
    eps = []
    for s in range(n_servers):
        t = 0.0
        while True:
            gap = rng.exponential(1 / lam[s]) if k is None else rng.weibull(k) / lam[s] / math.gamma(1 + 1 / k)
            t += gap
            if t >= horizon:
                break
            d = repair[1] * rng.weibull(repair[0])
            eps.append(Episode(s, t, t + d, "Hardware Failure", "GPU", "", False))
    return sorted(eps, key=lambda e: e.start_d)


def test_fit_recovers_a_known_generator():
    """Gamma shape 0.6, Weibull repairs k 0.5: the fit finds both (within sampling error), prefers
    the negative binomial over the Poisson, and does not reject exponential renewal times that
    are exponential; a Weibull k = 0.5 renewal is told apart."""
    rng = np.random.default_rng(1)
    eps = _synthetic(rng, n_servers=2000, rate=0.01)
    model, rep = fit_trace.fit(eps, population=2000)
    assert model.nb_shape == pytest.approx(0.6, rel=0.3)
    assert rep["per_server_counts"]["lr_p"] < 1e-3
    assert rep["repair_d"]["weibull"]["params"][0] == pytest.approx(0.5, rel=0.15)
    assert rep["repair_d"]["weibull"]["ks_p"] > 0.01
    assert rep["time_between_failures_d"]["weibull"]["params"][0] == pytest.approx(1.0, abs=0.12)
    eps_w = _synthetic(np.random.default_rng(2), n_servers=2000, rate=0.01, shape=50.0, k=0.5)
    _, rep_w = fit_trace.fit(eps_w, population=2000)
    assert rep_w["time_between_failures_d"]["exponential"]["ks_p"] < 1e-3
    assert rep_w["time_between_failures_d"]["weibull"]["params"][0] == pytest.approx(0.5, abs=0.1)


def test_laplace_and_loglinear_trend():
    rng = np.random.default_rng(3)
    flat = rng.uniform(0, 100, 2000)
    assert abs(fit_trace.laplace_z(flat, 100.0)) < 3
    assert abs(fit_trace.loglinear_trend(flat, 100.0)) < 0.005
    rising = 100 * np.sqrt(rng.uniform(0, 1, 2000))  # intensity proportional to t
    assert fit_trace.laplace_z(rising, 100.0) > 5
    assert fit_trace.loglinear_trend(rising, 100.0) > 0.01


def test_sampler_reproduces_the_half_it_was_fitted_on(episodes):
    """No trend (multiplier 1), days 0-174 again: about the 312 fault starts, bursts clustered in
    days as in the data (daily dispersion ~4.7, not a Poisson stream's 1), and the servers that
    failed most in days 0-174 fail most again (their identity is kept)."""
    model, rep = fit_trace.fit(episodes)
    rng = np.random.default_rng(0)
    starts, disp, by_server = [], [], np.zeros(400)
    for _ in range(40):
        fut = predict_trace.sample_future(model, [], rng, 1.0, 0.0, 174.0)
        starts.append(len(fut))
        daily = np.bincount(np.array([ep.start_d for ep in fut]).astype(int), minlength=174)[:174]
        disp.append(daily.var(ddof=1) / daily.mean())
        for ep in fut:
            by_server[ep.server] += 1
    assert np.mean(starts) == pytest.approx(312, rel=0.1)
    assert np.mean(disp) == pytest.approx(rep["bursts"]["daily_dispersion_index"], rel=0.35)
    counts = np.asarray(model.counts)
    assert by_server[counts >= 5].mean() > 5 * by_server[counts == 0].mean()
    # a server that is down starts nothing: no two faults of one server overlap
    fut = predict_trace.sample_future(model, episodes, np.random.default_rng(1), 1.0)
    last_end = {}
    for ep in sorted(fut, key=lambda e: e.start_d):
        assert ep.start_d >= last_end.get(ep.server, -1.0) - 1e-9
        last_end[ep.server] = ep.end_d


def test_prediction_file_has_the_names_relied_on():
    path = fit_trace.OUT / "prediction_days_174_348.json"
    pred = json.loads(path.read_text())
    for key in ("fault_starts", "unavailable_server_fraction", "median_repair_days"):
        assert set(pred[key]) == {"mean", "lo", "hi"} and pred[key]["lo"] <= pred[key]["mean"] <= pred[key]["hi"]
    assert pred["job"]["servers"] == 368 and pred["job"]["spares"] == 32
    assert {"deadpool", "checkpoint_restart", "injob_restart", "trainmover", "elastic_spares"} <= set(pred["ettr"])
    for v in pred["ettr"].values():
        assert 0 < v["lo"] <= v["mean"] <= v["hi"] <= 1
