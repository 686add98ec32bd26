"""Soak and lifecycle: many runs in one process give the single-run result every time, and nothing grows.

The seed's world had a stale-shape cache (variable-length audio read stale sizes), a GPU output leaked per
execute, a teardown segfault and temp `.so` files overwriting each other. These tests would catch each:
- `test_soak_*`: N greedy runs over audio of mixed lengths (under a second to several 30 s chunks) through one
  loaded program; every result equals that file's single-run result; RSS (after malloc_trim), open fds, mapped
  libraries, threads (and on CUDA allocated GPU memory) are flat after warm-up: the least-squares slope is
  printed and bounded.
- `test_load_destroy_*`: two bundles loaded, run and destroyed together N times, in both orders.
- identical libraries loaded at once stay separate and nothing is written; threads: two runners in two threads
  are correct, two threads on one runner get a clear "busy" error, never a mixed KV cache.

Short versions run in the default suite (`.ci/run`); the 1000-run / 100-load versions are `@pytest.mark.slow`
(`nox -s soak`). `VOXTRAL_SOAK_BUNDLE=DIR` soaks another bundle (e.g. a CUDA one on a GPU machine).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import prompt_for, runner_for

from runner.audio import N_SAMPLES, SAMPLE_RATE, load_audio
from runner.audio_chunks import num_chunks
from runner.bundle import file_entries, read_manifest, write_manifest
from runner.digests import sha256_file
from runner.errors import GenerationError
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.program import Program

ROOT = Path(__file__).resolve().parents[2]
AUDIO = ROOT / "fixtures" / "audio"
FIXTURE_FILES = ["short.wav", "speech_48k_stereo.wav", "silence.wav", "speech.wav", "long_35s.flac"]
OPTS = GenerationOptions(max_new_tokens=12)


# ---------------------------------------------------------------- measuring


def _mapped_libraries() -> set[str]:
    with open("/proc/self/maps") as f:
        paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    return {p for p in paths if ".so" in Path(p).name}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def sample(device: str) -> dict[str, float]:
    """What must stay flat: RSS after glibc returned its free pages (allocator slack with several arenas is noisy
    at this scale), open fds, mapped shared libraries, threads, and allocated GPU memory on CUDA."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    s = {
        "rss_kb": _status("VmRSS"),
        "fds": len(os.listdir("/proc/self/fd")),
        "libs": len(_mapped_libraries()),
        "threads": _status("Threads"),
    }
    if device == "cuda":
        torch.cuda.synchronize()
        s["gpu_alloc_kb"] = torch.cuda.memory_allocated() / 1024
        s["gpu_reserved_kb"] = torch.cuda.memory_reserved() / 1024
    return s


@dataclass
class Trend:
    """Samples taken after warm-up, at run (or cycle) indices `x`; slopes per run by least squares."""

    x: list[int]
    samples: list[dict[str, float]]

    def slope(self, key: str) -> float:
        y = np.array([s[key] for s in self.samples], dtype=np.float64)
        return float(np.polyfit(np.array(self.x, dtype=np.float64), y, 1)[0]) if len(y) > 1 else 0.0

    def spread(self, key: str) -> float:
        y = [s[key] for s in self.samples]
        return max(y) - min(y)

    def growth(self, key: str) -> float:
        return self.samples[-1][key] - self.samples[0][key]

    def report(self, what: str) -> str:
        keys = list(self.samples[0])
        parts = [
            f"{k} {self.samples[0][k]:.0f}->{self.samples[-1][k]:.0f} (slope {self.slope(k):+.3f}/step)" for k in keys
        ]
        return f"{what}: " + "; ".join(parts)


