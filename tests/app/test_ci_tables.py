"""The CI scripts' hostile inputs: hub ids and env numbers are validated strictly (one `error:` line naming the
input), and the markdown the job summaries write keeps its shape whatever the file names, keys and values hold
(one shared escaping function: each row one line with the expected cell count, no raw HTML)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.app.bench.report import BackendResult, BenchRun, markdown, to_records
from runner.app.e2e_summary import E2ESummary, FileRow, md_text

try:
    from tests.script_module import load_module
except ImportError:  # tests/ on sys.path rather than importable as a package
    from script_module import load_module

ROOT = Path(__file__).resolve().parents[2]
preflight = load_module("preflight", ROOT / "ci_scripts" / "preflight.py")
hub_checkpoint = load_module("hub_checkpoint", ROOT / "ci_scripts" / "hub_checkpoint.py")
job_summary = load_module("job_summary", ROOT / "ci_scripts" / "job_summary.py")

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
HOSTILE = ["a|b", "x`y`", "l1\nl2", "cr\r\nlf", "<script>alert(1)</script>", "back\\|slash", "a\\", "& < >", "**b**"]
# text made of what breaks markdown tables and headings, with plain letters between
hostile_text = st.lists(
    st.sampled_from([*HOSTILE, "|", "`", "\\", "\n", "\r", "<", ">", "&", "#", "*", "_", "[", "]", " ", "a", "é"]),
    max_size=12,
).map("".join)
CELL = re.compile(r"(?:\\.|[^|\\])*")  # a GFM table cell: escaped characters or anything but a pipe


def cells(row: str) -> list[str]:
    """A markdown table row's cells as GitHub splits them: on pipes that are not backslash-escaped."""
    assert row.startswith("|") and row.endswith("|"), row
    body = row[1:-1]
    out, pos = [], 0
    while True:
        m = CELL.match(body, pos)
        out.append(m.group(0))
        pos = m.end()
        if pos >= len(body):
            return out
        pos += 1  # the pipe


def assert_table_shape(text: str, width: int, rows: int) -> None:
    """`text` holds one table of `rows` rows of `width` cells (after the header and rule), every line of it a row,
    and no raw HTML anywhere."""
    lines = text.splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == rows + 2, text
    start = lines.index(table[0])
    assert lines[start : start + len(table)] == table, "a row spilled over lines"
    assert all(len(cells(line)) == width for line in table), [len(cells(line)) for line in table]
    assert "<script" not in text.lower() and not re.search(r"<[a-z/]", text, re.IGNORECASE), text


def assert_one_heading(text: str) -> None:
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert len(headings) == 1 and headings[0].startswith("### "), text


# ---- the one escaping function


@SETTINGS
@given(hostile_text)
def test_an_escaped_cell_is_one_cell_on_one_line_without_html(text):
    escaped = md_text(text)
    assert "\n" not in escaped and "\r" not in escaped
    assert cells(f"| {escaped} |") == [f" {escaped} "]
    assert "<" not in escaped and ">" not in escaped and not re.search(r"(?<!\\)(?:\\\\)*`", escaped)
    # nothing lost: undoing the escapes gives the text back with its whitespace runs as single spaces
    undone = re.sub(r"\\(.)", r"\1", escaped).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    assert undone == " ".join(text.split())


# ---- ci_scripts/job_summary.py


@SETTINGS
@given(st.lists(st.tuples(hostile_text, hostile_text), min_size=1, max_size=5), hostile_text)
def test_job_summary_records_with_hostile_keys_and_values_keep_the_table(pairs, title):
    records = [{"name": key or "k", "value": value} for key, value in pairs]
    records[0][pairs[0][0] or "k"] = pairs[0][1]  # a hostile key too: its own column
    text = job_summary.render({"results": records, "device": title}, title)
    width = len(dict.fromkeys(k for r in records for k in r))
    assert_table_shape(text, width, len(records))
    assert_one_heading(text)


