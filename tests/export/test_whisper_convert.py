"""The CTranslate2 reader and the Whisper converter, on small synthetic model.bin files written here (no model
package needed): round trip, and a clear refusal for every kind of unexpected content."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from runner.export.ct2 import ConversionError, read_ct2, write_ct2
from runner.export.whisper_convert import EXPECTED_FLAGS, convert, verify_files
from runner.models.voxtral_config import AudioConfig
from runner.models.whisper import Whisper, WhisperConfig, WhisperTextConfig

SMALL = WhisperConfig(
    audio=AudioConfig(n_mels=8, dim=16, n_layers=2, n_heads=2, ffn_dim=32),
    text=WhisperTextConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_dim=32, max_target_positions=12),
)


def to_ct2(model: Whisper) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Our state dict in CTranslate2's WhisperSpec layout (written independently of the converter: fused
    projections with a zero key bias, gamma/beta norms, scalars), float16 as the shipped file."""
    state = model.to_hf_layout(model.state_dict())  # the encoder's q/k/v as three, as CTranslate2 names them
    sd = {k: v.detach().numpy().astype(np.float16) for k, v in state.items() if "kv_cache" not in k}
    c = model.config
    out: dict[str, np.ndarray] = {}

    def norm(dst, src):
        out[f"{dst}/gamma"], out[f"{dst}/beta"] = sd[f"{src}.weight"], sd[f"{src}.bias"]

    def lin(dst, src):
        out[f"{dst}/weight"], out[f"{dst}/bias"] = sd[f"{src}.weight"], sd[f"{src}.bias"]

    def fused(dst, srcs):
        out[f"{dst}/weight"] = np.concatenate([sd[f"{s}.weight"] for s in srcs])
        zero = np.zeros(c.text.dim, np.float16)
        out[f"{dst}/bias"] = np.concatenate([sd.get(f"{s}.bias", zero) for s in srcs])

    def layer(dst, src, cross):
        fused(f"{dst}/self_attention/linear_0", [f"{src}.self_attn.{p}_proj" for p in "qkv"])
        lin(f"{dst}/self_attention/linear_1", f"{src}.self_attn.out_proj")
        norm(f"{dst}/self_attention/layer_norm", f"{src}.self_attn_layer_norm")
        if cross:
            lin(f"{dst}/attention/linear_0", f"{src}.encoder_attn.q_proj")
            fused(f"{dst}/attention/linear_1", [f"{src}.encoder_attn.{p}_proj" for p in "kv"])
            lin(f"{dst}/attention/linear_2", f"{src}.encoder_attn.out_proj")
            norm(f"{dst}/attention/layer_norm", f"{src}.encoder_attn_layer_norm")
        lin(f"{dst}/ffn/linear_0", f"{src}.fc1")
        lin(f"{dst}/ffn/linear_1", f"{src}.fc2")
        norm(f"{dst}/ffn/layer_norm", f"{src}.final_layer_norm")

    lin("encoder/conv1", "encoder.conv1")
    lin("encoder/conv2", "encoder.conv2")
    out["encoder/position_encodings/encodings"] = sd["encoder.embed_positions.weight"]
    for i in range(c.audio.n_layers):
        layer(f"encoder/layer_{i}", f"encoder.layers.{i}", False)
    norm("encoder/layer_norm", "encoder.layer_norm")
    out["decoder/embeddings/weight"] = sd["decoder.embed_tokens.weight"]
    out["decoder/position_encodings/encodings"] = sd["decoder.embed_positions.weight"]
    for i in range(c.text.n_layers):
        layer(f"decoder/layer_{i}", f"decoder.layers.{i}", True)
    norm("decoder/layer_norm", "decoder.layer_norm")
    out["encoder/num_heads"] = np.int16(c.audio.n_heads)
    out["decoder/num_heads"] = np.int16(c.text.n_heads)
    out["decoder/alignment_heads"] = np.int16(1)
    out["decoder/alignment_layer"] = np.int16(-1)
    out.update({k: np.int8(v) for k, v in EXPECTED_FLAGS.items()})
    return {k: np.asarray(v) for k, v in out.items()}, {"decoder/projection/weight": "decoder/embeddings/weight"}


@pytest.fixture
def small():
    torch.manual_seed(0)
    model = Whisper(SMALL).init_weights(3)
    with torch.no_grad():  # non-trivial biases and norms, so a swapped q/v or gamma/beta shows (the key rows of the
        # encoder's fused bias stay zero: transformers' layout, views of ours, has no key bias)
        for p in model.to_hf_layout(dict(model.named_parameters())).values():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    variables, aliases = to_ct2(model)
    return model, variables, aliases


def _write(tmp_path, variables, aliases, spec="WhisperSpec", revision=3):
    path = tmp_path / "model.bin"
    write_ct2(path, spec, revision, variables, aliases)
    return path


