"""benchmarks/gpu.py, the GPU machine's driver, on a CPU: its dry run prints every mode's commands, and each
product command in it is one the CLI's own parser accepts (a renamed flag fails here, not on the GPU machine);
the summary writer and the packing of $OUT."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from script_module import load_module

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from runner.app.cli import build_parser  # noqa: E402  (no torch)

gpu = load_module("gpu_driver", ROOT / "benchmarks" / "gpu.py")
# the sessions the driver runs and the CLI verb each hands its arguments to (nox's own options taken out first)
SESSION_VERBS = {"export-artifact": "export", "benchmark": "bench"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--out", str(out), *gpu.MODES],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    commands = [shlex.split(line.strip()[2:]) for line in r.stdout.splitlines() if line.strip().startswith("$ ")]
    return out, commands


def test_the_dry_run_runs_every_mode_and_writes_one_summary(dry_run):
    out, commands = dry_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True
    assert [m["mode"] for m in summary["modes"]] == list(gpu.MODES)  # setup first, then in the order given
    assert {m["status"] for m in summary["modes"]} == {"ok"}
    assert "| export | ok |" in (out / "summary.md").read_text()
    assert len(list(out.iterdir())) <= 8
    assert commands


def test_product_runs_go_through_nox_sessions_and_the_clis_own_flags(dry_run):
    _, commands = dry_run
    parser = build_parser()
    sessions = set()
    for cmd in commands:
        if cmd[1:3] == ["-m", "nox"]:
            assert cmd[3:5] == ["--no-venv", "--no-install"], cmd  # the image's CUDA torch, nothing installed
            session, args = cmd[cmd.index("-s") + 1], cmd[cmd.index("--") + 1 :]
            sessions.add(session)
            if session in SESSION_VERBS:
                parser.parse_args([SESSION_VERBS[session], *args])  # exits on a flag the verb does not have
        elif cmd[1:3] == ["-m", "runner"]:
            parser.parse_args(cmd[3:])
    assert {"export-artifact", "benchmark", "cuda-tests", "soak"} <= sessions
    exports = [c for c in commands if c[1:3] == ["-m", "nox"] and "export-artifact" in c]
    assert all(c[c.index("--device") + 1] == "cuda" for c in exports)
    listed = subprocess.run(
        [sys.executable, "-m", "nox", "--list", "--json", "-f", str(ROOT / "noxfile.py"), "-s", *sorted(sessions)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert listed.returncode == 0, listed.stderr
    assert {s["name"] for s in json.loads(listed.stdout)} == sessions


def test_an_unknown_mode_is_refused_before_anything_runs(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--out", str(tmp_path), "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr
    assert not list(tmp_path.iterdir())


def test_options_are_the_configs_fields():
    args, cfg = gpu.parse(["--long-seconds", "150", "--ab-b", "--no-pdl --no-cuda-graph", "bench"])
    assert cfg.long_seconds == 150 and gpu.split(cfg.ab_b) == ["--no-pdl", "--no-cuda-graph"]
    assert args.modes == ["bench"] and cfg.bundle == gpu.Config().bundle


def test_figures_reads_the_medians_of_each_backend():
    def rec(backend, name, median):
        return {"model": {"backend": backend}, "metric": {"name": name, "extra_info": {"median": median}}}

    records = [rec("aoti", "decode_tokens_per_s", 352.9), rec("aoti", "ttft_ms", 11.2), rec("aoti-vs-hf", "ttft_ms", 1)]
    assert gpu.figures(records) == "aoti: decode 352.9 tok/s, TTFT 11.2 ms"
    assert gpu.figures(None) == "no JSON written"


def test_more_than_eight_files_are_packed_with_the_headline_ones_beside(tmp_path):
    for i in range(12):
        (tmp_path / f"log{i}.log").write_text("x")
    (tmp_path / "summary.md").write_text("| mode |\n")
    (tmp_path / "bench_3b.json").write_text("[]")
    gpu.pack(tmp_path, gpu.KEEP)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["all.tar.gz", "bench_3b.json", "summary.md"]
    assert "all in all.tar.gz" in (tmp_path / "summary.md").read_text()


def test_a_command_past_its_limit_is_stopped_with_what_it_started(tmp_path):
    c = gpu.Call(gpu.Config(), tmp_path, dry=False, mode_end=gpu.time.monotonic() + 60)
    assert c.run([sys.executable, "-c", "print('hello')"], log="x.log") == 0
    assert c.lines("x.log", "hello") == ["hello"]
    child = "import subprocess, sys; subprocess.run(['sleep', '60']); print('not reached')"
    t0 = gpu.time.monotonic()
    assert c.run([sys.executable, "-c", child], log="y.log", limit=6) == 124
    assert gpu.time.monotonic() - t0 < 30 and not c.lines("y.log", "not reached")


def dry_serve(out: Path) -> list[list[str]]:
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--out", str(out), "serve"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [shlex.split(line.strip()[2:]) for line in r.stdout.splitlines() if line.strip().startswith("$ ")]


def test_the_serve_mode_loads_the_max_batch_server_beside_bench_throughput_at_the_same_batches(tmp_path):
    serve_load = load_module("serve_load", ROOT / "benchmarks" / "serve_load.py")
    commands = dry_serve(tmp_path)
    (export,) = [c for c in commands if "export-artifact" in c]
    (bench,) = [c for c in commands if "benchmark" in c]
    (serve,) = [c for c in commands if c[1:4] == ["-m", "runner", "serve"]]
    (load,) = [c for c in commands if c[1] == "serve_load.py"]
    assert export[export.index("--max-batch") + 1] == "32"
    assert bench[bench.index("--batch") + 1] == "8,32" and "--throughput-list" in bench
    build_parser().parse_args(serve[3:])
    assert (serve[serve.index("--max-batch") + 1], serve[serve.index("--max-new-tokens") + 1]) == ("32", "128")
    args = serve_load.parse(load[2:])  # the script's own parser: a renamed flag fails here
    assert args.url == f"http://127.0.0.1:{serve[serve.index('--port') + 1]}" and args.clients == [8, 32]
    assert args.compare == tmp_path / "bench_tp.json" and args.out == tmp_path / "serve_tp.json"
    assert args.language == "en" and args.seconds == gpu.Config().serve_seconds
    # the throughput mode's figures from earlier in the call: no second bench
    rec = {"metric": {"name": "throughput_decode_tokens_per_s_b{}", "extra_info": {"median": 1.0}}}
    recs = [json.loads(json.dumps(rec).replace("{}", str(b))) for b in (1, 8, 32)]
    (tmp_path / "bench_tp.json").write_text(json.dumps(recs))
    assert not [c for c in dry_serve(tmp_path) if "benchmark" in c]
