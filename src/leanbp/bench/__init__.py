"""`leanbp bench`: plain autograd, transformers gradient checkpointing and leanbp side by side."""

from ._run import ApproxBenchCase, BenchCase, run_approx_bench, run_bench

__all__ = ["ApproxBenchCase", "BenchCase", "run_approx_bench", "run_bench"]
