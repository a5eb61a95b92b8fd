"""The data's full checksums, off the critical path: a background thread of the launching process.

Launch checks only what costs no reading (``tokens.check``: the manifest, every file's size, the
tokenizer against ``model.vocab_size``, the splits' lengths): seconds for any corpus. Every
file's XXH3 is then computed here, once for the whole job (not once per rank), at the lowest
CPU priority, while the job starts and trains. A file that does not match its manifest
entry stops the job (``on_bad(message)``: the job's ``Stopper``, the path a signal takes: the
ranks leave in order) and the job ends ``failed`` with the message naming the file
(``job.run_job``). A job that ends first leaves the rest unchecked, and says so.

``data=megatron`` has no checksums; its token ids are checked against ``model.vocab_size`` the
same way (``BackgroundIds``) when the token dtype can hold a larger id and the ``.bin`` is too
large to read at launch (``megatron.check`` reads smaller ones before any process starts).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from deadpool.data import manifest as mf


class BackgroundVerify:
    """Checksums every file ``manifest`` names in ``directory`` on a daemon thread."""

    def __init__(self, directory, manifest: dict | None, on_bad, log=print):
        self.directory = Path(directory)
        self.files = mf.files(manifest) if manifest is not None else []
        self.on_bad, self.log = on_bad, log
        self.error: str | None = None
        self.checked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="data-verify", daemon=True)

    def start(self) -> "BackgroundVerify":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:  # a Linux thread has its own nice value: the job's own threads come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        for name, _, want in self.files:
            if self._stop.is_set():
                return
            try:
                got = mf.file_xxh3(self.directory / name)
            except OSError as e:
                got = f"unreadable ({e.strerror or e})"
            if got != want:
                self.error = (f"data.path={self.directory}: {name} is corrupted (xxh3 {got}, the "
                              f"manifest says {want}); prepare the directory again")
                self.log(f"[deadpool] {self.error}: stopping the job")
                self.on_bad(self.error)
                return
            self.checked += 1

    def finish(self, timeout_s: float = 0.0) -> None:
        """Stop checking (after up to ``timeout_s`` more); logs what was left unchecked."""
        self._thread.join(timeout_s)
        self._stop.set()
        if self.error is None and self.checked < len(self.files):
            self.log(f"[deadpool] data: {self.checked} of {len(self.files)} files' checksums "
                     "verified when the job ended (the rest were not read)")


class BackgroundIds(BackgroundVerify):
    """``data=megatron``: every token id of each prefix below ``vocab_size`` (``megatron.check_ids``)
    on a daemon thread; an id outside stops the job like a corrupted shard."""

    def __init__(self, prefixes: dict, vocab_size: int, on_bad, log=print):
        self.prefixes, self.vocab_size = prefixes, vocab_size  # {field: prefix}
        super().__init__(".", None, on_bad, log)
        self.files = list(prefixes)

    def _run(self) -> None:
        from deadpool.data import megatron
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        for field, prefix in self.prefixes.items():
            try:
                megatron.check_ids(megatron.read_index(prefix, field), self.vocab_size, field,
                                   stop=self._stop.is_set)
            except ValueError as e:
                self.error = str(e)
                self.log(f"[deadpool] {self.error}: stopping the job")
                self.on_bad(self.error)
                return
            if self._stop.is_set():
                return
            self.checked += 1
