"""Tekken, Mistral's tiktoken-based tokenizer, read from the `tekken.json` that ships with the checkpoint.

Ids: special (control) tokens occupy [0, num_special); BPE token of rank r has id r + num_special. The BPE
vocabulary is cut to `default_vocab_size - num_special` entries, as mistral-common does, so the id space is
exactly [0, vocab_size). Text is only ever encoded as plain text: a prompt containing "[INST]" gets the BPE
tokens for those characters, never the control id; control ids are inserted by name (`special_id`).
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable
from itertools import groupby

import tiktoken

from runner.errors import TokenizerError
from runner.json_file import TOKENIZER_MAX_BYTES, read_json_object

# Tekken files without a "special_tokens" list (tokenizer versions up to v7) use this fixed list.
_LEGACY_SPECIAL_TOKENS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
)  # fmt: skip
_FILLER = "<SPECIAL_{}>"  # mistral-common's name for unlisted special slots
# Bounds on what tekken.json may declare: mistral-common's files have 1000 special tokens and 131072 or 150000 ids.
MAX_SPECIAL = 1 << 16
MAX_VOCAB = 1 << 22


class Tekken:
    def __init__(self, bpe: list[bytes], specials: list[str], pattern: str, *, name: str = "tekken") -> None:
        """`bpe[r]` is the byte string of rank r; `specials[i]` is the name of control id i."""
        self.name = name  # the file, for errors
        self._num_special = len(specials)
        self._specials = list(specials)
        self._special_ids = {s: i for i, s in enumerate(specials)}
        self._bpe = list(bpe)
        try:
            self._enc = tiktoken.Encoding(
                name=name,
                pat_str=pattern,
                mergeable_ranks={b: r for r, b in enumerate(bpe)},
                special_tokens={},  # control tokens never come from text
            )
        except Exception as e:  # tiktoken reports a bad regex as ValueError from Rust
            raise TokenizerError(f"tokenizer {name}: cannot build BPE ({' '.join(str(e).split())})") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tekken:
        path = os.fspath(path)
        data = read_json_object(path, TokenizerError, TOKENIZER_MAX_BYTES)
        try:
            bpe, specials, pattern = _parse(data)
        except (KeyError, TypeError, ValueError) as e:
            raise TokenizerError(f"malformed tokenizer file {path}: {e}") from None
        return cls(bpe, specials, pattern, name=path)

    # --- ids ---
    @property
    def num_special(self) -> int:
        return self._num_special

    @property
    def vocab_size(self) -> int:
        return self._num_special + len(self._bpe)

    @property
    def bos_id(self) -> int:
        return self.special_id("<s>")

    @property
    def eos_id(self) -> int:
        return self.special_id("</s>")

    def special_id(self, name: str) -> int:
        try:
            return self._special_ids[name]
        except KeyError:
            raise TokenizerError(f"{self.name}: special token {name!r} is not in the tokenizer") from None

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < self._num_special

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of a BPE token (possibly part of a UTF-8 character); b"" for a special token."""
        self._check_id(token_id)
        return b"" if token_id < self._num_special else self._bpe[token_id - self._num_special]

    def special_name(self, token_id: int) -> str:
        self._check_id(token_id)
        return self._specials[token_id]

    # --- text ---
    def encode(self, text: str) -> list[int]:
        """Plain text to ids. No BOS/EOS; special-looking text stays text."""
        return [r + self._num_special for r in self._enc.encode_ordinary(text)]

    def decode(self, ids: Iterable[int], *, keep_special: bool = False) -> str:
        """Ids to text. Special tokens are skipped, or rendered by name with keep_special=True.

        Runs of BPE tokens are decoded together (invalid UTF-8 becomes U+FFFD), as mistral-common does.
        """
        parts = []
        for special, run in groupby(ids, self.is_special):
            run = list(run)
            if special:
                if keep_special:
                    parts.extend(self._specials[i] for i in run)
            else:
                parts.append(b"".join(self.token_bytes(i) for i in run).decode("utf-8", errors="replace"))
        return "".join(parts)

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")


def _parse(data: dict) -> tuple[list[bytes], list[str], str]:
    """Validate a tekken.json document; returns (bpe bytes by rank, special names by id, pattern)."""
    config = data["config"]
    if not isinstance(config, dict):
        raise ValueError("config is not a JSON object")
    pattern = config["pattern"]
    if not isinstance(pattern, str):
        raise ValueError("config.pattern is not a string")
    num_special = _count(config, "default_num_special_tokens", 1, MAX_SPECIAL)
    vocab_size = _count(config, "default_vocab_size", num_special + 1, MAX_VOCAB)

    listed = data.get("special_tokens")
    if listed is not None and not isinstance(listed, list):
        raise ValueError("special_tokens is not a list")
    names = list(_LEGACY_SPECIAL_TOKENS) if listed is None else []
    if len(listed or names) > num_special:
        raise ValueError(f"{len(listed or names)} special tokens listed but default_num_special_tokens={num_special}")
    for i, tok in enumerate(listed or ()):
        if tok["rank"] != i:
            raise ValueError(f"special token {tok['token_str']!r} has rank {tok['rank']}, expected {i}")
        if not isinstance(tok["token_str"], str):
            raise ValueError(f"special token {i}: token_str is not a string")
        names.append(tok["token_str"])
    names += [_FILLER.format(i) for i in range(len(names), num_special)]
    if len(set(names)) != len(names):
        raise ValueError("special token names are not unique")

    n_bpe = vocab_size - num_special
    vocab = data["vocab"]
    if len(vocab) < n_bpe:
        raise ValueError(f"vocab has {len(vocab)} entries, default_vocab_size needs {n_bpe}")
    bpe = []
    for r, tok in enumerate(vocab[:n_bpe]):
        if tok["rank"] != r:
            raise ValueError(f"vocab entry {r} has rank {tok['rank']}")
        bpe.append(base64.b64decode(tok["token_bytes"], validate=True))
    if len(set(bpe)) != len(bpe):
        raise ValueError("vocab has duplicate token bytes")
    return bpe, names, pattern


def _count(config: dict, key: str, least: int, most: int) -> int:
    """config[key]: a whole number within [least, most] (the special tokens' names are made for each one)."""
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config.{key}: {str(value)[:40]!r} is not a whole number")
    if not least <= value <= most:
        raise ValueError(f"config.{key}: {value} is out of range ({least} to {most})")
    return value
