"""bench's regression gate: our figures against a baseline run's, with a threshold per figure or group, and the
summary of what it compared."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from runner.app.bench.report import FIGURE, FIGURES, GROUPS, HEADLINE, OURS, THROUGHPUT, figure_for, read_records
from runner.app.e2e_summary import md_text
from runner.errors import RunnerError


@dataclass(frozen=True)
class Thresholds:
    """How much worse than the baseline (percent) each gated figure may be: a figure's own threshold, else its
    group's, else the default."""

    default: float = 20.0
    per: tuple[tuple[str, float], ...] = ()  # (figure or group, percent), as given

    def limit(self, metric: str) -> float:
        own = dict(self.per)
        fig = figure_for(metric)
        if metric in own:
            return own[metric]
        if fig is not None and fig.group in own:
            return own[fig.group]
        return self.default

    def describe(self) -> str:
        return f"{self.default:g}%" + "".join(f", {name} {pct:g}%" for name, pct in self.per)


def parse_thresholds(text: str, gate: set[str] | None = None) -> Thresholds:
    """`--max-regression`: `PCT`, or a comma list of a default `PCT` and `figure=PCT` / `group=PCT` items
    (`20,decode_tokens_per_s=5,memory=10`). With `gate`, every named figure or group must be one it checks."""
    flag = f"--max-regression {text}"

    def pct(item: str, value: str) -> float:
        try:
            x = float(value.strip().removesuffix("%"))
        except ValueError:
            x = math.nan
        if not math.isfinite(x) or x < 0:
            raise RunnerError(f"{flag}: {item!r} is not a percentage >= 0 (e.g. 20 or decode_tokens_per_s=5)")
        return x

    items = [i.strip() for i in str(text).split(",") if i.strip()]
    if not items:
        raise RunnerError(f"{flag}: give a percentage, or a comma list such as 20,decode_tokens_per_s=5,memory=10")
    default, per = None, {}
    for item in items:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq:
            if default is not None:
                raise RunnerError(f"{flag}: two default percentages ({default:g} and {item}); give one")
            default = pct(item, item)
            continue
        if figure_for(name) is None and name not in GROUPS:
            raise RunnerError(f"{flag}: {name} is not a figure or group ({', '.join(GROUPS)})")
        if name in per:
            raise RunnerError(f"{flag}: {name} is given twice")
        per[name] = pct(item, value)
    if gate is not None:

        def gated(key: str) -> bool:
            fig = figure_for(key)
            return key in gate or (fig is not None and fig.group in gate)

        for name in per:
            members = [f.key for f in (*FIGURES, *THROUGHPUT) if f.group == name] if name in GROUPS else [name]
            if not any(gated(k) for k in members):
                raise RunnerError(f"{flag}: {name} is not gated (--gate {','.join(sorted(gate))}); add it to --gate")
    return Thresholds(20.0 if default is None else default, tuple(per.items()))


@dataclass(frozen=True)
class Change:
    metric: str
    unit: str
    current: float
    baseline: float
    worse_pct: float  # how much worse than the baseline, in percent (negative: better)
    threshold: float = math.inf  # the most worse_pct may be

    @property
    def regressed(self) -> bool:
        return not self.worse_pct <= self.threshold  # a NaN figure is no pass: every comparison with NaN is false

    def describe(self) -> str:
        return f"{self.metric} {self.current:.4g} {self.unit} vs baseline {self.baseline:.4g} {self.unit} " + (
            "(not a number: a broken measurement)" if math.isnan(self.worse_pct) else f"({self.worse_pct:+.1f}% worse)"
        )


def _medians(records: list[dict], backend: str) -> dict[str, tuple[float, dict, dict]]:
    """Each figure's (median, metric.extra_info, model.extra_info) for `backend`."""
    out = {}
    for r in records:
        m = r.get("metric", {})
        if r.get("model", {}).get("backend") != backend or m.get("name") == "error":
            continue
        extra = m.get("extra_info") or {}
        try:
            value = float(extra["median"]) if "median" in extra else statistics.median(m["benchmark_values"])
        except (KeyError, ValueError, TypeError, OverflowError, statistics.StatisticsError):
            value = math.nan  # a figure that is there but unreadable: never a pass (Change.regressed)
        out[m["name"]] = (value, extra, r.get("model", {}).get("extra_info") or {})
    return out


