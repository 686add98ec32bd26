"""What a benchmark run is, and the ways it is written out: the PyTorch OSS benchmark "v3" JSON records and a
headline markdown table (stdout and the GitHub job summary; every figure stays in the JSON). The chart is
chart.py's, the regression gate gate.py's.

No torch here: a report can be read, compared and rendered where only the JSON is at hand.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from runner.app.e2e_summary import md_text
from runner.errors import RunnerError

OURS = "aoti"
LABELS = {OURS: "ours (AOTI)", "eager": "eager", "hf": "HF", "hf-compile": "HF compile"}
TRIM = 0.2  # trimmed mean: drop this share of the samples at each end (ExecuTorch's benchmark trims outliers)
RATIO_NOTE = "ratio = peer / ours for lower-is-better figures, ours / peer for higher-is-better; above 1 ours is better"


# ---------------------------------------------------------------- figures and statistics


@dataclass(frozen=True)
class Figure:
    key: str  # the metric name in the JSON records
    label: str
    unit: str
    better: str  # "lower" | "higher"
    group: str  # "load" | "method" | "e2e" | "first" | "memory"


METHODS = ("preprocessor", "audio_encoder", "token_embedding", "text_decoder", "text_decoder_step")
FIGURES: tuple[Figure, ...] = (
    Figure("load_verify_ms", "load: bundle verification", "ms", "lower", "load"),
    *(Figure(f"load_{m}_ms", f"load: {m} init", "ms", "lower", "load") for m in METHODS),
    Figure("load_weights_ms", "load: of the inits, weights files onto the device", "ms", "lower", "load"),
    Figure("load_total_ms", "load: total", "ms", "lower", "load"),
    Figure("load_warm_up_ms", "load: warm-up (first calls, decode graph)", "ms", "lower", "load"),
    Figure("preprocessor_ms", "preprocessor", "ms", "lower", "method"),
    Figure("audio_encoder_ms", "audio_encoder", "ms", "lower", "method"),
    Figure("audio_encoder_graph_ms", "audio_encoder, CUDA graph replay", "ms", "lower", "method"),
    Figure("token_embedding_ms", "token_embedding", "ms", "lower", "method"),
    Figure("text_decoder_prefill_ms", "text_decoder prefill", "ms", "lower", "method"),
    Figure("text_decoder_decode_ms", "text_decoder decode step", "ms", "lower", "method"),
    Figure("ttft_ms", "e2e: time to first token", "ms", "lower", "e2e"),
    # one sample per run (the process's first generate()): its own group, outside the default gate's
    Figure("first_ttft_ms", "e2e: time to first token, first generate()", "ms", "lower", "first"),
    Figure("prefill_tokens_per_s", "e2e: prefill", "tokens/s", "higher", "e2e"),
    Figure("decode_tokens_per_s", "e2e: decode", "tokens/s", "higher", "e2e"),
    Figure("e2e_total_ms", "e2e: total", "ms", "lower", "e2e"),
    Figure("real_time_factor", "e2e: real-time factor", "x", "lower", "e2e"),
    Figure("peak_memory_mb", "peak memory", "MiB", "lower", "memory"),
    # CUDA: each method phase's own peak (weights and caches included), the run's peak the largest of them and e2e's
    Figure("peak_memory_audio_encoder_mb", "peak memory: audio_encoder", "MiB", "lower", "memory"),
    Figure("peak_memory_text_decoder_prefill_mb", "peak memory: text_decoder prefill", "MiB", "lower", "memory"),
    Figure("peak_memory_text_decoder_decode_mb", "peak memory: text_decoder decode step", "MiB", "lower", "memory"),
    Figure("peak_memory_e2e_mb", "peak memory: generate() alone", "MiB", "lower", "memory"),
    Figure("peak_host_rss_mb", "peak host RSS, load and run (CUDA)", "MiB", "lower", "memory"),
)
FIGURE = {f.key: f for f in FIGURES}
# `--throughput-files N --batch B,...`: N files through generate_many at batch B, one timed pass each; every
# figure is recorded per batch size as `{key}_b{B}` (throughput_rtfx_b8), so batch sizes never share a name.
THROUGHPUT: tuple[Figure, ...] = (
    Figure(
        "throughput_decode_tokens_per_s", "throughput: generated tokens / wall time", "tokens/s", "higher", "throughput"
    ),
    Figure("throughput_rtfx", "throughput: audio seconds / wall second (RTFx)", "x", "higher", "throughput"),
    Figure("throughput_file_p50_ms", "throughput: per-file latency p50", "ms", "lower", "throughput"),
    Figure("throughput_file_p99_ms", "throughput: per-file latency p99", "ms", "lower", "throughput"),
    Figure("throughput_wall_ms", "throughput: wall time after load", "ms", "lower", "throughput"),
    # one decode step at this batch, timed alone: the per-token latency a sequence sees (batch 1: the graph step)
    Figure("throughput_step_ms", "throughput: decode step at this batch", "ms", "lower", "throughput"),
)
_THROUGHPUT = {f.key: f for f in THROUGHPUT}
GROUPS = tuple(dict.fromkeys(f.group for f in (*FIGURES, *THROUGHPUT)))  # load, method, e2e, first, memory, throughput


def throughput_key(key: str, batch: int) -> str:
    return f"{key}_b{batch}"


def figure_for(key: str) -> Figure | None:
    """A fixed figure by its name, or a throughput figure of one batch size (`throughput_rtfx_b8`)."""
    if key in FIGURE:
        return FIGURE[key]
    base, _, batch = key.rpartition("_b")
    if base in _THROUGHPUT and batch.isdigit():
        fig = _THROUGHPUT[base]
        return Figure(key, f"{fig.label}, batch {int(batch)}", fig.unit, fig.better, fig.group)
    return None


def throughput_error_key(batch: int) -> str:
    """The info key of why a batch size was not measured (a bundle without --max-batch, say)."""
    return f"throughput_b{batch}_error"


def throughput_errors(res: BackendResult) -> dict[int, str]:
    """Each batch size left out of the throughput figures, with why."""
    out = {}
    for key, why in res.info.items():
        head, _, tail = key.partition("_b")
        batch = tail.removesuffix("_error")
        if head == "throughput" and tail.endswith("_error") and batch.isdigit():
            out[int(batch)] = why
    return out


def throughput_batches(res: BackendResult) -> list[int]:
    """The batch sizes with throughput figures (or a throughput error) in a result, in order."""
    found = {int(k.rpartition("_b")[2]) for k in res.samples if k.startswith("throughput_") and figure_for(k)}
    return sorted(found | set(throughput_errors(res)))


def figures_of(res: BackendResult) -> list[Figure]:
    """The fixed figures, then the throughput figures of each batch size this result has."""
    return [*FIGURES, *(figure_for(throughput_key(f.key, b)) for b in throughput_batches(res) for f in THROUGHPUT)]


# The same-run table a person reads in ten seconds (at most MAX_HEADLINE rows); the load breakdown and every
# statistic stay in the JSON records.
HEADLINE = (
    "decode_tokens_per_s",
    "ttft_ms",
    "prefill_tokens_per_s",
    "e2e_total_ms",
    "real_time_factor",
    "first_ttft_ms",
    "preprocessor_ms",
    "audio_encoder_ms",
    "audio_encoder_graph_ms",
    "token_embedding_ms",
    "text_decoder_prefill_ms",
    "text_decoder_decode_ms",
    "peak_memory_mb",
    "load_total_ms",
    "load_warm_up_ms",
)
MAX_HEADLINE = 15


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default): q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    rank = (len(xs) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def trimmed_mean(values: list[float], trim: float = TRIM) -> float:
    """Mean after dropping floor(n * trim) samples at each end (scipy.stats.trim_mean's rule)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("trimmed mean of no values")
    k = int(len(xs) * trim)
    return statistics.fmean(xs[k : len(xs) - k])


@dataclass(frozen=True)
class Summary:
    median: float
    p90: float
    min: float
    max: float
    trimmed_mean: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Summary:
        return cls(
            statistics.median(values),
            percentile(values, 90),
            min(values),
            max(values),
            trimmed_mean(values),
            len(values),
        )


def short_sha(sha: str, n: int) -> str:
    return sha[:n] + ("-dirty" if sha.endswith("-dirty") else "")


def ratio(fig: Figure, ours: float, peer: float) -> float | None:
    """How many times better ours is (above 1: ours is faster / leaner)."""
    num, den = (peer, ours) if fig.better == "lower" else (ours, peer)
    return num / den if den > 0 and num >= 0 else None


# ---------------------------------------------------------------- one run


@dataclass
class BackendResult:
    backend: str  # OURS | "eager" | "hf" | "hf-compile"
    samples: dict[str, list[float]] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    def summary(self, key: str) -> Summary | None:
        xs = self.samples.get(key)
        return Summary.of(xs) if xs else None


@dataclass
class BenchRun:
    context: dict[str, str]  # device, torch version, git sha, bundle digest, shapes, ... (all strings)
    results: list[BackendResult]  # ours first

    @property
    def ours(self) -> BackendResult:
        return self.results[0]

    @property
    def peers(self) -> list[BackendResult]:
        return self.results[1:]


# ---------------------------------------------------------------- v3 records


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def to_records(run: BenchRun) -> list[dict]:
    """One record per (backend, figure), plus one per (peer, figure) ratio and per failed peer: the PyTorch OSS
    benchmark database's v3 format (benchmark / model / metric; every extra_info value a string)."""
    record = _Records(run.context)
    records = []
    for res in run.results:
        if res.error is not None:
            error = {"name": "error", "benchmark_values": [], "extra_info": {"error": res.error}}
            records.append(record(res.backend, error, res.info))
            continue
        for fig in figures_of(res):
            s = res.summary(fig.key)
            if s is not None:
                metric = {"name": fig.key, "benchmark_values": res.samples[fig.key], "extra_info": _summary(fig, s)}
                records.append(record(res.backend, metric, res.info))
    for peer in run.peers:
        for fig, r in ratios(run, peer):
            extra = {"unit": "x", "better": "higher", "definition": RATIO_NOTE}
            metric = {"name": fig.key, "benchmark_values": [r], "extra_info": extra}
            records.append(record(f"{OURS}-vs-{peer.backend}", metric, {}))
    return records


def _summary(fig: Figure, s: Summary) -> dict[str, str]:
    return {
        "unit": fig.unit,
        "better": fig.better,
        "median": _fmt(s.median),
        "p90": _fmt(s.p90),
        "min": _fmt(s.min),
        "max": _fmt(s.max),
        "trimmed_mean": _fmt(s.trimmed_mean),
        "n": str(s.n),
    }


class _Records:
    """A v3 record of one metric, with the run's benchmark and runner entries (one run context)."""

    def __init__(self, ctx: dict[str, str]):
        self.model = ctx["model"]
        self.benchmark = {
            "name": "voxtral-aoti-runner",
            "mode": "inference",
            "dtype": ctx["dtype"],
            "extra_info": {k: str(v) for k, v in ctx.items()},
        }
        self.runner = {
            "name": ctx.get("runner", "local"),
            "type": ctx["device"],
            "cpu_info": ctx.get("cpu", ""),
            "gpu_info": ctx.get("gpu", ""),
            "extra_info": {},
        }

    def __call__(self, backend: str, metric: dict, info: dict[str, str]) -> dict:
        return {
            "benchmark": self.benchmark,
            "model": {
                "name": self.model,
                "type": "OSS model",
                "backend": backend,
                "origins": ["pytorch"],
                "extra_info": {k: str(v) for k, v in info.items()},
            },
            "metric": metric,
            "runners": [self.runner],
        }


def ratios(run: BenchRun, peer: BackendResult) -> list[tuple[Figure, float]]:
    out = []
    if peer.error is not None:
        return out
    for fig in FIGURES:
        a, b = run.ours.summary(fig.key), peer.summary(fig.key)
        if a and b and (r := ratio(fig, a.median, b.median)) is not None:
            out.append((fig, r))
    return out


CONTEXT_KEYS = (
    "model",
    "device",
    "dtype",
    "arch",
    "torch_version",
    "git_sha",
    "bundle",
    "bundle_digest",
    "runs",
    "warmup",
    "chunks",
    "prefill_tokens",
    "audio",
    "audio_seconds",
    "new_tokens",
    "memory_kind",
)


def from_records(records: list[dict], source: Path) -> BenchRun:
    """The run back from its records (ratios are recomputed): to re-render or re-gate an earlier result."""
    results: dict[str, BackendResult] = {}
    try:
        ctx = {k: "?" for k in CONTEXT_KEYS} | dict(records[0]["benchmark"]["extra_info"])
        for r in records:
            backend, m = r["model"]["backend"], r["metric"]
            if "-vs-" in backend:
                continue
            res = results.setdefault(backend, BackendResult(backend, info=dict(r["model"].get("extra_info") or {})))
            if m["name"] == "error":
                res.error = m["extra_info"]["error"]
            elif figure_for(m["name"]) is not None:
                res.samples[m["name"]] = [float(v) for v in m["benchmark_values"]]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise RunnerError(f"{source}: not records written by runner bench ({type(e).__name__}: {e})") from None
    if OURS not in results:
        raise RunnerError(f"{source}: no records for {OURS}")
    return BenchRun(ctx, [results.pop(OURS), *results.values()])


def write_json(run: BenchRun, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_records(run), indent=1) + "\n")


