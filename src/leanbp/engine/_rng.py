"""Random draws of a streamed layer replayed in its backward.

A layer in training may draw random numbers inside its chunks (PEFT's ``lora_dropout``, residual
dropout): the backward recomputes every chunk, and a recompute that drew afresh would differentiate a
function other than the one whose loss the forward computed. So the forward keeps the generators'
states before each chunk (only when the layer drew at all: the states after the layer are compared
with those before it), and the backward sets them back before recomputing a chunk, the way
``torch.utils.checkpoint`` does for one region. The generators are the CPU's and, for a chunk computed
on an accelerator, that device's (a CUDA generator's state is its seed and Philox offset).

Replaying also decides how the backward gets its prefix K/V: without draws, a K/V projection of the
rows suffices; with draws, the forward's chunks are rerun in order, because the K/V the forward saw
came after the draws of everything that ran before them in each chunk (the queries' LoRA dropout,
for one).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily


def _device_module(device: torch.device):
    """The ``torch.<type>`` module of an accelerator whose generator a chunk may draw from."""
    if device.type == "cpu":
        return None
    return getattr(torch, device.type, None)


# The generators' states are real tensors even while ``leanbp plan`` runs a step under
# FakeTensorMode (whose fake draws move no generator: nothing is replayed there), so they are read,
# compared and set outside it.

def _states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    with unset_fake_temporarily():
        module = _device_module(device)
        own = module.get_rng_state(device) if module is not None else None
        return torch.get_rng_state(), own


def _set(device: torch.device, states: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, own = states
    with unset_fake_temporarily():
        torch.set_rng_state(cpu)
        if own is not None:
            _device_module(device).set_rng_state(own, device)


def _same(a, b) -> bool:
    with unset_fake_temporarily():
        return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                   for x, y in zip(a, b))


class ChunkDraws:
    """The generator states before each chunk of one layer call, kept only if the call drew
    (without them, ``restore`` and ``replaying`` do nothing: the backward recomputes as it is)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.before: list[tuple] = []  # the states before chunk j (a few KiB each: the CPU's is 5 KiB)

    def mark(self) -> None:
        """Call before each chunk of the forward, in order."""
        self.before.append(_states(self.device))

    def drew(self) -> bool:
        """After the forward: whether any chunk drew (the states moved). When none did, the
        states are dropped and the backward recomputes without replaying."""
        if self.before and _same(self.before[0], _states(self.device)):
            self.before = []
        return self.replays

    @property
    def replays(self) -> bool:
        return bool(self.before)

    def restore(self, j: int) -> None:
        """The generators as they were before chunk j of the forward."""
        if self.replays:
            _set(self.device, self.before[j])

    @contextmanager
    def replaying(self):
        """A backward that replays: afterwards the generators are where the backward found them,
        so a training step draws the same numbers after its backward as plain autograd's would."""
        now = _states(self.device) if self.replays else None
        try:
            yield self
        finally:
            if now is not None:
                _set(self.device, now)


__all__ = ["ChunkDraws"]
