"""The multimodal runner: prompt segments -> prefill -> decode loop, over any Engine (the exported program, or
the eager model for `--reference eager`), so both sides run exactly the same loop."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from runner import pdl
from runner.audio import CHUNK_LENGTH, SAMPLE_RATE, load_audio, num_chunks, pad_to_chunks
from runner.errors import AudioError, DelegateError, GenerationError
from runner.program import Program
from runner.stats import Stats, now_ms
from runner.tokenizer import StreamDecoder, Tekken

log = logging.getLogger(__name__)

# Languages Voxtral transcribes (mistral-common's `lang:xx` prefix).
LANGUAGES = ("en", "es", "fr", "pt", "hi", "de", "nl", "it")


# ---------------------------------------------------------------- engines


class Engine(Protocol):
    device: str
    max_seq_len: int
    max_audio_chunks: int
    encoder_dtype: torch.dtype

    def preprocess(self, wave: torch.Tensor) -> torch.Tensor: ...  # [k*480000] f32 -> mel [k,128,3000] f32
    def encode(self, mel: torch.Tensor) -> torch.Tensor: ...  # mel (encoder dtype) -> [1, k*375, H]
    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...  # [1, S] int64 -> [1, S, H]
    def decode(self, embeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor: ...  # -> logits [1, V] f32
    def reset(self) -> None: ...
    def decode_token(self, token: torch.Tensor, pos: int) -> torch.Tensor: ...  # [1,1] -> logits [1, V]
    def run_prefill(self, compute: Callable, inputs: list[torch.Tensor]): ...  # compute(*inputs), maybe graphed

    # Optional: `decode_greedy(token, pos, n)` -> the next n greedy tokens [1, n] on the device, and
    # `greedy_chain` (the n it runs fastest, as one launch). Without them, greedy_steps() below.


class ProgramEngine:
    def __init__(self, program: Program, cuda_graph: bool = True):
        m, model = program.methods, program.manifest.model
        self.program, self.device = program, program.device
        self.max_seq_len, self.max_audio_chunks = model["max_seq_len"], model["max_audio_chunks"]
        self.encoder_dtype = m["audio_encoder"].input_dtype(0)  # what the encoder declares, e.g. bf16 on CUDA
        self._pre, self._enc, self._emb, self._dec = (
            m[k] for k in ("preprocessor", "audio_encoder", "token_embedding", "text_decoder")
        )
        # The decoder exported for one token (bundles from before it have only text_decoder, which decodes too):
        # on CUDA it is the hand-written decode kernels (H200, 3B: see benchmarks/NOTES.md).
        self._step = m.get("text_decoder_step")
        self.use_cuda_graph = cuda_graph and self.device == "cuda"
        self.graph: DecodeGraph | None = None
        self.chain: GreedyChainGraph | None = None
        # the bundle's decode kernels wait before reading (manifest `pdl`: sm_90+, by default): their graph edges
        # may be made programmatic (runner/pdl.py); VOXTRAL_RUNNER_PDL=0 here keeps them plain anyway
        self.pdl = bool(model.get("pdl")) and self.use_cuda_graph and pdl.enabled()
        self.prefill_graphs = PrefillGraphs(self) if self.use_cuda_graph else None
        self.graph_safe = False  # True while a prefill is warmed up or captured: methods run capturably

    def _run(self, method, *inputs: torch.Tensor) -> torch.Tensor:
        if self.graph_safe:
            return method.backend.execute(method.handle, list(inputs), graph_safe=True)[0]
        return method(*inputs)[0]

    def preprocess(self, wave):
        return self._run(self._pre, wave)

    def encode(self, mel):
        return self._run(self._enc, mel)

    def embed(self, ids):
        return self._run(self._emb, ids)

    def decode(self, embeds, pos):
        return self._run(self._dec, embeds, pos)

    def run_prefill(self, compute, inputs):
        if self.prefill_graphs is None:
            return compute(*inputs)
        return self.prefill_graphs.run(compute, inputs)

    def reset(self):
        # Capture before any prefill: the warm-ups write the first cache positions, wiped here.
        if self.use_cuda_graph and self.graph is None:
            self.graph = DecodeGraph(self, overlap=self.pdl)
            steps = greedy_chain_steps()
            if 1 < steps <= self.max_seq_len:
                self.chain = GreedyChainGraph(self, steps, overlap=self.pdl)
        if self.chain is not None:
            self.chain.next_pos = -1  # a new input: its first chain starts from the token it is given
        self.program.reset_state()

    @property
    def greedy_chain(self) -> int:
        return self.chain.steps if self.chain is not None else 1

    def decode_greedy(self, token: torch.Tensor, pos: int, n: int) -> torch.Tensor:
        if self.chain is not None and n == self.chain.steps:
            return self.chain.run(token, pos)
        return greedy_steps(self, token, pos, n)

    def graph_step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """token_embedding + the decoder at one position, capturably (`...RunSingleThreaded` on the current
        stream): what a decode graph records."""
        emb, dec = self._emb, self._step or self._dec
        embeds = emb.backend.execute(emb.handle, [token], graph_safe=True)[0]
        return dec.backend.execute(dec.handle, [embeds, pos, *self.graph_inputs()], graph_safe=True)[0]

    def graph_inputs(self) -> tuple[torch.Tensor, ...]:
        """text_decoder inputs after (embeds, cache_position), as static tensors a captured step can read."""
        return ()

    def decode_token(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        if self.graph is not None:
            return self.graph.step(token, pos)
        step = self._step and (lambda embeds, pos: self._step(embeds, pos, *self.graph_inputs())[0])
        return decode_token(self, token, pos, step)


def decode_token(e: Engine, token: torch.Tensor, pos: int, decode=None) -> torch.Tensor:
    """One decode step: token [1, 1] -> logits [1, V], through `decode` (default: the engine's decoder). The
    position is filled on the device (torch.full), not copied from the host: a host copy would wait for the step
    queued before it."""
    return (decode or e.decode)(e.embed(token.view(1, 1)), torch.full((1,), pos, dtype=torch.int64, device=e.device))


def greedy_steps(e: Engine, token: torch.Tensor, pos: int, n: int) -> torch.Tensor:
    """n greedy decode steps from token [1, 1] at pos, queued on the device with no host sync -> tokens [1, n]."""
    out = []
    for i in range(n):
        token = e.decode_token(token, pos + i).argmax(dim=-1, keepdim=True)
        out.append(token)
    return out[0] if n == 1 else torch.cat(out, dim=1)


class _Done:
    def synchronize(self) -> None:  # CPU work is done when it returns
        pass


def _recorded_event(device: str):
    """An event recorded on the current stream (CUDA), to wait for exactly the work queued so far."""
    if torch.device(device).type != "cuda":
        return _Done()
    ev = torch.cuda.Event()
    ev.record()
    return ev


class DecodeGraph:
    """The decode step (token_embedding + text_decoder_step, or text_decoder, at one position) as one CUDA graph.

    Static input tensors (token, position) are rewritten before each replay; the containers run through
    `...RunSingleThreaded` on the capturing stream; the KV cache is our own bound buffer, mutated in place, so
    replays see every earlier step. The delegate's validated metadata cache sees the same static tensors on
    every call: this is the hot loop it exists for."""

    def __init__(self, engine: ProgramEngine, overlap: bool = False):
        self.engine = engine
        self.token = torch.zeros(1, 1, dtype=torch.int64, device=engine.device)
        self.pos = torch.zeros(1, dtype=torch.int64, device=engine.device)
        self.graph, self.logits = capture_graph(lambda: engine.graph_step(self.token, self.pos), engine.device, overlap)

    def step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        self.token.copy_(token.view(1, 1))
        self.pos.fill_(pos)
        self.graph.replay()
        return self.logits  # static: read it before the next step


def capture_graph(
    run: Callable[[], torch.Tensor], device: str, overlap: bool = False
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """run() once on a side stream (lazy init, workspace allocation: not capturable), then captured. With
    `overlap`, the decode kernels' edges are made programmatic before the graph is instantiated (runner/pdl.py:
    each starts while the kernel before it finishes); where that fails, the graph is captured plainly."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    if overlap:
        try:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph):
                out = run()
            n = pdl.programmatic_edges(graph.raw_cuda_graph())
            graph.instantiate()
            log.info("decode graph: %d kernel launches overlap the kernel before them (PDL)", n)
            return graph, out
        except (TypeError, AttributeError, OSError, RuntimeError) as e:  # old torch or driver: no PDL
            log.warning("decode graph captured without programmatic dependent launch: %s", e)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


