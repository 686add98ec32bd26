"""Folder runs (`run --audio-dir / --audio-list --out`): one record per file with the tokens `run --audio` gives,
re-runs that skip what is done, a crash's partial line repaired, bad files as error records, Ctrl-C finishing its
line; and bench's throughput figure."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.app.cli import main
from runner.app.results_file import ResultsFile

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"
NAMES = ["short.wav", "silence.wav", "speech.wav"]
FAST = ["--max-new-tokens", "4"]


def records(path: Path) -> list[dict]:
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"", "the file ends with a whole line"
    return [json.loads(line) for line in lines[:-1]]


def ok(recs: list[dict]) -> list[dict]:
    return [r for r in recs if "error" not in r]


@pytest.fixture
def folder(tmp_path) -> Path:
    """The fixture files, and what a folder of recordings also holds: notes, a hidden resource fork, a subfolder."""
    d = tmp_path / "audio"
    d.mkdir()
    for n in NAMES:
        shutil.copy(AUDIO / n, d / n)
    (d / "notes.txt").write_text("not audio")
    (d / "._speech.wav").write_bytes(b"\0\0macOS resource fork")
    (d / "more").mkdir()
    shutil.copy(AUDIO / "short.wav", d / "more" / "nested.wav")
    return d


@pytest.fixture(scope="module")
def alone(tiny_bundle) -> dict[str, dict]:
    """Each fixture file's record from the single-file path (`run --audio F --json`), in one process."""
    out = subprocess.run(
        [sys.executable, "-m", "runner", "run", "--bundle", str(tiny_bundle), "--json", *FAST]
        + [a for n in NAMES for a in ("--audio", str(AUDIO / n))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return {Path(r["audio"]).name: r for r in map(json.loads, out.stdout.splitlines())}


def run(bundle: Path, *args: str) -> int:
    return main(["run", "--bundle", str(bundle), *FAST, *map(str, args)])


def test_a_folder_gives_one_record_per_file_with_the_tokens_of_run_audio(tiny_bundle, folder, alone, tmp_path, capsys):
    out = tmp_path / "res" / "results.jsonl"  # its folder is made
    # speech.wav named twice (by --audio and by the folder): it runs once
    assert run(tiny_bundle, "--audio", folder / "speech.wav", "--audio-dir", folder, "--out", out) == 0
    recs = records(out)
    assert [Path(r["audio"]).name for r in recs] == ["speech.wav", "short.wav", "silence.wav"]
    for r in recs:
        want = alone[Path(r["audio"]).name]
        assert r["tokens"] == want["tokens"] and r["prompt_ids"] == want["prompt_ids"]
        assert r["text"] == want["text"] and set(want) <= set(r)
    err = capsys.readouterr().err
    assert "progress: 3/3 files" in err and "done: 3 file(s)" in err
    # without --out every name runs, a file named twice too (one record each, as run --audio always gave)
    assert run(tiny_bundle, "--audio", folder / "speech.wav", "--audio-dir", folder, "--json") == 0
    names = [Path(json.loads(line)["audio"]).name for line in capsys.readouterr().out.splitlines()]
    assert names == ["speech.wav", "short.wav", "silence.wav", "speech.wav"]

    # --recursive takes the subfolder's file as well, and only it is new
    assert run(tiny_bundle, "--audio-dir", folder, "--recursive", "--out", out) == 0
    assert [Path(r["audio"]).name for r in records(out)] == ["speech.wav", "short.wav", "silence.wav", "nested.wav"]
    assert "skipping 3 of 4 file(s)" in capsys.readouterr().err


def test_a_rerun_skips_every_file_done_and_loads_nothing(tiny_bundle, folder, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    assert run(tiny_bundle, "--audio-dir", folder, "--out", out) == 0
    before = out.read_bytes()
    capsys.readouterr()
    # a bundle path that does not exist: the skip is decided before any load
    assert main(["run", "--bundle", str(tmp_path / "gone"), "--audio-dir", str(folder), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "skipping 3 of 3 file(s)" in err and "nothing to do" in err
    assert out.read_bytes() == before


def test_a_crash_mid_line_is_repaired_and_the_rerun_completes_without_duplicates(tiny_bundle, folder, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    assert run(tiny_bundle, "--audio-dir", folder, "--out", out) == 0
    first, second, _ = out.read_bytes().splitlines(keepends=True)
    # one whole record, then a crash half-way through the second
    out.write_bytes(first + second[: len(second) // 2])
    capsys.readouterr()
    assert run(tiny_bundle, "--audio-dir", folder, "--out", out) == 0
    err = capsys.readouterr().err
    assert "removed an incomplete last line" in err
    data = out.read_bytes()
    assert data.startswith(first)  # nothing before the partial line was touched
    recs = [json.loads(line) for line in data.splitlines()]
    assert sorted(Path(r["audio"]).name for r in recs) == sorted(NAMES)  # each file once


def test_a_bad_file_is_an_error_record_the_others_run_and_the_exit_is_1(tiny_bundle, folder, tmp_path, capsys):
    (folder / "broken.wav").write_bytes(b"RIFF\x10\0\0\0WAVEjunk")
    out = tmp_path / "results.jsonl"
    assert run(tiny_bundle, "--audio-dir", folder, "--out", out) == 1
    err = capsys.readouterr().err
    assert any(line.startswith("error:") and "broken.wav" in line for line in err.splitlines())
    recs = records(out)
    assert sorted(Path(r["audio"]).name for r in ok(recs)) == sorted(NAMES)
    (bad,) = [r for r in recs if "error" in r]
    assert Path(bad["audio"]).name == "broken.wav" and "broken.wav" in bad["error"]

    # the re-run retries only the error, and once the file is fixed it gets its record
    shutil.copy(AUDIO / "short.wav", folder / "broken.wav")
    assert run(tiny_bundle, "--audio-dir", folder, "--out", out) == 0
    assert "skipping 3 of 4 file(s)" in capsys.readouterr().err
    assert sorted(Path(r["audio"]).name for r in ok(records(out))) == sorted([*NAMES, "broken.wav"])


def test_audio_list_skips_comments_and_reads_paths_relative_to_itself(
    tiny_bundle, folder, alone, tmp_path, monkeypatch
):
    lists = tmp_path / "lists"
    lists.mkdir()
    listing = lists / "files.txt"
    listing.write_text(f"# my recordings\n\n  ../audio/speech.wav  \n# ../audio/silence.wav\n{folder / 'short.wav'}\n")
    out = tmp_path / "results.jsonl"
    monkeypatch.chdir(tmp_path / "audio")  # not the list's folder: relative entries follow the list, not the cwd
    assert run(tiny_bundle, "--audio-list", listing, "--out", out) == 0
    recs = records(out)
    assert [Path(r["audio"]).resolve() for r in recs] == [folder / "speech.wav", folder / "short.wav"]
    assert [r["tokens"] for r in recs] == [alone["speech.wav"]["tokens"], alone["short.wav"]["tokens"]]


@pytest.mark.parametrize(
    "make, args, message",
    [
        (lambda t: (t / "empty").mkdir(), ["--audio-dir", "{t}/empty"], "{t}/empty: no audio files"),
        (lambda t: None, ["--audio-dir", "{t}/nowhere"], "--audio-dir {t}/nowhere: no such directory"),
        (lambda t: None, ["--audio-list", "{t}/none.txt"], "--audio-list {t}/none.txt: no such file"),
        (lambda t: (t / "l.txt").write_text("# only\n\n"), ["--audio-list", "{t}/l.txt"], "{t}/l.txt: lists no files"),
        (lambda t: (t / "l.txt").write_bytes(b"a.wav\n\xff\n"), ["--audio-list", "{t}/l.txt"], "line 2 is not UTF-8"),
        (lambda t: None, ["--audio", "x.wav", "--out", "{t}"], "--out {t}: a directory"),
        (lambda t: None, ["--audio", "x.wav", "--batch", "0"], "--batch 0: must be at least 1"),
        (lambda t: None, [], "no audio: give --audio FILE, --audio-dir DIR or --audio-list FILE"),
    ],
)
def test_bad_inputs_are_one_error_line_before_any_load(tmp_path, capsys, make, args, message):
    make(tmp_path)
    argv = [a.format(t=tmp_path) for a in args]
    assert main(["run", "--bundle", str(tmp_path / "no-bundle"), *argv]) == 1  # fails before the bundle is read
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message.format(t=tmp_path) in err[0], err


def test_a_second_run_on_the_same_out_is_refused(tmp_path):
    out = tmp_path / "results.jsonl"
    first = ResultsFile.open(out)
    try:
        with pytest.raises(Exception, match="another run is writing to it"):
            ResultsFile.open(out)
    finally:
        first.close()


def test_ctrl_c_during_a_write_finishes_the_line_then_stops(tmp_path, monkeypatch):
    # Python's own Ctrl-C handler, whatever this process inherited: a shell's background job starts with SIGINT
    # ignored, and an ignored Ctrl-C rightly stays ignored after the write
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted_write(tmp_path, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_write(tmp_path, monkeypatch):
    out = ResultsFile.open(tmp_path / "results.jsonl")
    real_fsync = os.fsync

    def interrupted_fsync(fd):  # Ctrl-C lands after the write, before the line is on disk
        signal.raise_signal(signal.SIGINT)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", interrupted_fsync)
    with pytest.raises(KeyboardInterrupt):
        out.append({"audio": "a.wav", "text": "x" * 100_000})
    out.close()
    assert [r["audio"] for r in records(tmp_path / "results.jsonl")] == ["a.wav"]


def test_sigint_during_a_folder_run_leaves_only_whole_lines_and_the_rerun_finishes(tiny_bundle, tmp_path):
    n = 40  # enough that Ctrl-C, sent when the first record is there, lands while the others run
    d = tmp_path / "many"
    d.mkdir()
    for i in range(n):
        shutil.copy(AUDIO / "speech.wav", d / f"f{i:02d}.wav")
    out = tmp_path / "results.jsonl"
    argv = [sys.executable, "-m", "runner", "run", "--bundle", str(tiny_bundle), "--audio-dir", str(d)]
    argv += ["--out", str(out), "--max-new-tokens", "48", "--min-new-tokens", "48"]

    def default_sigint():  # a shell's background job may inherit SIGINT ignored; a terminal's Ctrl-C is not
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    deadline = time.monotonic() + 300
    while not (out.exists() and out.stat().st_size) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "error: interrupted" in err and "the same command again" in err, err
    recs = records(out)  # every line whole
    assert 1 <= len(recs) < n
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"skipping {len(recs)} of {n} file(s)" in done.stderr
    assert sorted(Path(r["audio"]).name for r in records(out)) == [f"f{i:02d}.wav" for i in range(n)]


# ---------------------------------------------------------------- bench's throughput figure


def test_bench_throughput_figures_agree_with_their_counts(tiny_bundle, tmp_path, capsys):
    from runner.app.bench.report import from_records

    path = tmp_path / "bench.json"
    argv = f"bench --bundle {tiny_bundle} --compare none --runs 1 --warmup 0 --min-new-tokens 4 --max-new-tokens 4"
    assert main([*argv.split(), "--throughput-files", "3", "--batch", "1", "--json", str(path)]) == 0
    assert "#### Throughput: 3 files" in capsys.readouterr().out
    recs = json.loads(path.read_text())
    by = {r["metric"]["name"]: r for r in recs if r["model"]["backend"] == "aoti"}
    value = {k: r["metric"]["benchmark_values"][0] for k, r in by.items() if k.startswith("throughput_")}
    info = by["throughput_wall_ms_b1"]["model"]["extra_info"]
    wall_s = value["throughput_wall_ms_b1"] / 1e3
    assert int(info["throughput_b1_files"]) == 3 and int(info["throughput_b1_tokens"]) == 3 * 4
    assert value["throughput_decode_tokens_per_s_b1"] == pytest.approx(int(info["throughput_b1_tokens"]) / wall_s)
    assert value["throughput_rtfx_b1"] == pytest.approx(float(info["throughput_b1_audio_seconds"]) / wall_s, rel=1e-3)
    assert (
        0 < value["throughput_file_p50_ms_b1"] <= value["throughput_file_p99_ms_b1"] <= value["throughput_wall_ms_b1"]
    )
    assert by["throughput_rtfx_b1"]["metric"]["extra_info"]["better"] == "higher"
    import jsonschema

    schema = json.loads((AUDIO.parents[1] / "benchmarks" / "schema" / "v3.schema.json").read_text())
    jsonschema.validate(recs, schema, cls=jsonschema.Draft202012Validator)  # what the benchmark database takes
    again = from_records(recs, path)  # and they read back, for --from-json and the gate
    assert again.ours.samples["throughput_rtfx_b1"] == [value["throughput_rtfx_b1"]]


# ---------------------------------------------------------------- at batch > 1 (a bundle exported with --max-batch)


def test_a_batched_folder_run_gives_the_tokens_of_the_serial_one(tiny_batch_bundle, folder, tmp_path):
    shutil.copy(AUDIO / "long_35s.flac", folder / "long.flac")  # longer than the others: they finish around it
    serial, batched = tmp_path / "serial.jsonl", tmp_path / "batched.jsonl"
    assert run(tiny_batch_bundle, "--audio-dir", folder, "--out", serial, "--max-new-tokens", "12") == 0
    assert (
        run(tiny_batch_bundle, "--audio-dir", folder, "--batch", "3", "--out", batched, "--max-new-tokens", "12") == 0
    )
    one = {Path(r["audio"]).name: r for r in records(serial)}
    many = {Path(r["audio"]).name: r for r in records(batched)}  # in completion order
    assert sorted(many) == sorted(one) == sorted([*NAMES, "long.flac"])
    for name, r in many.items():  # fp32 on the CPU: exactly the serial tokens
        assert (r["tokens"], r["prompt_ids"], r["text"]) == (
            one[name]["tokens"],
            one[name]["prompt_ids"],
            one[name]["text"],
        )


def test_bench_throughput_compares_batch_sizes_on_the_same_files(tiny_batch_bundle, tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = (
        f"bench --bundle {tiny_batch_bundle} --compare none --runs 1 --warmup 0 --min-new-tokens 4 --max-new-tokens 4"
    )
    assert main([*argv.split(), "--throughput-files", "4", "--batch", "1,4", "--json", str(path)]) == 0
    table = capsys.readouterr().out
    assert "| 1 |" in table and "| 4 |" in table and "1.00x" in table  # the serial row beside the batched one
    recs = {r["metric"]["name"]: r for r in json.loads(path.read_text())}
    info = recs["throughput_wall_ms_b4"]["model"]["extra_info"]
    assert info["throughput_b1_tokens"] == info["throughput_b4_tokens"] == str(4 * 4)
    # the step alone at each batch (batch 1: the decode step; 4: the batched one), and the steady-state decode
    # rate the table derives from it: batch / step
    steps = {b: recs[f"throughput_step_ms_b{b}"]["metric"]["benchmark_values"][0] for b in (1, 4)}
    assert all(v > 0 for v in steps.values())
    row4 = next(line for line in table.splitlines() if line.startswith("| 4 |")).split("|")
    # the table prints the rate with one decimal: half a unit of that is the most the printed figure can differ
    assert float(row4[7]) == pytest.approx(steps[4], abs=1e-3) and float(row4[8]) == pytest.approx(
        4e3 / steps[4], abs=0.05
    )
