"""The fault matrix, through the CLI: every fault a user can meet ends as exactly one `error: …` line that names
the file or value at fault, a non-zero exit, no traceback, nothing written outside the destination, and a
failed download or export leaves nothing behind. Valid-but-unusual inputs (8 kHz, 96 kHz, 6 channels, special-
token text in a prompt, a generation that reaches the end of the context) succeed instead.

Most cases call `runner.app.cli.main([...])` in-process (what `python -m runner` runs; `capsys` reads stderr); a few
run `python -m runner` as a subprocess to prove the same at the process level. Each case's assertions name it
(group: case) and show its error line or outcome."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from runner import publish
from runner.app import fetch
from runner.app.cli import main
from runner.app.options import Environment
from runner.audio import N_SAMPLES, SAMPLE_RATE
from runner.bundle import FORMAT_VERSION, MANIFEST_NAME, file_entries, read_manifest, write_manifest
from runner.digests import sha256_file
from runner.families.voxtral.tokenizer import Tekken

try:
    from tests.github_stub import TOKEN, GitHubStub, fake_bundle_zip, write_fake_bundle, zip_dir, zip_members
except ImportError:  # tests/ on sys.path rather than importable as a package
    from github_stub import TOKEN, GitHubStub, fake_bundle_zip, write_fake_bundle, zip_dir, zip_members

ROOT = Path(__file__).resolve().parents[2]
AUDIO = ROOT / "fixtures" / "audio"
REPO, NAME = "octo/voxtral", "voxtral-bundle-tiny-cpu-fp32"
COMPILE_CACHE = Environment.read().cache_dir  # the real one, read before any test points VOXTRAL_RUNNER_CACHE elsewhere
CONTROL = re.compile(
    r"[\x00-\x1f\x7f\x9b]"
)  # what would break the line on a terminal or in a log: a raw newline, CR, ESC

# ---------------------------------------------------------------- running the CLI and judging the outcome


@dataclass
class Outcome:
    code: int
    out: str
    err: str

    @property
    def errors(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("error:")]


def cli(capsys, *argv) -> Outcome:
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    out, err = capsys.readouterr()
    return Outcome(code, out, err)


def python_m_runner(
    *argv, env: dict | None = None, preexec: Callable | None = None, cwd: Path = ROOT, prelude: str = ""
) -> Outcome:
    """`python -m runner ARGV` as a process; `prelude`, Python run in it first."""
    main = f"{prelude}; import runpy; runpy.run_module('runner', run_name='__main__', alter_sys=True)"
    r = subprocess.run(
        [sys.executable, "-c", main, *map(str, argv)] if prelude else [sys.executable, "-m", "runner", *map(str, argv)],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=preexec,
    )
    return Outcome(r.returncode, r.stdout, r.stderr)


def one_error(o: Outcome, group: str, case: str, *needles: str) -> str:
    """Exactly one `error:` line holding every needle, printable as it is (no control characters), a non-zero
    exit, and no traceback."""
    where = f"{group}: {case}"
    assert "Traceback" not in o.err + o.out, f"{where}: {o.err}"
    assert o.code not in (0, None), f"{where}: exit {o.code}; stderr: {o.err}"
    assert len(o.errors) == 1, f"{where}: expected one error line, got: {o.err}"
    line = o.errors[0]
    for n in needles:
        assert n in line, f"{where}: {n!r} not in {line!r}"
    assert not CONTROL.search(line), f"{where}: a control character in {line!r}"
    return line


def succeeded(o: Outcome, group: str, case: str) -> list[dict]:
    assert o.code == 0 and not o.errors and "Traceback" not in o.err, f"{group}: {case}: {o.err}"
    records = [json.loads(line) for line in o.out.splitlines()]
    assert records and all(isinstance(r.get("text"), str) for r in records), f"{group}: {case}: {o.out}"
    return records


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under `root` (but the digest cache) with its size and mtime: what a failed
    command must leave as it was."""
    out = {}
    for p in sorted(root.rglob("*")) if root.exists() else []:
        rel = p.relative_to(root).as_posix()
        if rel == "cache" or rel.startswith("cache/"):
            continue
        st = p.lstat()
        out[rel] = (0, 0) if p.is_dir() and not p.is_symlink() else (st.st_size, st.st_mtime_ns)
    return out


