"""One name for a bundle wherever one is formed: `python -m runner export`'s default --out, the nox sessions'
bundles and the CI artifacts (ci_scripts/bundle_name.py) all come from runner/bundle_name.py and carry the model,
device, dtype, quantisation and torch release the bundle needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CACHE
from script_module import load_module

from runner.app.cli import main
from runner.bundle_name import bundle_name
from runner.export import presets

ROOT = Path(__file__).resolve().parents[2]
# one copy per test run: nox warns about sessions registered twice
noxfile = sys.modules.get("noxfile_under_test") or load_module("noxfile_under_test", ROOT / "noxfile.py")
RUNNING = "torch" + ".".join(torch.__version__.split(".")[:2])  # e.g. torch2.13


@pytest.fixture
def exported(monkeypatch, tmp_path, capsys):
    """`python -m runner export ARGS` in tmp_path, the model loaded but not compiled: the directory it printed,
    and the one the exporter was given."""
    given = []

    def export(self, out, opts, progress=None):
        given.append(out)
        return SimpleNamespace(up_to_date=False, fallbacks=(), max_error={})

    monkeypatch.setattr(presets.ModelToExport, "export", export)
    monkeypatch.setenv("VOXTRAL_RUNNER_CACHE", str(CACHE))  # the tiny checkpoint the tests already wrote
    monkeypatch.chdir(tmp_path)

    def run(*argv: str) -> str:
        assert main(["export", *argv]) == 0
        printed = capsys.readouterr().out.strip()
        assert given[-1] == Path(printed)
        return printed

    return run


def test_the_exports_default_out_is_the_bundles_name(exported, tiny_checkpoint):
    cpu = ("--device", "cpu", "--dtype", "fp32")
    assert exported("--preset", "tiny", *cpu) == f"artifacts/voxtral-bundle-tiny-cpu-fp32-{RUNNING}"
    assert exported("--preset", "tiny", "--random-init", *cpu) == (
        f"artifacts/voxtral-bundle-tiny-random-cpu-fp32-{RUNNING}"
    )
    assert exported("--checkpoint", str(tiny_checkpoint), "--device", "cpu", "--dtype", "bf16") == (
        f"artifacts/voxtral-bundle-{tiny_checkpoint.name}-cpu-bf16-{RUNNING}"
    )
    assert exported("--preset", "tiny", *cpu, "--out", "mine") == "mine"


class Session:
    """What the noxfile's helpers ask of a nox session: `run` (a silent run answers with its output)."""

    name = "e2e"

    def __init__(self, torch_version: str = "2.13.0+cpu", posargs=(), printed: str = ""):
        self.torch_version, self.posargs, self.printed, self.ran = torch_version, list(posargs), printed, []

    def run(self, *args, silent=False, stdout=None, **kw):
        self.ran.append(args)
        if stdout is not None:  # what the command prints, last its bundle's directory
            stdout.write(self.printed)
        return f"a warning on stderr\n{self.torch_version}\n" if silent else None


def test_the_nox_sessions_bundle_is_named_after_the_venvs_torch():
    s = Session("2.13.0+cpu")
    out = noxfile.export_cpu(s, "tiny")
    assert out == "artifacts/voxtral-bundle-tiny-cpu-fp32-torch2.13"
    assert out == "artifacts/" + bundle_name("tiny", "cpu", "fp32", "2.13.0+cpu")
    export = s.ran[-1]
    assert export[:4] == ("python", "-m", "runner", "export") and export[-2:] == ("--out", out)
    # the export is asked for exactly what the name says (the CPU's default dtype could change under it)
    assert export[export.index("--device") + 1] == "cpu" and export[export.index("--dtype") + 1] == "fp32"
    assert noxfile.export_cpu(Session("2.14.1"), "whisper-tiny.en") == (
        "artifacts/voxtral-bundle-whisper-tiny.en-cpu-fp32-torch2.14"
    )


def test_the_nox_probe_reports_the_running_torch():
    s = Session()
    noxfile.cpu_bundle(s, "tiny")
    (probe,) = [args[-1] for args in s.ran if args[:2] == ("python", "-c")]
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == str(torch.__version__)


def test_export_artifact_without_out_checks_the_directory_the_verb_named(monkeypatch):
    monkeypatch.setattr(noxfile, "install", lambda session, extras="": None)
    s = Session(posargs=["--preset", "tiny"], printed="artifacts/voxtral-bundle-tiny-cuda-bf16-torch2.13\n")
    noxfile.export_artifact(s)
    assert s.ran[0] == ("python", "-m", "runner", "export", "--preset", "tiny")  # no --out: the verb's own
    assert s.ran[-1] == ("python", "ci_scripts/check_bundle.py", "artifacts/voxtral-bundle-tiny-cuda-bf16-torch2.13")
    s = Session(posargs=["--preset", "tiny", "--out=mine"])
    noxfile.export_artifact(s)
    assert s.ran[-1] == ("python", "ci_scripts/check_bundle.py", "mine")


def test_cli_nox_and_ci_name_the_tiny_cpu_bundle_alike(exported):
    cli = exported("--preset", "tiny", "--device", "cpu", "--dtype", "fp32")
    nox_dir = noxfile.cpu_bundle(Session(str(torch.__version__)), "tiny")
    spec = f"torch=={torch.__version__}"
    r = subprocess.run(
        [sys.executable, str(ROOT / "ci_scripts" / "bundle_name.py"), "--preset", "tiny", "--device", "cpu",
         "--dtype", "fp32", "--torch-spec", spec],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    ci_dir = dict(line.split("=", 1) for line in r.stdout.splitlines())["dir"]
    assert cli == nox_dir == ci_dir == f"artifacts/voxtral-bundle-tiny-cpu-fp32-{RUNNING}"
