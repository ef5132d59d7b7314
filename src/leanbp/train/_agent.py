"""``python -m leanbp.train._agent <torchrun's arguments>``: torchrun's agent as ``leanbp train
--nproc`` runs it (the launcher, ``_launcher.py``, builds the command).

It is torchrun (``torch.distributed.run``), with three differences:

* it dies with the launcher (``_ranks.die_with_parent``), and tells its ranks its pid, so that
  they die with it;
* a run whose ranks failed with leanbp's own exit codes (2: an error, 3: a non-finite step),
  having printed their one line (the others stopped by torchrun), ends with that code and nothing
  more: torchrun's report of the
  failure (a log line per failure, the closing signals it sent, and a ``ChildFailedError``
  traceback of about 30 lines) says nothing the line did not, and buried it;
* any other failure (a rank killed by a signal, a Python traceback) gets torchrun's whole report,
  as under a plain torchrun.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from ._ranks import PARENT_ENV, die_with_parent

EXPLAINED = (2, 3)  # the exit codes of `leanbp train` after it printed what went wrong


class _HeldReport(logging.Filter):
    """Holds back torchrun's log lines about failed and closed workers until the run's end says
    whether they are needed."""

    def __init__(self, handler: logging.Handler):
        super().__init__()
        self.handler = handler
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name.startswith("torch.distributed.elastic") and record.levelno >= logging.WARNING and (
                "exitcode" in message or "closing signal" in message):
            self.held.append(record)
            return False
        return True

    def release(self) -> None:
        """Print what was held, and hold nothing from now on."""
        self.handler.removeFilter(self)
        held, self.held = self.held, []
        for record in held:
            self.handler.handle(record)


def _hold_reports() -> list[_HeldReport]:
    handlers, logger = set(), logging.getLogger("torch.distributed.elastic")
    while logger is not None:  # (torch puts handlers on "torch" and "torch.distributed", which do not propagate)
        handlers.update(logger.handlers)
        logger = logger.parent
    filters = []
    for handler in handlers:
        held = _HeldReport(handler)
        handler.addFilter(held)
        filters.append(held)
    return filters


def main(argv: list[str]) -> int:
    expected = os.environ.get(PARENT_ENV)
    die_with_parent(int(expected) if expected else None)
    os.environ[PARENT_ENV] = str(os.getpid())  # (the ranks inherit it: their parent must be this process)

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    held = _hold_reports()
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        code = _explained(sorted((rank, f.exitcode) for rank, f in e.failures.items()))
        if code is not None:
            return code
        _release(held)
        raise
    except BaseException:
        _release(held)
        raise
    return 0


def _explained(codes: list[tuple[int, int]]) -> int | None:
    """The exit code of a failure the ranks explained: some rank exited with one of leanbp's codes
    and the others did too or were stopped by torchrun (SIGTERM, sent to the ranks still running
    once one has failed); None for any other failure."""
    ours = [code for _, code in codes if code in EXPLAINED]
    if ours and all(code in EXPLAINED or code == -signal.SIGTERM for _, code in codes):
        return ours[0]
    return None


def _release(held: list[_HeldReport]) -> None:
    for h in held:
        h.release()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