def read_records(path: Path) -> list[dict]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunnerError(f"{path}: cannot read benchmark JSON ({e})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) and "metric" in r and "model" in r for r in data):
        raise RunnerError(f"{path}: not a list of v3 benchmark records")
    return data


# ---------------------------------------------------------------- markdown


def _cell(s: Summary | None, unit: str) -> str:
    if s is None:
        return "–"
    d = 3 if unit == "x" else (1 if max(abs(s.median), abs(s.p90)) >= 10 else 3)
    return f"{s.median:.{d}f} (p90 {s.p90:.{d}f})" if s.n > 1 else f"{s.median:.{d}f}"


def _label(backend: str) -> str:
    return md_text(LABELS.get(backend, backend))


def headline_rows(run: BenchRun) -> list[list[str]]:
    """The headline figures this run has: [figure, ours, each peer, ours vs each peer]; at most MAX_HEADLINE."""
    peers = [p for p in run.peers if p.error is None]
    by_peer = [dict((f.key, r) for f, r in ratios(run, p)) for p in peers]
    rows = []
    for fig in (FIGURE[k] for k in HEADLINE):
        cells = [_cell(r.summary(fig.key), fig.unit) for r in (run.ours, *peers)]
        if all(c == "–" for c in cells):
            continue
        rs = [f"{rp[fig.key]:.2f}x" if fig.key in rp else "–" for rp in by_peer]
        rows.append([f"{fig.label} ({fig.unit})", *cells, *rs])
    return rows[:MAX_HEADLINE]


def markdown(run: BenchRun, title: str | None = None) -> str:
    """The headline same-run table (ours beside each peer, with ratios), what was measured in one line, and the
    peers that could not run. Every figure, with all its samples, is in the JSON records."""
    peers = [p for p in run.peers if p.error is None]
    raw = run.context
    shown = {"git_sha": short_sha(raw["git_sha"], 12), "audio": Path(raw["audio"]).name}
    ctx = {k: md_text(v) for k, v in (raw | shown | {"bundle_digest": raw["bundle_digest"][:12]}).items()}
    title = md_text(title or f"Voxtral benchmark: {raw['model']} on {raw['device']} ({raw['dtype']})")
    lines = [
        f"### {title}",
        "",
        f"{ctx['arch']}, torch {ctx['torch_version']}, git {ctx['git_sha']}; bundle {ctx['bundle']} "
        f"(manifest sha256 {ctx['bundle_digest']}); median (p90) of {ctx['runs']} runs after {ctx['warmup']} "
        f"warm-up; e2e: {ctx['audio']} ({ctx['audio_seconds']} s), {ctx['new_tokens']} new tokens; "
        f"per method: {ctx['chunks']} chunk(s), prefill {ctx['prefill_tokens']} tokens",
        "",
    ]
    if ctx.get("fallbacks"):
        lines += [f"**The bundle holds fallbacks, slower than the methods they replace:** {ctx['fallbacks']}", ""]
    head = [
        "figure",
        _label(OURS),
        *(_label(p.backend) for p in peers),
        *(f"ours vs {_label(p.backend)}" for p in peers),
    ]
    lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in headline_rows(run)]
    lines += [
        "",
        f"{RATIO_NOTE}. Peak memory: {ctx['memory_kind']}. Load average {ctx.get('load_average', '?')} at the end. "
        "Every figure (the load breakdown too) and every sample: the JSON records.",
    ]
    for p in run.peers:
        if p.error is not None:
            lines.append(f"\n{_label(p.backend)}: not measured: {md_text(p.error)}")
        elif p.info.get("note"):
            lines.append(f"\n{_label(p.backend)}: {md_text(p.info['note'])}")
    return "\n".join(lines) + "\n"
