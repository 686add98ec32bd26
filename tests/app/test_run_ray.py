"""`run --ray`: a folder run over the workers of a local Ray cluster gives the records of the single-process run,
each file's exactly once, even when a worker dies mid-run; a re-run skips what is done; without Ray, one line; an
address where no cluster answers, one line in seconds; a second driver joins a running cluster by its address."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runner.app import folder_ray
from runner.app.cli import main

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
AUDIO = ROOT / "fixtures" / "audio"
NAMES = ["short.wav", "speech.wav", "silence.wav", "speech_48k_stereo.wav"]
FILES = 12
FAST = ["--max-new-tokens", "8"]
CRASHES_ON = "f05.wav"  # the file whose first worker call kills that worker


def records(path: Path) -> list[dict]:
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"", "the file ends with a whole line"
    return [json.loads(line) for line in lines[:-1]]


def timeless(record: dict) -> dict:
    """A record without its timings (stats, at any depth): what two runs of the same file share."""
    if isinstance(record, dict):
        return {k: timeless(v) for k, v in record.items() if k != "stats"}
    if isinstance(record, list):
        return [timeless(v) for v in record]
    return record


def by_file(recs: list[dict]) -> dict[str, dict]:
    names = [Path(r["audio"]).name for r in recs]
    assert len(names) == len(set(names)), f"a file has more than one record: {sorted(names)}"
    return {Path(r["audio"]).name: timeless(r) for r in recs}


def run(bundle: Path, audio_dir: Path, out: Path, *extra: str) -> int:
    return main(["run", "--bundle", str(bundle), "--audio-dir", str(audio_dir), "--out", str(out), *FAST, *extra])


def run_cli(bundle: Path, audio_dir: Path, out: Path, *extra: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m runner run` in a process of its own, killed past `timeout` (a hang fails the test, and ends)."""
    argv = ["run", "--bundle", str(bundle), "--audio-dir", str(audio_dir), "--out", str(out), *FAST, *extra]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "runner", *argv]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the module: address="local" starts a new one, whatever RAY_ADDRESS says. The
    test's worker classes are sent by value (the workers cannot import this test module by its name)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ray-audio")
    for i in range(FILES):
        shutil.copy(AUDIO / NAMES[i % len(NAMES)], d / f"f{i:02d}.wav")
    return d


@pytest.fixture(scope="module")
def single(tiny_bundle, audio_dir, tmp_path_factory) -> Path:
    """The single-process run's --out over the same files."""
    out = tmp_path_factory.mktemp("single") / "results.jsonl"
    assert run(tiny_bundle, audio_dir, out) == 0
    assert len(records(out)) == FILES
    return out


class CrashingWorker(folder_ray.Worker):
    """A worker whose process exits (as a killed or crashed one does) the first time it is given CRASHES_ON."""

    flag: Path | None = None  # set by the test: made before the crash, so only the first call crashes

    def transcribe(self, paths: list[str]) -> list:
        if any(Path(p).name == CRASHES_ON for p in paths) and not self.flag.exists():
            self.flag.touch()
            os._exit(1)
        return super().transcribe(paths)


# the tests without a cluster come first: no Ray thread of the module's cluster runs while they read stderr


