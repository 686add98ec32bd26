"""Many files through one program: `generate_many` takes jobs (one audio file's prompt windows each) and yields
each job's result as it finishes, in completion order.

At batch 1 the jobs run one after another through `MultimodalRunner.generate_windows`. At batch B > 1 (a bundle
exported with `--max-batch`), B sequences are in flight in one batched decode step, each with its own position,
prompt length and stop; when one finishes, the next prompt's prefill takes its slot (continuous batching):

    queue of prompts ──free slot──▶ prefill at batch 1 (the engine's own cache) ──admit──▶ slot's cache
    every step: the active slots' last tokens ──decode_batch──▶ logits [B, V] ──each slot's sampler──▶ tokens

A job's windows run in order (its next window is queued, ahead of new jobs, when its previous one finishes), and
its result joins them as generate_windows does. A new prompt takes the lowest free slot, so the rows a step runs
(up to the highest slot in use) stay few.

Jobs come from a list or iterator (taken as slots free up; the run ends with it) or from a `JobFeed`, whose jobs
arrive over time (a server's requests): while sequences decode, the batcher looks once a step for a job ready now
and goes on decoding when there is none; only with nothing to decode does it wait on the feed, and the run ends when
the feed says it is closed.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from runner.errors import AudioError, GenerationError, TokenizerError
from runner.runtime.engine import NON_FINITE_FEATURES, Engine, to_encoder_dtype
from runner.runtime.generate import GenerationOptions, GenerationResult, MultimodalRunner, Sampler, answer_room
from runner.runtime.prompt import AudioSegment, EncodedAudio, Prompt, audio_seconds, window_sound
from runner.runtime.results import join_results, window_result
from runner.runtime.waveform import wave_on_device
from runner.stats import Stats, now_ms

# a job's own fault: its error record, and the other jobs go on
JOB_ERRORS = (AudioError, GenerationError, TokenizerError)


@dataclass(frozen=True)
class Job:
    key: object  # what the caller knows the job by (its audio path)
    windows: list[Prompt]  # one or more prompts, run in order, joined into one result
    stats: Stats | None = None  # what the caller recorded before (the model load); copied, never mutated
    error: Exception | None = None  # why it has no windows (its input could not be read): its result, at once


@runtime_checkable
class JobFeed(Protocol):
    """Jobs that arrive over time. `take(wait=False)`: a job ready now, or None when none is (the run goes on).
    `take(wait=True)`, asked only when nothing is decoding: blocks until a job is ready; None from it says the feed
    is closed, and the run ends."""

    def take(self, wait: bool) -> Job | None: ...


class _Iterated:
    """A JobFeed over an iterator, which has no "none now": each take waits for its next job, None at its end."""

    def __init__(self, jobs: Iterable[Job]):
        self.jobs, self.ended = iter(jobs), False

    def take(self, wait: bool) -> Job | None:
        job = None if self.ended else next(self.jobs, None)
        self.ended = job is None
        return job


@dataclass(frozen=True)
class JobResult:
    job: Job
    result: GenerationResult | None  # None when the job failed
    error: Exception | None = None


def generate_many(
    runner: MultimodalRunner,
    jobs: Iterable[Job] | JobFeed,
    opts: GenerationOptions,
    batch: int = 1,
    on_text: Callable[[str], None] | None = None,
) -> Iterator[JobResult]:
    """Each job's result as it finishes. A job that fails (bad audio, a prompt over the context) yields its error
    and the others go on. `batch` sequences decode at once (1: one after another, each job's text streamed to
    `on_text` as it is generated; several at once interleave, so a batch has no stream). `jobs` is a list or an
    iterator, or a JobFeed (jobs that arrive while others decode)."""
    if batch < 1:
        raise GenerationError(f"--batch {batch}: must be at least 1")
    feed = jobs if isinstance(jobs, JobFeed) else _Iterated(jobs)
    if batch == 1:
        yield from _serial(runner, feed, opts, on_text)
        return
    if on_text is not None:
        raise GenerationError(f"--batch {batch}: texts are not streamed while several files decode at once")
    slots = runner.engine.max_batch
    if batch > slots:
        exported = f"exported with --max-batch {slots}" if slots > 1 else "exported without --max-batch"
        raise GenerationError(
            f"--batch {batch}: this bundle decodes at most {slots} file{'s' if slots > 1 else ''} at once ({exported}); "
            f"export it with --max-batch {batch} (or more), or run with a smaller --batch"
        )
    with runner.exclusive():
        yield from _Batcher(runner, opts, batch).run(feed)


def _serial(
    runner: MultimodalRunner, feed: JobFeed, opts: GenerationOptions, on_text: Callable[[str], None] | None
) -> Iterator[JobResult]:
    while (job := feed.take(wait=True)) is not None:  # nothing decodes between jobs
        if job.error is not None:
            yield JobResult(job, None, job.error)
            continue
        stats = copy.copy(job.stats) if job.stats is not None else Stats()
        try:
            result = runner.generate_windows(job.windows, opts, on_text=on_text, stats=stats)
        except JOB_ERRORS as e:
            yield JobResult(job, None, e)
            continue
        yield JobResult(job, result)


@dataclass
class _JobProgress:
    """A job in progress: its windows' results so far."""

    job: Job
    results: list[GenerationResult] = field(default_factory=list)

    def stats(self) -> Stats:  # a window's own numbers, over what the caller recorded before (the model load)
        return copy.copy(self.job.stats) if self.job.stats is not None else Stats()


