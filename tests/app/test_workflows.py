"""The GitHub workflows, checked offline: they parse, the schema and zizmor find nothing, actions are pinned, and
the job graph is consistent with the nox sessions, with itself (artifact names, the bundle directory) and with
the bundle manifest. Also the ci_scripts glue the workflow steps call."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    from tests.github_stub import write_fake_bundle
except ImportError:  # tests/ on sys.path rather than importable as a package
    from github_stub import write_fake_bundle

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
FILES = {"ci": WORKFLOWS / "ci.yml", "cuda": WORKFLOWS / "cuda.yml"}
GRAPH = ("export-artifact", "benchmark", "e2e")  # the seed's three jobs, in both workflows
# The release each pinned SHA is; looked up from public workflows that pin the same tags.
PINS = {
    "actions/checkout": ("08c6903cd8c0fde910a37f88322edcfb5dd907a8", "v5.0.0"),
    "actions/setup-python": ("a26af69be951a213d495a4c3e4e4022e16d87065", "v5.6.0"),
    "actions/upload-artifact": ("ea165f8d65b6e75b540449e92b4886f43607fa02", "v4.6.2"),
    "actions/download-artifact": ("d3f86a106a0bac45b974a628896c90dbdf5c8093", "v4.3.0"),
    "actions/cache": ("0057852bfaa89a56745cba8c7296529d2fc39830", "v4.3.0"),
}
EXPR = re.compile(r"^\$\{\{\s*(.+?)\s*\}\}$")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module", params=sorted(FILES))
def wf(request) -> tuple[str, dict]:
    return request.param, load(FILES[request.param])


def on(w: dict) -> dict:
    return w.get("on", w.get(True))  # YAML 1.1 reads a bare `on` key as True


def steps(job: dict) -> list[dict]:
    return job.get("steps", [])


def step_using(job: dict, action: str) -> list[dict]:
    return [s for s in steps(job) if s.get("uses", "").startswith(f"{action}@")]


def expr(value: str) -> str:
    m = EXPR.match(str(value).strip())
    assert m, f"{value!r} is not a single ${{{{ }}}} expression"
    return m.group(1)


def tool(name: str) -> str:
    exe = Path(sys.executable).parent / name
    found = str(exe) if exe.exists() else shutil.which(name)
    assert found, f"{name} is a test dependency (pyproject [test]); install it"
    return found


# ---- the linters ---------------------------------------------------------------------------------------------


def test_workflows_parse_and_have_jobs(wf):
    name, w = wf
    assert w["name"] == name and w["jobs"]


def test_github_workflow_schema_reports_nothing():
    r = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", *map(str, FILES.values())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_actionlint_reports_nothing():
    r = subprocess.run([tool("actionlint"), *map(str, FILES.values())], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_zizmor_offline_reports_nothing():
    r = subprocess.run(
        [tool("zizmor"), "--offline", "--no-progress", *map(str, FILES.values())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "No findings" in r.stdout, r.stdout + r.stderr


# ---- hardening ---------------------------------------------------------------------------------------------


def test_actions_are_pinned_to_the_release_sha_with_the_tag_in_a_comment(wf):
    name, _ = wf
    uses = re.findall(r"uses:\s*(\S+)(.*)", FILES[name].read_text())
    assert uses
    for ref, rest in uses:
        action, _, sha = ref.partition("@")
        assert action in PINS, f"{name}: {action} is not one of the reviewed actions"
        want_sha, tag = PINS[action]
        assert sha == want_sha, f"{name}: {action}@{sha} is not the pinned {tag} commit"
        assert rest.strip() == f"# {tag}", f"{name}: {action} needs a trailing '# {tag}' comment"


def test_no_expression_is_expanded_inside_a_shell_script(wf):
    name, w = wf
    for job_id, job in w["jobs"].items():
        for s in steps(job):
            assert "${{" not in s.get("run", ""), f"{name}/{job_id}: pass values to `run:` through env"


def test_permissions_are_empty_at_the_top_and_read_only_per_job(wf):
    name, w = wf
    assert w["permissions"] == {}
    for job_id, job in w["jobs"].items():
        # benchmark also reads other runs' artifacts (its baseline); nothing writes
        extra = {"actions": "read"} if job_id == "benchmark" else {}
        assert job.get("permissions") == {"contents": "read", **extra}, f"{name}/{job_id}"


def test_checkout_keeps_no_credentials(wf):
    name, w = wf
    for job_id, job in w["jobs"].items():
        for s in step_using(job, "actions/checkout"):
            assert s["with"]["persist-credentials"] is False, f"{name}/{job_id}"


def test_the_hugging_face_token_is_only_in_the_cuda_hub_download_step():
    assert "secrets." not in FILES["ci"].read_text()
    w = load(FILES["cuda"])
    found = []
    for job_id, job in w["jobs"].items():
        assert "secrets." not in json.dumps(job.get("env", {})), job_id
        for s in steps(job):
            if "secrets." in json.dumps(s):
                found.append((job_id, s))
    assert "secrets." not in json.dumps(w.get("env", {}))
    assert len(found) == 1, "exactly one step reads a secret"
    job_id, s = found[0]
    assert job_id == "export-artifact"
    assert s["env"] == {"HF_TOKEN": "${{ secrets.HF_TOKEN }}"}
    assert "matrix.checkpoint" in s["if"], "the token is read only when a checkpoint is asked for"


def test_gpu_jobs_wait_for_the_preflight_skip_fork_pull_requests_and_benchmarks_queue():
    w = load(FILES["cuda"])
    pre, export = w["jobs"]["preflight"], w["jobs"]["export-artifact"]
    assert "head.repo.full_name == github.repository" in pre["if"] and "'cuda'" in pre["if"]  # the label
    assert pre["runs-on"] == "ubuntu-latest" and export["needs"] == "preflight"
    assert all(w["jobs"][j]["needs"] == ["preflight", "export-artifact"] for j in ("benchmark", "e2e"))
    assert w["concurrency"]["cancel-in-progress"] is False
    bench = w["jobs"]["benchmark"]["concurrency"]
    assert bench["cancel-in-progress"] is False and "benchmark" in bench["group"]
    for job in ("export-artifact", "benchmark", "e2e"):  # the preflight's label(s), skipped when it says not to run
        assert w["jobs"][job]["runs-on"] == "${{ fromJSON(needs.preflight.outputs.runs-on) }}"
    assert export["if"] == "needs.preflight.outputs.run == 'true'"
    assert "vars.CUDA_RUNNER_LABEL" in pre["steps"][1]["env"]["CUDA_RUNNER_LABEL"]


def test_preflight_fails_in_one_line_per_problem_without_a_gpu_runner_or_with_bad_inputs():
    good = {"CUDA_RUNNER_LABEL": "gpu-h200", "PRESET": "voxtral-mini-3b", "CHECKPOINT": "", "DTYPE": "bf16"}
    good |= {"MAX_NEW_TOKENS": "128", "BENCHMARK_RUNS": "5"}
    r = script("preflight.py", env={**good, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "inputs are valid" in r.stdout
    bad = {**good, "CUDA_RUNNER_LABEL": "", "PRESET": "huge", "MAX_NEW_TOKENS": "0", "BENCHMARK_RUNS": "x"}
    r = script("preflight.py", env={**bad, "PATH": "/usr/bin:/bin"})
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 1 and len(errors) == 4, r.stderr
    assert "CUDA_RUNNER_LABEL" in errors[0] and "choose from all, voxtral-mini-3b, tiny" in errors[1]
    assert r.stdout.count("::error::") == 4  # annotations on the run's page
    ckpt = script("preflight.py", env={**good, "CHECKPOINT": "not a hub id", "PATH": "/usr/bin:/bin"})
    assert ckpt.returncode == 1 and "a hub id (OWNER/NAME) or an absolute path" in ckpt.stderr


def test_preflight_writes_the_matrix_every_preset_one_preset_or_one_checkpoint(tmp_path):
    base = {"CUDA_RUNNER_LABEL": "gpu-h200", "DTYPE": "bf16", "MAX_NEW_TOKENS": "128", "BENCHMARK_RUNS": "5"}
    base |= {"CHECKPOINT": "", "PATH": "/usr/bin:/bin"}

    def cells(**env) -> list[dict]:
        out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
        r = script("preflight.py", "--github-output", out, env={**base, **env})
        assert r.returncode == 0, r.stderr
        return json.loads(read_outputs(out)["matrix"])["include"]

    every = cells(PRESET="all")
    assert [(c["cell"], c["preset"], c["random-init"], c["dtype"], c["quant"]) for c in every] == [
        ("tiny", "tiny", "false", "bf16", "none"),
        ("3b", "voxtral-mini-3b", "true", "bf16", "none"),
        ("3b-int4", "voxtral-mini-3b", "true", "bf16", "int4"),
    ]
    assert every == cells(PRESET="all", QUANT="all")  # a schedule or a pull request passes no inputs: all
    assert [c["cell"] for c in cells(PRESET="tiny", DTYPE="fp32")] == ["tiny"]
    assert [c["cell"] for c in cells(PRESET="all", DTYPE="fp32")] == ["tiny", "3b"]  # int4 is bf16 only
    assert [c["cell"] for c in cells(PRESET="voxtral-mini-3b", QUANT="none")] == ["3b"]
    assert [c["cell"] for c in cells(PRESET="all", QUANT="int4")] == ["3b-int4"]
    (one,) = cells(PRESET="all", CHECKPOINT="mistralai/Voxtral-Mini-3B-2507")
    assert one["cell"] == "checkpoint" and one["checkpoint"] == "mistralai/Voxtral-Mini-3B-2507"
    assert one["quant"] == "none" and cells(CHECKPOINT="/ckpt", PRESET="all", QUANT="int4")[0]["quant"] == "int4"
    # every cell's digest has an output key on the export job
    outputs = load(FILES["cuda"])["jobs"]["export-artifact"]["outputs"]
    assert {f"digest-{c['cell']}" for c in [*every, one]} <= set(outputs)
    # a preset and a quant no cell has: one line, no matrix
    r = script("preflight.py", env={**base, "PRESET": "tiny", "QUANT": "int4"})
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no cell is preset tiny with quant int4" in r.stderr
    for preset, ckpt in (("all", ""), ("all", "/ckpt")):  # int4 asked for in fp32: one line, before any job
        r = script("preflight.py", env={**base, "PRESET": preset, "CHECKPOINT": ckpt, "QUANT": "int4", "DTYPE": "fp32"})
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "quant int4 runs in bf16 only" in r.stderr


def test_ci_installs_the_cpu_torch_wheel():
    env = load(FILES["ci"])["env"]
    assert "+cpu" in env["TORCH_SPEC"]
    assert env["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"  # for torch alone: no global extra index
    assert not any("PIP_EXTRA_INDEX_URL" in path.read_text() for path in FILES.values())
    assert all(job["runs-on"] == "ubuntu-latest" for job in load(FILES["ci"])["jobs"].values())


def test_each_e2e_cell_generates_as_many_tokens_as_its_golden_tokens_were_made_with():
    """Whisper's long form cut at fewer tokens a window seeks elsewhere: its golden tokens and WER would fail."""
    e2e = load(FILES["ci"])["jobs"]["e2e"]
    (step,) = [s for s in steps(e2e) if "nox -s e2e" in s.get("run", "")]
    assert '--max-new-tokens "$MAX_NEW_TOKENS"' in step["run"]
    assert expr(step["env"]["MAX_NEW_TOKENS"]) == "matrix.max-new-tokens || env.MAX_NEW_TOKENS"
    assert expr(load(FILES["ci"])["env"]["MAX_NEW_TOKENS"]) == "inputs.max-new-tokens || 32"
    golden = {"tiny": "tiny.json", "whisper-tiny": "whisper-tiny.en.json"}  # tiny-realtime streams to the end
    for cell in e2e["strategy"]["matrix"]["include"]:
        if cell["model"] in golden:
            made = json.loads((ROOT / "fixtures" / "golden" / golden[cell["model"]]).read_text())["max_new_tokens"]
            assert cell.get("max-new-tokens", 32) == made, cell["cell"]


