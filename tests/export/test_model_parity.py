"""Our eager Voxtral (runner/export/model.py) against transformers' VoxtralForConditionalGeneration, fp32.

Both read the same checkpoint, written by transformers' save_pretrained. transformers initialises with std 0.02,
which makes every layer nearly the identity and attention nearly uniform (a wrong rope theta or mask would hide
in the noise); so the weights are re-drawn at unit gain, with non-trivial norm scales and biases, and saved again
through save_pretrained. Measured max |ours - HF| (logits of magnitude ~4, torch 2.13 CPU): 2.6e-6 - 5.6e-6 over
all prefill positions, 1.2e-6 - 2.3e-6 for a decode step, 1.2e-6 - 3.1e-6 on the audio embeddings; a wrong rope
theta alone moves the logits by 0.2 - 0.6.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, OTHER_HF_CONFIG, save_hf_checkpoint

from runner.audio import TOKENS_PER_CHUNK
from runner.export.checkpoint import load_checkpoint
from runner.families.voxtral.tokenizer import Tekken
from runner.models.voxtral import AudioEncoderMethod, TokenEmbeddingMethod

ATOL = 5e-5  # ~10x the worst error measured here (5.6e-6, other config, eager attention); logits ~4
CONFIGS = {
    "tiny": json.loads((FIXTURES / "voxtral-tiny" / "config.json").read_text()),
    "other": OTHER_HF_CONFIG,
}


def _spice(ckpt: Path, seed: int):
    """Re-draw every weight at unit gain (1/sqrt(fan_in)), norms ~1 +- 0.1, biases ~0 +- 0.1; save_pretrained."""
    from transformers import VoxtralForConditionalGeneration

    hf = VoxtralForConditionalGeneration.from_pretrained(ckpt)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
    hf.save_pretrained(ckpt)


class Pair:
    def __init__(self, ckpt: Path, attn: str):
        from transformers import VoxtralForConditionalGeneration

        self.hf = VoxtralForConditionalGeneration.from_pretrained(ckpt, attn_implementation=attn).eval()
        self.ours, _, tekken = load_checkpoint(ckpt)
        self.tok = Tekken.from_file(tekken)
        self.audio_id = self.tok.special_id("[AUDIO]")

    def prompt(self, n_chunks: int, text: str = "What is said here?") -> torch.Tensor:
        t = self.tok
        ids = (
            [t.bos_id, t.special_id("[INST]"), t.special_id("[BEGIN_AUDIO]")]
            + [self.audio_id] * TOKENS_PER_CHUNK * n_chunks
            + t.encode(text)
            + [t.special_id("[/INST]")]
        )
        return torch.tensor([ids])

    def prefill_embeds(self, input_ids: torch.Tensor, mel: torch.Tensor) -> torch.Tensor:
        """Our path: the audio_encoder method on mel, token embeddings, audio embeddings scattered at the [AUDIO] positions."""
        embeds = TokenEmbeddingMethod(self.ours)(input_ids)
        audio = AudioEncoderMethod(self.ours)(mel)
        where = (input_ids[0] == self.audio_id).nonzero()[:, 0]
        assert audio.shape == (1, len(where), embeds.shape[-1])
        embeds[0, where] = audio[0]
        return embeds


@pytest.fixture(scope="module", params=[("tiny", "eager"), ("other", "sdpa")], ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tmp_path_factory) -> Pair:
    name, attn = request.param
    ckpt = save_hf_checkpoint(tmp_path_factory.mktemp("parity") / name, CONFIGS[name], seed=3)
    _spice(ckpt, seed=5)
    return Pair(ckpt, attn)


def _mel(n_chunks: int, seed: int) -> torch.Tensor:
    # log-mel features live in roughly [-1.5, 1.5]
    return torch.randn(n_chunks, 128, 3000, generator=torch.Generator().manual_seed(seed)) * 0.7


def _all_position_logits(ours, embeds: torch.Tensor) -> torch.Tensor:
    """Logits at every position through our TextDecoder.forward (its own mask and rope): the last layer's
    output is caught with a hook, then normed and projected (forward itself keeps only the last position)."""
    decoder = ours.decoder()
    caught = {}
    hook = decoder.layers[-1].register_forward_hook(lambda mod, args, out: caught.__setitem__("h", out))
    try:
        last = decoder(embeds, torch.arange(embeds.shape[1]))
    finally:
        hook.remove()
    every = decoder.lm_head(decoder.norm(caught["h"])).float()
    torch.testing.assert_close(every[:, -1], last, rtol=0, atol=ATOL / 10)  # same math, other GEMM shape
    return every


def _cache_kw(hf) -> str:
    """transformers 5.2x renamed past_key_values to cache; 5.17 silently ignores `cache=` (runs uncached)."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def _hf_cache(out):
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


