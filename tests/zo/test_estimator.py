"""DPZero's estimator: the finite difference is the directional derivative g . z to O(mu^2) on real
model families (float64, against autograd), the direction is unbiased (E[(g . z) z] = g), z
regenerates bit for bit from its seed, and perturb / restore round the parameters by at most
what ``_directions.py`` states."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

import leanbp
from leanbp.engine import IGNORE_INDEX
from leanbp.models import tiny_config
from leanbp.testing import full_precision_norms, randomize_for_checks
from leanbp.zo import Direction, DPZero, DPZeroConfig, example_losses, finite_differences, trainable_parameters


def _model(family: str, dtype=torch.float64, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family), dtype=dtype)
    return randomize_for_checks(model)


def _batch(vocab: int, B: int = 3, T: int = 23, seed: int = 1):
    """Rows of different lengths (right padding) with prompt-masked labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 15:] = 0
    labels = ids.clone()
    labels[:, :7] = IGNORE_INDEX
    labels[mask == 0] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _reference_losses(model, batch) -> torch.Tensor:
    """(B,) per-example mean CE with autograd, from the model's logits (the oracle of example_losses)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
    targets = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]  # (B, T)
    scored = targets != IGNORE_INDEX
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(log_probs * scored).sum(1) / scored.sum(1)


@pytest.mark.parametrize("family, streamed", [("qwen3", False), ("llama", True)])
def test_the_finite_difference_is_the_directional_derivative_to_second_order(family, streamed):
    """d = g . z + (mu^2 / 6) l'''[z, z, z] + ...: at mu = 1e-5 within 1e-4 of g . z (relative), and
    halving mu divides the error by 4 (3.9 to 4.1): the central difference and nothing else."""
    model = _model(family)
    batch = _batch(model.config.vocab_size)
    with full_precision_norms(model):  # (transformers' RMSNorm rounds to float32 even in float64)
        reference = _reference_losses(model, batch)
        params = trainable_parameters(model)
        grads = torch.autograd.grad(reference.mean(), params)
        if streamed:
            leanbp.stream(model, chunk_size=7, head_chunk_size=5)
        losses = example_losses(model, **batch)
        torch.testing.assert_close(losses, reference.detach(), rtol=1e-13, atol=0)
        for seed in range(2):
            z = Direction(params, seed)
            gz = z.dot(grads)
            errors = [finite_differences(z, lambda: example_losses(model, **batch), mu)[0].mean().item() - gz
                      for mu in (2e-5, 1e-5)]
            assert abs(errors[1]) <= 1e-4 * max(1.0, abs(gz)), (seed, gz, errors)
            assert 3.9 < errors[0] / errors[1] < 4.1, (seed, errors)


def test_the_estimate_is_unbiased():
    """E_z[(g . z) z] = g for z ~ N(0, I): on a quadratic loss (where the central difference is
    exact) the mean of d z over 4000 directions projects onto g and onto a vector orthogonal to it
    as g does, within 6 standard errors (of a product of Gaussians: sqrt(2 / K) |g| along g,
    sqrt(1 / K) |g| across)."""
    torch.manual_seed(0)
    params = [torch.randn(7, 5, dtype=torch.float64, requires_grad=True), torch.randn(11, dtype=torch.float64,
                                                                                      requires_grad=True)]
    A = [torch.randn(7, 5, dtype=torch.float64), torch.randn(11, dtype=torch.float64)]

    def losses():  # sum_i a_i x_i + 0.5 x_i^2, one "example"
        return sum((a * p + 0.5 * p * p).sum() for a, p in zip(A, params)).reshape(1)

    g = [a + p.detach() for a, p in zip(A, params)]
    g_norm = math.sqrt(sum(float((t * t).sum()) for t in g))
    across = [torch.randn_like(t) for t in g]
    overlap = sum(float((u * t).sum()) for u, t in zip(across, g)) / g_norm**2
    across = [u - overlap * t for u, t in zip(across, g)]  # orthogonal to g
    across_norm = math.sqrt(sum(float((u * u).sum()) for u in across))
    K = 4000
    along_sum = across_sum = 0.0
    with torch.no_grad():
        for seed in range(K):
            z = Direction(params, seed)
            d = finite_differences(z, losses, 1e-3)[0].item()
            along_sum += d * z.dot(g) / g_norm
            across_sum += d * z.dot(across) / across_norm
    assert abs(along_sum / K - g_norm) <= 6 * math.sqrt(2 / K) * g_norm
    assert abs(across_sum / K) <= 6 * math.sqrt(1 / K) * g_norm


def test_the_direction_regenerates_bit_for_bit_and_seeds_differ():
    model = _model("qwen3", torch.float32)
    params = trainable_parameters(model)
    a, b = Direction(params, 123), Direction(params, 123)
    for i in range(len(params)):
        assert torch.equal(a.tensor(i), b.tensor(i))
        assert a.tensor(i).dtype == params[i].dtype and a.tensor(i).shape == params[i].shape
    other = Direction(params, 124)
    assert not torch.equal(a.tensor(0), other.tensor(0))
    # z_i hangs on (seed, i) only: the same tensor drawn for a sub-list that keeps its index
    assert torch.equal(Direction(params[:3], 123).tensor(2), a.tensor(2))
    # each z_i is N(0, 1) elementwise and unrelated to the next step's
    flat = torch.cat([a.tensor(i).flatten() for i in range(len(params))]).double()
    nxt = torch.cat([Direction(params, 125).tensor(i).flatten() for i in range(len(params))]).double()
    n = flat.numel()
    assert abs(flat.mean()) < 6 / math.sqrt(n) and abs(flat.var() - 1) < 6 * math.sqrt(2 / n)
    assert abs((flat * nxt).mean()) < 6 / math.sqrt(n)
    # the step's seed is (run seed, step): distinct across steps and runs
    seeds = {DPZeroConfig(seed=s).direction_seed(t) for s in range(3) for t in range(100)}
    assert len(seeds) == 300


@pytest.mark.parametrize("dtype, unit", [(torch.float32, 2.0**-24), (torch.float64, 2.0**-53)])
def test_perturb_and_restore_round_by_at_most_the_stated_bound(dtype, unit):
    """theta + mu z - 2 mu z + mu z: |restored - theta| <= 3 u (|theta| + 2 mu |z|) elementwise
    (one rounding per add); a DPZero step at lr 0 restores within the same bound."""
    model = _model("qwen3", dtype)
    params = trainable_parameters(model)
    before = [p.detach().clone() for p in params]
    mu = 1e-3
    z = Direction(params, 7)
    z.add_(mu)
    assert all(not torch.equal(p, b) for p, b in zip(params, before))  # (it moved)
    z.add_(-2 * mu)
    z.add_(mu)

    def within_bound():  # (of the z last assigned)
        for i, (p, b) in enumerate(zip(params, before)):
            bound = 3 * unit * (b.abs() + 2 * mu * z.tensor(i).abs())
            assert ((p.detach() - b).abs() <= bound).all(), i

    within_bound()
    for p, b in zip(params, before):
        p.data.copy_(b)
    batch = _batch(model.config.vocab_size)
    optimizer = DPZero(model, DPZeroConfig(mu=mu, clip=1.0))
    z = optimizer.direction(3)
    optimizer.step(lambda: example_losses(model, **batch), lr=0.0, step=3)
    within_bound()


def test_a_forward_that_fails_leaves_the_parameters_restored():
    params = [torch.randn(4, 3, dtype=torch.float64, requires_grad=True)]
    before = params[0].detach().clone()
    calls = []

    def losses():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory, say")
        return params[0].sum().reshape(1)

    with pytest.raises(RuntimeError, match="out of memory"):
        finite_differences(Direction(params, 0), losses, 1e-3)
    torch.testing.assert_close(params[0].detach(), before, rtol=0, atol=1e-15)
