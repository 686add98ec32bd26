"""What a GPU call is made of, for benchmarks/gpu.py's modes: the options (Config), the call (Call: $OUT, the
clock, commands run within a mode's limit or printed in a dry run), the modes run in turn within the budget, and
the summary and the packing of $OUT."""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEECH = ("speech.wav", "long_35s.flac", "speech_48k_stereo.wav")
MIN_MODE_S = 20  # a mode with less time than this left is skipped, not started


@dataclass
class Config:
    """The knobs of a call; each is an option (`--long-seconds 150`); lists of flags are one quoted string."""

    bundle: str = "artifacts/3b"
    bundle_int4: str = "artifacts/3b-int4"
    bundle_fp8: str = "artifacts/3b-fp8"
    bundle_24b: str = "artifacts/24b"
    export_args: str = "--max-seq-len 1024 --max-audio-chunks 1"  # the headline shape ("": the default capacity)
    compare: str = "hf,hf-compile"
    compare_24b: str = "hf,hf-compile"
    cuda_tests: str = ""  # pytest arguments after tests/cuda (e.g. one file's tests: -k int4)
    long_seconds: int = 600
    long_compare: str = "hf-compile"
    long_ab: str = ""
    memory_args: str = ""
    ab_a: str = ""
    ab_b: str = "--no-pdl"
    profile_args: str = "--no-ceilings"
    kernel_parts: str = "tune"
    kernel_fill: str = "450"
    kernel_args: str = ""
    prefill_args: str = "--lengths 385,2000,7510 --max-seq 10240"
    int4_args: str = "--parts check,gemv,step,agree"
    whisper_dtypes: str = "fp32 bf16"
    soak_tests: str = "tests/app/test_soak.py"
    rt_bundle: str = "artifacts/rt4b"
    rt_streams: int = 64
    # the long stream is cut at --long-limit-s of wall clock: the JSON says how many minutes it reached
    rt_bench_args: str = "--bench-seconds 20 --bench-steps 50 --latency-seconds 10 --long-minutes 60 --long-limit-s 100"
    tp_files: int = 64
    tp_batches: str = "1,8,32"
    serve_clients: str = "8,32"  # one load run per count, each beside bench --throughput at that batch
    serve_seconds: int = 20  # each run's sending time (closed loop: a client sends its next file on an answer)
    wheels: str = ".whl"  # the carried wheels (nox, soundfile, soxr, av and their needs)
    act_files: str = "artifacts/offline-act"  # node.xz and ci-actions.tgz, for the act mode
    act_args: str = "--input preset=all --input quant=none export-artifact benchmark e2e"
    budget: int = 565  # seconds, under the device's 600 a command
    gpu_samples_ms: int = 0  # >0: sample the SM clock, power and temperature (nvidia-smi) through the call


class Failed(Exception):
    """A mode's failure, with its one line for the summary."""


@dataclass
class Outcome:
    mode: str
    status: str  # ok, failed, timeout, skipped
    seconds: float
    limit: int
    note: str
    start: float = 0.0
    end: float = 0.0


