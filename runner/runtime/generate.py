"""The generation loop: prompt segments -> prefill -> decode, over any Engine (the exported program, or the eager
model for `--reference eager`), so both sides run exactly the same loop.

A prompt is one decoder context (reset, prefill, decode until a stop). A family may cut long audio into several
prompts, its windows (Whisper: one per 30 s); `generate_windows` runs them in order and joins their results.
What a prompt holds, and how its inputs reach the device: runner/runtime/prompt.py.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from runner.audio import ANSWER_TOKENS_PER_SECOND, DEFAULT_ANSWER_TOKENS
from runner.errors import GenerationError
from runner.runtime.detokenize import StreamDecoder, Tokenizer
from runner.runtime.engine import Engine, to_encoder_dtype
from runner.runtime.features import RecordingFeatures
from runner.runtime.prompt import (
    EncodedAudio,
    Segment,
    TextSegment,
    audio_seconds,
    inputs_on_device,
    window_sound,
)
from runner.runtime.results import GenerationResult, TextJoiner, join_results, window_result
from runner.stats import Stats, now_ms

# ---------------------------------------------------------------- windows decided while decoding


class WindowPlan:
    """A file's windows decided while decoding, not before (Whisper's long form: each window starts where the
    previous one's last complete segment ends, and its prompt holds the text before it). generate_windows hands
    it the runner, the KV cache held; it gives the file's one result."""

    def generate(self, runner: MultimodalRunner, opts: GenerationOptions, on_text, stats: Stats) -> GenerationResult:
        raise NotImplementedError


# ---------------------------------------------------------------- options and results


@dataclass(frozen=True)
class GenerationOptions:
    # None: room for the audio's answer, ANSWER_TOKENS_PER_SECOND of it (at least 128), up to the context's end
    max_new_tokens: int | None = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    min_new_tokens: int = 0  # ignore EOS until this many tokens (benchmarks force a fixed length)
    record_logits: bool = False
    # Long-form decoding, for a family whose windows are decided while decoding (WindowPlan: Whisper), as
    # openai-whisper's `transcribe` defaults them; the fixed windows of the other families never read them.
    # A window's decode judged implausible is decoded again at `temperature` + this, up to 1.0 (None: never)
    temperature_increment_on_fallback: float | None = 0.2
    compression_ratio_threshold: float | None = 2.4  # above: too repetitive, fall back
    logprob_threshold: float | None = -1.0  # average log-probability below: fall back
    no_speech_threshold: float | None = 0.6  # no-speech probability above, with a log-probability below: silence
    condition_on_previous_text: bool = True  # the previous windows' text prompts the next (<|startofprev|>)
    word_timestamps: bool = False  # each segment's words with their times (a family whose capabilities say so)

    def fallback_temperatures(self) -> tuple[float, ...]:
        """The temperatures a window is decoded at, in turn, until one decode is judged plausible."""
        step = self.temperature_increment_on_fallback
        if not step:
            return (self.temperature,)
        return tuple(float(t) for t in np.arange(self.temperature, 1.0 + 1e-6, step)) or (self.temperature,)

    def __post_init__(self):
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise GenerationError(f"--max-new-tokens {self.max_new_tokens}: must be at least 1")
        if self.min_new_tokens < 0:
            raise GenerationError(f"--min-new-tokens {self.min_new_tokens}: must be >= 0")
        # `not (... )` also refuses NaN, which every comparison calls false (a NaN temperature sampled greedily)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise GenerationError(f"--temperature {self.temperature}: a finite number >= 0 (0: greedy)")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"--top-p {self.top_p}: a number in (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise GenerationError(f"--seed {self.seed}: a whole number from 0 to 2**63 - 1")
        step = self.temperature_increment_on_fallback
        if step is not None and not (math.isfinite(step) and step >= 0):
            raise GenerationError(f"--temperature-increment-on-fallback {step}: a finite number >= 0 (0: no fallback)")


_MIN_TEMPERATURE = 1e-250  # |float32 logit| / this stays finite in float64


