"""Whisper's long form, as openai-whisper's `transcribe` (20250625) decodes a recording: each window is the 30 s
of log-mel from `seek` (any frame offset, cut from the recording's one log-mel), decoded with timestamp tokens
under openai-whisper's logit rules (SuppressBlank, SuppressTokens, ApplyTimestampRules); its complete segments
are kept, and the next window starts where the last of them ends (or after the window, where it ends in a single
timestamp or has none). A decode judged implausible (compression ratio above 2.4, or average log-probability
below -1.0) is decoded again at the next temperature (0.0, 0.2 ... 1.0); a window whose no-speech probability is
above 0.6 with a log-probability below -1.0 is silence, skipped whole. Each window's prompt holds the text kept
so far (`<|startofprev|>` + its last 223 tokens), reset after a window decoded above temperature 0.5.
The thresholds are GenerationOptions' (the CLI's flags, with openai-whisper's names)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from runner.audio import HOP_LENGTH, N_FRAMES, SAMPLE_RATE
from runner.families.whisper.timing import add_word_timestamps, last_end
from runner.families.whisper.tokenizer import WhisperTokenizer
from runner.runtime.generate import GenerationOptions, MultimodalRunner, WindowPlan
from runner.runtime.prompt import AudioSegment, TextSegment
from runner.runtime.results import (
    GenerationResult,
    Segment,
    TextJoiner,
    compression_ratio,
    join_results,
    window_result,
)
from runner.stats import Stats, now_ms

INPUT_STRIDE = 2  # mel frames per encoder position: N_FRAMES / n_audio_ctx
TIME_PRECISION = INPUT_STRIDE * HOP_LENGTH / SAMPLE_RATE  # seconds per timestamp step: 0.02
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # mel frames: 100
MAX_INITIAL_TIMESTAMP = 1.0  # DecodingOptions.max_initial_timestamp: the first timestamp at most 1 s in

# openai-whisper's Tokenizer.non_speech_tokens: speaker tags, music and annotation symbols, each suppressed where
# it is one token alone or after a space (the musical signs by their first token)
_SYMBOLS = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』') + (
    "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
)
_MISCELLANEOUS = "♩♪♫♬♭♮♯"


@dataclass(frozen=True)
class Rules:
    """The ids openai-whisper's logit filters and segmenting need, looked up in the tokenizer."""

    eot: int
    sot_prev: int
    no_speech: int
    no_timestamps: int
    timestamp_begin: int
    blank: tuple[int, ...]  # SuppressBlank: " " and <|endoftext|> as the first token
    suppress: tuple[int, ...]  # SuppressTokens("-1"): non-speech symbols and the control tokens

    @classmethod
    def of(cls, tok: WhisperTokenizer) -> Rules:
        names = [n for n in ("<|nospeech|>", "<|nocaptions|>") if _has(tok, n)]
        no_speech = tok.special_id(names[0])
        controls = ["<|transcribe|>", "<|translate|>", "<|startoftranscript|>", "<|startofprev|>", "<|startoflm|>"]
        suppress = {tok.encode(" -")[0], tok.encode(" '")[0], no_speech}
        suppress |= {tok.special_id(n) for n in controls if _has(tok, n)}
        for symbol in _SYMBOLS + list(_MISCELLANEOUS):
            for ids in (tok.encode(symbol), tok.encode(" " + symbol)):
                if len(ids) == 1 or symbol in _MISCELLANEOUS:
                    suppress.add(ids[0])
        no_timestamps = tok.special_id("<|notimestamps|>")
        return cls(
            eot=tok.eos_id,
            sot_prev=tok.special_id("<|startofprev|>"),
            no_speech=no_speech,
            no_timestamps=no_timestamps,
            timestamp_begin=no_timestamps + 1,  # <|0.00|>: the timestamps follow <|notimestamps|>
            blank=(*tok.encode(" "), tok.eos_id),
            suppress=tuple(sorted(suppress)),
        )

    def apply(self, logits: torch.Tensor, sampled: list[int]) -> torch.Tensor:
        """openai-whisper's SuppressBlank, SuppressTokens and ApplyTimestampRules on one step's logits [V]
        (float32, changed in place), given the tokens sampled so far in this window."""
        tb, inf = self.timestamp_begin, -np.inf
        if not sampled:
            logits[list(self.blank)] = inf
        logits[list(self.suppress)] = inf
        logits[self.no_timestamps] = inf
        last = len(sampled) >= 1 and sampled[-1] >= tb
        penultimate = len(sampled) < 2 or sampled[-2] >= tb
        if last:  # timestamps come in pairs, except directly before <|endoftext|>
            if penultimate:
                logits[tb:] = inf
            else:
                logits[: self.eot] = inf
        stamps = [t for t in sampled if t >= tb]
        if stamps:  # never decreasing, and a segment never empty (no loop at one time)
            logits[tb : stamps[-1] + (0 if last and not penultimate else 1)] = inf
        if not sampled:  # a window begins with a timestamp, at most MAX_INITIAL_TIMESTAMP in
            logits[:tb] = inf
            logits[tb + round(MAX_INITIAL_TIMESTAMP / TIME_PRECISION) + 1 :] = inf
        logprobs = torch.log_softmax(logits, dim=-1)
        if logprobs[tb:].logsumexp(dim=-1) > logprobs[:tb].max():  # timestamps together likelier than any text
            logits[:tb] = inf
        return logits


