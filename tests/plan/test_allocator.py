"""The model of PyTorch's CUDA caching allocator (leanbp.plan._allocator) follows the allocator's
rules, and the planner's longest T under it is the longest whose replay fits."""

from __future__ import annotations

import pytest
import torch

from leanbp.memory import MiB, track
from leanbp.plan import CachingAllocator, OutOfMemory, Planner, needed_capacity, replay, training_step
from leanbp.plan._allocator import round_request, segment_size
from _helpers import plan_config


def test_requests_round_to_512_bytes_and_segments_to_the_allocators_sizes():
    assert [round_request(n) for n in (1, 512, 513)] == [512, 512, 1024]
    # small requests share 2 MiB segments, 1-10 MiB ones 20 MiB, larger ones their size in 2 MiB steps
    assert segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(10 * MiB + 512) == 12 * MiB


def test_the_smallest_free_block_serves_and_is_split():
    a = CachingAllocator()
    big, small = a.malloc(100 * MiB), a.malloc(40 * MiB)
    a.free(big)
    a.free(small)
    x = a.malloc(30 * MiB)  # best fit: the 40 MiB segment, split (10 MiB rest > 1 MiB)
    assert (x.ptr, a.reserved) == (100 * MiB, 140 * MiB)
    y = a.malloc(10 * MiB)  # the rest of it, exactly
    assert y.ptr == 130 * MiB
    z = a.malloc(60 * MiB)  # now only the 100 MiB segment holds it
    assert z.ptr == 0 and a.reserved == 140 * MiB and a.allocated == 100 * MiB


def test_a_large_request_never_takes_a_small_pool_block():
    a = CachingAllocator()
    a.free(a.malloc(512 * 1024))  # a 2 MiB small-pool segment, now free
    a.malloc(int(1.5 * MiB))
    assert a.reserved == 2 * MiB + 20 * MiB


def test_freed_neighbours_merge_into_one_block():
    a = CachingAllocator()
    a.free(a.malloc(100 * MiB))
    first, second, third = a.malloc(30 * MiB), a.malloc(30 * MiB), a.malloc(40 * MiB)
    a.free(second)
    a.free(first)  # (merges with the free block after it)
    both = a.malloc(60 * MiB)
    assert both.ptr == 0 and a.reserved == 100 * MiB
    a.free(third)  # (merges with the free block before it)
    assert a.malloc(40 * MiB).ptr == 60 * MiB
    a = CachingAllocator()
    a.free(a.malloc(90 * MiB))
    left, middle, right = a.malloc(30 * MiB), a.malloc(30 * MiB), a.malloc(30 * MiB)
    a.free(left)
    a.free(right)
    a.free(middle)  # (merges on both sides: the segment is whole again, so it can be given back)
    a.release_cached()
    assert a.reserved == 0


def test_equal_free_blocks_serve_the_lower_address_and_a_small_rest_is_not_split_off():
    a = CachingAllocator()
    blocks = [a.malloc(40 * MiB) for _ in range(3)]
    for block in reversed(blocks):
        a.free(block)
    assert a.malloc(40 * MiB).ptr == 0
    whole = a.malloc(int(39.5 * MiB))  # a 0.5 MiB rest of a large block stays with it
    assert whole.size == 40 * MiB and a.allocated == 80 * MiB


def test_a_fit_is_decided_at_the_memory_itself():
    """More memory can hurt: at 58 MiB the tight run gives back its cached segments early and fits;
    at 60 MiB it keeps the 20 MiB segment, splits it and runs out. ``needed_capacity`` is one
    bisection's answer; a decision for a given memory replays at that memory (Planner.fits)."""
    trace = [(1, 2838034), (2, 37842356), (1, -2838034), (2, -37842356), (3, 1028232), (4, 12088538),
             (5, 40808603), (4, -12088538)]
    assert [replay(trace, capacity=c * MiB).fits for c in (56, 58, 60, 62)] == [False, True, False, True]


def test_cached_segments_are_given_back_before_running_out():
    a = CachingAllocator(capacity=100 * MiB)
    a.free(a.malloc(60 * MiB))  # cached, whole
    a.malloc(70 * MiB)  # 60 + 70 > 100: the cached 60 goes back to the driver first
    assert a.reserved == 70 * MiB


def test_a_split_segment_cannot_be_given_back_so_free_bytes_elsewhere_do_not_help():
    a = CachingAllocator(capacity=100 * MiB)
    a.free(a.malloc(60 * MiB))
    a.malloc(20 * MiB)  # splits the cached 60 MiB segment: 40 MiB of it stay free
    with pytest.raises(OutOfMemory):
        a.malloc(60 * MiB)  # 80 MiB are not allocated, but no 60 MiB block is free or can be reserved


def test_what_a_step_leaves_is_freed_before_the_next_and_the_optimizer_state_is_made_once():
    kept = [("grad", 30 * MiB)]  # a gradient the step makes and the loop frees after it
    assert replay(kept, steps=2).peak_allocated == 30 * MiB
    # the moments a torch optimizer makes at its first step land in the step's cached segment, so the
    # second step's 64 MiB tensor needs a segment of its own
    trace = [("x", 64 * MiB), ("x", -64 * MiB)]
    assert needed_capacity(trace, steps=1, state=[32 * MiB]) == 64 * MiB
    assert needed_capacity(trace, steps=2, state=[32 * MiB]) == 128 * MiB
    assert replay(trace, capacity=126 * MiB, steps=2, state=[32 * MiB]).oom is not None
    # the optimizer step's own temporaries come and go after each step's trace
    assert replay([], resident=[10 * MiB], update=20 * MiB).peak_allocated == 30 * MiB


