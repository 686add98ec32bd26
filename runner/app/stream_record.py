"""What a finished stream says of itself, in the library's Transcription of it (runner/app/streams.py), which
`stream --json` records (runner/app/stream.py): each token's times, the segments with their words, and the
stream's stats."""

from __future__ import annotations

from runner.families.voxtral_realtime.times import segments_of, token_times

__all__ = ["stream_stats", "timed"]


def timed(tok, spec, stream) -> dict:
    """A stream's record fields with times (runner/families/voxtral_realtime/times.py): each token's
    `token_times` [start, end] in seconds, and `segments` with their `words`."""
    times = token_times(spec, stream.positions)
    return {"token_times": [list(t) for t in times], "segments": segments_of(tok, stream.tokens, times)}


def stream_stats(session, spec, audio_seconds: float) -> dict:
    """Per-step latency p50/p99, how long after its audio arrived each token was decided, the model's own delay and
    the real-time factor."""
    t = session.times
    compute = sum(t.compute_ms)
    return {
        "audio_seconds": round(audio_seconds, 3),
        "steps": len(t.compute_ms),
        "generated_tokens": len(session.tokens),
        "step_ms_p50": round(_percentile(t.compute_ms, 50), 3),
        "step_ms_p99": round(_percentile(t.compute_ms, 99), 3),
        "token_lag_ms_p50": round(_percentile(t.lag_ms, 50), 3),
        "token_lag_ms_p99": round(_percentile(t.lag_ms, 99), 3),
        "model_delay_ms": spec.num_delay_tokens * spec.samples_per_token / 16.0,  # 16 samples per ms
        "rtf": round(compute / 1e3 / audio_seconds, 4) if audio_seconds else 0.0,
    }


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]
