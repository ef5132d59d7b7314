"""Property-based exactness: random family, batch, length, padding side and lengths, packed
documents, prompt boundary, chunk and head-chunk sizes, tied heads and sliding windows; every
float64 gradient within 1e-12 of plain autograd. Fixed seed, a bounded number of cases in CI
(``benchmarks/exactness_properties.py`` runs more)."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402

from leanbp.testing import check_case, exact_cases  # noqa: E402

CASES = 200


@settings(max_examples=CASES, derandomize=True, deadline=None, database=None)
@given(exact_cases())
def test_random_cases_are_exact(case):
    assert check_case(case) <= 1e-12, case