@SETTINGS
@given(st.dictionaries(hostile_text, hostile_text, min_size=1, max_size=5), hostile_text)
def test_job_summary_plain_object_with_hostile_keys_keeps_two_columns(data, title):
    text = job_summary.render(data, title)
    assert_table_shape(text, 2, len(job_summary.flatten(data)))
    assert_one_heading(text)


def bench_run(name: str) -> BenchRun:
    ctx = {k: name for k in ("model", "device", "dtype", "arch", "torch_version", "git_sha", "bundle", "audio")}
    ctx |= {"bundle_digest": name, "runs": "3", "warmup": "1", "chunks": "1", "prefill_tokens": "9"}
    ctx |= {"audio_seconds": "2.0", "new_tokens": "8", "memory_kind": name, "fallbacks": name}
    ours = BackendResult("aoti", {"ttft_ms": [1.0, 2.0], "decode_tokens_per_s": [50.0, 60.0]}, {"note": name})
    peer = BackendResult(name, {"ttft_ms": [2.0, 3.0], "decode_tokens_per_s": [40.0, 45.0]}, {"note": name})
    broken = BackendResult(name + "x", error=name)
    return BenchRun(ctx, [ours, peer, broken])


@SETTINGS
@given(st.sampled_from(HOSTILE), hostile_text)
def test_bench_records_with_hostile_names_keep_the_headline_table(name, title):
    run = bench_run(name)
    text = job_summary.render(to_records(run), title)
    assert_table_shape(text, 4, 2)  # figure, ours, the peer, ours vs the peer; two figures
    assert_one_heading(text)
    assert_one_heading(markdown(run))  # bench's own title, built from the records' context


def script(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "ci_scripts" / "job_summary.py"), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize(
    "content",
    [b"[" * 100_000 + b"]" * 100_000, b'{"a": "\xff\xfe"}', b"{", b'{"a":' * 2000 + b"1" + b"}" * 2000],
    ids=["deep", "not-utf8", "not-json", "deep-object"],
)
def test_job_summary_bad_json_is_one_error_line_naming_the_file(tmp_path, content):
    bad = tmp_path / "results.json"
    bad.write_bytes(content)
    summary = tmp_path / "summary.md"
    r = script(bad, "--out", summary)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {bad}") and "Traceback" not in r.stderr
    assert not summary.exists()


# ---- runner/app/e2e_summary.py


@SETTINGS
@given(st.lists(st.tuples(hostile_text, hostile_text), min_size=1, max_size=4), hostile_text, hostile_text)
def test_e2e_summary_with_hostile_file_names_and_texts_keeps_the_table(files, title, settings_line):
    summary = E2ESummary(title, settings_line, len(files))
    summary.rows = [FileRow(name, text, {"wer": "1.0% (1/100)"}) for name, text in files]
    summary.rows.append(FileRow(files[0][0], "", error=files[0][1] or "x"))
    text = summary.markdown([f"{name}: failed" for name, _ in files])
    assert_table_shape(text, 6, len(files) + 1)  # file, text and the four checks
    assert_one_heading(text)
    assert all(line.startswith(("### ", "|", "- ", "**")) or line in ("", md_text(settings_line)) for line in
               text.splitlines()), text  # fmt: skip


# ---- ci_scripts/preflight.py and hub_checkpoint.py

GOOD = {"CUDA_RUNNER_LABEL": "gpu", "PRESET": "tiny", "CHECKPOINT": "", "DTYPE": "bf16", "QUANT": "all"}
GOOD |= {"MAX_NEW_TOKENS": "128", "BENCHMARK_RUNS": "5"}


@pytest.mark.parametrize("value", ["²", "５", "1e3", " 5", "5\n", "-1", "", "0x10", "1_0"])
@pytest.mark.parametrize("name", ["MAX_NEW_TOKENS", "BENCHMARK_RUNS"])
def test_preflight_env_numbers_are_ascii_digits_or_one_error_line(capsys, name, value):
    assert preflight.main([], {**GOOD, name: value}) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and name in err, err