def _has(tok: WhisperTokenizer, name: str) -> bool:
    return tok.has_special(name)


@dataclass
class Attempt:
    """One decode of a window at one temperature."""

    temperature: float
    prompt_ids: list[int]
    tokens: list[int]  # sampled, <|endoftext|> left out
    logits: list[torch.Tensor]  # each sampled token's logits [1, V] after the rules (ruled out: -inf), if recorded
    sum_logprob: float
    no_speech_prob: float
    stop: str
    text: str = ""
    prefilled_ms: float = 0.0  # when the prompt's prefill ended
    first_token_ms: float = 0.0  # when the first token (or <|endoftext|>) was picked

    @property
    def avg_logprob(self) -> float:
        return self.sum_logprob / (len(self.tokens) + 1)

    def needs_fallback(self, opts: GenerationOptions) -> bool:
        """decode_with_fallback's judgement: too repetitive or too unlikely, unless it is silence (no speech
        likely, and too unlikely to be text)."""
        low = opts.logprob_threshold is not None and self.avg_logprob < opts.logprob_threshold
        if low and self._no_speech(opts):
            return False
        ratio = opts.compression_ratio_threshold
        return low or (ratio is not None and compression_ratio(self.text) > ratio)

    def is_silence(self, opts: GenerationOptions) -> bool:
        """transcribe's skip: no speech likely, unless the text's log-probability is high enough to keep it."""
        confident = opts.logprob_threshold is not None and self.avg_logprob > opts.logprob_threshold
        return self._no_speech(opts) and not confident

    def _no_speech(self, opts: GenerationOptions) -> bool:
        return opts.no_speech_threshold is not None and self.no_speech_prob > opts.no_speech_threshold


