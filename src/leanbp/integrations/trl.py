"""leanbp with TRL's trainers (SFT, DPO, GRPO; KTO and RLOO use the same fused head).

    trainer = SFTTrainer(model=model, args=args, train_dataset=data, peft_config=lora)  # or DPO/GRPO
    leanbp.integrations.trl.stream_trainer(trainer, chunk_size=2048)
    trainer.train()

TRL computes per-token log-probs through a fused LM head that it installs while building the
trainer. ``stream_trainer`` streams the trained model (whatever PEFT did to it) and a separate
reference model, after that, so leanbp answers the fused-head calls too: the decoder streams and
the log-probs come from leanbp's chunked head. Streaming the model before handing it to the trainer
also streams the decoder, but TRL's own head then computes the log-probs (leanbp warns once).

TRL's configs turn activation checkpointing on by default; ``stream_trainer`` turns it off, since
StreamBP already keeps only each layer's input (a streamed step would ignore it anyway).

**Sequence parallelism** (``stream_trainer(trainer, sequence_parallel=True)`` under torchrun, or a
process group of P consecutive ranks): each sequence is spread over the P ranks of its group,
Ulysses-style inside the streamed layers, for SFT, DPO and GRPO alike (TRL's own GRPO and DPO
trainers refuse ``sp_size > 1``). TRL keeps working on whole sequences: every rank of a group gets
the same batches (the training data loader is sharded over the groups, not the ranks), leanbp's
forwards take the rank's rows of TRL's inputs and give the loss and TRL's per-token results back
for the whole sequence, so TRL's masks, advantages and sums are its own. Each rank's gradient is
its rows' share, times P, and the trainer's DDP/FSDP/DeepSpeed engine averages the ranks'
gradients as it does for data parallelism: the group's P shares add up to the sequence's gradient.
Metrics TRL sums over processes (``num_tokens``) count each group's batch P times.

**TRL's own split** (SFT with accelerate's ``ParallelismConfig(sp_size=P, sp_backend="deepspeed")``:
DeepSpeed's Ulysses loader hands each rank its slice of every sequence): ``stream_trainer(trainer)``
follows it; training calls stream over DeepSpeed's group and return the slice's loss and per-token
results, which transformers' Trainer weighs and DeepSpeed sums, as for DeepSpeed's own attention.
"""

from __future__ import annotations

from ..streaming import StreamConfig, causal_lm_of, resolve_config, state_of, stream


# the positional parameters of stream_trainer() before StreamConfig carried them (deprecated)
_OLD_POSITIONAL = ("chunk_size", "head_chunk_size", "chunk_memory", "offload")


def stream_trainer(trainer, config: StreamConfig | None = None, *old_positional, sequence_parallel=None, **overrides):
    """Stream ``trainer.model`` and ``trainer.ref_model`` (when the trainer has a separate one) with
    ``config`` and ``overrides`` (as ``leanbp.stream``), and switch the trainer's activation
    checkpointing off. With ``offload``, a reference model (which builds no graph) keeps nothing
    on the host. ``sequence_parallel``: ``True`` (every process shares each sequence) or a process
    group of P consecutive ranks (see the module's docstring); a trainer whose parallelism_config
    splits the sequence itself is followed without it. Returns the trainer."""
    config = resolve_config(config, overrides, old_positional, _OLD_POSITIONAL)
    presliced = _presliced(trainer, sequence_parallel)
    for name in ("activation_checkpointing", "gradient_checkpointing"):  # transformers 5 keeps both fields
        if getattr(trainer.args, name, False):
            setattr(trainer.args, name, False)
    if sequence_parallel is not None and sequence_parallel is not False:
        _share_batches_in_groups(trainer, sequence_parallel)
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        lm = causal_lm_of(model)
        if getattr(lm, "is_activation_checkpointing", False):  # enabled while the trainer was built
            lm.activation_checkpointing_disable()
        stream(model, config, sequence_parallel=sequence_parallel)
        if sequence_parallel is not None and sequence_parallel is not False:
            state_of(lm).whole_sequences = True  # (TRL passes whole sequences)
        state_of(lm).presliced = presliced
    return trainer


