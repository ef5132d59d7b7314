"""`leanbp bench`: plain autograd, transformers gradient checkpointing and leanbp side by side."""

from ._run import BenchCase, run_bench

__all__ = ["BenchCase", "run_bench"]
