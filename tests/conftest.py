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



# -- the suite's time budget (README: the whole suite in 15 minutes on 2 cores) --------------------
# Each test's setup and call are charged their CPU seconds (this process's and the children it
# waited for: torchrun ranks, planner pools), which a busy machine does not inflate as it does wall
# time. One phase over CPU_LIMIT_S fails: a test that slow should share fixtures, start fewer
# processes or use smaller shapes (the 2-core budget is 1,800 CPU seconds; a phase may take 1/8).
CPU_LIMIT_S = float(os.environ.get("LEANBP_TEST_CPU_LIMIT_S", 225))


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _charged(item, phase: str):
    start = _cpu_seconds()
    result = yield
    spent = _cpu_seconds() - start
    item.user_properties.append((f"cpu_s_{phase}", round(spent, 2)))
    if spent > CPU_LIMIT_S:
        pytest.fail(f"{phase} took {spent:.0f} CPU seconds, over the suite's per-test limit of {CPU_LIMIT_S:.0f} "
                    "(tests/conftest.py CPU_LIMIT_S)", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _charged(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _charged(item, "call"))


_CPU_BY_TEST: dict[str, float] = {}


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == f"cpu_s_{report.when}":
            _CPU_BY_TEST[report.nodeid] = _CPU_BY_TEST.get(report.nodeid, 0.0) + value


def pytest_terminal_summary(terminalreporter):
    """The suite reports its own costliest tests (CPU seconds of setup and call, children included)."""
    if not _CPU_BY_TEST:
        return
    worst = sorted(_CPU_BY_TEST.items(), key=lambda kv: -kv[1])[:15]
    terminalreporter.section(f"costliest tests (CPU s; limit {CPU_LIMIT_S:.0f} per phase, total "
                             f"{sum(_CPU_BY_TEST.values()):.0f})")
    for nodeid, seconds in worst:
        terminalreporter.write_line(f"{seconds:8.1f}  {nodeid}")


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


@pytest.fixture
def small_cases(monkeypatch):
    """The bench's cases in this process, on the bench models at a tiny shape; plan presets with 2
    layers."""
    from _helpers import TINY_SHAPE
    from leanbp.bench import _models, _run
    from leanbp.bench._case import run_any_case
    from leanbp.plan import PRESETS

    for shape in (_models.BENCH_QWEN3, _models.BENCH_LLAMA):
        for key, value in TINY_SHAPE.items():
            if key in shape:
                monkeypatch.setitem(shape, key, value)
    monkeypatch.setattr(_run, "_run_one", lambda spec, timeout_s: run_any_case(spec))
    for name, preset in list(PRESETS.items()):
        monkeypatch.setitem(PRESETS, name, {**preset, "num_hidden_layers": 2})
