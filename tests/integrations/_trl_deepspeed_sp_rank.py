"""One rank of ``test_trl_deepspeed_sequence_parallel.py``'s torchrun launch: TRL's SFT with its own
sequence parallelism (accelerate's ``ParallelismConfig(sp_size=2, sp_backend="deepspeed")``,
DeepSpeed ZeRO-1 on CPU), first as TRL runs it (DeepSpeed's Ulysses attention), then streamed by
``stream_trainer(trainer)``; then transformers' Trainer (its labels calls) the same way, streamed. Each run saves, per optimizer step, every parameter's gradient as this
rank's backward left it (before DeepSpeed reduces it), the rows each streamed layer ran, and the
losses, to ``OUT/<run>/rank<r>.pt`` (or the error it met, ``rank<r>.error``)."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (the cases of test_trl.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (tests/: conftest)

import test_trl  # noqa: E402

RUNS = ("deepspeed", "leanbp", "trainer")
LENGTH = 32  # every batch padded to it (DeepSpeed's loader gathers the ranks' batches: one length)
# 2 steps, plain SGD at lr 1 without clipping: a step's update is its gradient
SETTINGS = dict(per_device_train_batch_size=3, max_steps=2, learning_rate=1.0, optim="sgd",
                lr_scheduler_type="constant", max_grad_norm=0.0)


def sft_config(folder: Path, sequence_parallel: bool):
    """The SFT run's settings; ``sequence_parallel``: TRL's own (over the 2 processes of the launch)."""
    import trl

    return trl.SFTConfig(pad_to_multiple_of=LENGTH, max_length=LENGTH, **_arguments(folder, sequence_parallel))


def trainer_config(folder: Path, sequence_parallel: bool):
    """The same for transformers' Trainer (``trainer_data`` and ``collate``: the batches)."""
    import transformers

    return transformers.TrainingArguments(remove_unused_columns=False, **_arguments(folder, sequence_parallel))


def trainer_data() -> list[dict]:
    from leanbp.train import byte_tokenizer

    tokenizer = byte_tokenizer()
    return [{"input_ids": tokenizer(row["text"])["input_ids"][:LENGTH]} for row in test_trl._text_data()]


def collate(rows: list[dict]) -> dict:
    """Right-padded to LENGTH, with position ids (DeepSpeed's loader needs them)."""
    ids = torch.zeros(len(rows), LENGTH, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, :len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
            "position_ids": torch.arange(LENGTH).expand(len(rows), LENGTH).contiguous()}


def _arguments(folder: Path, sequence_parallel: bool) -> dict:
    extra = {"use_cpu": True}
    if sequence_parallel:
        from accelerate import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        extra = dict(
            deepspeed={"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                       "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                       "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True},
            parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed", sp_handler=(
                DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))),
            # (accelerate gives DeepSpeed on CPU no backend, so 1 process, unless the state is made here)
            accelerator_config={"use_configured_state": True})
    return dict(output_dir=str(folder), report_to=[], bf16=False, fp16=False, save_strategy="no", seed=0,
                logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, **SETTINGS, **extra)


def exact_sequence_parallel_loss(accelerator, model, inputs, return_outputs, parallelism_config):
    """transformers' ``deepspeed_sp_compute_loss`` (each rank's loss weighted by its label count, the
    whole mean's value, this rank's share's gradient) in the loss's dtype: it rounds to float32."""
    from deepspeed.utils import groups

    if "labels" not in inputs:
        inputs["labels"] = inputs["shift_labels"]
    outputs = model(**inputs)
    loss = outputs.loss
    good = (inputs["shift_labels"] != -100).sum()
    local = torch.where(good > 0, loss, 0.0) * good
    totals = torch.stack((local.detach(), good.to(loss.dtype)))
    torch.distributed.all_reduce(totals, group=groups._get_sequence_parallel_group())
    loss = (local + (totals[0] - local.detach())) / totals[1].clamp(min=1)
    return (loss, outputs) if return_outputs else loss


class _Recorder:
    """Each step's gradients as this rank's backward left them: DeepSpeed's ZeRO-1 takes each
    parameter's gradient in ``process_gradients``, and the step ends in the engine's ``step``."""

    def __init__(self):
        import deepspeed.runtime.engine as engine
        import deepspeed.runtime.zero.stage_1_and_2 as zero

        self.steps, seen = [], {}
        process, step = zero.DeepSpeedZeroOptimizer.process_gradients, engine.DeepSpeedEngine.step

        def process_gradients(optimizer, param, i):
            seen[id(param)] = param.grad.detach().clone()
            return process(optimizer, param, i)

        def engine_step(deepspeed_engine, *args, **kwargs):
            self.steps.append({n: seen[id(p)] for n, p in deepspeed_engine.module.named_parameters() if id(p) in seen})
            seen.clear()
            return step(deepspeed_engine, *args, **kwargs)

        zero.DeepSpeedZeroOptimizer.process_gradients = process_gradients
        engine.DeepSpeedEngine.step = engine_step


def _rows_per_layer_call(rows: list) -> None:
    from leanbp.engine import StreamedLayerFunction

    apply = StreamedLayerFunction.apply

    def layer(hidden, *rest):
        rows.append(hidden.shape[1])
        return apply(hidden, *rest)

    StreamedLayerFunction.apply = layer


def _run(name: str, folder: Path, recorder: _Recorder, rows: list) -> dict:
    import trl
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from leanbp.integrations.trl import stream_trainer
    from leanbp.testing import exact_trl_head, full_precision_norms

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if name == "trainer":
        import transformers

        trainer = transformers.Trainer(model=test_trl.tiny_model(), args=trainer_config(folder, sequence_parallel=True),
                                       train_dataset=trainer_data(), data_collator=collate)
    else:
        trainer = trl.SFTTrainer(model=test_trl.tiny_model(), args=sft_config(folder, sequence_parallel=True),
                                 train_dataset=test_trl._text_data(), processing_class=test_trl.byte_tokenizer())
    if name in ("leanbp", "trainer"):
        stream_trainer(trainer, **test_trl.CHUNKS)
    recorder.steps.clear()
    rows.clear()
    try:
        with full_precision_norms(trainer.model), exact_trl_head():
            trainer.train()
    finally:  # (the next run sets accelerate's state and DeepSpeed's Ulysses up again)
        from accelerate.state import AcceleratorState
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        AcceleratorState._reset_state()
        parallel_state_sp._release_sequence_parallel_groups()
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    return {"grads": list(recorder.steps), "rows": list(rows),
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


def main(out: str) -> None:
    import transformers.trainer
    from accelerate import PartialState

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    transformers.trainer.deepspeed_sp_compute_loss = exact_sequence_parallel_loss
    recorder, rows = _Recorder(), []
    _rows_per_layer_call(rows)
    for name in RUNS:
        folder = Path(out, name)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            torch.save(_run(name, folder / f"run{rank}", recorder, rows), folder / f"rank{rank}.pt")
        except Exception:
            (folder / f"rank{rank}.error").write_text(traceback.format_exc())
            raise


if __name__ == "__main__":
    main(sys.argv[1])
