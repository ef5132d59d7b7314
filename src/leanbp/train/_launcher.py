"""``leanbp train --nproc N``: one command that runs N ranks on this machine as one run.

    launch(nproc, argv, cfg) = check the run (config, model, data, OUT) once, here
                               -> torchrun's agent (``_agent.py``) -> N ranks of ``leanbp train``

What can be found wrong before any process starts is found here and said once: the run's settings,
a model path that is no model, data that is missing, torn or too short, a run folder that holds
another run or is in use by a live one. The agent dies with this process and the ranks die with
the agent (``_ranks.py``), so a ``kill -9`` of this process (or its process group) leaves no rank
running; the main rank holds the run folder's lock (``_run_lock.py``) for the run's life.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from ..distributed import torchrun_command
from ._config import TrainConfig
from ._data import TokenData, load_tokenizer
from ._models import model_config
from ._outputs import check_run_folder
from ._ranks import ERROR_DIR_ENV, PARENT_ENV
from ._run_lock import RunLock
from ._trl import load_records, trl_modules

LAUNCHER_ENV = "LEANBP_LAUNCHER_PID"  # (named in the run folder's lock, so a refused run can say what to stop)


def check_run(cfg: TrainConfig, world: int) -> None:
    """Raise what a run of ``cfg`` on ``world`` processes would refuse, touching nothing: the model,
    its tokenizer and the data load (the weights are not read), the run folder can be used."""
    RunLock.check_free(Path(cfg.out))  # (first: a live run there is the one thing to say)
    if world % cfg.sp:
        raise ValueError(f"--sp {cfg.sp} must divide --nproc {world}: each group of {cfg.sp} ranks shares a sequence")
    if cfg.engine == "pipeline" and world % cfg.stages:
        raise ValueError(f"--engine pipeline --stages {cfg.stages} runs one stage per process: pass --nproc {cfg.stages} "
                         f"(or a multiple of it: pipelines side by side; or leave --nproc out)")
    config = model_config(cfg.model, cfg.seq_len)
    tokenizer = load_tokenizer(cfg.model, config.vocab_size)
    if cfg.objective == "lm":
        TokenData(tokenizer, cfg.data, cfg.seq_len, seed=cfg.seed)
    else:
        trl_modules()
        load_records(cfg.objective, cfg.data, cfg.seed)
    check_run_folder(cfg, world)


def launch(nproc: int, argv: list[str], cfg: TrainConfig) -> int:
    """Run ``leanbp <argv>`` (its ``--nproc`` left out) in ``nproc`` processes under torchrun,
    after ``check_run``; returns the ranks' exit code (0, 2 for an error they explained, 3 for a
    non-finite step, torchrun's 1 for anything else)."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    check_run(cfg, nproc)
    command, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            command.append(arg)
    if "--engine" not in command and not any(a.startswith("--engine=") for a in command):
        command += ["--engine", cfg.engine]
    with tempfile.TemporaryDirectory(prefix="leanbp-launch-") as errors:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               PARENT_ENV: str(os.getpid()), LAUNCHER_ENV: str(os.getpid()), ERROR_DIR_ENV: errors}
        return subprocess.run(torchrun_command(nproc, "leanbp", command, runner="leanbp.train._agent"),
                              env=env).returncode


__all__ = ["check_run", "launch"]
