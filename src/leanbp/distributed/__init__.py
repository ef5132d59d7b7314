"""What the distributed engines need from a streamed model, in one place.

The streamed decoder runs each decoder layer, the chunked final norm and the chunked LM head as
the body of one call of the module (the engine's ``_module_call.py``), and each of their autograd
Functions takes the parameters as explicit inputs and returns each one's gradient once, summed
over chunks. What an engine hooks on a module call or on a gradient therefore fires once per
module per step, as in plain training, whatever the number of chunks:

* DDP, DeepSpeed ZeRO-1/2: one gradient-ready hook per parameter per backward, so the all-reduce
  (reduce-scatter) buckets are those of plain training. Nothing to prepare.
* FSDP2 (``fully_shard`` per layer and on the root): a layer's pre-forward hook unshards it for its
  whole streamed forward (all chunks), its pre-backward hook for its whole streamed backward, and
  its post-backward hook reduce-scatters the summed gradients once. Nothing to prepare.
* DeepSpeed ZeRO-3 gathers the parameters a module owns *directly* around each call of it and of
  each of its submodules, and a streamed layer calls its submodules once per chunk. A ZeRO-3
  "leaf" module has all its parameters gathered by its own call (and its backward) and none by its
  children's, so ``leanbp.stream`` makes the decoder layers leaves: that must happen before
  ``deepspeed.initialize`` (or a Trainer / Accelerate with a DeepSpeed config) registers the hooks.
  The chunked head normally applies the final norm inside each head chunk; under ZeRO-3 the norm
  and the head are two calls (``gathers_per_call``), so each is gathered once.

A model built outside ``deepspeed.zero.Init`` is partitioned by ``deepspeed.initialize`` with a
dtype DeepSpeed picks from what the accelerator reports; ``partition_for_zero3`` partitions it
first with a dtype that does not depend on the machine (float64 models included).
"""

from __future__ import annotations

import sys

import torch
from torch import nn


def prepare_for_engines(layers, head_modules) -> None:
    """Called by ``leanbp.stream`` with the decoder layers it streams and the modules of the chunked
    head (final norm, LM head), before it changes anything."""
    check_layers(layers)
    if "deepspeed" in sys.modules:  # (importing DeepSpeed costs seconds: only when the user has)
        from deepspeed.utils import set_z3_leaf_module

        # the head's modules too: a wrapped head (PEFT) has children that would be gathered per chunk
        for module in (*layers, *head_modules):
            set_z3_leaf_module(module, True)


def check_layers(layers) -> None:
    """A ZeRO-3 model whose hooks were registered before the layers became leaves would gather
    each layer's parameters once per chunk: an ordering mistake, said clearly."""
    for layer in layers:
        if _hooked_by_zero3(layer) and not getattr(layer, "_z3_leaf", False):
            raise RuntimeError(
                "DeepSpeed ZeRO-3 registered its hooks on this model before leanbp.stream made the decoder layers "
                "ZeRO-3 leaves (so that each layer's parameters are gathered once per streamed forward and once per "
                "streamed backward, not once per chunk). Call leanbp.stream(model) after `import deepspeed` and "
                "before deepspeed.initialize, Accelerator.prepare or building the Trainer."
            )


def gathers_per_call(module: nn.Module) -> bool:
    """Whether the engine gathers ``module``'s parameters only for the duration of each of its
    calls (DeepSpeed ZeRO-3 partitions them), so a block must not use them outside one call."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


# the parameter dtypes DeepSpeed ZeRO-3 keeps as they are (its fp32 partitions hold the optimizer state)
ZERO3_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def partition_for_zero3(model: nn.Module, config: dict) -> None:
    """Partition ``model``'s parameters over the ranks as ``deepspeed.initialize(model=model,
    config=config)`` would, but with a dtype that does not depend on the machine; call it on every
    rank, then ``deepspeed.initialize`` (which finds the parameters partitioned and leaves them).

    Why: ``deepspeed.initialize`` partitions a model that was not built under ``zero.Init`` with
    ``zero.Init(module=model, dtype=<first parameter's dtype>)``, and ``Init`` keeps that dtype only
    where the accelerator reports fp16 support (DeepSpeed 0.19: ``dtype or torch.float16 if
    is_fp16_supported() else ...``), then asserts it is fp16, bf16 or fp32. A float64 model so fails
    on every GPU and on CPUs whose oneDNN reports fp16, and passes elsewhere. The dtype given here
    only names what ``Init`` would create or keep in fp32; the parameters keep their own dtype
    either way. fp16 / bf16 models pass their dtype (so buffers a model names for fp32 stay fp32);
    for fp32 and float64 the config decides: fp32, as it has no fp16 / bf16 section."""
    dtype = next(model.parameters()).dtype
    if dtype not in ZERO3_DTYPES:  # (before the first collective: every rank stops here alike)
        raise ValueError(f"DeepSpeed ZeRO-3 partitions parameters of dtype {', '.join(map(str, ZERO3_DTYPES))}; "
                         f"this model's are {dtype}")
    import deepspeed

    deepspeed.zero.Init(module=model, config_dict_or_path=config,
                        dtype=dtype if dtype in (torch.float16, torch.bfloat16) else None)


def torchrun_command(nproc: int, module: str, args, runner: str = "torch.distributed.run") -> list[str]:
    """The command that runs ``python -m <module> <args>`` in ``nproc`` processes on this machine
    (torchrun, standalone rendezvous; ``runner``: a module that takes torchrun's arguments)."""
    return [sys.executable, "-m", runner, "--standalone", f"--nproc_per_node={nproc}", "-m", module, *args]


def _hooked_by_zero3(module: nn.Module) -> bool:
    # ZeRO-3's parameter offload numbers every module it hooks; DDP, FSDP and ZeRO-1/2 don't
    return hasattr(module, "ds_id")


__all__ = ["ZERO3_DTYPES", "check_layers", "gathers_per_call", "partition_for_zero3", "prepare_for_engines",
           "torchrun_command"]
