"""A checkpoint's JSON files are checked before anything is built from them (issue 42): a config.json or
params.json claiming 1e9 layers or a 1e10 vocabulary, zero heads, a string or a float where a whole number
belongs, a list for a section, JSON nested 200k deep, bytes that are not UTF-8, a tekken.json declaring 1e9
special tokens, a model larger than the machine holds: each is one `error:` line naming the file and the field,
from `python -m runner export --checkpoint`, before any model is built or weight read."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

import runner.export.checkpoint as checkpoint
import runner.export.voxtral_realtime as voxtral_realtime
from runner.app.cli import main
from runner.errors import ExportError, TokenizerError
from runner.families.voxtral import Tekken
from runner.models.voxtral import Voxtral
from runner.models.voxtral_config import PRESETS

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TEKKEN = FIXTURES / "tekken.json"
REALTIME = FIXTURES / "voxtral-realtime-tiny"
HF_CONFIG = json.loads((FIXTURES / "voxtral-tiny" / "config.json").read_text())
REALTIME_CONFIG = json.loads((REALTIME / "config.json").read_text())
DEEP = b"[" * 200_000 + b"]" * 200_000  # deeper than json's parser recurses
NOT_UTF8 = b'{"text_config": {"hidden_size": 64, "model_type": "caf\xe9"}}'

# params.json of the tiny preset, as Mistral writes it (runner/export/mistral_format.py's mapping read backwards)
PARAMS = {
    "dim": 64, "n_layers": 2, "head_dim": 16, "hidden_dim": 128, "n_heads": 4, "n_kv_heads": 2,
    "rope_theta": 1e8, "norm_eps": 1e-5, "vocab_size": 1024,
    "multimodal": {
        "whisper_model_args": {
            "encoder_args": {
                "audio_encoding_args": {"num_mel_bins": 128}, "dim": 64, "n_layers": 2, "head_dim": 32,
                "hidden_dim": 256, "n_heads": 2, "max_source_positions": 1500,
            },
            "downsample_args": {"downsample_factor": 4},
        }
    },
}  # fmt: skip


@pytest.fixture(autouse=True)
def built(monkeypatch) -> list[str]:
    """What was built or read that the checks should have come before: the model's constructors and the weights'
    reader record themselves (and fail)."""
    calls: list[str] = []

    def refuse(what):
        def call(*args, **kwargs):
            calls.append(what)
            raise AssertionError(f"{what} before the checkpoint's files were checked")

        return call

    monkeypatch.setattr(checkpoint, "Voxtral", refuse("Voxtral()"))
    monkeypatch.setattr(checkpoint, "read_weights", refuse("read_weights"))
    monkeypatch.setattr(voxtral_realtime, "VoxtralRealtime", refuse("VoxtralRealtime()"))
    monkeypatch.setattr(voxtral_realtime, "read_weights", refuse("read_weights"))
    return calls


def _write(path: Path, doc) -> None:
    path.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())


def _checkpoint(tmp_path: Path, files: dict) -> Path:
    """A checkpoint directory: the given files (a dict is written as JSON, bytes as they are), a stand-in for the
    weights (never read: what is wrong is found first) and the fixture tokenizer unless one is given."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    weights = "consolidated.safetensors" if "params.json" in files else "model.safetensors"
    (ckpt / weights).write_bytes(b"\0" * 64)
    for name, doc in files.items():
        _write(ckpt / name, doc)
    if "tekken.json" not in files:
        shutil.copyfile(TEKKEN, ckpt / "tekken.json")
    return ckpt