def mapped(prefix: Path) -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[5].strip() for line in f if str(prefix) in line})


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A scratch directory as cwd, with the digest cache inside it; anything else written there is a failure."""
    monkeypatch.setenv("VOXTRAL_RUNNER_CACHE", str(tmp_path / "cache"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield tmp_path
    assert list(cwd.iterdir()) == [], "a failed command wrote into the working directory"


# ---------------------------------------------------------------- audio


def _tone(seconds: float, sr: int = SAMPLE_RATE, channels: int = 1) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    x = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return np.tile(x[:, None], (1, channels)) if channels > 1 else x


def _wav_with_codec(path: Path, tag: int) -> Path:
    fmt = struct.pack("<HHIIHH", tag, 1, SAMPLE_RATE, 2 * SAMPLE_RATE, 2, 16) + struct.pack("<H", 0)
    data = b"\x11" * 3200
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return path


def _truncated(path: Path, fmt: str) -> Path:
    whole = path.with_name(f"whole.{fmt}")
    sf.write(whole, _tone(2.0), SAMPLE_RATE)
    data = whole.read_bytes()
    whole.unlink()
    path.write_bytes(data[: len(data) // 2])
    return path


def _non_finite(path: Path, value: float) -> Path:
    x = np.zeros(SAMPLE_RATE, np.float32)
    x[100] = value
    sf.write(path, x, SAMPLE_RATE, subtype="FLOAT")
    return path


def _huge(path: Path, peak: float) -> Path:
    sf.write(path, (peak * np.sin(np.arange(SAMPLE_RATE) / 5)).astype(np.float32), SAMPLE_RATE, subtype="FLOAT")
    return path


def _not_utf8_name(d: Path) -> Path:
    """b"caf\xe9.wav" (Latin-1), as Python names it: "caf\udce9.wav"."""
    shutil.copyfile(AUDIO / "short.wav", d / "tmp.wav")
    os.rename(d / "tmp.wav", os.fsencode(d) + b"/caf\xe9.wav")
    return d / os.fsdecode(b"caf\xe9.wav")


def _write(path: Path, fn) -> Path:
    fn(path)
    return path


# case id -> (make the file in a directory, expected substrings of the error line after the file's name)
AUDIO_FAULTS: dict[str, tuple[Callable[[Path], Path], tuple[str, ...]]] = {
    "missing": (lambda d: d / "absent.wav", ("not found",)),
    "a directory": (lambda d: _write(d / "dir.wav", Path.mkdir), ("not a file",)),
    "empty (0 bytes)": (lambda d: _write(d / "empty.wav", lambda p: p.write_bytes(b"")), ("empty",)),
    "zero-length (no samples)": (
        lambda d: _write(d / "nosamples.wav", lambda p: sf.write(p, np.zeros(0, np.float32), SAMPLE_RATE)),
        ("no samples",),
    ),
    "truncated wav": (lambda d: _truncated(d / "cut.wav", "wav"), ("truncated",)),
    "truncated flac": (lambda d: _truncated(d / "cut.flac", "flac"), ("truncated",)),
    "not audio (text)": (
        lambda d: _write(d / "notes.wav", lambda p: p.write_text("not the samples you are looking for\n" * 40)),
        ("not a readable audio file",),
    ),
    "not audio (random bytes)": (
        lambda d: _write(d / "noise.flac", lambda p: p.write_bytes(np.random.default_rng(0).bytes(5000))),
        ("not a readable audio file",),
    ),
    "unsupported codec (WAV tag 0x1234)": (
        lambda d: _wav_with_codec(d / "codec.wav", 0x1234),
        ("unsupported WAV codec",),
    ),
    "unsupported container (m4a)": (
        lambda d: _write(
            d / "song.m4a", lambda p: p.write_bytes(b"\0\0\0\x20ftypM4A \0\0\0\0M4A mp42isom" + bytes(4000))
        ),
        ("not a readable audio file",),
    ),
    "NaN samples": (lambda d: _non_finite(d / "nan.wav", np.nan), ("NaN or Inf",)),
    "Inf samples": (lambda d: _non_finite(d / "inf.wav", -np.inf), ("NaN or Inf",)),
    # audio longer than the bundle's capacity is no fault: it is transcribed in windows (tests/families/
    # test_long_audio.py); a --prompt about it is one error line there
    # finite samples whose log-mel overflows: the encoder ran on NaN and the decoder picked token 0, exit 0
    "finite samples of huge amplitude (1e20)": (lambda d: _huge(d / "huge.wav", 1e20), ("not finite",)),
    "finite samples at the float32 limit (3e38)": (lambda d: _huge(d / "limit.wav", 3e38), ("not finite",)),
}

AUDIO_ACCEPTED: dict[str, Callable[[Path], Path]] = {
    "8 kHz (resampled)": lambda d: _write(d / "k8.wav", lambda p: sf.write(p, _tone(1.5, 8000), 8000)),
    "96 kHz (resampled)": lambda d: _write(d / "k96.flac", lambda p: sf.write(p, _tone(1.5, 96000), 96000)),
    "6 channels (mixed down)": lambda d: _write(
        d / "ch6.wav", lambda p: sf.write(p, _tone(1.5, channels=6), SAMPLE_RATE)
    ),
    "under a second": lambda d: AUDIO / "short.wav",
    "silence": lambda d: AUDIO / "silence.wav",
    "exactly 60 s (2 chunks, the max)": lambda d: _write(
        d / "max.flac", lambda p: sf.write(p, np.zeros(2 * N_SAMPLES, np.float32), SAMPLE_RATE)
    ),
    "a file name that is not UTF-8": lambda d: _not_utf8_name(d),
}


@pytest.mark.parametrize("case", list(AUDIO_FAULTS))
def test_audio_fault(case, tiny_bundle, work, capsys):
    make, needles = AUDIO_FAULTS[case]
    indir = work / "in"
    indir.mkdir()
    path = make(indir)
    before, bundle_before = tree(work), tree(tiny_bundle)
    o = cli(capsys, "run", "--bundle", tiny_bundle, "--audio", path, "--max-new-tokens", 4, "--json")
    line = one_error(o, "audio", case, str(path), *needles)
    # stdout: the file's record, an error record carrying that same line (so a batch's JSON has every file)
    assert [json.loads(x) for x in o.out.splitlines()] == [{"audio": str(path), "error": line.removeprefix("error: ")}]
    assert tree(work) == before and tree(tiny_bundle) == bundle_before


@pytest.mark.parametrize("case", list(AUDIO_ACCEPTED))
def test_audio_accepted(case, tiny_bundle, work, capsys):
    indir = work / "in"
    indir.mkdir()
    path = AUDIO_ACCEPTED[case](indir)
    o = cli(capsys, "run", "--bundle", tiny_bundle, "--audio", path, "--max-new-tokens", 4, "--json")
    (rec,) = succeeded(o, "audio", case)
    assert rec["audio"] == str(path) and len(rec["tokens"]) >= 1


def test_a_bad_file_after_a_good_one_keeps_the_good_result(tiny_bundle, work, capsys):
    bad = _non_finite(work / "nan.wav", np.nan)
    o = cli(capsys, "run", "--bundle", tiny_bundle, "--audio", AUDIO / "short.wav", "--audio", bad, "--json")
    one_error(o, "audio", "good file then NaN file", str(bad), "NaN")
    rec, err = [json.loads(line) for line in o.out.splitlines()]  # the first file's record is complete
    assert rec["audio"] == str(AUDIO / "short.wav") and rec["tokens"]
    assert err["audio"] == str(bad) and "NaN" in err["error"]


# ---------------------------------------------------------------- bundle


def _edit_manifest(bundle: Path, **changes) -> None:
    m = read_manifest(bundle)
    write_manifest(bundle, dataclasses.replace(m, **changes))


def _edit_json(bundle: Path, edit) -> None:
    d = json.loads((bundle / MANIFEST_NAME).read_text())
    edit(d)
    (bundle / MANIFEST_NAME).write_text(json.dumps(d, indent=2))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _point_library_at(bundle: Path, rel: str, target: Path) -> None:
    target.write_bytes((bundle / "audio_encoder.so").read_bytes())

    def edit(d):
        d["files"][rel] = {"sha256": sha256_file(target), "size": target.stat().st_size}
        d["methods"]["audio_encoder"]["library"] = rel

    _edit_json(bundle, edit)


def _symlink_library(bundle: Path) -> None:
    real = bundle.parent / "real_preprocessor.so"
    shutil.move(bundle / "preprocessor.so", real)
    os.symlink(real, bundle / "preprocessor.so")


def _wrong_weight_shape(bundle: Path) -> None:
    m = read_manifest(bundle)
    wfile = bundle / m.methods["token_embedding"].weights
    w = load_file(str(wfile))
    t = w["embed_tokens.weight"]
    w["embed_tokens.weight"] = torch.zeros(t.shape[0], t.shape[1] + 1)
    wfile.unlink()
    save_file(w, str(wfile))
    write_manifest(bundle, dataclasses.replace(m, files=file_entries(bundle, sorted(m.files))))


# case id -> (break the bundle copy, expected substrings)
BUNDLE_FAULTS: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "not a directory": (lambda b: (shutil.rmtree(b), b.write_text("x")), ("no such bundle directory",)),
    "missing model.pte": (lambda b: (b / MANIFEST_NAME).unlink(), (MANIFEST_NAME, "missing")),
    "model.pte not JSON": (lambda b: (b / MANIFEST_NAME).write_bytes(b"\x00PTE\x01"), (MANIFEST_NAME, "not a JSON")),
    "missing .so": (lambda b: (b / "audio_encoder.so").unlink(), ("audio_encoder.so", "missing")),
    "missing weight file": (
        lambda b: (b / "text_decoder.safetensors").unlink(),
        ("text_decoder.safetensors", "missing"),
    ),
    "missing tekken.json": (lambda b: (b / "tekken.json").unlink(), ("tekken.json", "missing")),
    "extra .so": (lambda b: shutil.copy(b / "text_decoder.so", b / "old_decoder.so"), ("old_decoder.so", "not listed")),
    "extra weight file": (
        lambda b: (b / "stray.safetensors").write_bytes(b"\0" * 16),
        ("stray.safetensors", "not listed"),
    ),
    "flipped byte in a .so": (lambda b: _flip(b / "text_decoder.so"), ("text_decoder.so", "sha256")),
    "flipped byte in a weight file": (
        lambda b: _flip(b / "audio_encoder.safetensors"),
        ("audio_encoder.safetensors", "sha256"),
    ),
    "a file of the wrong size": (
        lambda b: open(b / "token_embedding.safetensors", "ab").write(b"\0"),
        ("token_embedding.safetensors", "size"),
    ),
    "manifest path ../x.so": (
        lambda b: _point_library_at(b, "../x.so", b.parent / "x.so"),
        ("'../x.so'", "outside the bundle"),
    ),
    "manifest absolute path": (
        lambda b: _point_library_at(b, str(b.parent / "abs.so"), b.parent / "abs.so"),
        ("abs.so", "outside the bundle"),
    ),
    "manifest path a link": (_symlink_library, ("preprocessor.so", "link")),
    "newer format version": (
        lambda b: _edit_json(b, lambda d: d.update(format_version=FORMAT_VERSION + 1)),
        (MANIFEST_NAME, f"format version {FORMAT_VERSION + 1}", "upgrade"),
    ),
    "a method missing": (
        lambda b: _edit_json(b, lambda d: d["methods"].pop("text_decoder")),
        (MANIFEST_NAME, "methods missing: text_decoder"),
    ),
    ".so built by another torch": (
        lambda b: _edit_manifest(b, torch_version="2.99.0+cu999"),
        ("torch 2.99.0+cu999", f"this is torch {torch.__version__}", "re-export"),
    ),
    "weight file with wrong shapes": (
        _wrong_weight_shape,
        ("token_embedding", "embed_tokens.weight", "the library expects"),
    ),
}


# ---- trust: what a manifest may point at (issue 23)


def _manifest_a_link_out(bundle: Path) -> None:
    real = bundle.parent / "elsewhere.pte"
    shutil.move(bundle / MANIFEST_NAME, real)
    os.symlink(real, bundle / MANIFEST_NAME)


def _library_through_a_linked_directory(bundle: Path) -> None:
    outside = bundle.parent / "outside"
    outside.mkdir()
    shutil.move(bundle / "audio_encoder.so", outside / "audio_encoder.so")
    os.symlink(outside, bundle / "lib")  # lib/audio_encoder.so: a path inside, a file outside

    def edit(d):
        d["files"]["lib/audio_encoder.so"] = d["files"].pop("audio_encoder.so")
        d["methods"]["audio_encoder"]["library"] = "lib/audio_encoder.so"

    _edit_json(bundle, edit)


def _state_key(d: dict) -> str:
    return next(iter(d["methods"]["text_decoder"]["state"]))


BUNDLE_FAULTS |= {
    "model.pte a link out of the bundle": (_manifest_a_link_out, (MANIFEST_NAME, "link")),
    "a library through a linked directory": (_library_through_a_linked_directory, ("lib", "link")),
    "a method pointed at another's library": (
        lambda b: _edit_json(b, lambda d: d["methods"]["audio_encoder"].update(library="text_decoder.so")),
        ("text_decoder.so", "one library"),
    ),
    "a library that is a weights file": (
        lambda b: _edit_json(b, lambda d: d["methods"]["preprocessor"].update(library="text_decoder.safetensors")),
        ("text_decoder.safetensors", "weights or tokenizer"),
    ),
    "the tokenizer not pinned": (
        lambda b: _edit_json(b, lambda d: d["model"].update(tokenizer="../../etc/passwd")),
        ("../../etc/passwd", "not listed in files"),
    ),
}

# ---- manifest fields of the wrong type or missing: one line naming the field, before any dlopen (issue 23)


def _field(path: str, value, *needles: str):
    """Set (or with "delete", remove) the manifest field at dotted `path`; {state} is the decoder's first buffer."""

    def edit(d):
        keys = [_state_key(d) if k == "{state}" else (int(k) if k.isdigit() else k) for k in path.split(".")]
        owner = d
        for k in keys[:-1]:
            owner = owner[k]
        if value == "delete":
            del owner[keys[-1]]
        else:
            owner[keys[-1]] = value

    return (lambda b: _edit_json(b, edit), (MANIFEST_NAME, "malformed manifest", *needles))


