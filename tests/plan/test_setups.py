"""leanbp plan for real set-ups: the engines' shares and buffers, the optimizers' state, the host
budget, the work counter and the step-time model. Each modeled quantity has a test that fails when
the quantity is wrong: against the real optimizer's state, a real FSDP2 / DDP on a process group of
this process, a real step's FLOPs under the same counter, or arithmetic the model must obey."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import transformers

from leanbp import StreamConfig
from leanbp.cli import main
from leanbp.plan import GPUS, Planner, RankMemory, Setup, Work, WorkCounter, step_time, training_step
from leanbp.plan._setup import parameter_tensors, rank_bytes
from _helpers import plan_config as _config


def _model(dtype=torch.float32, layers=4):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(layers), dtype=dtype).train()


def _state_bytes(optimizer) -> int:
    storages = {}
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if hasattr(v, "to_local") else v
                storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(storages.values())


# -- set-up validation -------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(gpus=2, engine="single"), "single runs one GPU"),
    (dict(gpus=0), "positive integer"),
    (dict(engine="zero2", optimizer="adamw-bf16"), "fp32 copy"),
    (dict(engine="fsdp2", optimizer="host", offload_params=True), "needs engine zero3"),
    (dict(engine="zero3", optimizer="adamw", offload_params=True), "needs engine zero3"),
    (dict(efficiency=1.5), "efficiency"),
    (dict(gpu="tpu"), "gpu must be one of"),
    (dict(optimizer="sgd"), "optimizer must be one of"),
])
def test_a_setup_that_cannot_run_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Setup(**kwargs)


def test_the_engine_defaults_to_single_for_one_gpu_and_ddp_for_more():
    assert Setup().engine == "single" and Setup(gpus=8).engine == "ddp"
    assert Setup().host_memory > 0  # this machine's RAM


# -- optimizers: the real optimizer's state, byte for byte --------------------------------------
@pytest.mark.parametrize("dtype, optimizer", [(torch.float32, "adamw"), (torch.bfloat16, "adamw-bf16")])
def test_optimizer_state_is_torch_adamws_to_the_byte(dtype, optimizer):
    """adamw on fp32 weights and adamw-bf16 on bf16 weights are torch.optim.AdamW: two moments in the
    weights' dtype and a 4-byte step per tensor (fused or not)."""
    model = _model(dtype)
    for fused in (True, False):
        opt = torch.optim.AdamW(model.parameters(), fused=fused)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        assert rank_bytes(parameter_tensors(model), Setup(optimizer=optimizer)).optimizer == _state_bytes(opt)


def test_adamw_keeps_an_fp32_master_of_16_bit_weights_and_the_host_optimizer_nothing_on_the_device():
    model = _model(torch.bfloat16)
    tensors = parameter_tensors(model)
    n, count = sum(t.numel for t in tensors), len(tensors)
    assert rank_bytes(tensors, Setup(optimizer="adamw")).optimizer == 12 * n + 4 * count
    assert rank_bytes(tensors, Setup(optimizer="adamw-bf16")).optimizer == 4 * n + 4 * count
    host = rank_bytes(tensors, Setup(optimizer="host"))
    assert host.optimizer == 0 and host.host == 16 * n  # fp32 master, its gradient, two moments
    assert host.pcie == 2 * 2 * n  # bf16 gradients down, bf16 weights up