@dataclass
class _Sequence:
    """One prompt window in flight in a slot: its tokens, next position, cap and sampler."""

    progress: _JobProgress
    prompt_ids: list[int]
    stats: Stats
    sampler: Sampler
    limit: int  # max_new_tokens, or the room for the audio's answer
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    stop: str | None = None

    @property
    def pos(self) -> int:
        """Where the last token is decoded: the prompt's positions, then one per token before it."""
        return len(self.prompt_ids) + len(self.tokens) - 1

    def take(self, token: int, eos: int, opts: GenerationOptions, max_seq_len: int, logits=None) -> bool:
        """Append a token; True when the sequence stops (the same tests, in the same order, as generate)."""
        self.tokens.append(token)
        if logits is not None:
            self.logits.append(logits)
        n = len(self.tokens)
        if token == eos and n > opts.min_new_tokens:
            self.stop = "eos"
        elif n >= self.limit:
            self.stop = "max_new_tokens"
        elif self.pos >= max_seq_len:  # no position left to decode the next token at
            self.stop = "context"
        return self.stop is not None


class _Batcher:
    """Continuous batching: prompts queued for free slots, prefilled at batch 1 and admitted, then every slot in
    use decoded in one batched step, each finished sequence's slot taken by the next prompt."""

    def __init__(self, runner: MultimodalRunner, opts: GenerationOptions, batch: int):
        self.runner, self.opts = runner, opts
        self.e: Engine = runner.engine
        self.slots: list[_Sequence | None] = [None] * batch
        self.queue: deque[tuple[_JobProgress, int]] = deque()  # (job, window index) ready to prefill
        self.done: list[JobResult] = []

    def run(self, feed: JobFeed) -> Iterator[JobResult]:
        while self._pull(feed):
            self._admit_queued()
            yield from self._drain()
            if any(self.slots):
                self._step()
                yield from self._drain()

    def _pull(self, feed: JobFeed) -> bool:
        """Jobs from the feed queued for the free slots. The batcher waits on the feed only when it has nothing
        else to do (no sequence in flight, none queued, no result to hand back); else it takes what is ready now.
        False when the feed is closed and nothing is left: the run is over."""
        while len(self.queue) < self.slots.count(None):
            idle = not any(self.slots) and not self.queue and not self.done
            job = feed.take(wait=idle)
            if job is None:
                return not idle
            if job.error is not None or not job.windows:
                self.done.append(JobResult(job, None, job.error or GenerationError("empty prompt: nothing to prefill")))
            else:
                self.queue.append((_JobProgress(job), 0))
        return True

    def _admit_queued(self) -> None:
        """The queued prompts into the free slots, their audio through the encoder together."""
        free = self.slots.count(None)
        admitting = [self.queue.popleft() for _ in range(min(free, len(self.queue)))]
        start = now_ms()  # each one's TTFT counts the shared encoder call
        for (progress, _), window in zip(admitting, self._encode([w.job.windows[i] for w, i in admitting])):
            self._admit(progress, window, start)

    def _drain(self) -> Iterator[JobResult]:
        while self.done:
            yield self.done.pop(0)

    def _encode(self, windows: list[Prompt]) -> list[Prompt | Exception]:
        """The prompts about to take free slots with their audio through the encoder together: each file's
        features on their own (one log-mel per recording, as the serial path computes them), then the chunks of
        all of them in as few encoder calls as `max_audio_chunks` allows (a chunk is encoded on its own, so the
        split does not change it). Each prompt comes back with its audio as EncodedAudio, or its own error."""
        e = self.e
        out: list[Prompt | Exception] = list(windows)
        mels: list[tuple[int, int, torch.Tensor, int]] = []  # (prompt, segment, mel [k, n_mels, 3000], samples)
        for i, window in enumerate(windows):
            try:
                for j, seg in enumerate(window):
                    if isinstance(seg, AudioSegment) and seg.window is None:
                        wave = wave_on_device(seg.samples, e.max_audio_chunks, e.device, e.pinned)
                        mel = e.preprocess(wave)
                        if not bool(torch.isfinite(mel).all()):  # this file's fault, found before its prefill
                            raise AudioError(NON_FINITE_FEATURES)
                        mels.append((i, j, mel, seg.num_samples))
            except JOB_ERRORS as err:
                out[i] = err
        mels = [m for m in mels if not isinstance(out[m[0]], Exception)]
        if not mels:
            return out
        chunks = torch.cat([m[2] for m in mels])
        embeds = torch.cat(
            [
                e.encode(to_encoder_dtype(chunks[c : c + e.max_audio_chunks], e.encoder_dtype))
                for c in range(0, len(chunks), e.max_audio_chunks)
            ],
            dim=1,
        )  # [1, all chunks * tokens per chunk, H]
        per_chunk = embeds.shape[1] // len(chunks)
        at = 0
        for i, j, mel, samples in mels:
            n = len(mel) * per_chunk
            window = list(out[i])
            window[j] = EncodedAudio(embeds[:, at : at + n], samples)
            out[i] = window
            at += n
        return out

    def _admit(self, progress: _JobProgress, window: Prompt | Exception, start: float) -> None:
        """Prefill one window of the job at batch 1 (its audio already encoded) and take its first token; a
        sequence not done at once moves into the lowest free slot."""
        e, opts = self.e, self.opts
        if isinstance(window, Exception):
            self.done.append(JobResult(progress.job, None, window))
            return
        stats = progress.stats()
        stats.audio_seconds = audio_seconds(window)
        e.reset()  # the prefill's cache starts empty; the slots keep the sequences in flight
        stats.inference_start_ms = start  # TTFT is measured from here: the job's own encoder call
        try:
            logits, prompt_ids = self.runner.prefill(window)
            stats.prompt_eval_end_ms = now_ms()
            stats.prompt_tokens = len(prompt_ids)
            seq = _Sequence(
                progress,
                prompt_ids,
                stats,
                Sampler(opts, e.device),
                opts.max_new_tokens or answer_room(stats.audio_seconds),
            )
            t0 = now_ms()
            token = int(seq.sampler(logits))
            stats.aggregate_sampling_time_ms += now_ms() - t0
            stats.first_token_ms = now_ms()
            e.check_features()  # audio the prefill encoded itself (encoded audio was checked in _encode)
        except JOB_ERRORS as err:
            self.done.append(JobResult(progress.job, None, err))
            return
        kept = logits.to(torch.float32, copy=True).cpu() if opts.record_logits else None
        if seq.take(token, self.runner.tok.eos_id, opts, e.max_seq_len, kept):
            self._finish(seq)
            return
        slot = self.slots.index(None)
        e.admit(slot, len(prompt_ids))
        self.slots[slot] = seq

    def _step(self) -> None:
        """One batched decode step of every slot up to the highest in use (free ones below it decode a dummy)."""
        e, opts = self.e, self.opts
        n = max(i for i, s in enumerate(self.slots) if s is not None) + 1
        active = self.slots[:n]
        tokens = torch.tensor([[s.tokens[-1] if s else 0] for s in active], dtype=torch.int64).to(e.device)
        # a free slot below the highest in use decodes position 0: cheap to attend to, rewritten when it is taken
        pos = torch.tensor([s.pos if s else 0 for s in active], dtype=torch.int64).to(e.device)
        logits = e.decode_batch(tokens, pos)  # [n, V]
        t0 = now_ms()
        if all(s is None or s.sampler.generator is None for s in active):
            picked = logits.argmax(dim=-1).tolist()  # one copy to the host for every row
        else:
            picked = [int(s.sampler(logits[i : i + 1])) if s else 0 for i, s in enumerate(active)]
        kept = logits.to(torch.float32, copy=True).cpu() if opts.record_logits else None
        dt = (now_ms() - t0) / sum(s is not None for s in active)
        for i, s in enumerate(active):
            if s is None:
                continue
            s.stats.aggregate_sampling_time_ms += dt
            if s.take(
                picked[i], self.runner.tok.eos_id, opts, e.max_seq_len, None if kept is None else kept[i : i + 1]
            ):
                self.slots[i] = None
                self._finish(s)

    def _finish(self, seq: _Sequence) -> None:
        """A window is done: its result; the job's next window queued first, or the job's joined result."""
        progress = seq.progress
        r = window_result(self.runner.tok, seq.prompt_ids, seq.tokens, seq.stop, seq.stats, seq.logits, self.e.device)
        progress.results.append(r)
        if len(progress.results) < len(progress.job.windows):
            self.queue.appendleft((progress, len(progress.results)))
            return
        sound = [window_sound(w) for w in progress.job.windows]
        joined = join_results(progress.results, progress.stats(), self.e.device, sound)
        self.done.append(JobResult(progress.job, joined))