# ---- triggers and inputs -------------------------------------------------------------------------------------


def test_triggers_are_pull_request_push_to_main_and_dispatch_and_the_gpu_ones_are_rarer(wf):
    name, w = wf
    triggers = on(w)
    assert "pull_request" in triggers and "workflow_dispatch" in triggers
    if name == "ci":
        assert triggers["push"] == {"branches": ["main"]}
    else:  # a 3B export moves ~10 GB: dispatched, weekly, or on a labelled pull request; never on every push
        assert "push" not in triggers and triggers["schedule"][0]["cron"]
        assert set(triggers["pull_request"]["types"]) == {"labeled", "synchronize"}


def test_cuda_dispatch_inputs_are_typed():
    inputs = on(load(FILES["cuda"]))["workflow_dispatch"]["inputs"]
    assert inputs["preset"]["type"] == "choice" and {"all", "voxtral-mini-3b"} <= set(inputs["preset"]["options"])
    assert inputs["checkpoint"]["type"] == "string"
    assert inputs["dtype"]["type"] == "choice" and set(inputs["dtype"]["options"]) == {"bf16", "fp32"}
    assert inputs["quant"]["type"] == "choice" and set(inputs["quant"]["options"]) == {"all", "none", "int4"}
    assert inputs["max-new-tokens"]["type"] == "number" and inputs["benchmark-runs"]["type"] == "number"