MANIFEST_FIELD_FAULTS = {
    "model not an object": _field("model", [1, 2], "model is [1, 2]"),
    "model.config missing": _field("model.config", "delete", "model.config is missing"),
    "model.config.text a list": _field("model.config.text", [], "model.config.text is []"),
    "config.text.n_layers a string": _field("model.config.text.n_layers", "2", "model.config.text.n_layers"),
    "config.audio.dim missing": _field("model.config.audio.dim", "delete", "model.config.audio.dim is missing"),
    "max_seq_len missing": _field("model.max_seq_len", "delete", "model.max_seq_len is missing"),
    "max_seq_len a string": _field("model.max_seq_len", "1024", "model.max_seq_len is '1024'"),
    "max_audio_chunks 0": _field("model.max_audio_chunks", 0, "model.max_audio_chunks is 0", "from 1 to"),
    "max_audio_chunks null": _field("model.max_audio_chunks", None, "model.max_audio_chunks is None"),
    "tokenizer null": _field("model.tokenizer", None, "model.tokenizer is None"),
    "special tokens a list": _field("model.special_tokens", ["bos"], "model.special_tokens is ['bos']"),
    "a special token id a string": _field("model.special_tokens.bos", "1", "model.special_tokens.bos is '1'"),
    "source a string": _field("model.source", "hub", "model.source is 'hub'"),
    "a dim a string": _field("methods.audio_encoder.inputs.0.shape.1", "128", "inputs[0].shape[1] is '128'"),
    "a dynamic dim with min > max": _field(
        "methods.audio_encoder.inputs.0.shape.0", {"min": 3, "max": 1}, "inputs[0].shape[0]", "min <= max"
    ),
    "a shape not a list": _field("methods.preprocessor.outputs.0.shape", 7, "outputs[0].shape is 7"),
    "a tensor dtype unknown": _field("methods.token_embedding.inputs.0.dtype", "int3", "dtype is 'int3'"),
    "a state shape of strings": _field("methods.text_decoder.state.{state}.shape", ["x"], "shape[0] is 'x'"),
    "a state shape with a dynamic dim": _field(
        "methods.text_decoder.state.{state}.shape.0", {"min": 1, "max": 2}, "shape[0]"
    ),
    "a state dtype missing": _field("methods.text_decoder.state.{state}.dtype", "delete", "dtype is None"),
    "torch_version a number": _field("torch_version", 2.13, "torch_version is 2.13"),
    "torch_version missing": _field("torch_version", "delete", "torch_version is missing"),
    "device unknown": _field("device", "tpu", "device is 'tpu'", "cpu or cuda"),
    "device a list": _field("device", ["cpu"], "device is ['cpu']"),
    "dtype unknown": _field("dtype", "float8", "dtype is 'float8'"),
    "dtype missing": _field("dtype", "delete", "dtype is missing"),
    "gpu_arch a number": _field("gpu_arch", 90, "gpu_arch is 90"),
    "a method not an object": _field("methods.token_embedding", "token_embedding.so", "methods.token_embedding"),
    "a file entry not an object": (
        lambda b: _edit_json(b, lambda d: d["files"].update({"tekken.json": "abc"})),
        (MANIFEST_NAME, "malformed manifest", "files.tekken.json is 'abc'"),
    ),
    "format_version true": (
        lambda b: _edit_json(b, lambda d: d.update(format_version=True)),
        (MANIFEST_NAME, "format_version True is not a version number"),
    ),
}
BUNDLE_FAULTS |= MANIFEST_FIELD_FAULTS

