"""Trace files: CSV round trip, errors that name the line, add/remove node traces."""

import numpy as np
import pytest

from sim.trace import ADD, DAY_S, REMOVE, TraceSpec, generate
from sim.trace_io import TraceFormatError, load_addremove, load_csv, save_csv


def test_csv_round_trip(tmp_path):
    spec = TraceSpec(name="x", unexpected_per_1000_node_days=20.0, planned_per_1000_node_days=2.0)
    tr = generate(spec, 300, 30 * DAY_S, seed=1)
    p = tmp_path / "t.csv"
    save_csv(tr, p)
    back = load_csv(p)
    assert back.num_nodes == tr.num_nodes and back.horizon_s == tr.horizon_s
    np.testing.assert_array_equal(back.time_s, tr.time_s)
    np.testing.assert_array_equal(back.node, tr.node)
    np.testing.assert_array_equal(back.event, tr.event)
    np.testing.assert_array_equal(back.duration_s, tr.duration_s)
    assert [back.causes[c] for c in back.cause] == [tr.causes[c] for c in tr.cause]
    np.testing.assert_array_equal(back.transient, tr.transient)


@pytest.mark.parametrize("body, line, words", [
    ("time_s,node,event,cause,duration_s\n1.0,2,fail,gpu,5\n2.0,x,fail,gpu,5\n", 3, "node 'x'"),
    ("time_s,node,event,cause,duration_s\n1.0,2,explode,gpu,5\n", 2, "event 'explode'"),
    ("time_s,node,event,cause,duration_s\n5.0,2,fail,gpu,5\n1.0,2,fail,gpu,5\n", 3, "backwards"),
    ("time_s,node,event,cause,duration_s\n1.0,2,fail,gpu\n", 2, "expected 5 fields"),
    ("# comment\ntime,node\n", 2, "header"),
    ("time_s,node,event,cause,duration_s\nabc,2,fail,gpu,5\n", 2, "time_s 'abc'"),
    ("time_s,node,event,cause,duration_s\n1.0,2,fail,gpu,-5\n", 2, "duration_s"),
])
def test_bad_csv_names_the_line(tmp_path, body, line, words):
    p = tmp_path / "bad.csv"
    p.write_text(body)
    with pytest.raises(TraceFormatError, match=words) as e:
        load_csv(p)
    assert e.value.line == line
    assert f"bad.csv:{line}:" in str(e.value)


def test_addremove_loader(tmp_path):
    p = tmp_path / "spot.txt"
    p.write_text("# spot trace, milliseconds\ntime,event,node\n0,add,a\n0,add,b\n1000,add,c\n"
                 "60000,remove,a\n120000 add a\n")
    tr = load_addremove(p, time_unit_s=0.001, num_nodes=3)
    assert tr.num_nodes == 3
    np.testing.assert_allclose(tr.time_s, [0, 0, 1, 60, 120])
    assert tr.event.tolist() == [ADD, ADD, ADD, REMOVE, ADD]
    assert tr.initially_down.tolist() == [2]  # c joins at 1 s; a and b are there at t=0


def test_addremove_bad_line(tmp_path):
    p = tmp_path / "spot.txt"
    p.write_text("0,add,a\n10,vanish,a\n")
    with pytest.raises(TraceFormatError, match=r"spot.txt:2: event 'vanish'"):
        load_addremove(p)