def test_round_trip_recovers_every_weight_and_the_config(tmp_path, small):
    model, variables, aliases = small
    got, config = convert(_write(tmp_path, variables, aliases))
    assert config == SMALL
    want = {k: v.half().float() for k, v in model.state_dict().items() if "kv_cache" not in k}
    have = {k: v for k, v in got.state_dict().items() if "kv_cache" not in k}
    assert set(have) == set(want)
    for k in want:
        assert torch.equal(have[k], want[k]), k


def test_reader_resolves_aliases_and_reads_scalars(tmp_path, small):
    _, variables, aliases = small
    ct2 = read_ct2(_write(tmp_path, variables, aliases), expect_spec="WhisperSpec", expect_revision=3)
    assert ct2.variables["decoder/projection/weight"] is ct2.variables["decoder/embeddings/weight"]
    assert ct2.scalar("decoder/activation") == 3 and ct2.scalar("encoder/num_heads") == 2


@pytest.mark.parametrize(
    "patch, message",
    [
        (lambda b: struct.pack("<I", 5) + b[4:], "binary version 5"),
        (lambda b: b[:-7], "truncated"),
        (lambda b: b + b"\0\0", "trailing bytes"),
    ],
)
def test_reader_refuses_other_versions_truncation_and_trailing_bytes(tmp_path, small, patch, message):
    _, variables, aliases = small
    path = _write(tmp_path, variables, aliases)
    path.write_bytes(patch(path.read_bytes()))
    with pytest.raises(ConversionError, match=message):
        read_ct2(path)


def test_reader_refuses_another_spec_or_revision(tmp_path, small):
    _, variables, aliases = small
    with pytest.raises(ConversionError, match="model spec 'TransformerSpec'"):
        convert(_write(tmp_path, variables, aliases, spec="TransformerSpec"))
    with pytest.raises(ConversionError, match="revision 2, expected 3"):
        convert(_write(tmp_path, variables, aliases, revision=2))


def test_reader_refuses_a_dtype_it_cannot_represent(tmp_path, small):
    _, variables, aliases = small
    path = _write(tmp_path, {"x": np.zeros(2, np.float32)}, {})
    data = bytearray(path.read_bytes())
    # header: u32 version, u16 len + "WhisperSpec\0", u32 revision, u32 count, then "x": u16 + 2 bytes, rank, dims
    dtype_at = 4 + 2 + 12 + 4 + 4 + 2 + 2 + 1 + 4
    assert data[dtype_at] == 0  # float32
    data[dtype_at] = 5  # bfloat16
    path.write_bytes(bytes(data))
    with pytest.raises(ConversionError, match="unsupported dtype bfloat16"):
        read_ct2(path)


def test_converter_refuses_a_nonzero_key_bias(tmp_path, small):
    _, variables, aliases = small
    b = variables["decoder/layer_1/self_attention/linear_0/bias"].copy()
    b[SMALL.text.dim + 3] = 0.5  # inside the K slice
    variables["decoder/layer_1/self_attention/linear_0/bias"] = b
    with pytest.raises(ConversionError, match="non-zero key bias"):
        convert(_write(tmp_path, variables, aliases))


def test_converter_refuses_unexpected_and_missing_variables(tmp_path, small):
    _, variables, aliases = small
    extra = dict(variables, **{"decoder/layer_0/extra/weight": np.zeros(3, np.float16)})
    with pytest.raises(ConversionError, match="unexpected variables decoder/layer_0/extra/weight"):
        convert(_write(tmp_path, extra, aliases))
    missing = {k: v for k, v in variables.items() if k != "encoder/layer_1/ffn/linear_1/bias"}
    with pytest.raises(ConversionError, match="missing variable encoder/layer_1/ffn/linear_1/bias"):
        convert(_write(tmp_path, missing, aliases))


def test_converter_refuses_flags_our_model_does_not_implement(tmp_path, small):
    _, variables, aliases = small
    variables["decoder/activation"] = np.asarray(np.int8(1))  # GELUTanh
    with pytest.raises(ConversionError, match="decoder/activation is 1, our Whisper needs 3"):
        convert(_write(tmp_path, variables, aliases))


def test_converter_refuses_a_wrong_shape_with_the_key_named(tmp_path, small):
    _, variables, aliases = small
    variables["decoder/layer_0/ffn/linear_1/weight"] = np.zeros((16, 31), np.float16)
    with pytest.raises(Exception, match=r"decoder.layers.0.fc2.weight \[16, 31\] \(want \[16, 32\]\)"):
        convert(_write(tmp_path, variables, aliases))


def test_converter_refuses_an_untied_output_projection(tmp_path, small):
    _, variables, _ = small
    variables["decoder/projection/weight"] = variables["decoder/embeddings/weight"] + np.float16(1)
    with pytest.raises(ConversionError, match="not tied"):
        convert(_write(tmp_path, variables, {}))


def test_package_files_are_refused_unless_their_sha256_is_the_pinned_one(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"not the model")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConversionError, match="is not the pinned"):
        verify_files(tmp_path)
    (tmp_path / "model.bin").unlink()
    with pytest.raises(ConversionError, match="missing"):
        verify_files(tmp_path)
