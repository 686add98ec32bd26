"""What an export is asked for: the options every family's exporter takes (`ExportOptions`, checked as they are
made), and the dtypes and quantisation schemes they name."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from runner.audio import DEFAULT_AUDIO_CHUNKS, context_for
from runner.digests import default_cache_dir
from runner.errors import Cancellation, ExportError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
QUANTS = ("none", "int4", "fp8")  # --quant: weight-only int4 or fp8 of the decoder's linear layers (export/quant.py)


@dataclass(frozen=True)
class ExportOptions:
    device: str = "cpu"
    dtype: str = "fp32"
    max_seq_len: int | None = None  # None: room for the longest audio, a prompt and its answer (context_for)
    max_audio_chunks: int = DEFAULT_AUDIO_CHUNKS  # 10 minutes of audio in one prompt
    debug: bool = False  # AOTI debug compile, generated sources kept in the bundle's debug/ (the seed's DEBUG=1)
    cache_dir: Path | None = None  # compile cache and remembered digests (None: digests.default_cache_dir())
    check: bool = True  # run every method against eager before publishing
    pdl: bool = True  # CUDA sm_90+: decode kernels wait for their predecessor (programmatic dependent launch)
    force: bool = False  # --out holds other files: add the bundle's beside them (kept) instead of refusing
    quant: str = "none"  # "int4" / "fp8": the decoder's linear layers weight-only int4 / fp8 (runner/export/quant.py)
    max_streams: int | None = None  # a streaming family's stream slots batched in one step (None: its default)
    max_batch: int = 1  # a batching family: > 1 adds text_decoder_batch, that many sequences decoded in one step
    max_autotune: tuple[str, ...] = ()  # methods compiled with Inductor's max_autotune (GEMM templates benchmarked)
    # checked between methods and before publishing; not part of what the bundle is built from
    cancel: Cancellation = field(default_factory=Cancellation, compare=False, hash=False, repr=False)

    def __post_init__(self):
        chunks = self.max_audio_chunks
        if self.max_seq_len is None and isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1:
            object.__setattr__(self, "max_seq_len", context_for(chunks))
        for flag, value in (
            ("--max-audio-chunks", self.max_audio_chunks),
            ("--max-seq-len", self.max_seq_len),
            ("--max-batch", self.max_batch),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ExportError(f"{flag} {value}: a whole number, at least 1")
        if self.dtype not in DTYPES:
            raise ExportError(f"--dtype {self.dtype}: choose from {', '.join(DTYPES)}")
        if self.quant not in QUANTS:
            raise ExportError(f"--quant {self.quant}: choose from {', '.join(QUANTS)}")
        if self.quant == "int4" and self.device == "cuda" and self.dtype != "bf16":
            # tinygemm takes bf16 only: in fp32 every decode step would dequantise all the weights
            raise ExportError("--quant int4 on --device cuda needs --dtype bf16 (torch's int4 kernels take bf16)")
        if self.quant == "fp8" and self.dtype != "bf16":  # on the CPU too: its bundle computes as the GPU's
            raise ExportError(
                "--quant fp8 needs --dtype bf16 (the fp8 layers compute in bf16: torch's fp8 matmul gives bf16)"
            )

    @property
    def cache_root(self) -> Path:
        return Path(self.cache_dir or default_cache_dir())
