"""The library: a bundle loaded once, then audio files, encoded bytes or sample arrays transcribed with it, one at
a time or many through continuous batching, or audio streamed into a realtime bundle as it arrives.

    import runner

    with runner.load("artifacts/voxtral-tiny") as model:
        print(model.transcribe("fixtures/audio/speech.wav").text)

The same program, engine and runner the CLI puts together (runner/app/run.py, runner/app/stream.py), and the same
records: a Transcription's `to_dict()` holds what `run --json` (or `stream --json`) says of the same audio. Nothing
here reads the environment: the runtime switches are `load`'s arguments."""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runner.app.report import segments_of
from runner.app.run import _warm_up, check_word_timestamps
from runner.app.stream import stream_stats
from runner.audio import MAX_RATE, MIN_RATE, SAMPLE_RATE, _to_mono
from runner.bundle import read_manifest
from runner.errors import AudioError, GenerationError, RunnerError
from runner.families import Capabilities, family_for
from runner.families.voxtral_realtime import StreamSession, program_steps
from runner.families.voxtral_realtime.times import segments_of as stream_segments
from runner.families.voxtral_realtime.times import token_times
from runner.runtime.batch import Job, generate_many
from runner.runtime.engine import ProgramEngine
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.options import RuntimeOptions
from runner.runtime.program import Program
from runner.runtime.results import GenerationResult, Segment, Word
from runner.stats import Stats, now_ms

__all__ = ["Delta", "Model", "Stream", "Transcription", "load"]

# What `audio` may be: a file's path, a file's bytes (any container load_audio reads), or float samples
Audio = str | os.PathLike | bytes | np.ndarray
MAX_CHANNELS = 64  # an array (n, channels) wider than this is taken to be channels-first: refused, not averaged


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
        cuda = (device or read_manifest(bundle_dir).device) == "cuda"  # no CUDA context for a CPU bundle
        self._load = Stats(model_load_start_ms=now_ms())
        if cuda:
            self._load.record_gpu_memory("before_load")
        self._program = Program.load(bundle_dir, device=device, options=self.options)
        if cuda:
            self._load.record_gpu_memory("after_load")
        self._closed = False
        try:
            self._set_up(bundle_dir)
        except BaseException:
            self._program.close()
            raise

    def _set_up(self, bundle_dir: Path) -> None:
        program, load = self._program, self._load
        load.model_load_end_ms = now_ms()
        self._family = family_for(bundle_dir, program.manifest.model)
        self._engine: ProgramEngine | None = None
        self._steps = None
        if self.capabilities.streaming:
            self._steps = program_steps(program, self.options, self._family.spec.window)
            return
        self._engine = ProgramEngine(program, self.options, cross_attention=self._family.cross_attention)
        _warm_up(self._engine, self.options, load)
        self._runner = MultimodalRunner(self._engine, self._family.tokenizer, self._family.audio_id)

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
        return self._engine.max_batch if self._engine is not None else 1

    @property
    def device(self) -> str:
        return self._program.device

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
        with _audio_file(audio, sample_rate) as (path, source, label):
            windows = self._prompts(path, label, prompt, language)
        result = self._runner.generate_windows(windows, opts, on_text=on_text, stats=copy.copy(self._load))
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
                with _audio_file(audio, sample_rate, i) as (path, source, label):
                    sources[i] = source
                    yield Job(i, self._prompts(path, label, prompt, language), self._load)

        def results() -> Iterator[Transcription]:
            for done in generate_many(self._runner, jobs(), opts, batch, on_text=on_text):
                i = done.job.key
                if done.error is not None:
                    raise _naming(done.error, sources[i] or f"input {i}")
                yield _transcription(done.result, language, sources[i], i)

        return results()

    def _generation(self, temperature, top_p, seed, max_new_tokens, word_timestamps) -> GenerationOptions:
        """The options checked as the CLI checks its flags (the same sentences), on a bundle that takes them."""
        self._check_open()
        if self._engine is None:
            raise GenerationError(
                f"{self.name}: a {self.family} bundle transcribes streams: use Model.stream(), not transcribe()"
            )
        opts = GenerationOptions(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            word_timestamps=word_timestamps,
        )
        if word_timestamps:
            check_word_timestamps(self._program, self._family, self._engine)
        return opts

    def _prompts(self, path: str, label: str, prompt: str | None, language: str | None) -> list:
        """The family's prompt windows for an audio file; an error about a private temporary file names the input
        it stands for instead."""
        try:
            return self._family.prompts(path, prompt, language, self._engine.max_audio_chunks)
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
        return _mono(_float_frames(pcm, "pushed audio"), "pushed audio")

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
        """What `stream --json` records of the stream (runner/app/stream.py), as a Transcription."""
        s, tok = self._session.stream, self._tok
        text = tok.decode([t for t in s.tokens if t < tok.vocab_size])
        times = token_times(self._spec, s.positions)
        segments = tuple(_segment(r) for r in stream_segments(tok, s.tokens, times))
        stats = stream_stats(self._session, self._spec, s.received / SAMPLE_RATE)
        return Transcription(text, segments, None, tuple(s.tokens), stats, None, 0)


