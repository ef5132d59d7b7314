"""Random directions over a model's trainable parameters that are never stored.

A zeroth-order step moves the parameters along a Gaussian direction z, z_i ~ N(0, I) for every
trainable tensor p_i (the ones with ``requires_grad``: with LoRA, the adapters only). z is as large
as the trainable parameters, so it is never held: each z_i is drawn again from its own seed whenever
it is needed, one tensor at a time,

    seed of the step  s = mix(run seed, step)
    z_i               = randn(p_i.shape, generator seeded with mix(s, i))

and a step touches each parameter four times with the same z_i: +mu z (first forward), -2 mu z
(second forward), +mu z (restore) and -lr g z (update); the last two are one pass (``add_`` with
mu - lr g). Seeding each tensor on its own makes z_i independent of the order the tensors are
visited in and of how many there are before it in a pass.

# Memory: one parameter's z_i at a time (the largest trainable tensor), freed before the next.

Rounding: ``p.add_(z, alpha=a)`` rounds once per element, so theta + mu z - 2 mu z + mu z is theta
only up to a few units in the last place: |restored - theta| <= 3 u (|theta| + 2 mu |z|) elementwise
(u = 2**-24 in float32, 2**-53 in float64; tests/zo checks the bound). That drift is far below the
update itself (lr |g z|) and is what MeZO and DPZero accept; bfloat16 (u = 2**-8) is refused by
``leanbp train`` for it.

z_i is drawn on the parameter's device with that device's generator, so a CPU run and a CUDA run
draw different (equally Gaussian) directions from the same seed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn


def mix(*parts: int | str) -> int:
    """A 63-bit seed from ``parts`` (BLAKE2b of their text): different parts give unrelated seeds,
    unlike ``seed + step``, where runs with neighbouring seeds would share most directions."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def trainable_parameters(model_or_params: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a direction spans: a module's parameters that need gradients, in
    ``parameters()`` order (stable for a model loaded again, so a resumed run draws the same z),
    each once (tied weights are one tensor)."""
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    out, seen = [], set()
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    if not out:
        raise ValueError("no trainable parameter (requires_grad) to perturb")
    return out


class Direction:
    """A Gaussian direction z over ``params``, regenerated from ``seed`` whenever it is read.

    >>> z = Direction(params, seed)
    >>> z.add_(mu)           # theta + mu z, one z_i at a time
    >>> z.dot(grads)         # <z, g>, for tests
    """

    def __init__(self, params: Sequence[torch.Tensor], seed: int):
        self.params = list(params)
        self.seed = int(seed)

    def tensor(self, i: int) -> torch.Tensor:
        """z_i: a fresh tensor of ``params[i]``'s shape, dtype and device, the same bits every time."""
        p = self.params[i]
        generator = torch.Generator(device=p.device).manual_seed(mix(self.seed, i))
        return torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(p_i, z_i) pairs; z_i is dropped by the caller before the next is drawn."""
        for i, p in enumerate(self.params):
            yield p, self.tensor(i)

    @torch.no_grad()
    def add_(self, scale: float) -> None:
        """theta += scale * z, in place (one rounding per element)."""
        if scale == 0.0:
            return
        for p, z in self:
            p.add_(z, alpha=scale)
            del z  # (before the next z_i is drawn: one at a time)

    def dot(self, tensors: Sequence[torch.Tensor]) -> float:
        """<z, t> summed over the parameters, in float64."""
        if len(tensors) != len(self.params):
            raise ValueError(f"expected {len(self.params)} tensors, got {len(tensors)}")
        return float(sum((z.double() * t.double()).sum() for (_, z), t in zip(self, tensors)))

    def numel(self) -> int:
        return sum(p.numel() for p in self.params)