if not torch.cuda.is_available():
    BUNDLE_FAULTS[".so built for CUDA, no GPU here"] = (
        lambda b: _edit_manifest(b, device="cuda", gpu_arch="sm_90"),
        ("CUDA bundle", "no CUDA device"),
    )

# checked before any dlopen: afterwards none of the copy's libraries may be mapped
BEFORE_DLOPEN = set(BUNDLE_FAULTS) - {"weight file with wrong shapes"}


@pytest.fixture
def bundle_copy(tiny_bundle, work) -> Path:
    return Path(shutil.copytree(tiny_bundle, work / "bundles" / "b"))


@pytest.mark.parametrize("case", list(BUNDLE_FAULTS))
def test_bundle_fault(case, bundle_copy, work, capsys):
    breaker, needles = BUNDLE_FAULTS[case]
    breaker(bundle_copy)
    before = tree(work)
    o = cli(capsys, "run", "--bundle", bundle_copy, "--audio", AUDIO / "short.wav", "--max-new-tokens", 4)
    one_error(o, "bundle", case, *needles)
    assert tree(work) == before
    if case in BEFORE_DLOPEN:
        assert mapped(work / "bundles") == [], "a library was dlopen'ed before the bundle was refused"


@pytest.mark.parametrize(
    "case", ["flipped byte in a .so", "extra .so", "manifest path ../x.so", "newer format version"]
)
def test_inspect_refuses_the_same_bundles(case, bundle_copy, capsys):
    breaker, needles = BUNDLE_FAULTS[case]
    breaker(bundle_copy)
    one_error(cli(capsys, "inspect", bundle_copy), "bundle (inspect)", case, *needles)


def test_so_for_another_gpu_arch(bundle_copy, monkeypatch, capsys):
    """On a GPU of another architecture (faked: this may be a CPU machine) the manifest's gpu_arch is refused
    before any dlopen."""
    _edit_manifest(bundle_copy, device="cuda", gpu_arch="sm_90")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))  # the run verb's memory stats
    o = cli(capsys, "run", "--bundle", bundle_copy, "--audio", AUDIO / "short.wav")
    one_error(o, "bundle", ".so built for another GPU arch (sm_90 on sm_80)", "built for sm_90", "this GPU is sm_80")
    assert mapped(bundle_copy) == []