# ---- the job graph -------------------------------------------------------------------------------------------


def test_both_workflows_have_the_three_jobs_wired_the_same_way(wf):
    name, w = wf
    jobs = w["jobs"]
    assert set(GRAPH) <= set(jobs)
    for job_id in ("benchmark", "e2e"):
        needs = jobs[job_id]["needs"]
        assert "export-artifact" in ([needs] if isinstance(needs, str) else needs), f"{name}/{job_id}"
    if name == "ci":
        assert {"lint", "tests"} <= set(jobs)


def nox_sessions(job: dict) -> list[str]:
    return [m for s in steps(job) for m in re.findall(r"\bnox -s ([\w-]+)", s.get("run", ""))]


# Jobs that only check a run's configuration (a GPU runner, the inputs) before the GPU jobs start: no session.
GATES = {"preflight"}


def test_each_job_is_its_nox_session_and_every_session_exists():
    wanted = set()
    for path in FILES.values():
        for job_id, job in load(path)["jobs"].items():
            if job_id in GATES:
                continue
            sessions = nox_sessions(job)
            assert sessions == [job_id], f"{path.name}/{job_id} runs {sessions}; it should run `nox -s {job_id}`"
            wanted.update(sessions)
    r = subprocess.run(
        [sys.executable, "-m", "nox", "--list", "--json", "-f", str(ROOT / "noxfile.py"), "-s", *sorted(wanted)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert {s["name"] for s in json.loads(r.stdout)} == wanted


def cells(w: dict, job_id: str) -> list[dict]:
    """A job's matrix cells (ci.yml lists them; cuda.yml's come from the preflight)."""
    matrix = w["jobs"][job_id]["strategy"]["matrix"]
    return matrix["include"] if isinstance(matrix, dict) else []


def named_by(job: dict) -> str:
    (step,) = [s for s in steps(job) if s.get("id") == "bundle"]
    return step["run"]


def test_downloads_name_the_artifact_the_export_job_uploads(wf):
    """The jobs after export name the bundle by the same rule, from the same cell, and download it there."""
    name, w = wf
    export = w["jobs"]["export-artifact"]
    (upload,) = [s for s in step_using(export, "actions/upload-artifact")]
    assert expr(upload["with"]["name"]) == "steps.bundle.outputs.name"
    exported = {c["cell"]: c for c in cells(w, "export-artifact")}
    # the torch the jobs install is in the name: a benchmark baseline compares like with like
    assert '--torch-spec "$TORCH_SPEC"' in named_by(export) and "TORCH_SPEC" in w["env"], name
    for job_id in ("benchmark", "e2e"):
        job = w["jobs"][job_id]
        assert named_by(job) == named_by(export), f"{name}/{job_id} names the bundle another way"
        assert job["env"]["PRESET"] == export["env"]["PRESET"] and job["env"]["DTYPE"] == export["env"]["DTYPE"]
        for c in cells(w, job_id):  # each cell one the export job has, with the same preset and dtype
            assert {k: exported[c["cell"]][k] for k in ("preset", "dtype")} == {k: c[k] for k in ("preset", "dtype")}
        (download,) = step_using(job, "actions/download-artifact")
        assert expr(download["with"]["name"]) == "steps.bundle.outputs.name", f"{name}/{job_id}"
        assert expr(download["with"]["path"]) == "steps.bundle.outputs.dir", f"{name}/{job_id}"
    assert w["jobs"]["export-artifact"]["strategy"]["fail-fast"] is False


def test_the_exported_directory_is_checked_and_exactly_its_manifest_files_are_uploaded(wf):
    name, w = wf
    export = w["jobs"]["export-artifact"]
    by_id = {s.get("id"): s for s in steps(export)}
    (exp,) = [s for s in steps(export) if "nox -s export-artifact" in s.get("run", "")]
    assert '--out "$BUNDLE_DIR"' in exp["run"] and expr(exp["env"]["BUNDLE_DIR"]) == "steps.bundle.outputs.dir"
    check = by_id["check"]
    assert check["run"].startswith('python ci_scripts/check_bundle.py "$BUNDLE_DIR"')
    assert expr(check["env"]["BUNDLE_DIR"]) == "steps.bundle.outputs.dir"
    assert "--github-output" in check["run"]
    upload = by_id["upload"]
    assert expr(upload["with"]["path"]) == "steps.check.outputs.upload-paths", "upload what was checked"
    order = [s.get("id") or s.get("name") for s in steps(export)]
    assert order.index("check") < order.index("upload")


def test_downloaded_bundles_are_checked_against_the_exported_digest_before_use(wf):
    name, w = wf
    export = w["jobs"]["export-artifact"]
    (digest,) = [s for s in steps(export) if s.get("id") == "digest"]
    assert expr(digest["env"]["DIGEST"]) == "steps.check.outputs.bundle-digest"
    assert digest["run"] == 'echo "digest-${CELL}=${DIGEST}" >> "$GITHUB_OUTPUT"'
    for key, value in export["outputs"].items():  # one key per cell, each from that cell's step
        assert key.startswith("digest-") and expr(value) == f"steps.digest.outputs.{key}", f"{name}: {key}"
    for c in cells(w, "export-artifact"):
        assert f"digest-{c['cell']}" in export["outputs"], f"{name}: cell {c['cell']} has no digest output"
    for job_id in ("benchmark", "e2e"):
        job = w["jobs"][job_id]
        runs = [s.get("run", "") for s in steps(job)]
        i_check = next(i for i, r in enumerate(runs) if "check_bundle.py" in r)
        i_nox = next(i for i, r in enumerate(runs) if "nox -s" in r)
        assert '--expect-digest "$BUNDLE_DIGEST"' in runs[i_check] and i_check < i_nox, f"{name}/{job_id}"
        assert '--bundle "$BUNDLE_DIR"' in runs[i_nox]
        assert expr(job["env"]["BUNDLE_DIGEST"]) == "needs.export-artifact.outputs[format('digest-{0}', matrix.cell)]"


def test_uploads_fail_on_no_files_and_set_retention(wf):
    name, w = wf
    for job_id, job in w["jobs"].items():
        for s in step_using(job, "actions/upload-artifact"):
            # the bundle must be there; results upload `always()`, and a failed benchmark may have written none
            want = "warn" if s.get("if") == "${{ always() }}" else "error"
            assert s["with"]["if-no-files-found"] == want, f"{name}/{job_id}"
            assert int(s["with"]["retention-days"]) > 0, f"{name}/{job_id}"
    (bundle,) = step_using(w["jobs"]["export-artifact"], "actions/upload-artifact")
    assert bundle["with"]["compression-level"] == 0


def test_benchmark_results_are_uploaded_and_summarised(wf):
    name, w = wf
    runs = "\n".join(s.get("run", "") for s in steps(w["jobs"]["benchmark"]))
    assert "--json results/benchmark.json" in runs and "--chart results/latency.png" in runs
    assert "ci_scripts/job_summary.py results/benchmark.json" in runs
    # gated on the last green main run of the same workflow, thresholds from one variable
    assert f"--baseline-workflow {name}.yml" in runs and '--max-regression "$MAX_REGRESSION"' in runs
    assert w["jobs"]["benchmark"]["permissions"] == {"contents": "read", "actions": "read"}
    uploads = step_using(w["jobs"]["benchmark"], "actions/upload-artifact")
    assert [u["with"]["path"].split() for u in uploads] == [["results/benchmark.json", "results/latency.png"]]
    assert uploads[0]["if"] == "${{ always() }}"


# ---- ci_scripts ----------------------------------------------------------------------------------------------


def script(name: str, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "ci_scripts" / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def read_outputs(path: Path) -> dict[str, str]:
    """Parse a $GITHUB_OUTPUT file (key=value and key<<DELIM ... DELIM)."""
    out, lines = {}, path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if "<<" in lines[i] and "=" not in lines[i].split("<<")[0]:
            key, delim = lines[i].split("<<", 1)
            end = lines.index(delim, i + 1)
            out[key] = "\n".join(lines[i + 1 : end])
            i = end + 1
        else:
            key, _, value = lines[i].partition("=")
            out[key] = value
            i += 1
    return out


def test_check_bundle_lists_the_manifest_files_and_uploads_exactly_those(tmp_path):
    bundle = tmp_path / "voxtral-bundle-tiny-cpu-fp32"
    manifest = write_fake_bundle(bundle)
    (bundle / "export.log").write_text("not in the manifest")
    gh_out, summary = tmp_path / "out", tmp_path / "summary.md"
    r = script("check_bundle.py", bundle, "--github-output", gh_out, "--summary", summary)
    assert r.returncode == 0, r.stderr
    for name in manifest.files:
        assert name in r.stdout
    assert "export.log is not in model.pte" in r.stderr
    outputs = read_outputs(gh_out)
    uploaded = {Path(p).relative_to(bundle).as_posix() for p in outputs["upload-paths"].splitlines()}
    assert uploaded == {"model.pte", *manifest.files}
    assert re.fullmatch(r"[0-9a-f]{64}", outputs["bundle-digest"])
    assert int(outputs["bundle-files"]) == len(manifest.files) + 1
    assert "| tekken.json | tokenizer |" in summary.read_text()

    assert script("check_bundle.py", bundle, "--expect-digest", outputs["bundle-digest"]).returncode == 0
    r = script("check_bundle.py", bundle, "--expect-digest", "0" * 64)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "not the exported one" in r.stderr


def test_a_random_init_bundle_is_uploaded_without_its_weights_and_checked_without_them(tmp_path):
    from runner.bundle import read_manifest, write_manifest

    bundle = tmp_path / "b"
    write_fake_bundle(bundle)
    m = read_manifest(bundle)
    source = {"kind": "random-init", "name": "voxtral-mini-3b", "weights_digest": "0" * 64, "seed": 0}
    write_manifest(bundle, type(m)(**{**m.__dict__, "model": {**m.model, "source": source | {"generator": "g"}}}))
    weights = {s.weights for s in m.methods.values()}
    out = tmp_path / "out"
    r = script("check_bundle.py", bundle, "--github-output", out)
    assert r.returncode == 0, r.stderr
    assert "weights not uploaded" in r.stdout and "--regenerate" in r.stdout
    uploaded = {Path(p).name for p in read_outputs(out)["upload-paths"].splitlines()}
    assert uploaded == {"model.pte", *m.files} - weights
    digest = read_outputs(out)["bundle-digest"]
    r = script("check_bundle.py", bundle, "--github-output", tmp_path / "all", "--with-weights")
    assert {Path(p).name for p in read_outputs(tmp_path / "all")["upload-paths"].splitlines()} >= weights

    # downloaded: the weights are not there, everything else is checked as before
    for name in weights:
        (bundle / name).unlink()
    assert script("check_bundle.py", bundle, "--expect-digest", digest).returncode == 0
    lib = bundle / "audio_encoder.so"
    lib.write_bytes(b"X" + lib.read_bytes()[1:])
    r = script("check_bundle.py", bundle, "--expect-digest", digest)
    assert r.returncode == 1 and "audio_encoder.so" in r.stderr
    # a bundle without that record must have its weights
    write_manifest(bundle, m)
    r = script("check_bundle.py", bundle)
    assert r.returncode == 1 and "missing" in r.stderr


def test_check_bundle_fails_with_one_line_on_a_corrupt_or_missing_file(tmp_path):
    bundle = tmp_path / "b"
    write_fake_bundle(bundle)
    lib = bundle / "audio_encoder.so"
    lib.write_bytes(b"X" + lib.read_bytes()[1:])
    r = script("check_bundle.py", bundle)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "audio_encoder.so" in r.stderr
    lib.unlink()
    r = script("check_bundle.py", bundle)
    assert r.returncode == 1 and "missing" in r.stderr
    r = script("check_bundle.py", tmp_path / "nope")
    assert r.returncode == 1 and r.stderr.startswith("error: ")


def test_check_bundle_requires_the_tokenizer_in_the_manifest(tmp_path):
    from runner.bundle import read_manifest, write_manifest

    bundle = tmp_path / "b"
    write_fake_bundle(bundle)
    m = read_manifest(bundle)
    files = {k: v for k, v in m.files.items() if k != "tekken.json"}
    write_manifest(bundle, type(m)(**{**m.__dict__, "files": files}))
    r = script("check_bundle.py", bundle)
    assert r.returncode == 1 and "tekken.json" in r.stderr


def test_bundle_name_follows_the_artifact_naming_rule(tmp_path):
    cpu = ["--torch-spec", "torch==2.13.0+cpu"]
    r = script("bundle_name.py", "--preset", "tiny", "--device", "cpu", "--dtype", "fp32", *cpu)
    assert r.stdout == (
        "name=voxtral-bundle-tiny-cpu-fp32-torch2.13\ndir=artifacts/voxtral-bundle-tiny-cpu-fp32-torch2.13\n"
    )
    out = tmp_path / "o"
    args = ["--preset", "voxtral-mini-3b", "--random-init", "true", "--device", "cuda", "--dtype", "bf16"]
    args += ["--torch-spec", "torch==2.13.0"]
    script("bundle_name.py", *args, "--github-output", out)
    assert read_outputs(out) == {
        "name": "voxtral-bundle-voxtral-mini-3b-random-cuda-bf16-torch2.13",
        "dir": "artifacts/voxtral-bundle-voxtral-mini-3b-random-cuda-bf16-torch2.13",
    }
    r = script(
        "bundle_name.py", "--checkpoint", "mistralai/Voxtral-Mini-3B-2507", "--device", "cuda", "--dtype", "bf16",
        "--torch-spec", "torch==2.14.1",
    )  # fmt: skip
    assert "name=voxtral-bundle-mistralai--Voxtral-Mini-3B-2507-cuda-bf16-torch2.14\n" in r.stdout
    r = script("bundle_name.py", *args, "--quant", "int4")  # another artifact than the bf16 bundle's
    assert "name=voxtral-bundle-voxtral-mini-3b-random-cuda-bf16-int4-torch2.13\n" in r.stdout
    assert script("bundle_name.py", *args, "--quant", "none").stdout == script("bundle_name.py", *args).stdout


def test_bundle_name_is_the_packages_name(tmp_path):
    """The CI step and `export`'s default --out name a bundle by the one function (runner/bundle_name.py)."""
    from runner.bundle_name import bundle_name

    for preset, device, dtype, quant, random_init in [
        ("tiny", "cpu", "fp32", "none", False), ("voxtral-mini-3b", "cuda", "bf16", "int4", True),
    ]:  # fmt: skip
        argv = ["--preset", preset, "--device", device, "--dtype", dtype, "--quant", quant]
        argv += ["--random-init", str(random_init).lower(), "--torch-spec", "torch==2.13.0+cpu"]
        name = bundle_name(preset, device, dtype, "2.13.0+cpu", quant=quant, random_init=random_init)
        assert script("bundle_name.py", *argv).stdout.startswith(f"name={name}\n")


@pytest.mark.parametrize(
    ("spec", "tag"),
    [("torch==2.13.0+cpu", "torch2.13"), ("torch === 2.12.1", "torch2.12"), ("torch==2.14.*", "torch2.14"),
     ("/wheels/torch-2.13.0+cpu-cp312-cp312-linux_x86_64.whl", "torch2.13"),
     ("torch @ https://download.pytorch.org/whl/cpu/torch-2.15.0%2Bcpu-cp312-cp312-linux_x86_64.whl", "torch2.15")],
)  # fmt: skip
def test_bundle_name_reads_the_torch_release_from_the_spec_without_torch(spec, tag):
    """The workflow's step runs in a bare Python: `-S` (no site-packages) has no torch to ask."""
    cmd = [sys.executable, "-S", str(ROOT / "ci_scripts" / "bundle_name.py"), "--preset", "tiny", "--device", "cpu"]
    r = subprocess.run([*cmd, "--dtype", "fp32", "--torch-spec", spec], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"name=voxtral-bundle-tiny-cpu-fp32-{tag}\n")


@pytest.mark.parametrize("spec", ["preinstalled", "torch", "torch>=2.13", ""])
def test_bundle_name_asks_the_running_torch_when_the_spec_pins_none(spec):
    import torch

    major, minor = torch.__version__.split(".")[:2]
    r = script("bundle_name.py", "--preset", "tiny", "--device", "cpu", "--dtype", "fp32", "--torch-spec", spec)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"name=voxtral-bundle-tiny-cpu-fp32-torch{major}.{minor}\n")
    bare = [sys.executable, "-S", str(ROOT / "ci_scripts" / "bundle_name.py"), "--preset", "tiny"]
    r = subprocess.run(
        [*bare, "--device", "cpu", "--dtype", "fp32", "--torch-spec", spec], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and not r.stdout
    assert r.stderr.startswith("error: --torch-spec") and "torch" in r.stderr and len(r.stderr.splitlines()) == 1


def test_job_summary_renders_records_and_plain_objects(tmp_path):
    results = tmp_path / "benchmark.json"
    results.write_text(
        json.dumps(
            {"device": "cpu", "methods": [{"method": "text_decoder", "ms": {"p50": 1.23456}}, {"method": "a|b"}]}
        )
    )
    summary = tmp_path / "summary.md"
    assert script("job_summary.py", results, "--title", "Bench", "--out", summary).returncode == 0
    text = summary.read_text()
    assert "### Bench" in text and "| method | ms.p50 |" in text and "| text_decoder | 1.235 |" in text
    assert "a\\|b" in text and "device: cpu" in text

    results.write_text(json.dumps({"load_ms": 12.5, "decode": {"tok_per_s": 100}}))
    r = script("job_summary.py", results)
    assert "| decode.tok_per_s | 100 |" in r.stdout

    r = script("job_summary.py", tmp_path / "missing.json", "--out", summary)
    assert r.returncode == 0 and "was not written" in summary.read_text()


@pytest.mark.parametrize(
    ("env", "venv", "torch_args"),
    [
        ({}, {}, ("--index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0+cpu")),  # Linux, no GPU
        ({"TORCH_SPEC": "torch==2.13.0"}, {}, ("torch==2.13.0",)),
        ({"TORCH_SPEC": "torch==2.13.0+cpu", "TORCH_INDEX": "https://download.pytorch.org/whl/cpu"}, {},
         ("--index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0+cpu")),
        ({"TORCH_SPEC": "preinstalled"}, {"venv_params": ["--system-site-packages"]}, None),
    ],
)  # fmt: skip
def test_nox_installs_torch_alone_from_its_index_or_takes_the_preinstalled_one(monkeypatch, env, venv, torch_args):
    """TORCH_INDEX serves torch alone (no global extra index); TORCH_SPEC=preinstalled makes the session venvs see
    the runner's own torch and install nothing for it."""
    from script_module import load_module

    for name in ("TORCH_SPEC", "TORCH_INDEX"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no nvidia-smi: a machine without a GPU
    nox_file = load_module("noxfile_torch_modes", ROOT / "noxfile.py")
    assert nox_file.VENV == venv
    installed, ran = [], []

    class Session:
        venv_backend = "none"

        def run(self, *args, **kw):
            ran.append(args)

    monkeypatch.setattr(nox_file, "install_once", lambda session, *req: installed.append(req))
    nox_file.install(Session(), "test")
    assert installed[-1] == ("-e", ".[test]")
    if torch_args is None:
        assert len(installed) == 1 and "import torch" in ran[0][-1]
    else:
        assert installed[0] == torch_args and not ran
