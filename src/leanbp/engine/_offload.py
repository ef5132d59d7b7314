"""Host offload of the hidden states between decoder layers (``leanbp.stream(model, offload=True)``).

A streamed step keeps one tensor per decoder layer from the layer's forward to its backward, its
input (B, T, H), 288 KiB per token for Qwen3-8B in bf16, and in backward hands one (B, T, H)
gradient from layer to layer. With offload both live in host memory: the streamed layers take and
return host tensors, so autograd itself carries the layer boundaries and their gradients on the
host (a Function's gradient lives where its input does), and a layer moves only row blocks to the
device:

* forward: its input chunk by chunk, each chunk's output written straight back to the host;
* backward: the rows it needs in the order it needs them (``backward_reads``: the prefix rows for
  their K/V, then each chunk's input and output gradient, last chunk first), each chunk's input
  gradient written back over the output gradient rows it replaces.

The device holds the weights, their gradients and one layer's working set (its K/V and their
gradients, one chunk's recompute). The embedding output goes to the host before the first layer
(``to_host``); the last layer's output comes back whole for the final norm and the head
(``to_device``), and its gradient goes back to the host.

Copies run on a side stream, one block ahead of the compute that needs them; every Function waits
for its last copy before it returns, so a host tensor handed to autograd is always complete.
On CPU "device" and "host" are the same memory, but the store still copies both ways, the same
calls in the same order, so exactness and ordering are tested without a GPU; ``leanbp.memory``
counts the host side apart on every device.
"""

from __future__ import annotations

import torch

from ..memory import count_host_storage, host_allocations


def backward_reads(hidden: torch.Tensor, grad_out: torch.Tensor, chunks: list[tuple[int, int]]):
    """The host row blocks a streamed layer's backward reads, in order: the prefix rows block by
    block (for their K/V; the last chunk is never a prefix), then, from the last chunk to the
    first, the chunk's input rows and its output gradient rows."""
    return [(hidden, s, e) for s, e in chunks[:-1]] + \
        [(t, s, e) for s, e in reversed(chunks) for t in (hidden, grad_out)]


