"""The Whisper family at run time: tokenizer, engine and runner over the same Program, delegate and decode loop.

A Whisper bundle has the same four methods as a Voxtral one, but the audio is not part of the decoder's
sequence: `audio_encoder` turns one 30 s window into the cross-attention K/V of every decoder layer, and
`text_decoder(embeds, cache_position, cross_kv)` attends to them. So the engine keeps the last window's K/V and
hands them to every decoder call, and the runner transcribes long audio window by window (each window: reset the
KV cache, encode, prompt `<|startoftranscript|>[<|lang|><|transcribe|>]<|notimestamps|>`, greedy decode to
`<|endoftext|>`), joining the text. Everything else (sampling, stats, streaming, the eager comparison) is
MultimodalRunner's own loop.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from runner.audio import N_SAMPLES, load_audio
from runner.errors import GenerationError, TokenizerError
from runner.multimodal import (
    AudioSegment,
    GenerationOptions,
    GenerationResult,
    MultimodalRunner,
    ProgramEngine,
    Segment,
    TextSegment,
    stage,
    to_encoder_dtype,
)
from runner.program import Program
from runner.stats import Stats

FAMILY = "whisper"
TOKENIZER_TYPE = "hf-tokenizers"
# The control tokens a bundle's manifest lists (ids looked up by name in tokenizer.json at export).
SPECIAL_TOKENS = {
    "eot": "<|endoftext|>",
    "sot": "<|startoftranscript|>",
    "transcribe": "<|transcribe|>",
    "translate": "<|translate|>",
    "startofprev": "<|startofprev|>",
    "nocaptions": "<|nocaptions|>",
    "notimestamps": "<|notimestamps|>",
}


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
    behind the interface MultimodalRunner and StreamDecoder use (`special_id`, `eos_id`, `is_special`,
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


def whisper_prompt(tok: WhisperTokenizer, multilingual: bool, language: str | None) -> tuple[int, ...]:
    """<|startoftranscript|> [<|xx|><|transcribe|>] <|notimestamps|>; English-only models take no language."""
    if not multilingual:
        if language not in (None, "en"):
            raise GenerationError(f"this Whisper model is English-only; --language {language} is not available")
        return tok.special_id("<|startoftranscript|>"), tok.special_id("<|notimestamps|>")
    lang = tok.special_id(f"<|{language or 'en'}|>")
    return (
        tok.special_id("<|startoftranscript|>"),
        lang,
        tok.special_id("<|transcribe|>"),
        tok.special_id("<|notimestamps|>"),
    )


# ---------------------------------------------------------------- engines


class WhisperEngine(ProgramEngine):
    """ProgramEngine for a Whisper bundle: `encode` keeps the window's cross-attention K/V, which every
    `decode` passes to text_decoder as its third input."""

    def __init__(self, program: Program, cuda_graph: bool = True):
        super().__init__(program, cuda_graph=cuda_graph)
        model = program.manifest.model
        enc_in, kv_spec = self._enc.spec.inputs[0], self._enc.spec.outputs[0]
        # the mel bins come from the bundle: preprocessor output, encoder input and manifest must agree
        n_mels = model.get("n_mels")
        if not (n_mels == enc_in.shape[1] == self._pre.spec.outputs[0].shape[1]):
            raise GenerationError(
                f"{program.bundle_dir}: mel bins disagree (manifest {n_mels}, preprocessor "
                f"{self._pre.spec.outputs[0].shape[1]}, audio_encoder {enc_in.shape[1]})"
            )
        self.n_mels = n_mels
        self.cross_kv: torch.Tensor | None = None
        if self.use_cuda_graph:  # graph replays read a static tensor: encode() copies each window into it
            self.cross_kv = torch.zeros(kv_spec.shape, dtype=getattr(torch, kv_spec.dtype), device=self.device)

    def encode(self, mel):
        kv = self._enc(mel)[0]
        if self.use_cuda_graph:
            self.cross_kv.copy_(kv)
        else:
            self.cross_kv = kv
        return kv

    def decode(self, embeds, pos):
        if self.cross_kv is None:
            raise GenerationError("text_decoder called before audio_encoder: no cross-attention K/V yet")
        return self._dec(embeds, pos, self.cross_kv)[0]

    def graph_inputs(self):
        return (self.cross_kv,)


# ---------------------------------------------------------------- runner


class WindowTokens(list):
    """Generated ids of several windows, concatenated, remembering each window's length: teacher forcing
    (`generate(..., forced=result.tokens)`, the eager comparison) replays each window with its own tokens."""

    def __init__(self, tokens=(), lengths=()):
        super().__init__(tokens)
        self.lengths = list(lengths)


class WhisperRunner(MultimodalRunner):
    AUDIO_TOKEN = None  # audio is cross-attended, never a decoder position

    def __init__(self, engine, tokenizer: WhisperTokenizer, multilingual: bool = False):
        super().__init__(engine, tokenizer)
        self.multilingual = multilingual

    @classmethod
    def for_program(cls, program: Program, cuda_graph: bool = True) -> WhisperRunner:
        m = program.manifest.model
        tok = WhisperTokenizer(program.bundle_dir / m["tokenizer"], m["config"]["text"]["vocab_size"])
        return cls(WhisperEngine(program, cuda_graph=cuda_graph), tok, m.get("multilingual", False))

    def prompt_for(self, audio_path: str | os.PathLike, prompt: str | None, language: str | None) -> list[Segment]:
        """One (audio window, prompt) pair per 30 s of audio."""
        if prompt:
            raise GenerationError("a Whisper bundle transcribes only; --prompt is not supported")
        samples = load_audio(audio_path)
        ids = whisper_prompt(self.tok, self.multilingual, language)
        starts = range(0, max(len(samples), 1), N_SAMPLES)
        return [seg for s in starts for seg in (AudioSegment(samples[s : s + N_SAMPLES]), TextSegment(ids))]

    def prefill(self, segments: list[Segment]) -> tuple[torch.Tensor, list[int]]:
        e, pos, prompt_ids, logits = self.engine, 0, [], None
        for seg, x in zip(segments, stage(segments, e.device, 1)):  # inputs copied before any compute
            if isinstance(seg, AudioSegment):
                e.encode(to_encoder_dtype(e.preprocess(x), e.encoder_dtype))
                continue
            if pos + len(seg.ids) > e.max_seq_len:
                raise GenerationError(
                    f"the prompt needs {pos + len(seg.ids)} positions, the decoder has {e.max_seq_len}"
                )
            logits = e.decode(e.embed(x), self._positions(pos, len(seg.ids)))
            prompt_ids += seg.ids
            pos += len(seg.ids)
        if logits is None:
            raise GenerationError("a Whisper prompt needs text after the audio")
        return logits, prompt_ids

    def generate(self, segments, opts: GenerationOptions, on_text=None, stats: Stats | None = None, forced=None):
        windows = _windows(segments)
        if len(windows) == 1:
            result = super().generate(windows[0], opts, on_text=on_text, stats=stats, forced=forced)
            return replace(result, tokens=WindowTokens(result.tokens, [len(result.tokens)]))
        stats = stats or Stats()
        per_window = _split_forced(forced, len(windows), self.tok.eos_id)
        results: list[GenerationResult] = []
        for i, (window, forced_i) in enumerate(zip(windows, per_window)):
            s = stats if i == 0 else Stats()
            results.append(super().generate(window, opts, on_text=on_text, stats=s, forced=forced_i))
            if i:
                _merge_stats(stats, s)
        stats.finish_memory(self.engine.device)
        reasons = [r.stop_reason for r in results if r.stop_reason != "eos"]
        return GenerationResult(
            text="".join(r.text for r in results),
            prompt_ids=[i for r in results for i in r.prompt_ids],
            tokens=WindowTokens([t for r in results for t in r.tokens], [len(r.tokens) for r in results]),
            stop_reason=reasons[-1] if reasons else "eos",
            stats=stats,
            logits=[x for r in results for x in r.logits],
        )


def _windows(segments: list[Segment]) -> list[list[Segment]]:
    """Split at every AudioSegment: each window is its audio and the prompt after it."""
    out: list[list[Segment]] = []
    for seg in segments:
        if isinstance(seg, AudioSegment) or not out:
            out.append([])
        out[-1].append(seg)
    return out


def _split_forced(forced, n: int, eot: int) -> list[list[int] | None]:
    if forced is None:
        return [None] * n
    lengths = getattr(forced, "lengths", None)
    if lengths is None or len(lengths) != n:  # a plain list: each window ends at its <|endoftext|>
        cuts, start = [], 0
        for i, t in enumerate(forced):
            if t == eot and len(cuts) < n - 1:
                cuts.append(forced[start : i + 1])
                start = i + 1
        cuts.append(forced[start:])
        return cuts + [[]] * (n - len(cuts))
    out, start = [], 0
    for k in lengths:
        out.append(list(forced[start : start + k]))
        start += k
    return out


def _merge_stats(total: Stats, s: Stats) -> None:
    total.prompt_tokens += s.prompt_tokens
    total.generated_tokens += s.generated_tokens
    total.aggregate_sampling_time_ms += s.aggregate_sampling_time_ms
    total.audio_seconds += s.audio_seconds
    total.inference_end_ms = s.inference_end_ms