def test_the_tracker_trace_holds_every_storage_the_step_makes_and_frees():
    config = plan_config()
    model = __import__("transformers").AutoModelForCausalLM.from_config(config).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trace: list = []
    with track(model, trace=trace) as mem:
        training_step(model, torch.randint(0, config.vocab_size, (1, 96)), hold_outputs=False)
    live = peak = 0
    sizes: dict = {}
    for key, nbytes in trace:
        if nbytes > 0:
            assert key not in sizes  # (a key is made once)
            sizes[key] = nbytes
        else:
            assert sizes.pop(key) == -nbytes  # (each free follows its own allocation, with its size)
        live += nbytes
        peak = max(peak, live)
    assert peak == mem.report.peak - mem.report.params  # (the step started without gradients)
    assert live == mem.report.grads == sum(sizes.values())  # what is left: the gradients it made


def test_the_longest_T_under_the_allocator_is_the_longest_whose_replay_fits(bf16_planner):
    planner = Planner(plan_config(), dtype="bf16", hold_outputs=False, setup=bf16_planner.setup)
    tensors = planner.peak("ckpt", 4096).total
    capacity = tensors + 2 * MiB
    found = planner.longest_allocated("ckpt", capacity, multiple=128)
    assert found.checked and 0 < found.seq_len
    assert planner.fits("ckpt", found.seq_len, capacity) and not planner.fits("ckpt", found.seq_len + 128, capacity)
    fit = planner.allocator("ckpt", found.seq_len)
    assert fit.allocated >= planner.peak("ckpt", found.seq_len).total  # (each tensor rounded up to 512 bytes)
    # what the allocator needs beyond the tensors makes it shorter than the tensors alone would be
    assert found.seq_len < planner.longest("ckpt", capacity, multiple=128).seq_len
    with pytest.raises(ValueError, match="streams its layers"):
        planner.allocator("leanbp", 4096)


def test_auto_replays_where_the_device_holds_no_optimizer_state_made_at_the_first_step():
    """--allocator auto (the default) replays plain autograd and checkpointing for backprop, and for a
    step whose optimizer state is made before the first step (ZeRO) or lives on the host; a step of a
    torch optimizer on the device, and a streamed method, keep the fragmentation share. share never
    replays, replay always (but a streamed method)."""
    from leanbp.plan import CudaReserve, PlanRequest, Setup

    memory = 80 * 2**30
    share = int(CudaReserve().fragmentation * memory)
    auto = PlanRequest(memory=memory)
    assert auto.allocator == "auto" and auto.reserve == CudaReserve().context + CudaReserve().workspaces
    assert auto.replayed("plain", "backprop") and auto.replayed("ckpt", "backprop")
    assert not auto.replayed("ckpt", "step") and not auto.replayed("leanbp", "backprop")
    assert auto.budget_of("ckpt", "backprop") == auto.budget
    assert auto.budget_of("ckpt", "step") == auto.budget_of("leanbp", "backprop") == auto.budget - share
    for setup in (Setup(optimizer="host"), Setup(gpus=2, engine="zero2"),
                  Setup(gpus=2, engine="zero3", optimizer="adamw-8bit")):
        assert PlanRequest(memory=memory, setup=setup).replayed("ckpt", "step"), setup
    for setup in (Setup(optimizer="adamw-bf16"), Setup(gpus=2, engine="fsdp2"),
                  Setup(gpus=2, engine="ddp", optimizer="adamw-8bit")):
        assert not PlanRequest(memory=memory, setup=setup).replayed("ckpt", "step"), setup
    assert not PlanRequest(memory=memory, allocator="share").replayed("ckpt", "backprop")
    assert PlanRequest(memory=memory, allocator="share").reserve == CudaReserve().total(memory)
    replayed = PlanRequest(memory=memory, allocator="replay")
    assert replayed.replayed("ckpt", "step") and not replayed.replayed("leanbp", "step")
    with pytest.raises(ValueError, match="allocator must be one of"):
        PlanRequest(allocator="expandable")


def test_leanbp_plan_replays_checkpointing_through_the_model_by_default(tmp_path, capsys):
    """The default plan (--allocator auto): checkpointing's backprop longest T from the replay
    (marked †, and no row beyond it said to fit), its step with AdamW on the device and a streamed
    method from the tensors within the budget less the fragmentation share."""
    import json

    from leanbp.cli import main

    cfg = tmp_path / "config.json"
    plan_config(layers=2).to_json_file(str(cfg))
    assert main(["plan", "--model", str(cfg), "--memory", "2GiB", "--reserve", "0", "--methods", "ckpt,leanbp",
                 "--seq-lens", "131072,262144", "--out", str(tmp_path / "plan")]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "plan" / "plan.json").read_text())
    by = {(r["method"], r["mode"]): r for r in result["longest"]}
    ckpt, streamed = by["ckpt", "backprop"], by["leanbp", "backprop"]
    assert ckpt["replayed"] and not streamed["replayed"] and not by["ckpt", "step"]["replayed"]
    assert ckpt["budget"] == 2 * 2**30 and streamed["budget"] == 2 * 2**30 - int(0.05 * 2 * 2**30)
    assert by["ckpt", "step"]["budget"] == streamed["budget"]
    assert "in place of a fragmentation share where the device holds no optimizer state made at the first" in printed
    assert f"| {ckpt['max_seq_len']:,} † |" in printed and "† two steps played through" in printed
    assert 131072 < ckpt["max_seq_len"] < 262144
    assert "| backprop | transformers checkpointing | 262,144* |" in printed
    assert [line.split("|")[11].strip() for line in printed.splitlines()
            if line.startswith("| backprop | transformers checkpointing |")] == ["yes", "no"]
