"""The library: a bundle loaded once, then audio files, encoded bytes or sample arrays transcribed with it, one at
a time or many through continuous batching (a list, or inputs that arrive over time: `transcribe_feed`), or audio
streamed into a realtime bundle as it arrives.

    import runner

    with runner.load("artifacts/voxtral-bundle-tiny-cpu-fp32-torch2.13") as model:
        print(model.transcribe("fixtures/audio/speech.wav").text)

The CLI's verbs are users of the same pieces: the program, engine and runner loaded as `run` loads them
(runner/app/transcriber.py), the inputs made files (runner/app/audio_inputs.py), the streams over the bundle's
stream slots (runner/app/streams.py) and a stream's record as `stream` gives it (runner/app/stream_record.py). A
Transcription's `to_dict()` holds what `run --json` (or `stream --json`) says of the same audio. Nothing here reads
the environment: the runtime switches are `load`'s arguments."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from runner.app.audio_inputs import Audio, audio_file
from runner.app.streams import Stream, StreamSlots, stream_many
from runner.app.transcriber import Transcriber, load_program, segments_of
from runner.app.transcription import Delta, Transcription
from runner.errors import GenerationError, RunnerError
from runner.families import Capabilities, Family, family_for
from runner.families.voxtral_realtime import program_steps
from runner.runtime.batch import Job, JobResult, generate_many
from runner.runtime.generate import GenerationOptions
from runner.runtime.options import RuntimeOptions
from runner.runtime.program import Program
from runner.runtime.results import GenerationResult
from runner.stats import Stats

__all__ = ["Delta", "Model", "Stream", "StreamSlots", "Transcription", "load"]


class AudioFeed(Protocol):
    """Inputs that arrive over time (a server's requests), for `Model.transcribe_feed`: `take(wait=False)` is the
    next (index, audio) ready now, or None when none is (the batch goes on decoding); `take(wait=True)` is asked
    only when nothing is decoding: it blocks until an input is ready, and None from it says no more will come."""

    def take(self, wait: bool) -> tuple[int, Audio] | None: ...


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
    """A loaded bundle. `transcribe`, `transcribe_many` and `transcribe_feed` for the bundles that take whole
    files, `stream`, `stream_slots` and `stream_many` for the realtime ones (capabilities.streaming). One call at
    a time: the bundle's KV cache is shared state."""

    def __init__(self, bundle: str | os.PathLike, options: RuntimeOptions | None = None, device: str | None = None):
        options = options or RuntimeOptions()
        # as `run` loads it (runner/app/transcriber.py): the same load stats, warm-up and engine
        program, load = load_program(Path(bundle), options, device)
        self._adopt(program, load, options, None)

    @classmethod
    def of_program(cls, program: Program, load: Stats, options: RuntimeOptions, family: Family | None = None) -> Model:
        """A Model over a program already loaded with load_program (its `family`, where the caller has it): for the
        CLI's `stream`, which refuses a bundle of another family before any set-up. The Model closes the program."""
        model = cls.__new__(cls)
        model._adopt(program, load, options, family)
        return model

    def _adopt(self, program: Program, load: Stats, options: RuntimeOptions, family: Family | None) -> None:
        self.options, self._program, self._load, self._closed = options, program, load, False
        self.name = program.bundle_dir.resolve().name  # the model id: its bundle directory's name
        try:
            self._set_up(family or family_for(program.bundle_dir, program.manifest.model))
        except BaseException:
            program.close()
            raise

    def _set_up(self, family: Family) -> None:
        program = self._program
        self._family = family
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
        streaming bundle, whose streams `max_streams` counts)."""
        return self._whole.engine.max_batch if self._whole is not None else 1

    @property
    def max_streams(self) -> int:
        """How many streams `stream_slots()` holds at once (the bundle's --max-streams; 0 for a bundle that
        takes whole inputs)."""
        return self._steps.streams if self._steps is not None else 0

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
                yield self._job(i, audio, sample_rate, prompt, language, sources, which=i)

        def results() -> Iterator[Transcription]:
            for done in generate_many(self._whole.runner, jobs(), opts, batch, on_text=on_text):
                i = done.job.key
                if done.error is not None:
                    raise _naming(done.error, sources[i] or f"input {i}")
                yield _transcription(done.result, language, sources[i], i)

        return results()

    def transcribe_feed(
        self,
        feed: AudioFeed,
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
    ) -> Iterator[tuple[int, Transcription | RunnerError]]:
        """Inputs as they arrive, through one continuous batch: each joins a free slot while the others decode
        (`batch` at once, default max_batch). Yields (index, its Transcription) as each finishes, or (index, its
        error, as `transcribe` raises it): a bad input answers alone and the others go on. Ends when the feed
        says no more will come."""
        opts = self._generation(temperature, top_p, seed, max_new_tokens, word_timestamps)
        batch = self.max_batch if batch is None else batch
        jobs = _FeedJobs(self, feed, sample_rate, prompt, language)

        def results() -> Iterator[tuple[int, Transcription | RunnerError]]:
            for done in generate_many(self._whole.runner, jobs, opts, batch):
                i = done.job.key
                source = jobs.sources.pop(i, None)
                yield i, done.error if done.error is not None else _transcription(done.result, language, source, i)

        return results()

    def _job(self, i: int, audio: Audio, sample_rate, prompt, language, sources: dict, which: int | None) -> Job:
        """One input's job: its prompt windows (its audio read now, from a private temporary file where it is
        bytes or samples); `sources[i]` says where it came from. Errors name bytes or samples `<bytes WHICH>`
        (`<bytes>` for None, as `transcribe` names them)."""
        with audio_file(audio, sample_rate, which) as (path, source, name):
            sources[i] = source
            return Job(i, self._prompts(path, name, prompt, language), self._load)

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
        """A stream into a realtime bundle: `push` audio as it arrives, then `finish`. It holds the model's
        streams while open (for several at once: stream_slots())."""
        slots = self.stream_slots()
        try:
            return Stream(slots, on_delta, own=True)
        except BaseException:
            slots.close()
            raise

    def stream_slots(self) -> StreamSlots:
        """The bundle's `max_streams` stream slots, to stream several at once (runner/app/streams.py): `open()` a
        Stream in each, and push into any. They hold the model's streams until closed (use them in a `with`)."""
        return StreamSlots(self)

    def stream_many(
        self,
        sources: Iterable[Iterable[np.ndarray | bytes]],
        *,
        on_delta: Callable[[int, Delta], None] | None = None,
    ) -> Iterator[tuple[Transcription, Exception | None]]:
        """Sources of audio blocks (each an iterable of what Stream.push takes: a file read in blocks, a pipe's
        reads), streamed at once in the bundle's slots, fed in lockstep (one block of each, then the steps they
        make possible), as `python -m runner stream` streams its --audio. Yields (Transcription, None) as each
        stream ends, its `index` its source's place; or (what it decided, the error) where reading its source
        raised a RunnerError or OSError: that stream stops there, the others go on. `on_delta(index, delta)` as
        each stream's text is decided. The slots are the model's until the last stream ends."""
        return stream_many(self, sources, on_delta)

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


# ---------------------------------------------------------------- inputs and results


class _FeedJobs:
    """The runtime's JobFeed over an AudioFeed: each input made a job as it is taken; one that cannot be read is a
    job carrying its error (its answer, at once), so the feed goes on."""

    def __init__(self, model: Model, feed: AudioFeed, sample_rate, prompt, language):
        self.model, self.feed, self.args = model, feed, (sample_rate, prompt, language)
        self.sources: dict[int, str | None] = {}

    def take(self, wait: bool) -> Job | None:
        item = self.feed.take(wait)
        if item is None:
            return None
        i, audio = item
        try:
            return self.model._job(i, audio, *self.args, self.sources, which=None)
        except RunnerError as e:
            return Job(i, [], error=e)


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
