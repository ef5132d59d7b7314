"""Host offload of the hidden states between layers: the same gradients bit for bit, the host side
counted apart, blocks read back in the planned order."""

from __future__ import annotations

import weakref

import pytest
import torch

import leanbp
from conftest import ALL_FAMILIES, tiny_model
from _helpers import make_batch


def _step(model, batch):
    ids, mask, labels = batch
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_offload_gives_the_same_gradients_bit_for_bit(family):
    model = tiny_model(family)  # float64
    batch = make_batch(vocab=model.config.vocab_size)
    leanbp.stream(model, chunk_size=7)  # T=45: chunks that do not divide T, prompt inside a chunk
    loss, grads = _step(model, batch)
    leanbp.unstream(model)
    leanbp.stream(model, chunk_size=7, offload=True)
    loss_off, grads_off = _step(model, batch)
    assert torch.equal(loss, loss_off)
    assert grads.keys() == grads_off.keys() and len(grads) == len(list(model.parameters()))
    for name in grads:
        assert torch.equal(grads[name], grads_off[name]), name


def test_offload_with_a_frozen_input_and_lora_style_freezing():
    """Layers whose input needs no gradient (frozen embedding) still read their blocks in order."""
    model = tiny_model("qwen3")
    model.get_input_embeddings().weight.requires_grad_(False)
    batch = make_batch(vocab=model.config.vocab_size)
    leanbp.stream(model, chunk_size=16)
    _, grads = _step(model, batch)
    leanbp.unstream(model)
    leanbp.stream(model, chunk_size=16, offload=True)
    _, grads_off = _step(model, batch)
    assert grads.keys() == grads_off.keys()
    assert all(torch.equal(grads[n], grads_off[n]) for n in grads)


def test_host_store_is_counted_apart_and_the_device_side_shrinks():
    model = tiny_model("qwen3", dtype=torch.float32, num_hidden_layers=6)
    T, H = 512, model.config.hidden_size
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    reports = {}
    for offload in (False, True):
        leanbp.stream(model, chunk_size=64, offload=offload)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with leanbp.memory.track(model) as mem:
            model(input_ids=ids, labels=ids).loss.backward()
        reports[offload] = mem.report
        leanbp.unstream(model)
    layer_input = T * H * 4
    # the host holds the six layer inputs and one more layer boundary: the last layer's output
    # until it is back on the device, then the one gradient that is passed down the layers
    assert reports[True].host == 7 * layer_input and reports[False].host == 0
    # on the device, the six layer inputs and the (B, T, H) gradient are gone (one chunk's blocks
    # and the chunk working set remain)
    saved = reports[False].activations - reports[True].activations
    assert saved >= 6 * layer_input, saved / layer_input


def test_a_second_backward_through_the_graph_matches_no_offload():
    """The layer inputs stay on the host until autograd frees the graph, so a retained graph can be
    backpropagated again, as without offload."""
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    grads = {}
    for offload in (False, True):
        leanbp.stream(model, chunk_size=16, offload=offload)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids)
        out.logits.sum().backward(retain_graph=True)
        out.logits.sum().backward()
        grads[offload] = {n: p.grad.clone() for n, p in model.named_parameters()}
        leanbp.unstream(model)
    assert all(torch.equal(grads[False][n], grads[True][n]) for n in grads[False])


def test_host_blocks_are_read_in_the_planned_order_only():
    from leanbp.engine._offload import HostStore, backward_reads

    store = HostStore(torch.device("cpu"))
    hidden, grad = store.empty((1, 10, 3), torch.float64), store.empty((1, 10, 3), torch.float64)
    hidden.copy_(torch.arange(30.0).view(1, 10, 3))
    reader = store.reader(backward_reads(hidden, grad, [(0, 4), (4, 8), (8, 10)]))
    assert torch.equal(reader.take(hidden, 0, 4), hidden[:, 0:4])  # the prefix rows first
    with pytest.raises(RuntimeError, match="planned order"):
        reader.take(hidden, 8, 10)  # the last chunk comes after the prefix block (4, 8)


def test_offload_needs_streamed_layers():
    with pytest.raises(ValueError, match="layers=True"):
        leanbp.stream(tiny_model("qwen3"), layers=False, offload=True)


def _one_range(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are one contiguous range of its storage (in some order of dims)."""
    span = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride != span:
            return False
        span *= size
    return True


class _HostCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Every copy into or out of a host store's memory, as (destination, source) strides and
    whether each operand is one dense range."""

    def __init__(self, host_storages: set[int]):
        super().__init__()
        self.host, self.copies = host_storages, []

    def _on_host(self, t) -> bool:
        return torch.is_tensor(t) and t.untyped_storage().data_ptr() in self.host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            dst, src = (args[0], args[1]) if func is torch.ops.aten.copy_.default else (out, args[0])
            if self._on_host(dst) or self._on_host(src):
                self.copies.append([(t.stride(), _one_range(t)) for t in (dst, src)])
        return out


def test_every_host_copy_is_one_transfer_for_any_batch(monkeypatch):
    """Batch 2: each block a layer reads or writes, the layer boundary to and from the host, and
    the gradient rows, are one dense range with the same layout on both sides, so a GPU copies each
    in one asynchronous transfer from pinned memory. Before the fix the host was batch-major and a
    block of rows [s, e) was two ranges: PyTorch stages such a copy through a pageable temporary
    and blocks."""
    from leanbp.engine._offload import HostStore

    storages = set()
    empty = HostStore.empty

    def recorded(store, shape, dtype):
        host = empty(store, shape, dtype)
        ptr = host.untyped_storage().data_ptr()
        storages.add(ptr)  # while it lives (its memory is reused for other tensors after)
        weakref.finalize(host._base if host._base is not None else host, storages.discard, ptr)
        return host

    monkeypatch.setattr(HostStore, "empty", recorded)
    model = tiny_model("llama")
    ids, mask, labels = make_batch(B=2, vocab=model.config.vocab_size)
    leanbp.stream(model, chunk_size=7, offload=True)
    with _HostCopies(storages) as copies:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert len(copies.copies) > 4 * 7  # every layer's blocks both ways (45 rows in chunks of 7)
    for dst, src in copies.copies:
        assert dst[1] and src[1] and dst[0] == src[0], (dst, src)


def test_whole_tensor_moves_are_batch_major_on_the_device_and_go_by_row_blocks(monkeypatch):
    """The head takes the last layer's output as (B * T, H) rows: brought back from the (T, B, H)
    host memory it must be batch-major on the device (else the head copies it whole), and both
    whole-tensor moves go in row blocks, so batch 2 never holds a second full-size device copy."""
    from leanbp.engine._offload import HostStore

    monkeypatch.setattr(HostStore, "WHOLE_BLOCK_ROWS", 4)
    store = HostStore(torch.device("cpu"))
    x = torch.randn(2, 10, 3)
    host = store.to_host(x)
    assert host.transpose(0, 1).is_contiguous() and torch.equal(host, x)
    back = store.to_device(host)
    assert back.is_contiguous() and torch.equal(back, x)
    assert back.reshape(20, 3).data_ptr() == back.data_ptr()  # (B * T, H) is a view, no copy
