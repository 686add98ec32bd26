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
