"""The ways a training step can run that leanbp is measured against, in one table: ``leanbp bench``
runs them side by side, ``leanbp plan`` predicts them."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ._config import StreamConfig
from ._stream import is_streamed, stream, unstream


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    checkpointing: bool = False  # transformers' gradient (activation) checkpointing, non-reentrant
    streamed: bool = False  # leanbp.stream with the run's StreamConfig and ``overrides``
    overrides: dict = field(default_factory=dict, hash=False)
    # leanbp plan predicts it: with a fixed chunk size every buffer of the step is affine in T
    planned: bool = True


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("plain", "plain autograd"),
    Method("ckpt", "transformers checkpointing", checkpointing=True),
    Method("leanbp", "leanbp", streamed=True),
    Method("leanbp_auto", 'leanbp, chunk size "auto"', streamed=True, overrides={"chunk_size": "auto"},
           planned=False),
    Method("leanbp_offload", "leanbp + offload", streamed=True, overrides={"offload": True}),
    Method("head", "transformers' decoder + leanbp's head", streamed=True, overrides={"layers": False}, planned=False),
)}

PLANNED = tuple(name for name, m in METHODS.items() if m.planned)


def method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {list(METHODS)}")
    return METHODS[name]


def apply_method(model: nn.Module, name: str, config: StreamConfig | None = None, sequence_parallel=None
                 ) -> nn.Module:
    """Set ``model`` (a transformers causal LM) up to train as method ``name`` does, from whatever
    method it was set up for before; ``config``: the streamed methods' settings;
    ``sequence_parallel``: as ``stream`` takes it (a streamed method only)."""
    m = method(name)
    if sequence_parallel is not None and not m.streamed:
        raise ValueError(f"{name} does not stream the layers: it cannot split a sequence over processes")
    if is_streamed(model):
        unstream(model)
    if m.checkpointing:
        # (transformers' enable also makes the embedding's output require grad, which only a PEFT
        # model loaded by transformers takes back on disable: note that the hook came from here)
        hooked = getattr(model, "_require_grads_hook", None) is not None
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if not hooked and getattr(model, "_require_grads_hook", None) is not None:
            model._leanbp_took_input_grads = True
    elif getattr(model, "is_activation_checkpointing", False):
        model.activation_checkpointing_disable()
    if getattr(model, "_leanbp_took_input_grads", False) and not m.checkpointing:
        # with a frozen embedding (LoRA) that hook keeps a hidden state per layer input that the
        # next method would not keep: gone with the checkpointing that made it
        if getattr(model, "_require_grads_hook", None) is not None:
            model.disable_input_require_grads()
        model._leanbp_took_input_grads = False
    if m.streamed:
        stream(model, config, sequence_parallel=sequence_parallel, **m.overrides)
    return model
