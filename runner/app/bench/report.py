"""What a benchmark run is, and the ways it is written out: the PyTorch OSS benchmark "v3" JSON records, a
markdown table (stdout and the GitHub job summary), a PNG chart, and the regression gate against a baseline.

No torch here: a report can be read, compared and rendered where only the JSON is at hand.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

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
    group: str  # "load" | "method" | "e2e" | "memory"


METHODS = ("preprocessor", "audio_encoder", "token_embedding", "text_decoder", "text_decoder_step")
FIGURES: tuple[Figure, ...] = (
    Figure("load_verify_ms", "load: bundle verification", "ms", "lower", "load"),
    *(Figure(f"load_{m}_ms", f"load: {m} init", "ms", "lower", "load") for m in METHODS),
    Figure("load_total_ms", "load: total", "ms", "lower", "load"),
    Figure("preprocessor_ms", "preprocessor", "ms", "lower", "method"),
    Figure("audio_encoder_ms", "audio_encoder", "ms", "lower", "method"),
    Figure("audio_encoder_graph_ms", "audio_encoder, CUDA graph replay", "ms", "lower", "method"),
    Figure("token_embedding_ms", "token_embedding", "ms", "lower", "method"),
    Figure("text_decoder_prefill_ms", "text_decoder prefill", "ms", "lower", "method"),
    Figure("text_decoder_decode_ms", "text_decoder decode step", "ms", "lower", "method"),
    Figure("ttft_ms", "e2e: time to first token", "ms", "lower", "e2e"),
    Figure("prefill_tokens_per_s", "e2e: prefill", "tokens/s", "higher", "e2e"),
    Figure("decode_tokens_per_s", "e2e: decode", "tokens/s", "higher", "e2e"),
    Figure("e2e_total_ms", "e2e: total", "ms", "lower", "e2e"),
    Figure("real_time_factor", "e2e: real-time factor", "x", "lower", "e2e"),
    Figure("peak_memory_mb", "peak memory", "MiB", "lower", "memory"),
)
FIGURE = {f.key: f for f in FIGURES}


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
    ctx = run.context
    benchmark = {
        "name": "voxtral-aoti-runner",
        "mode": "inference",
        "dtype": ctx["dtype"],
        "extra_info": {k: str(v) for k, v in ctx.items()},
    }
    runner = {
        "name": ctx.get("runner", "local"),
        "type": ctx["device"],
        "cpu_info": ctx.get("cpu", ""),
        "gpu_info": ctx.get("gpu", ""),
        "extra_info": {},
    }

    def record(backend: str, metric: dict, info: dict[str, str]) -> dict:
        return {
            "benchmark": benchmark,
            "model": {
                "name": ctx["model"],
                "type": "OSS model",
                "backend": backend,
                "origins": ["pytorch"],
                "extra_info": {k: str(v) for k, v in info.items()},
            },
            "metric": metric,
            "runners": [runner],
        }

    records = []
    for res in run.results:
        if res.error is not None:
            records.append(
                record(
                    res.backend, {"name": "error", "benchmark_values": [], "extra_info": {"error": res.error}}, res.info
                )
            )
            continue
        for fig in FIGURES:
            s = res.summary(fig.key)
            if s is None:
                continue
            extra = {
                "unit": fig.unit,
                "better": fig.better,
                "median": _fmt(s.median),
                "p90": _fmt(s.p90),
                "min": _fmt(s.min),
                "max": _fmt(s.max),
                "trimmed_mean": _fmt(s.trimmed_mean),
                "n": str(s.n),
            }
            records.append(
                record(
                    res.backend,
                    {"name": fig.key, "benchmark_values": res.samples[fig.key], "extra_info": extra},
                    res.info,
                )
            )
    for peer in run.peers:
        for fig, r in ratios(run, peer):
            records.append(
                record(
                    f"{OURS}-vs-{peer.backend}",
                    {
                        "name": fig.key,
                        "benchmark_values": [r],
                        "extra_info": {"unit": "x", "better": "higher", "definition": RATIO_NOTE},
                    },
                    {},
                )
            )
    return records


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
            elif m["name"] in FIGURE:
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


def markdown(run: BenchRun) -> str:
    ctx, peers = run.context, [p for p in run.peers if p.error is None]
    lines = [
        f"### Voxtral benchmark: {ctx['model']} on {ctx['device']} ({ctx['dtype']})",
        "",
        f"bundle `{ctx['bundle']}` (manifest sha256 {ctx['bundle_digest'][:12]}), torch {ctx['torch_version']}, "
        f"git {short_sha(ctx['git_sha'], 12)}, {ctx['arch']}; {ctx['runs']} runs after {ctx['warmup']} warm-up; "
        f"per method: {ctx['chunks']} chunk(s), prefill {ctx['prefill_tokens']} tokens; e2e: "
        f"`{Path(ctx['audio']).name}` ({ctx['audio_seconds']} s), {ctx['new_tokens']} new tokens; "
        f"load average {ctx.get('load_average', '?')} at the end",
        "",
    ]
    head = [
        "figure",
        LABELS[OURS],
        *(LABELS.get(p.backend, p.backend) for p in peers),
        *(f"ours vs {LABELS.get(p.backend, p.backend)}" for p in peers),
    ]
    lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    by_peer = [dict((f.key, r) for f, r in ratios(run, p)) for p in peers]
    for fig in FIGURES:
        cells = [_cell(r.summary(fig.key), fig.unit) for r in (run.ours, *peers)]
        if all(c == "–" for c in cells):
            continue
        rs = [f"{rp[fig.key]:.2f}x" if fig.key in rp else "–" for rp in by_peer]
        lines.append(f"| {fig.label} ({fig.unit}) | " + " | ".join(cells + rs) + " |")
    lines += ["", f"median (p90) per figure; {RATIO_NOTE}. Peak memory: {ctx['memory_kind']}."]
    for p in run.peers:
        if p.error is not None:
            lines.append(f"\n{LABELS.get(p.backend, p.backend)}: not measured: {p.error}")
        elif p.info.get("note"):
            lines.append(f"\n{LABELS.get(p.backend, p.backend)}: {p.info['note']}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- chart


def write_chart(run: BenchRun, path: Path) -> None:
    """Horizontal bars per figure (median, whiskers min..max), ours beside each peer; log scale, since a decode
    step and a whole transcription differ by orders of magnitude."""
    try:
        import matplotlib
    except ImportError:
        raise RunnerError(f"--chart {path}: needs matplotlib (pip install '.[bench]')") from None

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    backends = [r for r in run.results if r.error is None]
    color = {b.backend: f"C{i}" for i, b in enumerate(run.results)}  # one colour per backend in both panels
    panels = [
        ("per method", [f for f in FIGURES if f.group == "method"]),
        ("end to end", [f for f in FIGURES if f.group == "e2e" and f.unit == "ms"] + [FIGURE["load_total_ms"]]),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), constrained_layout=True)
    height = 0.8 / max(len(backends), 1)
    for ax, (title, figs) in zip(axes, panels):
        figs = [f for f in figs if any(b.samples.get(f.key) for b in backends)]
        for i, b in enumerate(backends):
            ys, xs, lo, hi = [], [], [], []
            for j, f in enumerate(figs):
                s = b.summary(f.key)
                if s is None or s.median <= 0:
                    continue
                ys.append(j + (i - (len(backends) - 1) / 2) * height)
                xs.append(s.median)
                lo.append(s.median - s.min)
                hi.append(s.max - s.median)
            if xs:
                ax.barh(ys, xs, height=height, xerr=[lo, hi], capsize=2, color=color[b.backend])
        ax.set_yticks(range(len(figs)), [f.label for f in figs])
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms (median; whiskers min..max)")
        ax.set_title(title)
        ax.grid(axis="x", which="both", alpha=0.3)
    handles = [Patch(color=color[b.backend], label=LABELS.get(b.backend, b.backend)) for b in backends]
    try:
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles))
    except ValueError:  # matplotlib < 3.7 has no "outside" placement
        axes[0].legend(handles=handles, loc="lower right")
    ctx = run.context
    fig.suptitle(
        f"Voxtral {ctx['model']} on {ctx['arch']} ({ctx['device']}, {ctx['dtype']}), git {short_sha(ctx['git_sha'], 8)}"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- regression gate


@dataclass(frozen=True)
class Change:
    metric: str
    unit: str
    current: float
    baseline: float
    worse_pct: float  # how much worse than the baseline, in percent (negative: better)

    def describe(self) -> str:
        return (
            f"{self.metric} {self.current:.4g} {self.unit} vs baseline {self.baseline:.4g} {self.unit} "
            f"({self.worse_pct:+.1f}% worse)"
        )


def _medians(records: list[dict], backend: str) -> dict[str, tuple[float, dict]]:
    out = {}
    for r in records:
        m = r.get("metric", {})
        if r.get("model", {}).get("backend") != backend or m.get("name") == "error":
            continue
        extra = m.get("extra_info") or {}
        try:
            value = float(extra["median"]) if "median" in extra else statistics.median(m["benchmark_values"])
        except (KeyError, ValueError, TypeError, statistics.StatisticsError):
            continue
        out[m["name"]] = (value, extra)
    return out


def compare(current: list[dict], baseline: list[dict], gate: set[str]) -> list[Change]:
    """Our figures against the baseline's (medians), for metrics whose name or group is in `gate`."""
    base, changes = _medians(baseline, OURS), []
    for name, (value, extra) in _medians(current, OURS).items():
        fig = FIGURE.get(name)
        if name not in base or not ({name, fig.group if fig else ""} & gate):
            continue
        old = base[name][0]
        if old <= 0:
            continue
        better = extra.get("better", fig.better if fig else "lower")
        worse = (value / old - 1) * 100 if better == "lower" else (1 - value / old) * 100
        changes.append(Change(name, extra.get("unit", ""), value, old, worse))
    return changes


def check_baseline_matches(current: list[dict], baseline: list[dict], path: Path) -> None:
    """Same model, device and dtype, or the comparison means nothing (the bundle digest may differ: a new
    export of the same model is exactly what the gate is for)."""

    def ident(records: list[dict]) -> tuple:
        r = next((r for r in records if r["model"].get("backend") == OURS), None)
        if r is None:
            return ()
        return (r["model"].get("name"), r["benchmark"].get("extra_info", {}).get("device"), r["benchmark"].get("dtype"))

    a, b = ident(current), ident(baseline)
    if not b:
        raise RunnerError(f"{path}: the baseline has no records for {OURS}")
    if a != b:
        raise RunnerError(f"{path}: baseline is for {' '.join(map(str, b))}, this run is {' '.join(map(str, a))}")