class Sampler:
    """Greedy at temperature 0; otherwise temperature + top-p from a seeded generator."""

    def __init__(self, opts: GenerationOptions, device: str):
        self.temperature, self.top_p = opts.temperature, opts.top_p
        self.generator = None
        if opts.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(opts.seed if opts.seed is not None else int.from_bytes(os.urandom(4), "little"))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:  # logits [1, V] -> token [1, 1]
        if self.generator is None:
            return logits.argmax(dim=-1, keepdim=True)
        # float64 and a floor on the temperature: a tiny one (1e-40) overflowed float32 into NaN probabilities;
        # at the floor the distribution is already one-hot on the argmax, the limit as the temperature goes to 0
        probs = torch.softmax(logits.double() / max(self.temperature, _MIN_TEMPERATURE), dim=-1)
        if self.top_p < 1.0:
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < self.top_p  # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p * keep)
        return torch.multinomial(probs, 1, generator=self.generator)


# ---------------------------------------------------------------- prefill


def prefill_compute(e: Engine, segments: list[Segment], inputs) -> tuple[torch.Tensor, list[int]]:
    """The device work of prefill (no host sync: it may be captured); returns the last logits and the decoder
    positions each segment took. One decoder call over the whole prompt, not one per segment: each call streams all
    the decoder's weights, so a 3-segment prompt prefilled piecewise costs two extra weight passes."""
    embeds, lengths = prompt_embeds(e, segments, inputs)
    return e.decode(embeds, torch.arange(0, embeds.shape[1], device=e.device)), lengths


def prompt_embeds(e: Engine, segments: list[Segment], inputs) -> tuple[torch.Tensor, list[int]]:
    """The decoder's input for the prompt [1, S, H] and the positions each segment took. Audio is encoded in place;
    a cross-attending engine keeps it and it takes no positions."""
    parts, lengths, n = [], [], 0
    for seg, x in zip(segments, inputs):
        if isinstance(seg, TextSegment):
            check_fits(e, n, len(seg.ids))  # before embedding: the method refuses long ids
            parts.append(e.embed(x))
        elif isinstance(seg, EncodedAudio):
            check_fits(e, n, x.shape[1])
            parts.append(x)
        else:
            mel = x if seg.window is not None else e.preprocess(x)  # a window's input is already its features
            audio = e.encode(to_encoder_dtype(mel, e.encoder_dtype))
            if e.cross is not None:
                lengths.append(0)
                continue
            parts.append(audio)
            check_fits(e, n, audio.shape[1])
        lengths.append(parts[-1].shape[1])
        n += lengths[-1]
    if not parts:
        raise GenerationError("the prompt has no text for the decoder after its audio")
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1), lengths


def check_fits(e: Engine, pos: int, n: int) -> None:
    if pos + n > e.max_seq_len:
        raise GenerationError(
            f"the prompt needs at least {pos + n} positions, the bundle's context is "
            f"{e.max_seq_len} (--max-seq-len at export)"
        )


# ---------------------------------------------------------------- the runner


