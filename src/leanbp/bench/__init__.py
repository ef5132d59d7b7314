"""`leanbp bench`: plain autograd, transformers gradient checkpointing and leanbp side by side."""

from ._run import ApproxBenchCase, BenchCase, TrlBenchCase, run_approx_bench, run_bench, run_trl_bench

__all__ = ["ApproxBenchCase", "BenchCase", "TrlBenchCase", "run_approx_bench", "run_bench", "run_trl_bench"]
