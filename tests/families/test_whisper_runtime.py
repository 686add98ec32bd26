"""The Whisper family without the model package: the tokenizer on a small byte-level tokenizer.json made here,
the prompt, how long audio is cut into windows, and how a result's tokens are split back per window."""

from __future__ import annotations

import numpy as np
import pytest

from runner.audio import N_SAMPLES
from runner.errors import AudioError, BundleError, GenerationError, TokenizerError
from runner.families.whisper import WhisperFamily, whisper_prompt, windows
from runner.families.whisper.tokenizer import WhisperTokenizer, _byte_decoder
from runner.runtime.detokenize import StreamDecoder
from runner.runtime.generate import GenerationResult
from runner.runtime.prompt import AudioSegment, TextSegment
from runner.stats import Stats

SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> WhisperTokenizer:
    """GPT-2's 256 byte symbols as the whole BPE vocabulary (no merges), then Whisper's control tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    alphabet = sorted(_byte_decoder(), key=lambda ch: _byte_decoder()[ch])
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tk.save(str(path))
    return WhisperTokenizer(path, vocab_size=300)


def test_control_tokens_are_looked_up_by_name_and_everything_from_endoftext_up_is_special(tokenizer):
    assert tokenizer.eos_id == tokenizer.special_id("<|endoftext|>") == 256
    assert [tokenizer.special_id(s) for s in SPECIALS] == [256, 257, 258, 259, 260]
    assert tokenizer.is_special(299) and not tokenizer.is_special(255)  # 299: past tokenizer.json (timestamps)
    assert tokenizer.special_name(257) == "<|startoftranscript|>" and tokenizer.special_name(299).startswith("<|")
    with pytest.raises(TokenizerError, match="not in the tokenizer"):
        tokenizer.special_id("<|fr|>")
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tokenizer.token_bytes(300)


def test_text_round_trips_and_streams_whole_characters_only(tokenizer):
    text = " Héllo wörld, ça va? 🙂"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte in this vocabulary
    assert tokenizer.decode(ids) == text
    stream = StreamDecoder(tokenizer)
    pieces = [stream.feed(i) for i in [257, 260, *ids, 256]] + [stream.flush()]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    assert tokenizer.decode([257, *ids[:2], 256], keep_special=True) == "<|startoftranscript|> H<|endoftext|>"


def test_control_tokens_typed_as_text_are_refused(tokenizer):
    with pytest.raises(TokenizerError, match="control token"):
        tokenizer.encode("say <|endoftext|>")


def test_prompt_english_only_and_multilingual(tokenizer):
    assert whisper_prompt(tokenizer, False, None) == (257, 260)
    assert whisper_prompt(tokenizer, False, "en") == (257, 260)
    with pytest.raises(GenerationError, match="English-only"):
        whisper_prompt(tokenizer, False, "de")
    assert whisper_prompt(tokenizer, True, "en") == (257, 258, 259, 260)


def test_audio_is_cut_into_one_prompt_per_30_s_window_of_the_whole_recording():
    """openai/whisper's windows: one per 3000 content frames (len // 160), each a window of the whole recording
    (whose features are computed once over all of it)."""
    samples = np.arange(N_SAMPLES + 200, dtype=np.float32)
    got = windows(samples, (1, 2))
    assert [[type(s).__name__ for s in w] for w in got] == [["AudioSegment", "TextSegment"]] * 2
    assert all(isinstance(w[0], AudioSegment) and w[0].samples is samples for w in got)
    assert [w[0].window for w in got] == [0, 1] and [w[0].num_samples for w in got] == [N_SAMPLES, 200]
    assert all(w[1] == TextSegment((1, 2)) for w in got)
    assert len(windows(samples[: N_SAMPLES + 100], (1,))) == 1  # under one hop past 30 s: no frame, no window
    assert len(windows(np.zeros(0, np.float32), (1,))) == 1  # silence: still one window


def test_a_recording_longer_than_the_preprocessor_takes_is_refused_by_name(tokenizer, tmp_path):
    sf = pytest.importorskip("soundfile")
    path = tmp_path / "forty.wav"
    sf.write(path, np.zeros(40 * 16000, np.float32), 16000)  # 40 s + the 30 s of zeros: 3 chunks
    with pytest.raises(AudioError, match=r"forty.wav: audio is 40.0 s long; .* recordings up to 30 s"):
        WhisperFamily(tokenizer, max_recording_chunks=2).prompts(path, None, None, 1)
    assert len(WhisperFamily(tokenizer, max_recording_chunks=3, long_form=False).prompts(path, None, None, 1)) == 2


def test_a_manifest_without_the_preprocessors_bound_is_refused_by_name(tmp_path):
    model = {"config": {"text": {"vocab_size": 300}}, "tokenizer": "tokenizer.json"}
    with pytest.raises(BundleError, match="model.max_recording_chunks is missing"):
        WhisperFamily.from_bundle(tmp_path, model)


def test_tokens_are_split_back_by_each_windows_count():
    """A window cut by --max-new-tokens has no <|endoftext|>: only the recorded counts split the tokens right."""
    result = GenerationResult("", [], [5, 6, 7, 9], "eos", Stats(), windows=(2, 2))
    assert result.window_tokens() == [[5, 6], [7, 9]]
    assert GenerationResult("", [], [5, 9], "eos", Stats()).window_tokens() == [[5, 9]]  # no record: one window