def _check_like(name: str, now: tuple, base: tuple) -> None:
    """One figure measured alike in both runs: the same unit and direction, and for a throughput figure the same
    files at its batch size. Raises RunnerError (without the path) naming what differs."""
    fig = figure_for(name)
    default = {"unit": fig.unit if fig else None, "better": fig.better if fig else None}
    meaning = (
        {k: str(now[1].get(k, default[k])) for k in default},
        {k: str(base[1].get(k, default[k])) for k in default},
    )
    if diffs := _differences(*meaning, ("unit", "better")):
        raise RunnerError(f"{name} is not measured alike ({'; '.join(diffs)}; baseline vs this run): not comparable")
    head, _, batch = name.rpartition("_b")
    if fig is not None and fig.group == "throughput" and batch.isdigit():
        keys = [f"throughput_b{batch}_{k}" for k in SAME_PER_BATCH]
        if diffs := _differences(now[2], base[2], keys):
            raise RunnerError(f"{name} is for another workload ({'; '.join(diffs)}; baseline vs this run)")


def check_records(records: list, path: Path) -> None:
    """The fields the gate reads, each of its type: a malformed file is one error line naming it, not a
    traceback, and not a figure silently left out (which would pass)."""

    def bad(i: int, what: str) -> RunnerError:
        return RunnerError(f"{path}: record {i}: {what}; not a benchmark file this runner wrote")

    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise bad(i, "not an object")
        for key in ("model", "metric", "benchmark"):
            if not isinstance(r.get(key), dict):
                raise bad(i, f"{key} is not an object")
        m = r["metric"]
        if not isinstance(m.get("name"), str):
            raise bad(i, "metric.name is not a string")
        for owner, where in ((m, "metric"), (r["benchmark"], "benchmark"), (r["model"], "model")):
            if not isinstance(owner.get("extra_info", {}), dict):
                raise bad(i, f"{where}.extra_info is not an object")
        values = m.get("benchmark_values", [])
        if not isinstance(values, list) or not all(_is_number(v) for v in values):
            raise bad(i, "metric.benchmark_values is not a list of numbers")


def compare(
    current: list[dict], baseline: list[dict], gate: set[str], thresholds: Thresholds | None = None
) -> list[Change]:
    """Our figures against the baseline's (medians), for metrics whose name or group is in `gate`."""
    base, changes = _medians(baseline, OURS), []
    for name, (value, extra, info) in _medians(current, OURS).items():
        fig = figure_for(name)
        if name not in base or not ({name, fig.group if fig else ""} & gate):
            continue
        _check_like(name, (value, extra, info), base[name])
        old = base[name][0]
        if not math.isfinite(old):
            raise RunnerError(f"the baseline's {name} is {old}, not a number to compare with")
        if old <= 0:
            continue
        better = extra.get("better", fig.better if fig else "lower")
        worse = (value / old - 1) * 100 if better == "lower" else (1 - value / old) * 100
        if not math.isfinite(value):  # a broken measurement (NaN, or an infinite rate from no time): no pass
            worse = math.nan
        limit = thresholds.limit(name) if thresholds is not None else math.inf
        changes.append(Change(name, extra.get("unit", ""), value, old, worse, limit))
    return changes


# The run context's fields (bench's context()) that make two runs' figures comparable: the same model and weights
# on the same device model (GPU name; CPU machine and cores), in the same dtype, timing the same workload. The
# bundle digest may differ: a new export of the same model is exactly what the gate is for.
SAME = (
    "model", "weights", "device", "gpu", "arch", "dtype",
    "audio_seconds", "chunks", "prefill_tokens", "new_tokens", "throughput_files",
)  # fmt: skip
# each batch size's throughput pass (model.extra_info), compared where a throughput figure of that batch is
SAME_PER_BATCH = ("files", "audio_seconds")


def _setup(records: list[dict]) -> dict[str, str | None] | None:
    r = next((r for r in records if r["model"].get("backend") == OURS), None)
    if r is None:
        return None
    ctx = r["benchmark"].get("extra_info", {})
    found = {k: ctx.get(k) for k in SAME} | {"model": r["model"].get("name"), "dtype": r["benchmark"].get("dtype")}
    return {k: None if v is None else str(v) for k, v in found.items()}


def _differences(now: dict, base: dict, keys) -> list[str]:
    """`key: baseline B, this run N` for each key whose values differ (a field one of them lacks differs)."""
    shown = {None: "not recorded"}
    return [f"{k} {shown.get(base.get(k), repr(base.get(k)))} vs {shown.get(now.get(k), repr(now.get(k)))}"
            for k in keys if base.get(k) != now.get(k)]  # fmt: skip


