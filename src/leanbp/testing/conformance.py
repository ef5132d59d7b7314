"""Distributed conformance check: streamed training under each engine equals one process.

Run under ``torchrun --nproc_per_node=2 -m leanbp.testing.conformance --out result.json`` (what
``run_conformance`` does)
(gloo on CPU). For every engine it trains a tiny Qwen3 (float64; float32 weights with bf16
compute for ``fsdp2_bf16``) on 4 padded rows (each rank takes its share) with chunks of 7 rows
(5 chunks per layer), once streamed and once plain, and records on rank 0:

* the gradients after one step, gathered to full tensors, and the parameters after 3 optimizer
  steps (SGD): compared in the test with one process on the whole batch;
* the collectives of the step (calls and bytes per kind): equal with and without leanbp.

One launch runs every engine, so the process start-up is paid once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist

from ..approx import approx
from ..distributed import partition_for_zero3, torchrun_command
from ..engine import IGNORE_INDEX, is_routed
from ..models import DecoderAdapter
from ..streaming import stream
from ._references import patch_full_precision_norms

CHUNK = 7
SEQ = 31  # 5 chunks of 7 rows (the last one partial)
ROWS = 4
LR = 0.05
STEPS = 3
# "_late": leanbp.stream called on the wrapped model (after DDP / fully_shard / deepspeed.initialize);
# "_approx": the model under leanbp.approx (ReSiLU2 + MS-RMSNorm) as well
ENGINES = ("ddp", "ddp_late", "fsdp2", "fsdp2_bf16", "fsdp2_late", "fsdp2_approx", "zero2", "zero3", "zero3_late")
HF_ENGINES = ("trainer_zero3",)  # DeepSpeed through the transformers Trainer (and its Accelerate plugin)


def tiny_config():
    import transformers

    return transformers.Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    tie_word_embeddings=False, attn_implementation="sdpa")


def build_model(dtype=torch.float64, approximated: bool = False):
    """The same weights in every process (seeded), with float64-preserving norms (transformers'
    RMSNorm rounds to fp32 inside); ``approximated``: under leanbp.approx (ReSiLU2, MS-RMSNorm)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(), dtype=dtype)
    if approximated:
        approx(model, activations=True, norms=True)
    patch_full_precision_norms(model)
    return model


def full_batch():
    """4 rows, two padded on the left by different amounts, prompts masked inside a chunk."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (ROWS, SEQ), generator=g)
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[1, :5] = 0
    mask[3, :11] = 0
    labels = ids.clone()
    labels[mask == 0] = IGNORE_INDEX
    labels[:, :9] = IGNORE_INDEX
    return ids, mask, labels


def shard(batch, rank: int, world: int):
    per = ROWS // world
    return tuple(t[rank * per:(rank + 1) * per] for t in batch)


def items(labels) -> float:
    """Labelled next-token targets in ``labels`` (what a causal-LM loss averages over)."""
    return float((labels[:, 1:] != IGNORE_INDEX).sum())


class CollectiveCounter:
    """Counts the collectives called through ``torch.distributed`` (and DDP's all-reduce buckets,
    through a comm hook) while active: {kind: calls} and {kind: bytes}."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "broadcast", "all_reduce_coalesced", "_all_gather_base", "_reduce_scatter_base",
             "all_gather_single", "reduce_scatter_single", "all_to_all_single")

    def __init__(self):
        self.calls, self.bytes, self.active = Counter(), Counter(), False
        self._saved = {}

    def record(self, kind: str, tensors) -> None:
        if self.active:
            self.calls[kind] += 1
            self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    def install(self):
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def counted(*args, _fn=fn, _name=name, **kwargs):
                self.record(_name, list(args[:2]) + [v for v in kwargs.values() if torch.is_tensor(v)])
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def ddp_hook(self, state, bucket):
        self.record("ddp_bucket_all_reduce", [bucket.buffer()])
        buffer = bucket.buffer().div_(dist.get_world_size())  # average, as DDP's default hook does
        all_reduce = self._saved.get("all_reduce", dist.all_reduce)  # (counted once, as the bucket)
        return all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    @contextlib.contextmanager
    def counting(self):
        self.calls.clear()
        self.bytes.clear()
        self.active = True
        try:
            yield
        finally:
            self.active = False


