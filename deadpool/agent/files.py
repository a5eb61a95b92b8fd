"""The files next to a node's board: plans the agent hands its processes, reports they hand it.

Both are written whole (a reader sees all of a file or none), never through a link, and sealed
with the job's secret bound to the file's name (``file_context``); the directory they live in
is private to the job's user (``agent.shm``).
"""

from __future__ import annotations

import os
from pathlib import Path

CRASH = "crash"  # a report kind the agent posts at once under the process's own key (crash/<slot>)


def write_whole(path: Path, text: str) -> None:
    """Write ``path`` so that a reader sees all of ``text`` or no file (never through a link:
    the temporary file is created anew, ``O_EXCL | O_NOFOLLOW``)."""
    path = os.fspath(path)  # (strings, not pathlib, on this path: a recovery writes one per rank)
    tmp = os.path.splitext(path)[0] + ".tmp"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        data = memoryview(text.encode("utf-8"))
        while data:  # (a write may take less than it was given)
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_file(path: Path) -> str:
    """A node file's text, never through a symbolic link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8")


def plan_file(node_dir: Path, generation: int) -> Path:
    """Plan ``generation``'s wire text for the node's processes, sealed (``file_context``)."""
    return Path(node_dir) / f"plan-{generation}.wire"


def report_file(node_dir: Path, index: int, n: int) -> Path:
    """The ``n``-th report of the process of local record ``index`` (``agent.client.NodeLink
    .report``): ``report_text``, sealed (``file_context``)."""
    return Path(report_path(os.fspath(node_dir), index, n))


def report_path(node_dir: str, index: int, n: int) -> str:
    """``report_file`` as a string (the reports' own path: no pathlib per report)."""
    return f"{node_dir}/report-{index}-{n}.txt"


def file_context(path: Path) -> str:
    """The seal context of a node file: its name (a sealed plan or report cannot be replayed
    under another name; the directory is private to the job's user, ``agent.shm``)."""
    return f"node-file/{os.path.basename(path)}"


def report_text(generation: int, kind: str, rank: int, text: str) -> str:
    """A report as the rank seals it: ``"<g> <kind> <rank>"``, a newline, then its text as it is
    (no JSON around a text that is JSON already: two encodings less per rank and recovery)."""
    return f"{int(generation)} {kind} {int(rank)}\n{text}"


def read_report(path: Path, seal, on_forged=None, raw: str | None = None) -> dict | None:
    """A local process's report, ``{"g", "kind", "rank", "text"}``: ``raw`` (from its mailbox
    on the board) or else its file (``report_file``, removed once read); None if it is missing,
    malformed, or fails its seal (``on_forged(name)`` is then called)."""
    if raw is None:
        try:
            raw = read_file(path)
            os.unlink(path)
        except OSError:
            return None  # (the rank writes the file before the word: not expected)
    text = seal.open(file_context(path), raw)
    if text is None:
        if on_forged is not None:
            on_forged(os.path.basename(path))
        return None
    head, _, body = text.partition("\n")
    try:
        g, kind, rank = head.split(" ")
        return {"g": int(g), "kind": kind, "rank": int(rank), "text": body}
    except ValueError:
        return None
