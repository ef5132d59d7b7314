"""One run folder, one owner: a kernel lock on ``OUT/.leanbp.lock`` for the whole life of a run.

Checkpoints survive a writer that dies (``_checkpoint``), not a second live writer: two runs on one
folder would prune, rename and point at each other's checkpoints. So the main rank of a run takes an
exclusive ``flock`` on a file in OUT before it reads or changes anything there, and holds it until the
run ends. The kernel releases a ``flock`` when the holding process dies, however it dies (``kill -9``
included), so a lock left by a dead run never blocks a ``--resume``: there is nothing stale to clean.
The file also names its holder (pid, host, rank, launcher, start time) so that a refused run can say
which process to wait for or stop; those words are only read for that message, never trusted for the
lock itself.

On a network filesystem: Linux's NFS client turns ``flock`` into an NFS lock on the whole file
(since 2.6.12), so runs on different machines exclude each other on NFSv4, and on NFSv3 where the
lock manager (NLM) runs. A machine that dies holding the lock holds it until the server reclaims it
(NFSv4's lease, about 90 s). Mounted with ``nolock`` or ``local_lock=flock`` (and on filesystems
without locks, some FUSE mounts), a lock excludes only the runs of the same machine. Where the
filesystem refuses locks altogether, the run goes on unlocked with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path

LOCK_FILE = ".leanbp.lock"


class RunFolderBusy(ValueError):
    """Another live run holds the run folder."""


class RunLock:
    """``with RunLock(out):`` holds OUT for this process (``acquire`` / ``release`` by hand too)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.path = self.out / LOCK_FILE
        self._file = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise ``RunFolderBusy`` naming the run that holds it."""
        self._file = self._take(self.path)
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()
            self._file.write(json.dumps(_holder()) + "\n")
            self._file.flush()
        return self

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    @classmethod
    def check_free(cls, out: Path) -> None:
        """Raise ``RunFolderBusy`` if a live run holds ``out`` (taking and dropping the lock at once:
        the launcher's check before it starts any process)."""
        if (Path(out) / LOCK_FILE).exists():
            cls(out)._check()

    def _check(self) -> None:
        file = self._take(self.path)
        if file is not None:
            fcntl.flock(file, fcntl.LOCK_UN)
            file.close()

    @staticmethod
    def _take(path: Path):
        """The open, locked file; None where the filesystem has no locks (warned)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        file = open(path, "a+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read()
            file.close()
            raise RunFolderBusy(f"{path.parent} is in use by a running leanbp train ({_describe(holder)}); wait for "
                                "it to end or stop it, or choose another --out") from None
        except OSError as e:
            file.close()
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                raise
            warnings.warn(f"{path.parent}: this filesystem refuses file locks ({e.strerror}); the run folder is not "
                          "protected against a second run writing into it", stacklevel=3)
            return None
        return file


def _holder() -> dict:
    """Who holds the lock: this process, its rank, and what launched it."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "rank": int(os.environ.get("RANK", "0")),
            "world": int(os.environ.get("WORLD_SIZE", "1")), "launcher": os.environ.get("LEANBP_LAUNCHER_PID"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv[1:])[:300]}


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        words = f"pid {holder['pid']} on {holder['host']}"
    except (ValueError, KeyError, TypeError):  # (written between our open and its lock: no words yet)
        return "its process is starting"
    if holder.get("world", 1) > 1:
        words += f", rank {holder['rank']} of {holder['world']}"
    if holder.get("launcher"):
        words += f", launched by `leanbp train --nproc` as pid {holder['launcher']}"
    return f"{words}, since {holder.get('started', '?')}"


__all__ = ["LOCK_FILE", "RunFolderBusy", "RunLock"]
