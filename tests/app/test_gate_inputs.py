"""The benchmark gate on inputs that made it pass everything or raise (issue 23): `--gate ""` gated nothing and
passed; a NaN figure compared false with every threshold and passed; a malformed baseline raised a traceback; a
gate that found no figure to compare passed. Now each is one `error:` line, or a regression.

Records are built as report.to_records writes them (the fields the gate reads), so the cases need no bench run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.app.bench.gate import Thresholds, evaluate
from runner.app.bench.report import OURS
from runner.app.cli import main
from runner.errors import RunnerError

GATE = {"method", "e2e", "memory"}


def record(name: str, value: float | str, *, unit: str = "tokens/s", better: str = "higher", backend: str = OURS):
    return {
        "benchmark": {"name": "voxtral", "dtype": "float32", "extra_info": {"device": "cpu"}},
        "model": {"name": "tiny", "backend": backend, "extra_info": {}},
        "metric": {
            "name": name,
            "benchmark_values": [],
            "extra_info": {"unit": unit, "better": better, "median": str(value)},
        },
        "runners": [],
    }


def run(decode: float | str = 100.0, ttft: float | str = 10.0) -> list[dict]:
    return [record("decode_tokens_per_s", decode), record("ttft_ms", ttft, unit="ms", better="lower")]


def test_a_matching_run_passes():
    result = evaluate(run(), run(), Path("base.json"), GATE, Thresholds(20.0))
    assert result.error() is None and len(result.changes) == 2


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "fast"])
def test_a_figure_that_is_not_a_number_is_a_regression_not_a_pass(value):
    """NaN > 20 is false: a NaN decode rate passed the gate."""
    result = evaluate(run(decode=value), run(), Path("base.json"), GATE, Thresholds(20.0))
    assert [c.metric for c in result.regressions] == ["decode_tokens_per_s"] and result.error()


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda r: r[0]["metric"].update(extra_info=[1]), "metric.extra_info is not an object"),
        (lambda r: r[0].update(model="tiny"), "model is not an object"),
        (lambda r: r[0].pop("benchmark"), "benchmark is not an object"),
        (lambda r: r[0]["benchmark"].update(extra_info="cpu"), "benchmark.extra_info is not an object"),
        (lambda r: r[0]["metric"].update(name=7), "metric.name is not a string"),
        (lambda r: r[0]["metric"].update(benchmark_values=["1"]), "benchmark_values is not a list of numbers"),
        (lambda r: r[0]["metric"]["extra_info"].update(median="nan"), "decode_tokens_per_s is nan"),
        (lambda r: r[0]["metric"]["extra_info"].update(median="n/a"), "decode_tokens_per_s is nan"),
        (lambda r: r.__setitem__(0, "a record"), "record 0: not an object"),
    ],
)
def test_a_malformed_baseline_is_one_error_naming_it(edit, needle):
    base = run()
    edit(base)
    with pytest.raises(RunnerError) as e:
        evaluate(run(), base, Path("base.json"), GATE, Thresholds(20.0))
    assert str(e.value).startswith("base.json: ") and needle in str(e.value), str(e.value)


def test_a_gate_that_compares_nothing_is_an_error():
    """A baseline of the same model without any gated figure (here: only load figures): it passed, checking nothing."""
    base = [record("load_total_ms", 5.0, unit="ms", better="lower")]
    with pytest.raises(RunnerError, match="compared no figures"):
        evaluate(run(), base, Path("base.json"), GATE, Thresholds(20.0))


@pytest.mark.parametrize("gate", ["", ",", " , "])
def test_an_empty_gate_is_one_error_line(gate, tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(run()))
    assert main(["bench", "--from-json", str(path), "--baseline", str(path), "--gate", gate]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --gate {gate!r}: name at least one figure"), err


# ---- like with like: a baseline of another GPU, workload or unit is refused, naming what differs

CONTEXT = {
    "model": "tiny", "device": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "arch": "NVIDIA H100 80GB HBM3", "weights": "random",
    "audio_seconds": "30.00", "prefill_tokens": "393", "new_tokens": "64", "chunks": "1", "dtype": "bfloat16",
}  # fmt: skip


def contextual(records: list[dict], **changes: str) -> list[dict]:
    """The records with a run context (what bench's context() writes), some of its fields changed."""
    records = json.loads(json.dumps(records))
    for r in records:
        r["metric"]["benchmark_values"] = [float(r["metric"]["extra_info"]["median"])]  # what --from-json reads
        r["benchmark"]["extra_info"] = CONTEXT | changes
        r["benchmark"]["dtype"] = (CONTEXT | changes)["dtype"]
    return records


@pytest.mark.parametrize(
    "field, value",
    [
        ("gpu", "NVIDIA A10G"),
        ("arch", "NVIDIA A10G"),
        ("audio_seconds", "10.00"),
        ("prefill_tokens", "1000"),
        ("new_tokens", "8"),
        ("chunks", "3"),
        ("dtype", "float32"),
        ("weights", "hub"),
        ("throughput_files", "16"),
    ],
)
def test_a_baseline_of_another_gpu_or_workload_is_refused_naming_the_field(field, value):
    """They passed as "no regression in N figures": the figures of another GPU or workload say nothing."""
    with pytest.raises(RunnerError) as e:
        evaluate(contextual(run()), contextual(run(), **{field: value}), Path("base.json"), GATE, Thresholds(20.0))
    msg = str(e.value)
    assert msg.startswith("base.json: ") and "\n" not in msg and field in msg and value in msg, msg
    assert evaluate(contextual(run()), contextual(run()), Path("base.json"), GATE, Thresholds(20.0)).error() is None


@pytest.mark.parametrize("unit, median", [("us", 1000.0), ("s", 0.001), ("tokens/s", 10.0)])
def test_a_baseline_figure_in_another_unit_is_refused_not_compared(unit, median):
    """A ttft of 10 ms against a baseline of 1000 us read as 99% better: a 10x slowdown, hidden."""
    base = run()
    base[1]["metric"]["extra_info"].update(unit=unit, median=str(median))
    with pytest.raises(RunnerError) as e:
        evaluate(run(), base, Path("base.json"), GATE, Thresholds(20.0))
    msg = str(e.value)
    assert msg.startswith("base.json: ") and "ttft_ms" in msg and unit in msg and "ms" in msg, msg


def test_a_baseline_that_counts_better_the_other_way_is_refused():
    base = run()
    base[0]["metric"]["extra_info"]["better"] = "lower"
    with pytest.raises(RunnerError, match="decode_tokens_per_s"):
        evaluate(run(), base, Path("base.json"), GATE, Thresholds(20.0))


def test_throughput_at_a_batch_of_another_workload_is_refused():
    def at_batch(files: str) -> list[dict]:
        r = record("throughput_rtfx_b8", 50.0, unit="x")
        r["model"]["extra_info"] = {"throughput_b8_files": files, "throughput_b8_audio_seconds": "120.000"}
        return [r]

    with pytest.raises(RunnerError, match="throughput_b8_files"):
        evaluate(at_batch("16"), at_batch("4"), Path("base.json"), {"throughput"}, Thresholds(20.0))
    assert evaluate(at_batch("16"), at_batch("16"), Path("base.json"), {"throughput"}, Thresholds(20.0)).changes


def test_the_cli_refuses_a_baseline_of_another_gpu_in_one_line(tmp_path, capsys):
    now, base = tmp_path / "now.json", tmp_path / "base.json"
    now.write_text(json.dumps(contextual(run())))
    base.write_text(json.dumps(contextual(run(decode=1000.0), gpu="NVIDIA A10G", arch="NVIDIA A10G")))
    assert main(["bench", "--from-json", str(now), "--baseline", str(base)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {base}: ") and "NVIDIA A10G" in err[0], err
    assert main(["bench", "--from-json", str(now), "--baseline", str(now)]) == 0
