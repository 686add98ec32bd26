"""Voxtral Realtime parity with transformers' VoxtralRealtimeForConditionalGeneration (fp32, CPU), on a tiny random
config used nowhere else: the streaming features, the checkpoint loader, and greedy tokens for a whole file
(transformers' generate) and for a stream (transformers' generate over a generator of feature blocks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    VoxtralRealtimeConfig,
    VoxtralRealtimeFeatureExtractor,
    VoxtralRealtimeForConditionalGeneration,
)

from runner.export.voxtral_realtime import load_checkpoint  # noqa: E402
from runner.families.voxtral_realtime import StreamSession, StreamSpec, run_whole  # noqa: E402
from runner.models.voxtral_realtime import StreamingLogMel  # noqa: E402
from runner.models.voxtral_realtime_config import (  # noqa: E402
    RealtimeAudioConfig,
    RealtimeConfig,
    RealtimeTextConfig,
)
from runner.reference.voxtral_realtime import EagerSteps  # noqa: E402

# Odd sizes on purpose (3 encoder heads, 12-dim text heads, GQA 2:1), windows short enough to wrap both rings.
CONFIG = RealtimeConfig(
    audio=RealtimeAudioConfig(dim=48, n_layers=2, n_heads=3, head_dim=16, ffn_dim=96, sliding_window=20),
    text=RealtimeTextConfig(
        vocab_size=300, dim=48, ffn_dim=80, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, sliding_window=12
    ),
    num_delay_tokens=4,
)
SPEC = StreamSpec(
    8, n_left_pad_tokens=3, n_right_pad_tokens=4 + 1 + 10, num_delay_tokens=4, bos_id=1, eos_id=2, pad_id=32
)


def _audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    tone = sum(np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) for f in rng.uniform(100, 3000, 5))
    return (0.1 * tone * (1 + np.sin(2 * np.pi * 1.3 * t)) + 0.02 * rng.standard_normal(t.shape)).astype(np.float32)


def _padded(audio: np.ndarray) -> np.ndarray:
    """mistral-common's streaming padding of a whole file."""
    spt = SPEC.samples_per_token
    right = (-len(audio)) % spt + SPEC.n_right_pad_tokens * spt
    return np.concatenate([np.zeros(SPEC.n_left_pad_tokens * spt, np.float32), audio, np.zeros(right, np.float32)])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = VoxtralRealtimeForConditionalGeneration(VoxtralRealtimeConfig(**CONFIG.to_hf()))
    hf.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # larger than the default init: decisive logits, varied tokens
        for _, p in hf.named_parameters():
            p.copy_(
                (1.0 if p.dim() == 1 else 0.0) + torch.randn(p.shape, generator=g) * (0.1 if p.dim() == 1 else 0.25)
            )
    hf.eval()
    ckpt = tmp_path_factory.mktemp("ckpt")
    hf.save_pretrained(ckpt)
    ours, _ = load_checkpoint(ckpt)  # through the HF checkpoint layout
    ours = ours.eval()
    ours.setup_caches()
    return hf, ours


def _hf_features(padded: np.ndarray, center: bool = True) -> torch.Tensor:
    fe = VoxtralRealtimeFeatureExtractor()
    return fe(padded, sampling_rate=16000, center=center, return_tensors="pt").input_features


def test_streaming_log_mel_matches_the_feature_extractor():
    padded = _padded(_audio(1.0, 0))
    want = _hf_features(padded)[0]  # [128, frames]
    mel = StreamingLogMel(128)
    buf = np.concatenate([np.zeros(200, np.float32), padded, np.zeros(200, np.float32)])
    got = torch.cat([mel(torch.from_numpy(buf[1280 * t : 1280 * t + 1520]))[0] for t in range(want.shape[1] // 8)], -1)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_checkpoint_loads_every_tensor(models):
    hf, ours = models
    want = {k.removeprefix("model."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    got = ours.to_hf_layout(ours.state_dict())  # q/k/v and gate/up are fused inside
    assert set(got) >= set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


class Recording(EagerSteps):
    """Keeps the logits of every position from the prompt's last on (those that choose a token)."""

    def __init__(self, model):
        super().__init__(model)
        self.logits = []

    def decode(self, token, audio, pos, delay):
        out = super().decode(token, audio, pos, delay)
        if int(pos) >= len(SPEC.prompt) - 1:
            self.logits.append(out)
        return out


def _hf_generate(hf, padded: np.ndarray) -> tuple[list[int], torch.Tensor]:
    prompt = torch.tensor([SPEC.prompt])
    out = hf.generate(
        input_ids=prompt,
        input_features=_hf_features(padded),
        num_delay_tokens=SPEC.num_delay_tokens,
        do_sample=False,
        eos_token_id=SPEC.eos_id,
        pad_token_id=SPEC.eos_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, prompt.shape[1] :].tolist(), torch.cat(out.logits)


@pytest.mark.parametrize("seconds", [1.0, 2.7])
def test_whole_file_tokens_equal_transformers_generate(models, seconds):
    hf, ours = models
    audio = _audio(seconds, 1)
    want, want_logits = _hf_generate(hf, _padded(audio))
    steps = Recording(ours)
    got = run_whole(steps, SPEC, audio)
    assert len(SPEC.prompt) + len(want) > CONFIG.text.sliding_window  # the decoder's ring wrapped
    assert len(set(want)) > 3  # not one token repeated: the test can tell models apart
    assert got == want
    torch.testing.assert_close(torch.cat(steps.logits), want_logits, atol=1e-4, rtol=1e-4)


def test_streamed_tokens_equal_transformers_streaming_generate(models):
    """transformers streams as its docs do: the first block (left padding, prompt's positions) with a centred
    STFT, then 8 mel frames per step from overlapping uncentred windows."""
    hf, ours = models
    audio = _audio(2.1, 2)
    padded = _padded(audio)
    n_pos = len(padded) // SPEC.samples_per_token
    first = _hf_features(padded[: (len(SPEC.prompt) * 8 - 1) * 160 + 200])
    assert first.shape[-1] == 8 * len(SPEC.prompt)

    def blocks():
        yield first
        for pos in range(len(SPEC.prompt), n_pos - 1):  # generate decodes positions 0 .. T-2, as offline
            start = pos * 1280 - 200
            yield _hf_features(padded[start : start + 1680], center=False)

    out = hf.generate(
        input_ids=torch.tensor([SPEC.prompt]),
        input_features=blocks(),
        num_delay_tokens=SPEC.num_delay_tokens,
        do_sample=False,
        eos_token_id=SPEC.eos_id,
        pad_token_id=SPEC.eos_id,
    )
    want = out[0, len(SPEC.prompt) :].tolist()

    session = StreamSession(EagerSteps(ours), SPEC)
    rng = np.random.default_rng(3)
    i = 0
    while i < len(audio):  # blocks of random sizes, as a live source delivers them
        n = int(rng.integers(1, 3000))
        session.feed(audio[i : i + n])
        i += n
    session.finish()
    assert session.tokens == want
    assert session.tokens == run_whole(EagerSteps(ours), SPEC, audio)