def test_ray_not_installed_is_one_error_line(tiny_bundle, audio_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = tmp_path / "ray.jsonl"
    assert run(tiny_bundle, audio_dir, out, "--ray") == 1
    assert capsys.readouterr().err == 'error: --ray needs Ray: pip install -e ".[ray]"\n'
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "error: --ray needs --out FILE"),
        (["--out", "x.jsonl", "--expect", "hello"], "error: --ray: --expect check(s)"),
    ],
)
def test_ray_without_out_or_with_a_check_is_one_error_line(tiny_bundle, audio_dir, extra, message, tmp_path, capsys):
    argv = ["run", "--bundle", str(tiny_bundle), "--audio-dir", str(audio_dir), "--ray", *extra]
    argv = [str(tmp_path / a) if a == "x.jsonl" else a for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("address", ["127.0.0.1:1", "no-such-host.invalid:6379", "ray://127.0.0.1:1"])
def test_an_address_where_no_cluster_listens_is_one_error_line_in_seconds(tiny_bundle, audio_dir, address, tmp_path):
    """ray.init alone dials such an address for many minutes; the run says so in one line within PROBE_S."""
    out = tmp_path / "ray.jsonl"
    t0 = time.monotonic()
    done = run_cli(tiny_bundle, audio_dir, out, "--ray", address, timeout=120)
    took = time.monotonic() - t0
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.startswith(f"error: --ray {address}: cannot join a Ray cluster there (")
    assert done.stderr.count("\n") == 1, done.stderr
    assert took < 30, f"{took:.1f} s"
    assert not out.exists()


def test_a_server_that_is_not_ray_is_refused_and_a_silent_one_within_the_timeout(monkeypatch):
    """Something listens, but it is not a gRPC server (an HTTP/1 answer), or answers nothing: refused either way,
    the silent one after PROBE_S. The servers listen on the address Ray dials for this machine."""
    host = ray.util.get_node_ip_address()
    with socket.create_server((host, 0)) as http, socket.create_server((host, 0)) as silent:

        def answer():
            conn, _ = http.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        address = f"{host}:{http.getsockname()[1]}"
        assert folder_ray.unreachable(address) == f"{address} answers, but not as a Ray cluster's gRPC server does"
        thread.join(10)

        monkeypatch.setattr(folder_ray, "PROBE_S", 1)
        address = f"{host}:{silent.getsockname()[1]}"  # the kernel takes the connection; nobody reads it
        t0 = time.monotonic()
        assert folder_ray.unreachable(address) == f"no answer from {address} within 1 s"
        assert 0.9 < time.monotonic() - t0 < 5


def test_help_does_not_import_ray():
    code = (
        "import sys\nfrom runner.app.cli import main\ntry:\n    main(['run', '--help'])\nexcept SystemExit:\n"
        "    pass\nprint('ray' in sys.modules, file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "--ray" in done.stdout and "--workers" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == "False"


def test_two_workers_give_the_records_of_the_single_process_run(
    cluster, tiny_bundle, audio_dir, single, tmp_path, capsys
):
    out = tmp_path / "ray.jsonl"
    assert run(tiny_bundle, audio_dir, out, "--ray", "--workers", "2") == 0
    assert f"done: {FILES} file(s)" in capsys.readouterr().err  # the whole job's progress, on the driver
    got = by_file(records(out))
    assert got == by_file(records(single))
    assert len(got) == FILES and all(r["tokens"] for r in got.values())


def test_a_worker_that_dies_mid_run_loses_and_duplicates_nothing(
    cluster, tiny_bundle, audio_dir, single, tmp_path, monkeypatch
):
    flag = tmp_path / "crashed"
    monkeypatch.setattr(CrashingWorker, "flag", flag)
    monkeypatch.setattr(folder_ray, "Worker", CrashingWorker)
    out = tmp_path / "ray.jsonl"
    assert run(tiny_bundle, audio_dir, out, "--ray", "--workers", "2") == 0
    assert flag.exists(), "the worker given f05.wav died"
    assert by_file(records(out)) == by_file(records(single))  # each file once, its record the same


def test_a_rerun_on_ray_skips_the_files_done(cluster, tiny_bundle, audio_dir, single, tmp_path, capsys):
    out = tmp_path / "ray.jsonl"
    first = single.read_bytes().split(b"\n")[:5]  # five files done by an earlier run
    out.write_bytes(b"\n".join(first) + b"\n")
    assert run(tiny_bundle, audio_dir, out, "--ray", "--workers", "2") == 0
    assert "skipping 5 of 12 file(s)" in capsys.readouterr().err
    assert out.read_bytes().startswith(b"\n".join(first) + b"\n")  # the records there are left as they are
    assert by_file(records(out)) == by_file(records(single))
    done = out.read_bytes()
    assert run(tiny_bundle, audio_dir, out, "--ray", "--workers", "2") == 0
    assert "nothing to do" in capsys.readouterr().err
    assert out.read_bytes() == done


def test_a_bundle_the_workers_cannot_run_is_one_error_line(cluster, tiny_bundle, audio_dir, tmp_path, capsys):
    out = tmp_path / "ray.jsonl"
    assert run(tiny_bundle, audio_dir, out, "--ray", "--workers", "2", "--word-timestamps") == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--word-timestamps" in errors[0], errors
    assert not out.exists()


def test_a_second_driver_joins_the_running_cluster_by_its_address(cluster, tiny_bundle, audio_dir, single, tmp_path):
    """The probe lets a real cluster through: `--ray HOST:PORT` of this cluster's GCS, from another process, gives
    the single-process run's records."""
    address = ray.get_runtime_context().gcs_address
    assert folder_ray.unreachable(address) is None
    out = tmp_path / "joined.jsonl"
    done = run_cli(tiny_bundle, audio_dir, out, "--ray", address, "--workers", "1", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert by_file(records(out)) == by_file(records(single))
