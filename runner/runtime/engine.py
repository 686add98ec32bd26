"""Engines: the four methods of a bundle behind one interface (`Engine`, a base class with the defaults of an engine
without a feature), so the generation loop (runner/runtime/generate.py) runs the exported program
(`ProgramEngine`) and the eager reference (runner/reference/) alike.

A family whose decoder cross-attends to the audio (Whisper) keeps the encoder's output and passes it to every
decoder call after (embeds, cache_position); one whose audio embeddings are decoder positions (Voxtral) passes
nothing more. That is the only difference between the two kinds of engine, and it is a value, not a subclass.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from runner.audio import N_SAMPLES, PROMPT_ROOM, TOKENS_PER_CHUNK
from runner.bundle import ALIGN_METHOD, BATCH_METHOD, BATCH_STATE_PREFIX, STEP_METHOD
from runner.dtypes import torch_dtype
from runner.errors import AudioError, BundleError, GenerationError
from runner.runtime.graphs import BatchGraphs, DecodeGraph, PrefillGraphs
from runner.runtime.options import RuntimeOptions
from runner.runtime.program import Method, Program
from runner.runtime.waveform import PinnedHostBuffer, wave_on_device

# warm_up's prefill length: a 30 s prompt's at most (Voxtral: a chunk's audio tokens and the room its text takes)
WARM_UP_TOKENS = TOKENS_PER_CHUNK + PROMPT_ROOM

NON_FINITE_FEATURES = (
    "the audio's log-mel features are not finite (NaN or Inf): its samples are too large for the preprocessor "
    "(normalise the audio to [-1, 1])"
)


class CrossAttended:
    """The audio_encoder's output kept for a cross-attending decoder. `static` (for CUDA graphs, which read one
    fixed tensor) is copied into; otherwise the latest output is held."""

    def __init__(self, static: torch.Tensor | None = None):
        self.static, self.value = static, static

    def keep(self, out: torch.Tensor) -> torch.Tensor:
        if self.static is None:
            self.value = out
        else:
            self.static.copy_(out)
        return out

    def inputs(self) -> tuple[torch.Tensor, ...]:
        if self.value is None:
            raise GenerationError("text_decoder called before audio_encoder: no cross-attention K/V yet")
        return (self.value,)


def extra_inputs(cross: CrossAttended | None) -> tuple[torch.Tensor, ...]:
    """text_decoder inputs after (embeds, cache_position)."""
    return cross.inputs() if cross is not None else ()


class Engine:
    """A bundle's four methods behind what the generation loop (generate.py), the batch scheduler (batch.py) and
    bench call: the exported program (ProgramEngine) and the eager reference (runner/reference/engine.py) alike.
    A subclass gives the methods; every other member has here the default of an engine without that feature, so a
    caller never asks whether an engine has it."""

    device: str
    max_seq_len: int
    max_audio_chunks: int
    encoder_dtype: torch.dtype
    max_batch: int = 1  # sequences decode_batch decodes at once, each in a slot of its own cache; 1: none
    # A decoder that cross-attends to the audio (Whisper) reads the encoder's output kept here after (embeds,
    # cache_position); None: the audio embeddings take decoder positions (Voxtral).
    cross: CrossAttended | None = None
    pinned: PinnedHostBuffer | None = None  # the waveform's page-locked host buffer, kept (ProgramEngine on CUDA)
    scores: bool = False  # whether score() gives the logits of every position (a compiled decoder: the last only)
    aligns: bool = False  # whether align() can run (word timing's forward: a bundle's `alignment` method)

    def __init__(self, state_lock: threading.Lock | None = None):
        # Held by the one caller using the KV cache (MultimodalRunner.exclusive): engines over one cache share it.
        self.state_lock = state_lock or threading.Lock()

    def preprocess(self, wave: torch.Tensor) -> torch.Tensor:  # [k*480000] f32 -> mel [k, n_mels, 3000] f32
        raise NotImplementedError

    def encode(self, mel: torch.Tensor) -> torch.Tensor:  # mel (encoder dtype) -> audio embeddings / cross K/V
        raise NotImplementedError

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [1, S] int64 -> [1, S, H]
        raise NotImplementedError

    def decode(self, embeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # -> logits [1, V] f32
        raise NotImplementedError

    def reset(self) -> None:
        """Empty the KV cache a prompt is prefilled into."""
        raise NotImplementedError

    def align(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [1, S] over the window encoded last -> (the alignment heads' cross-attention scores [A, S, frames],
        each id's probability [S]), both float32: word timing (a bundle with the `alignment` method)."""
        raise GenerationError(
            "--word-timestamps: this bundle has no alignment method (export it again with this version)"
        )

    def decode_token(self, token: torch.Tensor, pos: int) -> torch.Tensor:  # [1, 1] -> logits [1, V]
        return decode_token(self, token, pos)

    def run_prefill(self, compute, inputs: list[torch.Tensor]):
        """compute(engine, *inputs): the prompt's device work, which an engine may run as a CUDA graph."""
        return compute(self, *inputs)

    def check_features(self) -> None:
        """Raise AudioError if a feature of the prompt just prefilled was not finite (an engine that keeps no check
        has nothing to say)."""

    def score(self, embeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The logits at every position of `embeds` [1, S, H] (an engine whose `scores` is true)."""
        raise NotImplementedError

    def rewind(self, length: int) -> None:
        """Drop the cache's positions from `length` on: a cache that grows needs it before a step is timed again;
        a fixed one is overwritten in place."""

    def admit(self, slot: int, length: int) -> None:
        """The prompt just prefilled (positions [0, length)) into `slot`'s cache."""
        raise GenerationError(f"{type(self).__name__}: no batched decode step")

    def decode_batch(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens [B, 1] int64, pos [B] int64 (row b is slot b) -> logits [B, V] float32."""
        raise GenerationError(f"{type(self).__name__}: no batched decode step")


class ProgramEngine(Engine):
    """A loaded Program as an Engine. On CUDA (unless options.cuda_graph is off) the decode step is a CUDA graph
    and repeated prefill shapes replay one graph each."""

    def __init__(self, program: Program, options: RuntimeOptions | None = None, cross_attention: bool = False):
        super().__init__(program.state_lock)  # two engines over one Program share its KV cache
        options = options or RuntimeOptions()
        m, model = program.methods, program.manifest.model
        self.program, self.device = program, program.device
        self.max_seq_len, self.max_audio_chunks = model["max_seq_len"], model["max_audio_chunks"]
        self.encoder_dtype = m["audio_encoder"].input_dtype(0)  # what the encoder declares, e.g. bf16 on CUDA
        self._pre, self._enc, self._emb, self._dec = (
            m[k] for k in ("preprocessor", "audio_encoder", "token_embedding", "text_decoder")
        )
        _check_mel_bins(program, self._pre, self._enc)
        # the decoder exported for one token; a family without one decodes a token through text_decoder
        self._step = m.get(STEP_METHOD)
        self._align = m.get(ALIGN_METHOD)  # word timing's forward, where the family exports one
        self.aligns = self._align is not None and cross_attention
        # B tokens of B sequences in one step, each in a slot of its own cache (a bundle exported with --max-batch)
        self._batch = m.get(BATCH_METHOD)
        self.max_batch = model.get("max_batch", 1) if self._batch is not None else 1
        self._slots = slot_pairs(program, self._dec, self._batch) if self._batch is not None else []
        self.batch_graphs: BatchGraphs | None = None
        self.use_cuda_graph = options.cuda_graph and self.device == "cuda"
        self.encoder_chunks = options.encoder_chunks
        self.prefill_chunk = options.prefill_chunk
        if self.prefill_chunk and not model.get("prefill_pieces"):
            raise BundleError(
                "--prefill-chunk: this bundle's text_decoder takes a prompt from position 0 only (no "
                "model.prefill_pieces: a CPU export, or a Whisper one); "
                "export it again on CUDA, or prefill in one call"
            )
        if cross_attention:  # graph replays read a static tensor: encode() copies each window's K/V into it
            kv, static = self._enc.spec.outputs[0], None
            if self.use_cuda_graph:
                static = torch.zeros(kv.shape, dtype=torch_dtype(kv.dtype), device=self.device)
            self.cross = CrossAttended(static)
        self.graph: DecodeGraph | None = None
        # the bundle's decode kernels wait before reading (manifest `pdl`): their graph edges may be programmatic
        self.pdl = bool(model.get("pdl")) and self.use_cuda_graph and options.pdl
        # a cross-attended prefill is not captured: its graph was never measured or tested
        self.prefill_graphs = PrefillGraphs(self.device) if self.use_cuda_graph and not cross_attention else None
        self._capturable = False  # a view that runs every method on the current stream (see capturable())
        # Whether every feature of this prompt is finite: kept on the device, so no host sync joins a captured
        # prefill (a replay rewrites it like any static tensor), copied to the host after the prefill and read
        # once the first token is there (check_features): by then the copy is done, and the read costs nothing.
        self._features_ok = torch.ones((), dtype=torch.bool, device=self.device)
        self._features_host = torch.ones((), dtype=torch.bool, pin_memory=self.device == "cuda")
        # the waveform's page-locked host buffer, pinned at warm_up: not one pinned per prompt
        self.pinned = PinnedHostBuffer() if self.device == "cuda" else None

    def capturable(self) -> ProgramEngine:
        """This engine with every method run on the caller's current stream through `...RunSingleThreaded`, the
        entry point that can be captured into a CUDA graph (`...Run` uses the handle's own stream)."""
        view = object.__new__(ProgramEngine)
        view.__dict__.update(self.__dict__, _capturable=True)
        return view

    def _run(self, method: Method, *inputs: torch.Tensor) -> torch.Tensor:
        if self._capturable:
            return method.backend.execute(method.handle, list(inputs), graph_safe=True)[0]
        return method(*inputs)[0]

    def preprocess(self, wave):
        mel = self._run(self._pre, wave)
        self._features_ok.logical_and_(torch.isfinite(mel).all())
        return mel

    def check_features(self) -> None:
        """Raise AudioError if a feature of the prompt just prefilled was NaN or Inf (finite samples of huge
        amplitude overflow the log-mel): the encoder would run on NaN and the decoder pick token 0."""
        if not bool(self._features_host):
            raise AudioError(NON_FINITE_FEATURES)

    def encode(self, mel):
        g = self.encoder_chunks
        if 0 < g < mel.shape[0]:  # [chunks, n_mels, frames] -> [1, chunks * positions, dim]: a chunk attends to itself
            out = torch.cat([self._run(self._enc, mel[i : i + g]) for i in range(0, mel.shape[0], g)], dim=1)
        else:
            out = self._run(self._enc, mel)
        return self.cross.keep(out) if self.cross is not None else out

    def embed(self, ids):
        return self._run(self._emb, ids)

    def align(self, ids):
        if not self.aligns:
            return super().align(ids)
        scores, probs = self._align(ids.to(self.device), *self.cross.inputs())
        return scores, probs

    def decode(self, embeds, pos):
        p = self.prefill_chunk
        if 0 < p < embeds.shape[1]:  # pieces in order: each attends to the cache the ones before it wrote
            for i in range(0, embeds.shape[1], p):
                logits = self._run(self._dec, embeds[:, i : i + p], pos[i : i + p], *extra_inputs(self.cross))
            return logits
        return self._run(self._dec, embeds, pos, *extra_inputs(self.cross))

    def run_prefill(self, compute, inputs):
        if self.prefill_graphs is None:
            out = compute(self, *inputs)
        else:
            out = self.prefill_graphs.run(
                lambda *xs: compute(self, *xs), inputs, lambda *xs: compute(self.capturable(), *xs)
            )
        self._features_host.copy_(self._features_ok, non_blocking=True)  # read after the first token
        return out

    def reset(self):
        # Capture before any prefill: the warm-ups write the first cache positions, wiped here.
        if self.use_cuda_graph and self.graph is None:
            self.graph = DecodeGraph(self.graph_step, self.device, overlap=self.pdl)
        self.program.reset_state(keep=(BATCH_METHOD,))  # the slots hold sequences in flight
        self._features_ok.fill_(True)

    def warm_up(self) -> bool:
        """Every method called once on inputs of a transcription's size, and the decode step captured (reset):
        a CUDA method's first call loads its kernels (the driver loads each at its first launch; cuBLAS picks and
        loads GEMM kernels by shape) and creates library handles and workspaces, which made a process's first
        generate() slow. Done at load instead; the caches are wiped after. Nothing on CPU, where a first call costs
        what any call does: returns whether it ran."""
        if self.device != "cuda":
            return False
        self.reset()  # with graphs: the decode step's capture
        mel = self.preprocess(wave_on_device(np.zeros(N_SAMPLES, np.float32), 1, self.device, self.pinned))
        self.encode(to_encoder_dtype(mel, self.encoder_dtype))
        n = min(self.max_seq_len - 1, WARM_UP_TOKENS)
        embeds = self.embed(torch.zeros(1, n, dtype=torch.int64, device=self.device))
        logits = self.decode(embeds, torch.arange(n, device=self.device))
        self.decode_token(logits.argmax(-1).view(1, 1), n)
        torch.cuda.synchronize(self.device)
        self.reset()
        return True

    def admit(self, slot: int, length: int) -> None:
        """The prompt just prefilled into `slot` (admit_into_slot)."""
        admit_into_slot(self._slots, slot, length)

    def decode_batch(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens [B, 1] int64, pos [B] int64 (row b is slot b) -> logits [B, V] float32, on CUDA from the graph
        of the smallest captured batch >= B (its rows past B decode position 0 of free slots)."""
        if self._batch is None:
            raise GenerationError(f"{self.program.bundle_dir}: no text_decoder_batch (export with --max-batch N)")
        if self.use_cuda_graph:
            if self.batch_graphs is None:  # captured at the first batched step; see BatchGraphs on why that is safe
                self.batch_graphs = BatchGraphs(self.batch_step, self.device, self.max_batch, self.max_seq_len - 1)
            return self.batch_graphs.step(tokens, pos)
        return self.batch_step(tokens, pos, graph_safe=False)

    def batch_step(self, tokens: torch.Tensor, pos: torch.Tensor, graph_safe: bool = True) -> torch.Tensor:
        """token_embedding (the B tokens as one row of ids: it takes [1, S]) + text_decoder_batch."""
        b = tokens.shape[0]
        emb, dec = self._emb, self._batch
        embeds = emb.backend.execute(emb.handle, [tokens.view(1, b)], graph_safe=graph_safe)[0]
        return dec.backend.execute(dec.handle, [embeds.view(b, 1, -1), pos], graph_safe=graph_safe)[0]

    def graph_step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """token_embedding + the decoder at one position, capturably: what a decode graph records."""
        emb, dec = self._emb, self._step or self._dec
        embeds = emb.backend.execute(emb.handle, [token], graph_safe=True)[0]
        return dec.backend.execute(dec.handle, [embeds, pos, *extra_inputs(self.cross)], graph_safe=True)[0]

    def decode_token(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        if self.graph is not None:
            return self.graph.step(token, pos)
        step = self._step and (lambda embeds, pos: self._step(embeds, pos, *extra_inputs(self.cross))[0])
        return decode_token(self, token, pos, step)


def admit_into_slot(pairs: list[tuple[torch.Tensor, torch.Tensor]], slot: int, length: int) -> None:
    """For each (slot cache [N, ...], prefill cache [1, ...]): positions [0, length) of the prefill's cache into
    `slot`, the slot's positions after them zeroed (a masked position is multiplied by zero: stale values must be
    finite)."""
    for slots, one in pairs:
        slots[slot, :, :length].copy_(one[0, :, :length])
        slots[slot, :, length:].zero_()


def slot_pairs(program: Program, dec: Method, batch: Method) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(slot cache [N, ...], prefill cache [1, ...]) for every cache of the batched method, paired by name: a slot
    cache is named as the prefill's under BATCH_STATE_PREFIX (runner/bundle.py)."""
    pairs = []
    for fqn, slots in batch.handle.state.items():
        one = dec.handle.state.get(fqn.removeprefix(BATCH_STATE_PREFIX)) if fqn.startswith(BATCH_STATE_PREFIX) else None
        if one is None or one.shape[0] != 1 or one.shape[1:] != slots.shape[1:] or one.dtype != slots.dtype:
            raise BundleError(
                f"{program.bundle_dir}: {BATCH_METHOD} state {fqn} {list(slots.shape)} has no matching cache in "
                f"text_decoder ({BATCH_STATE_PREFIX}<its name>, one row of the same shape): export the bundle again"
            )
        pairs.append((slots, one))
    if not pairs:
        raise BundleError(f"{program.bundle_dir}: {BATCH_METHOD} has no slot cache: export the bundle again")
    return pairs


def _check_mel_bins(program: Program, pre: Method, enc: Method) -> None:
    """The mel bins come from the bundle: preprocessor output, encoder input and manifest (if it says) agree."""
    for spec, what in ((pre.spec.outputs, "preprocessor output"), (enc.spec.inputs, "audio_encoder input")):
        if not spec or len(spec[0].shape) != 3:  # mel [chunks, n_mels, frames]
            raise BundleError(f"{program.bundle_dir}: the manifest's {what} is not a mel [chunks, n_mels, frames]")
    n_mels = program.manifest.model.get("n_mels", pre.spec.outputs[0].shape[1])
    if not (n_mels == enc.spec.inputs[0].shape[1] == pre.spec.outputs[0].shape[1]):
        raise GenerationError(
            f"{program.bundle_dir}: mel bins disagree (manifest {n_mels}, preprocessor "
            f"{pre.spec.outputs[0].shape[1]}, audio_encoder {enc.spec.inputs[0].shape[1]})"
        )


def decode_token(e: Engine, token: torch.Tensor, pos: int, decode=None) -> torch.Tensor:
    """One decode step: token [1, 1] -> logits [1, V], through `decode` (default: the engine's decoder). The
    position is filled on the device (torch.full), not copied from the host: a host copy would wait for the step
    queued before it."""
    return (decode or e.decode)(e.embed(token.view(1, 1)), torch.full((1,), pos, dtype=torch.int64, device=e.device))


def to_encoder_dtype(mel: torch.Tensor, want: torch.dtype) -> torch.Tensor:
    """The seed's convert_to_bfloat16, generalised: features come out of the preprocessor as float32 and
    the encoder may declare a narrower float; anything else is a clear error, not a silent reinterpretation."""
    if mel.dtype == want:
        return mel
    if mel.dtype == torch.float32 and want in (torch.bfloat16, torch.float16):
        return mel.to(want)
    raise GenerationError(f"audio_encoder expects {want}, the features are {mel.dtype}: unsupported dtype conversion")