# Greedy tokens per decode-graph replay. Each step's argmax feeds the next inside the graph, so per GREEDY_CHAIN
# tokens the stream carries one replay, one copy to the host and one event, where the one-step graph needs,
# around every replay, the token's copy in, the position, the argmax, the copy out and an event (≈ 30 us per token
# beyond the replay on the H200 at 3B, benchmarks/NOTES.md). Up to 2 * GREEDY_CHAIN - 1 steps may run past an
# EOS (two chains are kept queued); they only write cache positions the next reset() wipes. H200, 3B: 437.7-438.0
# tok/s with 1, 439.7-439.9 with 8, alternating in one call (NOTES item 25). VOXTRAL_RUNNER_GREEDY_CHAIN overrides.
GREEDY_CHAIN = 8


def greedy_chain_steps() -> int:
    """GREEDY_CHAIN, or VOXTRAL_RUNNER_GREEDY_CHAIN (1: one step per replay, as before chains)."""
    value = os.environ.get("VOXTRAL_RUNNER_GREEDY_CHAIN", str(GREEDY_CHAIN))
    if not value.isdigit() or int(value) < 1:
        raise GenerationError(f"VOXTRAL_RUNNER_GREEDY_CHAIN={value!r}: a whole number of steps, at least 1")
    return int(value)


