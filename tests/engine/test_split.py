"""A streamed backward split into an input pass and a weight pass (``leanbp.engine`` ``_split.py``),
as torch's pipeline stages run it (``stage_backward_input`` / ``stage_backward_weight``): the input
pass gives the input gradient of plain autograd and no parameter gradient, the weight pass gives
every parameter's, and each pass does less work than the full backward."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

import leanbp
from leanbp.engine import backward_pass, current_pass
from leanbp.plan import WorkCounter
from leanbp.streaming import stage_hidden, stage_loss
from conftest import tiny_model

TOL = 1e-12


def _stage_out(model, hidden_in, labels, last: bool, defer: bool = False):
    """Layers 1.. of ``model`` on ``hidden_in`` (a stage after the first), with the loss when last."""
    n = model.config.num_hidden_layers
    out = stage_hidden(model, range(1, n), inputs_embeds=hidden_in)
    if last:
        return stage_loss(model, out, labels, (labels[:, 1:] != -100).sum(), defer_param_grads=defer)
    return out


@pytest.mark.parametrize("last, defer", [(False, False), (True, False), (True, True)],
                         ids=["middle stage", "last stage (chunked head)", "last stage, head's weights deferred"])
def test_input_then_weight_pass_equal_the_full_backward_and_each_costs_less(last, defer):
    model = leanbp.stream(tiny_model("llama", num_hidden_layers=3, tie_word_embeddings=False), chunk_size=5,
                          head_chunk_size=7)
    params = [p for i in (1, 2) for p in model.model.layers[i].parameters()]
    if last:
        params += [model.model.norm.weight, model.lm_head.weight]
    torch.manual_seed(3)
    hidden_in = torch.randn(2, 17, model.config.hidden_size, dtype=torch.float64)
    labels = torch.randint(0, model.config.vocab_size, (2, 17))
    grad_out = None if last else torch.randn(2, 17, model.config.hidden_size, dtype=torch.float64)

    x = hidden_in.clone().requires_grad_()
    out = _stage_out(model, x, labels, last)
    with WorkCounter() as full_flops:
        out.backward(grad_out)
    full = {id(p): p.grad.clone() for p in params}
    full_input = x.grad.clone()
    model.zero_grad(set_to_none=True)

    x = hidden_in.clone().requires_grad_()
    out = _stage_out(model, x, labels, last, defer)
    with WorkCounter() as input_flops, backward_pass("input"):
        (dx,), groups = stage_backward_input([out], None if last else [grad_out], [x], iter(params))
    assert current_pass() == "full"
    assert all(p.grad is None for p in params)  # the input pass hands no parameter gradient over
    assert (dx - full_input).abs().max() <= TOL * full_input.abs().max()
    with WorkCounter() as weight_flops, backward_pass("weight"):
        stage_backward_weight(iter(params), groups)
    for p in params:
        assert (p.grad - full[id(p)]).abs().max() <= TOL * full[id(p)].abs().max()
    # the input pass skips every dW = X^T dY. The weight pass recomputes the chunks and backpropagates
    # to every weight: in a pre-norm layer whose norms train, that needs every dX but the layer
    # input's own (the norms' weights need the gradient of their outputs), so it costs what the full
    # backward costs; the split's price is the input pass
    total, inp, wgt = full_flops.flops, input_flops.flops, weight_flops.flops
    assert 0.5 * total < inp < 0.9 * total
    if defer:  # the head's logits once more, and its weight gradient, in the weight pass
        assert wgt > total
    else:
        assert wgt == total


def test_a_deferring_head_holds_no_weight_gradient_between_forward_and_the_weight_pass():
    from leanbp.memory import track

    model = leanbp.stream(tiny_model("llama", num_hidden_layers=2, tie_word_embeddings=False), chunk_size=5,
                          head_chunk_size=7)
    hidden = torch.randn(2, 17, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, model.config.vocab_size, (2, 17))
    peak = {}
    for defer in (False, True):
        with track(model) as mem:
            loss = stage_loss(model, hidden, labels, 32, defer_param_grads=defer)
        peak[defer] = mem.report.peak
        del loss
    head = model.lm_head.weight
    assert peak[False] - peak[True] >= head.numel() * head.element_size()  # the (V, H) sum kept until backward


def test_a_pass_name_is_checked_and_restored():
    with pytest.raises(ValueError, match="backward pass must be one of"):
        with backward_pass("dw"):
            pass
    with pytest.raises(KeyError):
        with backward_pass("weight"):
            raise KeyError("inside")
    assert current_pass() == "full"