class MultimodalRunner:
    """generate() over an Engine and a tokenizer. `audio_id` is the id prompt_ids show at each audio position
    (as HF's input_ids); None for a family whose audio is cross-attended. `synced_prefill`: prefill() returns once
    the device is done with it, so a prefill's time stamp is its end, not when it was queued (bench's timings)."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, audio_id: int | None, synced_prefill: bool = False):
        self.engine, self.tok, self.audio_id = engine, tokenizer, audio_id
        self.synced_prefill = synced_prefill
        # The engine's KV cache is shared by every runner over it (over a Program: its engines'), so its lock is
        # too: a second caller at once gets a clear error, not its steps interleaved with the first's.
        self._busy = engine.state_lock
        self._recordings = RecordingFeatures(engine)  # windows' features, for one generate_windows call

    def _inputs_on_device(self, segments: list[Segment]) -> list[torch.Tensor]:
        e = self.engine
        return inputs_on_device(segments, e.device, e.max_audio_chunks, self._recordings.window, e.pinned)

    def prefill(self, segments: list[Segment]) -> tuple[torch.Tensor, list[int]]:
        """Every segment in order, as one decoder call; returns the last logits and the prompt ids (with the
        audio id at every audio position). The engine may run it all as one CUDA graph."""
        if not segments:
            raise GenerationError("empty prompt: nothing to prefill")
        e = self.engine
        inputs = self._inputs_on_device(segments)
        logits, lengths = e.run_prefill(lambda eng, *xs: prefill_compute(eng, segments, xs), inputs)
        if self.synced_prefill:  # outside run_prefill: a prefill may be captured as a CUDA graph
            torch.cuda.synchronize()
        prompt_ids: list[int] = []
        for seg, n in zip(segments, lengths):
            prompt_ids += list(seg.ids) if isinstance(seg, TextSegment) else [self.audio_id] * n
        return logits, prompt_ids

    def generate(
        self,
        segments: list[Segment],
        opts: GenerationOptions,
        on_text: Callable[[str], None] | None = None,
        stats: Stats | None = None,
    ) -> GenerationResult:
        """One prompt from an empty KV cache. Raises GenerationError if another generate() is running on the same
        program."""
        return self.generate_windows([segments], opts, on_text, stats)

    def generate_windows(
        self,
        windows: list[list[Segment]] | WindowPlan,
        opts: GenerationOptions,
        on_text: Callable[[str], None] | None = None,
        stats: Stats | None = None,
    ) -> GenerationResult:
        """Each window as its own prompt, in order; one result with the text and tokens joined (a space between
        two windows' texts where neither has one, so words never run together; `on_text` streams the same), the
        stats summed into `stats` (the first token's time is the first window's), `windows` giving each one's
        token count and `parts` each one's own text and stats."""
        stats = stats if stats is not None else Stats()
        if isinstance(windows, WindowPlan):
            with self.exclusive():
                return windows.generate(self, opts, on_text, stats)
        if not windows:
            raise GenerationError("empty prompt: nothing to prefill")
        joiner = TextJoiner(on_text)
        with self.exclusive():
            results = []
            for window in windows:
                joiner.next_window()
                s = copy.copy(stats)  # its own numbers, over what the caller recorded before (the model load)
                out = joiner if on_text else None
                results.append(self._generate(window, opts, out, s))
        return join_results(results, stats, self.engine.device, [window_sound(w) for w in windows])

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The program's KV cache for this caller alone (generate_windows, a batched run); a second caller gets a
        GenerationError. The recordings' features computed meanwhile are dropped at the end."""
        if not self._busy.acquire(blocking=False):
            raise GenerationError(
                "runner is busy: another generate() is running on this program (its KV cache is shared state); "
                "use one program and runner per thread"
            )
        try:
            yield
        finally:
            self._recordings.clear()
            self._busy.release()

    def score_windows(self, windows: list[list[Segment]], answers: list[list[int]]) -> list[torch.Tensor]:
        """Teacher forcing: the logits each answer token is chosen from, one [1, V] float32 per token in order, each
        window's prompt and its answer (but the last token) in one decoder call. Needs an engine that `scores`
        every position's logits (the eager reference; a compiled text_decoder gives the last one's): one call
        where stepping costs a decoder pass per token."""
        if len(answers) != len(windows):
            raise GenerationError(f"{len(answers)} answers for {len(windows)} prompt windows")
        e, scored = self.engine, []
        if not e.scores:
            raise GenerationError(f"{type(e).__name__} cannot score an answer: its decoder gives the last logits only")
        with self.exclusive():
            for segments, answer in zip(windows, answers):
                if not answer:
                    continue
                segments = [*segments, TextSegment(tuple(answer[:-1]))] if len(answer) > 1 else list(segments)
                e.reset()
                try:
                    embeds, _ = prompt_embeds(e, segments, self._inputs_on_device(segments))
                    logits = e.score(embeds, torch.arange(embeds.shape[1], device=e.device))
                finally:
                    e.reset()
                scored += logits[-len(answer) :].float().cpu().split(1)
        return scored

    def _generate(self, segments, opts: GenerationOptions, on_text, stats: Stats) -> GenerationResult:
        e = self.engine
        stats.audio_seconds = audio_seconds(segments)
        sampler, stream = Sampler(opts, e.device), StreamDecoder(self.tok)
        tokens: list[int] = []
        recorded: list[torch.Tensor] = []
        e.reset()  # every input starts from an empty KV cache
        stats.inference_start_ms = now_ms()
        try:
            logits, prompt_ids = self.prefill(segments)
            stats.prompt_eval_end_ms = now_ms()
            stats.prompt_tokens = len(prompt_ids)
            stop = "max_new_tokens"
            limit = opts.max_new_tokens or answer_room(stats.audio_seconds)
            pick = _TimedSampler(sampler, opts.record_logits, stats)
            greedy = sampler.generator is None and not opts.record_logits
            advance = greedy_advance(e) if greedy else lambda token, pos: pick(e.decode_token(token, pos))
            for tok_id, chosen_from in token_stream(e, lambda: pick(logits), len(prompt_ids), limit, advance):
                if not tokens:
                    stats.first_token_ms = now_ms()
                    e.check_features()  # the prefill's feature check, on the host once its token is (no extra sync)
                tokens.append(tok_id)
                if chosen_from is not None:
                    recorded.append(chosen_from)
                if tok_id == self.tok.eos_id and len(tokens) > opts.min_new_tokens:
                    stop = "eos"
                    break
                if on_text and tok_id < self.tok.vocab_size:
                    on_text(stream.feed(tok_id))
            else:
                if len(tokens) < limit:
                    stop = "context"
        finally:
            e.reset()
        if on_text:
            on_text(stream.flush())
        return window_result(self.tok, prompt_ids, tokens, stop, stats, recorded, e.device)


def answer_room(audio_seconds: float) -> int:
    """The default cap on new tokens for a prompt with this much audio: a transcript of 10 minutes needs ~2400
    tokens, where a fixed 128 would cut it short; a short file keeps 128."""
    return max(DEFAULT_ANSWER_TOKENS, math.ceil(audio_seconds * ANSWER_TOKENS_PER_SECOND))


class _TimedSampler:
    """The Sampler timed into the stats: the next token [1, 1] on the device from its logits, and the logits if
    recorded (copied now: a graph's logits buffer is overwritten by the next step)."""

    def __init__(self, sampler: Sampler, record: bool, stats: Stats):
        self.sampler, self.record, self.stats = sampler, record, stats

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        t0 = now_ms()
        token = self.sampler(logits)
        kept = logits.to(torch.float32, copy=True) if self.record else None
        self.stats.aggregate_sampling_time_ms += now_ms() - t0
        return token, kept


def token_stream(e: Engine, first, pos: int, limit: int, advance) -> Iterator[tuple[int, torch.Tensor | None]]:
    """Yields (token id, the logits it was chosen from or None). first() gives the first token (from the
    prefill's logits); advance(token, pos) queues the step after `token` at `pos` and gives its token [1, 1].
    After the first token, the next step is queued on the device before the host waits for this one, so the
    host's per-step work (reading ids, streaming text) overlaps the GPU's and the GPU does not idle between steps.
    Launches stop at `limit` tokens or the end of the context; a consumer that stops
    at EOS leaves a queued step behind, which the reset() after it follows on the same stream."""
    queue, n, ahead = deque(), 0, 0  # ahead 0 for the first token: it is the TTFT

    def launch(token: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        nonlocal n
        queue.append((token.to("cpu", non_blocking=True), kept, _recorded_event(e.device)))
        n += 1
        return token

    if limit < 1:
        return
    token = launch(*first())
    while True:
        while len(queue) <= ahead and n < limit and pos < e.max_seq_len:
            token = launch(*advance(token, pos))
            pos += 1
        if not queue:
            return
        host, kept, done = queue.popleft()
        done.synchronize()
        ahead = 1
        yield int(host), kept.cpu() if kept is not None else None


def greedy_advance(e: Engine):
    """token_stream's advance for greedy decoding with nothing recorded: the argmax stays on the device, and no
    logits are copied."""
    return lambda token, pos: (e.decode_token(token, pos).argmax(dim=-1, keepdim=True), None)


class _CpuEvent:
    """What a CUDA event is to token_stream, on the CPU: its work is done when the call that queued it returns."""

    def synchronize(self) -> None:
        pass


def _recorded_event(device: str):
    """An event recorded on the current stream (CUDA), to wait for exactly the work queued so far."""
    if torch.device(device).type != "cuda":
        return _CpuEvent()
    ev = torch.cuda.Event()
    ev.record()
    return ev
