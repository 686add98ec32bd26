"""`python -m runner bench`: statistics, the v3 JSON (schema-valid, ours and eager, ratios), the chart, the
markdown table and job summary, and the regression gate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runner.app.bench.report import FIGURE, OURS, Summary, percentile, ratio, trimmed_mean
from runner.app.cli import main

SCHEMA = Path(__file__).resolve().parents[2] / "benchmarks" / "schema" / "v3.schema.json"


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
    extra = records[0]["benchmark"]["extra_info"]
    assert extra["device"] == "cpu" and extra["torch_version"] and len(extra["bundle_digest"]) == 64
    ours_info = by[(OURS, "e2e_total_ms")]["model"]["extra_info"]
    assert ours_info["generated_tokens"] == "32"  # --min-new-tokens 32 forces the length


def test_chart_opens(bench_run):
    import matplotlib.image

    img = matplotlib.image.imread(bench_run[1] / "out.png")
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_table_and_job_summary_from_a_recorded_run(bench_run, tmp_path, monkeypatch, capsys):
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert main(["bench", "--from-json", str(bench_run[1] / "out.json"), "--json", str(tmp_path / "again.json")]) == 0
    table = capsys.readouterr().out
    assert "| figure | ours (AOTI) | eager | ours vs eager |" in table
    assert "| e2e: time to first token (ms) |" in table
    assert table in summary.read_text()
    assert _records(tmp_path / "again.json") == _records(bench_run[1] / "out.json")  # a lossless round trip


# ---------------------------------------------------------------- the regression gate


def _doctored(src: Path, dest: Path, factor: float = 10.0) -> Path:
    """Every figure `factor` times better than recorded."""
    records = _records(src)
    for r in records:
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
    base = _doctored(bench_run[1] / "out.json", tmp_path / "fast.json")
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
