"""Host offload of the layer inputs (``leanbp.stream(model, offload=True)``).

A streamed step keeps one tensor per decoder layer from the layer's forward to its backward: its
input (B, T, H), 288 KiB per token for Qwen3-8B in bf16. With offload that tensor waits in host
memory instead, and it never comes back whole: a layer's backward reads its input in row blocks
(the chunks, in the order ``backward_ranges`` gives), each copied to the device just before it is
needed. The device holds the weights, the gradients and one layer's working set; the host holds
L x B x T x H.

Forward: when a layer has run, its input is copied to a pinned host buffer on a side stream, and
the device copy is released once that copy is done (the caller drops its reference; the allocator
is told the side stream still reads it). Backward: taking a block waits for its copy and starts the
copy of the next block in backward order (one block ahead, across layer boundaries too), so the
transfers overlap the chunks' compute.

On CPU "device" and "host" are the same memory, but the store still copies both ways, the same
calls in the same order, so exactness and ordering are tested without a GPU; ``leanbp.memory``
counts the host side apart on every device.
"""

from __future__ import annotations

import torch

from ..memory import count_host_storage, host_allocations


def backward_ranges(chunks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The row blocks a streamed layer's backward reads, in order: the prefix rows block by block
    (for their K/V; the last chunk is never a prefix), then every chunk from last to first."""
    return chunks[:-1] + chunks[::-1]


class _Slot:
    """One layer input in host memory and the blocks its backward will read, in order."""

    def __init__(self, host: torch.Tensor, device: torch.device, ranges: list[tuple[int, int]]):
        self.host = host
        self.device = device
        self.ranges = ranges
        self.next = 0  # index into ranges of the next block to be read


class HostStore:
    """The offloaded layer inputs of one streamed forward call, in layer order."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self._slots: list[_Slot | None] = []
        self._ahead = None  # (slot index, range index, device block, ready event): the prefetched block

    def put(self, hidden: torch.Tensor, ranges: list[tuple[int, int]]) -> int:
        """Start copying ``hidden`` (B, T, H) to the host; returns its slot. The caller must not
        keep ``hidden``: dropping it is what frees the device memory."""
        with host_allocations():
            host = torch.empty(hidden.shape, dtype=hidden.dtype, device="cpu", pin_memory=self.cuda)
        count_host_storage(host)
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream(hidden.device))  # hidden is written
            with torch.cuda.stream(self.side):
                host.copy_(hidden, non_blocking=True)
            hidden.record_stream(self.side)  # Memory: its block is reused only after the copy
        else:
            host.copy_(hidden)
        self._slots.append(_Slot(host, hidden.device, ranges))
        return len(self._slots) - 1

    def _copy_in(self, slot: _Slot, start: int, end: int):
        """(device block, ready event) of rows [start, end), the copy started now."""
        if not self.cuda:
            return slot.host[:, start:end].to(slot.device, copy=True), None
        # (ordered after the host copy's write: the same side stream)
        with torch.cuda.stream(self.side):
            block = slot.host[:, start:end].to(slot.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.side)
        return block, ready

    def rows(self, index: int, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of slot ``index`` on the device: the slot's next planned block."""
        slot = self._slots[index]
        if slot is None or slot.next >= len(slot.ranges) or slot.ranges[slot.next] != (start, end):
            raise RuntimeError("offloaded layer input read out of order (a second backward through the graph "
                               "needs offload=False)")
        if self._ahead is not None and self._ahead[:2] == (index, slot.next):
            block, ready = self._ahead[2:]
        else:
            block, ready = self._copy_in(slot, start, end)
        self._ahead = None
        if ready is not None:
            stream = torch.cuda.current_stream(slot.device)
            stream.wait_event(ready)
            block.record_stream(stream)  # allocated on the side stream, used on this one
        slot.next += 1
        if slot.next == len(slot.ranges):
            self._slots[index] = None  # Memory: the host copy is read for the last time
        self._prefetch(index)
        return block

    def _prefetch(self, index: int) -> None:
        """Start copying the block that backward reads next: this slot's, or the first of the layer below."""
        for i in (index, index - 1):
            slot = self._slots[i] if i >= 0 else None
            if slot is not None and slot.next < len(slot.ranges):
                self._ahead = (i, slot.next, *self._copy_in(slot, *slot.ranges[slot.next]))
                return
