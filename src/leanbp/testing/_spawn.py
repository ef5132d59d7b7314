"""Cases run on spawned CPU processes (gloo): the processes start once for a list of cases."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def _rank(rank: int, world: int, init: str, run_case, cases: list[dict], folder: str) -> None:
    """One process: joins the gloo group, runs every case (an error is that case's result, so the
    others still run), writes its results to ``folder/rank{rank}.json``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = []
    try:
        for fields in cases:
            try:
                results.append(run_case(fields))
            except Exception as e:  # (every rank meets the same error in step)
                results.append(dict(error=f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(results))


def spawn_cases(run_case, cases: list[dict], world: int) -> list[list[dict]]:
    """``run_case(fields) -> dict`` (a module-level function) for every case, on each of ``world``
    spawned processes. Returns, per case, every rank's result."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{os.path.join(folder, 'rendezvous')}"
        mp.spawn(_rank, args=(world, init, run_case, cases, folder), nprocs=world)
        per_rank = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]
    return [list(results) for results in zip(*per_rank)]
