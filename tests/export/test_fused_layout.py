"""models/fused.py: transformers' separate q/k/v and gate/up projections <-> our fused ones, for Voxtral's decoder
and (since session 26) its audio encoder, whose fused bias has zero key rows that transformers' layout does not
show (Whisper's key projection has no bias)."""

from __future__ import annotations

import torch

from runner.models.voxtral import Voxtral
from runner.models.voxtral_config import preset

ENC = "audio_tower.layers.0.self_attn."


def tiny() -> Voxtral:
    return Voxtral(preset("tiny")).init_weights(seed=5)


def test_the_hf_layout_splits_the_encoders_qkv_and_drops_only_the_key_bias():
    m = tiny()
    state = m.state_dict()
    hf = m.to_hf_layout(state)
    d = m.config.audio.dim
    assert ENC + "qkv_proj.weight" not in hf and ENC + "qkv_proj.bias" not in hf
    assert [hf[ENC + f"{p}_proj.weight"].shape for p in "qkv"] == [(d, d)] * 3
    assert ENC + "k_proj.bias" not in hf and hf[ENC + "q_proj.bias"].shape == (d,)
    assert torch.equal(hf[ENC + "v_proj.weight"], state[ENC + "qkv_proj.weight"][2 * d :])
    assert torch.equal(m.from_hf_layout(hf)[ENC + "qkv_proj.weight"], state[ENC + "qkv_proj.weight"])


def test_a_checkpoint_without_a_key_bias_gets_zero_key_rows():
    m = tiny()
    hf = m.to_hf_layout(m.state_dict())
    d = m.config.audio.dim
    q_bias, v_bias = torch.randn(d), torch.randn(d)
    hf[ENC + "q_proj.bias"], hf[ENC + "v_proj.bias"] = q_bias, v_bias
    bias = m.from_hf_layout(hf)[ENC + "qkv_proj.bias"]
    assert torch.equal(bias, torch.cat([q_bias, torch.zeros(d), v_bias]))


def test_a_fused_key_whose_parts_are_missing_is_left_for_the_report():
    m = tiny()
    hf = m.to_hf_layout(m.state_dict())
    del hf[ENC + "q_proj.weight"], hf[ENC + "q_proj.bias"]
    ours = m.from_hf_layout(hf)
    assert ENC + "qkv_proj.weight" not in ours and ENC + "qkv_proj.bias" not in ours
    assert ENC + "k_proj.weight" in ours and ENC + "k_proj.bias" not in ours  # nothing made up for a missing q


def test_the_fused_encoder_attention_is_the_three_projections():
    """The encoder's attention with q, k and v through one matmul equals the three of transformers' layout."""
    m = tiny()
    attn = m.audio_tower.layers[0].self_attn
    hf = m.to_hf_layout(dict(attn.named_parameters(prefix=ENC[:-1])))
    x = torch.randn(2, 7, m.config.audio.dim)
    q, k, v = (x @ hf[ENC + f"{p}_proj.weight"].T for p in "qkv")
    q, v = q + hf[ENC + "q_proj.bias"], v + hf[ENC + "v_proj.bias"]
    heads = lambda t: t.view(2, 7, attn.n_heads, -1).transpose(1, 2)  # noqa: E731
    y = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v)).transpose(1, 2).reshape(2, 7, -1)
    torch.testing.assert_close(attn(x), attn.out_proj(y))