def check_flat(trend: Trend, what: str, *, rss_kb_per_step: float, rss_kb_total: float) -> None:
    print("\n" + trend.report(what))
    s0, s1 = trend.samples[0], trend.samples[-1]
    # a leak opens descriptors; one an earlier test left to the garbage collector may close mid-run
    fds = [s["fds"] for s in trend.samples]
    assert max(fds) <= fds[0], f"{what}: open fds grew: {fds}"
    assert trend.spread("libs") == 0, f"{what}: mapped libraries changed: {[s['libs'] for s in trend.samples]}"
    assert s1["threads"] <= s0["threads"], f"{what}: threads grew {s0['threads']} -> {s1['threads']}"
    slope = trend.slope("rss_kb")
    assert slope < rss_kb_per_step, f"{what}: RSS grows {slope:.1f} kB per step (limit {rss_kb_per_step})"
    assert trend.growth("rss_kb") < rss_kb_total, f"{what}: RSS grew {trend.growth('rss_kb'):.0f} kB"
    if "gpu_alloc_kb" in s0:
        assert trend.spread("gpu_alloc_kb") == 0, f"{what}: GPU memory allocated changed: {trend.report(what)}"
        assert trend.growth("gpu_reserved_kb") <= 0, f"{what}: GPU memory reserved grew"


# ---------------------------------------------------------------- runs


def make_runner(program: Program) -> MultimodalRunner:
    return runner_for(program)


def result_of(runner: MultimodalRunner, path: Path, opts: GenerationOptions = OPTS) -> tuple:
    r = runner.generate(prompt_for(runner, path, None, None), opts)
    return (tuple(r.tokens), r.text, tuple(r.prompt_ids), r.stop_reason)


def single_run_results(bundle: Path, files: list[Path], opts: GenerationOptions = OPTS) -> dict[Path, tuple]:
    """Each file run once, on a freshly loaded program of its own (what a one-file process computes)."""
    out = {}
    for f in files:
        with Program.load(bundle) as p:
            out[f] = result_of(make_runner(p), f, opts)
    return out