def test_8bit_state_is_bitsandbytes_layout():
    """bitsandbytes AdamW8bit: uint8 moments and an fp32 absmax per 256 for tensors of 4096+ elements,
    fp32 moments below; with bitsandbytes installed, its real state."""
    model = _model(torch.float32)
    tensors = parameter_tensors(model)
    expected = sum(2 * t.numel + 8 * math.ceil(t.numel / 256) if t.numel >= 4096 else 8 * t.numel for t in tensors)
    assert rank_bytes(tensors, Setup(optimizer="adamw-8bit")).optimizer == expected + 2 * 256 * 4
    bnb = pytest.importorskip("bitsandbytes")
    opt = bnb.optim.AdamW8bit(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    try:
        opt.step()
    except Exception as e:  # (a bitsandbytes without a CPU backend for its 8-bit kernels)
        pytest.skip(f"bitsandbytes cannot step on this CPU: {e}")
    assert rank_bytes(tensors, Setup(optimizer="adamw-8bit")).optimizer == _state_bytes(opt)


# -- engines: real DDP / FSDP2 in this process ---------------------------------------------------
@pytest.fixture
def fake_group():
    """A process group of ``world`` fake ranks in this process (torch's "fake" backend: collectives
    do nothing), rank 0 of it; torn down after the test."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    made = []

    def make(world):
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        made.append(world)

    yield make
    if made and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_shards_are_fully_shards_to_the_byte(fake_group, world):
    """Weights, gradients and AdamW state of a rank under fully_shard are the planner's shares; where
    every dim 0 divides by the world they are exactly 1/world of the whole."""
    from torch.distributed.fsdp import fully_shard

    fake_group(world)
    model = _model(layers=2)
    tensors = parameter_tensors(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    local = [p.to_local() for p in model.parameters()]
    sharded = sum(t.untyped_storage().nbytes() for t in local)
    share = rank_bytes(tensors, Setup(gpus=world, engine="fsdp2"))
    full = sum(t.numel * t.itemsize for t in tensors)
    root = sum(t.numel * t.itemsize for t in tensors if t.unit < 0)
    assert share.weights - root == sharded  # (the root's weights stay unsharded through the step)
    assert sharded * world == full  # every dim 0 of this model divides by 2 and 4
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    assert share.grads == sum(p.grad.to_local().untyped_storage().nbytes() for p in model.parameters())
    opt.step()
    assert share.optimizer == _state_bytes(opt)


def test_fsdp2_pads_a_dim_0_that_does_not_divide():
    t = parameter_tensors(_model(layers=2))[0]  # the embedding, 512 rows
    odd = type(t)((511, 64), t.dtype, True, -1)
    assert rank_bytes([odd], Setup(gpus=4, engine="fsdp2")).grads == 128 * 64 * 4  # ceil(511 / 4) rows


def test_zero_partitions_are_one_over_world_and_ddp_adds_a_gradient_copy():
    tensors = parameter_tensors(_model(layers=2))
    full = sum(t.numel * t.itemsize for t in tensors)
    n = sum(t.numel for t in tensors)
    z3 = rank_bytes(tensors, Setup(gpus=4, engine="zero3"))
    assert z3.weights == sum(math.ceil(t.numel / 4) * 4 for t in tensors) and z3.weights * 4 == full
    assert z3.optimizer == 12 * math.ceil(n / 8) * 8 // 4 + 4  # fp32 master + two moments of the flat partition
    z2 = rank_bytes(tensors, Setup(gpus=4, engine="zero2"))
    assert z2.weights == math.ceil(n / 8) * 8 * 4 and z2.grads * 4 == z2.weights
    ddp = rank_bytes(tensors, Setup(gpus=4, engine="ddp"))
    assert (ddp.weights, ddp.grads, ddp.buffers) == (full, full, full)
    assert ddp.collective == round(2 * 3 / 4 * full)  # ring all-reduce
    host = rank_bytes(tensors, Setup(gpus=4, engine="zero3", optimizer="host", offload_params=True))
    assert (host.weights, host.grads, host.optimizer) == (0, 0, 0)


def test_ddp_buckets_are_one_more_copy_of_the_gradients(fake_group):
    """The reducer's flat buckets (gradient_as_bucket_view=False): measured as they are allocated."""
    fake_group(2)
    with RankMemory() as mem:
        model = _model(layers=2)
        with mem.window() as w:
            ddp = torch.nn.parallel.DistributedDataParallel(model)
    del ddp
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert w.end - w.start == grads == rank_bytes(parameter_tensors(model), Setup(gpus=2, engine="ddp")).buffers


# -- one rank's step: the planner against a whole-process measurement ----------------------------
@pytest.mark.parametrize("method, dtype, optimizer", [("ckpt", "fp32", "adamw"), ("leanbp", "fp32", "adamw"),
                                                      ("leanbp", "bf16", "adamw-bf16")])
def test_a_full_step_with_its_optimizer_is_predicted_to_the_byte(method, dtype, optimizer):
    """Everything the process holds (RankMemory, entered before the model is built): weights, resident
    gradients, fused AdamW's state, activations, the optimizer step; the model's own buffers (RoPE)
    aside."""
    import leanbp
    from leanbp.streaming import apply_method

    stream = StreamConfig(chunk_size=64, head_chunk_size=32)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    ids = torch.randint(0, 512, (2, 320))
    with RankMemory() as mem:
        model = apply_method(_model(torch_dtype), method, stream)
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        training_step(model, ids)
        opt.step()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with mem.window() as w:
            training_step(model, ids)
            opt.step()
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    planner = Planner(_config(), dtype=dtype, batch=2, stream=stream, setup=Setup(optimizer=optimizer))
    assert planner.peak(method, 320, optimizer=True, probe=True).total == w.peak - buffers
    assert leanbp.is_streamed(model) == (method == "leanbp")


# -- sequence parallelism --------------------------------------------------------------------------
def _sequence_parallel_rank(rank: int, world: int, init: str, T: int, out: str, offload: bool) -> None:
    """One rank of a real sequence-parallel step (gloo), measured as the planner's fake step is."""
    import json

    import leanbp
    from leanbp.memory import track

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    sent = [0]
    exchange = dist.all_to_all_single

    def counted(output, input, *args, **kwargs):
        """Counts the bytes sent, through buffers the tracker does not see: gloo's worker thread
        drops its reference to a collective's tensors at a moment of its own, after the call has
        returned, so counting the engine's own tensors there made the measured peak vary by up
        to two exchange blocks from run to run (the engine frees them at once)."""
        from torch.utils._python_dispatch import _disable_current_modes

        sent[0] += input.numel() * input.element_size()
        with _disable_current_modes():
            send, recv = input.clone(), torch.empty_like(output)
            exchange(recv, send, *args, **kwargs)
            output.copy_(recv)

    try:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config()).train()
        leanbp.stream(model, chunk_size=64, head_chunk_size=32, sequence_parallel=True, offload=offload)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        ids = torch.zeros(2, T // world, dtype=torch.long)
        dist.all_to_all_single = counted
        with track(model) as mem:
            training_step(model, ids)
        dist.all_to_all_single = exchange
        r = mem.report
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(dict(peak=r.peak, params=r.params, grads=r.grads, host=r.host, sent=sent[0]), f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("offload", [False, True], ids=["leanbp", "leanbp_offload"])
def test_a_sequence_parallel_step_is_predicted_to_the_byte_with_its_exchange(tmp_path, offload):
    """The fake step of rank 0 with ``Setup(sp=2)`` against rank 0 of a real 2-process step: memory
    to the byte (with offload, the host's too), and the bytes its all-to-alls send."""
    import json

    import torch.multiprocessing as mp

    T = 640
    mp.spawn(_sequence_parallel_rank, args=(2, f"file://{tmp_path}/rendezvous", T, str(tmp_path), offload), nprocs=2)
    measured = json.loads((tmp_path / "rank0.json").read_text())
    planner = Planner(_config(), dtype="fp32", batch=2, stream=StreamConfig(chunk_size=64, head_chunk_size=32),
                      setup=Setup(gpus=2, sp=2))
    method = "leanbp_offload" if offload else "leanbp"
    predicted = planner.step(method, T)
    assert (predicted.peak, predicted.params, predicted.grads, predicted.host) == \
        (measured["peak"], measured["params"], measured["grads"], measured["host"])
    assert (predicted.host > 0) == offload
    assert planner.work(method, T).exchange == measured["sent"] > 0
    one = Planner(_config(), dtype="fp32", batch=2, stream=StreamConfig(chunk_size=64, head_chunk_size=32))
    assert predicted.activations < one.step(method, T).activations  # (rank 0 holds half the rows)


def test_sequence_parallelism_plans_leanbp_on_whole_chunks_of_each_ranks_rows():
    with pytest.raises(ValueError, match="divides gpus"):
        Setup(gpus=4, sp=3)
    planner = Planner(_config(), stream=StreamConfig(chunk_size=64, head_chunk_size=32), setup=Setup(gpus=4, sp=2))
    with pytest.raises(ValueError, match="does not split a sequence"):
        planner.step("ckpt", 1024)
    with pytest.raises(ValueError, match="does not split over sp=2"):
        planner.step("leanbp", 1025)
    with pytest.raises(ValueError, match="splits the 4 query heads"):
        Planner(_config(), setup=Setup(gpus=8, sp=8)).step("leanbp", 8 * 2048)


def test_cli_plans_sequence_parallelism_for_leanbp(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    _config().to_json_file(str(cfg))
    args = ["plan", "--model", str(cfg), "--memory", "64MiB", "--reserve", "0", "--seq-lens", "4096",
            "--chunk-size", "256", "--head-chunk-size", "512", "--gpus", "4", "--sp", "2", "--mode", "backprop",
            "--out", str(tmp_path / "plan")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "each sequence over 2 of them (sequence parallelism)" in printed
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert {p["method"] for p in plan["peaks"]} == {"leanbp"} and plan["longest"][0]["max_seq_len"] % 512 == 0
    assert main(args[:-2] + ["--methods", "ckpt,leanbp", "--out", str(tmp_path / "plan")]) == 2
    assert "do not split a sequence" in capsys.readouterr().err


# -- host memory ------------------------------------------------------------------------------
def test_the_host_budget_stops_offload_where_the_host_is_full(bf16_planner):
    BUDGET = 2**26  # (a small device: the searches stay short)
    host = 2 * 2**20
    # (the shared planner's fake steps: the host's size changes no step, only what fits)
    planner = bf16_planner.with_setup(Setup(host_memory=host))
    found = planner.longest("leanbp_offload", BUDGET)
    # (the device alone would take far more: the host stops it first)
    assert found.bound == "host" and 0 < found.seq_len == found.host_seq_len < found.device_seq_len
    assert planner.peak("leanbp_offload", found.seq_len).host <= host
    assert planner.peak("leanbp_offload", found.seq_len + 512).host > host
    # all ranks of the machine share it
    two = planner.with_setup(Setup(gpus=2, host_memory=host)).longest("leanbp_offload", BUDGET)
    assert two.seq_len < found.seq_len


# -- work and time --------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["plain", "ckpt", "leanbp", "leanbp_offload"])
def test_the_fake_step_counts_the_flops_of_the_real_step(method):
    """The same counter over the fake step (at the model's depth, from the depth line) and over the
    real step: the same FLOPs, to the FLOP. leanbp's fake step takes every row as labelled (the
    planner's assumption where no label can be read, ``leanbp.engine.has_values``), the real step's
    causal shift leaves each sequence's last row without one: its head does two products of hidden x
    vocabulary more (the row's logits and its hidden state's gradient). The other
    ops' bytes agree to a few kB: the real step reads values the fake one cannot (the position ids,
    to find packed documents)."""
    from leanbp.streaming import apply_method

    stream = StreamConfig(chunk_size=96, head_chunk_size=64)
    model = apply_method(_model(), method, stream)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with WorkCounter() as counter:
        training_step(model, torch.randint(0, 512, (1, 384)))
    planner = Planner(_config(), dtype="fp32", stream=stream)
    planner.step(method, 384)
    fake = planner.work(method, 384)
    extra = 0 if method in ("plain", "ckpt") else 4 * 64 * 512  # one more labelled row in the head
    assert counter.work.flops > 0 and fake.flops - counter.work.flops == extra
    assert 0 < counter.work.attention < counter.work.flops and fake.attention == counter.work.attention
    assert fake.bytes == pytest.approx(counter.work.bytes, rel=1e-3)
    # (the softmaxes and SiLUs; leanbp's head log-softmaxes its one more row)
    assert 0 < counter.work.transcendental and fake.transcendental == pytest.approx(counter.work.transcendental, rel=1e-2)


def test_the_work_is_quadratic_in_t_through_the_probes(bf16_planner):
    """FLOPs are a polynomial of degree two in T (attention) to the FLOP; the other ops' bytes to 1%
    (a few of them follow T less regularly)."""
    planner = bf16_planner
    for method in ("ckpt", "leanbp"):
        planner.lines(method)
        T = max(planner._probes[method]) + 4 * planner.stream.chunk_size  # (beyond the probes: extrapolated)
        by_polynomial = planner.work(method, T)
        planner.step(method, T)
        counted = planner.work(method, T)
        assert by_polynomial.flops == pytest.approx(counted.flops, rel=1e-12)
        assert by_polynomial.attention == pytest.approx(counted.attention, rel=1e-12)
        assert by_polynomial.bytes == pytest.approx(counted.bytes, rel=1e-2)


def test_the_counter_counts_transcendental_elements_and_fresh_large_results():
    """exp/log/erf ops count their result elements (others none); a result allocated at FRESH_FROM
    bytes or more counts its bytes as fresh (an in-place op's, or a smaller one's, not)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from leanbp.plan._work import FRESH_FROM

    with FakeTensorMode(), WorkCounter() as counter:
        big = torch.zeros(FRESH_FROM // 4)  # fresh
        big.add_(1)  # in place: not fresh
        torch.ones(FRESH_FROM // 4 - 1)  # one element short: not fresh
        torch.nn.functional.silu(big)  # fresh, and transcendental
        big * 2  # fresh, not transcendental
        torch.log_softmax(torch.zeros(4, 10), -1)
    assert counter.work.fresh == 3 * FRESH_FROM
    assert counter.work.transcendental == FRESH_FROM // 4 + 40


def test_transcendental_ops_and_fresh_pages_take_time_on_a_device_that_states_their_rates():
    """A measured CPU times exp/log elements and fresh pages at its own rates; a GPU as traffic only."""
    tensors = parameter_tensors(_model(layers=2))
    work = Work(bytes=2e9, transcendental=1e9, fresh=1e9)
    gpu = step_time(work, Setup(efficiency=1.0), rank_bytes(tensors, Setup()), "bf16")
    assert gpu.memory == pytest.approx(2e9 / GPUS["h100"].hbm)
    cpu = replace(GPUS["h100"], flops={"fp32": 1e11}, hbm=40e9, transcendental={"fp32": 0.5e9}, fresh=4e9)
    timed = step_time(work, Setup(), rank_bytes(tensors, Setup()), "fp32", device=cpu)
    assert timed.memory == pytest.approx(2e9 / 40e9 + 1e9 / 0.5e9 + 1e9 / 4e9)


def test_the_counter_keeps_each_distinct_call_with_its_count_and_flops():
    """Products and attention calls are kept by op and operand layout (a transposed operand is
    another call); their counts x FLOPs add up to the step's FLOPs; the depth line keeps them and a
    polynomial in T (other shapes) drops them."""
    from leanbp.plan._work import quadratic_through

    x, w = torch.randn(30, 16), torch.randn(24, 16)
    q = torch.randn(1, 2, 9, 8)
    with WorkCounter() as counter:
        for _ in range(3):
            torch.nn.functional.linear(x, w)  # (an mm with the weight transposed)
        x @ w.t().contiguous()  # the same product, another layout
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True)
    work = counter.work
    assert sorted(n for n, _ in work.calls.values()) == [1, 1, 3]
    assert sum(n * f for n, f in work.calls.values()) == work.flops
    assert (work + (work - work) * 5).calls == work.calls
    assert sorted(n for n, _ in (work * 2).calls.values()) == [2, 2, 6]
    assert quadratic_through([(1, work), (2, work * 2), (3, work * 3)])(4).calls is None


def test_a_cpu_that_timed_the_calls_adds_up_their_times():
    """time_calls remakes each call on operands of its layout and times it; step_time then takes those
    seconds for the calls it timed and the rates for the rest."""
    from leanbp.plan import time_calls
    from leanbp.plan._devices import _operand

    x, w = torch.randn(30, 16), torch.randn(24, 16)
    with WorkCounter() as counter:
        torch.nn.functional.linear(x, w)
    (signature, (count, flops)), = counter.work.calls.items()
    remade = _operand(signature[1])
    assert [(t.shape, t.stride()) for t in remade] == [((30, 16), (16, 1)), ((16, 24), (1, 16))]
    seconds = time_calls(counter.work.calls, seconds=0.01)
    assert seconds[signature] > 0
    tensors = parameter_tensors(_model(layers=2))
    work = Work(flops=flops + 1e9, attention=0.0, calls=counter.work.calls)
    cpu = replace(GPUS["h100"], flops={"fp32": 1e11}, calls={signature: 2.0})
    timed = step_time(work, Setup(), rank_bytes(tensors, Setup()), "fp32", device=cpu)
    assert timed.compute == pytest.approx(2.0 + 1e9 / 1e11)


def test_causal_attention_counts_the_pairs_it_computes():
    q = torch.zeros(1, 2, 8, 4)
    with WorkCounter() as counter:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True)
    assert counter.work.flops == 2 * 2 * (8 * 9 // 2) * (4 + 4)
    with WorkCounter() as counter:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, False)
    assert counter.work.flops == 2 * 2 * 64 * 8
    assert counter.work.attention == counter.work.flops  # (attention kernels only)
    with WorkCounter() as counter:
        torch.mm(torch.zeros(8, 4), torch.zeros(4, 3))
    assert counter.work.flops == 2 * 8 * 4 * 3 and counter.work.attention == 0


def test_attention_runs_at_the_devices_attention_rate():
    """A GPU's attention rate is its matmul peak; a device that states its own (the measured CPU)
    times the attention FLOPs at that rate and the rest at the matmul rate."""
    tensors = parameter_tensors(_model(layers=2))
    work = Work(flops=3e12, attention=1e12)
    gpu = step_time(work, Setup(efficiency=1.0), rank_bytes(tensors, Setup()), "bf16")
    assert gpu.compute == pytest.approx(3e12 / GPUS["h100"].matmul_rate("bf16"))
    cpu = replace(GPUS["h100"], flops={"fp32": 2e12}, attention={"fp32": 0.5e12})
    timed = step_time(work, Setup(), rank_bytes(tensors, Setup()), "fp32", device=cpu)
    assert timed.compute == pytest.approx(2e12 / 2e12 + 1e12 / 0.5e12)


def test_the_measured_cpu_states_its_attention_rate_apart():
    from leanbp.plan import measure_cpu

    cpu = measure_cpu(torch.float32, size=256, seconds=0.05, heads=(4, 2), head_dim=16)
    assert set(cpu.attention) == set(cpu.flops) == {"fp32"}
    assert cpu.attention_rate("fp32") == cpu.attention["fp32"] != cpu.matmul_rate("fp32")
    assert GPUS["h100"].attention_rate("bf16") == GPUS["h100"].matmul_rate("bf16")
    assert cpu.transcendental_rate("fp32") > 0 and cpu.fresh > 0
    assert GPUS["h100"].transcendental_rate("bf16") is None and GPUS["h100"].fresh is None


def test_step_time_follows_rates_links_and_efficiency():
    tensors = parameter_tensors(_model(layers=2))
    work = Work(flops=989e12, bytes=3350e9)
    one = step_time(work, Setup(efficiency=1.0), rank_bytes(tensors, Setup()), "bf16")
    assert one.compute == pytest.approx(1.0) and one.memory == pytest.approx(1.0) and one.total == pytest.approx(2.0)
    half = step_time(work, Setup(efficiency=0.5), rank_bytes(tensors, Setup()), "bf16")
    assert half.total == pytest.approx(4.0)
    h200 = step_time(work, Setup(gpu="h200", efficiency=1.0), rank_bytes(tensors, Setup()), "bf16")
    assert h200.memory == pytest.approx(3350 / 4800)
    setup = Setup(gpus=8, engine="fsdp2", efficiency=1.0)
    share = rank_bytes(tensors, setup)
    eight = step_time(Work(), setup, share, "bf16")
    assert eight.comm == pytest.approx(share.collective / GPUS["h100"].nvlink) and eight.total == eight.comm
    host = Setup(optimizer="host", efficiency=1.0)
    stepped = step_time(Work(), host, rank_bytes(tensors, host), "bf16", optimizer=True)
    assert stepped.optimizer > 0 and stepped.total == stepped.optimizer


def test_a_planned_offload_step_moves_its_layer_boundaries_over_pcie(bf16_planner):
    planner = bf16_planner
    assert planner.offload_pcie_bytes("leanbp", 4096) == 0
    moved = planner.offload_pcie_bytes("leanbp_offload", 4096)
    # per layer: 2T in forward, (T - chunk) + 3T in backward; 3T around the decoder
    assert moved == (4 * (2 * 4096 + 4096 - 512 + 3 * 4096) + 3 * 4096) * 64 * 2
    assert planner.time("leanbp_offload", 4096).offload > 0


# -- per-rank lines ------------------------------------------------------------------------------
def test_a_planner_on_another_setup_shares_its_fake_steps_and_agrees_with_a_fresh_one():
    stream = StreamConfig(chunk_size=64, head_chunk_size=32)
    base = Planner(_config(layers=2), dtype="fp32", stream=stream)
    setup = Setup(gpus=4, engine="fsdp2", optimizer="adamw-bf16")
    shared = base.with_setup(setup)
    assert shared.setup == setup and base.setup == Setup()
    fresh = Planner(_config(layers=2), dtype="fp32", stream=stream, setup=setup)
    assert shared.peak("leanbp", 256, optimizer=True, probe=True) == fresh.peak("leanbp", 256, optimizer=True, probe=True)
    assert ("leanbp", 256) in base._steps  # the shared planner's fake step is the base's
    assert base.peak("leanbp", 256, optimizer=True) != shared.peak("leanbp", 256, optimizer=True)
    assert base.with_setup(Setup(gpus=4, sp=2))._steps == {}  # (another sequence split: its own steps)


def test_each_engine_changes_only_what_it_holds(bf16_planner):
    one = bf16_planner  # (one GPU; its lines serve every set-up)
    single = one.peak("leanbp", 4096)
    ddp = one.with_setup(Setup(gpus=4, engine="ddp")).peak("leanbp", 4096)
    assert ddp.total - single.total == ddp.grads == ddp.buffers  # one more copy of the gradients
    assert ddp.activations == single.activations
    fsdp = one.with_setup(Setup(gpus=4, engine="fsdp2")).peak("leanbp", 4096, optimizer=True)
    full = one.peak("leanbp", 4096, optimizer=True)
    assert fsdp.grads * 4 == full.grads and fsdp.activations == full.activations
    assert fsdp.optimizer < full.optimizer / 3


def test_cli_plans_several_gpus_and_states_the_setup(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    _config().to_json_file(str(cfg))
    out = tmp_path / "plan"
    assert main(["plan", "--model", str(cfg), "--memory", "64MiB", "--reserve", "0", "--seq-lens", "1024,4096",
                 "--methods", "ckpt,leanbp_offload", "--chunk-size", "512", "--head-chunk-size", "1024",
                 "--gpus", "4", "--engine", "zero3", "--optimizer", "host", "--offload-params", "--host-memory",
                 "1GiB", "--gpu", "h200", "--efficiency", "0.4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "4 x H200 SXM 141GB, engine zero3 with the weights offloaded to the host, optimizer host" in printed
    assert "efficiency 0.4" in printed and "step s" in printed
    assert main(["plan", "--model", str(cfg), "--gpus", "2", "--engine", "single", "--out", str(out)]) == 2
    assert main(["plan", "--model", str(cfg), "--engine", "zero2", "--optimizer", "adamw-bf16",
                 "--out", str(out)]) == 2