@dataclass
class LongForm(WindowPlan):
    """A recording transcribed as openai-whisper's `transcribe` does it (the module's docstring)."""

    samples: np.ndarray
    sot_sequence: tuple[int, ...]  # <|startoftranscript|> [<|xx|><|transcribe|>]: no <|notimestamps|>
    tok: WhisperTokenizer
    rules: Rules | None = field(init=False)

    def __post_init__(self):
        self.rules = None  # looked up when decoding starts: a file that fails before it needs none

    def generate(self, runner: MultimodalRunner, opts: GenerationOptions, on_text, stats: Stats) -> GenerationResult:
        self.rules = self.rules or Rules.of(self.tok)
        content = len(self.samples) // HOP_LENGTH
        gen = torch.Generator().manual_seed(opts.seed if opts.seed is not None else 0)
        state = _State()
        joiner = TextJoiner(on_text)
        while state.seek < content or not state.windows:
            s = copy.copy(stats)
            s.inference_start_ms = now_ms()
            size = min(N_FRAMES, content - state.seek)
            attempts = self._decode_with_fallback(runner, opts, state, size, gen)
            kept = attempts[-1]
            advance, segments, used, single_ending = self._segments(kept, state.seek, size, opts)
            if opts.word_timestamps:
                segments, advance = self._words(runner.engine, state, segments, size, advance, single_ending)
            segments = [_cleared(seg) for seg in segments]
            s.audio_seconds = advance * HOP_LENGTH / SAMPLE_RATE  # this window's stretch: the records' bounds
            s.prompt_tokens = len(kept.prompt_ids)
            s.prompt_eval_end_ms, s.first_token_ms = kept.prefilled_ms, kept.first_token_ms
            r = window_result(
                self.tok, kept.prompt_ids, kept.tokens[:used], kept.stop, s, kept.logits[:used], runner.engine.device
            )
            text = "".join(seg.text for seg in segments)
            state.add(replace(r, text=text), attempts, segments, opts, kept.is_silence(opts) and not segments)
            if on_text:  # a window's text is known once its segments are: streamed window by window
                joiner.next_window()
                joiner(text)
            state.seek += advance if advance > 0 else size  # a window always moves on
        joined = join_results(state.windows, stats, runner.engine.device)
        parts = tuple(
            replace(p, temperature=a[-1].temperature, fallbacks=len(a) - 1, silent=silent)
            for p, (a, silent) in zip(joined.parts, state.outcomes)
        )
        return replace(joined, parts=parts, segments=tuple(state.segments), prompts=tuple(state.prompts))

    def _decode_with_fallback(self, runner, opts: GenerationOptions, state: _State, size: int, gen) -> list[Attempt]:
        """The window decoded at each temperature in turn until a decode is judged plausible (or the last)."""
        e = runner.engine
        half = e.max_seq_len // 2
        previous = state.tokens[state.prompt_reset_since :]
        prompt = [self.rules.sot_prev, *previous[-(half - 1) :]] if previous else []
        audio = AudioSegment(self.samples, window=0, frames=(state.seek, size))
        window = [audio, TextSegment((*prompt, self.sot_sequence[0]))]
        state.prompts.append([audio, TextSegment((*prompt, *self.sot_sequence))])  # what teacher forcing replays
        attempts = []
        for t in opts.fallback_temperatures():
            attempts.append(self._decode(runner, window, t, opts.max_new_tokens or half, opts.record_logits, gen))
            if not attempts[-1].needs_fallback(opts):
                break
        return attempts

    def _decode(self, runner, window, t: float, sample_len: int, record: bool, gen) -> Attempt:
        """One decode of the window at temperature t: greedy at 0, else sampled from the filtered logits."""
        e = runner.engine
        e.reset()
        try:
            logits, prompt_ids = runner.prefill(window)  # up to <|startoftranscript|>: its logits say no-speech
            no_speech = float(torch.softmax(logits[0].float(), dim=-1)[self.rules.no_speech])
            pos = len(prompt_ids)
            for token in self.sot_sequence[1:]:  # a multilingual model's language and task
                logits = e.decode_token(torch.tensor([[token]], device=e.device), pos)
                prompt_ids.append(token)
                pos += 1
            prefilled_ms, first_token_ms = now_ms(), 0.0
            tokens, recorded, total, stop = [], [], 0.0, "max_new_tokens"
            limit = min(sample_len, e.max_seq_len - pos)
            while len(tokens) < limit:
                raw = logits[0].float().cpu()
                filtered = self.rules.apply(raw.clone(), tokens)
                logprobs = torch.log_softmax(filtered, dim=-1)
                if t == 0:
                    token = int(filtered.argmax())
                else:
                    token = int(torch.multinomial(torch.softmax(filtered / t, dim=-1), 1, generator=gen))
                total += float(logprobs[token])
                first_token_ms = first_token_ms or now_ms()
                if token == self.rules.eot:
                    stop = "eos"
                    break
                tokens.append(token)
                if record:  # what the reference check compares: the rules rule the same tokens out for eager
                    recorded.append(filtered[None])
                logits = e.decode_token(torch.tensor([[token]], device=e.device), pos)
                pos += 1
        finally:
            e.reset()
        text = self.tok.decode([x for x in tokens if x < self.rules.eot]).strip()
        first_token_ms = first_token_ms or now_ms()  # no token picked (the limit): the decode's end
        return Attempt(t, prompt_ids, tokens, recorded, total, no_speech, stop, text, prefilled_ms, first_token_ms)

    def _words(self, engine, state: _State, segments: list[Segment], size: int, advance: int, single_ending: bool):
        """The window's segments with word timestamps, and the frames to advance: to the last word's end where
        the window does not end in a single timestamp (transcribe's seek with word_timestamps)."""
        offset = state.seek * HOP_LENGTH / SAMPLE_RATE
        segments = add_word_timestamps(engine, self.tok, self.sot_sequence, segments, offset, size, state.last_speech)
        end = last_end(segments)
        if not single_ending and end is not None and end > offset:
            advance = round(end * FRAMES_PER_SECOND) - state.seek
        state.last_speech = end if end is not None else state.last_speech
        return segments, advance

    def _segments(self, a: Attempt, seek: int, size: int, opts: GenerationOptions):
        """transcribe's segmenting of a kept decode: (frames to advance, its segments, tokens of it kept, whether
        it ends in a single timestamp). A silent window advances `size` with nothing kept."""
        if a.is_silence(opts):
            return size, [], 0, False
        tb, offset = self.rules.timestamp_begin, seek * HOP_LENGTH / SAMPLE_RATE
        tokens = a.tokens
        stamp = [x >= tb for x in tokens]
        single_ending = stamp[-2:] == [False, True]
        cuts = [i + 1 for i in range(len(tokens) - 1) if stamp[i] and stamp[i + 1]]
        if not cuts:
            stamps = [x for x in tokens if x >= tb]
            end = size * HOP_LENGTH / SAMPLE_RATE
            if stamps and stamps[-1] != tb:
                end = (stamps[-1] - tb) * TIME_PRECISION
            return size, [self._segment(a, offset, offset + end, tokens)], len(tokens), single_ending
        if single_ending:
            cuts.append(len(tokens))
        out, last = [], 0
        for cut in cuts:
            piece = tokens[last:cut]
            start, end = (offset + (piece[i] - tb) * TIME_PRECISION for i in (0, -1))
            out.append(self._segment(a, start, end, piece))
            last = cut
        advance = size if single_ending else (tokens[last - 1] - tb) * INPUT_STRIDE
        return advance, out, last, single_ending

    def _segment(self, a: Attempt, start: float, end: float, tokens: list[int]) -> Segment:
        text = self.tok.decode([x for x in tokens if x < self.rules.eot])
        return Segment(start, end, text, tuple(tokens), a.avg_logprob, a.no_speech_prob, a.temperature)


def _cleared(s: Segment) -> Segment:
    """An instantaneous or blank segment is kept for its times, without text, tokens or words (after word timing,
    which reads its tokens, as transcribe does)."""
    if s.start == s.end or not s.text.strip():
        return replace(s, text="", tokens=(), words=() if s.words is not None else None)
    return s


@dataclass
class _State:
    """What the long form has kept so far."""

    seek: int = 0
    tokens: list[int] = field(default_factory=list)  # every kept segment's tokens: the prompt's text
    prompt_reset_since: int = 0
    windows: list[GenerationResult] = field(default_factory=list)
    outcomes: list[tuple[list[Attempt], bool]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    prompts: list[list] = field(default_factory=list)
    last_speech: float = 0.0  # where the last word ended (word timing's pause heuristics)

    def add(self, r: GenerationResult, attempts: list[Attempt], segments: list[Segment], opts, silent: bool) -> None:
        self.windows.append(r)
        self.outcomes.append((attempts, silent))
        self.segments += segments
        self.tokens += [t for s in segments for t in s.tokens]
        if not opts.condition_on_previous_text or attempts[-1].temperature > 0.5:
            self.prompt_reset_since = len(self.tokens)