# ---------------------------------------------------------------- inputs


@contextlib.contextmanager
def _audio_file(audio: Audio, sample_rate: int | None, index: int | None = None) -> Iterator[tuple[str, Any, str]]:
    """(a file load_audio reads, the input's source, the name errors give it) for any input: a path as it is;
    bytes, or an array's 16 kHz mono samples as float32 WAV, in a private temporary file removed after."""
    which = "" if index is None else f" {index}"
    if isinstance(audio, str | os.PathLike):
        if sample_rate is not None:
            raise AudioError(f"sample_rate={sample_rate}: only for a sample array; a file says its own rate")
        path = os.fspath(audio)
        yield path, path, path
        return
    if isinstance(audio, bytes | bytearray | memoryview):
        if sample_rate is not None:
            raise AudioError(f"sample_rate={sample_rate}: only for a sample array; encoded bytes say their own rate")
        with _temporary(lambda f: f.write(bytes(audio))) as path:
            yield path, None, f"<bytes{which}>"
        return
    if isinstance(audio, np.ndarray):
        samples = _array_samples(audio, sample_rate, f"<array{which}>")
        with _temporary(lambda f: _write_wav(f, samples)) as path:
            yield path, None, f"<array{which}>"
        return
    raise AudioError(f"audio: a path, bytes of an audio file or a float32 sample array, not {type(audio).__name__}")


@contextlib.contextmanager
def _temporary(write: Callable) -> Iterator[str]:
    """A file only this user can read (mkstemp), written by `write(file)`, removed however the block ends."""
    fd, path = tempfile.mkstemp(prefix="runner-audio-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        yield path
    finally:
        os.unlink(path)


def _write_wav(f, samples: np.ndarray) -> None:
    """Float32 WAV: load_audio reads back exactly these samples (16 kHz mono: nothing to mix or resample)."""
    import soundfile as sf

    sf.write(f, samples, SAMPLE_RATE, format="WAV", subtype="FLOAT")


def _array_samples(audio: np.ndarray, sample_rate: int | None, label: str) -> np.ndarray:
    """An array's samples as load_audio gives a file's: float32 mono at 16 kHz (channels averaged, resampled
    with soxr), non-finite samples refused."""
    if sample_rate is None:
        raise AudioError(f"{label}: a sample array needs its sample_rate (e.g. sample_rate=16000)")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int | np.integer):
        raise AudioError(f"{label}: sample_rate={sample_rate!r}: a whole number of Hz")
    if not MIN_RATE <= sample_rate <= MAX_RATE:
        raise AudioError(f"{label}: unsupported sample rate {sample_rate} Hz (expected {MIN_RATE} to {MAX_RATE} Hz)")
    return _mono(_float_frames(audio, label), label, int(sample_rate))


def _float_frames(audio: Any, label: str) -> np.ndarray:
    """[frames, channels] float32 from a float array of (n,) or (n, channels); NaN and Inf refused."""
    a = np.asarray(audio)
    if a.dtype.kind != "f":
        raise AudioError(f"{label}: samples must be floats in [-1, 1] (float32), not {a.dtype}")
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2 or a.shape[1] > MAX_CHANNELS:
        raise AudioError(f"{label}: samples of shape {a.shape}; give (n,) mono or (n, channels), channels last")
    if len(a) == 0:
        raise AudioError(f"{label}: no samples")
    if not np.isfinite(a).all():
        raise AudioError(f"{label}: contains NaN or Inf samples")
    return a.astype(np.float32, copy=False)


def _mono(frames: np.ndarray, label: str, rate: int = SAMPLE_RATE) -> np.ndarray:
    """What load_audio does with a file's frames (runner/audio.py): the mix, the resampling and their checks."""
    return _to_mono(label, frames, rate)


def _naming(error: Exception, source: str) -> Exception:
    """An input's error, naming the input where it does not already."""
    if source in str(error):
        return error
    return type(error)(f"{source}: {error}")


# ---------------------------------------------------------------- results


def _transcription(result: GenerationResult, language: str | None, source: str | None, index: int) -> Transcription:
    """A generation's Transcription: the segments `run --json` records (runner/app/report.py's segments_of)."""
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
