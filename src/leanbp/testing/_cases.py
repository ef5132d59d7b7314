"""Random float64 exactness cases: a tiny model of any registered family and a batch drawn to hit
the edge cases (padding sides, packed documents, prompt boundaries, chunk sizes that do not divide
T, tied heads, sliding windows). The suite runs a bounded number of them (hypothesis), and
``benchmarks/exactness_properties.py`` many more."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import IGNORE_INDEX
from ..models import supported_model_types, tiny_config
from ._references import randomize_for_checks, relative_errors, streamed_vs_plain


@dataclass(frozen=True)
class ExactCase:
    """One float64 exactness check: a tiny model of ``family`` and a batch drawn to hit edge cases."""

    family: str
    batch: int
    seq_len: int
    padding: str  # left | right | none | packed
    pads: tuple[int, ...]  # padding per row (left/right), or document lengths of every row (packed)
    prompt: int  # labels before this row are -100 (the prompt boundary)
    chunk_size: int
    head_chunk_size: int
    tied: bool
    window: int | None  # sliding window of the family's sliding layers (FamilyAdapter.tiny_config)
    seed: int = 0


def case_model(case: ExactCase):
    import transformers

    config = tiny_config(case.family, case.window, vocab_size=61, hidden_size=32, intermediate_size=48, head_dim=8,
                         max_position_embeddings=256, tie_word_embeddings=case.tied)
    torch.manual_seed(case.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    return randomize_for_checks(model).train()


def case_batch(case: ExactCase):
    """(inputs, labels) of ``case``; inputs have an attention_mask, or position_ids when packed."""
    g = torch.Generator().manual_seed(case.seed + 1)
    B, T = case.batch, case.seq_len
    ids = torch.randint(0, 61, (B, T), generator=g)
    labels = ids.clone()
    labels[:, : case.prompt] = IGNORE_INDEX
    if case.padding == "packed":
        pos = torch.cat([torch.arange(n) for n in case.pads])[None].expand(B, T).contiguous()
        return {"input_ids": ids, "position_ids": pos, "use_cache": False}, labels
    mask = torch.ones(B, T, dtype=torch.long)
    for b, n in enumerate(case.pads):
        if n and case.padding == "left":
            mask[b, :n] = 0
        elif n and case.padding == "right":
            mask[b, T - n:] = 0
    labels[mask == 0] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask}, labels


def check_case(case: ExactCase) -> float:
    """The worst relative error (loss and every parameter gradient), leanbp vs plain autograd."""
    model = case_model(case)
    inputs, labels = case_batch(case)
    stream_inputs = {k: v for k, v in inputs.items() if k != "use_cache"}
    reference, ref_loss, loss = streamed_vs_plain(
        model, labels, stream_inputs, dict(chunk_size=case.chunk_size, head_chunk_size=case.head_chunk_size),
        ref_inputs=inputs)
    errors = relative_errors(reference, model)
    if not errors:
        raise AssertionError(f"no gradients compared for {case}")
    return max(abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), *errors.values())


def exact_cases():
    """A hypothesis strategy of ``ExactCase`` (hypothesis is a test dependency, imported here)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(draw):
        family = draw(st.sampled_from(supported_model_types()))
        B = draw(st.integers(1, 3))
        T = draw(st.integers(3, 40))
        padding = draw(st.sampled_from(["left", "right", "none", "packed"]))
        if padding == "packed":
            cuts = sorted(draw(st.sets(st.integers(1, T - 1), max_size=4)))
            pads = tuple(b - a for a, b in zip([0, *cuts], [*cuts, T]))
        elif padding == "none":
            pads = (0,) * B
        else:  # at least one real token per row; one row may be unpadded
            pads = tuple(draw(st.integers(0, T - 2)) for _ in range(B))
        prompt = draw(st.integers(0, T - 2))
        # at least one labelled row after the shift, in some row
        lengths = [T - p for p in pads] if padding in ("left", "right") else [T] * B
        starts = list(pads) if padding == "left" else [0] * B
        if not any(max(prompt, s) + 1 < s + n for s, n in zip(starts, lengths)):
            prompt = 0
        window = draw(st.one_of(st.none(), st.integers(1, T + 2)))  # (families without sliding layers ignore it)
        return ExactCase(family=family, batch=B, seq_len=T, padding=padding, pads=pads, prompt=prompt,
                         chunk_size=draw(st.integers(1, T + 3)), head_chunk_size=draw(st.integers(1, 2 * T)),
                         tied=draw(st.booleans()), window=window, seed=draw(st.integers(0, 2**16)))

    return draw()
