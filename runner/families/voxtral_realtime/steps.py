"""A loaded streaming bundle's three methods as batched Steps: called one by one (`ProgramSteps`), or on CUDA as
two CUDA graphs per batch size (`GraphSteps`: preprocessor + encoder_step, then decoder_step + the greedy pick).

Graphs are captured when the steps are built, before any stream: a capture's warm-up runs the methods for real,
writing the state rows it covers, and every row is cleared after. Batch sizes are the powers of two up to the
bundle's stream slots (and that number): a step of n streams replays the smallest size >= n, the rows beyond n
being free rows (cleared when a stream takes one)."""

from __future__ import annotations

import logging

import torch

from runner.errors import GenerationError
from runner.families.voxtral_realtime.session import Steps
from runner.runtime.graphs import CaptureError, batch_sizes, capture_graph
from runner.runtime.program import Method

log = logging.getLogger(__name__)

METHODS = ("preprocessor", "encoder_step", "decoder_step")


class ProgramSteps(Steps):
    """A loaded Program's three methods as Steps."""

    def __init__(self, program):
        missing = [m for m in METHODS if m not in program.methods]
        if missing:
            raise GenerationError(f"{program.bundle_dir}: not a streaming bundle (no {', '.join(missing)})")
        self.program, self.device = program, program.device
        self._pre, self._enc, self._dec = (program.methods[m] for m in METHODS)
        self.streams = program.manifest.model.get("max_streams")  # the state's rows
        if not isinstance(self.streams, int) or self.streams < 1:
            raise GenerationError(f"{program.bundle_dir}: no stream slots in the manifest (export it again)")
        self._held = _whole_row_state(program)

    def preprocess(self, wave):
        return self._pre(wave)[0]

    def encode(self, mel, pos):
        return self._enc(mel, pos)[0]

    def decode(self, token, audio, pos, delay):
        return self._dec(token, audio, pos, delay)[0]

    def held_state(self) -> list[torch.Tensor]:
        return self._held

    def reset(self, rows: list[int] | None = None):
        if rows is None:
            self.program.reset_state()
            return
        seen: set[int] = set()  # a buffer two methods share, once
        for m in self.program.methods.values():
            for t in m.handle.state.values():
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    t[rows] = 0


def _whole_row_state(program) -> list[torch.Tensor]:
    """The steps' state but the K/V rings (`state.layers.N.k` / `.v`: models/voxtral_realtime.py's RingKV, whose
    slot for a position only a step at that position writes): the convolutions' tails, which every step
    overwrites. A buffer the rings do not name is counted here, so a new kind of state is held, not lost."""
    seen: set[int] = set()  # a buffer two methods share, once
    held = []
    for m in METHODS:
        for name, t in program.methods[m].handle.state.items():
            if name.rsplit(".", 1)[-1] not in ("k", "v") and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                held.append(t)
    return held


def _graph_safe(method: Method, *inputs: torch.Tensor) -> torch.Tensor:
    """The method on the caller's current stream through `...RunSingleThreaded` (capturable)."""
    return method.backend.execute(method.handle, list(inputs), graph_safe=True)[0]


class _Graphs:
    """The two graphs of one batch size, over static inputs a replay reads."""

    def __init__(self, steps: ProgramSteps, b: int, window: int):
        dev = steps.device
        self.wave = torch.zeros(b, window, device=dev)
        self.pos = torch.zeros(b, dtype=torch.int64, device=dev)
        self.token = torch.zeros(b, 1, dtype=torch.int64, device=dev)
        self.delay = torch.zeros(b, device=dev)

        def encode():
            return _graph_safe(steps._enc, _graph_safe(steps._pre, self.wave), self.pos)

        enc = capture_graph(encode, dev)
        self.encoder, self.audio = enc.graph, enc.out

        def decode():
            return _graph_safe(steps._dec, self.token, self.audio, self.pos, self.delay).argmax(dim=-1)

        dec = capture_graph(decode, dev)
        self.decoder, self.next = dec.graph, dec.out


class GraphSteps(ProgramSteps):
    """ProgramSteps whose whole step is replayed from CUDA graphs (a step launches so many kernels that at batch 1
    the host's launches would take longer than the GPU's work)."""

    def __init__(self, program, window: int):
        super().__init__(program)
        if self.device != "cuda":
            raise GenerationError(f"{program.bundle_dir}: CUDA graphs need a CUDA bundle")
        self.graphs: dict[int, _Graphs] = {}
        try:
            for b in batch_sizes(self.streams):
                self.graphs[b] = _Graphs(self, b, window)
        except CaptureError as e:
            raise GenerationError(f"{program.bundle_dir}: the step could not be captured as a CUDA graph ({e})") from e
        finally:
            self.program.reset_state()  # the warm-ups wrote every row
        log.info("captured the step for batches of %s", ", ".join(map(str, self.graphs)))

    def batch_for(self, rows: int) -> int:
        return next(b for b in self.graphs if b >= rows)

    def step(self, wave, pos, token, delay) -> torch.Tensor:
        g = self.graphs[wave.shape[0]]
        g.wave.copy_(wave)
        g.pos.copy_(pos)
        g.token.copy_(token)
        g.delay.copy_(delay)
        g.encoder.replay()
        g.decoder.replay()
        return g.next  # static: read before the next step

    def encode_only(self, b: int) -> None:
        """Replay one batch size's encoder half (benchmarks time the halves)."""
        self.graphs[b].encoder.replay()

    def decode_only(self, b: int) -> None:
        self.graphs[b].decoder.replay()


def program_steps(program, options, window: int) -> ProgramSteps:
    """GraphSteps on CUDA unless the options turn graphs off; ProgramSteps otherwise, or where the step cannot be
    captured (said once: the stream still runs, method by method)."""
    if program.device == "cuda" and options.cuda_graph:
        try:
            return GraphSteps(program, window)
        except GenerationError as e:
            log.warning("%s; running the methods one by one", e)
    return ProgramSteps(program)
