"""The node's private directory (board, doorbells, plan and report files), made so that no
other user can take it over.

Its path is predictable (``agent.__main__.node_dir``: ``/dev/shm/deadpool-<uid>-<hash>/nodeN``),
and ``/dev/shm`` is writable by every user (sticky, like /tmp). A parent made first by someone
else, left group- or world-writable, or a symbolic link to somewhere else would let that user
swap ``nodeN`` for their own before the ranks open the board and read plans from it. So
``make_node_dir``:

    parent  created here with mode 0700, or, if it exists, taken only when ``lstat`` shows a
            real directory (not a link) owned by this user with no group or other access;
            anything else is refused (``UnsafeNodeDir``), never repaired
    nodeN   whatever is there is removed without following it (a link is unlinked, a
            directory left by a killed agent of the same job removed), then made anew, 0700

Inside it, plan and report files are sealed with the job's secret (``agent.node.file_context``)
and opened with ``O_NOFOLLOW``: a planted file is refused, not read.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path


class UnsafeNodeDir(RuntimeError):
    """The node's directory cannot be made private to this user."""


def _check_private(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeNodeDir(f"{path} is a symbolic link; refusing to keep the node's board under "
                            "it (remove it if it is yours)")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeNodeDir(f"{path} exists and is not a directory")
    if st.st_uid != os.getuid():
        raise UnsafeNodeDir(f"{path} is owned by uid {st.st_uid}, not by this user (uid "
                            f"{os.getuid()}): another user made it first; refusing it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise UnsafeNodeDir(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: others could "
                            f"replace the node's files; it must be 0700 (`chmod 700 {path}` "
                            "if it is yours)")


def make_node_dir(where: Path) -> Path:
    """Make ``where`` (``<parent>/nodeN``) afresh, private to this user; returns it."""
    where = Path(where)
    parent = where.parent
    try:
        os.mkdir(parent, 0o700)
    except FileExistsError:
        pass
    _check_private(parent)
    try:
        st = os.lstat(where)
    except FileNotFoundError:
        st = None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(where)
        else:  # a link or a file: removed, never followed
            os.unlink(where)
    os.mkdir(where, 0o700)
    _check_private(where)
    return where
