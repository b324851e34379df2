"""The journal file that survives its writers' deaths (`SafeJournalFileBackend`).

Appends hold an flock(2) on `<journal>.flock`, which the kernel releases when a writer dies, so a
process killed inside an append leaves no lock behind (Optuna's own symlink lock, made from a
relative path, leaves a dangling link that hangs every later writer); an append that fails (disk
full) truncates what it wrote; and a torn record, left by a writer killed mid-write, is moved aside
to `<journal>.torn-<time>` before anything is appended after it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

# optuna.storages._heartbeat and optuna.storages.journal._file are private (no public name);
# what this module relies on (the heartbeat base class, for which Optuna beats and fails stale
# trials; the journal lock's base class and context) is pinned by tests/test_private_apis.py.
import filelock
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock
from optuna.storages.journal._file import BaseJournalFileLock, get_lock_file

LOCK_SUFFIX = ".flock"  # beside the journal: the lock its appends hold
TORN_SUFFIX = ".torn-"  # beside the journal: bytes of a record whose writer died mid-write
RECOVERED_SUFFIX = ".recovered-"  # beside the journal: its records, kept when it vanished
LOCK_WARN_S = 10.0  # say that the journal lock is taking long, this often
_RECORD_START = b'{"op_code":'  # every record of Optuna's journal begins so
_log = logging.getLogger(__name__)


class JournalWriteError(OSError):
    """The journal could not be written (a full disk, a read-only or vanished filesystem).
    Nothing of the failed append is left in it: the study resumes once the cause is gone."""


class JournalLost(JournalWriteError):
    """The journal was deleted, replaced by another file or truncated while this process had
    it open: its offsets no longer point at records, so nothing more is read or written. What
    this process could still read of the old file is in `recovered` (None: nothing was)."""

    def __init__(self, message: str, recovered: Path | None):
        super().__init__(message)
        self.recovered = recovered


class FlockJournalLock(BaseJournalFileLock):
    """An exclusive flock(2) on `<journal>.flock` (or another `suffix`), through filelock's
    UnixFileLock. The kernel releases it when its holder dies, however it dies, so no stale
    lock is ever left behind. Local filesystems, NFS (v3 with lockd, v4) and Lustre or GPFS
    mounted with flock support it; a wait longer than `warn_s` is said, with the lock's path
    and `held_by`, every `warn_s`. Each thread holds it through a descriptor of its own, so
    threads exclude each other as processes do (a thread taking it again only counts)."""

    def __init__(
        self,
        journal: Path,
        suffix: str = LOCK_SUFFIX,
        held_by: str = "another process is writing the study (a stopped or hung one holds it "
        "until it ends)",
        warn_s: float | None = None,  # None: LOCK_WARN_S
    ):
        self.path = Path(f"{journal}{suffix}")
        self.held_by = held_by
        self.warn_s = warn_s
        self._lock = self._flock()

    def _flock(self) -> filelock.UnixFileLock:
        # No soft fallback: where flock is missing, the backend uses Optuna's symlink lock
        # (_flock_works), as every other writer of the journal then does.
        return filelock.UnixFileLock(
            self.path, mode=0o644, poll_interval=0.01, fallback_to_soft=False
        )

    def __getstate__(self) -> dict[str, Any]:  # a pickled storage (a launcher's worker)
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = self._flock()

    def acquire(self) -> bool:
        started = time.monotonic()
        while True:
            try:
                self._lock.acquire(timeout=self.warn_s or LOCK_WARN_S)
                return True
            except filelock.Timeout:
                waited = time.monotonic() - started
                _log.warning("waiting %.0f s for the lock %s: %s", waited, self.path, self.held_by)

    def release(self) -> None:
        self._lock.release()


def _flock_works(journal: Path) -> bool:
    lock = FlockJournalLock(journal)
    try:
        lock.acquire()
    except OSError as error:
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise
    lock.release()
    return True


class SafeJournalFileBackend(JournalFileBackend):
    """Optuna's journal file, safe against its writers' deaths and a full disk:
    - appends hold a FlockJournalLock (Optuna's symlink lock on a filesystem without flock);
    - the path is absolute, so no lock or message depends on the working directory;
    - an append that fails truncates the journal back to where it began, and raises
      JournalWriteError;
    - bytes after the last complete record (a writer killed mid-write) are moved aside to
      `<journal>.torn-<time>` before the next append, and at open also a record that a
      later append was glued onto (the next record is kept). `notes` says what was moved;
    - the journal deleted, replaced or truncated under a running study stops it (JournalLost)
      instead of replaying records at offsets of another file: the old file, still open
      here, is copied to `<journal>.recovered-<time>` first."""

    def __init__(self, path: str | Path):
        journal = Path(path).absolute()
        journal.parent.mkdir(parents=True, exist_ok=True)
        lock = (
            FlockJournalLock(journal)
            if _flock_works(journal)
            else JournalFileSymlinkLock(str(journal))
        )
        super().__init__(str(journal), lock_obj=lock)
        self.lock = lock  # our own reference: the backend's (`_lock`) is private
        self.path = journal
        self.notes: list[str] = []
        self._opened = False
        _remove_dangling_link(Path(f"{journal}.lock"), self.notes)
        with get_lock_file(self.lock):
            self._repair()
            self._hold()
        self._opened = True

    def __getstate__(self) -> dict[str, Any]:  # a pickled storage (a launcher's worker)
        return {k: v for k, v in self.__dict__.items() if k not in ("_held", "_identity", "_lost")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._hold()

    def _hold(self) -> None:
        """Keep the journal open: deleted or replaced, its bytes stay readable through this
        descriptor until the process ends (O_CLOEXEC: no child inherits it)."""
        self._lost: JournalLost | None = None
        self._held = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        stat = os.fstat(self._held)
        self._identity = (stat.st_dev, stat.st_ino)

    def __del__(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.close(self._held)

    def read_logs(self, log_number_from: int) -> Any:
        self._check_same_file()
        return super().read_logs(log_number_from)

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        data = ("\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n").encode()
        # Unbuffered: every byte the kernel took is one `_write` knows of, and none is left
        # in a buffer for closing the file to flush after the cut below (the tail of a
        # record, which a running worker then fails to parse).
        with get_lock_file(self.lock):
            self._check_same_file()
            self._append(data)

    def _append(self, data: bytes) -> None:
        with open(self.path, "a+b", buffering=0) as f:
            end = f.seek(0, os.SEEK_END)
            try:
                if end and _byte_at(f, end - 1) != b"\n":
                    end = self._cut_torn_tail(f, end)
                self._write(f, data)
            except OSError as error:
                _truncate_quietly(f, end)
                raise JournalWriteError(
                    error.errno,
                    f"the study's journal {self.path} could not be written "
                    f"({os.strerror(error.errno) if error.errno else error}); nothing was lost "
                    "but the record being written. Free the space (or fix the filesystem) and "
                    "run the same command again: the study resumes",
                ) from None

    def _check_same_file(self) -> None:
        """Raise JournalLost where the path is no longer the file this process replayed:
        deleted, another file in its place, or shorter than the records already read (a
        torn tail cut by a writer is never that short)."""
        if self._lost is not None:  # said once; its file recovered once
            raise self._lost
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            what = "deleted"
        else:
            replayed = max(self._log_number_offset.values())  # bytes of records read here
            if (stat.st_dev, stat.st_ino) != self._identity:
                what = "replaced by another file"
            elif stat.st_size < replayed:
                what = f"truncated ({stat.st_size} bytes of the {replayed} already read)"
            else:
                return
        recovered = self._recover() if not what.startswith("truncated") else None
        kept = (
            f"its records up to now are kept in {recovered}: to go on with this study, put "
            f"them back (mv {recovered} {self.path}) and run the same command again"
            if recovered is not None
            else "its records before the cut are gone from it"
        )
        self._lost = JournalLost(
            f"the study's journal {self.path} was {what} while the study ran; the study stops "
            f"here, and every trial's MLflow run is kept. {kept[0].upper()}{kept[1:]}; to start "
            "a new study instead, give a new search.study_name (or search.storage)",
            recovered,
        )
        raise self._lost

    def _recover(self) -> Path | None:
        """The old file's bytes, read through the descriptor held since open, beside it."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        recovered = self.path.with_name(f"{self.path.name}{RECOVERED_SUFFIX}{stamp}-{os.getpid()}")
        try:
            with os.fdopen(os.dup(self._held), "rb") as old, open(recovered, "wb") as f:
                old.seek(0)
                shutil.copyfileobj(old, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            return None
        return recovered

    @staticmethod
    def _write(f: Any, data: bytes) -> None:
        """All of `data`, to the file's end (O_APPEND), through write(2) itself: a short
        write is continued, and the first error raised with nothing of it buffered."""
        view = memoryview(data)
        while view:
            view = view[os.write(f.fileno(), view) :]
        os.fsync(f.fileno())

    def _cut_torn_tail(self, f: Any, end: int) -> int:
        """Move the bytes after the last newline aside; the new end of the journal."""
        keep = _last_newline(f, end) + 1
        f.seek(keep)
        torn = f.read(end - keep)
        self._set_aside([torn], f"{end - keep} bytes of a record whose writer died mid-write")
        os.ftruncate(f.fileno(), keep)
        os.fsync(f.fileno())
        return keep

    def _repair(self) -> None:
        """At open: every record complete. A torn tail is cut; a line that does not parse
        (a torn record with the next one appended to it) keeps the record it ends with."""
        data = self.path.read_bytes()
        *lines, tail = data.split(b"\n")
        kept, torn = [], []
        for line in lines:
            record, scrap = _whole_record(line)
            if scrap:
                torn.append(scrap)
            if record is not None:
                kept.append(record)
        if not torn:
            if tail:
                with open(self.path, "a+b") as f:
                    self._cut_torn_tail(f, len(data))
            return
        if tail:
            torn.append(tail)
        self._set_aside(torn, "a torn record" if len(torn) == 1 else f"{len(torn)} torn records")
        fresh = self.path.with_name(f".{self.path.name}.{os.getpid()}.repair")
        with open(fresh, "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        fresh.replace(self.path)

    def _set_aside(self, pieces: list[bytes], what: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = self.path.with_name(f"{self.path.name}{TORN_SUFFIX}{stamp}-{os.getpid()}")
        with open(aside, "ab") as f:
            f.write(b"\n".join(pieces) + b"\n")
        note = (
            f"the study's journal held {what}; the complete records are kept and the "
            f"torn bytes moved to {aside}"
        )
        self.notes.append(note)
        if self._opened:  # at open, the driver prints the notes with its others
            _log.warning(note)


def _byte_at(f: Any, offset: int) -> bytes:
    f.seek(offset)
    return f.read(1)


def _last_newline(f: Any, end: int, block: int = 1 << 16) -> int:
    """Offset of the last newline before `end` (-1: none)."""
    stop = end
    while stop > 0:
        start = max(0, stop - block)
        f.seek(start)
        found = f.read(stop - start).rfind(b"\n")
        if found >= 0:
            return start + found
        stop = start
    return -1


def _whole_record(line: bytes) -> tuple[bytes | None, bytes]:
    """(the record the line holds, or None; the bytes of it that are no record)."""
    try:
        json.loads(line)
        return line, b""
    except ValueError:
        pass
    cut = line.rfind(_RECORD_START, 1)
    while cut > 0:
        try:
            json.loads(line[cut:])
            return line[cut:], line[:cut]
        except ValueError:
            cut = line.rfind(_RECORD_START, 1, cut)
    return None, line


def _truncate_quietly(f: Any, size: int) -> None:
    with contextlib.suppress(OSError):  # the write's own error is the one to report
        os.ftruncate(f.fileno(), size)


def _remove_dangling_link(link: Path, notes: list[str]) -> None:
    """Optuna's symlink lock of a relative journal path points nowhere; one left by a killed
    writer of an older batchfit would be taken for a live lock by Optuna."""
    if link.is_symlink() and not link.exists():
        link.unlink(missing_ok=True)
        notes.append(f"removed {link}, a lock left by a writer that died (it pointed nowhere)")
