"""What a run may switch, as one frozen value. The CLI builds it once from its flags and the environment
(runner/app/options.py); nothing below the CLI reads the environment."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner.errors import GenerationError

# Greedy tokens per decode-graph replay: each step's argmax feeds the next inside the graph, so per chain the
# stream carries one replay, one copy to the host and one event instead of one of each per token.
GREEDY_CHAIN = 8


@dataclass(frozen=True)
class RuntimeOptions:
    cuda_graph: bool = True  # CUDA: decode steps and repeated prefills replayed as CUDA graphs
    pdl: bool = True  # CUDA: programmatic graph edges for a bundle whose kernels wait (manifest `pdl`)
    greedy_chain: int = GREEDY_CHAIN  # greedy steps per decode-graph replay; 1: one step per replay
    rehash: bool = False  # hash every bundle file again, ignoring the digests remembered for it
    cache_dir: Path | None = None  # where verified digests are remembered (None: bundle.default_cache_dir())

    def __post_init__(self):
        if isinstance(self.greedy_chain, bool) or not isinstance(self.greedy_chain, int) or self.greedy_chain < 1:
            raise GenerationError(f"greedy chain {self.greedy_chain!r}: a whole number of steps, at least 1")
