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
