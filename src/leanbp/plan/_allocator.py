"""A model of PyTorch's CUDA caching allocator, replayed on the allocations of a fake step.

A step's tensors do not decide alone whether it fits a GPU: PyTorch's allocator reserves memory from
the driver in segments and caches what is freed, and a free block can only serve a request it is
large enough for. A step whose loss makes 16 GiB tensors of two sizes can fail with enough free
bytes in total but no free block large enough. The planner's default reserve holds back a flat
share for this (``CudaReserve.fragmentation``); ``replay`` plays a step's allocations and frees
through the allocator's rules instead, and ``needed_capacity`` finds the device memory with which
the step runs without running out.

The rules are those of the native allocator with the default settings (no ``max_split_size_mb``,
no expandable segments, no garbage collection threshold), from c10/cuda/CUDACachingAllocator.cpp:

* A request is rounded up to a multiple of 512 bytes. Up to 1 MiB it is served from the small pool,
  above from the large pool; a block never moves between pools.
* The smallest free block of the pool that holds the request serves it (best fit; equal sizes:
  the lower address). A block is split when the rest is at least 512 bytes (small pool) or more
  than 1 MiB (large pool); the rest stays free.
* Without such a block a segment is reserved from the driver (``cudaMalloc``): 2 MiB for a small
  request, 20 MiB for a large one under 10 MiB, else the request rounded up to 2 MiB.
* A freed block merges with the free blocks beside it in its segment.
* When the driver has no room, every cached segment that is wholly free is given back and the
  reservation is tried again; if it still does not fit, the step is out of memory.

One stream: a step's allocations and frees in program order (the order the fake step's ops ran,
which is the order autograd runs them on the device too). Not modelled: other streams (offload's
copy stream, NCCL's), the allocations of libraries that bypass the allocator (cuBLAS workspaces and
the CUDA context: ``CudaReserve`` keeps those), and expandable segments.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_BLOCK = 512  # every request is rounded up to a multiple of this (kMinBlockSize)
SMALL_REQUEST = 1 << 20  # requests up to this size come from the small pool
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20  # the segment of a large request under MIN_LARGE_SEGMENT
MIN_LARGE_SEGMENT = 10 << 20
ROUND_LARGE = 2 << 20

# A trace: (key, nbytes) in program order, nbytes > 0 allocates the block called key, nbytes < 0
# frees it. Keys are any hashable; each alloc's key is freed at most once.
Trace = list


class OutOfMemory(Exception):
    def __init__(self, request: int, reserved: int, allocated: int, capacity: int):
        super().__init__(f"out of memory: a request of {request} bytes with {reserved} reserved, {allocated} "
                         f"allocated, of {capacity}")
        self.request, self.reserved, self.allocated, self.capacity = request, reserved, allocated, capacity


class _Block:
    __slots__ = ("ptr", "size", "small", "used", "prev", "next")

    def __init__(self, ptr: int, size: int, small: bool):
        self.ptr, self.size, self.small, self.used = ptr, size, small, False
        self.prev: _Block | None = None
        self.next: _Block | None = None


def round_request(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MIN_LARGE_SEGMENT:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class CachingAllocator:
    """The allocator's state on one device of ``capacity`` bytes (``None``: no limit)."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0
        self._free = {True: [], False: []}  # small pool?, sorted (size, ptr) of free blocks
        self._by_ptr: dict[int, _Block] = {}  # free blocks by address
        self._next_ptr = 0  # (segments get addresses in the order they are reserved)

    # -- the pools' free lists ------------------------------------------------------------------
    def _cache(self, block: _Block) -> None:
        block.used = False
        bisect.insort(self._free[block.small], (block.size, block.ptr))
        self._by_ptr[block.ptr] = block

    def _uncache(self, block: _Block) -> None:
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.ptr))]
        del self._by_ptr[block.ptr]

    # -- malloc / free --------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> _Block | None:
        if nbytes <= 0:  # (an empty storage takes no memory)
            return None
        size = round_request(nbytes)
        small = size <= SMALL_REQUEST
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = self._by_ptr[pool[i][1]]
            self._uncache(block)
        else:
            block = self._reserve(size, small)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_REQUEST:
            remainder = _Block(block.ptr + size, rest, small)
            remainder.prev, remainder.next = block, block.next
            if block.next is not None:
                block.next.prev = remainder
            block.next, block.size = remainder, size
            self._cache(remainder)
        block.used = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block | None) -> None:
        if block is None:
            return
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.used:
                self._uncache(neighbour)
                if neighbour is block.prev:
                    block.ptr, block.prev = neighbour.ptr, neighbour.prev
                    if block.prev is not None:
                        block.prev.next = block
                else:
                    block.next = neighbour.next
                    if block.next is not None:
                        block.next.prev = block
                block.size += neighbour.size
        self._cache(block)

    def _reserve(self, size: int, small: bool) -> _Block:
        grant = segment_size(size)
        if self.capacity is not None and self.reserved + grant > self.capacity:
            self.release_cached()
            if self.reserved + grant > self.capacity:
                raise OutOfMemory(size, self.reserved, self.allocated, self.capacity)
        block = _Block(self._next_ptr, grant, small)
        self._next_ptr += grant
        self.reserved += grant
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def release_cached(self) -> None:
        """Give back every segment that is wholly free (``torch.cuda.empty_cache()``, and what the
        allocator does itself before it reports out of memory)."""
        for small in (True, False):
            for size, ptr in list(self._free[small]):
                block = self._by_ptr[ptr]
                if block.prev is None and block.next is None:
                    self._uncache(block)
                    self.reserved -= block.size


