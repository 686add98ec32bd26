"""Whisper's byte-level BPE tokenizer, read from the `tokenizer.json` shipped with the model."""

from __future__ import annotations

import os

from runner.errors import TokenizerError

TOKENIZER_TYPE = "hf-tokenizers"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character each byte is written as -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class WhisperTokenizer:
    """Whisper's byte-level BPE from the `tokenizer.json` shipped with the model (the `tokenizers` package),
    behind the runtime's Tokenizer interface (`special_id`, `eos_id`, `is_special`,
    `token_bytes`, `decode`). Every id from `<|endoftext|>` up is a control token (including the timestamp ids
    past the end of tokenizer.json, up to the model's vocabulary size)."""

    def __init__(self, path: str | os.PathLike, vocab_size: int):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(
                'the Whisper tokenizer needs the "tokenizers" package (pip install -e ".[whisper]")'
            ) from None
        path = os.fspath(path)
        try:
            self._tk = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises its own Exception subclass for missing/malformed files
            raise TokenizerError(f"cannot read tokenizer {path} ({' '.join(str(e).split())})") from None
        self._special_ids = {t.content: i for i, t in self._tk.get_added_tokens_decoder().items()}
        self._names = {i: s for s, i in self._special_ids.items()}
        self._vocab_size = vocab_size
        self._eot = self.special_id("<|endoftext|>")
        if min(self._names) != self._eot:  # is_special() relies on every control token sitting from it up
            raise TokenizerError(f"{path}: control tokens below <|endoftext|> ({self._eot})")
        if self._tk.get_vocab_size(with_added_tokens=True) > vocab_size:
            raise TokenizerError(f"{path}: more tokens than the model's vocabulary ({vocab_size})")
        self._bytes = _byte_decoder()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        return self._eot

    def special_id(self, name: str) -> int:
        try:
            return self._special_ids[name]
        except KeyError:
            raise TokenizerError(f"special token {name!r} is not in the tokenizer") from None

    def has_special(self, name: str) -> bool:
        return name in self._special_ids

    def is_special(self, token_id: int) -> bool:
        return token_id >= self._eot

    def special_name(self, token_id: int) -> str:
        self._check_id(token_id)
        return self._names.get(token_id, f"<|special:{token_id}|>")

    def token_bytes(self, token_id: int) -> bytes:
        self._check_id(token_id)
        if self.is_special(token_id):
            return b""
        return bytes(self._bytes[c] for c in self._tk.id_to_token(token_id))

    def encode(self, text: str) -> list[int]:
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if any(self.is_special(i) for i in ids):
            raise TokenizerError(f"text {text!r} contains a Whisper control token")
        return ids

    def decode(self, ids, *, keep_special: bool = False) -> str:
        parts, run = [], []
        for i in ids:
            if self.is_special(i):
                parts.append(b"".join(run).decode("utf-8", errors="replace"))
                run = []
                if keep_special:
                    parts.append(self.special_name(i))
            else:
                run.append(self.token_bytes(i))
        parts.append(b"".join(run).decode("utf-8", errors="replace"))
        return "".join(parts)

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self._vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary [0, {self._vocab_size})")
