"""`python -m runner bench`: statistics, the v3 JSON (schema-valid, ours and eager, ratios), the chart, the
headline table and job summary (bench's own and ci_scripts/job_summary.py's), and the regression gate with its
per-figure thresholds and an optional baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runner.app.bench.chart import CHART_DPI, CHART_SIZE, chart_figure
from runner.app.bench.gate import Thresholds, parse_thresholds
from runner.app.bench.report import (
    FIGURE,
    HEADLINE,
    MAX_HEADLINE,
    METHODS,
    OURS,
    Summary,
    from_records,
    percentile,
    ratio,
    trimmed_mean,
)
from runner.app.cli import main
from runner.errors import RunnerError

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "benchmarks" / "schema" / "v3.schema.json"


# ---------------------------------------------------------------- statistics


def test_statistics_on_known_numbers():
    s = Summary.of([5.0, 1.0, 4.0, 2.0, 100.0])
    assert (s.median, s.min, s.max, s.n) == (4.0, 1.0, 100.0, 5)
    assert s.p90 == pytest.approx(5.0 + 0.6 * 95.0)  # rank 3.6: 60% of the way from 5 to 100
    assert s.trimmed_mean == pytest.approx((2 + 4 + 5) / 3)  # the outlier and the minimum dropped


def test_percentile_matches_numpy_linear_interpolation():
    xs = [3.0, 1.0, 7.5, 2.25, 9.0, 4.0, 11.0]
    for q in (0, 10, 50, 90, 100):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))


def test_trimmed_mean_keeps_small_samples_whole():
    assert trimmed_mean([1.0, 3.0]) == 2.0  # floor(2 * 0.2) = 0 dropped
    assert trimmed_mean(list(map(float, range(1, 11)))) == pytest.approx(5.5)  # 2 dropped at each end
    assert Summary.of([7.0]).p90 == 7.0


def test_ratio_is_above_one_when_ours_is_better():
    assert ratio(FIGURE["e2e_total_ms"], ours=10.0, peer=25.0) == pytest.approx(2.5)
    assert ratio(FIGURE["decode_tokens_per_s"], ours=50.0, peer=25.0) == pytest.approx(2.0)
    assert ratio(FIGURE["e2e_total_ms"], ours=0.0, peer=5.0) is None


# ---------------------------------------------------------------- one real run on the tiny bundle


@pytest.fixture(scope="module")
def bench_run(tiny_bundle, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = f"bench --bundle {tiny_bundle} --runs 2 --warmup 1 --json {out / 'out.json'} --chart {out / 'out.png'}"
    rc = main(argv.split())
    return rc, out


def _records(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def test_bench_exits_zero_and_writes_json_and_chart(bench_run):
    rc, out = bench_run
    assert rc == 0
    assert (out / "out.json").is_file() and (out / "out.png").is_file()


def test_json_validates_against_the_v3_schema(bench_run):
    import jsonschema  # check-jsonschema's own dependency

    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(_records(bench_run[1] / "out.json"), schema, cls=jsonschema.Draft202012Validator)


def test_json_has_ours_eager_and_their_ratio(bench_run):
    records = _records(bench_run[1] / "out.json")
    by = {(r["model"]["backend"], r["metric"]["name"]): r for r in records}
    for figure in (
        "load_total_ms",
        "audio_encoder_ms",
        "text_decoder_decode_ms",
        "ttft_ms",
        "decode_tokens_per_s",
        "e2e_total_ms",
        "real_time_factor",
        "peak_memory_mb",
    ):
        assert (OURS, figure) in by and ("eager", figure) in by, figure
        r = by[(f"{OURS}-vs-eager", figure)]["metric"]["benchmark_values"][0]
        ours = float(by[(OURS, figure)]["metric"]["extra_info"]["median"])
        eager = float(by[("eager", figure)]["metric"]["extra_info"]["median"])
        assert r == pytest.approx(ratio(FIGURE[figure], ours, eager), rel=1e-4)
    assert len(by[(OURS, "e2e_total_ms")]["metric"]["benchmark_values"]) == 2  # --runs 2, warm-up excluded
    assert (OURS, "load_verify_ms") in by and (OURS, "load_text_decoder_ms") in by
    inits = sum(
        float(by[(OURS, f"load_{m}_ms")]["metric"]["extra_info"]["median"])
        for m in METHODS
        if (OURS, f"load_{m}_ms") in by
    )
    weights = float(by[(OURS, "load_weights_ms")]["metric"]["extra_info"]["median"])
    assert 0 < weights <= inits  # the weights' reading is a part of the methods' inits
    extra = records[0]["benchmark"]["extra_info"]
    assert extra["device"] == "cpu" and extra["torch_version"] and len(extra["bundle_digest"]) == 64
    ours_info = by[(OURS, "e2e_total_ms")]["model"]["extra_info"]
    assert ours_info["generated_tokens"] == "32"  # --min-new-tokens 32 forces the length


def test_chart_opens(bench_run):
    import matplotlib.image

    img = matplotlib.image.imread(bench_run[1] / "out.png")
    assert img.shape[:2] == (round(CHART_SIZE[1] * CHART_DPI), round(CHART_SIZE[0] * CHART_DPI))
    assert img.ndim == 3


def test_chart_shows_decode_and_ttft_values_on_linear_axes_beside_the_breakdown(bench_run):
    run = from_records(_records(bench_run[1] / "out.json"), bench_run[1] / "out.json")
    fig = chart_figure(run)
    assert tuple(fig.get_size_inches()) == CHART_SIZE
    decode, ttft, methods, e2e = fig.axes
    assert decode.get_title().startswith("decode (tokens/s") and ttft.get_title().startswith("time to first token")
    for ax, key in ((decode, "decode_tokens_per_s"), (ttft, "ttft_ms")):
        assert ax.get_yscale() == "linear"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["ours (AOTI)", "eager"]
        labels = [t.get_text() for t in ax.texts]  # bar_label's value labels
        want = [b.summary(key).median for b in run.results]
        assert [float(x) for x in labels] == pytest.approx(want, rel=0.01), (key, labels)
    assert methods.get_xscale() == "log" and e2e.get_xscale() == "log"
    assert "text_decoder decode step" in [t.get_text() for t in methods.get_yticklabels()]
    assert methods.texts and e2e.texts  # the breakdown's bars are labelled too


def _table_rows(text: str) -> list[str]:
    """The rows of the first markdown table in `text` (header and rule left out)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        rows.append(line)
    return rows


