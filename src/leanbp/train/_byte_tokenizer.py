"""A byte-level tokenizer that needs nothing downloaded: token id = UTF-8 byte value.

The built-in model has a 256-token vocabulary; TRL's trainers need a real ``PreTrainedTokenizerFast``
(padding, an end-of-sequence token, ``apply_chat_template``). This one maps every byte to its own
id, with byte 0x00 as padding and 0x04 (end of transmission) as end of sequence: text never holds
them, so the vocabulary stays 256.
"""

from __future__ import annotations

from functools import lru_cache

PAD_BYTE, EOS_BYTE = 0x00, 0x04
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@lru_cache(maxsize=1)
def _byte_chars() -> list[str]:
    """The printable character byte-level BPE uses for each byte value (GPT-2's table: printable
    Latin-1 bytes stand for themselves, the others are moved past U+0100 in order)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    chars, moved = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + moved))
            moved += 1
    return chars


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` with ids 0..255 = bytes, pad = 0x00, eos = 0x04."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_chars()
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=chars[PAD_BYTE], eos_token=chars[EOS_BYTE])
    fast.chat_template = CHAT_TEMPLATE
    return fast
