"""Streams over the three step methods: each stream's samples, position and tokens on the host (`Stream`), and
the batched step loop that runs every stream of a `StreamBatch` in one call of each method, stream i in state
row i (`Steps`: exported, graphed or eager, all batched).

What a stream feeds, as transformers' VoxtralRealtimeProcessor and mistral-common's streaming request:
    audio   n_left_pad_tokens x 1280 zeros, the stream, then (at the end) zeros up to a whole position plus
            n_right_pad_tokens positions; STFT frames are centred (frame k's centre is sample 160 k)
    tokens  <s> [STREAMING_PAD] x (n_left_pad_tokens + delay) as the prompt, one per position, then each
            greedy token feeds the next position. Positions 0 .. T-2 are decoded for T positions of padded audio
            (transformers' generate stops at T), or until </s>.
A stream keeps only the samples its next step needs, so a stream of any length runs in bounded memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from runner.audio import HOP_LENGTH, N_FFT
from runner.errors import GenerationError


class Steps:
    """The three methods over a batch of B streams (B <= streams; row b is state row b): exported, graphed or
    eager. A subclass gives the methods; `step` and `batch_for` are those of steps run method by method."""

    device: str
    streams: int  # state rows

    def preprocess(self, wave: torch.Tensor) -> torch.Tensor:  # [B, 1520] f32 -> [B, n_mels, 8] f32
        raise NotImplementedError

    def encode(self, mel: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # pos [B] -> [B, 1, dim]
        raise NotImplementedError

    def decode(self, token, audio, pos, delay) -> torch.Tensor:  # [B, 1], [B, 1, dim], [B], [B] -> [B, V] f32
        raise NotImplementedError

    def reset(self, rows: list[int] | None = None) -> None:  # zero the state of these rows (None: all)
        raise NotImplementedError

    def held_state(self) -> list[torch.Tensor]:
        """The state buffers a step rewrites whole in every row of its batch ([streams, ...] each): what a row
        stepped without its audio (StreamBatch's held rows) must get back. The rest of the state is written only
        at the step's own position, which that row's real step at the same position writes again before it
        reads it."""
        raise NotImplementedError

    def step(self, wave, pos, token, delay) -> torch.Tensor:
        """One position of every row: the greedy next token [B] int64 (on the device), the three methods in
        turn (GraphSteps replays the whole step as CUDA graphs)."""
        return self.decode(token, self.encode(self.preprocess(wave), pos), pos, delay).argmax(dim=-1)

    def batch_for(self, rows: int) -> int:
        """The batch a step of `rows` rows runs at (graphed steps round up to a captured size; the rest are free
        rows, whose state is cleared when a stream takes them)."""
        return rows


@dataclass(frozen=True)
class StreamSpec:
    """A bundle's streaming constants (manifest `model`)."""

    mel_frames_per_token: int  # 8
    n_left_pad_tokens: int
    n_right_pad_tokens: int
    num_delay_tokens: int
    bos_id: int
    eos_id: int
    pad_id: int  # [STREAMING_PAD]

    @property
    def samples_per_token(self) -> int:
        return self.mel_frames_per_token * HOP_LENGTH

    @property
    def window(self) -> int:  # the samples one step's frames span: 1520
        return (self.mel_frames_per_token - 1) * HOP_LENGTH + N_FFT

    @property
    def prompt(self) -> tuple[int, ...]:
        return (self.bos_id,) + (self.pad_id,) * (self.n_left_pad_tokens + self.num_delay_tokens)

    @classmethod
    def from_model(cls, model: dict) -> StreamSpec:
        s = model["special_tokens"]
        return cls(
            model["mel_frames_per_token"],
            model["n_left_pad_tokens"],
            model["n_right_pad_tokens"],
            model["num_delay_tokens"],
            s["bos"],
            s["eos"],
            s["streaming_pad"],
        )


@dataclass
class StepTimes:
    """Per position: compute time of the (batched) step, and how long after the audio it needed had arrived
    its token was decided (perf_counter based, ms)."""

    compute_ms: list[float] = field(default_factory=list)
    lag_ms: list[float] = field(default_factory=list)


class Stream:
    """One stream's host side: feed(samples) as they arrive, then finish(). A StreamBatch runs its positions;
    tokens as they are decided go to `on_token`. `stop_at_eos=False` runs to the end of the audio whatever the
    model says (benchmarks on random weights)."""

    def __init__(self, spec: StreamSpec, on_token: Callable[[int], None] | None = None, stop_at_eos: bool = True):
        self.spec, self.on_token, self.stop_at_eos = spec, on_token, stop_at_eos
        self.tokens: list[int] = []
        self.positions: list[int] = []  # the position each token was decided at: its audio's time (times.py)
        self.times = StepTimes()
        self.received = 0  # samples of the stream itself
        self.position = 0  # the next position to run
        self.limit: int | None = None  # positions to run, once finish() knows the length
        self.done = False  # </s> decided, or every position run
        # Buffer coordinates: index 0 is 200 samples before the padded audio (the STFT's centre padding, zeros
        # as transformers' reflection of the zero left padding gives); `_base` is the coordinate of _buf[0].
        self._buf = np.zeros(N_FFT // 2 + spec.n_left_pad_tokens * spec.samples_per_token, dtype=np.float32)
        self._base = 0
        self.arrived = time.perf_counter()

    def feed(self, samples: np.ndarray) -> None:
        """Append mono 16 kHz float32 samples."""
        if self.done or self.limit is not None:
            return
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        self.received += len(samples)
        self._buf = np.concatenate([self._buf, samples])
        self.arrived = time.perf_counter()

    def finish(self) -> None:
        """End of stream: pad as mistral-common pads a whole file; the positions left are then known."""
        if self.done or self.limit is not None:
            return
        spt = self.spec.samples_per_token
        tail = (-self.received) % spt + self.spec.n_right_pad_tokens * spt
        self._buf = np.concatenate([self._buf, np.zeros(tail + N_FFT // 2, dtype=np.float32)])
        self.arrived = time.perf_counter()
        self.limit = self.spec.n_left_pad_tokens + (self.received + tail) // self.spec.samples_per_token - 1
        self.done = self.position >= self.limit

    def ready(self) -> bool:
        """Whether the next position's audio is all here."""
        start = self.position * self.spec.samples_per_token - self._base
        return not self.done and start + self.spec.window <= len(self._buf)

    def window(self) -> np.ndarray:
        start = self.position * self.spec.samples_per_token - self._base
        return self._buf[start : start + self.spec.window]

    def previous_token(self) -> int:
        prompt = self.spec.prompt
        p = self.position
        return prompt[p] if p < len(prompt) else self.tokens[p - len(prompt)]

    def accept(self, token: int, compute_ms: float, decided: float) -> None:
        """The step at this position ran: its token counts from the prompt's last position on."""
        self.times.compute_ms.append(compute_ms)
        if self.position >= len(self.spec.prompt) - 1:  # inside the prompt the next token is given
            self.times.lag_ms.append((decided - self.arrived) * 1e3)
            self.tokens.append(token)
            self.positions.append(self.position)
            if self.on_token is not None:
                self.on_token(token)
            if token == self.spec.eos_id and self.stop_at_eos:
                self.done = True
        self.position += 1
        if self.limit is not None and self.position >= self.limit:
            self.done = True
        drop = self.position * self.spec.samples_per_token - self._base  # what no later step reads
        if drop > 0:
            self._buf, self._base = self._buf[drop:], self._base + drop


class StreamBatch:
    """Streams in the state rows of one Steps, stepped together, for the rows up to the last one taken. A step
    runs when every stream in a row has its next position's audio (streams fed in lockstep, as `stream` feeds its
    files, step together), or, with `hold_idle`, as soon as one has (streams fed as their audio arrives, as the
    server's): every row of a batch runs, so a stream whose audio has not arrived runs at its own next position on
    zeros, its token dropped and its Steps.held_state put back after; it is then where it was, and stalls nobody.
    A stream that is done leaves its row."""

    def __init__(self, steps: Steps, spec: StreamSpec, hold_idle: bool = False):
        self.steps, self.spec, self.hold_idle = steps, spec, hold_idle
        self.rows: list[Stream | None] = [None] * steps.streams
        self._delay = float(spec.num_delay_tokens)

    def add(self, stream: Stream) -> int:
        """Put a stream in the first free row (its state cleared); GenerationError when every row is taken."""
        self._leave_done()
        row = next((i for i, s in enumerate(self.rows) if s is None), None)
        if row is None:
            raise GenerationError(f"all {len(self.rows)} stream slots of the bundle are taken (export --max-streams)")
        self.steps.reset([row])
        self.rows[row] = stream
        return row

    def free(self) -> int:
        """How many rows are free (a done stream's row is)."""
        return len(self.rows) - len(self.live)

    def _leave_done(self) -> None:
        self.rows = [None if s is not None and s.done else s for s in self.rows]

    @property
    def live(self) -> list[tuple[int, Stream]]:
        """The streams in a row that still have positions to run (a done one leaves its row here)."""
        self._leave_done()
        return [(r, s) for r, s in enumerate(self.rows) if s is not None]

    def step(self) -> bool:
        """One batched position, if every stream in a row is ready (with hold_idle: if one is); whether it ran."""
        live = self.live
        idle = [r for r, s in live if not s.ready()]
        if len(idle) == len(live) or (idle and not self.hold_idle):
            return False
        b = self.steps.batch_for(live[-1][0] + 1)
        dev = self.steps.device
        wave = np.zeros((b, self.spec.window), dtype=np.float32)
        pos = np.zeros(b, dtype=np.int64)
        prev = np.zeros((b, 1), dtype=np.int64)
        for r, s in live:
            pos[r], prev[r, 0] = s.position, s.previous_token()
            if r not in idle:
                wave[r] = s.window()
        held = [(t, t[idle].clone()) for t in self.steps.held_state()] if idle else []
        t0 = time.perf_counter()
        tokens = self.steps.step(
            torch.from_numpy(wave).to(dev),
            torch.from_numpy(pos).to(dev),
            torch.from_numpy(prev).to(dev),
            torch.full((b,), self._delay, device=dev),
        ).tolist()  # waits for the step
        t1 = time.perf_counter()
        for t, rows in held:
            t[idle] = rows
        for r, s in live:
            if r not in idle:
                s.accept(tokens[r], (t1 - t0) * 1e3, t1)
        return True

    def run(self) -> int:
        """Step while a step can run; the number of steps run."""
        n = 0
        while self.step():
            n += 1
        return n


class StreamSession:
    """One stream alone (rows cleared first): feed(samples) -> new tokens, then finish() -> the rest."""

    def __init__(self, steps: Steps, spec: StreamSpec, on_token: Callable[[int], None] | None = None):
        steps.reset()
        self.stream = Stream(spec, on_token)
        self.batch = StreamBatch(steps, spec)
        self.batch.add(self.stream)

    def feed(self, samples: np.ndarray) -> list[int]:
        n = len(self.stream.tokens)
        self.stream.feed(samples)
        self.batch.run()
        return self.stream.tokens[n:]

    def finish(self) -> list[int]:
        n = len(self.stream.tokens)
        self.stream.finish()
        self.batch.run()
        return self.stream.tokens[n:]

    @property
    def tokens(self) -> list[int]:
        return self.stream.tokens

    @property
    def times(self) -> StepTimes:
        return self.stream.times

    @property
    def received(self) -> int:
        return self.stream.received

    @property
    def position(self) -> int:
        return self.stream.position


def run_whole(steps: Steps, spec: StreamSpec, samples: np.ndarray) -> list[int]:
    """The whole file at once (what `stream` must reproduce block by block)."""
    session = StreamSession(steps, spec)
    session.feed(samples)
    session.finish()
    return session.tokens


def run_fed(
    batch: StreamBatch,
    sources: list[tuple[Stream, Iterator[np.ndarray]]],
    on_done: Callable[[int], None] | None = None,
) -> None:
    """Each stream fed its source's blocks in lockstep (one block each, then every step they make possible),
    finished when its source ends. Streams start in order as rows are free: more sources than the bundle's
    stream slots wait for one. `on_done(i)` as the i-th stream ends."""
    waiting = list(range(len(sources)))
    active: list[int] = []
    while waiting or active:
        while waiting and batch.free():
            i = waiting.pop(0)
            batch.add(sources[i][0])
            active.append(i)
        for i in active:
            stream, blocks = sources[i]
            block = next(blocks, None)
            if block is None:
                stream.finish()
            else:
                stream.feed(block)
        batch.run()
        for i in [i for i in active if sources[i][0].done]:
            active.remove(i)
            if on_done is not None:
                on_done(i)


def blocks_of(samples: np.ndarray, block: int) -> Iterator[np.ndarray]:
    return (samples[i : i + block] for i in range(0, len(samples), block))


def run_together(steps: Steps, spec: StreamSpec, files: list[np.ndarray], block: int = 1280) -> list[list[int]]:
    """Several files as concurrent streams, fed in lockstep blocks: each file's tokens."""
    steps.reset()
    streams = [Stream(spec) for _ in files]
    run_fed(StreamBatch(steps, spec), [(s, blocks_of(f, block)) for s, f in zip(streams, files)])
    return [s.tokens for s in streams]
