"""Shared pieces of the engine tests: a batch with padding and prompt masks, and the reference step."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from leanbp.engine import IGNORE_INDEX
from leanbp.testing import relative_errors, streamed_vs_plain


REPO = Path(__file__).resolve().parents[1]  # the checkout: README, docs/, benchmarks/
# the bench models at a tiny size (the ``small_cases`` fixture of tests/conftest.py)
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=192, vocab_size=512)  # (MoE experts: 192 // 3, rows of 16-byte multiples)


def make_batch(B=3, T=45, vocab=101, padding="left", prompt=13, seed=1):
    """Token ids, a padding mask (rows padded by different amounts) and prompt-masked labels whose
    prompt boundary falls inside a chunk."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if padding != "none":
        for b, n_pad in enumerate([5, 11, 0, 3][:B]):
            if n_pad:
                if padding == "left":
                    mask[b, :n_pad] = 0
                else:
                    mask[b, T - n_pad:] = 0
    labels = ids.clone()
    labels[mask == 0] = IGNORE_INDEX
    labels[:, :prompt] = IGNORE_INDEX
    return ids, mask, labels


def compare_step(model, stream_kwargs, batch, embeds=False, num_items_in_batch=None):
    """Loss, input gradient and all parameter gradients of leanbp vs plain autograd (float64 norms).

    Returns (loss error, input-gradient relative error, {param: relative error})."""
    ids, mask, labels = batch
    ref_inputs = inputs = dict(attention_mask=mask, input_ids=ids)
    if embeds:
        ref_in = model.get_input_embeddings()(ids).detach().requires_grad_()
        model_in = ref_in.detach().clone().requires_grad_()
        ref_inputs, inputs = dict(attention_mask=mask, inputs_embeds=ref_in), dict(attention_mask=mask, inputs_embeds=model_in)
    ref, ref_loss, loss = streamed_vs_plain(model, labels, inputs, stream_kwargs, ref_inputs=ref_inputs,
                                            num_items_in_batch=num_items_in_batch)
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    input_err = None
    if embeds:
        input_err = ((model_in.grad - ref_in.grad).norm() / ref_in.grad.norm()).item()
    return loss_err, input_err, relative_errors(ref, model)


def forced_probes(deepspeed_fp16: bool | None = None, pdeathsig: bool | None = None) -> dict[str, str]:
    """The environment of a process that answers DeepSpeed's fp16 probe with ``deepspeed_fp16``
    and leanbp's parent-death-signal probe with ``pdeathsig`` (None: as the machine does),
    whatever this machine reports (tests/_forced_probes/sitecustomize.py)."""
    site = str(Path(__file__).resolve().parent / "_forced_probes")
    path = os.pathsep.join(filter(None, (site, os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path}
    for name, answer in (("LEANBP_TEST_DEEPSPEED_FP16", deepspeed_fp16), ("LEANBP_TEST_PDEATHSIG", pdeathsig)):
        if answer is not None:
            env[name] = "1" if answer else "0"
    return env


def plan_config(layers=4, **extra):
    """The planner tests' tiny Qwen3 shape (its fake steps take seconds)."""
    import transformers

    return transformers.Qwen3Config(**{**dict(hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                              vocab_size=512, max_position_embeddings=4096,
                                              tie_word_embeddings=False, attn_implementation="sdpa"), **extra})


def torchrun(script: Path, out: str, world: int) -> str:
    """One ``torchrun`` launch of ``world`` CPU ranks of ``script`` (beside the tests: it imports
    them) with the argument ``out``; returns the tail of its output, for a failing test to show."""
    import subprocess
    import sys

    here = script.resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                           str(script), out], env=env, capture_output=True, text=True, timeout=900)
    return done.stdout[-4000:] + done.stderr[-4000:]


def slope_error(loss, params, eps: float = 1e-6, seed: int = 7) -> float:
    """|grad . d - (loss(+eps d) - loss(-eps d)) / 2 eps| / |that difference|: whether the gradient
    that ``loss()`` (a float64 loss, backpropagated here) leaves on ``params`` is its derivative along
    a random direction d. ``loss`` must draw the same random numbers on every call (a fixed seed).
    eps 1e-6: float64's rounding stays ~1e-10 of the slope, the truncation error ~1e-9 on the tiny models."""
    for p in params:
        p.grad = None
    loss().backward()
    g = torch.Generator().manual_seed(seed)
    direction = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    projected = sum(float((p.grad * d).sum()) for p, d in zip(params, direction))
    losses = []
    for sign in (1, -1):  # (the losses with grad enabled: a training step's forward, whose draws
        with torch.no_grad():  # a forward under no_grad need not repeat)
            for p, d in zip(params, direction):
                p.add_(sign * eps * d)
        losses.append(loss().item())
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.sub_(sign * eps * d)
    slope = (losses[0] - losses[1]) / (2 * eps)
    return abs(projected - slope) / abs(slope)
