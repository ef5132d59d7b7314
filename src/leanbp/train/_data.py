"""Training data: the bundled text or a local .txt / .jsonl file, as fixed-length token batches.

Token ids come from a byte-level tokenizer (the built-in model has a 256-token vocabulary, so the
bundled text needs nothing downloaded) or from a tokenizer saved next to a local model. The
built-in post-training sets (SFT, DPO, GRPO) and the classification task (``--data
builtin:classify``) are made from the same text.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import warnings
from functools import cache
from importlib import resources
from pathlib import Path

import torch

from ..engine import IGNORE_INDEX
from ._byte_tokenizer import byte_tokenizer

CLASSIFY = "builtin:classify"  # --data: the bundled verses as a two-class task (``classify_records``)


@cache
def bundled_text() -> str:
    """Genesis and Ruth from the King James Bible (public domain), as shipped in leanbp/data."""
    data = resources.files("leanbp").joinpath("data/kjv_genesis_ruth.txt.gz").read_bytes()
    return gzip.decompress(data).decode("utf-8")


def load_tokenizer(model_dir: str | None, vocab_size: int):
    """The tokenizer saved next to a local model, else the byte-level one (ids = UTF-8 bytes)."""
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
    return byte_tokenizer()


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class TokenData:
    """Batches of ``seq_len`` tokens, drawn deterministically from (seed, step).

    A text corpus (.txt, jsonl with "text") becomes one token stream sampled in random windows.
    A jsonl with "prompt" and "completion" gives one example per line, right-padded, with the
    prompt's labels masked (-100), i.e. supervised fine-tuning on completions only.
    ``builtin:classify`` is such a set made from the bundled verses (``classify_records``), each
    example a prompt and one label token; its batches are cut to their longest row (a verse is a
    few hundred bytes: padding every row to --seq-len would be most of the work).

    ``records`` and ``rows`` serve DPZero's Poisson sampling: the records are the examples, or the
    non-overlapping windows of ``seq_len`` tokens of a text corpus (the unit its privacy protects).
    """

    def __init__(self, tokenizer, path: str | None, seq_len: int, seed: int = 0):
        if seq_len < 2:
            raise ValueError("seq_len must be at least 2")
        self.seq_len, self.seed = seq_len, seed
        self.pad_id = getattr(tokenizer, "pad_token_id", 0) or 0
        self.stream: torch.Tensor | None = None
        self.examples: list[tuple[list[int], int]] | None = None  # (ids, prompt length)
        self.dropped = 0  # prompt/completion examples with no completion token within seq_len
        self.trim = path == CLASSIFY  # batches as long as their longest row, not seq_len
        if path is None:
            self.stream = torch.tensor(_encode(tokenizer, bundled_text()), dtype=torch.long)
        elif path == CLASSIFY:
            records = classify_records()
            _check_one_token_labels(tokenizer, records)
            self._examples(tokenizer, path, records)
        elif _check_file(path).lower().endswith(".jsonl"):
            records = read_jsonl(path)
            if all("prompt" in r and "completion" in r for r in records):
                self._examples(tokenizer, path, records)
            elif all("text" in r for r in records):
                texts = [_string(r, "text", path, i) for i, r in enumerate(records)]
                self.stream = torch.tensor(_encode(tokenizer, "\n\n".join(texts)), dtype=torch.long)
            else:
                raise ValueError(f"{path}: every line needs a 'text' field, or 'prompt' and 'completion'")
        else:
            self.stream = torch.tensor(_encode(tokenizer, Path(path).read_text(encoding="utf-8")), dtype=torch.long)
        if self.stream is not None and self.stream.numel() < seq_len + 1:
            raise ValueError(f"the data has {self.stream.numel()} tokens, fewer than seq_len={seq_len}")

    def _examples(self, tokenizer, path: str, records: list[dict]) -> None:
        self.examples = []
        for i, r in enumerate(records):
            prompt = _encode(tokenizer, _string(r, "prompt", path, i))
            tokens = (prompt + _encode(tokenizer, _string(r, "completion", path, i)))[: self.seq_len]
            # a label needs a completion token at a row >= 1 (row t is predicted from row t - 1)
            if len(tokens) <= max(len(prompt), 1):
                self.dropped += 1
                continue
            self.examples.append((tokens, len(prompt)))
        if not self.examples:
            raise ValueError(f"{path}: no example has a completion token within --seq-len {self.seq_len} (prompts "
                             "too long, or completions empty)")
        if self.dropped:
            warnings.warn(f"{path}: {self.dropped} of {len(records)} examples have no completion token within "
                          f"--seq-len {self.seq_len} (prompt too long or completion empty); they are left out",
                          stacklevel=2)

    def batch(self, step: int, micro: int, batch_size: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + micro)
        if self.stream is not None:
            starts = torch.randint(0, self.stream.numel() - self.seq_len, (batch_size,), generator=g)
            ids = torch.stack([self.stream[s: s + self.seq_len] for s in starts.tolist()])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        picks = torch.randint(0, len(self.examples), (batch_size,), generator=g).tolist()
        return self._padded(picks, self.trim)

    @property
    def records(self) -> int:
        """How many records the data holds: examples, or whole ``seq_len`` windows of a corpus."""
        return len(self.examples) if self.examples is not None else self.stream.numel() // self.seq_len

    def rows(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """A batch of the records ``indices``, padded (right) to its longest row."""
        if self.stream is not None:
            ids = torch.stack([self.stream[i * self.seq_len: (i + 1) * self.seq_len] for i in indices]) if indices \
                else torch.zeros(0, self.seq_len, dtype=torch.long)  # (B, seq_len)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        return self._padded(indices, trim=True)

    def _padded(self, picks: list[int], trim: bool) -> dict[str, torch.Tensor]:
        longest = max((len(self.examples[i][0]) for i in picks), default=1)
        ids = torch.full((len(picks), longest if trim else self.seq_len), self.pad_id, dtype=torch.long)  # (B, T)
        labels = torch.full_like(ids, IGNORE_INDEX)
        mask = torch.zeros_like(ids)
        for b, i in enumerate(picks):
            tokens, n_prompt = self.examples[i]
            ids[b, : len(tokens)] = torch.tensor(tokens)
            mask[b, : len(tokens)] = 1
            labels[b, n_prompt: len(tokens)] = torch.tensor(tokens[n_prompt:], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _check_file(path: str) -> str:
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"--data {path} is a folder; give a .txt or .jsonl file")
    if not p.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    return path


def _string(record: dict, field: str, path: str, index: int) -> str:
    value = record[field]
    if not isinstance(value, str):
        raise ValueError(f"{path}: record {index + 1}: '{field}' must be a string, got {type(value).__name__}")
    return value


def read_jsonl(path: str) -> list[dict]:
    """The records of a .jsonl file: one JSON object per non-empty line (errors name the line)."""
    records = []
    with open(_check_file(path), encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    if not records:
        raise ValueError(f"{path} has no records")
    return records


def verses() -> list[str]:
    """The verses of the bundled text, in order."""
    return [m.group(1) for m in re.finditer(r"^\s+\d+ (.+)$", bundled_text(), flags=re.MULTILINE)]


# the classification task: does someone speak in the verse (a word of speech in it)?
SPEECH = re.compile(r"\b(said|saith|saying|spake)\b")
CLASSIFY_QUESTION = "\nDoes someone speak? "
CLASSIFY_LABELS = ("n", "y")  # (one token each for the byte-level tokenizer)


def classify_records() -> list[dict]:
    """The bundled verses as a two-class task, in the prompt/completion format:

        {"prompt": "<verse>\nDoes someone speak? ", "completion": "y" | "n"}

    "y" when the verse holds a word of speech (said, saith, saying, spake: 533 of the 1618 verses,
    33%), a label read off the text so that it needs no annotation. The loss is the cross-entropy of
    the label token under the LM head (the prompt's tokens are not scored)."""
    return [{"prompt": v + CLASSIFY_QUESTION, "completion": CLASSIFY_LABELS[bool(SPEECH.search(v))]}
            for v in verses()]


def _check_one_token_labels(tokenizer, records: list[dict]) -> None:
    for label in sorted({r["completion"] for r in records}):
        if len(_encode(tokenizer, label)) != 1:
            raise ValueError(f"--data {CLASSIFY}: the label {label!r} is {len(_encode(tokenizer, label))} tokens under "
                             "this model's tokenizer; the task scores one label token")


def _split(verse: str) -> tuple[str, str]:
    """(first half, rest) at a word boundary."""
    words = verse.split(" ")
    cut = max(1, len(words) // 2)
    return " ".join(words[:cut]) + " ", " ".join(words[cut:])


def builtin_records(objective: str, seed: int = 0) -> list[dict]:
    """Post-training data made from the bundled verses, in TRL's dataset formats:

    sft:  {"prompt": first half of a verse, "completion": the rest}
    dpo:  {"prompt": first half, "chosen": the rest, "rejected": the rest of another verse}
    grpo: {"prompt": first half, "answer": the rest} (scored by ``continuation_reward``)
    """
    halves = [_split(v) for v in verses()]
    if objective == "sft":
        return [{"prompt": p, "completion": c} for p, c in halves]
    if objective == "dpo":
        others = list(range(len(halves)))
        random.Random(seed).shuffle(others)
        return [{"prompt": p, "chosen": c, "rejected": halves[j][1] if j != i else halves[(j + 1) % len(halves)][1]}
                for i, ((p, c), j) in enumerate(zip(halves, others))]
    if objective == "grpo":
        return [{"prompt": p, "answer": c} for p, c in halves]
    raise ValueError(f"no built-in data for objective {objective!r}")


def continuation_reward(completions, answer, **kwargs) -> list[float]:
    """A rule-based reward in [0, 1]: how closely each completion matches the true continuation
    (difflib's character similarity ratio over the answer's length)."""
    import difflib

    return [difflib.SequenceMatcher(None, c[: len(a)], a).ratio() for c, a in zip(completions, answer)]