def _export_error(capsys, tmp_path: Path, ckpt: Path) -> str:
    """`export --checkpoint`: exit 1 with exactly one line on stderr, `error: ...`, and no traceback."""
    out = tmp_path / "out"
    rc = main(["export", "--checkpoint", str(ckpt), "--device", "cpu", "--out", str(out), "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 1, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not out.exists()
    return lines[0]


def _edit(doc: dict, path: str, value) -> dict:
    """A copy of `doc` with the field at dotted `path` set to `value`."""
    doc = copy.deepcopy(doc)
    *sections, key = path.split(".")
    target = doc
    for s in sections:
        target = target[s]
    target[key] = value
    return doc


# ---------------------------------------------------------------- config.json (HF layout)

BAD_FIELDS = [
    ("text_config.num_hidden_layers", 10**9),
    ("text_config.vocab_size", 10**10),
    ("audio_config.num_hidden_layers", 10**9),
    ("text_config.num_attention_heads", 0),
    ("audio_config.num_attention_heads", 0),
    ("text_config.hidden_size", "64"),
    ("text_config.intermediate_size", 128.0),
    ("text_config.num_hidden_layers", True),
    ("text_config.head_dim", -16),
    ("text_config.num_key_value_heads", 3),
    ("text_config.rms_norm_eps", "1e-5"),
    ("text_config.rope_parameters.rope_theta", -1.0),
    ("audio_config.num_mel_bins", [128]),
    ("audio_token_id", 10**6),
]


@pytest.mark.parametrize("field, value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_a_bad_hf_config_field_is_one_line_naming_the_file_and_the_field(capsys, tmp_path, built, field, value):
    ckpt = _checkpoint(tmp_path, {"config.json": _edit(HF_CONFIG, field, value)})
    line = _export_error(capsys, tmp_path, ckpt)
    assert str(ckpt / "config.json") in line and field in line
    assert built == []


@pytest.mark.parametrize("section", ["text_config", "audio_config"])
@pytest.mark.parametrize("value", [[1, 2], "text", 3])
def test_a_section_that_is_not_an_object_is_named(capsys, tmp_path, built, section, value):
    ckpt = _checkpoint(tmp_path, {"config.json": _edit(HF_CONFIG, section, value)})
    line = _export_error(capsys, tmp_path, ckpt)
    assert str(ckpt / "config.json") in line and section in line and "not a JSON object" in line
    assert built == []


@pytest.mark.parametrize("content, needle", [(DEEP, "nested too deeply"), (NOT_UTF8, "not UTF-8")])
def test_an_unreadable_config_json_is_one_line_naming_it(capsys, tmp_path, built, content, needle):
    ckpt = _checkpoint(tmp_path, {"config.json": content})
    line = _export_error(capsys, tmp_path, ckpt)
    assert str(ckpt / "config.json") in line and needle in line
    assert built == []


def test_a_model_larger_than_the_machine_holds_is_refused_before_it_is_built(capsys, tmp_path, built):
    """Every field within its bound, the whole far beyond any machine: 1024 layers 131072 wide, 4M tokens."""
    doc = HF_CONFIG
    for field, value in (("num_hidden_layers", 1024), ("hidden_size", 1 << 17), ("intermediate_size", 1 << 18)):
        doc = _edit(doc, f"text_config.{field}", value)
    ckpt = _checkpoint(tmp_path, {"config.json": _edit(doc, "text_config.vocab_size", 1 << 22)})
    line = _export_error(capsys, tmp_path, ckpt)
    assert str(ckpt / "config.json") in line and "parameters" in line and "memory" in line
    assert built == []


def test_the_memory_check_counts_the_parameters_the_model_has():
    """The count the memory check uses is the built model's (the tiny preset is cheap to build)."""
    for name in ("tiny",):
        assert checkpoint.param_count(PRESETS[name]) == sum(p.numel() for p in Voxtral(PRESETS[name]).parameters())


def test_a_model_that_fits_passes_the_memory_check_and_one_that_does_not_is_refused(tmp_path):
    params = checkpoint.param_count(PRESETS["voxtral-mini-3b"])  # 4.7 B: 17.4 GiB in float32
    checkpoint.check_host_memory(tmp_path / "config.json", params, 32 << 30)
    checkpoint.check_host_memory(tmp_path / "config.json", params, None)  # unknown: not refused
    with pytest.raises(ExportError, match=r"config\.json: describes a model of 4\.68 B parameters"):
        checkpoint.check_host_memory(tmp_path / "config.json", params, 8 << 30)


def test_a_shard_index_nested_too_deeply_or_naming_a_file_elsewhere_is_named(capsys, tmp_path, built):
    ckpt = _checkpoint(tmp_path, {"config.json": HF_CONFIG, "model.safetensors.index.json": DEEP})
    line = _export_error(capsys, tmp_path, ckpt)
    assert str(ckpt / "model.safetensors.index.json") in line and "nested too deeply" in line
    _write(ckpt / "model.safetensors.index.json", {"weight_map": {"a": "../../elsewhere.safetensors"}})
    line = _export_error(capsys, tmp_path, ckpt)
    assert str(ckpt / "model.safetensors.index.json") in line and "elsewhere" in line
    assert built == []


# ---------------------------------------------------------------- params.json (Mistral layout)

BAD_PARAMS = [
    ("n_layers", 10**9),
    ("vocab_size", 10**10),
    ("n_heads", 0),
    ("dim", "64"),
    ("hidden_dim", 128.5),
    ("norm_eps", None),
    ("multimodal.whisper_model_args.encoder_args.n_layers", 10**9),
    ("multimodal.whisper_model_args.encoder_args.n_heads", 0),
    ("multimodal.whisper_model_args.encoder_args.audio_encoding_args", [128]),
    ("multimodal.whisper_model_args", [1]),
]


@pytest.mark.parametrize("field, value", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_a_bad_params_json_field_is_one_line_naming_the_file_and_the_field(capsys, tmp_path, built, field, value):
    ckpt = _checkpoint(tmp_path, {"params.json": _edit(PARAMS, field, value)})
    line = _export_error(capsys, tmp_path, ckpt)
    assert str(ckpt / "params.json") in line and field in line
    assert built == []


@pytest.mark.parametrize("content, needle", [(DEEP, "nested too deeply"), (b"\xff\xfe{}", "not UTF-8")])
def test_an_unreadable_params_json_is_one_line_naming_it(capsys, tmp_path, built, content, needle):
    ckpt = _checkpoint(tmp_path, {"params.json": content})
    line = _export_error(capsys, tmp_path, ckpt)
    assert str(ckpt / "params.json") in line and needle in line
    assert built == []


def test_the_params_json_of_the_tiny_preset_is_the_tiny_preset():
    """The stand-in above is a valid params.json: each test's one edit is what is refused."""
    from runner.export.mistral_format import config_from_params

    assert config_from_params(PARAMS, 24) == PRESETS["tiny"]


# ---------------------------------------------------------------- config.json (Voxtral Realtime)

BAD_REALTIME = [
    ("text_config.num_hidden_layers", 10**9),
    ("text_config.vocab_size", 10**10),
    ("audio_config.num_attention_heads", 0),
    ("text_config.num_attention_heads", 0),
    ("text_config.sliding_window", "16"),
    ("audio_config.head_dim", 16.0),
    ("downsample_factor", 10**9),
    ("text_config.rope_parameters", [1]),
]


@pytest.mark.parametrize("field, value", BAD_REALTIME, ids=[f"{f}={v!r}" for f, v in BAD_REALTIME])
def test_a_bad_realtime_config_field_is_one_line_naming_the_file_and_the_field(capsys, tmp_path, built, field, value):
    ckpt = _checkpoint(
        tmp_path,
        {"config.json": _edit(REALTIME_CONFIG, field, value), "tekken.json": (REALTIME / "tekken.json").read_bytes()},
    )
    line = _export_error(capsys, tmp_path, ckpt)
    assert str(ckpt / "config.json") in line and field in line
    assert built == []


# ---------------------------------------------------------------- tekken.json

TEKKEN_DOC = json.loads(TEKKEN.read_text())
BAD_TEKKEN = [
    ("config.default_num_special_tokens", 10**9),
    ("config.default_vocab_size", 10**10),
    ("config.default_num_special_tokens", "1000"),
    ("config.default_vocab_size", 1024.0),
]


@pytest.mark.parametrize("field, value", BAD_TEKKEN, ids=[f"{f}={v!r}" for f, v in BAD_TEKKEN])
@pytest.mark.parametrize("layout", ["config.json", "params.json"])
def test_a_bad_tekken_json_count_is_one_line_naming_the_file_and_the_field(
    capsys, tmp_path, built, field, value, layout
):
    doc = HF_CONFIG if layout == "config.json" else PARAMS
    ckpt = _checkpoint(tmp_path, {layout: doc, "tekken.json": _edit(TEKKEN_DOC, field, value)})
    line = _export_error(capsys, tmp_path, ckpt)
    assert str(ckpt / "tekken.json") in line and field in line
    assert built == []


def test_a_tekken_json_nested_too_deeply_is_named(capsys, tmp_path, built):
    ckpt = _checkpoint(tmp_path, {"config.json": HF_CONFIG, "tekken.json": DEEP})
    line = _export_error(capsys, tmp_path, ckpt)
    assert str(ckpt / "tekken.json") in line and "nested too deeply" in line
    assert built == []


def test_a_special_token_the_tokenizer_lacks_is_named_with_its_file(tmp_path):
    path = tmp_path / "tekken.json"
    _write(path, TEKKEN_DOC)
    with pytest.raises(TokenizerError, match=r"special token '\[NOPE\]'") as e:
        Tekken.from_file(path).special_id("[NOPE]")
    assert str(path) in str(e.value)
