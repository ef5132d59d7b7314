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
"""

from __future__ import annotations

from ..streaming import StreamConfig, causal_lm_of, resolve_config, stream


# the positional parameters of stream_trainer() before StreamConfig carried them (deprecated)
_OLD_POSITIONAL = ("chunk_size", "head_chunk_size", "chunk_memory", "offload")


def stream_trainer(trainer, config: StreamConfig | None = None, *old_positional, **overrides):
    """Stream ``trainer.model`` and ``trainer.ref_model`` (when the trainer has a separate one) with
    ``config`` and ``overrides`` (as ``leanbp.stream``), and switch the trainer's activation
    checkpointing off. With ``offload``, a reference model (which builds no graph) keeps nothing
    on the host. Returns the trainer."""
    config = resolve_config(config, overrides, old_positional, _OLD_POSITIONAL)
    for name in ("activation_checkpointing", "gradient_checkpointing"):  # transformers 5 keeps both fields
        if getattr(trainer.args, name, False):
            setattr(trainer.args, name, False)
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        lm = causal_lm_of(model)
        if getattr(lm, "is_activation_checkpointing", False):  # enabled while the trainer was built
            lm.activation_checkpointing_disable()
        stream(model, config)
    return trainer


__all__ = ["stream_trainer"]
