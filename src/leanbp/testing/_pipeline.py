"""Pipelines checked against one process: S CPU processes (gloo), one stage each, run a float64
model through ``leanbp.pipeline.Pipeline`` for a few optimizer steps; the first step's gradients
of every stage's parameters and the weights after the last step must equal the same streamed model
trained in one process on the whole batch (streamed too: plain autograd's equal, checked elsewhere).

``check_pipeline(cases, stages)`` spawns the processes once for a list of cases and returns, per
case, every stage's result: the losses of both runs per step, the worst relative gradient error of
the first step (``relative_errors``' measure), the worst relative weight difference at the end, and
how many backward passes of each kind (full, input, weight) the stage ran.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ._spawn import spawn_cases


@dataclass(frozen=True)
class PipelineCase:
    family: str = "llama"
    schedule: str = "2bp"
    layers: int = 4
    batch: int = 4
    microbatches: int = 4
    seq_len: int = 19
    chunk_size: int = 5  # (does not divide seq_len: a short last chunk)
    padding: bool = False  # left padding in some rows (the mask travels to every stage)
    steps: int = 3
    streamed: bool = True  # False: transformers' layers in every stage (plain autograd), the baseline

    @property
    def name(self) -> str:
        return "-".join(str(x) for x in (self.family, self.schedule, f"L{self.layers}", f"B{self.batch}",
                                          f"m{self.microbatches}", self.seq_len, self.chunk_size,
                                          "pad" if self.padding else "", "" if self.streamed else "plain"
                                          ) if x != "")


def _model(case: PipelineCase):
    import transformers

    from ..models import tiny_config
    from ._references import randomize_for_checks

    torch.manual_seed(0)
    config = tiny_config(case.family, num_hidden_layers=case.layers, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    return randomize_for_checks(model).train()


def _batch(case: PipelineCase, vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (case.batch, case.seq_len), generator=g)
    labels = ids.clone()
    labels[:, case.seq_len // 2: case.seq_len // 2 + 2] = -100
    mask = None
    if case.padding:
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
        mask[-1, :2] = 0
        labels[mask == 0] = -100
    return ids, mask, labels


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _train(case: PipelineCase, step_fn, model, params) -> tuple[list[float], dict]:
    """``case.steps`` optimizer steps; returns the losses and the first step's gradients by name."""
    from ._references import full_precision_norms

    ids, mask, labels = _batch(case, model.config.vocab_size)
    opt = _optimizer([p for _, p in params])
    losses, first = [], {}
    with full_precision_norms(model):
        for step in range(case.steps):
            losses.append(float(step_fn(ids, labels, mask)))
            if step == 0:
                first = {n: p.grad.clone() for n, p in params if p.grad is not None}
            opt.step()
            opt.zero_grad()
    return losses, first


def _one_process(case: PipelineCase):
    from ..streaming import stream

    model = _model(case)
    stream(model, chunk_size=case.chunk_size, head_chunk_size=7)

    def step(ids, labels, mask):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach()

    losses, grads = _train(case, step, model, list(model.named_parameters()))
    return losses, grads, model


def _pipelined(case: PipelineCase):
    from ..pipeline import Pipeline
    from ..streaming import stream

    model = _model(case)
    if case.streamed:
        stream(model, chunk_size=case.chunk_size, head_chunk_size=7)
    pipe = Pipeline(model, schedule=case.schedule, microbatches=case.microbatches)
    mine = {id(p) for p in pipe.parameters()}
    params = [(n, p) for n, p in model.named_parameters() if id(p) in mine]
    losses, grads = _train(case, lambda ids, labels, mask: pipe.step(ids, labels, attention_mask=mask), model, params)
    return losses, grads, dict(params), dict(pipe.stage.passes)


def _worst(reference: dict, candidate: dict, floor: float = 1e-2) -> float:
    """The worst relative difference over ``candidate``'s names (``relative_errors``' measure:
    tensors smaller than ``floor`` of the total are compared at that scale)."""
    total = sum(float(reference[n].double().norm()) ** 2 for n in candidate) ** 0.5
    worst = 0.0
    for name, value in candidate.items():
        ref = reference[name].double()
        worst = max(worst, float((ref - value.double()).norm()) / max(float(ref.norm()), floor * total))
    return worst


def _run_case(fields: dict) -> dict:
    case = PipelineCase(**fields)
    losses, grads, params, passes = _pipelined(case)
    ref_losses, ref_grads, reference = _one_process(case)
    ref_params = dict(reference.named_parameters())
    missing = sorted(set(ref_grads) & set(params) - set(grads))
    return dict(case=case.name, losses=losses, reference_losses=ref_losses, params=len(params), missing=missing,
                passes=passes, worst_grad_error=_worst(ref_grads, grads),
                worst_weight_error=_worst({n: p.detach() for n, p in ref_params.items()},
                                          {n: p.detach() for n, p in params.items()}))


def check_pipeline(cases: list[PipelineCase], stages: int = 2) -> list[list[dict]]:
    """Run ``cases`` on ``stages`` spawned processes; returns, per case, every stage's result."""
    return spawn_cases(_run_case, [asdict(c) for c in cases], stages)
