"""Run statistics, printed the way ExecuTorch's runner prints them: one `PyTorchObserver {json}` line that
tools parse, and a few human lines (rates, time to first token, real-time factor, memory)."""

from __future__ import annotations

import json
import resource
import time
from dataclasses import asdict, dataclass

import torch

SCALING_FACTOR_UNITS_PER_SECOND = 1000  # all *_ms fields are milliseconds


def now_ms() -> float:
    return time.perf_counter() * 1e3


@dataclass
class Stats:
    model_load_start_ms: float = 0.0
    model_load_end_ms: float = 0.0
    warm_up_ms: float = 0.0  # of the load above: the engine's warm-up (CUDA: first calls, the decode graph)
    inference_start_ms: float = 0.0
    prompt_eval_end_ms: float = 0.0
    first_token_ms: float = 0.0
    inference_end_ms: float = 0.0
    aggregate_sampling_time_ms: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    audio_seconds: float = 0.0
    gpu_total_bytes: int = -1
    gpu_free_before_load_bytes: int = -1
    gpu_free_after_load_bytes: int = -1
    gpu_peak_usage_mb: float = -1.0
    peak_rss_mb: float = 0.0
    # Audio longer than one prompt takes runs as several prompt windows: the counts above are their sums, the
    # timestamps span them all, and the durations below are summed over them (below 0: one window, whose
    # durations the timestamps give).
    windows: int = 1
    prompt_eval_total_ms: float = -1.0
    generation_total_ms: float = -1.0
    decode_total_ms: float = -1.0

    @property
    def ttft_ms(self) -> float:
        return self.first_token_ms - self.inference_start_ms

    @property
    def prompt_eval_ms(self) -> float:
        return (
            self.prompt_eval_total_ms
            if self.prompt_eval_total_ms >= 0
            else self.prompt_eval_end_ms - self.inference_start_ms
        )

    @property
    def generation_ms(self) -> float:
        """From the end of prefill to the last token."""
        return (
            self.generation_total_ms
            if self.generation_total_ms >= 0
            else self.inference_end_ms - self.prompt_eval_end_ms
        )

    @property
    def decode_ms(self) -> float:
        """From the first token to the last: the decode steps."""
        return self.decode_total_ms if self.decode_total_ms >= 0 else self.inference_end_ms - self.first_token_ms

    @property
    def prefill_tokens_per_s(self) -> float:
        dt = self.prompt_eval_ms
        return self.prompt_tokens / dt * 1e3 if dt > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # each window's first token comes out of its prefill; the rest are decode steps
        dt, steps = self.decode_ms, self.generated_tokens - self.windows
        return steps / dt * 1e3 if dt > 0 and steps > 0 else 0.0

    @property
    def real_time_factor(self) -> float:
        """Processing time over audio duration (below 1 is faster than real time)."""
        dt = (self.inference_end_ms - self.inference_start_ms) / 1e3
        return dt / self.audio_seconds if self.audio_seconds > 0 else 0.0

    def record_gpu_memory(self, when: str) -> None:
        """Free/total device memory around the model load ("before_load" / "after_load"), as the seed's runner."""
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            self.gpu_total_bytes = total
            setattr(self, f"gpu_free_{when}_bytes", free)

    def finish_memory(self, device: str) -> None:
        self.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if device == "cuda" and torch.cuda.is_available():
            self.gpu_peak_usage_mb = torch.cuda.max_memory_allocated() / 2**20

    def to_dict(self) -> dict:
        d = asdict(self)
        d["SCALING_FACTOR_UNITS_PER_SECOND"] = SCALING_FACTOR_UNITS_PER_SECOND
        d.update(
            ttft_ms=self.ttft_ms,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
            real_time_factor=self.real_time_factor,
        )
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}

    def observer_line(self) -> str:
        return "PyTorchObserver " + json.dumps(self.to_dict())

    def human_lines(self) -> list[str]:
        lines = [
            f"Prompt tokens: {self.prompt_tokens}  Generated tokens: {self.generated_tokens}",
            f"Model load time: {(self.model_load_end_ms - self.model_load_start_ms) / 1e3:.3f} s"
            + (f" (warm-up {self.warm_up_ms / 1e3:.3f} s)" if self.warm_up_ms else ""),
            f"Prompt evaluation: {self.prompt_eval_ms / 1e3:.3f} s ({self.prefill_tokens_per_s:.1f} tokens/s)",
            f"Generated {self.generated_tokens} tokens: {self.generation_ms / 1e3:.3f} s "
            f"({self.decode_tokens_per_s:.1f} tokens/s)",
            f"Time to first generated token: {self.ttft_ms / 1e3:.3f} s",
            f"Sampling time over {self.generated_tokens} tokens: {self.aggregate_sampling_time_ms / 1e3:.3f} s",
        ]
        if self.audio_seconds:
            windows = f" in {self.windows} prompt windows" if self.windows > 1 else ""
            lines.append(f"Audio: {self.audio_seconds:.2f} s{windows}, real-time factor {self.real_time_factor:.3f}")
        if self.gpu_peak_usage_mb >= 0:
            lines.append(
                f"GPU memory: peak {self.gpu_peak_usage_mb:.1f} MiB, total {self.gpu_total_bytes / 2**20:.0f} MiB, "
                f"free before/after load {self.gpu_free_before_load_bytes / 2**20:.0f}/"
                f"{self.gpu_free_after_load_bytes / 2**20:.0f} MiB"
            )
        else:
            lines.append(f"Peak RSS: {self.peak_rss_mb:.1f} MiB")
        return lines