def test_preflight_env_numbers_in_range_pass(capsys):
    assert preflight.main([], {**GOOD, "MAX_NEW_TOKENS": "4096", "BENCHMARK_RUNS": "1"}) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "checkpoint", ["org/name\n", "org/name\r", "org/name ", " org/name", "org/na\nme", "/ckpt\n", "/ck\rpt"]
)
def test_preflight_refuses_a_checkpoint_with_whitespace_or_a_line_break(capsys, checkpoint):
    assert preflight.main([], {**GOOD, "CHECKPOINT": checkpoint}) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: checkpoint"), err


@pytest.mark.parametrize("repo_id", ["org/name\n", "org/name\r\n", "org/name ", "org /name", "org/name\t"])
def test_hub_checkpoint_refuses_an_id_with_whitespace_before_any_download(tmp_path, capsys, monkeypatch, repo_id):
    calls = []
    fake = type(sys)("huggingface_hub")
    fake.snapshot_download = lambda *a, **k: calls.append((a, k)) or str(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    assert hub_checkpoint.main([repo_id, str(tmp_path / "dest")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and calls == []
    assert hub_checkpoint.main(["org/name", str(tmp_path / "dest")]) == 0 and len(calls) == 1


# ---- ci_scripts/check_bundle.py


@SETTINGS
@given(st.lists(hostile_text, min_size=1, max_size=4), hostile_text)
def test_bundle_summary_with_hostile_file_and_method_names_keeps_its_tables(names, dirname):
    check_bundle = load_module("check_bundle", ROOT / "ci_scripts" / "check_bundle.py")
    model = {"compile_seconds": {n: 1.5 for n in names}, "compile_cached": {n: True for n in names}}
    manifest = type("M", (), {"device": dirname, "dtype": "bf16", "torch_version": dirname, "gpu_arch": dirname})
    manifest.model = model
    rows = [(n, n, "10", "0" * 64) for n in names]
    text = check_bundle.summary(manifest, Path("/b") / (dirname.replace("/", "") or "d"), "0" * 64, rows)
    files, methods = text.split("| method |")
    assert_table_shape(files, 4, len(rows) + 1)  # the files, then the total
    assert_table_shape("| method |" + methods, 3, len(model["compile_seconds"]))
    assert_one_heading(text)


# ---- ci_scripts/preflight.py: the weekly run without a GPU runner, runner labels


def _outputs(path) -> dict:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_the_weekly_run_without_a_gpu_runner_is_a_notice_and_skips_the_gpu_jobs(tmp_path, capsys):
    out = tmp_path / "out"
    env = {**GOOD, "CUDA_RUNNER_LABEL": "", "EVENT_NAME": "schedule"}
    assert preflight.main(["--github-output", str(out)], env) == 0
    assert _outputs(out)["run"] == "false" and json.loads(_outputs(out)["matrix"]) == {"include": []}
    assert capsys.readouterr().out.startswith("::notice::the weekly GPU run is skipped: no GPU runner configured")
    # a dispatch (or a labelled pull request) without a runner still fails, in one line
    assert preflight.main([], {**env, "EVENT_NAME": "workflow_dispatch"}) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no GPU runner configured")


@pytest.mark.parametrize(
    ("label", "runs_on"),
    [("gpu-h100", "gpu-h100"), ('["self-hosted", "gpu"]', ["self-hosted", "gpu"]), (" linux-gpu ", "linux-gpu")],
)
def test_the_runner_label_is_one_label_or_a_json_list(tmp_path, label, runs_on):
    out = tmp_path / "out"
    assert preflight.main(["--github-output", str(out)], {**GOOD, "CUDA_RUNNER_LABEL": label}) == 0
    got = _outputs(out)
    assert got["run"] == "true" and json.loads(got["runs-on"]) == runs_on and json.loads(got["matrix"])["include"]


@pytest.mark.parametrize("label", ["[]", '["gpu", 3]', "[gpu", 'gpu"; rm', '["a b"]'])
def test_a_runner_label_that_is_neither_is_one_line(capsys, label):
    assert preflight.main([], {**GOOD, "CUDA_RUNNER_LABEL": label}) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: CUDA_RUNNER_LABEL")
