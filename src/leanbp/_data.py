"""Training data: the bundled text or a local .txt / .jsonl file, as fixed-length token batches.

Token ids come from a byte-level tokenizer (the built-in model has a 256-token vocabulary, so the
bundled text needs nothing downloaded) or from a tokenizer saved next to a local model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ._builtin import bundled_text
from .engine._head import IGNORE_INDEX


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; pad id 0 (padding is masked out anyway)."""

    vocab_size = 256
    pad_token_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_tokenizer(model_dir: str | None, vocab_size: int):
    if model_dir is not None and Path(model_dir).is_dir() and any(
        (Path(model_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok
    if vocab_size < 256:
        raise ValueError(f"the model's vocabulary ({vocab_size}) is too small for byte-level tokens; "
                         "save a tokenizer next to the model")
    return ByteTokenizer()


def _encode(tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class TokenData:
    """Batches of ``seq_len`` tokens, drawn deterministically from (seed, step).

    A text corpus (.txt, jsonl with "text") becomes one token stream sampled in random windows.
    A jsonl with "prompt" and "completion" gives one example per line, right-padded, with the
    prompt's labels masked (-100), i.e. supervised fine-tuning on completions only.
    """

    def __init__(self, tokenizer, path: str | None, seq_len: int, seed: int = 0):
        if seq_len < 2:
            raise ValueError("seq_len must be at least 2")
        self.seq_len, self.seed = seq_len, seed
        self.pad_id = getattr(tokenizer, "pad_token_id", 0) or 0
        self.stream: torch.Tensor | None = None
        self.examples: list[tuple[list[int], int]] | None = None  # (ids, prompt length)
        if path is None:
            self.stream = torch.tensor(_encode(tokenizer, bundled_text()), dtype=torch.long)
        elif path.endswith(".jsonl"):
            records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
            if not records:
                raise ValueError(f"{path} has no records")
            if all("prompt" in r and "completion" in r for r in records):
                self.examples = []
                for r in records:
                    prompt = _encode(tokenizer, r["prompt"])
                    self.examples.append(((prompt + _encode(tokenizer, r["completion"]))[:seq_len], len(prompt)))
            elif all("text" in r for r in records):
                self.stream = torch.tensor(_encode(tokenizer, "\n\n".join(r["text"] for r in records)))
            else:
                raise ValueError(f"{path}: every line needs a 'text' field, or 'prompt' and 'completion'")
        else:
            self.stream = torch.tensor(_encode(tokenizer, Path(path).read_text(encoding="utf-8")), dtype=torch.long)
        if self.stream is not None and self.stream.numel() < seq_len + 1:
            raise ValueError(f"the data has {self.stream.numel()} tokens, fewer than seq_len={seq_len}")

    def batch(self, step: int, micro: int, batch_size: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + micro)
        if self.stream is not None:
            starts = torch.randint(0, self.stream.numel() - self.seq_len, (batch_size,), generator=g)
            ids = torch.stack([self.stream[s: s + self.seq_len] for s in starts.tolist()])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        picks = torch.randint(0, len(self.examples), (batch_size,), generator=g).tolist()
        ids = torch.full((batch_size, self.seq_len), self.pad_id, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE_INDEX)
        mask = torch.zeros_like(ids)
        for b, i in enumerate(picks):
            tokens, n_prompt = self.examples[i]
            ids[b, : len(tokens)] = torch.tensor(tokens)
            mask[b, : len(tokens)] = 1
            labels[b, n_prompt: len(tokens)] = torch.tensor(tokens[n_prompt:], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
