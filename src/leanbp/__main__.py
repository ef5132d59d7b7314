"""``python -m leanbp`` (what ``torchrun --nproc_per_node=N -m leanbp train ...`` runs on each rank)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