def _presliced(trainer, sequence_parallel) -> bool:
    """Whether the trainer's own sequence parallelism hands each rank a slice of every sequence
    (accelerate's ``ParallelismConfig(sp_size=P, sp_backend="deepspeed")``: DeepSpeed's Ulysses data
    loader, TRL's SFT and transformers' Trainer); refuses what leanbp does not follow."""
    pc = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    if pc is None:
        return False
    if getattr(pc, "cp_enabled", False):
        raise ValueError("the trainer's parallelism_config has cp_size > 1 (ring attention over load-balanced "
                         "shards), which leanbp's streamed layers do not follow: use sp_size (DeepSpeed's Ulysses), or "
                         "leave it out and call stream_trainer(trainer, sequence_parallel=True)")
    if not getattr(pc, "sp_enabled", False):
        return False
    if sequence_parallel is not None and sequence_parallel is not False:
        raise ValueError("the trainer's parallelism_config splits the sequence itself (sp_size > 1): leave "
                         "sequence_parallel out (leanbp follows its split) or the parallelism_config out")
    if not getattr(getattr(pc, "sp_handler", None), "sp_disable_in_eval", True):
        raise ValueError("sp_disable_in_eval=False (sliced evaluation batches) is not supported: leanbp streams "
                         "evaluation calls whole, as DeepSpeed's default does")
    return True


def _share_batches_in_groups(trainer, group) -> None:
    """The training data loader sharded over the sequence-parallel groups (the data-parallel ranks),
    not over every process: the P ranks of a group get the same batches. The group must be P
    consecutive ranks starting at a multiple of P (as ``leanbp train --sp`` builds them)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("sequence_parallel needs torch.distributed initialized (torchrun, or init_process_group)")
    ranks = dist.get_process_group_ranks(group if group is not True else dist.group.WORLD)
    size, world, rank = len(ranks), dist.get_world_size(), dist.get_rank()
    if ranks != list(range(ranks[0], ranks[0] + size)) or ranks[0] % size or world % size:
        raise ValueError(f"stream_trainer's sequence_parallel group must be P consecutive ranks starting at a multiple "
                         f"of P (ranks {ranks} of {world}): build the groups as [0..P-1], [P..2P-1], ...")
    own = trainer.get_train_dataloader

    def get_train_dataloader():
        loader = own()
        shard = getattr(loader, "batch_sampler", None)
        if not (hasattr(shard, "num_processes") and hasattr(shard, "process_index")):
            raise NotImplementedError(f"stream_trainer with sequence_parallel shards a map-style data set's batches "
                                      f"over the groups; this loader ({type(loader).__name__}) dispatches or streams "
                                      "them")
        if shard.num_processes != world:
            raise RuntimeError(f"the trainer's data loader is sharded over {shard.num_processes} processes, expected "
                               f"the {world} of the world")
        shard.num_processes, shard.process_index = world // size, rank // size
        return loader

    trainer.get_train_dataloader = get_train_dataloader
    _same_random_numbers_in_group(group if group is not True else None, ranks[0])


def _same_random_numbers_in_group(group, first: int) -> None:
    """Every rank of the group draws what its first rank draws from now on. GRPO and RLOO seed each
    process differently (``set_seed(seed, device_specific=True)``) so that the processes sample
    different completions; the ranks of a group must sample the same ones (they score one batch),
    and the groups stay apart as the processes did (group g draws as its rank g P did)."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    states = [(torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
               random.getstate(), np.random.get_state())]
    dist.broadcast_object_list(states, src=first, group=group)
    cpu, cuda, python, numpy = states[0]
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python)
    np.random.set_state(numpy)
__all__ = ["stream_trainer"]
