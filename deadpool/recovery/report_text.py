"""What a rank's error report means, in one console line: gloo's transport errors named as such.

When a rank dies mid-step, its peers' open gloo pairs fail: the survivor's replication or
collective raises gloo's own text, e.g. ``[.../gloo/transport/tcp/pair.cc:537] Read error
[127.0.0.1]:60583: Connection reset by peer. This is typically caused by a remote worker hanging
...`` or ``... GLHF! Connection closed by peer``. That is the expected symptom of the failure the
recovery then handles, not a second fault; the coordinator's report line says so (``summarize``)
instead of echoing the C++ source path and gloo's advice. Any other text is kept as it is. (gloo's
own C++ log lines go where each rank's stderr goes: ``logs/slot<N>.log`` in the run directory.)
"""

from __future__ import annotations

import re

_GLOO = re.compile(r"\[[^\]]*gloo/[^\]]*\]\s*")  # "[/.../gloo/transport/tcp/pair.cc:537] "
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "GLHF",
              "Read error", "Write error", "Connection refused")
_ADVICE = re.compile(r"\.? ?This is typically caused by .*$", re.S)


def is_peer_gone(text: str) -> bool:
    """True for gloo's transport error when the other end of a pair went away."""
    return bool(_GLOO.search(text)) and any(s in text for s in _PEER_GONE)


def summarize(text: str, limit: int = 300) -> str:
    """``text`` for the console: a lost-peer transport error as one line naming what it is."""
    if not is_peer_gone(text):
        return text[:limit]
    what = _ADVICE.sub("", _GLOO.sub("", text)).replace("GLHF! \U0001f3d6\ufe0f ", "")
    what = " ".join(what.replace("GLHF!", "").split())
    return (f"{what[:limit]} (gloo: a peer's connection closed, the expected symptom of a rank "
            "that died; the recovery below replaces it)")
