"""`leanbp train`: a complete training loop on a streamed model, with checkpoints and resume."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from . import memory
from ._builtin import TRAIN_QWEN3, build_model, qwen3_config
from ._data import TokenData, load_tokenizer
from .approx import approx
from .engine import StreamConfig, stream

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


OBJECTIVES = ("lm", "sft", "dpo", "grpo")


@dataclass
class TrainConfig:
    model: str | None = None  # local model directory or config.json; None: the built-in model
    data: str | None = None  # .txt or .jsonl; None: the bundled text (or the objective's built-in set)
    # lm: leanbp's own loop (next-token loss on text, or prompt/completion SFT);
    # sft | dpo | grpo: TRL's trainers on the streamed model
    objective: str = "lm"
    out: str = "runs/leanbp-train"
    seq_len: int = 4096
    batch_size: int = 1
    grad_accum: int = 1
    steps: int = 40
    lr: float = 1e-3
    warmup: int = 5
    weight_decay: float = 0.0
    dtype: str = "fp32"
    chunk_size: int = StreamConfig.chunk_size
    head_chunk_size: int = StreamConfig.head_chunk_size
    stream: bool = True
    approx: str = "none"  # none | act | norm | both (Approx-BP / MS-BP; "act" changes gradients)
    save_every: int = 20
    seed: int = 0
    device: str = "cpu"
    resume: bool = False
    packing: bool = False  # sft: pack examples into padding-free rows
    group_size: int = 4  # grpo: completions per prompt
    completion_len: int = 64  # grpo: tokens generated per completion

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "chunk_size", "head_chunk_size",
                     "save_every", "group_size", "completion_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.lr <= 0:
            raise ValueError("lr must be > 0")
        if self.approx not in ("none", "act", "norm", "both"):
            raise ValueError(f"approx must be none, act, norm or both, got {self.approx!r}")


def load_model(spec: str | None, seq_len: int, dtype: torch.dtype, seed: int):
    """A transformers causal LM from a local directory or config.json, or the built-in Qwen3 model.
    A directory with weights is loaded; a bare config is built with random init (seeded)."""
    if spec is None:
        return build_model(qwen3_config(TRAIN_QWEN3, max_positions=max(seq_len, 2048)), dtype, seed)
    path = Path(spec)
    if path.is_file() and path.suffix == ".json":
        config = transformers.AutoConfig.from_pretrained(str(path))
        return build_model(config, dtype, seed)
    if path.is_dir():
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        if has_weights:
            return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        return build_model(transformers.AutoConfig.from_pretrained(str(path)), dtype, seed)
    raise FileNotFoundError(f"--model {spec!r} is neither a model directory nor a config .json file")


def _lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 10% of the peak rate."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def atomic_export(final: Path, write) -> Path:
    """``write(folder)`` into a temporary folder, then swap it in: a crash never leaves a torn one."""
    tmp, old = final.with_name(f".{final.name}.tmp"), final.with_name(f".{final.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(out: Path, model, optimizer, state: dict) -> Path:
    """An ordinary transformers checkpoint plus the optimizer and the loop's state."""

    def write(folder: Path):
        model.save_pretrained(folder)
        torch.save(optimizer.state_dict(), folder / "optimizer.pt")
        (folder / "trainer_state.json").write_text(json.dumps(state, indent=1))

    return atomic_export(out / "checkpoint", write)


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype, device = DTYPES[cfg.dtype], torch.device(cfg.device)
    ckpt = out / "checkpoint"
    state = {"step": 0, "losses": [], "config": asdict(cfg)}
    if cfg.resume and cfg.objective == "lm":
        if not (ckpt / "trainer_state.json").exists():
            raise FileNotFoundError(f"--resume: no checkpoint in {ckpt}")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype)
        state = json.loads((ckpt / "trainer_state.json").read_text())
    else:
        model = load_model(cfg.model, cfg.seq_len, dtype, cfg.seed)
    model.to(device).train()
    tokenizer = load_tokenizer(cfg.model if not cfg.resume else state["config"]["model"],
                               model.config.vocab_size)
    if cfg.objective != "lm":
        if cfg.approx != "none":
            approx(model, activations=cfg.approx in ("act", "both"), norms=cfg.approx in ("norm", "both"))
        from ._train_trl import train_trl

        return train_trl(cfg, model, tokenizer, progress=progress)
    data = TokenData(tokenizer, cfg.data, cfg.seq_len, seed=cfg.seed)
    if cfg.approx != "none":
        approx(model, activations=cfg.approx in ("act", "both"), norms=cfg.approx in ("norm", "both"))
    if cfg.stream:
        stream(model, chunk_size=cfg.chunk_size, head_chunk_size=cfg.head_chunk_size)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    if cfg.resume:
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=device))

    log_path = out / "train_log.csv"
    new_log = not (cfg.resume and log_path.exists())
    log = open(log_path, "w" if new_log else "a", newline="")
    writer = csv.writer(log)
    if new_log:
        writer.writerow(["step", "loss", "lr", "tokens_per_s", "peak_mib", "activation_mib"])
    bar = tqdm(range(state["step"], cfg.steps), initial=state["step"], total=cfg.steps, disable=not progress,
               desc="leanbp train", unit="step")
    try:
        for step in bar:
            lr = _lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = [data.batch(step, m, cfg.batch_size) for m in range(cfg.grad_accum)]
            # transformers' convention: every micro-batch divides by the step's total label count
            n_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
            t0 = time.perf_counter()
            loss_sum = 0.0
            with memory.track(model, device=device) as mem:
                for b in batches:
                    b = {k: v.to(device) for k, v in b.items()}
                    loss = model(**b, num_items_in_batch=torch.tensor(n_items, device=device)).loss
                    loss.backward()
                    loss_sum += loss.item()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - t0
            tokens = sum(int(b["attention_mask"].sum()) for b in batches)
            report = mem.report.as_mib()
            state["step"] = step + 1
            state["losses"].append(loss_sum)
            writer.writerow([step + 1, f"{loss_sum:.5f}", f"{lr:.3e}", f"{tokens / seconds:.1f}",
                             f"{report['peak']:.1f}", f"{report['activations']:.1f}"])
            log.flush()
            bar.set_postfix(loss=f"{loss_sum:.4f}", tok_s=f"{tokens / seconds:.0f}", peak_mib=f"{report['peak']:.0f}")
            if state["step"] % cfg.save_every == 0 or state["step"] == cfg.steps:
                save_checkpoint(out, model, optimizer, state)
    finally:
        log.close()
    if state["losses"]:
        plot_losses(state["losses"], out / "loss.png")
    return state


def plot_losses(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