# ---------------------------------------------------------------- runner options


@pytest.mark.parametrize("where", [".", ".."])
def test_out_that_is_or_holds_the_current_directory(where, tiny_bundle, tiny_checkpoint, work, monkeypatch, capsys):
    """`export --out .` from inside a bundle: a ValueError traceback after the compile (its stage was made inside
    the bundle); `--out ..` would swap out the directory the shell stands in. Refused first, nothing touched."""
    inside = Path(shutil.copytree(tiny_bundle, work / "bundles" / "b"))
    (inside / "debug").mkdir()
    monkeypatch.chdir(inside / "debug" if where == ".." else inside)
    before = tree(work)
    o = cli(
        capsys, "export", "--checkpoint", tiny_checkpoint, "--no-check", "--out", where, "--cache-dir", COMPILE_CACHE
    )
    one_error(o, "runner", f"export --out {where} (in a bundle)", f"{where}: is the current directory")
    assert tree(work) == before


def test_fetch_dest_that_is_the_current_directory(gh, work, monkeypatch, capsys):
    gh.add_run(1)
    here = work / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    o = cli(capsys, "fetch", "--repo", REPO, "--run-id", 1, "--name", NAME, "--dest", ".", "--no-progress", "--force")
    one_error(o, "fetch", "--dest . --force", ".: is the current directory")
    assert gh.requests == [] and list(here.iterdir()) == []


def _golden(tmp: Path, content) -> Path:
    path = tmp / "golden.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return path


@pytest.mark.parametrize(
    "content",
    [
        [1, 2],
        {"weights_digest": 5, "tokens": {}},
        {"weights_digest": "x", "tokens": []},
        {"weights_digest": "x", "tokens": {"cpu-float32": []}},
        {"weights_digest": "DIGEST", "tokens": {"cpu-float32": {"short.wav": 5}}},
        {"weights_digest": "DIGEST", "tokens": {"cpu-float32": {"short.wav": ["7"]}}},
        b'\xff\xfe{"weights_digest": "x"}',
    ],
    ids=["a list", "digest a number", "tokens a list", "a kind a list", "ids a number", "ids strings", "not UTF-8"],
)
def test_expect_tokens_file_of_the_wrong_shape(content, tiny_bundle, work, capsys):
    digest = read_manifest(tiny_bundle).model["source"]["weights_digest"]
    if isinstance(content, dict) and content["weights_digest"] == "DIGEST":
        content = {**content, "weights_digest": digest}
    path = _golden(work, content)
    o = cli(capsys, "run", "--bundle", tiny_bundle, "--audio", AUDIO / "short.wav", "--expect-tokens", path)
    one_error(o, "runner", f"--expect-tokens: {str(content)[:40]}", str(path), "not a golden-token file")


def test_wer_file_that_is_not_utf8(tiny_bundle, work, capsys):
    path = work / "refs.json"
    path.write_bytes(b'{"short.wav": "caf\xe9"}')  # Latin-1
    o = cli(capsys, "run", "--bundle", tiny_bundle, "--audio", AUDIO / "short.wav", "--wer", path)
    one_error(o, "runner", "--wer file not UTF-8", str(path), "not a transcript file")


@pytest.mark.parametrize("content", ["[1, 2]", "5", '"x"', '{"k": 5, "j": [1]}', "{" * 5000, "\xff"])
def test_a_digest_cache_that_is_not_an_object_is_ignored_and_rebuilt(content, tiny_bundle, work, capsys):
    """It is only a cache: a run with it succeeds (it raised AttributeError before) and writes a good one."""
    cache = work / "cache" / "digests.json"
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(content, errors="surrogateescape")
    o = cli(capsys, "run", "--bundle", tiny_bundle, "--audio", AUDIO / "short.wav", "--json", "--max-new-tokens", 2)
    succeeded(o, "runner", f"digest cache {content[:12]!r}")
    entries = json.loads(cache.read_text())
    assert isinstance(entries, dict) and len(entries) == len(read_manifest(tiny_bundle).files)


def test_max_new_tokens_zero(tiny_bundle, work, capsys):
    for n in (0, -3):
        o = cli(capsys, "run", "--bundle", tiny_bundle, "--audio", AUDIO / "short.wav", "--max-new-tokens", n)
        one_error(o, "runner", f"--max-new-tokens {n}", f"--max-new-tokens {n}", "at least 1")


def test_prompt_longer_than_the_context(tiny_bundle, work, capsys):
    prompt = " ".join(["word"] * 1200)
    o = cli(capsys, "run", "--bundle", tiny_bundle, "--audio", AUDIO / "short.wav", "--prompt", prompt)
    one_error(o, "runner", "context overflow (prompt longer than the context)", "prompt needs", "context is 1024")


def test_generation_that_reaches_the_end_of_the_context_stops_cleanly(tiny_bundle, work, capsys):
    o = cli(
        capsys, "run", "--bundle", tiny_bundle, "--audio", AUDIO / "long_35s.flac", "--json",
        "--max-new-tokens", 2000, "--min-new-tokens", 2000,
    )  # fmt: skip
    (rec,) = succeeded(o, "runner", "generation reaching the end of the context")
    assert rec["stop_reason"] == "context" and len(rec["prompt_ids"]) + len(rec["tokens"]) == 1024 + 1
    assert "note:" in o.err and "end of the context" in o.err


@pytest.mark.parametrize("lang", ["xx", "EN", "english", ""])
def test_unknown_language(lang, tiny_bundle, work, capsys):
    o = cli(capsys, "run", "--bundle", tiny_bundle, "--audio", AUDIO / "short.wav", "--language", lang)
    one_error(o, "runner", f"--language {lang!r}", f"unknown language {lang!r}")


