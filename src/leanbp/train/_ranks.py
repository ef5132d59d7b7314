"""What makes the processes of one run behave as one: they die with what launched them, and an
error they all meet is said once.

**Dying with the launcher.** ``leanbp train --nproc N`` starts torchrun's agent, which starts the
N ranks, each in a session of its own: a ``kill -9`` of the launcher's process group (a shell, a
watchdog, the OOM killer) reaches neither the ranks nor, if only the launcher is hit, the agent, and
nothing else tells them. Each of them (the agent, and every rank started by torchrun, ours or a plain
one) therefore arms Linux's parent-death signal at start: the kernel sends it SIGKILL the moment the
thread that started it ends. Chosen over a watchdog that polls the parent because the kernel
delivers it whatever the process is doing (inside a long kernel of C++ code, holding the GIL, or
stuck in a collective), at once, and with no thread of ours in a healthy run; torchrun starts its
ranks from its main thread, which lives as long as the agent, so it never fires while the agent
lives. SIGKILL, not SIGTERM: a rank must stop, not run the rest of a step or a checkpoint write;
what it leaves half-written is a temporary folder that the next run removes (``_checkpoint``), and
the newest complete checkpoint stays as it is. Where the signal does not exist (macOS, other
Unixes), a daemon thread polls the parent instead (every 0.2 s).

**One error, said once.** An error every rank meets (bad data, a non-finite step) is printed by
the first rank that has it; the others exit with the same code, silently. The ranks agree on who
is first through a file created with O_EXCL in a folder of the launch (``LEANBP_ERROR_DIR``, set by
``leanbp train --nproc``; under a plain torchrun, one per torchrun run in the temporary folder).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_ENV = "LEANBP_PARENT_PID"  # the pid a child of ours must find as its parent
ERROR_DIR_ENV = "LEANBP_ERROR_DIR"


def launched_by_torchrun() -> bool:
    """This process is a rank started by torchrun (even a world of one)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def several_processes() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def parent_death_signal_available() -> bool:
    """Linux's prctl(PR_SET_PDEATHSIG) exists here (the suite answers this both ways)."""
    return sys.platform.startswith("linux") and ctypes.util.find_library("c") is not None


def die_with_parent(expected_parent: int | None = None) -> None:
    """SIGKILL this process when its parent ends (at once if its parent is no longer
    ``expected_parent``: that one has ended already and this process was re-parented)."""
    parent = os.getppid()
    if expected_parent is not None and parent != expected_parent:
        os.kill(os.getpid(), signal.SIGKILL)
    if parent_death_signal_available():
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=_watch_parent, args=(parent,), name="leanbp-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # (it ended between the check and the arming)
        os.kill(os.getpid(), signal.SIGKILL)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_torchrun() -> None:
    """In a rank started by torchrun: die with its agent (which passes its pid when it is ours)."""
    expected = os.environ.get(PARENT_ENV)
    die_with_parent(int(expected) if expected else None)


def first_to_report() -> bool:
    """Whether this process is the one of its launch to print an error (always, outside torchrun)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if folder is None:
        if run is None or int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return True
        folder = Path(tempfile.gettempdir()) / "leanbp-errors" / run
    marker = Path(folder) / f"reported-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # (no temporary folder to agree through: better twice than never)
        return True
    return True


__all__ = ["ERROR_DIR_ENV", "PARENT_ENV", "die_with_parent", "die_with_torchrun", "first_to_report",
           "launched_by_torchrun", "parent_death_signal_available", "several_processes"]
