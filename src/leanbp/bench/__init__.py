"""``leanbp bench``: plain autograd, transformers' gradient checkpointing and leanbp (and the
Approx-BP rows, and TRL's trainers) side by side, each case in its own process.

    _run.py       the suites: cases, their processes, the tables, CSV, JSON and plots
    _case.py      one case of the core and approx suites (``python -m leanbp.bench._case SPEC``)
    _trl_case.py  one case of the TRL suite
    _peers.py     the strongest exact single-device peers (checkpointing + tiled loss; ALST's recipe)
    _models.py    the bench models
    _machine.py   what a measurement ran on
    _timing.py    timing a step on any device
"""

from ._case import build_case_model
from ._machine import describe_machine, machine
from ._models import BENCH_LLAMA, BENCH_MODELS, BENCH_QWEN3, bench_config
from ._peers import PEERS, peer_loss, prepare_peer
from ._run import (BENCH_DTYPES, PEERS_SUITE, ApproxBenchCase, BenchCase, TrlBenchCase, format_approx_table,
                   format_table, format_trl_table, run_approx_bench, run_bench, run_trl_bench)
from ._timing import synchronize
from ._trl_case import TRL_METHODS, TRL_OBJECTIVES

__all__ = ["ApproxBenchCase", "BENCH_DTYPES", "BENCH_LLAMA", "BENCH_MODELS", "BENCH_QWEN3", "BenchCase", "PEERS",
           "PEERS_SUITE", "peer_loss", "prepare_peer",
           "TRL_METHODS", "TRL_OBJECTIVES", "TrlBenchCase", "bench_config", "build_case_model", "describe_machine",
           "format_approx_table", "format_table", "format_trl_table", "machine", "run_approx_bench", "run_bench",
           "run_trl_bench", "synchronize"]
