"""The files next to a node's board: plans the agent hands its processes, reports they hand it.

Both are written whole (a reader sees all of a file or none), never through a link, and sealed
with the job's secret bound to the file's name (``file_context``); the directory they live in
is private to the job's user (``agent.shm``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CRASH = "crash"  # a report kind the agent posts at once under the process's own key (crash/<slot>)


def write_whole(path: Path, text: str) -> None:
    """Write ``path`` so that a reader sees all of ``text`` or no file (never through a link:
    the temporary file is created anew, ``O_EXCL | O_NOFOLLOW``)."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_file(path: Path) -> str:
    """A node file's text, never through a symbolic link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        return f.read()


def plan_file(node_dir: Path, generation: int) -> Path:
    """Plan ``generation``'s wire text for the node's processes, sealed (``file_context``)."""
    return Path(node_dir) / f"plan-{generation}.wire"


def report_file(node_dir: Path, index: int, n: int) -> Path:
    """The ``n``-th report of the process of local record ``index`` (``agent.client.NodeLink
    .report``): JSON ``{"g", "kind", "rank", "text"}``, sealed (``file_context``)."""
    return Path(node_dir) / f"report-{index}-{n}.json"


def file_context(path: Path) -> str:
    """The seal context of a node file: its name (a sealed plan or report cannot be replayed
    under another name; the directory is private to the job's user, ``agent.shm``)."""
    return f"node-file/{Path(path).name}"


def read_report(path: Path, seal, on_forged=None) -> dict | None:
    """A local process's report file (``report_file``), removed once read; None if it is missing,
    not JSON, or fails its seal (``on_forged(name)`` is then called)."""
    try:
        raw = read_file(path)
        path.unlink()
    except OSError:
        return None  # (the rank writes the file before the word: not expected)
    text = seal.open(file_context(path), raw)
    if text is None:
        if on_forged is not None:
            on_forged(path.name)
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None
