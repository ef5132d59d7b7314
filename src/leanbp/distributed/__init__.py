"""What the distributed engines need from a streamed model, in one place.

The streamed decoder runs each decoder layer, the chunked final norm and the chunked LM head as
the body of one call of the module (``engine._calls.call_through``), and each of their autograd
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
"""

from __future__ import annotations

import sys

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


def _hooked_by_zero3(module: nn.Module) -> bool:
    # ZeRO-3's parameter offload numbers every module it hooks; DDP, FSDP and ZeRO-1/2 don't
    return hasattr(module, "ds_id")


__all__ = ["check_layers", "gathers_per_call", "prepare_for_engines"]
