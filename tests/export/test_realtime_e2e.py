"""tiny-realtime end to end: export the three step methods, stream the fixture audio through `python -m runner
stream` (from a file, paced or not, and as raw PCM on stdin), and check the tokens against the golden file, a
whole-file run and the eager model on the bundle's weights."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import CACHE, FIXTURES

from runner.audio import load_audio
from runner.bundle import read_manifest
from runner.export.options import ExportOptions
from runner.export.registry import LoadRequest
from runner.export.voxtral_realtime import export_voxtral_realtime, load
from runner.families import family_for
from runner.families.voxtral_realtime import NAME, ProgramSteps, StreamSession, run_whole
from runner.reference.voxtral_realtime import eager_steps
from runner.runtime.program import Program

GOLDEN_FILE = FIXTURES / "golden" / "tiny-realtime.json"
GOLDEN = json.loads(GOLDEN_FILE.read_text())
AUDIO = ("speech.wav", "short.wav")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    loaded = load(LoadRequest("tiny-realtime", None))
    model, source, tekken = loaded.model, loaded.source, loaded.tokenizer
    out = tmp_path_factory.mktemp("rt") / "tiny-realtime"
    export_voxtral_realtime(model, source, tekken, out, ExportOptions(cache_dir=CACHE))
    return out


def _run_stream(bundle: Path, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "runner", "stream", "--bundle", str(bundle), "--json", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, timeout=300)


def _stream(bundle: Path, *args: str, stdin: bytes | None = None) -> dict:
    p = _run_stream(bundle, *args, stdin=stdin)
    assert p.returncode == 0, p.stderr.decode()
    lines = p.stdout.decode().splitlines()
    assert len(lines) == 1  # stdout carries only the record; text streamed to stderr
    return json.loads(lines[0])


def test_manifest_declares_the_streaming_steps(bundle):
    m = read_manifest(bundle)
    assert m.model["family"] == NAME and set(m.methods) == {"preprocessor", "encoder_step", "decoder_step"}
    assert m.model["num_delay_tokens"] == 6 and m.model["n_left_pad_tokens"] == 2
    assert m.methods["decoder_step"].state and m.methods["encoder_step"].state
    # one program for every batch of 1..max_streams streams; the state has a row per stream slot
    assert m.model["max_streams"] == 8
    for method in m.methods.values():
        assert all(x.shape[0] == {"min": 1, "max": 8} for x in [*method.inputs, *method.outputs])
        assert all(st.shape[0] == 8 for st in method.state.values())


@pytest.mark.parametrize("name", AUDIO)
def test_stream_gives_the_golden_tokens(bundle, name):
    rec = _stream(bundle, "--audio", str(FIXTURES / "audio" / name), "--block-ms", "30")
    assert rec["tokens"] == GOLDEN["tokens"]["cpu-float32"][name]
    s = rec["stats"]
    assert s["steps"] > 0 and s["step_ms_p99"] >= s["step_ms_p50"] > 0 and s["rtf"] > 0
    assert s["model_delay_ms"] == 480


def test_stdin_pcm_equals_the_file(bundle):
    samples = load_audio(FIXTURES / "audio" / "speech.wav")
    pcm = (np.clip(samples, -1, 1 - 2**-15) * 32768).astype("<i2").tobytes()
    rec = _stream(bundle, "--audio", "-", stdin=pcm)
    file_rec = _stream(bundle, "--audio", str(FIXTURES / "audio" / "speech.wav"))
    # s16 quantisation changes the features a little; the tiny model's greedy tokens stay put
    assert rec["tokens"] == file_rec["tokens"]
    f32 = _stream(bundle, "--audio", "-", "--pcm", "f32le", stdin=samples.astype("<f4").tobytes())
    assert f32["tokens"] == file_rec["tokens"]


def test_realtime_pacing_takes_wall_clock_time(bundle):
    short = FIXTURES / "audio" / "short.wav"
    seconds = len(load_audio(short)) / 16000
    t = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time,subprocess,sys; t=time.perf_counter(); "
            f"subprocess.run([sys.executable,'-m','runner','stream','--bundle',{str(bundle)!r},'--audio',{str(short)!r},"
            "'--realtime','--json'],check=True,capture_output=True); print(time.perf_counter()-t)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert float(t.stdout) >= seconds * 0.9


def test_streamed_equals_whole_file_and_eager(bundle):
    samples = load_audio(FIXTURES / "audio" / "speech.wav")
    with Program.load(bundle) as program:
        family = family_for(bundle, program.manifest.model)
        steps = ProgramSteps(program)
        whole = run_whole(steps, family.spec, samples)
        session = StreamSession(steps, family.spec)
        for i in range(0, len(samples), 777):  # blocks that never line up with a position
            session.feed(samples[i : i + 777])
        session.finish()
        assert session.tokens == whole
        eager = run_whole(eager_steps(bundle, program.manifest), family.spec, samples)
    assert eager == whole == GOLDEN["tokens"]["cpu-float32"]["speech.wav"]
    assert len(set(whole)) > 3  # the tiny model's tokens follow the audio: a real golden test


def test_stream_refuses_a_bundle_of_another_family(tiny_bundle):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "stream",
            "--bundle",
            str(tiny_bundle),
            "--audio",
            str(FIXTURES / "audio" / "short.wav"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr


def test_the_e2e_checks_pass_and_say_so(bundle):
    """What `nox -s e2e -- --model tiny-realtime` runs: golden tokens, streamed == whole file == eager."""
    rec = _stream(
        bundle, "--audio", str(FIXTURES / "audio" / "short.wav"), "--expect-tokens", str(GOLDEN_FILE),
        "--check-whole", "--reference", "eager",
    )  # fmt: skip
    assert rec["checks"] == {"golden": "match", "whole": "match", "eager": "match"}


def test_a_wrong_golden_token_fails_with_one_line_per_file(bundle, tmp_path):
    golden = json.loads(GOLDEN_FILE.read_text())
    files = golden["tokens"]["cpu-float32"]
    files["short.wav"] = files["short.wav"][:5] + [(files["short.wav"][5] + 1) % 1000] + files["short.wav"][6:]
    files["speech.wav"] = files["speech.wav"][:-1]  # one token short: a difference too, where it ends
    bad = tmp_path / "golden.json"
    bad.write_text(json.dumps(golden))
    audio = [x for n in ("short.wav", "speech.wav") for x in ("--audio", str(FIXTURES / "audio" / n))]
    p = _run_stream(bundle, *audio, "--expect-tokens", str(bad))
    assert p.returncode == 1
    assert len(p.stdout.decode().splitlines()) == 2  # every file's record, failures or not
    errors = [line for line in p.stderr.decode().splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {FIXTURES / 'audio' / 'short.wav'}: tokens differ from golden.json at index 5",
        f"error: {FIXTURES / 'audio' / 'speech.wav'}: tokens differ from golden.json at index "
        f"{len(files['speech.wav'])}",
    ]
    assert "Traceback" not in p.stderr.decode()


def test_check_bundle_accepts_the_streaming_bundle_and_its_files(bundle, tmp_path):
    """The CI job's required-file check: the three step methods (library + weights) and tekken.json."""
    check = [sys.executable, str(ROOT / "ci_scripts" / "check_bundle.py")]
    out = tmp_path / "github_output"
    p = subprocess.run([*check, str(bundle), "--github-output", str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for method in ("preprocessor", "encoder_step", "decoder_step"):
        assert f"{method} library" in p.stdout and f"{method} weights" in p.stdout
    assert "tokenizer" in p.stdout
    paths = out.read_text().split("upload-paths<<__PATHS__\n")[1].split("\n__PATHS__")[0].splitlines()
    assert sorted(Path(x).name for x in paths) == sorted(["model.pte", *read_manifest(bundle).files])

    broken = tmp_path / "broken"
    shutil.copytree(bundle, broken)
    (broken / "decoder_step.so").unlink()
    p = subprocess.run([*check, str(broken)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.startswith("error: ") and "decoder_step.so" in p.stderr


def test_concurrent_streams_give_the_golden_tokens_and_each_file_alone_s(bundle):
    """Every fixture file at once: one batched step loop, a stream per state row (what the e2e session runs)."""
    names = list(GOLDEN["tokens"]["cpu-float32"])
    audio = [x for n in names for x in ("--audio", str(FIXTURES / "audio" / n))]
    p = _run_stream(bundle, *audio, "--expect-tokens", str(GOLDEN_FILE), "--check-whole", "--block-ms", "50")
    assert p.returncode == 0, p.stderr.decode()
    records = [json.loads(line) for line in p.stdout.decode().splitlines()]
    assert [Path(r["audio"]).name for r in records] == names
    for r in records:
        assert r["checks"] == {"golden": "match", "whole": "match"}, r["audio"]


def test_stream_bench_reports_every_figure(bundle, tmp_path):
    """`stream --bench` on the CPU bundle (the GPU run's figures, small): batch-1 steps and halves, the batch sweep,
    paced latency, and a stream past its first minute for the memory figures."""
    out = tmp_path / "bench.json"
    p = subprocess.run(
        [
            sys.executable, "-m", "runner", "stream", "--bench", "--bundle", str(bundle), "--bench-seconds", "2",
            "--bench-steps", "6", "--bench-batches", "1,3", "--latency-seconds", "1", "--long-minutes", "1.1",
            "--bench-json", str(out),
        ],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    # the positions whose window (1520 samples from 1280 p, past 200 samples of STFT padding and 2 positions of
    # left padding) 2 s of audio completes, the 5 warm-up steps dropped
    assert r["steps_timed"] == (200 + 2 * 1280 + 32000 - 1520) // 1280 + 1 - 5
    assert 0 < r["step_ms_p50"] <= r["step_ms_p99"]
    assert r["decode_tokens_per_s"] == round(1e3 / r["decoder_ms"], 1)
    assert [b["batch"] for b in r["batches"]] == [1, 3] and r["max_streams"] == 8
    assert all(b["held"] == (b["step_ms_p99"] < 80) for b in r["batches"])
    assert r["max_streams_held"] == max((b["batch"] for b in r["batches"] if b["held"]), default=0)
    assert r["latency"][0]["batch"] == 1 and r["latency"][0]["token_latency_ms_p50"] >= 0
    long = r["long_stream"]
    assert long["minutes"] >= 1.1 and long["steps"] >= 1.1 * 60 * 12.5
    assert long["growth_mib"]["rss_mib"] == round(long["at_end"]["rss_mib"] - long["after_first_minute"]["rss_mib"], 1)
    assert r["cuda_graphs"] is False and r["model_delay_ms"] == 480
    for row in ("compute per 80 ms at batch 1", "decode at batch 1 (tokens/s)", "concurrent streams held",
                "token latency beyond the model delay", "growth after the first minute"):  # fmt: skip
        assert row in p.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bench", "--audio", "x.wav"], "--bench streams synthetic audio"),
        (["--bench", "--bench-batches", "0,2"], "--bench-batches 0,2: each between 1"),
        (["--bench", "--bench-batches", "9"], "max_streams (8)"),
        ([], "--audio FILE (or -) is required"),
    ],
)
def test_bad_bench_options_are_one_line(bundle, args, message):
    p = subprocess.run(
        [sys.executable, "-m", "runner", "stream", "--bundle", str(bundle), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 1 and p.stderr.startswith("error: ") and message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
