"""One bf16 planner of the tiny shape for the tests that can share its fake models and lines
(each new planner probes its lines afresh: tens of seconds)."""

from __future__ import annotations

import pytest

from _helpers import plan_config
from leanbp import StreamConfig
from leanbp.plan import Planner


@pytest.fixture(scope="session")
def bf16_planner():
    return Planner(plan_config(), dtype="bf16", stream=StreamConfig(chunk_size=512, head_chunk_size=1024))
