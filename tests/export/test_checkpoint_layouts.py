"""Every real layout a Voxtral checkpoint comes in loads to the same model as transformers' on the same weights:
the published HF files, what save_pretrained writes (transformers 5.17 nests the text model once more; 5.25
writes the published layout: measured, and run under both by `nox -s compat`), transformers-5 in-memory
names, and Mistral's own params.json + consolidated.safetensors. Anything else is the one error listing the
unknown and missing keys, named as the file names them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, OTHER_HF_CONFIG
from safetensors.torch import load_file, save_file

from runner.errors import ExportError
from runner.export import mistral_format
from runner.export.checkpoint import load_checkpoint
from runner.families.voxtral import Tekken
from runner.models.voxtral import AudioEncoderMethod, TokenEmbeddingMethod
from runner.models.voxtral_config import VoxtralConfig

ATOL = 5e-5  # as tests/export/test_model_parity.py: ~10x the worst fp32 difference measured against transformers

# transformers 5 in-memory name -> the published file's name (what mistralai/Voxtral-Mini-3B-2507's
# model-*.safetensors use; DESIGN.md §3; transformers' conversion_mapping "qwen2_audio" renames them back)
PUBLISHED = (
    ("model.audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)

# transformers' convert_voxtral_weights_to_hf.py STATE_DICT_MAPPING (Mistral -> HF), inverted here to write
# Mistral's format: (HF published name pattern, Mistral name).
TO_MISTRAL = (
    (r"language_model\.lm_head\.weight", r"output.weight"),
    (r"language_model\.model\.norm\.weight", r"norm.weight"),
    (r"language_model\.model\.embed_tokens\.weight", r"mm_whisper_embeddings.tok_embeddings.weight"),
    (r"language_model\.model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attention_norm.weight"),
    (r"language_model\.model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
    (r"language_model\.model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.weight", r"layers.\1.attention.w\2.weight"),
    (r"language_model\.model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"layers.\1.feed_forward.w1.weight"),
    (r"language_model\.model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"layers.\1.feed_forward.w2.weight"),
    (r"language_model\.model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"layers.\1.feed_forward.w3.weight"),
    (r"audio_tower\.conv1\.(weight|bias)", r"mm_whisper_embeddings.whisper_encoder.conv_layers.0.\1"),
    (r"audio_tower\.conv2\.(weight|bias)", r"mm_whisper_embeddings.whisper_encoder.conv_layers.1.\1"),
    (r"audio_tower\.layer_norm\.(weight|bias)", r"mm_whisper_embeddings.whisper_encoder.transformer.norm.\1"),
    (
        r"audio_tower\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)",
        r"mm_whisper_embeddings.whisper_encoder.transformer.layers.\1.attention.w\2.\3",
    ),
    (
        r"audio_tower\.layers\.(\d+)\.self_attn\.out_proj\.(weight|bias)",
        r"mm_whisper_embeddings.whisper_encoder.transformer.layers.\1.attention.wo.\2",
    ),
    (
        r"audio_tower\.layers\.(\d+)\.self_attn_layer_norm\.(weight|bias)",
        r"mm_whisper_embeddings.whisper_encoder.transformer.layers.\1.attention_norm.\2",
    ),
    (
        r"audio_tower\.layers\.(\d+)\.fc1\.(weight|bias)",
        r"mm_whisper_embeddings.whisper_encoder.transformer.layers.\1.feed_forward.w1.\2",
    ),
    (
        r"audio_tower\.layers\.(\d+)\.fc2\.(weight|bias)",
        r"mm_whisper_embeddings.whisper_encoder.transformer.layers.\1.feed_forward.w2.\2",
    ),
    (
        r"audio_tower\.layers\.(\d+)\.final_layer_norm\.(weight|bias)",
        r"mm_whisper_embeddings.whisper_encoder.transformer.layers.\1.ffn_norm.\2",
    ),
    (r"multi_modal_projector\.linear_1\.weight", r"mm_whisper_embeddings.audio_language_projection.0.weight"),
    (r"multi_modal_projector\.linear_2\.weight", r"mm_whisper_embeddings.audio_language_projection.2.weight"),
)


def _published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    def name(k):
        return next(new + k[len(old) :] for old, new in PUBLISHED if k.startswith(old))

    return {name(k): v.contiguous() for k, v in state.items()}


def _pairs_from_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of the convert script's permute_for_rope: HF's rotary halves back to Mistral's pairs."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_mistral(state: dict[str, torch.Tensor], text) -> dict[str, torch.Tensor]:
    """A published-layout state -> Mistral's consolidated.safetensors (no embed_positions: Mistral omits them)."""
    out = {}
    for k, v in state.items():
        if k == "audio_tower.embed_positions.weight":
            continue
        new = next(re.sub(p, r, k) for p, r in TO_MISTRAL if re.fullmatch(p, k))
        if re.fullmatch(r"language_model\.model\.layers\.\d+\.self_attn\.q_proj\.weight", k):
            v = _pairs_from_halves(v, text.num_attention_heads)
        elif re.fullmatch(r"language_model\.model\.layers\.\d+\.self_attn\.k_proj\.weight", k):
            v = _pairs_from_halves(v, text.num_key_value_heads)
        out[new] = v.contiguous()
    return out