def _zero_config(stage: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(), "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True}
    if stage == 3:
        # partition even the tiny test model's parameters (the default keeps small ones whole)
        config["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0,
                                           stage3_prefetch_bucket_size=0)
    return config


def run_engine(engine: str, streamed: bool, counter: CollectiveCounter) -> dict:
    """Train STEPS steps; returns full gradients of step 1, full parameters after STEPS, collectives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    late, approximated = engine.endswith("_late"), engine.endswith("_approx")
    engine = engine.removesuffix("_late").removesuffix("_approx")
    dtype = torch.float32 if engine == "fsdp2_bf16" else torch.float64
    if engine.startswith("zero"):
        import deepspeed  # noqa: F401  (before leanbp.stream, which then makes the layers ZeRO-3 leaves)
    model = build_model(dtype, approximated)
    if streamed and not late:
        stream(model, chunk_size=CHUNK, head_chunk_size=5)
    elif not streamed and engine == "zero3":
        # the engine configuration leanbp runs under: decoder layers as ZeRO-3 leaves (one gather of
        # a layer's parameters per call instead of one per submodule; the same bytes, fewer calls)
        from deepspeed.utils import set_z3_leaf_module

        for layer in model.model.layers:
            set_z3_leaf_module(layer, True)
    names = [n for n, _ in model.named_parameters()]
    ids, mask, labels = shard(full_batch(), rank, world)
    # each rank's loss sums its tokens and divides by the whole batch's count / world: the engines
    # average gradients over ranks, which then gives the gradient of the whole batch's mean loss
    denominator = torch.tensor(items(full_batch()[2]) / world, dtype=dtype)

    if engine == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        wrapped.register_comm_hook(None, counter.ddp_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        step = lambda loss: (loss.backward(), )  # noqa: E731
    elif engine.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()
        if engine == "fsdp2_bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=True, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        wrapped = model
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        step = lambda loss: (loss.backward(), )  # noqa: E731
    else:
        import deepspeed

        config = _zero_config(int(engine[-1]))
        if engine == "zero3":  # (what leanbp train does: a dtype that does not depend on the machine)
            partition_for_zero3(model, config)
        wrapped, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                        config=config)
        step = lambda loss: wrapped.backward(loss)  # noqa: E731
    if streamed and late:
        stream(wrapped, chunk_size=CHUNK, head_chunk_size=5)

    grads = None
    collectives = None
    for i in range(STEPS):
        with counter.counting(), ChunkCounter() as chunks:
            out = wrapped(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=denominator)
            step(out.loss)
        if i == 0:
            # chunks a layer ran in the step (forward and backward recompute), measured
            chunks_per_layer = chunks.calls / (2 * len(model.model.layers))
            collectives = {"calls": dict(counter.calls), "bytes": dict(counter.bytes)}
            grads = _full_grads(engine, wrapped, model, names)
            grad_dtype = str(_grad_dtype(engine, model))
        if engine.startswith("zero"):
            wrapped.step()
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    params = _full_params(engine, model, names)
    if engine.startswith("zero"):
        wrapped.destroy()
    return {"grads": grads, "params": params, "collectives": collectives, "grad_dtype": grad_dtype,
            "chunks_per_layer": chunks_per_layer}


class ChunkCounter:
    """Counts the streamed chunk computations (the adapter's ``chunk_forward``) while active: 0 for
    a model that did not stream."""

    def __enter__(self):
        self.calls, self._cls = 0, DecoderAdapter
        self._plain = DecoderAdapter.chunk_forward

        def counted(adapter, *args, **kwargs):
            self.calls += 1
            return self._plain(adapter, *args, **kwargs)

        DecoderAdapter.chunk_forward = counted
        return self

    def __exit__(self, *exc):
        self._cls.chunk_forward = self._plain
        return False


def _grad_dtype(engine, model):
    p = next(model.parameters())
    if engine.startswith("zero"):
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(p).dtype
    return p.grad.dtype


def _full_grads(engine, wrapped, model, names) -> dict:
    out = {}
    for name, p in zip(names, model.parameters()):
        if engine.startswith("zero"):
            from deepspeed.utils import safe_get_full_grad

            g = safe_get_full_grad(p)
        else:
            g = p.grad
            if hasattr(g, "full_tensor"):  # FSDP2: a sharded DTensor
                g = g.full_tensor()
        out[name] = None if g is None else g.detach().double().tolist()
    return out


def _full_params(engine, model, names) -> dict:
    out = {}
    for name, p in zip(names, model.parameters()):
        if engine == "zero3":
            from deepspeed.utils import safe_get_full_fp32_param

            t = safe_get_full_fp32_param(p)
        else:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone().tolist()
    return out


def run_trainer(engine: str, streamed: bool, counter: CollectiveCounter) -> dict:
    """``trainer_zero3``: the transformers Trainer (through its Accelerate DeepSpeed plugin) with a
    DeepSpeed ZeRO-3 config, the model built after TrainingArguments, so partitioned by zero.Init
    as it is built; STEPS SGD steps on the 4 rows (2 per rank). Returns the parameters after the
    steps and the collectives of the whole run."""
    import tempfile

    import transformers
    from deepspeed.utils import safe_get_full_fp32_param

    world = dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": ROWS // world, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=ROWS // world, learning_rate=LR, max_steps=STEPS,
        lr_scheduler_type="constant", max_grad_norm=1.0, deepspeed=config, report_to=[], logging_strategy="no",
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    model = build_model(torch.float32)  # under DeepSpeed's zero.Init: partitioned as it is built
    _stream_or_leaves(model, streamed)
    ids, mask, labels = full_batch()
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(ROWS)]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    with counter.counting():
        trainer.train()
    params = {n: safe_get_full_fp32_param(p).double().tolist() for n, p in model.named_parameters()}
    trainer.model_wrapped.destroy()
    return {"params": params, "collectives": {"calls": dict(counter.calls), "bytes": dict(counter.bytes)},
            # a layer is routed on its first streamed call: proof that the trainer's steps streamed
            "streamed_layers": sum(is_routed(layer) for layer in model.model.layers)}


def _stream_or_leaves(model, streamed: bool) -> None:
    """leanbp.stream, or (plain) the same ZeRO-3 configuration: decoder layers as leaves."""
    if streamed:
        stream(model, chunk_size=CHUNK, head_chunk_size=5)
    else:
        from deepspeed.utils import set_z3_leaf_module

        for layer in model.model.layers:
            set_z3_leaf_module(layer, True)


def run_conformance(out, engines, nproc: int = 2, env: dict | None = None, timeout_s: int = 900) -> dict:
    """Run the check of ``engines`` under torchrun on ``nproc`` CPU processes (gloo), writing and
    returning the results (``env``: the processes' environment, e.g. with forced probes)."""
    import subprocess

    env = {**(env if env is not None else os.environ), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(torchrun_command(nproc, __name__, ["--out", str(out), "--engines", ",".join(engines)]),
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the conformance run failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--engines", default=",".join(ENGINES))
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    counter = CollectiveCounter().install()
    results = {}
    for engine in args.engines.split(","):
        results[engine] = {}
        for streamed in (True,) if engine.endswith("_late") else (True, False):
            try:
                run = run_trainer if engine in HF_ENGINES else run_engine
                results[engine]["leanbp" if streamed else "plain"] = run(engine, streamed, counter)
            except Exception as e:  # recorded, so one engine's failure does not hide the others
                import traceback

                results[engine]["leanbp" if streamed else "plain"] = {"error": traceback.format_exc()}
                print(f"rank {dist.get_rank()} {engine} streamed={streamed}: {e!r}", flush=True)
            dist.barrier()
    if "deepspeed" in sys.modules:  # what the accelerator answered (tests force it both ways)
        from deepspeed.accelerator import get_accelerator

        results["_probes"] = {"deepspeed_fp16": bool(get_accelerator().is_fp16_supported())}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
