"""`leanbp train --objective sft|dpo|grpo`: TRL's trainers on a streamed model.

The data is the built-in set for the objective (made from the bundled text, see
``_data.builtin_records``) or a local .jsonl in TRL's formats. TRL's trainer runs the loop (its
progress bar, its checkpoints under ``OUT/trainer/checkpoint-<step>``, ``--resume`` continues from
the newest); at the end the model is exported (crash-safe, see ``_checkpoint``) to
``OUT/checkpoint`` as an ordinary transformers checkpoint, the losses to ``OUT/train_log.csv`` and ``OUT/loss.png``.
"""

from __future__ import annotations

import copy
import csv
from pathlib import Path

from ..integrations.trl import stream_trainer
from . import _checkpoint as checkpoints
from ._data import builtin_records, continuation_reward, read_jsonl
from ._outputs import plot_losses, record_run

# the columns each objective needs (any one of the alternatives)
_FORMATS = {
    "sft": (("text",), ("prompt", "completion"), ("messages",)),
    "dpo": (("prompt", "chosen", "rejected"),),
    "grpo": (("prompt", "answer"),),
}


def load_records(objective: str, path: str | None, seed: int) -> list[dict]:
    if path is None:
        return builtin_records(objective, seed)
    if not path.lower().endswith(".jsonl"):
        raise ValueError(f"--objective {objective} reads a .jsonl file in TRL's format, got {path!r}")
    records = read_jsonl(path)
    for fields in _FORMATS[objective]:
        if all(all(f in r for f in fields) for r in records):
            return records
    wanted = " or ".join("+".join(f) for f in _FORMATS[objective])
    raise ValueError(f"{path}: every line needs {wanted} for --objective {objective}")


def trl_modules():
    try:
        import datasets
        import trl
    except ImportError as e:
        raise ImportError('--objective sft|dpo|grpo runs TRL\'s trainers: pip install -e ".[trl]"') from e
    return trl, datasets


def train_trl(cfg, model, tokenizer, progress: bool = True) -> dict:
    """Train ``model`` with the TRL trainer of ``cfg.objective``; returns {"step", "losses"}."""
    trl, datasets = trl_modules()
    out = Path(cfg.out)
    dataset = datasets.Dataset.from_list(load_records(cfg.objective, cfg.data, cfg.seed))
    common = dict(
        output_dir=str(out / "trainer"), max_steps=cfg.steps, learning_rate=cfg.lr, weight_decay=cfg.weight_decay,
        warmup_steps=cfg.warmup, lr_scheduler_type="cosine", per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum, max_grad_norm=1.0, logging_steps=1, save_strategy="steps",
        save_steps=cfg.save_every, save_total_limit=2, report_to=[], seed=cfg.seed, use_cpu=cfg.device == "cpu",
        bf16=False, fp16=False, disable_tqdm=not progress, dataloader_num_workers=0,
        # the plain baseline (--no-stream) keeps TRL's default, checkpointing; StreamBP replaces it
        gradient_checkpointing=cfg.stream is None,
    )
    extra = {}
    if cfg.objective == "sft":
        args = trl.SFTConfig(max_length=cfg.seq_len, packing=cfg.packing, **common)
        trainer_cls = trl.SFTTrainer
    elif cfg.objective == "dpo":
        args = trl.DPOConfig(max_length=cfg.seq_len, **common)
        trainer_cls = trl.DPOTrainer
        extra["ref_model"] = copy.deepcopy(model).eval()  # the frozen starting point
    else:
        args = trl.GRPOConfig(max_completion_length=cfg.completion_len, num_generations=cfg.group_size, **common)
        trainer_cls = trl.GRPOTrainer
        extra["reward_funcs"] = continuation_reward
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, **extra)
    if cfg.stream is not None:
        stream_trainer(trainer, cfg.stream)
    trainer_checkpoints = sorted((out / "trainer").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if cfg.resume and not trainer_checkpoints:
        raise FileNotFoundError(f"--resume: no checkpoint in {out / 'trainer'}")
    record_run(out, cfg)
    trainer.train(resume_from_checkpoint=str(trainer_checkpoints[-1]) if cfg.resume else None)

    losses = [(row["step"], row["loss"]) for row in trainer.state.log_history if "loss" in row and "step" in row]
    with open(out / "train_log.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss"])
        writer.writerows(losses)
    checkpoints.save(out, trainer.state.global_step,
                     lambda folder: (trainer.save_model(str(folder)), tokenizer.save_pretrained(folder)), cfg.keep)
    if losses:
        plot_losses([loss for _, loss in losses], out / "loss.png")
    return {"step": trainer.state.global_step, "losses": [loss for _, loss in losses]}


__all__ = ["load_records", "train_trl", "trl_modules"]