def test_table_and_job_summary_from_a_recorded_run(bench_run, tmp_path, monkeypatch, capsys):
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert main(["bench", "--from-json", str(bench_run[1] / "out.json"), "--json", str(tmp_path / "again.json")]) == 0
    table = capsys.readouterr().out
    assert "| figure | ours (AOTI) | eager | ours vs eager |" in table
    assert "| e2e: time to first token (ms) |" in table
    assert table in summary.read_text()
    assert _records(tmp_path / "again.json") == _records(bench_run[1] / "out.json")  # a lossless round trip


def test_a_bundle_with_a_fallback_says_so_above_its_table(bench_run, tmp_path, capsys):
    records = _records(bench_run[1] / "out.json")
    assert {r["benchmark"]["extra_info"]["fallbacks"] for r in records} == {""}  # the tiny bundle has none
    main(["bench", "--from-json", str(bench_run[1] / "out.json")])
    assert "fallback" not in capsys.readouterr().out
    for r in records:
        r["benchmark"]["extra_info"]["fallbacks"] = (
            "text_decoder_step (InductorError: CppCompileError: C++ compile error)"
        )
    (tmp_path / "fb.json").write_text(json.dumps(records))
    assert main(["bench", "--from-json", str(tmp_path / "fb.json")]) == 0
    head = capsys.readouterr().out.split("| figure |")[0]
    assert "The bundle holds fallbacks, slower than the methods they replace:** text_decoder_step (Inductor" in head