def to_params(config) -> dict:
    """params.json for an HF VoxtralConfig: convert_config's mapping read backwards (+ the fields vLLM reads)."""
    t, a = config.text_config, config.audio_config
    return {
        "dim": t.hidden_size, "n_layers": t.num_hidden_layers, "head_dim": t.head_dim,
        "hidden_dim": t.intermediate_size, "n_heads": t.num_attention_heads, "n_kv_heads": t.num_key_value_heads,
        "rope_theta": t.rope_parameters["rope_theta"], "norm_eps": t.rms_norm_eps, "vocab_size": t.vocab_size,
        "max_position_embeddings": 32768,
        "multimodal": {
            "whisper_model_args": {
                "encoder_args": {
                    "audio_encoding_args": {
                        "sampling_rate": 16000, "frame_rate": 12.5, "num_mel_bins": a.num_mel_bins,
                        "hop_length": 160, "window_size": 400, "chunk_length_s": 30.0,
                    },
                    "dim": a.hidden_size, "n_layers": a.num_hidden_layers, "head_dim": a.hidden_size // a.num_attention_heads,
                    "hidden_dim": a.intermediate_size, "n_heads": a.num_attention_heads, "vocab_size": 51866,
                    "max_source_positions": a.max_source_positions,
                },
                "downsample_args": {"downsample_factor": 4},
            }
        },
    }  # fmt: skip


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """transformers' model at unit gain (std 0.02 makes every layer nearly the identity), with Whisper's
    sinusoidal positions as the real checkpoint has them, saved by the installed transformers."""
    from transformers import VoxtralConfig as HFConfig
    from transformers import VoxtralForConditionalGeneration
    from transformers.models.whisper.modeling_whisper import sinusoids

    torch.manual_seed(21)
    model = VoxtralForConditionalGeneration(HFConfig(**json.loads(json.dumps(OTHER_HF_CONFIG)))).eval()
    g = torch.Generator().manual_seed(22)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
        pos = model.model.audio_tower.embed_positions.weight
        pos.copy_(sinusoids(*pos.shape))
    saved = tmp_path_factory.mktemp("layouts") / "save_pretrained"
    model.save_pretrained(saved)
    shutil.copyfile(FIXTURES / "tekken.json", saved / "tekken.json")
    return model, saved


def _write(dest: Path, hf_dir: Path, weights: dict[str, torch.Tensor], name="model.safetensors") -> Path:
    dest.mkdir(parents=True)
    for f in ("config.json", "tekken.json"):
        shutil.copyfile(hf_dir / f, dest / f)
    save_file(weights, str(dest / name), metadata={"format": "pt"})
    return dest


def write_layout(layout: str, hf, dest: Path) -> Path:
    model, saved = hf
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if layout == "save_pretrained":
        return saved
    if layout == "in-memory":
        return _write(dest, saved, {k: v.contiguous() for k, v in state.items()})
    published = _published(state)
    if layout == "published":
        return _write(dest, saved, published)
    if layout == "transformers-5.17":
        nested = {
            re.sub(r"^language_model\.model\.", "language_model.model.model.", k): v for k, v in published.items()
        }
        return _write(dest, saved, nested)
    assert layout == "mistral"
    dest.mkdir(parents=True)
    (dest / "params.json").write_text(json.dumps(to_params(model.config), indent=2))
    shutil.copyfile(FIXTURES / "tekken.json", dest / "tekken.json")
    save_file(to_mistral(published, model.config.text_config), str(dest / "consolidated.safetensors"))
    return dest


def _last_logits_ours(ours, input_ids, mel) -> torch.Tensor:
    audio_id = ours.config.audio_token_id
    with torch.no_grad():
        embeds = TokenEmbeddingMethod(ours)(input_ids)
        where = (input_ids[0] == audio_id).nonzero()[:, 0]
        embeds[0, where] = AudioEncoderMethod(ours)(mel)[0]
        ours.setup_caches(input_ids.shape[1] + 1)
        return ours.decoder()(embeds, torch.arange(input_ids.shape[1]))


