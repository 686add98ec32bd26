"""The library: a bundle loaded once, then audio files, encoded bytes or sample arrays transcribed with it, one at
a time or many through continuous batching, or audio streamed into a realtime bundle as it arrives.

    import runner

    with runner.load("artifacts/voxtral-bundle-tiny-cpu-fp32-torch2.13") as model:
        print(model.transcribe("fixtures/audio/speech.wav").text)

The CLI's verbs are users of the same pieces: the program, engine and runner loaded as `run` loads them
(runner/app/transcriber.py), the inputs made files (runner/app/audio_inputs.py), and a stream's record as `stream`
gives it (runner/app/stream_record.py). A Transcription's `to_dict()` holds what `run --json` (or `stream --json`)
says of the same audio. Nothing here reads the environment: the runtime switches are `load`'s arguments."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runner.app.audio_inputs import Audio, audio_file, mono_samples
from runner.app.stream_record import stream_stats, timed
from runner.app.transcriber import Transcriber, load_program, segments_of
from runner.audio import SAMPLE_RATE
from runner.errors import GenerationError, RunnerError
from runner.families import Capabilities, family_for
from runner.families.voxtral_realtime import StreamSession, program_steps
from runner.families.voxtral_realtime.times import token_times
from runner.runtime.batch import Job, JobResult, generate_many
from runner.runtime.generate import GenerationOptions
from runner.runtime.options import RuntimeOptions
from runner.runtime.results import GenerationResult, Segment, Word

__all__ = ["Delta", "Model", "Stream", "Transcription", "load"]


@dataclass(frozen=True)
class Transcription:
    """One input's transcript: its text, timed segments, tokens and stats; `source` is its path (None for bytes
    or an array) and `index` its place among the inputs given (0 for one)."""

    text: str
    segments: tuple[Segment, ...]
    language: str | None
    tokens: tuple[int, ...]
    stats: dict = field(repr=False)
    source: str | None = None
    index: int = 0

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "index": self.index,
            "text": self.text,
            "language": self.language,
            "tokens": list(self.tokens),
            "segments": [s.to_dict() for s in self.segments],
            "stats": dict(self.stats),
        }


@dataclass(frozen=True)
class Delta:
    """Text a stream decided, with the stream time (seconds from its start) of the audio it was heard in."""

    text: str
    start: float
    end: float


def load(
    bundle: str | os.PathLike,
    *,
    device: str | None = None,
    cuda_graph: bool = True,
    warm_up: bool = True,
    pdl: bool = True,
    encoder_chunks: int = 0,
    prefill_chunk: int = 0,
    rehash: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> Model:
    """Load a bundle (every file's digest checked first) for transcribing; `close()` it, or use it in a `with`."""
    options = RuntimeOptions(
        cuda_graph=cuda_graph,
        warm_up=warm_up,
        pdl=pdl,
        encoder_chunks=encoder_chunks,
        prefill_chunk=prefill_chunk,
        rehash=rehash,
        cache_dir=Path(cache_dir) if cache_dir is not None else None,
    )
    return Model(bundle, options, device)


class Model:
    """A loaded bundle. `transcribe` and `transcribe_many` for the bundles that take whole files, `stream` for
    the realtime ones (capabilities.streaming). One call at a time: the bundle's KV cache is shared state."""

    def __init__(self, bundle: str | os.PathLike, options: RuntimeOptions | None = None, device: str | None = None):
        bundle_dir = Path(bundle)
        self.options = options or RuntimeOptions()
        self.name = bundle_dir.resolve().name  # the model id: its bundle directory's name
        # as `run` loads it (runner/app/transcriber.py): the same load stats, warm-up and engine
        self._program, self._load = load_program(bundle_dir, self.options, device)
        self._closed = False
        try:
            self._set_up(bundle_dir)
        except BaseException:
            self._program.close()
            raise

    def _set_up(self, bundle_dir: Path) -> None:
        program = self._program
        self._family = family_for(bundle_dir, program.manifest.model)
        self._whole: Transcriber | None = None  # a bundle that takes whole inputs
        self._steps = None  # a realtime bundle's streaming steps
        if self.capabilities.streaming:
            self._steps = program_steps(program, self.options, self._family.spec.window)
            return
        self._whole = Transcriber.ready(program, self._family, self.options, self._load)

    @property
    def family(self) -> str:
        return self._family.name

    @property
    def capabilities(self) -> Capabilities:
        return self._family.capabilities

    @property
    def max_batch(self) -> int:
        """How many inputs `transcribe_many` decodes at once at most (the bundle's --max-batch; 1 for a
        streaming bundle, whose streams go one at a time here)."""
        return self._whole.engine.max_batch if self._whole is not None else 1

    @property
    def device(self) -> str:
        return self._program.device

    @property
    def bundle_dir(self) -> Path:
        """The bundle's directory, as `load` was given it."""
        return self._program.bundle_dir

    # ------------------------------------------------ whole inputs

    def transcribe(
        self,
        audio: Audio,
        *,
        sample_rate: int | None = None,
        language: str | None = None,
        prompt: str | None = None,
        temperature: float = 0.0,
        word_timestamps: bool = False,
        max_new_tokens: int | None = None,
        top_p: float = 1.0,
        seed: int | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Transcription:
        """One input's transcript (`prompt`: a question about the audio, where the family takes one). `on_text`
        gets the text as it is generated."""
        opts = self._generation(temperature, top_p, seed, max_new_tokens, word_timestamps)
        with audio_file(audio, sample_rate) as (path, source, label):
            windows = self._prompts(path, label, prompt, language)
        result = self._whole.runner.generate_windows(windows, opts, on_text=on_text, stats=copy.copy(self._load))
        return _transcription(result, language, source, 0)

    def transcribe_many(
        self,
        audios: Iterable[Audio],
        *,
        batch: int | None = None,
        sample_rate: int | None = None,
        language: str | None = None,
        prompt: str | None = None,
        temperature: float = 0.0,
        word_timestamps: bool = False,
        max_new_tokens: int | None = None,
        top_p: float = 1.0,
        seed: int | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Iterator[Transcription]:
        """Each input's transcript as it finishes (in completion order: each says its `index`), `batch` of them
        decoding at once (default: the bundle's max_batch). Inputs are read as they are taken; an input that
        fails raises its error, naming it. `on_text` only at batch 1 (a batch's texts interleave)."""
        opts = self._generation(temperature, top_p, seed, max_new_tokens, word_timestamps)
        batch = self.max_batch if batch is None else batch
        sources: dict[int, str | None] = {}

        def jobs() -> Iterator[Job]:
            for i, audio in enumerate(audios):
                with audio_file(audio, sample_rate, i) as (path, source, label):
                    sources[i] = source
                    yield Job(i, self._prompts(path, label, prompt, language), self._load)

        def results() -> Iterator[Transcription]:
            for done in generate_many(self._whole.runner, jobs(), opts, batch, on_text=on_text):
                i = done.job.key
                if done.error is not None:
                    raise _naming(done.error, sources[i] or f"input {i}")
                yield _transcription(done.result, language, sources[i], i)

        return results()

    def file_results(
        self,
        paths: Iterable[Path],
        generation: GenerationOptions,
        *,
        batch: int | None = None,
        prompt: str | None = None,
        language: str | None = None,
        on_start: Callable[[Path], None] | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Iterator[JobResult]:
        """Audio files as `run` takes them (runner/app/transcriber.py), for the CLI's own workers (`run --ray`):
        any GenerationOptions (temperature fallback, logits kept for a check), each file's JobResult (keyed by its
        path; its GenerationResult, or its error: a file that cannot be read is its result, not a raise) as it
        finishes, `batch` at a time (default: max_batch). A program wants `transcribe_many`."""
        whole = self._transcriber()
        if generation.word_timestamps:
            whole.check_word_timestamps()
        batch = self.max_batch if batch is None else batch
        return whole.file_results(list(paths), generation, batch, prompt, language, on_start, on_text)

    def check_word_timestamps(self) -> None:
        """Raise RunnerError, with the line `run --word-timestamps` gives, unless this bundle gives word times: its
        family must (capabilities.word_timestamps), and its export must have the alignment method."""
        self._transcriber().check_word_timestamps()

    def _transcriber(self) -> Transcriber:
        """The engine and runner of an open bundle that takes whole inputs."""
        self._check_open()
        if self._whole is None:
            raise GenerationError(
                f"{self.name}: a {self.family} bundle transcribes streams: use Model.stream(), not transcribe()"
            )
        return self._whole

    def _generation(self, temperature, top_p, seed, max_new_tokens, word_timestamps) -> GenerationOptions:
        """The options checked as the CLI checks its flags (the same sentences), on a bundle that takes them."""
        whole = self._transcriber()
        opts = GenerationOptions(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            word_timestamps=word_timestamps,
        )
        if word_timestamps:
            whole.check_word_timestamps()
        return opts

    def _prompts(self, path: str, label: str, prompt: str | None, language: str | None) -> list:
        """The family's prompt windows for an audio file; an error about a private temporary file names the input
        it stands for instead."""
        try:
            return self._whole.prompts(path, prompt, language)
        except RunnerError as e:
            if path == label:
                raise
            raise type(e)(str(e).replace(path, label)) from None

    # ------------------------------------------------ streams

    def stream(self, on_delta: Callable[[Delta], None] | None = None) -> Stream:
        """A stream into a realtime bundle: `push` audio as it arrives, then `finish`. One stream at a time."""
        self._check_open()
        if self._steps is None:
            raise GenerationError(
                f"{self.name}: a {self.family} bundle transcribes whole inputs: use Model.transcribe(), not stream()"
            )
        return Stream(self, on_delta)

    # ------------------------------------------------ the model's life

    def _check_open(self) -> None:
        if self._closed:
            raise GenerationError(f"{self.name}: the model is closed; load it again")

    def close(self) -> None:
        """Free the bundle's methods (and their device memory); any call after this raises."""
        if not self._closed:
            self._closed = True
            self._program.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.device
        return f"<runner.Model {self.name} ({self.family}, {state})>"


class Stream:
    """Audio into a realtime bundle as it arrives. `push(pcm)` takes float32 samples at 16 kHz (mono, or
    (n, channels) averaged) or bytes of s16le mono PCM, and gives the text deltas it decided; `finish()` ends the
    stream (its right padding decides the last tokens, whose deltas go to `on_delta` and `deltas`) and gives the
    Transcription: the same tokens and text as `python -m runner stream --json` on the same audio."""

    def __init__(self, model: Model, on_delta: Callable[[Delta], None] | None = None):
        self._model, self._on_delta = model, on_delta
        family = model._family
        self._tok, self._spec = family.tokenizer, family.spec
        self._lock = model._program.state_lock  # the state rows are the model's: one stream (or call) at a time
        if not self._lock.acquire(blocking=False):
            raise GenerationError(f"{model.name}: a stream is already open on this model; finish it first")
        try:
            self._session = StreamSession(model._steps, self._spec)
        except BaseException:
            self._lock.release()
            raise
        self._decoder = family.decoder()
        self._odd = b""  # a byte of an s16 sample split across pushes
        self.deltas: list[Delta] = []  # every delta so far, in order
        self._open = True

    def push(self, pcm: np.ndarray | bytes) -> list[Delta]:
        """Feed audio; the deltas of the tokens it decided (none until the model's delay has passed)."""
        self._check_open()
        samples = self._samples(pcm)
        n = len(self._session.tokens)
        self._session.feed(samples)
        return self._deltas(n)

    def finish(self) -> Transcription:
        """End the stream: the last tokens, then the whole transcript. The stream is closed after."""
        self._check_open()
        n = len(self._session.tokens)
        try:
            self._session.finish()
            self._deltas(n, final=True)
            return self._transcription()
        finally:
            self.close()

    def close(self) -> None:
        """Give the model's stream slot back (finish() does); the stream takes no more audio."""
        if self._open:
            self._open = False
            self._lock.release()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        self._model._check_open()
        if not self._open:
            raise GenerationError("the stream is finished; open another with Model.stream()")

    def _samples(self, pcm: np.ndarray | bytes) -> np.ndarray:
        if isinstance(pcm, bytes | bytearray | memoryview):
            data = self._odd + bytes(pcm)
            cut = len(data) - len(data) % 2
            self._odd = data[cut:]
            return np.frombuffer(data[:cut], dtype="<i2").astype(np.float32) * np.float32(1 / 32768.0)
        if np.asarray(pcm).size == 0:  # nothing arrived yet: nothing to decide
            return np.zeros(0, np.float32)
        return mono_samples(pcm, "pushed audio")

    def _deltas(self, first: int, final: bool = False) -> list[Delta]:
        """The deltas of the tokens from index `first` on (and, at the end, the decoder's held-back bytes)."""
        s = self._session.stream
        times = token_times(self._spec, s.positions[first:])
        out = []
        for token, (start, end) in zip(s.tokens[first:], times):
            text = self._decoder.feed(token) if token < self._tok.vocab_size else ""
            if text:
                out.append(Delta(text, start, end))
        tail = self._decoder.flush() if final else ""
        if tail:
            end = token_times(self._spec, s.positions[-1:])[0][1] if s.positions else 0.0
            out.append(Delta(tail, end, end))
        for d in out:
            self.deltas.append(d)
            if self._on_delta is not None:
                self._on_delta(d)
        return out

    def _transcription(self) -> Transcription:
        """What `stream --json` records of the stream (runner/app/stream_record.py), as a Transcription."""
        s, tok = self._session.stream, self._tok
        text = tok.decode([t for t in s.tokens if t < tok.vocab_size])
        segments = tuple(_segment(r) for r in timed(tok, self._spec, s)["segments"])
        stats = stream_stats(self._session, self._spec, s.received / SAMPLE_RATE)
        return Transcription(text, segments, None, tuple(s.tokens), stats, None, 0)


# ---------------------------------------------------------------- inputs and results


def _naming(error: Exception, source: str) -> Exception:
    """An input's error, naming the input where it does not already."""
    if source in str(error):
        return error
    return type(error)(f"{source}: {error}")


def _transcription(result: GenerationResult, language: str | None, source: str | None, index: int) -> Transcription:
    """A generation's Transcription: the segments `run --json` records (runner/app/transcriber.py's segments_of)."""
    return Transcription(
        text=result.text,
        segments=tuple(segments_of(result)),
        language=language,
        tokens=tuple(result.tokens),
        stats=result.stats.to_dict(),
        source=source,
        index=index,
    )


def _segment(record: dict) -> Segment:
    """A stream's segment record (runner/families/voxtral_realtime/times.py) as a Segment with its Words."""
    words = tuple(Word(w["word"], w["start"], w["end"], w["probability"]) for w in record["words"])
    return Segment(
        record["start"],
        record["end"],
        record["text"],
        tuple(record["tokens"]),
        avg_logprob=record["avg_logprob"],
        no_speech_prob=record["no_speech_prob"],
        temperature=record["temperature"],
        words=words,
    )