@pytest.mark.parametrize("n_chunks", [1, 2])
def test_audio_embeddings_match_transformers(pair, n_chunks):
    mel = _mel(n_chunks, seed=n_chunks)
    with torch.no_grad():
        theirs = pair.hf.get_audio_features(mel, return_dict=True).pooler_output
        ours = AudioEncoderMethod(pair.ours)(mel)
    theirs = theirs.reshape(ours.shape)
    err = (ours - theirs).abs().max().item()
    assert err <= ATOL, f"audio embeddings differ by {err:.3g}"
    assert ours.shape == (1, n_chunks * TOKENS_PER_CHUNK, pair.ours.config.text.dim)


@pytest.mark.parametrize("n_chunks", [1, 2])
def test_prefill_logits_match_transformers_at_every_position(pair, n_chunks):
    input_ids, mel = pair.prompt(n_chunks), _mel(n_chunks, seed=10 + n_chunks)
    S = input_ids.shape[1]
    with torch.no_grad():
        theirs = pair.hf(input_ids=input_ids, input_features=mel).logits
        pair.ours.setup_caches(S + 4)
        ours = _all_position_logits(pair.ours, pair.prefill_embeds(input_ids, mel))
    assert ours.shape == theirs.shape == (1, S, pair.ours.config.text.vocab_size)
    assert theirs.abs().max() > 1.0  # not a degenerate comparison of near-zero logits
    err = (ours - theirs).abs().max().item()
    assert err <= ATOL, f"logits differ by {err:.3g} (worst at position {(ours - theirs).abs().amax(-1).argmax()})"
    # the audio positions matter: without the scatter, the last logits move far beyond the tolerance
    with torch.no_grad():
        pair.ours.reset_caches()
        blind = pair.ours.decoder()(TokenEmbeddingMethod(pair.ours)(input_ids), torch.arange(S))
    assert (blind - theirs[:, -1]).abs().max() > 100 * ATOL


@pytest.mark.parametrize("n_chunks", [1, 2])
def test_text_decoder_last_logits_and_decode_steps_match_transformers_kv_cache(pair, n_chunks):
    """Prefill (cache_position = arange(S)), then three greedy decode steps one position each, against HF's
    own KV cache and against HF recomputing the whole sequence."""
    input_ids, mel = pair.prompt(n_chunks, "Transcribe."), _mel(n_chunks, seed=20 + n_chunks)
    S = input_ids.shape[1]
    ours = pair.ours
    with torch.no_grad():
        out = pair.hf(input_ids=input_ids, input_features=mel, use_cache=True)
        ours.setup_caches(S + 8)
        decoder = ours.decoder()
        logits = decoder(pair.prefill_embeds(input_ids, mel), torch.arange(S))
        assert logits.shape == (1, ours.config.text.vocab_size) and logits.dtype == torch.float32
        err = (logits - out.logits[:, -1]).abs().max().item()
        assert err <= ATOL, f"prefill last logits differ by {err:.3g}"
        seq, cache = input_ids, _hf_cache(out)
        for step in range(3):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            assert int(logits.argmax()) == int(nxt)
            seq = torch.cat([seq, nxt], dim=1)
            logits = decoder(TokenEmbeddingMethod(ours)(nxt), torch.tensor([S + step]))
            out = pair.hf(input_ids=nxt, use_cache=True, **{_cache_kw(pair.hf): cache})
            cache = _hf_cache(out)
            err = (logits - out.logits[:, -1]).abs().max().item()
            assert err <= ATOL, f"decode step {step}: logits differ from HF's cached step by {err:.3g}"
        full = pair.hf(input_ids=seq, input_features=mel).logits[:, -1]
        err = (logits - full).abs().max().item()
        assert err <= ATOL, f"last decode step differs from HF recomputing {seq.shape[1]} tokens by {err:.3g}"


def test_decode_step_depends_on_the_kv_cache(pair):
    """A decode step after a reset cache must differ: the step above only matches because the cache holds
    the prefill."""
    input_ids, mel = pair.prompt(1), _mel(1, seed=30)
    S = input_ids.shape[1]
    ours = pair.ours
    with torch.no_grad():
        ours.setup_caches(S + 2)
        decoder = ours.decoder()
        decoder(pair.prefill_embeds(input_ids, mel), torch.arange(S))
        nxt = torch.tensor([[7]])
        warm = decoder(TokenEmbeddingMethod(ours)(nxt), torch.tensor([S]))
        ours.reset_caches()
        cold = decoder(TokenEmbeddingMethod(ours)(nxt), torch.tensor([S]))
    assert (warm - cold).abs().max() > 100 * ATOL