def _rows_of(host: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of a host tensor as (e - s, B, H): one contiguous range of its memory."""
    return host[:, start:end].transpose(0, 1)


class HostStore:
    """Host tensors of one streamed forward call and the copies between them and the device.

    A host tensor (B, T, H) lies in memory as (T, B, H): rows [s, e) of every batch row are then
    one contiguous range, so every block's copy is one transfer from (or into) pinned memory, for
    any batch (with batch-major memory a block of B > 1 rows is B ranges, which PyTorch stages
    through a pageable temporary and copies synchronously)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor (B, T, ...) with (T, B, ...) memory (pinned on CUDA, for asynchronous
        copies), counted as host memory."""
        batch, rows, *rest = shape
        with host_allocations():
            host = torch.empty((rows, batch, *rest), dtype=dtype, device="cpu", pin_memory=self.cuda)
        count_host_storage(host)
        return host.transpose(0, 1)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a host tensor laid out (and pinned) as this store makes them."""
        return t.device.type == "cpu" and t.transpose(0, 1).is_contiguous() and (not self.cuda or t.is_pinned())

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself if the store could have made it, else a copy in a store tensor (a gradient
        that autograd summed from two uses is an ordinary host tensor)."""
        if self.holds(t):
            return t
        host = self.empty(t.shape, t.dtype)
        host.copy_(t)
        return host

    def write(self, host: torch.Tensor, start: int, end: int, block: torch.Tensor) -> None:
        """Copy the device ``block`` (B, e - s, H) into rows [start, end) of ``host``, after the
        compute that made it: rearranged to (e - s, B, H) on the device (no copy for batch 1), then
        one transfer."""
        if not self.cuda:
            _rows_of(host, start, end).copy_(block.transpose(0, 1).contiguous())
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            staged = block.transpose(0, 1).contiguous()  # Memory: one block, for batch > 1
            _rows_of(host, start, end).copy_(staged, non_blocking=True)
        block.record_stream(self.side)  # Memory: the block is reused only after its copy

    # Memory: a whole-tensor move rearranges (T, B, H) <-> (B, T, H) this many rows at a time, so
    # for batch > 1 the device holds one such block beside the tensor, never a second copy of it
    WHOLE_BLOCK_ROWS = 4096

    def _whole_blocks(self, rows: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.WHOLE_BLOCK_ROWS, rows)) for s in range(0, rows, self.WHOLE_BLOCK_ROWS)]

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        """The whole device tensor (B, T, H) into a new host tensor, in row blocks."""
        host = self.empty(x.shape, x.dtype)
        for s, e in self._whole_blocks(x.shape[1]):
            self.write(host, s, e, x[:, s:e])
        self.finish()
        return host

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """The whole host tensor as a batch-major (B, T, H) device tensor, as without offload (the
        head views it as (B * T, H) rows: a (T, B, H) one would be copied whole there), in row
        blocks."""
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        if not self.cuda:
            for s, e in self._whole_blocks(host.shape[1]):
                out[:, s:e] = _rows_of(host, s, e).to(self.device, copy=True).transpose(0, 1)
            return out
        self.side.wait_stream(torch.cuda.current_stream(self.device))  # (out is allocated on this one)
        with torch.cuda.stream(self.side):
            for s, e in self._whole_blocks(host.shape[1]):
                out[:, s:e] = _rows_of(host, s, e).to(self.device, non_blocking=True).transpose(0, 1)
        torch.cuda.current_stream(self.device).wait_stream(self.side)
        out.record_stream(self.side)
        return out

    def reader(self, reads: list[tuple[torch.Tensor, int, int]]) -> "BlockReader":
        return BlockReader(self, reads)

    def finish(self) -> None:
        """Wait until every copy to the host is done (before a host tensor goes to autograd)."""
        if self.cuda:
            self.side.synchronize()


class BlockReader:
    """Device copies of host row blocks taken in a planned order; taking one starts the next one's
    copy, so each transfer overlaps the compute on the block before it."""

    def __init__(self, store: HostStore, reads: list[tuple[torch.Tensor, int, int]]):
        self._store = store
        self._reads = reads
        self._next = 0
        self._ahead = self._copy_in(0)

    def _copy_in(self, index: int):
        """(device block, ready event) of planned read ``index``, its copy started now; None past the end."""
        if index >= len(self._reads):
            return None
        host, start, end = self._reads[index]
        store = self._store
        if not store.cuda:
            return _rows_of(host, start, end).to(store.device, copy=True).transpose(0, 1).contiguous(), None
        with torch.cuda.stream(store.side):  # (after every write the side stream was given before)
            # one transfer of the contiguous range, then (B, e - s, H) on the device, as the layer
            # computes without offload (no copy for batch 1)
            block = _rows_of(host, start, end).to(store.device, non_blocking=True).transpose(0, 1).contiguous()
            ready = torch.cuda.Event()
            ready.record(store.side)
        return block, ready

    def take(self, host: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of ``host`` on the device: the next planned read."""
        if self._next >= len(self._reads) or self._reads[self._next][0] is not host or \
                self._reads[self._next][1:] != (start, end):
            raise RuntimeError(f"host rows [{start}, {end}) read out of the planned order")
        block, ready = self._ahead
        self._next += 1
        self._ahead = self._copy_in(self._next)
        if ready is not None:
            stream = torch.cuda.current_stream(self._store.device)
            stream.wait_event(ready)
            block.record_stream(stream)  # allocated on the side stream, used on this one
        return block


class _ToHost(torch.autograd.Function):
    """The embedding output moves to the host before the first streamed layer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, store: HostStore):
        ctx.store = store
        return store.to_host(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.store.to_device(grad), None


class _ToDevice(torch.autograd.Function):
    """The last layer's output comes back whole for the final norm and the head; its gradient
    goes to the host for the layers' backward."""

    @staticmethod
    def forward(ctx, host: torch.Tensor, store: HostStore):
        ctx.store = store
        return store.to_device(host)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.store.to_host(grad), None


def to_host(x: torch.Tensor, store: HostStore) -> torch.Tensor:
    return _ToHost.apply(x, store)


def to_device(host: torch.Tensor, store: HostStore) -> torch.Tensor:
    return _ToDevice.apply(host, store)
