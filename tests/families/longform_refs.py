"""The references for Whisper's long form, on exactly our weights: openai-whisper's `transcribe` over a
`whisper.model.Whisper` loaded from our converted tiny.en (the pinned CTranslate2 model.bin; no pickle, no
download), and faster-whisper's `WhisperModel` on the same CTranslate2 directory; and long espeak-ng recordings
of known sentences, made by the test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

# Sentences of everyday English, each said once: a lost sentence is one none of whose words come out.
SENTENCES = [
    "The weather this morning was cold and bright.",
    "By the afternoon the clouds had gathered over the hills.",
    "In the evening it started to rain.",
    "A computer reads a program one instruction at a time.",
    "Speech recognition turns sound into text.",
    "Engineers measure latency, throughput and memory.",
    "The train to the city leaves every hour.",
    "She planted tomatoes and beans in the garden.",
    "The library opens at nine and closes at six.",
    "My brother bought a new bicycle last week.",
    "The children played football in the park.",
    "We ordered soup, bread and a pot of tea.",
    "The museum has a large collection of old maps.",
    "He forgot his umbrella on the bus.",
    "The river flows slowly past the village.",
    "Our neighbours are painting their house blue.",
    "The doctor said I should drink more water.",
    "A small boat sailed across the quiet lake.",
    "The shop on the corner sells fresh fruit.",
    "They watched the sunset from the top of the hill.",
    "The meeting was moved to Thursday afternoon.",
    "I read the newspaper while the coffee cooled.",
    "The old clock in the hall stopped at noon.",
    "Birds were singing in the tall trees.",
    "The teacher wrote the answer on the board.",
    "We walked along the beach and collected shells.",
    "The baker makes bread before the sun rises.",
    "A letter arrived from my aunt in the country.",
    "The farmer drove his tractor across the field.",
    "The cat slept all day by the warm window.",
]


def espeak_recording(dest: Path, minutes: float, pause_s: float = 1.0) -> tuple[Path, list[str]]:
    """A 16 kHz mono wav of the sentences said one after another (cycled, `pause_s` between them) until it lasts
    `minutes`; returns it and the sentences in order. Needs espeak-ng (apt-get install espeak-ng)."""
    from runner.audio import SAMPLE_RATE, load_audio

    if shutil.which("espeak-ng") is None:
        raise FileNotFoundError("espeak-ng is not installed")
    dest.mkdir(parents=True, exist_ok=True)
    parts, said, total, i = [], [], 0, 0
    gap = np.zeros(int(pause_s * SAMPLE_RATE), np.float32)
    while total < minutes * 60 * SAMPLE_RATE:
        sentence = SENTENCES[i % len(SENTENCES)]
        wav = dest / f"s{i % len(SENTENCES)}.wav"
        if not wav.exists():
            subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(wav), sentence], check=True)
        x = load_audio(wav)  # resampled to 16 kHz as the runner reads any file
        parts += [x, gap]
        said.append(sentence)
        total += len(x) + len(gap)
        i += 1
    out = dest / f"long_{minutes:g}min.wav"
    import soundfile

    soundfile.write(out, np.concatenate(parts), SAMPLE_RATE, subtype="PCM_16")
    return out, said


def lost_sentences(said: list[str], text: str, min_share: float = 0.5) -> list[int]:
    """The sentences (by position) less than `min_share` of whose words come out: by the word alignment of least
    edits between the whole script and the whole text (the WER's), each script word matched or not. (A longest-block
    alignment misplaces whole sentences of a script that says its sentences more than once.)"""
    from runner.app.wer import normalize as words

    ref, owner = [], []
    for i, s in enumerate(said):
        w = words(s)
        ref += w
        owner += [i] * len(w)
    found = [0] * len(said)
    for k in matched_words(ref, words(text)):
        found[owner[k]] += 1
    return [i for i, s in enumerate(said) if found[i] < min_share * len(words(s))]


def matched_words(ref: list[str], hyp: list[str]) -> list[int]:
    """The positions in `ref` of the words a least-edits alignment to `hyp` matches (Levenshtein, backtraced)."""
    n, m = len(ref), len(hyp)
    d = np.zeros((n + 1, m + 1), np.int32)
    d[:, 0], d[0, :] = np.arange(n + 1), np.arange(m + 1)
    hyp_arr = np.array(hyp, dtype=object)
    for i in range(1, n + 1):
        same = hyp_arr == ref[i - 1]
        row = np.minimum(d[i - 1, 1:] + 1, d[i - 1, :-1] + ~same)  # deletion, or match/substitution
        for j in range(1, m + 1):  # insertions run along the row
            row[j - 1] = min(row[j - 1], (d[i, j - 1] if j > 1 else i) + 1)
            d[i, j] = row[j - 1]
    out, i, j = [], n, m
    while i > 0 and j > 0:
        if ref[i - 1] == hyp[j - 1] and d[i, j] == d[i - 1, j - 1]:
            out.append(i - 1)
            i, j = i - 1, j - 1
        elif d[i, j] == d[i - 1, j - 1] + 1:
            i, j = i - 1, j - 1
        elif d[i, j] == d[i - 1, j] + 1:
            i -= 1
        else:
            j -= 1
    return out[::-1]


def openai_whisper_from(model) -> torch.nn.Module:
    """openai-whisper's `Whisper` with tiny.en's dims and our eager model's weights (renamed; the encoder's fused
    q/k/v split back)."""
    from whisper.model import ModelDimensions, Whisper

    c = model.config
    dims = ModelDimensions(
        n_mels=c.audio.n_mels, n_audio_ctx=c.audio.max_source_positions, n_audio_state=c.audio.dim,
        n_audio_head=c.audio.n_heads, n_audio_layer=c.audio.n_layers, n_vocab=c.text.vocab_size,
        n_text_ctx=c.text.max_target_positions, n_text_state=c.text.dim, n_text_head=c.text.n_heads,
        n_text_layer=c.text.n_layers,
    )  # fmt: skip
    ours = {k: v for k, v in model.state_dict().items() if "cache" not in k}
    state = {}
    for k, v in ours.items():
        state.update(_renamed(k, v))
    ref = Whisper(dims)
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"encoder.positional_embedding"}, missing  # a buffer: the sinusoids, as ours are
    assert torch.allclose(ref.encoder.positional_embedding, ours["encoder.embed_positions.weight"], atol=1e-4)
    return ref.float().eval()


_LAYER = {
    "self_attn_layer_norm": "attn_ln", "encoder_attn_layer_norm": "cross_attn_ln", "final_layer_norm": "mlp_ln",
    "fc1": "mlp.0", "fc2": "mlp.2", "self_attn": "attn", "encoder_attn": "cross_attn",
}  # fmt: skip
_PROJ = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "out_proj": "out"}


def _renamed(k: str, v: torch.Tensor) -> dict[str, torch.Tensor]:
    top = {
        "encoder.embed_positions.weight": "encoder.positional_embedding",
        "encoder.layer_norm.weight": "encoder.ln_post.weight", "encoder.layer_norm.bias": "encoder.ln_post.bias",
        "decoder.embed_tokens.weight": "decoder.token_embedding.weight",
        "decoder.embed_positions.weight": "decoder.positional_embedding",
        "decoder.layer_norm.weight": "decoder.ln.weight", "decoder.layer_norm.bias": "decoder.ln.bias",
    }  # fmt: skip
    if k in top:
        return {top[k]: v}
    if not k.startswith(("encoder.layers.", "decoder.layers.")):
        return {k: v}
    side, _, i, rest = k.split(".", 3)
    prefix = f"{side}.blocks.{i}."
    if ".qkv_proj." in rest:  # the encoder's fused projection, q k v stacked on dim 0
        module, _, param = rest.split(".")
        q, kk, vv = v.chunk(3)
        out = {f"{prefix}attn.query.{param}": q, f"{prefix}attn.value.{param}": vv}
        if param == "weight":
            out[f"{prefix}attn.key.weight"] = kk
        else:
            assert not kk.any(), "openai-whisper's key projection has no bias"
        return out
    parts = rest.split(".")
    if parts[0] in ("self_attn", "encoder_attn"):
        return {f"{prefix}{_LAYER[parts[0]]}.{_PROJ[parts[1]]}.{parts[2]}": v}
    return {f"{prefix}{_LAYER[parts[0]]}.{parts[1]}": v}
