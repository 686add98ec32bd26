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
    # audio_encoder on at most this many 30 s chunks per call (0: a prompt's chunks in one call): a long input's
    # encoder activations then follow this, not its length
    encoder_chunks: int = 0
    # text_decoder's prefill on at most this many prompt tokens per call, each piece attending to the ones before
    # it in the cache (0: a prompt in one call): a long prompt's activations then follow this, not its length.
    # Only bundles whose text_decoder takes a prompt from any position (manifest `prefill_pieces`: CUDA exports)
    prefill_chunk: int = 0
    rehash: bool = False  # hash every bundle file again, ignoring the digests remembered for it
    cache_dir: Path | None = None  # where verified digests are remembered (None: digests.default_cache_dir())
