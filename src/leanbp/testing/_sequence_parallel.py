"""Sequence parallelism checked against one process: P CPU processes (gloo) share each sequence of
a float64 model; the loss, and the gradients summed over the group, must equal plain autograd on
the whole sequence in one process.

``check_sequence_parallel(cases, world)`` spawns the processes once for a list of cases (their
start-up is paid once) and returns one result per case: the loss of each rank and of the
reference, and the worst relative gradient error over every parameter.

Objectives: ``lm`` is the causal-LM loss of the model's labels call (the denominator counted over
the whole sequence); ``pairwise`` is a DPO-shaped loss, nonlinear in per-sequence sums: the sum of
each row's token log-probs (``token_log_probs``, summed over the group by ``sequence_sum``), then
-logsigmoid((s0 - s1) / 10) for rows 0 and 1 (scaled to stay off the sigmoid's flat tails).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ._spawn import spawn_cases

OBJECTIVES = ("lm", "pairwise")


@dataclass(frozen=True)
class SequenceCase:
    family: str = "llama"
    seq_len: int = 32  # of the whole sequence (every rank holds seq_len / P rows, after padding to a multiple of P)
    chunk_size: int = 4
    padding: str = "none"  # none | left | right
    documents: bool = False  # packed rows: position ids that restart, no attention mask
    window: int | None = None  # a sliding window (mistral, qwen2)
    objective: str = "lm"
    offload: bool = False  # the layer boundaries and their gradients in host memory
    router_loss: bool = False  # a mixture of experts' load-balancing loss in the loss (output_router_logits)
    # DeepSpeed's sequence-parallel groups of this size made first (as accelerate's ParallelismConfig
    # has them made): ``sequence_parallel=True`` must take them, and each group streams its own batch
    deepspeed_groups: int | None = None

    @property
    def name(self) -> str:
        return "-".join(str(x) for x in (self.family, self.seq_len, self.chunk_size, self.padding,
                                          "docs" if self.documents else "", self.window or "", self.objective,
                                          "offload" if self.offload else "", "aux" if self.router_loss else "",
                                          f"ds{self.deepspeed_groups}" if self.deepspeed_groups else "") if x != "")


def _model(case: SequenceCase):
    import transformers

    from ..models import tiny_config
    from ._references import randomize_for_checks

    torch.manual_seed(0)
    config = tiny_config(case.family, case.window)
    if hasattr(config, "output_router_logits"):
        config.output_router_logits = case.router_loss
        config.router_aux_loss_coef = 1.0  # (not 0.001: an error in its gradient must show at 1e-12)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    return randomize_for_checks(model).train()


def _batch(case: SequenceCase, vocab: int, group_index: int = 0):
    """(input_ids, attention_mask, position_ids, labels) of the whole sequence, batch 2 (group
    ``group_index``'s, when there are several sequence-parallel groups)."""
    B, T = 2, case.seq_len
    g = torch.Generator().manual_seed(1 + group_index)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = ids.clone()
    labels[:, T // 2: T // 2 + 3] = -100  # (unlabelled rows, one of them at a rank boundary for P = 2)
    mask = positions = None
    if case.padding != "none":
        mask = torch.ones(B, T, dtype=torch.long)
        if case.padding == "left":
            mask[0, :5], mask[1, :2] = 0, 0
        else:
            mask[0, -7:] = 0
        labels[mask == 0] = -100
    if case.documents:
        first = T // 3 + 1  # (a document boundary inside a rank's rows)
        positions = torch.stack([torch.cat([torch.arange(first), torch.arange(T - first)]), torch.arange(T)])
    return ids, mask, positions, labels


def _pairwise(log_probs_sum: torch.Tensor) -> torch.Tensor:
    return -F.logsigmoid((log_probs_sum[0] - log_probs_sum[1]) / 10)


def _reference(case: SequenceCase, group_index: int = 0):
    """Plain autograd in one process on the whole sequence: (loss, the model with its gradients)."""
    from ..engine import IGNORE_INDEX
    from ._references import full_precision_norms, reference_causal_lm_loss

    model = _model(case)
    ids, mask, positions, labels = _batch(case, model.config.vocab_size, group_index)
    with full_precision_norms(model):
        if case.objective == "lm":
            loss = reference_causal_lm_loss(model, labels, input_ids=ids, attention_mask=mask, position_ids=positions,
                                            use_cache=False)  # (transformers separates documents only then)
        else:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
            keep = targets != IGNORE_INDEX
            picked = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            loss = _pairwise((picked * keep).sum(1))
        loss.backward()
    return loss.item(), model


def _sequence_parallel(case: SequenceCase, group_index: int = 0):
    """The same on this rank's rows, streamed with ``sequence_parallel``: (loss, the model with the
    gradients summed over the group)."""
    from ..streaming import reduce_sequence_gradients, sequence_batch, sequence_sum, stream, token_log_probs
    from ._references import full_precision_norms

    model = _model(case)
    ids, mask, positions, labels = _batch(case, model.config.vocab_size, group_index)
    stream(model, chunk_size=case.chunk_size, head_chunk_size=3, sequence_parallel=True, offload=case.offload)
    rows = sequence_batch(model, input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels)
    with full_precision_norms(model):
        if case.objective == "lm":
            loss = model(**rows).loss
        else:
            labels = rows.pop("labels")
            out = token_log_probs(model, labels, **rows)
            loss = _pairwise(sequence_sum(model, out["log_probs"].sum(1)))
        loss.backward()
    reduce_sequence_gradients(model)
    return loss.item(), model


def _run_case(fields: dict) -> dict:
    from ._references import relative_errors

    case = SequenceCase(**fields)
    if case.deepspeed_groups:
        return _with_deepspeed_groups(case)
    loss, model = _sequence_parallel(case)
    ref_loss, reference = _reference(case)
    worst = max(relative_errors(reference, model).values())
    return dict(case=case.name, loss=loss, reference_loss=ref_loss, worst_grad_error=worst)


def _with_deepspeed_groups(case: SequenceCase) -> dict:
    """The case with DeepSpeed's sequence-parallel groups set up (released afterwards): this rank's
    group streams its own batch; reports the group's size and this rank's rank in it."""
    import torch.distributed as dist
    import deepspeed.comm
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from ..streaming import state_of
    from ._references import relative_errors

    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # (takes the existing group)
    parallel_state_sp.initialize_sequence_parallel(case.deepspeed_groups)
    try:
        group_index = dist.get_rank() // case.deepspeed_groups  # (DeepSpeed's groups: consecutive ranks)
        loss, model = _sequence_parallel(case, group_index)
        sequence = state_of(model).sequence
        taken = sequence.group is parallel_state_sp.get_sequence_parallel_group()
    finally:
        parallel_state_sp._release_sequence_parallel_groups()
    ref_loss, reference = _reference(case, group_index)
    worst = max(relative_errors(reference, model).values())
    return dict(case=case.name, loss=loss, reference_loss=ref_loss, worst_grad_error=worst,
                group_size=sequence.size, group_rank=sequence.rank, deepspeeds_group=taken)


def check_sequence_parallel(cases: list[SequenceCase], world: int = 2) -> list[list[dict]]:
    """Run ``cases`` on ``world`` spawned processes; returns, per case, every rank's result."""
    return spawn_cases(_run_case, [asdict(c) for c in cases], world)
