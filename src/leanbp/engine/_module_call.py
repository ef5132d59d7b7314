"""Running a block of leanbp's work inside a module's own ``__call__``.

A streamed layer, the chunked final norm and the chunked LM head call their submodules once per
chunk, in forward and again in backward. A distributed engine that shards parameters hooks the
*module's* call: FSDP2 unshards a ``fully_shard``-ed module in its pre-forward hook and again in its
pre-backward hook, and reduce-scatters its gradients in its post-backward hook; DeepSpeed ZeRO-3
gathers a module's parameters around its call and its backward. Running the whole block as the
body of one call of the module makes those hooks fire once per block, whatever the number of
chunks, with the parameters whole for all of it (see ``leanbp.distributed``).
"""

from __future__ import annotations

from torch import nn

from .._patching import install, installed, uninstall


def call_through(module: nn.Module, block, *args):
    """``block(*args)``, run as the body of ``module(*args)``: the module's hooks see one call
    whose inputs are ``args`` and whose output is the block's. Parameters the block needs are
    looked up inside it, after the engine's pre-forward hook has materialized them."""
    if installed(module, "forward", _routed_forward) is None:
        install(module, "forward", _routed_forward)  # once per module; other calls pass through
    if getattr(module, "gradient_checkpointing", False) and type(module).__call__ is not nn.Module.__call__:
        # a layer class that checkpoints in its own __call__ (transformers' GradientCheckpointingLayer
        # in some versions) would run the streamed block twice: StreamBP replaces checkpointing
        module.gradient_checkpointing = False
        try:
            return module(*args, _leanbp_block=block)
        finally:
            module.gradient_checkpointing = True
    return module(*args, _leanbp_block=block)


def unroute(module: nn.Module) -> None:
    uninstall(module, "forward", _routed_forward)


def is_routed(module: nn.Module) -> bool:
    """Whether leanbp has run a block as the body of a call of ``module`` (routed on first use)."""
    return installed(module, "forward", _routed_forward) is not None


def _routed_forward(module: nn.Module, plain, *args, _leanbp_block=None, **kwargs):
    if _leanbp_block is None:
        return plain(*args, **kwargs)  # the module's own forward, for every call leanbp does not make
    if kwargs:  # (a pre-forward hook added arguments the block would silently drop)
        raise TypeError(f"a hook on {type(module).__name__} added arguments {sorted(kwargs)} to a call leanbp makes")
    return _leanbp_block(*args)
