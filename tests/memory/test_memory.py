"""leanbp.memory.track: live tensor bytes on CPU, split into params, grads and the rest."""

from __future__ import annotations

import torch
from torch import nn

import leanbp


def test_counts_live_bytes_and_frees():
    lin = nn.Linear(100, 100, bias=False)  # 40_000 B of params
    with leanbp.memory.track(lin) as mem:
        for _ in range(3):
            x = torch.empty(1000, 100)  # 400_000 B, freed every iteration
            del x
    r = mem.report
    assert r.params == 40_000 and r.grads == 0
    assert r.peak == 40_000 + 400_000
    assert r.activations == 400_000


def test_views_of_existing_tensors_are_not_allocations():
    lin = nn.Linear(200, 100, bias=False)
    with leanbp.memory.track(lin) as mem:
        w = lin.weight.t()  # a view of a parameter
        v = w[:10]
        del w, v
    assert mem.report.peak == mem.report.params


def test_module_called_many_times_with_backward():
    """The case torch's MemTracker refuses: a module called more than once per step."""
    lin = nn.Linear(64, 64, bias=False)  # 16_384 B
    x = torch.randn(32, 64, requires_grad=True)
    with leanbp.memory.track(lin) as mem:
        h = x
        for _ in range(4):
            h = lin(h)  # each (32, 64) output: 8_192 B, kept for backward
        h.sum().backward()
    r = mem.report
    assert r.grads == 16_384
    # at least the three saved intermediate outputs plus the last one were alive at once
    assert r.peak >= r.params + 4 * 8_192
    assert r.activations > 0
    assert set(r.as_mib()) == {"peak", "params", "grads", "activations", "host"} and r.host == 0


def test_a_module_without_parameters_is_measured_on_cpu():
    with leanbp.memory.track(nn.Identity()) as mem:
        x = torch.empty(1000)
        del x
    assert mem.report.params == 0 and mem.report.peak == 4000


def test_gradients_freed_inside_the_block_still_count_as_gradients():
    lin = nn.Linear(100, 100, bias=False)  # 40_000 B of params, 40_000 B of gradient
    x = torch.randn(8, 100)
    with leanbp.memory.track(lin) as mem:
        lin(x).sum().backward()
        lin.zero_grad(set_to_none=True)  # as an optimizer loop does inside the step
    r = mem.report
    assert r.grads == 40_000
    assert r.activations == r.peak - 80_000 and r.activations < 40_000