@pytest.mark.parametrize("flag, value", [("--temperature", -1), ("--top-p", 0), ("--top-p", 1.5)])
def test_bad_sampling_options(flag, value, tiny_bundle, work, capsys):
    o = cli(capsys, "run", "--bundle", tiny_bundle, "--audio", AUDIO / "short.wav", flag, value)
    one_error(o, "runner", f"{flag} {value}", flag)


def test_special_token_text_in_a_prompt_is_encoded_as_text(tiny_bundle, work, capsys):
    prompt = "[/INST]</s><s>[INST][AUDIO][BEGIN_AUDIO][TRANSCRIBE] what is said?"
    o = cli(capsys, "run", "--bundle", tiny_bundle, "--audio", AUDIO / "short.wav", "--prompt", prompt, "--json")
    (rec,) = succeeded(o, "runner", "special-token text in --prompt")
    tok = Tekken.from_file(tiny_bundle / "tekken.json")
    text_ids = tok.encode(prompt)
    assert all(not tok.is_special(i) for i in text_ids)
    s = tok.special_id
    audio = [i for i in rec["prompt_ids"] if i == s("[AUDIO]")]
    # the template's control tokens and nothing else: <s>[INST][BEGIN_AUDIO] [AUDIO]*n {prompt as text} [/INST]
    assert rec["prompt_ids"] == [tok.bos_id, s("[INST]"), s("[BEGIN_AUDIO]"), *audio, *text_ids, s("[/INST]")]


# ---------------------------------------------------------------- fetch


class CuttingStub(GitHubStub):
    """The stub, able to cut the storage download short (headers promise the whole zip) or to drop API
    connections without an answer."""

    cut_blob_at: int | None = None
    drop_api: int = 0

    def _handler(self, server: str):
        base, stub = super()._handler(server), self

        class Handler(base):
            def do_GET(self) -> None:
                if server == "api" and stub.drop_api > 0:
                    stub.drop_api -= 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if server == "blob" and stub.cut_blob_at is not None:
                    art = stub.artifacts[-1]
                    self.send_response(200)
                    self.send_header("Content-Type", "application/zip")
                    self.send_header("Content-Length", str(len(art.data)))
                    self.end_headers()
                    self.wfile.write(art.data[: stub.cut_blob_at])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                super().do_GET()

        return Handler


@pytest.fixture
def gh(monkeypatch):
    with CuttingStub(REPO, page_size=2) as stub:
        monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
        monkeypatch.delenv("GH_TOKEN", raising=False)
        monkeypatch.setenv("GITHUB_API_URL", stub.api_url)
        monkeypatch.setitem(fetch.GitHubAccess.__init__.__kwdefaults__, "sleep", lambda s: None)  # retries, no waiting
        yield stub


def _big_zip(n: int = 400_000) -> bytes:
    return zip_members({"model.pte": np.random.default_rng(1).bytes(n)})  # stored, incompressible


def _bundle_zip_with_flip(tmp: Path) -> bytes:
    src = tmp / "src-flip"
    write_fake_bundle(src)
    _flip(src / "text_decoder.so")
    return zip_dir(src)


# case id -> (set the stub up (run 1 exists), extra CLI args, expected substrings)
FETCH_FAULTS: dict[str, tuple[Callable, tuple[str, ...], tuple[str, ...]]] = {
    "no token": (lambda gh, t, mp: mp.delenv("GITHUB_TOKEN"), (), ("no GitHub token",)),
    "bad token (401)": (lambda gh, t, mp: mp.setenv("GITHUB_TOKEN", "ghp_wrong"), (), ("401", "GITHUB_TOKEN")),
    "token lacks permission (403)": (
        lambda gh, t, mp: gh.inject("/runs/1", 403, {"x-accepted-github-permissions": "actions=read"}),
        (),
        ("forbidden (403", "actions=read"),
    ),
    "rate limit exhausted until later": (
        lambda gh, t, mp: gh.inject("/runs/1", 403, {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "4102444800"}),
        (),
        ("rate limit", "resets at"),
    ),
    "429 with a long retry-after": (
        lambda gh, t, mp: gh.inject("/runs/1", 429, {"retry-after": "3600"}),
        (),
        ("rate limit", "try again later"),
    ),
    "run not found (404)": (lambda gh, t, mp: None, ("--run-id", 999), ("run 999", "404")),
    "no artifact of that name": (
        lambda gh, t, mp: gh.add_artifact(10, "benchmark-results", 1, b"x"),
        (),
        (f"no artifact named {NAME}", "benchmark-results"),
    ),
    "artifact expired": (lambda gh, t, mp: gh.add_artifact(10, NAME, 1, b"x", expired=True), (), ("expired",)),
    "410 on download": (
        lambda gh, t, mp: (
            gh.add_artifact(10, NAME, 1, fake_bundle_zip(t)),
            gh.inject("/artifacts/10/zip", 410, body={"message": "Artifact has expired"}),
        ),
        (),
        ("gone (410", "expired"),
    ),
    "5xx every time": (
        lambda gh, t, mp: [gh.inject("/runs/1", 502) for _ in range(fetch.RetryPolicy().attempts)],
        (),
        ("HTTP 502", "gave up after"),
    ),
    "API drops every connection": (
        lambda gh, t, mp: setattr(gh, "drop_api", fetch.RetryPolicy().attempts),
        (),
        ("cannot reach",),
    ),
    "storage refuses (403)": (
        lambda gh, t, mp: (gh.add_artifact(10, NAME, 1, fake_bundle_zip(t)), setattr(gh, "blob_status", 403)),
        (),
        ("storage host refused",),
    ),
    "connection cut mid-download": (
        lambda gh, t, mp: (gh.add_artifact(10, NAME, 1, _big_zip()), setattr(gh, "cut_blob_at", 150_000)),
        (),
        (f"artifact {NAME} (10)", "try again"),
    ),
    "digest mismatch": (
        lambda gh, t, mp: gh.add_artifact(10, NAME, 1, fake_bundle_zip(t), digest="sha256:" + "0" * 64),
        (),
        ("does not match GitHub's digest",),
    ),
    "not a zip": (lambda gh, t, mp: gh.add_artifact(10, NAME, 1, b"PK\x03\x04 not really"), (), ("not a zip",)),
    "unsafe archive (../)": (
        lambda gh, t, mp: gh.add_artifact(10, NAME, 1, zip_members({"model.pte": b"{}", "../evil.so": b"x"})),
        (),
        ("unsafe archive", "'..' path"),
    ),
    "a corrupt bundle in a good zip": (
        lambda gh, t, mp: gh.add_artifact(10, NAME, 1, _bundle_zip_with_flip(t)),
        (),
        ("not a valid bundle", "text_decoder.so", "sha256"),
    ),
}


