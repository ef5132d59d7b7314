"""Restoring folded weights bit for bit.

Folding gamma into a weight, W' = fl(W * gamma), loses information: fl(W' / gamma) equals W only
up to one unit in the last place in about a tenth of the entries (more in fp16 with small gammas).
``FoldRecord`` keeps, on the host, what makes the round trip exact: one 2-bit code per entry saying
which neighbour of fl(W' / gamma) the original was (0: itself, 1: the next float up, 2: the next
down, 3: none of them, with the exact value kept aside), computed in the dtype the fold was done in,
plus exact copies of the (small) bias vectors. That costs a sixteenth of an fp32 weight (an eighth
of a bf16 one) of host memory and nothing on the device.

The record restores the weight only while the folded weight is still what folding produced (it
checks fl(W * gamma) == W' bitwise); a weight trained since is unfolded by division, since there
is no original left to restore. A weight whose dtype was changed after folding (``model.to``) is
restored in the fold dtype and cast, which is what the cast would have done to the original.
"""

from __future__ import annotations

import torch

from ._activations import pack_2bit, unpack_2bit


class FoldRecord:
    """How to undo ``W' = W * gamma`` (and ``b' = b + W beta``) exactly, for one weight."""

    def __init__(self, original: torch.Tensor, folded: torch.Tensor, gamma: torch.Tensor,
                 bias: torch.Tensor | None = None, folded_bias: torch.Tensor | None = None):
        self.dtype = folded.dtype
        self.numel = folded.numel()
        unfolded = folded / gamma  # what plain division gives back
        up, down = torch.nextafter(unfolded, torch.full_like(unfolded, float("inf"))), torch.nextafter(
            unfolded, torch.full_like(unfolded, float("-inf")))
        codes = torch.full(folded.shape, 3, dtype=torch.uint8, device=folded.device)
        codes[down == original] = 2
        codes[up == original] = 1
        codes[unfolded == original] = 0
        del unfolded, up, down
        flat = codes.view(-1)
        self.other_index = torch.nonzero(flat == 3).flatten().cpu()
        self.other_value = original.reshape(-1)[self.other_index.to(original.device)].cpu()
        self.codes = pack_2bit(codes).cpu()  # Memory: 2 bits per entry, on the host
        self.bias = None if bias is None else bias.detach().cpu().clone()
        self.folded_bias = None if folded_bias is None else folded_bias.detach().cpu().clone()

    def weight(self, folded_now: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        """The original weight, in ``folded_now``'s dtype and device (division if it was trained)."""
        current = folded_now.detach()
        folded = current.to(self.dtype)
        g = gamma.to(device=current.device, dtype=self.dtype)
        unfolded = folded / g
        codes = unpack_2bit(self.codes.to(current.device), self.numel).view(folded.shape)
        candidate = torch.where(codes == 1, torch.nextafter(unfolded, torch.full_like(unfolded, float("inf"))),
                                torch.where(codes == 2, torch.nextafter(unfolded, torch.full_like(unfolded, float("-inf"))),
                                            unfolded))
        candidate.view(-1)[self.other_index.to(current.device)] = self.other_value.to(current.device, self.dtype)
        if torch.equal(candidate * g, folded) and torch.equal(folded.to(current.dtype), current):
            return candidate.to(current.dtype)
        return current / gamma.to(device=current.device, dtype=current.dtype)  # trained since folding

    def bias_or_none(self, folded_bias_now: torch.Tensor) -> torch.Tensor | None:
        """The original bias while the folded bias is unchanged (None: unfold it by subtraction)."""
        if self.bias is None or self.folded_bias is None:
            return None
        current = folded_bias_now.detach()
        if torch.equal(current.to(self.folded_bias.dtype).cpu(), self.folded_bias):
            return self.bias.to(device=current.device, dtype=current.dtype)
        return None
