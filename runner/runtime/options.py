"""What a run may switch, as one frozen value. The CLI builds it once from its flags and the environment
(runner/app/options.py); nothing below the CLI reads the environment."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RuntimeOptions:
    cuda_graph: bool = True  # CUDA: decode steps and repeated prefills replayed as CUDA graphs
    warm_up: bool = True  # CUDA: first method calls and the decode graph's capture at load (ProgramEngine.warm_up)
    pdl: bool = True  # CUDA: programmatic graph edges for a bundle whose kernels wait (manifest `pdl`)
    rehash: bool = False  # hash every bundle file again, ignoring the digests remembered for it
    cache_dir: Path | None = None  # where verified digests are remembered (None: digests.default_cache_dir())
