"""``python -m leanbp`` (what ``torchrun --nproc_per_node=N -m leanbp train ...`` runs on each rank)."""

import os
import sys

from .cli import main

if __name__ == "__main__":
    code = main()
    from .train import launched_by_torchrun, several_processes

    if launched_by_torchrun() and several_processes():
        # A rank has written, closed and synchronised everything by now (the loop's finish ends
        # with a barrier and destroys its group), but the interpreter's teardown can still abort in
        # a C++ thread of a communication library ("terminate called without an active exception",
        # seen once in 850 FSDP2 runs on CPU), turning a finished run into a failed launch: leave
        # without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    sys.exit(code)