@dataclass
class Call:
    """What the modes share: the options, $OUT, the clock, and a way to run commands (printed in a dry run)."""

    cfg: Config
    out: Path
    dry: bool
    mode_end: float = 0.0
    commands: list[list[str]] = field(default_factory=list)

    def run(self, cmd: list[str], log: str | None = None, stdout: str | None = None, limit: int = 10**6,
            env: dict | None = None, cwd: Path = ROOT, replace_env: bool = False) -> int:  # fmt: skip
        """`cmd` within `limit` and the mode's end; stderr (and stdout, unless `stdout`) appended to $OUT/log."""
        self.commands.append(cmd)
        print("  $ " + shlex.join(cmd), flush=True)
        if self.dry:
            return 0
        left = min(limit, self.mode_end - time.monotonic())
        if left < 5:
            print("  no time left in the mode")
            return 124
        err = open(self.out / log, "a") if log else None  # noqa: SIM115 (closed below)
        sink = open(self.out / stdout, "w") if stdout else err  # noqa: SIM115
        # its own process group: a timeout stops what it started too (nox -> python -> compiler workers)
        env = env if replace_env else {**os.environ, **(env or {})}
        proc = subprocess.Popen(cmd, stdout=sink, stderr=err, cwd=cwd, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            stop(proc, grace=10)
            return 124
        finally:
            for f in {err, sink} - {None}:
                f.close()

    def nox(self, session: str, *args: str, **kw) -> int:
        """A nox session in this Python (it holds CUDA torch): nothing installed, no venv made."""
        cmd = [sys.executable, "-m", "nox", "--no-venv", "--no-install", "-f", str(ROOT / "noxfile.py"), "-s", session]
        return self.run([*cmd, "--", *args], **kw)

    def runner(self, verb: str, *args: str, **kw) -> int:
        return self.run([sys.executable, "-m", "runner", verb, *args], **kw)

    def script(self, name: str, *args: str, **kw) -> int:
        return self.run([sys.executable, name, *args], cwd=ROOT / "benchmarks", **kw)

    def check(self, rc: int, what: str, log: str | None = None) -> None:
        if rc:
            if log and (self.out / log).exists():
                print("".join((self.out / log).read_text(errors="replace").splitlines(True)[-30:]))
            raise Failed(f"{what} failed (rc {rc})")

    def need(self, bundle: str) -> None:
        if not self.dry and not (ROOT / bundle / "model.pte").is_file():
            raise Failed(f"no bundle at {bundle} (run its export mode first, in this call or on a warm machine)")

    def read_json(self, name: str):
        path = self.out / name
        return json.loads(path.read_text()) if path.is_file() and path.stat().st_size else None

    def lines(self, name: str, start: str) -> list[str]:
        path = self.out / name
        text = path.read_text(errors="replace") if path.is_file() else ""
        return [line for line in text.splitlines() if line.startswith(start)]


def stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the process's group, SIGKILL after `grace` seconds (a group already gone: nothing to do)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def split(flags: str | int) -> list[str]:
    return shlex.split(str(flags))


def figures(records) -> str:
    """Per backend, the medians of decode (tok/s) and time to first token (ms) from bench's JSON."""
    fig: dict[str, dict[str, float]] = {}
    for r in records or []:
        backend, m = r["model"]["backend"], r["metric"]
        if "-vs-" not in backend and m["name"] in ("decode_tokens_per_s", "ttft_ms"):
            fig.setdefault(backend, {})[m["name"]] = float(m["extra_info"]["median"])
    nan = float("nan")
    return "; ".join(
        f"{b}: decode {f.get('decode_tokens_per_s', nan):.1f} tok/s, TTFT {f.get('ttft_ms', nan):.1f} ms"
        for b, f in fig.items()
    ) or "no JSON written"  # fmt: skip


def speech_wav(c: Call, path: str, seconds: float, gaps: bool = True) -> None:
    """`seconds` of the fixtures' speech (with short gaps), repeated, at 16 kHz."""
    print(f"  (writes {seconds:g} s of the fixtures' speech to {path})")
    if c.dry:
        return
    import numpy as np
    import soundfile as sf

    from runner.audio import load_audio

    parts = [load_audio(ROOT / "fixtures" / "audio" / n) for n in SPEECH]
    gap = np.zeros(8000 if gaps else 0, np.float32)
    seq = [x for p in parts for x in (p, gap)]
    need = int(seconds * 16000)
    sf.write(path, np.concatenate(seq * (need // sum(map(len, seq)) + 1))[:need], 16000)


# ---------------------------------------------------------------- the call


def run_modes(c: Call, todo: list[str], modes: dict, limits: dict[str, int]) -> list[Outcome]:
    """Each mode in turn within its limit and what is left of the budget; a failed setup or export stops the rest."""
    start, stop, done = time.monotonic(), "", []
    for mode in todo:
        left = c.cfg.budget - (time.monotonic() - start)
        limit = int(min(limits[mode], left))
        if stop or left < MIN_MODE_S:
            done.append(Outcome(mode, "skipped", 0, limit, stop or f"{left:.0f} s of the {c.cfg.budget} s budget left"))
            continue
        print(f"=== {mode} (limit {limit} s)", flush=True)
        t0, w0 = time.monotonic(), time.time()
        c.mode_end = t0 + limit
        try:
            status, note = "ok", modes[mode](c)
        except Failed as e:
            status, note = ("timeout" if "rc 124" in str(e) else "failed"), str(e)
        done.append(Outcome(mode, status, round(time.monotonic() - t0, 1), limit, note, w0, time.time()))
        print(f"  {status}: {note}", flush=True)
        if status != "ok" and mode in ("setup", "export"):
            stop = f"skipped: {mode} failed"
    return done


def gpu_table(samples: Path, done: list[Outcome]) -> list[str]:
    """Per mode: the SM clock, power and temperature nvidia-smi sampled while it ran."""
    rows = []
    for line in samples.read_text().splitlines() if samples.is_file() else []:
        try:
            t, sm, w, temp = (x.strip() for x in line.split(","))
            rows.append(
                (time.mktime(time.strptime(t.split(".")[0], "%Y/%m/%d %H:%M:%S")), float(sm), float(w), float(temp))
            )
        except ValueError:
            continue
    out = ["", "| mode | samples | SM clock MHz, median (min) | power W, median (max) | temperature C, max |",
           "|---|---:|---:|---:|---:|"]  # fmt: skip
    for o in done:
        got = [r for r in rows if o.start - 1 <= r[0] <= o.end]
        if got:
            sm, w, temp = zip(*(r[1:] for r in got), strict=True)
            out.append(f"| {o.mode} | {len(got)} | {statistics.median(sm):.0f} ({min(sm):.0f}) | "
                       f"{statistics.median(w):.0f} ({max(w):.0f}) | {max(temp):.0f} |")  # fmt: skip
    return out if len(out) > 3 else []


def write_summary(c: Call, done: list[Outcome], seconds: float, bench_args: list[str]) -> str:
    """summary.json (the outcomes and the options) and summary.md (their table); returns the table."""
    results = {"config": asdict(c.cfg), "dry_run": c.dry, "seconds": round(seconds, 1), "bench_args": bench_args}
    results["modes"] = [asdict(o) for o in done]
    (c.out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    table = ["| mode | status | s | limit s | result |", "|---|---|---:|---:|---|"]
    table += [f"| {o.mode} | {o.status} | {o.seconds:.0f} | {o.limit} | {o.note} |" for o in done]
    table += ["", f"total {seconds:.0f} s of {c.cfg.budget} s; bench flags: {shlex.join(bench_args)}"]
    table += gpu_table(c.out / "gpu_samples.csv", done)
    text = "\n".join(table) + "\n"
    (c.out / "summary.md").write_text(text)
    return text


def pack(out: Path, keep_first: tuple[str, ...], most: int = 8) -> None:
    """At most `most` files come back from $OUT: past that, all of them in all.tar.gz, the headline ones beside."""
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != "all.tar.gz")
    if len(files) <= most:
        return
    with tarfile.open(out / "all.tar.gz", "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=p.name)
    keep = [n for n in keep_first if (out / n).is_file()][: most - 1]
    for p in files:
        if p.name not in keep:
            p.unlink()
    with open(out / "summary.md", "a") as f:
        f.write(f"({len(files)} files in $OUT: all in all.tar.gz, the headline ones beside it)\n")