@pytest.mark.parametrize("case", list(FETCH_FAULTS))
def test_fetch_fault(case, gh, work, monkeypatch, capsys):
    setup, extra, needles = FETCH_FAULTS[case]
    gh.add_run(1)
    src = work / "src"
    src.mkdir()
    setup(gh, src, monkeypatch)
    dest = work / "dl" / "bundle"
    dest.parent.mkdir()
    run_id = [] if "--run-id" in extra else ["--run-id", 1]
    args = ["fetch", "--repo", REPO, *run_id, "--name", NAME, "--dest", dest, "--no-progress", *extra]
    before = tree(work)
    o = cli(capsys, *args)
    line = one_error(o, "fetch", case, *needles)
    assert TOKEN not in o.err + o.out and "SeCrEt" not in line
    assert o.out == ""
    assert list(dest.parent.iterdir()) == [], "a failed fetch left files behind"
    assert tree(work) == before


def _bomb_zip(t: Path, name: str, size: int) -> bytes:
    """A valid fake bundle plus member `name`: `size` zero bytes deflated to ~1/1000 of that, first in the zip."""
    import io
    import zipfile

    src = t / "src-bomb"
    write_fake_bundle(src)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(name, bytes(size))
        for p in sorted(src.iterdir()):
            if p.name != name:
                zf.write(p, p.name)
    return buf.getvalue()


@pytest.mark.parametrize(
    "name, needle",
    [("junk.bin", "not a file model.pte lists"), ("tekken.json", "model.pte says")],
    ids=["a member the manifest does not list", "a listed member far larger than the manifest says"],
)
def test_fetch_bounds_extraction_by_the_manifest(name, needle, gh, work, monkeypatch, capsys):
    """A zip of ~64 kB that inflates to 64 MiB: it was written out whole (and an unlisted file kept in the bundle);
    now it is refused before a byte of it is read."""
    import zipfile

    data = _bomb_zip(work, name, 64 << 20)
    assert len(data) < 200_000
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, data)
    opened = []
    real_open = zipfile.ZipFile.open
    monkeypatch.setattr(
        zipfile.ZipFile,
        "open",
        lambda zf, m, *a, **k: opened.append(getattr(m, "filename", m)) or real_open(zf, m, *a, **k),
    )
    dest = work / "dl" / "bundle"
    dest.parent.mkdir()
    o = cli(capsys, "fetch", "--repo", REPO, "--run-id", 1, "--name", NAME, "--dest", dest, "--no-progress")
    one_error(o, "fetch", f"zip bomb: {name}", "unsafe archive", repr(name), needle)
    assert name not in opened and list(dest.parent.iterdir()) == []


def test_fetch_into_a_non_empty_or_file_destination(gh, work, capsys):
    gh.add_run(1)
    full = work / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    o = cli(capsys, "fetch", "--repo", REPO, "--run-id", 1, "--name", NAME, "--dest", full, "--no-progress")
    one_error(o, "fetch", "destination not empty", str(full), "--force")
    afile = work / "afile"
    afile.write_text("mine")
    o = cli(capsys, "fetch", "--repo", REPO, "--run-id", 1, "--name", NAME, "--dest", afile, "--no-progress")
    one_error(o, "fetch", "destination is a file", str(afile), "not a directory")
    assert (full / "keep.txt").read_text() == "mine" and afile.read_text() == "mine"
    assert gh.requests == []


