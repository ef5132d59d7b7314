"""Cases run on spawned CPU processes (gloo): the processes start once for a list of cases."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def spawn_cases(worker, cases: list[dict], world: int) -> list[list[dict]]:
    """Run ``worker(rank, world, init, cases, folder)`` on ``world`` spawned processes; each rank
    writes its list of results (one per case) to ``folder/rank{r}.json``. Returns, per case, every
    rank's result."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{os.path.join(folder, 'rendezvous')}"
        mp.spawn(worker, args=(world, init, cases, folder), nprocs=world)
        per_rank = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]
    return [list(results) for results in zip(*per_rank)]