@dataclass(frozen=True)
class Replay:
    """What a replay of a step found: the largest allocated and reserved bytes (``capacity`` None:
    nothing was given back for want of room), or the request that ran out (``oom``)."""

    peak_allocated: int
    peak_reserved: int
    oom: OutOfMemory | None = None

    @property
    def fits(self) -> bool:
        return self.oom is None


def replay(trace: Trace, resident=(), capacity: int | None = None, steps: int = 2, state=(), update: int = 0
           ) -> Replay:
    """Play ``steps`` steps of ``trace`` on one allocator, after allocating ``resident`` (the
    blocks the run holds throughout: weights, gradients, the engine's buffers). After each step's
    trace the optimizer steps: ``state`` is the state it makes at its first step and keeps (a torch
    optimizer makes its moments lazily, one pair per parameter, into whatever the first step left
    cached), ``update`` the bytes its step allocates and frees. What a step leaves allocated is freed
    before the next one starts (the loop drops its outputs, ``zero_grad`` its gradients). Two steps
    by default: the second starts with the first one's cached segments, which is where a step that
    only just fitted once runs out."""
    allocator = CachingAllocator(capacity)
    try:
        for nbytes in resident:
            allocator.malloc(nbytes)
        for step in range(steps):
            live: dict = {}
            for key, nbytes in trace:
                if nbytes > 0:
                    live[key] = allocator.malloc(nbytes)
                else:
                    allocator.free(live.pop(key, None))
            if step == 0:
                for nbytes in state:
                    allocator.malloc(nbytes)
            allocator.free(allocator.malloc(update))
            for block in live.values():
                allocator.free(block)
    except OutOfMemory as oom:
        return Replay(allocator.peak_allocated, allocator.peak_reserved, oom)
    return Replay(allocator.peak_allocated, allocator.peak_reserved)


def needed_capacity(trace: Trace, resident=(), steps: int = 2, state=(), update: int = 0,
                    unlimited: Replay | None = None) -> int:
    """The device memory (a multiple of 2 MiB) with which ``replay`` runs without running out, found
    by bisection between the allocated peak (too little) and what the allocator reserves when
    nothing limits it (enough). The least such memory when fitting is monotone in the memory; the
    allocator is not quite (more memory can keep a segment that a tighter run gave back, and then
    split it), so a decision for one memory replays at that memory (``replay(...).fits``).
    ``unlimited``: this replay without a capacity, when the caller has it already."""
    unlimited = unlimited or replay(trace, resident, None, steps, state, update)
    hi = -(-unlimited.peak_reserved // ROUND_LARGE) * ROUND_LARGE
    lo = -(-unlimited.peak_allocated // ROUND_LARGE) * ROUND_LARGE - ROUND_LARGE
    while hi - lo > ROUND_LARGE:
        mid = (lo + hi) // 2 // ROUND_LARGE * ROUND_LARGE
        if replay(trace, resident, mid, steps, state, update).fits:
            hi = mid
        else:
            lo = mid
    return hi


__all__ = ["CachingAllocator", "OutOfMemory", "Replay", "Trace", "needed_capacity", "replay", "round_request",
           "segment_size"]