@pytest.fixture
def small_fs(tmp_path):
    """A 512 kB tmpfs: a real full disk. Needs root (mount); skipped elsewhere (the file-size-limit test
    below covers the same failure without privileges)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_fetch_onto_a_disk_without_room_is_refused_before_the_download(gh, small_fs, work, capsys):
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, _big_zip(300_000))
    dest = small_fs / "bundle"
    o = cli(capsys, "fetch", "--repo", REPO, "--run-id", 1, "--name", NAME, "--dest", dest, "--no-progress")
    one_error(o, "fetch", "no room for the zip and its files (512 kB tmpfs)", "free on its disk", "needs about")
    assert gh.seen("blob") == [] and list(small_fs.iterdir()) == []


@pytest.mark.parametrize("size", [700_000, 300_000], ids=["download", "extraction"])
def test_fetch_onto_a_disk_that_fills_up(size, gh, small_fs, work, monkeypatch, capsys):
    """The disk said it had room (another writer took it meanwhile): the zip does not fit (download) or fits but
    its extracted copy does not (extraction)."""
    monkeypatch.setattr(publish, "free_bytes", lambda path: 1 << 40)
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, _big_zip(size))
    dest = small_fs / "bundle"
    o = cli(capsys, "fetch", "--repo", REPO, "--run-id", 1, "--name", NAME, "--dest", dest, "--no-progress")
    one_error(o, "fetch", f"disk full during {'download' if size > 400_000 else 'extraction'}", "No space left")
    assert list(small_fs.iterdir()) == []


def test_fetch_past_the_file_size_limit_in_a_real_process(gh, work):
    """`python -m runner fetch` where writes fail (RLIMIT_FSIZE: EFBIG, as a full disk fails them with ENOSPC)."""
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, _big_zip(400_000))
    dest = work / "dl" / "bundle"

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    env = {"GITHUB_TOKEN": TOKEN, "GITHUB_API_URL": gh.api_url, "PYTHONDONTWRITEBYTECODE": "1"}
    o = python_m_runner(
        "fetch", "--repo", REPO, "--run-id", 1, "--name", NAME, "--dest", dest, "--no-progress",
        env=env, preexec=limit, cwd=work / "cwd",
    )  # fmt: skip
    one_error(o, "fetch", "file size limit during download (process)", str(dest.parent), "File too large")
    assert list(dest.parent.iterdir()) == []


# ---------------------------------------------------------------- export


def _ckpt_without_weights(t: Path) -> Path:
    d = t / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "tekken.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    return d


EXPORT_FAULTS: dict[str, tuple[Callable[[Path, Path], list], tuple[str, ...]]] = {
    "checkpoint missing": (lambda t, ck: ["--checkpoint", t / "nope"], ("nope", "not found")),
    "checkpoint with pickle weights only": (
        lambda t, ck: ["--checkpoint", _ckpt_without_weights(t)],
        ("no .safetensors", "pytorch_model.bin"),
    ),
    "--max-seq-len too small for the audio": (
        lambda t, ck: ["--checkpoint", ck, "--max-seq-len", 100],
        ("--max-seq-len 100",),
    ),
    "preset without weights": (lambda t, ck: ["--preset", "voxtral-mini-3b"], ("voxtral-mini-3b", "no weights")),
    "--out is a non-bundle directory": (
        lambda t, ck: ["--checkpoint", ck, "--no-check"],
        ("is not a bundle", "refusing"),
    ),
}


@pytest.mark.parametrize("case", list(EXPORT_FAULTS))
def test_export_fault(case, tiny_checkpoint, work, capsys):
    args, needles = EXPORT_FAULTS[case]
    argv = args(work, tiny_checkpoint)
    out = work / "exports" / "bundle"
    out.parent.mkdir()
    if case == "--out is a non-bundle directory":
        out.mkdir()
        (out / "mine.txt").write_text("keep")
    before = tree(work)
    o = cli(capsys, "export", *argv, "--out", out, "--cache-dir", COMPILE_CACHE)
    one_error(o, "export", case, *needles)
    assert tree(work) == before, "a failed export left files behind"


def test_export_that_fails_half_way_leaves_nothing(tiny_checkpoint, work, monkeypatch, capsys):
    """The disk fills while the weights are written (injected ENOSPC on the third file): the half-built stage
    is removed, the old bundle at --out stays, and the error names --out."""
    from runner.export import aoti

    out = work / "exports" / "bundle"
    out.mkdir(parents=True)
    write_fake_bundle(out)  # an earlier bundle at --out: must survive the failed export
    calls = []
    real = aoti.save_file

    def filling_up(tensors, path, *a, **kw):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(tensors, path, *a, **kw)

    monkeypatch.setattr(aoti, "save_file", filling_up)
    before = tree(work)
    o = cli(capsys, "export", "--checkpoint", tiny_checkpoint, "--no-check", "--out", out, "--cache-dir", COMPILE_CACHE)
    one_error(o, "export", "disk full half-way (injected ENOSPC)", str(out), "No space left")
    assert len(calls) == 3 and tree(work) == before


def test_export_onto_a_disk_without_room_is_refused_before_any_work(tiny_checkpoint, small_fs, work, capsys):
    out = small_fs / "bundle"
    o = cli(capsys, "export", "--checkpoint", tiny_checkpoint, "--no-check", "--out", out, "--cache-dir", COMPILE_CACHE,
            "--max-audio-chunks", "2", "--max-seq-len", "1024")  # fmt: skip
    one_error(o, "export", "no room for the bundle (512 kB tmpfs)", str(out.parent), "free on its disk", "needs about")
    assert list(small_fs.iterdir()) == []


def test_export_onto_a_full_disk(tiny_checkpoint, small_fs, work, monkeypatch, capsys):
    """Compiled methods come from the cache: copying them onto the full disk fails (OSError). The disk said it
    had room (another writer took it meanwhile)."""
    monkeypatch.setattr(publish, "free_bytes", lambda path: 1 << 40)
    out = small_fs / "bundle"
    o = cli(capsys, "export", "--checkpoint", tiny_checkpoint, "--no-check", "--out", out, "--cache-dir", COMPILE_CACHE,
            "--max-audio-chunks", "2", "--max-seq-len", "1024")  # fmt: skip  # tiny_bundle's sizes: cached
    one_error(o, "export", "disk full (512 kB tmpfs)", str(out), "No space left")
    assert list(small_fs.iterdir()) == []


@pytest.mark.slow
def test_export_compiling_onto_a_full_disk_does_not_abort(tiny_checkpoint, small_fs, tmp_path):
    """Compiling (empty cache) onto a full disk: torch's archive writer fails with a RuntimeError and then threw
    again from its C++ destructor: `terminate called`, exit 134. Now one error line and exit 1."""
    out = small_fs / "bundle"
    cache = tmp_path / "empty-cache"
    o = python_m_runner(
        "export", "--checkpoint", tiny_checkpoint, "--no-check", "--out", out, "--cache-dir", cache,
        prelude="import runner.publish; runner.publish.free_bytes = lambda path: 1 << 40",  # past the room check
    )  # fmt: skip
    one_error(o, "export", "disk full while compiling (process)", str(out), "export failed")
    assert o.code == 1 and "terminate called" not in o.err
    assert list(small_fs.iterdir()) == []


# ---------------------------------------------------------------- the same, as real processes


@pytest.mark.parametrize(
    "case",
    ["flipped byte in a .so", "NaN samples", "unknown language"],
)
def test_python_m_runner_fails_with_one_line(case, tiny_bundle, tmp_path):
    bundle, audio, extra = tiny_bundle, AUDIO / "short.wav", []
    if case == "flipped byte in a .so":
        bundle = Path(shutil.copytree(tiny_bundle, tmp_path / "b"))
        _flip(bundle / "text_decoder.so")
    elif case == "NaN samples":
        audio = _non_finite(tmp_path / "nan.wav", np.nan)
    else:
        extra = ["--language", "xx"]
    o = python_m_runner(
        "run", "--bundle", bundle, "--audio", audio, *extra, env={"VOXTRAL_RUNNER_CACHE": str(tmp_path)}
    )
    one_error(o, "process", case, "error: ")
    assert o.code == 1 and o.out == ""
