"""A held-out checkpoint, exactly as the installed transformers' save_pretrained writes it (5.17 and 5.25 under
`nox -s compat`), exported by the CLI: its greedy tokens on 10 s and on 70 s of speech equal transformers'
`generate` on the features VoxtralProcessor computes (WhisperFeatureExtractor over the audio padded to a
multiple of 30 s: one global log-mel), its prompt ids equal the ones transformers' processor builds through
mistral-common, and every step's logits match. The config is used nowhere else: other widths, head counts, one
KV head, rope theta, seed.

Measured (torch 2.13 CPU, transformers 5.25): features cut per 30 s chunk instead of one global log-mel move the
first step's logits on the 70 s audio by 0.039 (logits ~3) but leave these greedy tokens unchanged, so the
logits are compared too, at LOGITS_ATOL."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import FIXTURES

from runner.audio import N_FRAMES, N_MELS, N_SAMPLES, SAMPLE_RATE, load_audio

HELD_OUT = {
    "audio_config": {"hidden_size": 48, "intermediate_size": 192, "num_hidden_layers": 1, "num_attention_heads": 3},
    "text_config": {
        "vocab_size": 1024,
        "hidden_size": 80,
        "intermediate_size": 224,
        "num_hidden_layers": 2,
        "num_attention_heads": 5,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rope_theta": 2.5e5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 2.5e5},
    },
    "audio_token_id": 24,
}
SEED = 2024
MAX_NEW_TOKENS = 20
LOGITS_ATOL = 1e-4  # measured 1.8e-6 (10 s) and 2.3e-6 (70 s); per-chunk features: 0.047
SECONDS = {"10s": 10, "70s": 70}
# 70 s is three 30 s chunks: the bundle must take them in one prompt (the default capacity may be smaller).
EXPORT_ARGS = ["--device", "cpu", "--max-audio-chunks", "3", "--max-seq-len", "1536"]


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> Path:
    """save_pretrained of a model at unit gain (std 0.02 would make near-ties of every logit), with Whisper's
    sinusoidal positions as the real checkpoint has them."""
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration
    from transformers.models.whisper.modeling_whisper import sinusoids

    torch.manual_seed(SEED)
    model = VoxtralForConditionalGeneration(VoxtralConfig(**json.loads(json.dumps(HELD_OUT))))
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:  # token embeddings 8x larger: at unit gain greedy decoding repeats one token from the start
                gain = 8.0 if "embed_tokens" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain / p[0].numel() ** 0.5)
        pos = model.model.audio_tower.embed_positions.weight
        pos.copy_(sinusoids(*pos.shape))
    ckpt = tmp_path_factory.mktemp("held-out") / "held-out"
    model.save_pretrained(ckpt)
    shutil.copyfile(FIXTURES / "tekken.json", ckpt / "tekken.json")
    return ckpt


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> dict[str, Path]:
    """10 s and 70 s of the fixtures' speech, end to end (16-bit PCM, so every reader sees the same samples)."""
    parts = ("long_35s.flac", "speech.wav", "speech_48k_stereo.wav", "short.wav", "long_35s.flac", "speech.wav")
    joined = np.concatenate([load_audio(FIXTURES / "audio" / name) for name in parts])
    out = tmp_path_factory.mktemp("speech")
    files = {}
    for name, seconds in SECONDS.items():
        assert len(joined) >= seconds * SAMPLE_RATE
        files[name] = out / f"{name}.wav"
        sf.write(files[name], joined[len(joined) - seconds * SAMPLE_RATE :], SAMPLE_RATE, subtype="PCM_16")
    return files  # the 10 s file starts mid-sentence in long_35s.flac's speech, the 70 s one spans all parts


def _cli(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def bundle(held_out, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("held-out-bundle") / "bundle"
    _cli("export", "--checkpoint", str(held_out), *EXPORT_ARGS, "--out", str(out))
    return out


@pytest.fixture(scope="module")
def ours(bundle, speech) -> dict[str, dict]:
    audio = [a for name in SECONDS for a in ("--audio", str(speech[name]))]
    lines = _cli("run", "--bundle", str(bundle), *audio, "--json", "--max-new-tokens", str(MAX_NEW_TOKENS)).stdout
    records = [json.loads(line) for line in lines.splitlines()]
    return {name: r for name, r in zip(SECONDS, records, strict=True)}


def _features(samples: np.ndarray) -> torch.Tensor:
    """VoxtralProcessor's input_features: its audio kwargs, then its reshape into 30 s chunks."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=N_MELS)
    out = fe(
        samples, sampling_rate=SAMPLE_RATE, padding=True, truncation=False, pad_to_multiple_of=N_SAMPLES,
        return_tensors="pt",
    )["input_features"]  # fmt: skip
    return out.reshape(N_MELS, -1, N_FRAMES).transpose(0, 1)


def _processor_ids(path: Path) -> list[int]:
    """The prompt transformers' VoxtralProcessor builds (mistral-common's transcription request)."""
    from transformers import VoxtralProcessor, WhisperFeatureExtractor
    from transformers.tokenization_mistral_common import MistralCommonBackend

    processor = VoxtralProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=N_MELS),
        tokenizer=MistralCommonBackend(tokenizer_path=str(FIXTURES / "tekken.json")),
    )
    inputs = processor.apply_transcription_request(  # an array: a path needs librosa in transformers 5.17
        audio=load_audio(path), sampling_rate=SAMPLE_RATE, format="wav", model_id="held-out"
    )
    return inputs["input_ids"][0].tolist()


@pytest.fixture(scope="module")
def hf_model(held_out):
    from transformers import VoxtralForConditionalGeneration

    return VoxtralForConditionalGeneration.from_pretrained(held_out).eval()


def _hf_generate(model, prompt: list[int], path: Path):
    features = _features(load_audio(path))
    with torch.no_grad():
        return model.generate(
            input_ids=torch.tensor([prompt]), input_features=features, max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False, num_beams=1, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip


@pytest.mark.parametrize("name", list(SECONDS))
def test_greedy_tokens_equal_transformers_generate(hf_model, speech, ours, name):
    record = ours[name]
    prompt = record["prompt_ids"]
    assert prompt == _processor_ids(speech[name])  # the same prompt, id for id
    assert prompt.count(HELD_OUT["audio_token_id"]) == 375 * -(-SECONDS[name] // 30)  # 1 and 3 chunks
    theirs = _hf_generate(hf_model, prompt, speech[name]).sequences[0, len(prompt) :].tolist()
    assert len(set(record["tokens"])) >= 3  # a real comparison, not one token repeated
    assert record["tokens"] == theirs


@pytest.mark.parametrize("name", list(SECONDS))
def test_every_steps_logits_match_transformers(hf_model, bundle, speech, name):
    from conftest import prompt_for, runner_for

    from runner.runtime.generate import GenerationOptions
    from runner.runtime.program import Program

    with Program.load(bundle) as program:
        runner = runner_for(program)
        opts = GenerationOptions(max_new_tokens=MAX_NEW_TOKENS, record_logits=True)
        result = runner.generate(prompt_for(runner, speech[name]), opts)
    theirs = _hf_generate(hf_model, result.prompt_ids, speech[name])
    want = torch.cat([x.reshape(1, -1) for x in theirs.logits]).float()
    got = torch.cat([x.reshape(1, -1) for x in result.logits]).float()
    assert got.shape == want.shape and want.abs().max() > 1.0
    err = (got - want).abs().max().item()
    assert err <= LOGITS_ATOL, f"logits differ by {err:.3g} (worst step {(got - want).abs().amax(-1).argmax()})"