def test_the_summary_is_the_headline_table_and_the_json_keeps_every_figure(bench_run, tmp_path, monkeypatch):
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert main(["bench", "--from-json", str(bench_run[1] / "out.json")]) == 0
    text = summary.read_text()
    rows = _table_rows(text)
    assert 0 < len(rows) <= len(HEADLINE) <= MAX_HEADLINE == 15
    firsts = [r.split(" | ")[0].removeprefix("| ") for r in rows]
    assert firsts[:3] == ["e2e: decode (tokens/s)", "e2e: time to first token (ms)", "e2e: prefill (tokens/s)"]
    assert {"text_decoder decode step (ms)", "audio_encoder (ms)", "peak memory (MiB)", "load: total (ms)"} <= set(
        firsts
    )
    decode = rows[0].split(" | ")
    assert len(decode) == 4 and decode[-1].endswith("x |")  # ours, eager, and the ratio
    assert "load: bundle verification" not in text and "Regression gate" not in text  # no --baseline: no gate
    names = {r["metric"]["name"] for r in _records(bench_run[1] / "out.json") if r["model"]["backend"] == OURS}
    assert {"load_verify_ms", "load_text_decoder_ms"} <= names  # the rest stays in the JSON


def test_job_summary_script_renders_bench_records_as_the_headline_table(bench_run, tmp_path):
    out = tmp_path / "summary.md"
    r = subprocess.run(
        [sys.executable, str(ROOT / "ci_scripts" / "job_summary.py"), str(bench_run[1] / "out.json"),
         "--title", "Benchmark - tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert text.startswith("### Benchmark - tiny\n")
    assert "| figure | ours (AOTI) | eager | ours vs eager |" in text
    assert 0 < len(_table_rows(text)) <= MAX_HEADLINE
    assert "benchmark.name" not in text and "metric.benchmark_values" not in text  # not the column-per-key dump


# ---------------------------------------------------------------- the regression gate


def _doctored(src: Path, dest: Path, factor: float = 10.0, **context: str) -> Path:
    """Every figure `factor` times better than recorded (and the run context's `context` fields changed)."""
    records = _records(src)
    for r in records:
        r["benchmark"]["extra_info"].update(context)
        m = r["metric"]
        if r["model"]["backend"] != OURS or m["name"] == "error":
            continue
        f = 1 / factor if m["extra_info"]["better"] == "lower" else factor
        m["benchmark_values"] = [v * f for v in m["benchmark_values"]]
        for k in ("median", "p90", "min", "max", "trimmed_mean"):
            m["extra_info"][k] = str(float(m["extra_info"][k]) * f)
    dest.write_text(json.dumps(records))
    return dest


def test_same_baseline_passes(bench_run):
    out = bench_run[1] / "out.json"
    assert main(["bench", "--from-json", str(out), "--baseline", str(out), "--max-regression", "20"]) == 0


def test_faster_baseline_fails_naming_the_metric(bench_run, tmp_path, capsys):
    base = _doctored(bench_run[1] / "out.json", tmp_path / "fast.json")
    out = bench_run[1] / "out.json"
    assert main(f"bench --from-json {out} --baseline {base} --max-regression 20".split()) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "regression beyond 20%" in err[0]
    assert any(name in err[0] for name in FIGURE), err[0]


def test_gate_runs_at_the_end_of_a_real_run(bench_run, tiny_bundle, tmp_path, capsys):
    base = _doctored(bench_run[1] / "out.json", tmp_path / "fast.json", new_tokens="4")  # the same workload
    argv = (
        f"bench --bundle {tiny_bundle} --runs 1 --warmup 0 --compare none --min-new-tokens 4 --max-new-tokens 4 "
        f"--json {tmp_path / 'new.json'} --baseline {base} --gate text_decoder_decode_ms,memory"
    )
    rc = main(argv.split())
    assert rc == 1
    err = capsys.readouterr().err
    assert "error: regression beyond 20%" in err and ("text_decoder_decode_ms" in err or "peak_memory_mb" in err)
    assert (tmp_path / "new.json").is_file()  # results are written before the gate fails


def test_baseline_for_another_device_is_refused(bench_run, tmp_path, capsys):
    records = _records(bench_run[1] / "out.json")
    for r in records:
        r["benchmark"]["extra_info"]["device"] = "cuda"
    (tmp_path / "cuda.json").write_text(json.dumps(records))
    out = bench_run[1] / "out.json"
    assert main(f"bench --from-json {out} --baseline {tmp_path / 'cuda.json'}".split()) == 1
    assert "baseline is for" in capsys.readouterr().err


def _gate_table(text: str) -> dict[str, list[str]]:
    """The gate's table in a summary: figure label -> [baseline, now, change, max worse, result]."""
    part = text[text.index("#### Regression gate") :]
    return {r.split(" | ")[0].removeprefix("| "): r.removesuffix(" |").split(" | ")[1:] for r in _table_rows(part)}


def test_per_figure_threshold_fails_a_ten_times_better_baseline_naming_the_figure(
    bench_run, tmp_path, monkeypatch, capsys
):
    base = _doctored(bench_run[1] / "out.json", tmp_path / "fast.json")
    out, summary = bench_run[1] / "out.json", tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    # 10x better: lower-is-better figures are 900% worse, higher-is-better ones 90%: only decode's 5% is exceeded
    argv = f"bench --from-json {out} --baseline {base} --gate e2e --max-regression 1000,decode_tokens_per_s=5"
    assert main(argv.split()) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [err[0]] and err[0].startswith(f"error: regression beyond 5% vs {base}: decode_tokens_per_s ")
    assert "more:" not in err[0]  # the one regression
    gate = _gate_table(summary.read_text())
    assert set(gate) == {f"{FIGURE[k].label} ({FIGURE[k].unit})" for k in FIGURE if FIGURE[k].group == "e2e"}
    assert list(gate)[:3] == ["e2e: decode (tokens/s)", "e2e: time to first token (ms)", "e2e: prefill (tokens/s)"]
    decode = gate.pop("e2e: decode (tokens/s)")  # the regression first, then the table's order
    assert decode[2:] == ["-90.0%", "5%", "**REGRESSION**: 90.0% worse"]
    assert float(decode[0].replace(",", "")) == pytest.approx(10 * float(decode[1].replace(",", "")), rel=0.01)
    assert all(row[3] == "1000%" and row[4].startswith("ok: ") for row in gate.values())
    assert "**1 regression(s)** in 5 figures" in summary.read_text()


def test_group_threshold_and_the_default_apply_to_their_figures(bench_run, tmp_path, capsys):
    base = _doctored(bench_run[1] / "out.json", tmp_path / "fast.json")
    out = bench_run[1] / "out.json"
    argv = f"bench --from-json {out} --baseline {base} --gate e2e,memory --max-regression 950,memory=10,e2e=2000"
    assert main(argv.split()) == 1
    err = capsys.readouterr().err
    assert "error: regression beyond 10% vs" in err and "peak_memory_mb" in err and "more:" not in err
    argv = f"bench --from-json {out} --baseline {base} --gate e2e,memory --max-regression 950,memory=10,e2e=50"
    assert main(argv.split()) == 1  # every e2e figure too: the one furthest past its threshold named first
    err = capsys.readouterr().err
    assert "error: regression beyond 10% vs" in err and "(and 5 more: " in err and "decode_tokens_per_s" in err


def test_a_matching_baseline_passes_with_per_figure_thresholds(bench_run, tmp_path, monkeypatch, capsys):
    out, summary = bench_run[1] / "out.json", tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    argv = f"bench --from-json {out} --baseline {out} --max-regression 1,decode_tokens_per_s=0,memory=0"
    assert main(argv.split()) == 0
    gate = _gate_table(summary.read_text())
    assert len(gate) >= 10 and all(row[2] == "+0.0%" and row[4] == "ok: unchanged" for row in gate.values())
    assert list(gate)[:2] == ["e2e: decode (tokens/s)", "e2e: time to first token (ms)"]  # the headline's order
    assert gate["e2e: decode (tokens/s)"][3] == "0%" and gate["peak memory (MiB)"][3] == "0%"
    assert gate["text_decoder decode step (ms)"][3] == "1%"
    assert "no regression in" in summary.read_text()


@pytest.mark.parametrize("content", [None, "", "  \n", "[]"])
def test_no_baseline_yet_passes_with_the_optional_flag_and_says_so(bench_run, tmp_path, monkeypatch, capsys, content):
    base, summary = tmp_path / "baseline" / "benchmark.json", tmp_path / "summary.md"
    if content is not None:
        base.parent.mkdir()
        base.write_text(content)
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    argv = f"bench --from-json {bench_run[1] / 'out.json'} --baseline {base} --baseline-optional --max-regression 5"
    assert main(argv.split()) == 0
    out, err = capsys.readouterr()
    assert "no baseline yet: gate skipped" in err
    text = summary.read_text()
    assert "#### Regression gate: no baseline yet: gate skipped" in text and str(base) in text
    assert "| figure | ours (AOTI) |" in text  # the headline table is still there
    assert out in text


def test_without_the_optional_flag_a_missing_baseline_is_an_error(bench_run, tmp_path, capsys):
    argv = f"bench --from-json {bench_run[1] / 'out.json'} --baseline {tmp_path / 'nope.json'}"
    assert main(argv.split()) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {tmp_path / 'nope.json'}: cannot read benchmark JSON")


def test_the_optional_flag_still_refuses_a_corrupt_baseline(bench_run, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    argv = f"bench --from-json {bench_run[1] / 'out.json'} --baseline {tmp_path / 'bad.json'} --baseline-optional"
    assert main(argv.split()) == 1
    assert "cannot read benchmark JSON" in capsys.readouterr().err


def test_thresholds_parse_and_resolve_figure_then_group_then_default():
    t = parse_thresholds("20,decode_tokens_per_s=5,memory=10%,e2e=7.5")
    assert t == Thresholds(20.0, (("decode_tokens_per_s", 5.0), ("memory", 10.0), ("e2e", 7.5)))
    assert t.limit("decode_tokens_per_s") == 5.0  # its own, before its group's
    assert t.limit("ttft_ms") == 7.5 and t.limit("peak_memory_mb") == 10.0 and t.limit("audio_encoder_ms") == 20.0
    assert parse_thresholds("12.5") == Thresholds(12.5) and parse_thresholds("20.0").limit("ttft_ms") == 20.0
    assert parse_thresholds("memory=3").default == 20.0  # no bare number: the usual default
    assert t.describe() == "20%, decode_tokens_per_s 5%, memory 10%, e2e 7.5%"


@pytest.mark.parametrize(
    "value, message",
    [
        ("fast", "'fast' is not a percentage >= 0"),
        ("-5", "'-5' is not a percentage >= 0"),
        ("nan", "is not a percentage"),
        ("20,30", "two default percentages (20 and 30)"),
        ("latency=5", "latency is not a figure or group (load, method, e2e, first, memory, throughput)"),
        ("decode_tokens_per_s=x", "'decode_tokens_per_s=x' is not a percentage"),
        ("ttft_ms=5,ttft_ms=6", "ttft_ms is given twice"),
        ("load=10", "load is not gated (--gate e2e,memory,method); add it to --gate"),
        ("load_total_ms=10", "load_total_ms is not gated"),
        (",", "give a percentage, or a comma list"),
    ],
)
def test_bad_max_regression_is_one_error_line(bench_run, tmp_path, value, message, capsys):
    out = bench_run[1] / "out.json"
    assert main(["bench", "--from-json", str(out), "--baseline", str(out), "--max-regression", value]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --max-regression {value}: ") and message in err[0], err


def test_a_threshold_for_a_figure_gated_through_its_group_or_a_group_gated_through_a_figure_is_fine():
    parse_thresholds("text_decoder_decode_ms=3", {"method"})
    parse_thresholds("method=3", {"text_decoder_decode_ms"})
    with pytest.raises(RunnerError, match="memory is not gated"):
        parse_thresholds("memory=3", {"text_decoder_decode_ms"})


def test_baseline_optional_needs_a_baseline(bench_run, capsys):
    assert main(["bench", "--from-json", str(bench_run[1] / "out.json"), "--baseline-optional"]) == 1
    assert "error: --baseline-optional: give the baseline file with --baseline FILE" in capsys.readouterr().err


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--compare", "onnx"], "--compare onnx: unknown peer"),
        (["--gate", "latency"], "--gate latency: not a figure or group"),
        (["--runs", "0"], "--runs 0: must be >= 1"),
        (["--chunks", "9"], "--chunks 9: the bundle takes at most"),
        (["--min-new-tokens", "8", "--max-new-tokens", "4"], "above --max-new-tokens"),
    ],
)
def test_bad_arguments_are_one_error_line(tiny_bundle, argv, message, capsys):
    assert main(["bench", "--bundle", str(tiny_bundle), *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]


def test_bundle_or_recorded_run_is_required(capsys):
    assert main(["bench"]) == 1
    assert "--bundle DIR is required" in capsys.readouterr().err


# ---------------------------------------------------------------- transformers beside us


def test_hf_peer_runs_with_the_same_weights(tiny_bundle, tmp_path):
    pytest.importorskip("transformers")
    argv = (
        f"bench --bundle {tiny_bundle} --runs 1 --warmup 0 --compare hf --min-new-tokens 8 --max-new-tokens 8 "
        f"--json {tmp_path / 'hf.json'}"
    )
    rc = main(argv.split())
    assert rc == 0
    records = _records(tmp_path / "hf.json")
    hf = {r["metric"]["name"]: r for r in records if r["model"]["backend"] == "hf"}
    assert "error" not in hf, hf.get("error", {}).get("metric")
    assert {"audio_encoder_ms", "text_decoder_prefill_ms", "text_decoder_decode_ms", "e2e_total_ms"} <= set(hf)
    # greedy, fp32, same weights: transformers' generate() picks exactly our tokens
    assert hf["e2e_total_ms"]["model"]["extra_info"]["tokens_match_ours"] == "true"


def test_git_sha_says_dirty_when_tracked_files_differ_from_the_commit(tmp_path, monkeypatch):
    import subprocess

    from runner.app.bench import verb as bench
    from runner.app.options import Environment

    env = Environment.read({})  # no GITHUB_SHA: the commit is read from git

    git = ["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f.py").write_text("a\n")
    subprocess.run([*git, "add", "f.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    monkeypatch.setattr(bench, "REPO", tmp_path)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert bench._git_sha(env) == head
    (tmp_path / "new_untracked.txt").write_text("ignored\n")  # untracked files do not make it dirty
    assert bench._git_sha(env) == head
    (tmp_path / "f.py").write_text("b\n")
    assert bench._git_sha(env) == head + "-dirty"


def test_the_runs_peak_memory_is_the_largest_of_the_phase_peaks_and_the_last_window():
    """On CUDA bench_methods resets the peak counter per phase: the run's peak folds those phases back in, and
    only those (the host's RSS is another figure)."""
    from runner.app.bench.measure import peak_memory_mb

    now = peak_memory_mb("cpu")
    assert now > 0
    assert peak_memory_mb("cpu", {"peak_memory_text_decoder_prefill_mb": [now * 10]}) == now * 10
    assert peak_memory_mb("cpu", {"peak_memory_audio_encoder_mb": [1.0]}) >= now  # a smaller phase: the window's
    assert peak_memory_mb("cpu", {"peak_host_rss_mb": [now * 10], "decode_tokens_per_s": [1e9]}) < now * 10


def test_transformers_copy_reads_the_weights_on_the_host_where_the_gpu_cannot_hold_two(tiny_bundle, monkeypatch):
    """bench's HF peers copy the bundle's weights into transformers' model: read onto the GPU when it holds both
    copies, onto the host when not (Small-24B's 48.5 GB on an 80 GB card); a CPU run reads on the CPU."""
    import torch

    from runner.app.bench.peers import HF_HEADROOM, weights_device
    from runner.bundle import read_manifest, weight_files

    manifest = read_manifest(tiny_bundle)
    size = sum(manifest.files[f].size for f in weight_files(manifest))
    assert weights_device(manifest, "cpu") == "cpu"
    for free, want in ((2 * size + HF_HEADROOM, "cuda"), (2 * size + HF_HEADROOM - 1, "cpu")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda free=free: (free, 80 * 2**30))
        assert weights_device(manifest, "cuda") == want


def test_a_peer_failing_after_a_stop_was_asked_for_ends_the_bench_as_a_stop(tiny_bundle, tmp_path, monkeypatch, capsys):
    """SIGTERM while a peer runs: torch's cleanup may replace the Terminated it raised with its own error. Once a
    stop was asked for, that error is the stop (exit 143, nothing written), not a failed peer to report."""
    from runner.app.bench import verb
    from runner.errors import Cancellation

    def peer_dies(*args, **kwargs):
        monkeypatch.setattr(Cancellation, "requested", property(lambda self: True))  # the signal arrived
        raise RuntimeError("Trying to pop empty mode stack")

    monkeypatch.setattr(verb, "bench_eager", peer_dies)
    out = tmp_path / "out.json"
    argv = ["bench", "--bundle", str(tiny_bundle), "--runs", "1", "--warmup", "0", "--compare", "eager"]
    assert main([*argv, "--json", str(out)]) == 143
    assert not out.exists() and "eager failed" not in capsys.readouterr().err