def _prompt_and_mel():
    tok = Tekken.from_file(FIXTURES / "tekken.json")
    s = tok.special_id
    ids = [tok.bos_id, s("[INST]"), s("[BEGIN_AUDIO]"), *[s("[AUDIO]")] * 375, s("[/INST]"), s("[TRANSCRIBE]")]
    mel = torch.randn(1, 128, 3000, generator=torch.Generator().manual_seed(23)) * 0.7
    return torch.tensor([ids]), mel


LAYOUTS = ["save_pretrained", "published", "transformers-5.17", "in-memory", "mistral"]


@pytest.fixture(scope="module")
def hf_logits(hf) -> torch.Tensor:
    input_ids, mel = _prompt_and_mel()
    with torch.no_grad():
        return hf[0](input_ids=input_ids, input_features=mel).logits[:, -1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_loads_transformers_weights_and_logits(hf, hf_logits, layout, tmp_path):
    model, _ = hf
    ckpt = write_layout(layout, hf, tmp_path / layout)
    ours, source, tekken = load_checkpoint(ckpt)
    assert tekken == ckpt / "tekken.json" and source.kind == "checkpoint"
    theirs = _published(dict(model.state_dict()))
    mine = ours.to_hf_layout(ours.state_dict())
    assert set(mine) == set(theirs)
    for k, v in theirs.items():
        # Mistral's file has no positions: ours are computed, as the HF conversion computed the published ones
        assert torch.equal(mine[k], v), k
    got = _last_logits_ours(ours, *_prompt_and_mel())
    assert hf_logits.abs().max() > 1.0
    assert (got - hf_logits).abs().max().item() <= ATOL


def test_the_installed_transformers_writes_a_layout_we_name(hf):
    """save_pretrained's layout is one of ours: 5.17 nests the text model (language_model.model.model.*), 5.25
    writes the published one. A new transformers that writes yet another one fails here first."""
    _, saved = hf
    keys = set(load_file(str(saved / "model.safetensors")))
    published = set(_published(dict(hf[0].state_dict())))
    nested = {re.sub(r"^language_model\.model\.", "language_model.model.model.", k) for k in published}
    assert keys in (published, nested)


def test_unknown_layout_is_one_error_listing_unknown_and_missing_keys(hf, tmp_path):
    model, saved = hf
    odd = {"backbone." + k: v.contiguous() for k, v in model.state_dict().items()}
    ckpt = _write(tmp_path / "odd", saved, odd)
    with pytest.raises(ExportError) as e:
        load_checkpoint(ckpt)
    msg = str(e.value)
    assert "missing: " in msg and "unexpected: " in msg and str(ckpt) in msg
    assert "unexpected: backbone." in msg  # named as the file names them
    assert f"({len(odd)})" in msg  # every key of the file is unknown, every key of ours missing


def test_errors_in_the_517_layout_name_keys_as_the_file_does(hf, tmp_path):
    model, saved = hf
    ckpt = write_layout("transformers-5.17", hf, tmp_path / "t517")
    state = load_file(str(ckpt / "model.safetensors"))
    gone = "language_model.model.model.layers.1.mlp.up_proj.weight"
    stray = "language_model.model.model.layers.2.self_attn.rotary_emb.inv_freq"
    del state[gone]
    state[stray] = torch.zeros(4)
    save_file(state, str(ckpt / "model.safetensors"))
    with pytest.raises(ExportError) as e:
        load_checkpoint(ckpt)
    msg = str(e.value)
    assert f"missing: {gone} (1)" in msg and f"unexpected: {stray} (1)" in msg


def test_hf_files_win_over_mistral_files_in_one_directory(hf, tmp_path):
    """The hub repository holds both; the HF files are read (the consolidated file here is not even valid)."""
    ckpt = write_layout("published", hf, tmp_path / "both")
    (ckpt / "params.json").write_text(json.dumps(to_params(hf[0].config)))
    (ckpt / "consolidated.safetensors").write_bytes(b"\xff" * 64)
    ours, _, _ = load_checkpoint(ckpt)
    ref, _, _ = load_checkpoint(write_layout("mistral", hf, tmp_path / "mistral"))
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k


# ---------------------------------------------------------------- Mistral's format in detail


def test_mistral_rotary_layout_is_what_meta_rotary_expects(hf):
    """Independent of both converters: Mistral's q/k rows with rotary applied to interleaved pairs (as
    mistral-inference does, complex multiply) give the attention scores transformers gets from its rows with
    rotate_half. Without the permutation they do not."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    model, _ = hf
    t = model.config.text_config
    hd, H, KV = t.head_dim, t.num_attention_heads, t.num_key_value_heads
    published = _published(dict(model.state_dict()))
    mistral = to_mistral(published, t)
    wq_hf, wk_hf = (published[f"language_model.model.layers.0.self_attn.{p}_proj.weight"] for p in "qk")
    wq_m, wk_m = mistral["layers.0.attention.wq.weight"], mistral["layers.0.attention.wk.weight"]
    S = 7
    x = torch.randn(S, t.hidden_size, generator=torch.Generator().manual_seed(24))
    pos = torch.arange(S)

    def meta(w, heads):  # mistral-inference's apply_rotary_emb
        theta = t.rope_parameters["rope_theta"]
        freqs = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
        cis = torch.polar(torch.ones(S, hd // 2), torch.outer(pos.float(), freqs))
        z = torch.view_as_complex((x @ w.T).view(S, heads, hd // 2, 2))
        return torch.view_as_real(z * cis[:, None]).flatten(-2)  # [S, heads, hd]

    cos, sin = LlamaRotaryEmbedding(config=t)(x, pos[None])
    q_h, k_h = (x @ wq_hf.T).view(1, S, H, hd).transpose(1, 2), (x @ wk_hf.T).view(1, S, KV, hd).transpose(1, 2)
    q_h, k_h = apply_rotary_pos_emb(q_h, k_h, cos, sin)

    def scores(q, k):  # q [H, S, hd], k [KV, S, hd]
        return q @ k.repeat_interleave(H // KV, dim=0).transpose(1, 2)

    want = scores(q_h[0], k_h[0])
    got = scores(meta(wq_m, H).transpose(0, 1), meta(wk_m, KV).transpose(0, 1))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    unpermuted = scores(meta(wq_hf, H).transpose(0, 1), meta(wk_hf, KV).transpose(0, 1))
    assert (unpermuted - want).abs().max() > 0.1


def test_mistral_positions_are_whispers_sinusoids():
    from transformers.models.whisper.modeling_whisper import sinusoids

    assert torch.equal(mistral_format.sinusoids(1500, 1280), sinusoids(1500, 1280))


def test_params_json_converts_to_the_hf_config(hf):
    model, _ = hf
    got = mistral_format.config_from_params(to_params(model.config), audio_token_id=24)
    assert got == VoxtralConfig.from_hf(model.config.to_dict())


def _params_dir(hf, tmp_path, edit) -> Path:
    ckpt = write_layout("mistral", hf, tmp_path / "m")
    params = json.loads((ckpt / "params.json").read_text())
    edit(params)
    (ckpt / "params.json").write_text(json.dumps(params))
    return ckpt


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda p: p.pop("n_kv_heads"), "params.json: missing n_kv_heads"),
        (lambda p: p["multimodal"]["whisper_model_args"]["encoder_args"].pop("dim"), "encoder_args.dim"),
        (lambda p: p["multimodal"]["whisper_model_args"]["encoder_args"].update(causal=True), "Realtime"),
        (lambda p: p["multimodal"]["whisper_model_args"].update(downsample_args={"downsample_factor": 8}), "8"),
        (lambda p: p.pop("multimodal"), "not an audio"),
        (lambda p: p.update(tied_embeddings=True), "tied"),
        (lambda p: p.update(sliding_window=4096), "sliding"),
    ],
)
def test_unsupported_params_json_is_one_error(hf, tmp_path, edit, needle):
    ckpt = _params_dir(hf, tmp_path, edit)
    with pytest.raises(ExportError, match=needle) as e:
        load_checkpoint(ckpt)
    assert str(ckpt) in str(e.value)


def test_mistral_key_errors_name_mistral_keys(hf, tmp_path):
    ckpt = write_layout("mistral", hf, tmp_path / "m")
    state = load_file(str(ckpt / "consolidated.safetensors"))
    del state["layers.1.feed_forward.w3.weight"]
    state["layers.1.attention.wq.bias"] = torch.zeros(48)
    state["layers.0.attention.wk.weight"] = torch.zeros(5, 48)
    save_file(state, str(ckpt / "consolidated.safetensors"))
    with pytest.raises(ExportError) as e:
        load_checkpoint(ckpt)
    msg = str(e.value)
    assert "missing: layers.1.feed_forward.w3.weight (1)" in msg
    assert "unexpected: layers.1.attention.wq.bias (1)" in msg
    assert "layers.0.attention.wk.weight [5, 48] (want [24, 48])" in msg
