"""A block of leanbp's work runs as the body of one call of its module, whatever the module's own
``__call__`` does."""

from __future__ import annotations

import torch

from leanbp.engine._module_call import call_through


def test_a_block_runs_once_inside_a_layer_that_checkpoints_in_its_own_call():
    """Some transformers versions checkpoint a decoder layer in its ``__call__``; a streamed block
    run through such a call must run once, not under checkpointing (StreamBP replaces it), and the
    layer's setting is restored."""
    class CheckpointingLayer(torch.nn.Module):
        gradient_checkpointing = True

        def __call__(self, *args, **kwargs):
            if self.gradient_checkpointing:
                raise AssertionError("the streamed block ran under the layer's checkpointing")
            return super().__call__(*args, **kwargs)

    layer, runs = CheckpointingLayer(), []
    out = call_through(layer, lambda h: runs.append(1) or h * 2, torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0)) and runs == [1] and layer.gradient_checkpointing
