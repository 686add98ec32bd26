"""The CLI as a new user meets it (issue 19 §5): a fast --help with defaults, --debug/-v after the verb, one-line
errors for an unknown preset and for DIR/model.pte, golden tokens compared as a prefix, fixtures that ship."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner import fixtures
from runner.app.cli import build_parser, main
from runner.app.run import golden_mismatch
from runner.errors import BundleError

REPO = Path(__file__).resolve().parents[2]
AUDIO = REPO / "fixtures" / "audio"
GOLDEN = REPO / "fixtures" / "golden" / "tiny.json"
VERBS = ("export", "run", "inspect", "bench", "fetch", "stream", "serve")
# the help's width follows COLUMNS; a fixed one keeps "(default: N)" on one line whatever the terminal
ENV = {**os.environ, "COLUMNS": "200"}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ---------------------------------------------------------------- --help without torch, with defaults


def imported_modules(importtime_stderr: str) -> set[str]:
    # -X importtime lines: "import time: self [us] | cumulative | name", the name indented by depth
    return {
        line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines() if line.startswith("import time:")
    }


@pytest.mark.parametrize("argv", [[], *([v] for v in VERBS)], ids=lambda a: " ".join(a) or "top")
def test_help_imports_no_torch(argv):
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "runner", *argv, "--help"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: python -m runner")
    modules = imported_modules(out.stderr)
    assert "runner.app.cli" in modules  # the parse of -X importtime's lines works
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "requests"))
    assert not heavy, heavy


def test_every_verb_shows_its_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(VERBS)
    for verb in sub.choices.values():
        assert issubclass(verb.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    helps = {name: verb.format_help() for name, verb in sub.choices.items()}
    assert "(default: 20)" in helps["export"]  # --max-audio-chunks
    assert "(default: 0.0)" in helps["run"] and "--max-new-tokens" in helps["run"]  # --max-new-tokens: its own words
    assert "(default: 0.0)" in helps["run"]  # --temperature
    assert "(default: method,e2e,memory)" in helps["bench"]
    assert f"(default: {fixtures.fixtures_dir() / 'audio' / 'speech.wav'})" in helps["bench"]
    # unset (None) and off (False) are not shown as defaults
    assert "(default: None)" not in "".join(helps.values()) and "(default: False)" not in "".join(helps.values())


def test_the_verbs_flags_and_defaults_parse_as_before(tmp_path):
    p = build_parser()
    run = p.parse_args(["run", "--bundle", "b", "--audio", "a.wav"])
    # max_new_tokens None: 128, or 4 a second of the window's audio when that is more (generate.answer_room)
    assert (run.max_new_tokens, run.temperature, run.top_p, run.min_new_tokens) == (None, 0.0, 1.0, 0)
    bench = p.parse_args(["bench", "--bundle", "b"])
    assert (bench.max_new_tokens, bench.min_new_tokens, bench.compare, bench.max_regression) == (32, 32, "eager", 20.0)
    assert bench.audio == fixtures.fixtures_dir() / "audio" / "speech.wav"
    export = p.parse_args(["export"])
    assert (export.preset, export.max_seq_len, export.max_audio_chunks, export.seed) == (None, None, 20, 0)
    fetch = p.parse_args(["fetch", "--repo", "o/n", "--latest", "--name", "x"])
    assert fetch.latest and fetch.api_url is None


# ---------------------------------------------------------------- --debug and -v after the verb


@pytest.mark.parametrize(
    ("argv", "debug", "verbose"),
    [
        (["inspect", "b"], False, 0),
        (["inspect", "b", "--debug", "-vv"], True, 2),
        (["--debug", "-v", "inspect", "b"], True, 1),  # not reset by the verb's parser
        (["--debug", "inspect", "b", "-v"], True, 1),
    ],
)
def test_debug_and_verbose_before_or_after_the_verb(argv, debug, verbose):
    args = build_parser().parse_args(argv)
    assert (args.debug, args.verbose) == (debug, verbose)


def test_debug_after_the_verb_shows_the_traceback(tmp_path):
    cmd = [sys.executable, "-m", "runner", "inspect", str(tmp_path / "nope")]
    env = {**ENV, "VOXTRAL_RUNNER_CACHE": str(tmp_path / "cache")}
    plain = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert plain.returncode == 1
    assert plain.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope'}: no such bundle directory"]
    debug = subprocess.run([*cmd, "--debug"], capture_output=True, text=True, env=env, timeout=120)
    assert debug.returncode == 1
    assert debug.stderr.startswith("Traceback") and "runner.errors.BundleError" in debug.stderr


def test_debug_after_the_verb_raises_in_process(tmp_path):
    with pytest.raises(BundleError, match="no such bundle directory"):
        main(["run", "--bundle", str(tmp_path / "nope"), "--audio", str(AUDIO / "short.wav"), "--debug"])


# ---------------------------------------------------------------- one-line errors


def test_unknown_preset_is_one_line_listing_the_presets(tmp_path, capsys):
    from runner.export.registry import preset_names

    PRESETS = preset_names()  # asked now: a family a test registered and removed is not among them

    assert main(["export", "--preset", "tinyy", "--out", str(tmp_path / "o")]) == 1
    line = one_error_line(capsys)
    assert line == f"error: --preset tinyy: unknown; choose from {', '.join(PRESETS)}"
    assert {"tiny", "voxtral-mini-3b", "whisper-tiny.en"} <= set(PRESETS)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "verb",
    [
        lambda pte: ["run", "--bundle", str(pte), "--audio", str(AUDIO / "short.wav")],
        lambda pte: ["bench", "--bundle", str(pte), "--compare", "none"],
        lambda pte: ["inspect", str(pte)],
        lambda pte: ["inspect", str(pte), "--no-verify"],
    ],
    ids=["run", "bench", "inspect", "inspect --no-verify"],
)
def test_bundle_given_as_its_manifest_file_says_pass_the_directory(verb, tmp_path, capsys):
    pte = tmp_path / "bundle" / "model.pte"
    pte.parent.mkdir()
    pte.write_text("{}")
    assert main(verb(pte)) == 1
    assert one_error_line(capsys) == f"error: {pte}: that is the manifest; pass the bundle directory, {pte.parent}"


# ---------------------------------------------------------------- golden tokens as a prefix


@pytest.mark.parametrize(
    ("ours", "index"),
    [
        ([5, 6, 7, 8], None),  # the same
        ([5, 6], None),  # a smaller --max-new-tokens
        ([5, 6, 7, 8, 9, 10], None),  # a larger one: the golden file's length is checked
        ([], None),
        ([5, 6, 9, 8], 2),
        ([5, 6, 9], 2),
        ([5, 6, 7, 8, 1], None),
        ([4], 0),
    ],
)
def test_golden_tokens_compare_as_a_prefix(ours, index):
    assert golden_mismatch([5, 6, 7, 8], ours) == index


def test_golden_early_eos_is_a_difference():
    eos = 2
    assert golden_mismatch([5, 6, 7, 8], [5, 6, eos]) == 2


def run_golden(bundle: Path, golden: Path, max_new_tokens: int) -> int:
    return main(
        ["run", "--bundle", str(bundle), "--audio", str(AUDIO / "speech.wav"), "--max-new-tokens",
         str(max_new_tokens), "--expect-tokens", str(golden)]
    )  # fmt: skip


@pytest.mark.parametrize("max_new_tokens", [4, 40])
def test_golden_check_passes_for_other_max_new_tokens(tiny_bundle, max_new_tokens, capsys):
    assert json.loads(GOLDEN.read_text())["max_new_tokens"] == 32
    rc = run_golden(tiny_bundle, GOLDEN, max_new_tokens)
    assert rc == 0, capsys.readouterr().err[-2000:]


def test_golden_check_still_names_the_differing_index(tiny_bundle, tmp_path, capsys):
    golden = json.loads(GOLDEN.read_text())
    golden["tokens"]["cpu-float32"]["speech.wav"][2] += 1
    doctored = tmp_path / "golden.json"
    doctored.write_text(json.dumps(golden))
    assert run_golden(tiny_bundle, doctored, 4) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {AUDIO / 'speech.wav'}: tokens differ from golden.json at index 2"


# ---------------------------------------------------------------- fixtures in the package


def test_fixtures_are_found():
    d = fixtures.fixtures_dir()  # the checkout's, or (an editable install's) the same folder as voxtral_fixtures
    for rel in ("tekken.json", "voxtral-tiny/config.json", "audio/speech.wav", "golden/tiny.json"):
        assert (d / rel).is_file(), rel


def test_an_installed_voxtral_fixtures_package_is_preferred(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / fixtures.PACKAGE).mkdir(parents=True)
    (site / fixtures.PACKAGE / "tekken.json").write_text("{}")
    monkeypatch.syspath_prepend(str(site))
    fixtures.fixtures_dir.cache_clear()
    try:
        assert fixtures.fixtures_dir() == site / fixtures.PACKAGE
    finally:
        fixtures.fixtures_dir.cache_clear()


def test_without_the_package_the_source_tree_is_used(monkeypatch):
    monkeypatch.setattr(fixtures, "PACKAGE", "voxtral_fixtures_not_installed")
    fixtures.fixtures_dir.cache_clear()
    try:
        assert fixtures.fixtures_dir() == fixtures.SOURCE_TREE == REPO / "fixtures"
    finally:
        fixtures.fixtures_dir.cache_clear()


def test_pyproject_ships_the_fixtures_and_every_runner_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from setuptools import find_packages

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    # the list is written out (find cannot also map fixtures/): a new runner package must be added to it
    # the fixtures' importable folders are listed too (setuptools warns of one left out)
    fixture_dirs = [d.name for d in (REPO / "fixtures").iterdir() if d.is_dir() and d.name.isidentifier()]
    folders = {f"{fixtures.PACKAGE}.{name}" for name in fixture_dirs if not name.startswith("__")}
    assert set(tool["packages"]) == {*find_packages(str(REPO), include=["runner*"]), fixtures.PACKAGE, *folders}
    assert tool["package-dir"] == {fixtures.PACKAGE: "fixtures"}

    def folder(package: str) -> Path:  # voxtral_fixtures.audio -> fixtures/audio
        return REPO / "fixtures" / Path(*package.split(".")[1:])

    shipped = {p.relative_to(REPO / "fixtures").as_posix() for pkg, globs in tool["package-data"].items()
               for g in globs for p in folder(pkg).glob(g)}  # fmt: skip
    # what the code reads: the tiny preset, bench's default audio; and what the e2e check uses
    assert {"tekken.json", "voxtral-tiny/config.json", "audio/speech.wav", "golden/tiny.json"} <= shipped


# ---------------------------------------------------------------- not a terminal, whatever FORCE_COLOR says


def test_export_draws_no_spinner_into_a_log_even_with_force_color(tmp_path):
    """CI sets FORCE_COLOR (rich then treats any stream as a terminal). stderr here is a pipe: the export's
    progress must be plain lines, and a failure inside it exactly one `error:` line, with no spinner frames."""
    env = {**ENV, "FORCE_COLOR": "1", "VOXTRAL_RUNNER_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "runner", "export", "--preset", "tiny", "--device", "cpu", "--max-seq-len", "16"]
    r = subprocess.run([*cmd, "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert errors == [
        "error: --max-seq-len 16 cannot hold 20 audio chunks (7500 positions), a prompt (16) and an answer "
        "(64 at least); for 20 chunks the default is 10240"
    ], r.stderr
    assert "\r" not in r.stderr and "\x1b[?25l" not in r.stderr  # no carriage-return redraws, no hidden cursor
    assert "exporting tiny (cpu, fp32)" in r.stderr  # the progress, as a line
    assert not (tmp_path / "out").exists()


def test_version_and_the_console_scripts_usage_name_the_program(monkeypatch, capsys):
    """`python -m runner --version` and `voxtral-runner --version` print the package's version (pyproject's),
    each under its own name; the console script's usage names itself, not `python -m runner`."""
    import tomllib

    from runner import __version__
    from runner.app.cli import console, main

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__
    assert project["license"] == "BSD-3-Clause" and "BSD 3-Clause" in (root / "LICENSE").read_text()
    assert project["scripts"]["voxtral-runner"] == "runner.app.cli:console"
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"python -m runner {__version__}\n"
    monkeypatch.setattr(sys, "argv", ["voxtral-runner", "--version"])
    with pytest.raises(SystemExit):
        console()
    assert capsys.readouterr().out == f"voxtral-runner {__version__}\n"
    monkeypatch.setattr(sys, "argv", ["voxtral-runner", "run"])
    with pytest.raises(SystemExit):
        console()
    assert capsys.readouterr().err.startswith("usage: voxtral-runner run ")