def cli_single_run_results(bundle: Path, files: list[Path], opts: GenerationOptions = OPTS) -> dict[Path, tuple]:
    """Each file in its own `python -m runner run --json` process: the single-run result, literally."""
    out = {}
    for f in files:
        r = subprocess.run(
            [sys.executable, "-m", "runner", "run", "--bundle", str(bundle), "--audio", str(f), "--json",
             "--max-new-tokens", str(opts.max_new_tokens)],
            cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        rec = json.loads(r.stdout)
        out[f] = (tuple(rec["tokens"]), rec["text"], tuple(rec["prompt_ids"]), rec["stop_reason"])
    return out


def soak(bundle: Path, files: list[Path], runs: int, warmup: int, every: int, reference: dict[Path, tuple]) -> Trend:
    """`runs` runs through one program, files in a fixed shuffled order; every result is checked against
    `reference`. Every `every` runs after `warmup`, one more run of the first (shortest) file, then a sample: the
    delegate's metadata cache holds each method's last input until its next call (2 chunks of audio: ~3.4 MB),
    so memory is compared in the same state each time, not after whichever file came last."""
    order = np.random.default_rng(0).permutation(np.resize(np.arange(len(files)), runs))
    x, samples, wrong, done = [], [], [], 0
    with Program.load(bundle) as program:
        runner = make_runner(program)
        t0 = time.perf_counter()

        def run(f: Path) -> None:
            nonlocal done
            got = result_of(runner, f)
            done += 1
            if got != reference[f]:
                wrong.append((done, f.name, got[0][:8], reference[f][0][:8]))

        for i, k in enumerate(order):
            run(files[k])
            if i + 1 >= warmup and (i + 1 - warmup) % every == 0:
                run(files[0])
                x.append(i + 1)
                samples.append(sample(program.device))
        seconds = time.perf_counter() - t0
    assert not wrong, f"{len(wrong)} of {done} runs differ from the single-run result, first: {wrong[:3]}"
    print(f"\n{done} runs over {len(files)} files in {seconds:.1f} s ({seconds / done * 1e3:.0f} ms per run)")
    return Trend(x, samples)


def chunk_mix(files: list[Path]) -> str:
    return ", ".join(f"{f.name}: {len(load_audio(f)) / SAMPLE_RATE:.1f} s" for f in files)


@pytest.fixture(scope="module")
def soak_bundle(request) -> Path:
    if os.environ.get("VOXTRAL_SOAK_BUNDLE"):
        return Path(os.environ["VOXTRAL_SOAK_BUNDLE"])
    return request.getfixturevalue("tiny_bundle")


@pytest.fixture(scope="module")
def fixture_files(soak_bundle) -> list[Path]:
    most = read_manifest(soak_bundle).model["max_audio_chunks"]
    return [AUDIO / n for n in FIXTURE_FILES if num_chunks(len(load_audio(AUDIO / n))) <= most]


def test_soak_short(soak_bundle, fixture_files):
    """30 runs (+ a probe run before each sample, every 2 runs past 6 of warm-up): results identical, nothing
    grows. Measured here: RSS within +-16 kB of the first sample."""
    reference = single_run_results(soak_bundle, fixture_files)
    print("\nfiles:", chunk_mix(fixture_files))
    trend = soak(soak_bundle, fixture_files, runs=30, warmup=6, every=2, reference=reference)
    # Leaking every output would be >= the mel (1.5 MB per chunk) per run; leaking only the logits of each
    # decode step, 12 x 4 kB per run. Either is far over these bounds.
    check_flat(trend, "30 runs", rss_kb_per_step=16, rss_kb_total=1024)


@pytest.fixture(scope="module")
def long_bundle(request, tmp_path_factory) -> Path:
    """The tiny model with room for 4 chunks (2 min of audio): the slow soak's "several chunks"."""
    if os.environ.get("VOXTRAL_SOAK_BUNDLE"):
        return Path(os.environ["VOXTRAL_SOAK_BUNDLE"])
    tiny_checkpoint = request.getfixturevalue("tiny_checkpoint")
    from runner.export.checkpoint import load_checkpoint
    from runner.export.options import ExportOptions
    from runner.export.voxtral import export_voxtral

    out = tmp_path_factory.mktemp("bundles") / "tiny-4chunks"
    model, source, tekken = load_checkpoint(tiny_checkpoint)
    export_voxtral(model, source, tekken, out, ExportOptions(max_audio_chunks=4, max_seq_len=1600))
    return out


def long_files(tmp: Path, max_chunks: int) -> list[Path]:
    """Speech spread over 3 and 4 chunks (speech, silence, tone), beside the fixtures."""
    speech = load_audio(AUDIO / "speech.wav")
    out = []
    for chunks in (3, 4):
        if chunks > max_chunks:
            continue
        n = chunks * N_SAMPLES - SAMPLE_RATE * 7  # a few seconds short of whole chunks: padding in play
        x = np.zeros(n, np.float32)
        for start in range(0, n - len(speech), 20 * SAMPLE_RATE):
            x[start : start + len(speech)] = speech
        t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
        x[-SAMPLE_RATE:] += 0.2 * np.sin(2 * np.pi * 330 * t).astype(np.float32)
        path = tmp / f"speech_{chunks}chunks.flac"
        sf.write(path, x, SAMPLE_RATE)
        out.append(path)
    return out


@pytest.mark.slow
def test_soak_1000_runs(long_bundle, tmp_path):
    most = read_manifest(long_bundle).model["max_audio_chunks"]
    files = [AUDIO / n for n in FIXTURE_FILES] + long_files(tmp_path, most)
    files = [f for f in files if num_chunks(len(load_audio(f))) <= most]
    print("\nfiles:", chunk_mix(files))
    reference = cli_single_run_results(long_bundle, files)
    trend = soak(long_bundle, files, runs=1000, warmup=50, every=10, reference=reference)
    check_flat(trend, "1000 runs", rss_kb_per_step=1, rss_kb_total=2048)


# ---------------------------------------------------------------- load / destroy


def load_destroy(bundles: list[Path], cycles: int, warmup: int) -> Trend:
    """Each cycle: load every bundle (all alive at once), run one file on each, destroy them, alternating the
    order (first loaded first, then last loaded first)."""
    refs = {b: single_run_results(b, [AUDIO / "short.wav"])[AUDIO / "short.wav"] for b in bundles}
    x, samples = [], []
    device = read_manifest(bundles[0]).device
    for i in range(cycles):
        programs = [Program.load(b) for b in bundles]
        for b, p in zip(bundles, programs):
            assert result_of(make_runner(p), AUDIO / "short.wav") == refs[b], f"cycle {i}: {b.name} differs"
        for p in programs if i % 2 == 0 else reversed(programs):
            p.close()
        if i + 1 >= warmup:
            x.append(i + 1)
            samples.append(sample(device))
    return Trend(x, samples)


def _bound_kb(bundles: list[Path]) -> float:
    return sum(e.size for b in bundles for n, e in read_manifest(b).files.items() if n.endswith(".safetensors")) / 1024


def test_load_destroy_short(tiny_bundle, other_bundle):
    bundles = [tiny_bundle, other_bundle]
    trend = load_destroy(bundles, cycles=12, warmup=3)
    # a leak of what is bound would be the weights (+ KV cache) per cycle; known: ~45 kB per bundle per cycle
    # stays with the container's never-deleted non-owning handles (tests/test_delegate.py)
    check_flat(trend, "12 load/run/destroy cycles of 2 bundles", rss_kb_per_step=0.25 * _bound_kb(bundles),
               rss_kb_total=8192)  # fmt: skip


@pytest.mark.slow
def test_load_destroy_100(tiny_bundle, other_bundle):
    bundles = [tiny_bundle, other_bundle]
    trend = load_destroy(bundles, cycles=100, warmup=10)
    check_flat(trend, "100 load/run/destroy cycles of 2 bundles", rss_kb_per_step=0.1 * _bound_kb(bundles),
               rss_kb_total=0.1 * _bound_kb(bundles) * 100)  # fmt: skip


# ---------------------------------------------------------------- identical libraries, no files written


def _digests(d: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(d.iterdir())}


def test_identical_libraries_loaded_at_once_stay_separate(tiny_bundle, tmp_path, monkeypatch):
    """The seed wrote each partition to a temp `.so` named by content, so two identical partitions overwrote
    each other's file. Here: two copies of a bundle (same `.so` bytes) plus, inside one, a fifth method whose
    library is a byte-identical copy of another's. All load at once, run interleaved with the right results,
    each from its own file and mapping, and nothing is written anywhere (a private TMPDIR stays empty)."""
    private_tmp = tmp_path / "tmpdir"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    a = Path(shutil.copytree(tiny_bundle, tmp_path / "a"))
    b = Path(shutil.copytree(tiny_bundle, tmp_path / "b"))
    shutil.copyfile(b / "token_embedding.so", b / "token_embedding_twin.so")
    m = read_manifest(b)
    twin = dataclasses.replace(
        m.methods["token_embedding"], name="token_embedding_twin", library="token_embedding_twin.so"
    )
    files = file_entries(b, sorted([*m.files, "token_embedding_twin.so"]))
    write_manifest(b, dataclasses.replace(m, methods={**m.methods, twin.name: twin}, files=files))
    before = {d: _digests(d) for d in (a, b)}
    ref = single_run_results(tiny_bundle, [AUDIO / "short.wav", AUDIO / "speech.wav"])

    with Program.load(a) as pa, Program.load(b) as pb:
        libs = {str(m.handle.path.resolve()) for p in (pa, pb) for m in p.methods.values()}
        n = 2 * len(pa.methods) + 1  # both bundles' methods and the twin
        assert len(libs) == n and libs <= _mapped_libraries(), "each method maps its own file"
        assert len({m.handle.lib._handle for p in (pa, pb) for m in p.methods.values()}) == n
        ids = torch.tensor([[5, 17, 99]])
        e1, e2 = pb.methods["token_embedding"](ids)[0], pb.methods["token_embedding_twin"](ids)[0]
        assert torch.equal(e1, e2)
        ra, rb = make_runner(pa), make_runner(pb)
        for f in [AUDIO / "short.wav", AUDIO / "speech.wav"] * 2:
            assert result_of(ra, f) == ref[f] and result_of(rb, f) == ref[f]
        pb.methods["token_embedding_twin"].destroy()  # one twin gone: the other still runs, from its own file
        assert torch.equal(pb.methods["token_embedding"](ids)[0], e1)
        assert result_of(rb, AUDIO / "short.wav") == ref[AUDIO / "short.wav"]

    assert {d: _digests(d) for d in (a, b)} == before, "a bundle file was written"
    assert list(private_tmp.iterdir()) == [], "temporary files were written"


# ---------------------------------------------------------------- threads


def _threads(n: int, target, *args_per_thread, timeout: float = 600) -> list[BaseException]:
    """Run `target` in `n` threads (thread i with args_per_thread[i]) and wait for them; the exceptions they
    raised. A thread still running after `timeout` seconds is a deadlock: the test fails, it never passes."""
    errors: list[BaseException] = []

    def wrap(*a):
        try:
            target(*a)
        except BaseException as e:  # reported by the test
            errors.append(e)

    ts = [threading.Thread(target=wrap, args=args_per_thread[i]) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=timeout)
    hung = [t.name for t in ts if t.is_alive()]
    assert not hung, f"threads still running after {timeout:g} s (a deadlock): {', '.join(hung)}"
    return errors


def test_a_thread_that_never_finishes_fails_the_thread_helper():
    release = threading.Event()
    try:
        with pytest.raises(AssertionError, match="a deadlock"):
            _threads(2, lambda e: e.wait(), (release,), (release,), timeout=0.05)
    finally:
        release.set()


def test_two_threads_two_runners(tiny_bundle, fixture_files):
    """Each thread has its own program (same bundle: the same library mapping, separate containers and KV
    caches) and runs the mixed files; every result equals the single-run one."""
    ref = single_run_results(tiny_bundle, fixture_files)
    wrong: list = []

    def drive(runner: MultimodalRunner, k: int):
        for i in range(10):
            f = fixture_files[(i + k) % len(fixture_files)]
            if (got := result_of(runner, f)) != ref[f]:
                wrong.append((k, i, f.name, got[0][:6]))

    with Program.load(tiny_bundle) as p1, Program.load(tiny_bundle) as p2:
        errors = _threads(2, drive, (make_runner(p1), 0), (make_runner(p2), 1))
    assert not errors and not wrong, (errors, wrong)


def test_two_threads_on_one_runner_get_a_clear_busy_error(tiny_bundle, fixture_files):
    """Generation on one program is not concurrent: its KV cache is one piece of state. Unguarded, two threads
    interleaved their steps in it and one came back with other tokens. Now the second caller is refused."""
    ref = single_run_results(tiny_bundle, fixture_files)
    with Program.load(tiny_bundle) as p:
        runner = make_runner(p)
        inside, tried = threading.Event(), threading.Event()

        def first():
            def hold(_text):  # streaming callback: runs inside generate(), mid-decode
                inside.set()
                tried.wait(timeout=30)

            r = runner.generate(prompt_for(runner, AUDIO / "speech.wav", None, None), OPTS, on_text=hold)
            assert tuple(r.tokens) == ref[AUDIO / "speech.wav"][0]

        def second():
            inside.wait(timeout=30)
            try:
                with pytest.raises(GenerationError, match="runner is busy"):
                    result_of(runner, AUDIO / "short.wav")
                # a second runner over the same program shares its KV cache: refused too
                with pytest.raises(GenerationError, match="runner is busy"):
                    result_of(make_runner(p), AUDIO / "short.wav")
            finally:
                tried.set()

        assert _threads(2, lambda f: f(), (first,), (second,)) == []
        assert result_of(runner, AUDIO / "short.wav") == ref[AUDIO / "short.wav"]  # usable after

        # free-for-all: every call either gives the single-run result or is refused as busy, and a refused call
        # tried again (as a caller would) gets the single-run result: 12 calls per thread, all of them correct
        outcomes: list[str] = []

        def hammer(k: int):
            for i in range(12):
                f = fixture_files[(i + k) % len(fixture_files)]
                while True:
                    try:
                        outcomes.append("ok" if result_of(runner, f) == ref[f] else f"WRONG {f.name}")
                        break
                    except GenerationError as e:
                        assert "runner is busy" in str(e)
                        outcomes.append("busy")

        assert _threads(2, hammer, (0,), (1,)) == []
    assert not [o for o in outcomes if o.startswith("WRONG")], outcomes
    assert outcomes.count("ok") == 24, outcomes
    print(f"\none runner, two threads: {outcomes.count('ok')} correct, {outcomes.count('busy')} refused as busy")