def _refuse(path: Path, what: str, diffs: list[str]) -> RunnerError:
    return RunnerError(
        f"{path}: baseline is for another {what} ({'; '.join(diffs)}; baseline vs this run): its figures are not "
        "comparable, so the gate refuses; use a baseline of the same setup"
    )


def check_baseline_matches(current: list[dict], baseline: list[dict], path: Path) -> None:
    """The same setup (SAME), or the comparison means nothing: one error naming every field that differs."""
    now, base = _setup(current), _setup(baseline)
    if base is None:
        raise RunnerError(f"{path}: the baseline has no records for {OURS}")
    if now is not None and (diffs := _differences(now, base, SAME)):
        raise _refuse(path, "setup", diffs)


NO_BASELINE = "no baseline yet: gate skipped"


def read_baseline(path: Path, optional: bool) -> tuple[list[dict] | None, str | None]:
    """(records, None), or with `optional` and a missing or empty file (no earlier green run): (None, why)."""
    if optional:
        if not Path(path).exists():
            return None, f"{path} does not exist"
        if Path(path).is_file() and not Path(path).read_bytes().strip():
            return None, f"{path} is empty"
    records = read_records(path)
    if optional and not records:
        return None, f"{path} holds no records"
    return records, None


@dataclass(frozen=True)
class GateResult:
    baseline: Path
    gate: frozenset[str]
    thresholds: Thresholds
    changes: tuple[Change, ...] = ()  # worst first
    skipped: str | None = None  # why nothing was compared (no baseline yet)

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.regressed]

    def markdown(self) -> str:
        if self.skipped is not None:
            return (
                f"#### Regression gate: {NO_BASELINE}\n\n{md_text(self.skipped)} (no earlier green run to compare with); "
                "nothing was compared and the gate passes.\n"
            )
        regs = self.regressions
        lines = [
            f"#### Regression gate vs {md_text(self.baseline)}: "
            + (f"**{len(regs)} regression(s)**" if regs else "no regression")
            + f" in {len(self.changes)} figures",
            "",
            f"gated: {', '.join(sorted(self.gate))}; most a figure may be worse than the baseline: "
            f"{self.thresholds.describe()}",
            "",
            "| figure | baseline | now | change | max worse | result |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for c in self.changes:
            fig = figure_for(c.metric)
            name = f"{fig.label} ({c.unit})" if fig else f"{c.metric} ({c.unit})"
            delta = (c.current / c.baseline - 1) * 100
            how = (
                "not a number"
                if math.isnan(c.worse_pct)
                else "unchanged"
                if abs(c.worse_pct) < 0.05
                else f"{abs(c.worse_pct):.1f}% {'worse' if c.worse_pct > 0 else 'better'}"
            )
            result = f"**REGRESSION**: {how}" if c.regressed else f"ok: {how}"
            lines.append(
                f"| {name} | {_num(c.baseline)} | {_num(c.current)} | {delta:+.1f}% | {c.threshold:g}% | {result} |"
            )
        return "\n".join(lines) + "\n"

    def error(self) -> str | None:
        regs = self.regressions
        if not regs:
            return None
        first = regs[0]
        more = f" (and {len(regs) - 1} more: {', '.join(c.metric for c in regs[1:])})" if len(regs) > 1 else ""
        return f"regression beyond {first.threshold:g}% vs {self.baseline}: {first.describe()}{more}"


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def evaluate(
    current: list[dict], baseline: list[dict], path: Path, gate: set[str], thresholds: Thresholds
) -> GateResult:
    """The gate: our figures in `gate` against the baseline's, each against its threshold; the regressions first
    (furthest past their threshold first), then the others in the table's order."""
    check_records(baseline, path)
    check_baseline_matches(current, baseline, path)
    order = {k: i for i, k in enumerate(dict.fromkeys((*HEADLINE, *FIGURE)))}

    def key(c: Change) -> tuple:
        return (
            (0, c.threshold - c.worse_pct, c.metric) if c.regressed else (1, order.get(c.metric, len(order)), c.metric)
        )

    try:
        changes = sorted(compare(current, baseline, gate, thresholds), key=key)
    except RunnerError as e:
        raise RunnerError(f"{path}: {e}") from None
    if not changes:  # a gate that compared nothing would pass anything
        raise RunnerError(
            f"{path}: the gate compared no figures: neither run has a figure of --gate {','.join(sorted(gate))} "
            "the other has"
        )
    return GateResult(path, frozenset(gate), thresholds, tuple(changes))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
