"""What the generation loop needs of a tokenizer, and text streamed as tokens arrive."""

from __future__ import annotations

import codecs
from typing import Protocol


class Tokenizer(Protocol):
    """The interface every family's tokenizer offers (Tekken for Voxtral, byte-level BPE for Whisper)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    def special_id(self, name: str) -> int: ...
    def is_special(self, token_id: int) -> bool: ...
    def special_name(self, token_id: int) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids, *, keep_special: bool = False) -> str: ...


class StreamDecoder:
    """Incremental `Tokenizer.decode`: feed ids one at a time, get back the text that is complete so far.

    Byte-level BPE splits emoji and CJK characters across tokens, so the tail of an unfinished UTF-8 sequence is
    held back until its last byte arrives. Concatenating every `feed` result and `flush()` equals `decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, *, keep_special: bool = False) -> None:
        self._tok = tokenizer
        self._keep_special = keep_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if self._tok.is_special(token_id):
            # A special token ends the byte run, exactly as decode() groups runs.
            text = self._utf8.decode(b"", final=True)
            self._utf8.reset()
            return text + (self._tok.special_name(token_id) if self._keep_special else "")
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still held back (an unfinished sequence becomes U+FFFD)."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
