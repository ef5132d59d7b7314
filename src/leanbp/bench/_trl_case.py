"""One TRL benchmark case (run in its own process by ``leanbp bench --suite trl``).

The bench model (Qwen3-shaped, vocabulary 32000) trained by TRL's SFT (packed, padding-free),
DPO (2 pairs) or GRPO (a group of 4) trainer at sequence length T, with TRL's default gradient
checkpointing ("ckpt"), with checkpointing and leanbp's chunked head answering TRL's fused-head
calls ("ckpt_head": ``stream(layers=False)``, which separates the head's share from the
decoder's), or streamed with ``stream_trainer`` ("leanbp"). Measured: the
backprop part of a training step, from ``compute_loss`` (DPO's reference forward included) to the
end of ``backward``; GRPO's generation comes before it and is the same ``generate`` either way, so
it is left out. Step 1 is tracked for memory (parameters and gradients resident), the later steps
are timed (median).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..integrations.trl import stream_trainer
from ..memory import track
from ..streaming import StreamConfig, stream
from ..train import build_model, byte_tokenizer, qwen3_config, verses
from ._models import BENCH_QWEN3
from ._timing import synchronize

# the trainers measured, and their labels in the tables
TRL_OBJECTIVES = {"sft": "SFT (packed)", "dpo": "DPO (2 pairs)", "grpo": "GRPO (group of 4)"}
# the setups each trainer runs with, and their labels
TRL_METHODS = {"ckpt": "TRL + checkpointing", "ckpt_head": "TRL + checkpointing + leanbp head",
               "leanbp": "TRL + leanbp"}
COMPLETION_LEN = 16  # GRPO: tokens generated per completion
DOCUMENTS = 8  # SFT: documents packed into the one row


def _text(n_chars: int, offset: int) -> str:
    """``n_chars`` characters of the bundled verses, starting at verse ``offset`` (ASCII: 1 token each)."""
    out, i = [], offset
    while sum(map(len, out)) < n_chars:
        out.append(verses()[i % len(verses())] + " ")
        i += 1
    return "".join(out)[:n_chars]


def _dataset(objective: str, T: int):
    """Rows whose tokenized lengths give sequences of exactly T tokens (EOS included)."""
    import datasets

    if objective == "sft":  # DOCUMENTS documents that fill one padding-free row
        rows = [{"text": _text(T // DOCUMENTS - 1, 37 * i)} for i in range(DOCUMENTS)]
    elif objective == "dpo":  # prompt + chosen and prompt + rejected are each T tokens
        half = T // 2
        rows = [{"prompt": _text(half, 50 * i), "chosen": _text(T - half - 1, 50 * i + 20),
                 "rejected": _text(T - half - 1, 50 * i + 30)} for i in range(2)]
    else:  # one prompt, a group of completions of COMPLETION_LEN tokens
        rows = [{"prompt": _text(T - COMPLETION_LEN, 0), "answer": "x"}]
    return datasets.Dataset.from_list(rows)


def _reward(completions, **kwargs):
    return [float(len(set(c))) for c in completions]  # varied, so that the advantages are not zero


def _trainer(spec: dict, model):
    import trl

    objective, T, method = spec["objective"], spec["seq_len"], spec["method"]
    steps = 1 + spec.get("timed_steps", 3)
    common = dict(output_dir="/tmp/leanbp-bench-trl", max_steps=steps, learning_rate=1e-5, report_to=[],
                  use_cpu=torch.device(spec.get("device", "cpu")).type == "cpu",
                  bf16=False, fp16=False, save_strategy="no", logging_steps=1, disable_tqdm=True,
                  dataloader_num_workers=0, gradient_checkpointing=method != "leanbp",
                  gradient_checkpointing_kwargs={"use_reentrant": False})
    extra = {}
    if objective == "sft":
        args = trl.SFTConfig(packing=True, max_length=T, per_device_train_batch_size=1, **common)
        cls = trl.SFTTrainer
    elif objective == "dpo":
        args = trl.DPOConfig(max_length=T, per_device_train_batch_size=2, **common)
        cls = trl.DPOTrainer
        import copy

        extra["ref_model"] = copy.deepcopy(model)
    else:
        args = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=COMPLETION_LEN,
                              **common)
        cls = trl.GRPOTrainer
        extra["reward_funcs"] = _reward
    trainer = cls(model=model, args=args, train_dataset=_dataset(objective, T), processing_class=byte_tokenizer(),
                  **extra)
    config = StreamConfig(**spec.get("stream", {}))
    if method == "leanbp":
        stream_trainer(trainer, config)
    elif method == "ckpt_head":  # the trainer's checkpointed decoder, leanbp's head
        for m in (trainer.model, getattr(trainer, "ref_model", None)):
            if m is not None:
                stream(m, config, layers=False)
    return trainer


class _StepProbe:
    """Wraps ``compute_loss`` and ``accelerator.backward``: tracks memory in the first step, times
    the others, and records the tokens each step saw."""

    def __init__(self, trainer):
        self.trainer, self.report, self.times, self.tokens = trainer, None, [], []
        self._tracker = self._t0 = self._device = None
        compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward

        def probed_compute_loss(model, inputs, *args, **kwargs):
            self._start(model, inputs)
            return compute_loss(model, inputs, *args, **kwargs)

        def probed_backward(loss, **kwargs):
            backward(loss, **kwargs)
            self._stop()

        trainer.compute_loss = probed_compute_loss
        trainer.accelerator.backward = probed_backward

    def _start(self, model, inputs):
        # steady state of a training loop: gradients resident, as in the core benchmark
        for p in self.trainer.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        # tokens in the step: input_ids (SFT, DPO) or prompt + completion ids (GRPO)
        self.tokens.append(sum(int(inputs[k].numel()) for k in ("input_ids", "prompt_ids", "completion_ids")
                               if torch.is_tensor(inputs.get(k))))
        if self.report is None:
            self._tracker = track(self.trainer.model)
            self._tracker.__enter__()
        self._device = next(self.trainer.model.parameters()).device  # (placed by the trainer by now)
        synchronize(self._device)  # (a GPU: only this step's work is timed)
        self._t0 = time.perf_counter()

    def _stop(self):
        synchronize(self._device)
        seconds = time.perf_counter() - self._t0
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.report, self._tracker = self._tracker.report, None
        else:
            self.times.append(seconds)


def run_trl_case(spec: dict) -> dict:
    if spec["objective"] not in TRL_OBJECTIVES:
        raise ValueError(f"unknown objective {spec['objective']!r}; choose from {list(TRL_OBJECTIVES)}")
    if spec["method"] not in TRL_METHODS:
        raise ValueError(f"the trl suite compares {list(TRL_METHODS)}, got {spec['method']!r}")
    T = spec["seq_len"]
    model = build_model(qwen3_config(BENCH_QWEN3, max_positions=max(T + COMPLETION_LEN, 2048),
                                     pad_token_id=0, eos_token_id=4, bos_token_id=None)).train()
    trainer = _trainer(spec, model)
    probe = _StepProbe(trainer)
    trainer.train()
    r = probe.report
    return {**spec, "peak": r.peak, "params": r.params, "grads": r.grads, "activations": r.activations,
            "step_s": statistics.median(probe.times), "tokens": probe.tokens[0]}
