"""The coordinator's line for a rank's report: gloo's lost-peer transport errors (the survivors'
side of a rank that died, texts as gloo raises them) are named as such, not echoed raw."""

from deadpool.recovery.report_text import is_peer_gone, summarize

RESET = ("replication of step 12 failed: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
         "pair.cc:537] Read error [127.0.0.1]:60583: Connection reset by peer. This is typically "
         "caused by a remote worker hanging or bugs in the application. Check the logs of the "
         "remote worker before reporting an error.")
GLHF = ("all_reduce failed: [../third_party/gloo/gloo/transport/tcp/pair.cc:590] "
        "GLHF! \U0001f3d6\ufe0f Connection closed by peer [127.0.0.1]:41231")


def test_a_lost_peer_is_one_line_saying_what_it_is():
    for text in (RESET, GLHF):
        line = summarize(text)
        assert is_peer_gone(text)
        assert "gloo/transport" not in line and "GLHF" not in line and "typically caused" not in line
        assert "\n" not in line and "expected symptom of a rank that died" in line
    assert summarize(RESET).startswith("replication of step 12 failed: Read error [127.0.0.1]:60583: "
                                       "Connection reset by peer (gloo:")


def test_other_reports_are_kept_as_they_are():
    text = "loss is nan at step 7 " + "x" * 400
    assert not is_peer_gone(text) and summarize(text) == text[:300]
    assert not is_peer_gone("Connection reset by peer")  # not gloo's transport text
