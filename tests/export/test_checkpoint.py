"""The checkpoint loader: what `VoxtralForConditionalGeneration.save_pretrained` writes (single file or sharded),
transformers-5 key spellings, and one clear ExportError for every way a checkpoint can be wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, OTHER_HF_CONFIG, save_hf_checkpoint
from safetensors.torch import load_file, save_file

from runner.errors import ExportError
from runner.export.checkpoint import load_checkpoint
from runner.models.voxtral_config import PRESETS, AudioConfig, TextConfig, VoxtralConfig

TINY_HF_CONFIG = json.loads((FIXTURES / "voxtral-tiny" / "config.json").read_text())


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """An unsharded tiny checkpoint, written by transformers."""
    return save_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tiny", TINY_HF_CONFIG, seed=11)


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    from transformers import VoxtralForConditionalGeneration

    return VoxtralForConditionalGeneration.from_pretrained(hf_dir).eval()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ours_name(hf_key: str) -> str:
    """transformers-5 in-memory name -> the save_pretrained (4.x) layout our model uses."""
    for old, new in (
        ("model.audio_tower.", "audio_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    ):
        if hf_key.startswith(old):
            return new + hf_key[len(old) :]
    raise AssertionError(f"unexpected HF key {hf_key}")


def _copy_ckpt(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _as_saved(state: dict, key: str) -> str:
    """A published-layout key as the installed transformers' save_pretrained spells it in `state` (5.17 nests
    the text model once more: language_model.model.model.*)."""
    nested = key.replace("language_model.model.", "language_model.model.model.", 1)
    return key if key in state or nested not in state else nested


# ---------------------------------------------------------------- the happy paths


def test_unsharded_checkpoint_loads_every_hf_parameter_unchanged(hf_dir, hf_model):
    ours, source, tekken = load_checkpoint(hf_dir)
    theirs = {_ours_name(k): v for k, v in hf_model.state_dict().items()}
    mine = ours.to_hf_layout(ours.state_dict())  # q/k/v and gate/up are fused in ours: split back
    assert set(mine) == set(theirs)
    assert "language_model.model.layers.0.self_attn.qkv_proj.weight" in ours.state_dict()
    for k, v in theirs.items():
        assert torch.equal(mine[k], v), k
    assert source.kind == "checkpoint" and source.name == hf_dir.name and len(source.weights_digest) == 64
    assert tekken == hf_dir / "tekken.json"


def test_sharded_checkpoint_loads_the_same_weights_as_unsharded(hf_dir, hf_model, tmp_path):
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="200KB")
    shutil.copyfile(hf_dir / "tekken.json", sharded / "tekken.json")
    assert (sharded / "model.safetensors.index.json").is_file()
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) >= 3, shards
    a, src_a, _ = load_checkpoint(hf_dir)
    b, src_b, _ = load_checkpoint(sharded)
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert src_a.weights_digest != src_b.weights_digest  # the digest is of the files, not the tensors


def test_sharded_checkpoint_with_a_missing_shard_is_an_export_error(hf_dir, hf_model, tmp_path):
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="200KB")
    shutil.copyfile(hf_dir / "tekken.json", sharded / "tekken.json")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ExportError, match=victim.name):
        load_checkpoint(sharded)


def test_malformed_shard_index_is_an_export_error(hf_dir, hf_model, tmp_path):
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="200KB")
    shutil.copyfile(hf_dir / "tekken.json", sharded / "tekken.json")
    (sharded / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ExportError, match="model.safetensors.index.json"):
        load_checkpoint(sharded)


def test_transformers5_in_memory_key_names_normalise(hf_dir, hf_model, tmp_path):
    """transformers 5 names keys as the in-memory model does: model.audio_tower.*, model.language_model.*,
    model.multi_modal_projector.*, lm_head.weight. They must load to the same weights."""
    ckpt = tmp_path / "t5"
    ckpt.mkdir()
    for name in ("config.json", "tekken.json"):
        shutil.copyfile(hf_dir / name, ckpt / name)
    hf_state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "lm_head.weight" in hf_state and any(k.startswith("model.audio_tower.") for k in hf_state)
    assert any(k.startswith("model.language_model.") for k in hf_state)
    save_file(hf_state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    ours, _, _ = load_checkpoint(ckpt)
    reference, _, _ = load_checkpoint(hf_dir)
    for k, v in reference.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k


def test_bf16_checkpoint_loads_and_casts_to_requested_dtype(hf_dir, tmp_path):
    ckpt = _copy_ckpt(hf_dir, tmp_path / "bf16")
    state = load_file(str(ckpt / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(ckpt / "model.safetensors"))
    model, _, _ = load_checkpoint(ckpt, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ref, _, _ = load_checkpoint(hf_dir)
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v.to(torch.bfloat16)), k


# ---------------------------------------------------------------- wrong weights: one error listing them all


def _rewrite_weights(ckpt: Path, edit) -> None:
    state = load_file(str(ckpt / "model.safetensors"))
    edit(state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(ckpt / "model.safetensors"))


def test_missing_unexpected_and_misshaped_keys_are_one_error_naming_each(hf_dir, tmp_path):
    ckpt = _copy_ckpt(hf_dir, tmp_path / "bad")
    saved = load_file(str(ckpt / "model.safetensors"))
    missing = _as_saved(saved, "language_model.model.layers.1.mlp.up_proj.weight")
    text_prefix = missing.removesuffix("layers.1.mlp.up_proj.weight")  # as this transformers spells it
    unexpected = text_prefix + "layers.7.self_attn.rotary_emb.inv_freq"
    misshaped = "audio_tower.layers.0.fc1.weight"

    def edit(s):
        del s[missing]
        s[unexpected] = torch.zeros(8)
        s[misshaped] = torch.zeros(3, 5)

    _rewrite_weights(ckpt, edit)
    with pytest.raises(ExportError) as e:
        load_checkpoint(ckpt)
    msg = str(e.value)
    assert missing in msg and unexpected in msg and misshaped in msg
    assert "missing" in msg and "unexpected" in msg and "wrong shape" in msg
    assert "[3, 5]" in msg and "[256, 64]" in msg  # the shape found and the shape the config wants
    assert str(ckpt) in msg


@pytest.mark.parametrize("kind", ["missing", "unexpected", "wrong shape"])
def test_each_kind_of_mismatch_alone_is_an_export_error(hf_dir, tmp_path, kind):
    ckpt = _copy_ckpt(hf_dir, tmp_path / "bad")
    key = "multi_modal_projector.linear_2.weight"

    def edit(s):
        if kind == "missing":
            del s[key]
        elif kind == "unexpected":
            s["multi_modal_projector.linear_3.weight"] = torch.zeros(2, 2)
        else:
            s[key] = torch.zeros(64, 63)

    _rewrite_weights(ckpt, edit)
    with pytest.raises(ExportError, match=kind) as e:
        load_checkpoint(ckpt)
    assert ("linear_3" if kind == "unexpected" else key) in str(e.value)


def test_many_missing_keys_are_counted(hf_dir, tmp_path):
    ckpt = _copy_ckpt(hf_dir, tmp_path / "bad")
    layer = _as_saved(
        load_file(str(ckpt / "model.safetensors")), "language_model.model.layers.1.input_layernorm.weight"
    )
    _rewrite_weights(ckpt, lambda s: [s.pop(k) for k in list(s) if k.startswith(layer.split("input_layernorm")[0])])
    with pytest.raises(ExportError, match=r"missing: .*\(9\)"):  # 7 linears + 2 norms in one decoder layer
        load_checkpoint(ckpt)


def test_checkpoint_for_another_config_is_an_export_error(hf_dir, tmp_path):
    """The weights of the tiny model under the 'other' config.json: every width is wrong."""
    ckpt = _copy_ckpt(hf_dir, tmp_path / "mixed")
    other = save_hf_checkpoint(tmp_path / "other", OTHER_HF_CONFIG)
    shutil.copyfile(other / "config.json", ckpt / "config.json")
    with pytest.raises(ExportError, match="wrong shape"):
        load_checkpoint(ckpt)


# ---------------------------------------------------------------- missing or unreadable files


def test_missing_config_json_is_an_export_error(hf_dir, tmp_path):
    ckpt = _copy_ckpt(hf_dir, tmp_path / "c")
    (ckpt / "config.json").unlink()
    with pytest.raises(ExportError, match="missing config.json"):
        load_checkpoint(ckpt)


def test_missing_tekken_json_is_an_export_error(hf_dir, tmp_path):
    ckpt = _copy_ckpt(hf_dir, tmp_path / "c")
    (ckpt / "tekken.json").unlink()
    with pytest.raises(ExportError, match="missing tekken.json"):
        load_checkpoint(ckpt)


def test_missing_directory_is_an_export_error(tmp_path):
    with pytest.raises(ExportError, match="not found"):
        load_checkpoint(tmp_path / "nope")


def test_pickle_only_checkpoint_is_refused_with_a_hint(hf_dir, tmp_path):
    ckpt = _copy_ckpt(hf_dir, tmp_path / "c")
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ExportError) as e:
        load_checkpoint(ckpt)
    assert "no .safetensors" in str(e.value) and "pytorch_model.bin" in str(e.value)


def test_no_weights_at_all_is_an_export_error(hf_dir, tmp_path):
    ckpt = _copy_ckpt(hf_dir, tmp_path / "c")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ExportError, match="no .safetensors"):
        load_checkpoint(ckpt)


def test_corrupt_safetensors_is_an_export_error(hf_dir, tmp_path):
    ckpt = _copy_ckpt(hf_dir, tmp_path / "c")
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ExportError, match="model.safetensors"):
        load_checkpoint(ckpt)


def test_unreadable_config_json_is_an_export_error(hf_dir, tmp_path):
    ckpt = _copy_ckpt(hf_dir, tmp_path / "c")
    (ckpt / "config.json").write_text("{ nope")
    with pytest.raises(ExportError, match="config.json"):
        load_checkpoint(ckpt)


# ---------------------------------------------------------------- config conversion


def test_tiny_fixture_config_is_the_tiny_preset():
    assert VoxtralConfig.from_hf_file(FIXTURES / "voxtral-tiny" / "config.json") == PRESETS["tiny"]


def test_transformers_default_config_is_the_voxtral_mini_preset():
    from transformers import VoxtralConfig as HFVoxtralConfig

    assert VoxtralConfig.from_hf(HFVoxtralConfig().to_dict()) == PRESETS["voxtral-mini-3b"]


def test_other_config_converts_every_field():
    from transformers import VoxtralConfig as HFVoxtralConfig

    hf = HFVoxtralConfig(**json.loads(json.dumps(OTHER_HF_CONFIG))).to_dict()
    c = VoxtralConfig.from_hf(hf)
    assert c.audio == AudioConfig(n_mels=128, dim=32, n_layers=1, n_heads=4, ffn_dim=128, max_source_positions=1500)
    assert c.text == TextConfig(
        vocab_size=1024,
        dim=48,
        ffn_dim=96,
        n_layers=3,
        n_heads=6,
        n_kv_heads=3,
        head_dim=8,
        rope_theta=5e5,
        norm_eps=1e-5,
    )
    assert c.audio_token_id == 24
    assert VoxtralConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_legacy_rope_theta_spelling_is_read():
    """transformers 4.5x wrote rope_theta at the top of text_config, without rope_parameters."""
    hf = json.loads(json.dumps(TINY_HF_CONFIG))
    del hf["text_config"]["rope_parameters"]
    hf["text_config"]["rope_theta"] = 12345.0
    assert VoxtralConfig.from_hf(hf).text.rope_theta == 12345.0


@pytest.mark.parametrize(
    "patch, needle",
    [
        ({"text_config": {"tie_word_embeddings": True}}, "tied"),
        ({"text_config": {"hidden_act": "gelu"}}, "Llama"),
        ({"text_config": {"attention_bias": True}}, "Llama"),
        ({"text_config": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}}, "llama3"),
        ({"audio_config": {"activation_function": "relu"}}, "GELU"),
        ({"audio_config": {"intermediate_size": 100}}, "ffn_dim"),
        ({"text_config": {"num_key_value_heads": 3}}, "head counts"),
    ],
)
def test_unsupported_configs_are_export_errors(patch, needle):
    hf = json.loads(json.dumps(TINY_HF_CONFIG))
    for section, fields in patch.items():
        hf[section].update(fields)
    with pytest.raises(ExportError, match=needle):
        VoxtralConfig.from_hf(hf)
