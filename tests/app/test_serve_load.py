"""benchmarks/serve_load.py, the load that issue 44's figures come from, against a live server on the tiny batch
bundle: what it counts is what the server's /metrics counts and what the model generates alone; gpu.py's `serve`
glue (the server in the background, the load, SIGTERM) run for real on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import AUDIO
from live_server import running
from script_module import load_module

import runner
from runner.app.serve import Service
from runner.app.serve_args import ServeOptions

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serve_load.py"
SPEECH, SHORT = AUDIO / "speech.wav", AUDIO / "short.wav"
NEW = 8  # tokens per answer: quick on the tiny model
KEY = "sk-load-3c1e"
ROUTE = '{route="/v1/audio/transcriptions",status="200"}'


def load(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def metric(text: str, name: str) -> float:
    (value,) = [float(line.rpartition(" ")[2]) for line in text.splitlines() if line.rpartition(" ")[0] == name]
    return value


def test_four_clients_eight_requests_each_counted_as_the_server_and_the_model_count(tiny_batch_bundle, tmp_path):
    bench = [{"metric": {"name": "throughput_decode_tokens_per_s_b4", "extra_info": {"median": 1000.0}}}]
    (tmp_path / "bench_tp.json").write_text(json.dumps(bench))
    out = tmp_path / "serve_tp.json"
    with runner.load(tiny_batch_bundle) as model:
        alone = {p: len(model.transcribe(p.read_bytes(), max_new_tokens=NEW).tokens) for p in (SPEECH, SHORT)}
        service = Service(model, ServeOptions(port=0, max_new_tokens=NEW, api_key=KEY))
        with running(service) as port:
            url = f"http://127.0.0.1:{port}"
            r = load("--url", url, "--audio", str(SPEECH), str(SHORT), "--clients", "4", "--requests", "8",
                     "--api-key", KEY, "--compare", str(tmp_path / "bench_tp.json"), "--out", str(out))  # fmt: skip
            with httpx.Client(trust_env=False) as c:
                metrics = c.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert r.returncode == 0, r.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert r.stdout.splitlines() == [
        f"4 clients: {run['requests_per_s']:.2f} req/s, {run['tokens_per_s']:.0f} tok/s ({run['vs_bench']:.0%} of "
        f"bench --throughput at batch 4, target 85%), mean batch {run['server']['batch_occupancy_mean']:.1f}, "
        f"p50 {run['latency_ms']['p50']:.0f} ms"
    ]
    assert (run["clients"], run["requests"], run["ok"], run["errors"], run["error_samples"]) == (4, 32, 32, 0, [])
    # clients 0 and 2 send speech.wav, 1 and 3 short.wav: 16 of each timed, one each per client in the warm-up
    want = 16 * (alone[SPEECH] + alone[SHORT])
    assert run["generated_tokens"] == run["server"]["generated_tokens"] == want > 0
    assert run["server"]["requests"] == 32 and metric(metrics, "runner_requests_total" + ROUTE) == 32 + 4
    assert metric(metrics, "runner_generated_tokens_total") == want + 2 * (alone[SPEECH] + alone[SHORT])
    assert run["tokens_per_s"] == pytest.approx(want / run["wall_s"]) and run["tokens_per_s"] > 0
    assert run["requests_per_s"] == pytest.approx(32 / run["wall_s"])
    assert run["vs_bench"] == pytest.approx(run["tokens_per_s"] / 1000) and run["bench_tokens_per_s"] == 1000
    assert 1 <= run["server"]["batch_occupancy_mean"] <= 4 and run["server"]["batches"] >= 8
    lat = run["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= run["wall_s"] * 1e3


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--audio", "missing.wav"], "error: --audio missing.wav: no such file or folder"),
        (["--audio", "{empty}"], "a folder with no audio files"),
        (["--audio", str(SHORT), "--compare", "missing.json"], "error: --compare missing.json: not bench's JSON"),
        (["--audio", str(SHORT), "--compare", "{dict}"], "not bench's JSON"),
        (["--audio", str(SHORT), "--wait-s", "0"], "/health did not answer 200 within 0 s"),
    ],
)
def test_bad_input_is_one_error_line(args, says, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "dict.json").write_text('{"metric": 1}')
    args = [a.replace("{empty}", str(tmp_path / "empty")).replace("{dict}", str(tmp_path / "dict.json")) for a in args]
    r = load("--url", "http://127.0.0.1:9", *args, timeout=60)  # port 9 (discard): nothing listens there
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: ") and says in line, line


def test_a_count_below_one_is_refused_by_the_parser():
    r = load("--url", "http://127.0.0.1:9", "--audio", str(SHORT), "--clients", "0", timeout=60)
    assert r.returncode == 2 and "argument --clients: 0: 1 or more" in r.stderr


def test_gpu_serve_glue_starts_the_server_loads_it_and_stops_it(tiny_batch_bundle, tmp_path):
    """gpu.py's serve_load() as the serve mode calls it, on CPU: a `python -m runner serve` process, the load once
    /health answers, then SIGTERM (the server's own exit; its log says it served)."""
    gpu = load_module("gpu_driver_serve", ROOT / "benchmarks" / "gpu.py")
    c = gpu.Call(gpu.Config(), tmp_path, dry=False, mode_end=gpu.time.monotonic() + 240)
    args = ["--audio", str(SHORT), "--clients", "2", "--requests", "2", "--out", str(tmp_path / "serve_tp.json")]
    line = gpu.serve_load(c, str(tiny_batch_bundle), ["--max-batch", "2", "--max-new-tokens", str(NEW)], args)
    (run,) = json.loads((tmp_path / "serve_tp.json").read_text())["runs"]
    assert line.startswith("2 clients: ") and (run["ok"], run["errors"], run["server"]["requests"]) == (4, 0, 4)
    assert c.commands[0][1:4] == ["-m", "runner", "serve"] and "serving " in (tmp_path / "serve.log").read_text()
    assert not [p for p in Path("/proc").glob("[0-9]*") if _is_server(p, tiny_batch_bundle)]  # it exited


def test_gpu_serve_glue_stops_at_once_when_the_server_exits(tmp_path):
    gpu = load_module("gpu_driver_serve", ROOT / "benchmarks" / "gpu.py")
    c = gpu.Call(gpu.Config(), tmp_path, dry=False, mode_end=gpu.time.monotonic() + 240)
    t0 = gpu.time.monotonic()
    with pytest.raises(gpu.Failed, match=r"the server failed \(rc 1\)"):
        gpu.serve_load(c, str(tmp_path / "none"), [], ["--audio", str(SHORT)])
    assert gpu.time.monotonic() - t0 < 120 and len(c.commands) == 1  # no load was sent
    assert "error: " in (tmp_path / "serve.log").read_text()


def _is_server(proc: Path, bundle: Path) -> bool:
    try:
        cmd = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in cmd and str(bundle).encode() in cmd