class GreedyChainGraph:
    """`steps` greedy decode steps as one CUDA graph: step k embeds the argmax of step k - 1 and runs at the next
    position, both advanced on the device. The last token and the position after it stay in the graph's inputs,
    so a chain that continues the previous one needs nothing written before its replay."""

    def __init__(self, engine: ProgramEngine, steps: int, overlap: bool = False):
        dev, i64 = engine.device, torch.int64
        self.steps = steps
        self.token = torch.zeros(1, 1, dtype=i64, device=dev)  # the input token, then the last one chosen
        self.pos = torch.zeros(1, dtype=i64, device=dev)  # the next step's position
        self.out = torch.zeros(1, steps, dtype=i64, device=dev)
        self.next_pos = -1  # host copy of self.pos after the last replay (-1: unknown)
        chosen = [torch.zeros(1, 1, dtype=i64, device=dev) for _ in range(steps)]

        def run() -> torch.Tensor:
            token = self.token
            for t in chosen:
                torch.argmax(engine.graph_step(token, self.pos), dim=-1, keepdim=True, out=t)
                self.pos.add_(1)
                token = t
            torch.cat(chosen, dim=1, out=self.out)
            self.token.copy_(chosen[-1])
            return self.out

        self.graph, _ = capture_graph(run, engine.device, overlap)

    def run(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """The next `steps` greedy tokens after token [1, 1] at pos -> [1, steps], valid until the next run."""
        if pos != self.next_pos or token.data_ptr() != self.out[:, -1:].data_ptr():  # not where the last chain ended
            self.token.copy_(token.view(1, 1))
            self.pos.fill_(pos)
        self.graph.replay()
        self.next_pos = pos + self.steps
        return self.out


class PrefillGraphs:
    """The whole prefill (preprocessor, audio_encoder, token_embedding, text_decoder over the prompt) as one CUDA
    graph per shape of its inputs. Run method by method, the host launches each of its ~800 kernels (3B), and the
    GPU waits on those launches: on the H200 the methods' kernels took 12.1 ms of a 16.7 ms time to first token.
    A transcription prompt's shape depends only on the audio's chunk count and the language, so a batch of files
    repeats one shape. A shape is captured the second time it is seen (its run is the warm-up; the capture
    itself executes nothing) and replayed from the third; a shape seen once never pays for a capture. The
    `capacity` most recent graphs are kept: each holds the memory of its prefill's activations."""

    def __init__(self, engine: ProgramEngine, capacity: int = 4):
        self.engine, self.capacity = engine, capacity
        self.seen: set[tuple] = set()
        self.disabled = False
        self.graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], object]] = OrderedDict()

    def run(self, compute: Callable, inputs: list[torch.Tensor]):
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        if key in self.graphs:
            graph, static, out = self.graphs[key]
            self.graphs.move_to_end(key)
            for s, x in zip(static, inputs):
                s.copy_(x)
            graph.replay()
            return out
        if self.disabled or key not in self.seen:
            self.seen.add(key)
            return compute(*inputs)
        static = [x.clone() for x in inputs]
        side = torch.cuda.Stream(device=self.engine.device)
        side.wait_stream(torch.cuda.current_stream())
        self.engine.graph_safe = True
        try:
            with torch.cuda.stream(side):  # warm-up on the capturing path; its result is this call's
                result = compute(*static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    out = compute(*static)
            except (RuntimeError, DelegateError) as e:  # not capturable: the prefill still works, uncaptured
                log.warning("prefill not captured as a CUDA graph (%s); running it method by method", e)
                self.disabled = True
                return result
        finally:
            self.engine.graph_safe = False
        self.graphs[key] = (graph, static, out)
        while len(self.graphs) > self.capacity:
            self.graphs.popitem(last=False)
        return result


def to_encoder_dtype(mel: torch.Tensor, want: torch.dtype) -> torch.Tensor:
    """The seed's convert_to_bfloat16, generalised: features come out of the preprocessor as float32 and
    the encoder may declare a narrower float; anything else is a clear error, not a silent reinterpretation."""
    if mel.dtype == want:
        return mel
    if mel.dtype == torch.float32 and want in (torch.bfloat16, torch.float16):
        return mel.to(want)
    raise GenerationError(f"audio_encoder expects {want}, the features are {mel.dtype}: unsupported dtype conversion")


# ---------------------------------------------------------------- prompts


@dataclass(frozen=True)
class TextSegment:
    ids: tuple[int, ...]


@dataclass(frozen=True)
class AudioSegment:
    samples: np.ndarray  # float32 mono 16 kHz


Segment = TextSegment | AudioSegment


def transcription_prompt(tok: Tekken, audio: np.ndarray, language: str | None) -> list[Segment]:
    """mistral-common's transcription request: <s>[INST][BEGIN_AUDIO][AUDIO]…[/INST]lang:xx[TRANSCRIBE]."""
    if language is not None and language not in LANGUAGES:
        raise GenerationError(f"unknown language {language!r}; choose from {', '.join(LANGUAGES)}")
    s = tok.special_id
    tail = [s("[/INST]")] + (tok.encode(f"lang:{language}") if language else []) + [s("[TRANSCRIBE]")]
    return [TextSegment((tok.bos_id, s("[INST]"), s("[BEGIN_AUDIO]"))), AudioSegment(audio), TextSegment(tuple(tail))]


def chat_prompt(tok: Tekken, audio: np.ndarray, prompt: str) -> list[Segment]:
    """The seed's runner: <s>[INST][BEGIN_AUDIO] + audio + {prompt}[/INST]. The prompt is plain text: a
    "[INST]" typed by a user stays text, never a control token."""
    s = tok.special_id
    return [
        TextSegment((tok.bos_id, s("[INST]"), s("[BEGIN_AUDIO]"))),
        AudioSegment(audio),
        TextSegment(tuple(tok.encode(prompt)) + (s("[/INST]"),)),
    ]


def stage(segments: list[Segment], device: str, audio_chunks: int) -> list[torch.Tensor]:
    """Each segment's input on the device (ids [1, S] int64, or the waveform padded to `audio_chunks` x 30 s),
    all copied before any compute is queued: a copy from pageable host memory synchronises the stream, so one
    made after the audio encoder is queued would wait for it. On the H200 (3B) this ordering did not move time
    to first token (16.9 -> 16.7 ms, within run-to-run spread); both prefills build their inputs here."""
    return [
        torch.tensor([s.ids], dtype=torch.int64).to(device)
        if isinstance(s, TextSegment)
        else torch.from_numpy(pad_to_chunks(s.samples, audio_chunks)).to(device)
        for s in segments
    ]


# ---------------------------------------------------------------- generation


@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    min_new_tokens: int = 0  # ignore EOS until this many tokens (benchmarks force a fixed length)
    record_logits: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise GenerationError(f"--max-new-tokens {self.max_new_tokens}: must be at least 1")
        if self.min_new_tokens < 0:
            raise GenerationError(f"--min-new-tokens {self.min_new_tokens}: must be >= 0")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise GenerationError("--temperature must be >= 0 and --top-p in (0, 1]")


@dataclass(frozen=True)
class GenerationResult:
    text: str
    prompt_ids: list[int]
    tokens: list[int]
    stop_reason: str  # "eos" | "max_new_tokens" | "context"
    stats: Stats
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # per generated token, when recorded


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
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < self.top_p  # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p * keep)
        return torch.multinomial(probs, 1, generator=self.generator)


# One lock per KV cache. The cache is the program's state, shared by every runner over it: two generate() calls
# at once would interleave their prefill and decode steps in it. A second caller gets a clear error, not a mix.
_STATE_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STATE_LOCKS_GUARD = threading.Lock()


def _state_lock(engine: Engine) -> threading.Lock:
    owner = getattr(engine, "program", engine)  # two ProgramEngines over one Program share its cache
    with _STATE_LOCKS_GUARD:
        try:
            return _STATE_LOCKS.setdefault(owner, threading.Lock())
        except TypeError:  # not hashable or not weakly referenceable: a lock for this runner alone
            return threading.Lock()


class MultimodalRunner:
    # the id prompt_ids show at each audio position; None for a family whose audio is cross-attended (Whisper)
    AUDIO_TOKEN: str | None = "[AUDIO]"

    def __init__(self, engine: Engine, tokenizer: Tekken):
        self.engine, self.tok = engine, tokenizer
        self.audio_id = tokenizer.special_id(self.AUDIO_TOKEN) if self.AUDIO_TOKEN else None
        self._busy = _state_lock(engine)

    def _positions(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, device=self.engine.device)

    def prefill(self, segments: list[Segment]) -> tuple[torch.Tensor, list[int]]:
        """Embed every segment in order, then run the decoder once over the whole prompt; returns the last logits
        and the prompt ids (with the [AUDIO] id at every audio position, as HF's input_ids). One decoder call, not
        one per segment: each call streams all the decoder's weights (7.2 GB at 3B), so a 3-segment prompt
        prefilled piecewise costs two extra weight passes (measured on the H200: TTFT 26.4 -> 16.9 ms). The
        engine may run it all as one CUDA graph (`PrefillGraphs`)."""
        if not segments:
            raise GenerationError("empty prompt: nothing to prefill")
        e = self.engine
        logits, lengths = e.run_prefill(
            lambda *xs: self._prefill(segments, xs), stage(segments, e.device, e.max_audio_chunks)
        )
        prompt_ids: list[int] = []
        for seg, n in zip(segments, lengths):
            prompt_ids += list(seg.ids) if isinstance(seg, TextSegment) else [self.audio_id] * n
        return logits, prompt_ids

    def _prefill(self, segments: list[Segment], inputs) -> tuple[torch.Tensor, list[int]]:
        """The device work of prefill (no host sync: it may be captured); returns logits and each segment's length."""
        e, parts, n = self.engine, [], 0
        for seg, x in zip(segments, inputs):
            if isinstance(seg, TextSegment):
                self._check_fits(n, len(seg.ids))  # before embedding: the method refuses long ids
                parts.append(e.embed(x))
            else:
                parts.append(e.encode(to_encoder_dtype(e.preprocess(x), e.encoder_dtype)))
                self._check_fits(n, parts[-1].shape[1])
            n += parts[-1].shape[1]
        embeds = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return e.decode(embeds, self._positions(0, n)), [p.shape[1] for p in parts]

    def _check_fits(self, pos: int, n: int) -> None:
        if pos + n > self.engine.max_seq_len:
            raise GenerationError(
                f"the prompt needs at least {pos + n} positions, the bundle's context is "
                f"{self.engine.max_seq_len} (--max-seq-len at export)"
            )

    def generate(
        self,
        segments: list[Segment],
        opts: GenerationOptions,
        on_text: Callable[[str], None] | None = None,
        stats: Stats | None = None,
        forced: list[int] | None = None,
    ) -> GenerationResult:
        """`forced` feeds the given tokens instead of sampling (teacher forcing, for the eager comparison).
        Raises GenerationError if another generate() is running on the same program (one runner per thread)."""
        if not self._busy.acquire(blocking=False):
            raise GenerationError(
                "runner is busy: another generate() is running on this program (its KV cache is shared state); "
                "use one program and runner per thread"
            )
        try:
            return self._generate(segments, opts, on_text, stats, forced)
        finally:
            self._busy.release()

    def _generate(self, segments, opts, on_text, stats, forced) -> GenerationResult:
        e, stats = self.engine, stats or Stats()
        stats.audio_seconds = sum(len(s.samples) for s in segments if isinstance(s, AudioSegment)) / SAMPLE_RATE
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
            limit = opts.max_new_tokens if forced is None else min(opts.max_new_tokens, len(forced))

            def pick(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
                """The n-th token [1, 1] on the device, and its logits if recorded (copied now: a graph's logits
                buffer is overwritten by the next step)."""
                t0 = now_ms()
                if forced is None:
                    token = sampler(logits)
                else:
                    token = torch.full((1, 1), forced[n], dtype=torch.int64, device=e.device)
                kept = logits.to(torch.float32, copy=True) if opts.record_logits else None
                stats.aggregate_sampling_time_ms += now_ms() - t0
                return token, kept

            def one_step(token: torch.Tensor, pos: int, n: int, room: int):  # sampling, forcing, recording
                return pick(e.decode_token(token, pos), n)

            greedy = forced is None and sampler.generator is None and not opts.record_logits
            advance = self._greedy_advance() if greedy else one_step
            steps = self._token_stream(lambda: pick(logits, 0), len(prompt_ids), limit, advance)
            for tok_id, chosen_from in steps:
                if not tokens:
                    stats.first_token_ms = now_ms()
                tokens.append(tok_id)
                if chosen_from is not None:
                    recorded.append(chosen_from)
                if tok_id == self.tok.eos_id and len(tokens) > opts.min_new_tokens and forced is None:
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
        stats.inference_end_ms = now_ms()
        stats.generated_tokens = len(tokens)
        stats.finish_memory(e.device)
        text = self.tok.decode([t for t in tokens if t < self.tok.vocab_size and t != self.tok.eos_id])
        return GenerationResult(text, prompt_ids, tokens, stop, stats, recorded)

    def _token_stream(self, first, pos: int, limit: int, advance):
        """Yields (token id, the logits it was chosen from or None). first() gives the first token (from the
        prefill's logits); advance(token, pos, n, room) queues the steps after `token` at `pos` and gives their
        tokens [1, k], k <= room, with n tokens chosen so far. After the first token, the next steps are queued on
        the device before the host waits for these, so the host's per-step work (reading ids, streaming text)
        overlaps the GPU's and the GPU does not idle between steps (H200, 3B: 3.08 ms per token end to end
        before, 2.95 ms after, the graph replay's own time). Launches stop at `limit` tokens or the end of the
        context; a consumer that stops at EOS leaves queued steps behind, which the reset() after it follows on
        the same stream."""
        e, queue, n, ahead = self.engine, deque(), 0, 0  # ahead 0 for the first token: it is the TTFT

        def launch(tokens: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
            nonlocal n
            queue.append((tokens.to("cpu", non_blocking=True), kept, _recorded_event(e.device)))
            n += tokens.shape[1]
            return tokens[:, -1:]

        if limit < 1:
            return
        token = launch(*first())
        while True:
            while len(queue) <= ahead and n < limit and pos < e.max_seq_len:
                tokens, kept = advance(token, pos, n, min(limit - n, e.max_seq_len - pos))
                token = launch(tokens, kept)
                pos += tokens.shape[1]
            if not queue:
                return
            host, kept, done = queue.popleft()
            done.synchronize()
            ahead = 1
            kept = kept.cpu() if kept is not None else None
            for tok_id in host.view(-1).tolist():
                yield int(tok_id), kept

    def _greedy_advance(self):
        """`_token_stream`'s advance for greedy decoding with nothing recorded: in chains. The engine's
        `decode_greedy` queues k steps at once (one CUDA-graph replay for a whole chain, GreedyChainGraph) and the
        host reads a chain's tokens with one copy; two chains stay queued, as one step does otherwise. A tail
        shorter than a chain (the token limit, the context's end) runs step by step."""
        e = self.engine
        decode_greedy = getattr(e, "decode_greedy", None) or (lambda t, p, k: greedy_steps(e, t, p, k))
        chain = getattr(e, "greedy_chain", 1)

        def advance(token: torch.Tensor, pos: int, n: int, room: int):
            return decode_greedy(token, pos, chain if room >= chain else 1), None  # the argmax is the step's own

        return advance

    def prompt_for(self, audio_path: str | os.PathLike, prompt: str | None, language: str | None) -> list[Segment]:
        samples = load_audio(audio_path)
        n, most = num_chunks(len(samples)), self.engine.max_audio_chunks
        if n > most:  # pad_to_chunks says so too, later, but without the file's name
            raise AudioError(
                f"{audio_path}: audio is {len(samples) / SAMPLE_RATE:.1f} s long ({n} chunks of {CHUNK_LENGTH} s); "
                f"this bundle takes at most {most} chunks ({most * CHUNK_LENGTH} s)"
            )
        return chat_prompt(self.tok, samples, prompt) if prompt else transcription_prompt(self.tok, samples, language)
