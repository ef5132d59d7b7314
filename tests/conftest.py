"""Tiny random-init models of every supported family, built from configs (never downloaded)."""

from __future__ import annotations

import os

# Triton kernels run on CPU tensors only in its interpreter; set before anything imports triton
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import transformers

from leanbp.testing import randomize_for_checks
from leanbp.models import supported_model_types
from leanbp.models import tiny_config as leanbp_tiny_config

def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the suite's default, pyproject.toml): one worker per core, at most 8 (each
    worker holds its own tiny models and planner; more rarely pays on a shared machine)."""
    return max(1, min(8, os.cpu_count() or 1))


def pytest_configure(config):
    # Workers side by side share the cores: each gets its share of intra-op threads instead of
    # every worker starting one thread per core (oversubscribed, the suite ran slower than alone).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))



FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # the Llama family: the deepest engine tests run on it
# every registered family (adding a family = an adapter with its tiny_config + a registry line)
ALL_FAMILIES = supported_model_types()


def tiny_config(family: str, window: int | None = None, **overrides):
    """A 2-layer model small enough for float64 gradient checks in well under a second."""
    return leanbp_tiny_config(family, window, **overrides)


def tiny_model(family: str, dtype=torch.float64, seed: int = 0, window: int | None = None, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(family, window, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return randomize_for_checks(model).train()


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="session")
def bf16_planner():
    """One bf16 planner of the plan tests' tiny shape, for the tests that can share its fake models
    and lines (each new planner probes its lines afresh: tens of seconds)."""
    from _helpers import plan_config
    from leanbp import StreamConfig
    from leanbp.plan import Planner

    return Planner(plan_config(), dtype="bf16", stream=StreamConfig(chunk_size=512, head_chunk_size=1024))
