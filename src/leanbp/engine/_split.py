"""A backward split in two, for pipeline schedules that defer the weight gradients (2BP, zero bubble).

A pipeline stage's backward can run as one pass ("full") or as two: first the gradient of the
stage's input only ("input": what the previous stage waits for), later the gradients of its
weights ("weight": work that fills the pipeline's idle time). ``torch.distributed.pipelining``
splits plain autograd graphs by itself; a streamed Function is one node that computes both kinds
at once, so it must be told which pass is running. The pipeline stage sets the pass around each
backward it runs (``backward_pass``) and every streamed Function reads it (``current_pass``):

* input pass: the Function returns its input's gradient and no parameter gradient; autograd skips
  every weight-gradient product (dW = X^T dY) in its chunk graphs. It keeps nothing new: the
  stage keeps the Function's output gradient for the weight pass (that is torch's split).
* weight pass: the Function recomputes its chunks from its saved input and returns only its
  parameters' gradients, from the same output gradient. Memory: nothing but that gradient and the
  input (both kept anyway) waits between the passes; the price is a second recompute.

A pass is a process-wide setting, not a context variable: autograd runs a CUDA backward on its
own device thread, which a context variable would not reach.
"""

from __future__ import annotations

from contextlib import contextmanager

FULL, INPUT, WEIGHT = "full", "input", "weight"
PASSES = (FULL, INPUT, WEIGHT)

_current = FULL


def current_pass() -> str:
    """The backward pass running now (``FULL`` outside a split pipeline stage)."""
    return _current


@contextmanager
def backward_pass(name: str):
    """Run a backward as the given pass of a split backward."""
    global _current
    if name not in PASSES:
        raise ValueError(f"backward pass must be one of {PASSES}, got {name!r}")
    before, _current = _current, name
    try:
        yield
    finally:
        _current = before


def wanted(ctx, first_param: int) -> tuple[bool, list[bool]]:
    """(whether this pass computes the Function's input gradient, which parameters it computes),
    from autograd's needs (input 0, parameters from ``first_param`` on) and the running pass."""
    running = _current
    need_input = bool(ctx.needs_input_grad[0]) and running != WEIGHT
    need_params = [bool(n) and running != INPUT for n in ctx.needs_input_grad[first_param:]]
    return need_input, need_params
