"""CUDA graphs: one warm-up-then-capture helper, and the graphs built on it (the decode step, the prefill per
input shape). Each takes callables and a device, not an engine: what
runs inside is the caller's business (runner/runtime/engine.py passes capturable method calls)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runner.errors import DelegateError
from runner.runtime import pdl

log = logging.getLogger(__name__)

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (token [1, 1], position [1]) -> logits [1, V]


class CaptureError(RuntimeError):
    """The capture failed; the warm-up before it ran, and `warm` is what it returned."""

    def __init__(self, message: str, warm: Any):
        super().__init__(message)
        self.warm = warm


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    out: Any  # what run() returned during the capture: static tensors a replay rewrites
    warm: Any  # what run() returned during the warm-up, which really ran (a capture executes nothing)


def capture_graph(run: Callable[[], Any], device: str, overlap: bool = False) -> Captured:
    """run() once on a side stream (lazy init, workspace allocation: not capturable), then captured. With
    `overlap`, the decode kernels' edges are made programmatic before the graph is instantiated (runner/runtime/pdl.py:
    each starts while the kernel before it finishes); where that fails, the graph is captured plainly. A plain
    capture that fails raises CaptureError."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = run()
    torch.cuda.current_stream().wait_stream(side)
    if overlap:
        try:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph):
                out = run()
            n = pdl.programmatic_edges(graph.raw_cuda_graph())
            graph.instantiate()
            log.info("graph: %d kernel launches overlap the kernel before them (PDL)", n)
            return Captured(graph, out, warm)
        except (TypeError, AttributeError, OSError, RuntimeError) as e:  # old torch or driver: no PDL
            log.warning("graph captured without programmatic dependent launch: %s", e)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = run()
    except (RuntimeError, DelegateError) as e:
        raise CaptureError(str(e), warm) from e
    return Captured(graph, out, warm)


class DecodeGraph:
    """One decode step as a CUDA graph. Static input tensors (token, position) are rewritten before each replay;
    the KV cache is the program's own buffer, mutated in place, so replays see every earlier step."""

    def __init__(self, step: Step, device: str, overlap: bool = False):
        self.token = torch.zeros(1, 1, dtype=torch.int64, device=device)
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)
        c = capture_graph(lambda: step(self.token, self.pos), device, overlap)
        self.graph, self.logits = c.graph, c.out

    def step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        self.token.copy_(token.view(1, 1))
        self.pos.fill_(pos)
        self.graph.replay()
        return self.logits  # static: read it before the next step


def batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes captured as CUDA graphs for a batched step (the decode slots here, the realtime streams):
    powers of two below max_batch, and max_batch."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]


class BatchGraphs:
    """The batched decode step (tokens [B, 1], positions [B] -> logits [B, V]) as one CUDA graph per batch size
    of batch_sizes(); a step of n rows replays the smallest size >= n. Its rows past n are free slots (the caller's
    contract), decoded at position 0: the cheapest for an attention that reads a row's own positions, and harmless,
    as admitting a prompt rewrites a slot from position 0. Capturing runs real steps (the warm-ups) over every row,
    so it may happen while sequences are in flight: it runs them at `park`, the context's last position, which a
    sequence writes before it attends to it."""

    def __init__(self, step: Step, device: str, max_batch: int, park: int):
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for b in batch_sizes(max_batch):
            token = torch.zeros(b, 1, dtype=torch.int64, device=device)
            pos = torch.full((b,), park, dtype=torch.int64, device=device)
            c = capture_graph(lambda token=token, pos=pos: step(token, pos), device)
            self.graphs[b] = (c.graph, token, pos, c.out)
        log.info("captured the batched decode step for batches of %s", ", ".join(map(str, self.graphs)))

    def graph_for(self, n: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(graph, its token, position and logits tensors) of the smallest captured batch >= n."""
        return self.graphs[next(b for b in self.graphs if b >= n)]

    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        graph, token, position, logits = self.graph_for(n)
        token[:n].copy_(tokens.view(n, 1))
        token[n:].zero_()
        position[:n].copy_(pos)
        position[n:].zero_()
        graph.replay()
        return logits[:n]  # static: read it before the next step


class PrefillGraphs:
    """A whole prefill (every method it calls) as one CUDA graph per shape of its inputs. Run method by method,
    the host launches each of its hundreds of kernels and the GPU waits on those launches. A transcription prompt's
    shape depends only on the audio's chunk count and the language, so a batch of files repeats one shape. A
    shape is captured the second time it is seen (its run is the warm-up) and replayed from the third; a shape
    seen once never pays for a capture. The `capacity` most recent graphs are kept: each holds the memory of its
    prefill's activations."""

    def __init__(self, device: str, capacity: int = 4):
        self.device, self.capacity = device, capacity
        self.seen: set[tuple] = set()
        self.disabled = False
        self.graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Any]] = OrderedDict()

    def run(self, compute: Callable[..., Any], inputs: list[torch.Tensor], capturable: Callable[..., Any]) -> Any:
        """compute(*inputs), or its graph's replay. `capturable` computes the same on the current stream (what a
        capture records); it runs for the warm-up and the capture."""
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
        try:
            c = capture_graph(lambda: capturable(*static), self.device)
        except CaptureError as e:  # not capturable: the prefill still works, uncaptured
            log.warning("prefill not captured as a CUDA graph (%s); running it method by method", e)
            self.disabled = True
            return e.warm
        self.graphs[key] = (c.graph, static, c.out)
        while len(self.graphs) > self.capacity:
            self.graphs.popitem(last=False)
        return c.warm
