"""Manifest fields of any type, through the verbs that read them (issue 23): a real bundle's model.pte with a field
replaced by a value of another JSON type (or of the right type and out of range) or removed, then `inspect` and
`run`. The property: exit 0, or exactly one `error:` line and exit 1; never a traceback. model.pte is not among the
files its own digests pin, so an edited manifest reaches every reader of its fields. tests/app/test_fault_matrix.py
names the cases one by one (MANIFEST_FIELD_FAULTS); tests/fuzz/fuzz_manifest.py runs the same for longer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.app.cli import main
from runner.bundle import MANIFEST_NAME

try:
    from tests.json_paths import mutate, paths
except ImportError:  # tests/ on sys.path rather than importable as a package
    from json_paths import mutate, paths

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio" / "short.wav"

# every JSON type, and values of the right type that are still wrong
_VALUES = st.one_of(
    st.sampled_from(
        [
            None,
            True,
            False,
            0,
            -1,
            1,
            2**63,
            2**70,
            1.5,
            float("inf"),
            "",
            "x",
            "1024",
            "float8",
            "cuda",
            "../x.so",
            "text_decoder.so",
            "tekken.json",
            [],
            {},
            [1],
            ["x"],
            {"a": 1},
            {"min": 2, "max": 1},
            {"min": 0, "max": 2**70},
            {"text": {}, "audio": {}},
            "delete",
        ]
    ),  # fmt: skip
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=6,
    ),
)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def bundle(tiny_bundle, tmp_path_factory) -> tuple[Path, str]:
    b = Path(shutil.copytree(tiny_bundle, tmp_path_factory.mktemp("fields") / "b"))
    return b, (b / MANIFEST_NAME).read_text()


def _mutated(text: str, data) -> dict:
    d = json.loads(text)
    # the fields the runner reads: top level, model, methods (not the file digests: those fail their check)
    where = [p for p in paths(d) if p and p[0] != "files" or len(p) == 2]
    for _ in range(data.draw(st.integers(1, 2), label="edits")):
        mutate(d, data.draw(st.sampled_from(where), label="path"), data.draw(_VALUES, label="value"))
    return d


def _one_line_or_success(capsys, argv) -> None:
    capsys.readouterr()
    code = main(argv)  # anything but a RunnerError/OSError escapes here and fails the test
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert (code == 0 and not errors) or (code == 1 and len(errors) == 1), (code, err[-2000:])


@settings(max_examples=200, **SETTINGS)
@given(data=st.data())
def test_inspect_reads_any_manifest_or_says_what_is_wrong_in_one_line(bundle, capsys, tmp_path, data):
    b, text = bundle
    try:
        (b / MANIFEST_NAME).write_text(json.dumps(_mutated(text, data)))
        _one_line_or_success(capsys, ["inspect", str(b), "--no-verify"])
    finally:
        (b / MANIFEST_NAME).write_text(text)


@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_run_reads_any_manifest_or_says_what_is_wrong_in_one_line(bundle, capsys, monkeypatch, tmp_path, data):
    b, text = bundle
    monkeypatch.setenv("VOXTRAL_RUNNER_CACHE", str(tmp_path / "cache"))
    try:
        (b / MANIFEST_NAME).write_text(json.dumps(_mutated(text, data)))
        _one_line_or_success(capsys, ["run", "--bundle", str(b), "--audio", str(AUDIO), "--max-new-tokens", "2"])
    finally:
        (b / MANIFEST_NAME).write_text(text)
