"""runner/tokenizer.py over the fixture tekken.json: ids by name, round trips, streaming decode, bad files."""

import base64
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from runner.errors import TokenizerError
from runner.families.voxtral.tokenizer import Tekken
from runner.runtime.detokenize import StreamDecoder

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TEKKEN = FIXTURES / "tekken.json"

# Ranks in the real Voxtral-Mini-3B-2507 tekken.json (and so in the fixture).
REAL_RANKS = {
    "<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "[AVAILABLE_TOOLS]": 5, "[TOOL_CALLS]": 9,
    "[IMG]": 10, "<pad>": 11, "[SYSTEM_PROMPT]": 17, "[TOOL_CONTENT]": 19, "[AUDIO]": 24, "[BEGIN_AUDIO]": 25,
    "[TRANSCRIBE]": 34,
}  # fmt: skip

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing newline\n\tand a tab\r\n",
    "Numbers 12345 and punctuation!? (yes) a/b",
    "Café, naïve, façade, Ångström, ß, œuvre",  # accented Latin
    "日本語のテキストと中文文本",  # CJK
    "emoji 😀🎉👍🏽 and family 👨‍👩‍👧",  # 4-byte sequences and ZWJ joins
    "Привет, мир! مرحبا ‏שלום",  # Cyrillic, Arabic, Hebrew with an RLM mark
    "",
]


@pytest.fixture(scope="module")
def tok():
    return Tekken.from_file(TEKKEN)


def test_sizes(tok):
    assert tok.num_special == 100
    assert tok.vocab_size == 1024


@pytest.mark.parametrize("name, rank", REAL_RANKS.items())
def test_special_ids_by_name_match_the_real_ranks(tok, name, rank):
    assert tok.special_id(name) == rank


def test_bos_eos(tok):
    assert (tok.bos_id, tok.eos_id) == (1, 2)


def test_filler_special_names(tok):
    assert tok.special_id("<SPECIAL_20>") == 20
    assert tok.special_id("<SPECIAL_99>") == 99


def test_unknown_special_token_is_named_in_the_error(tok):
    with pytest.raises(TokenizerError, match=r"\[NOT_A_TOKEN\]"):
        tok.special_id("[NOT_A_TOKEN]")


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips(tok, text):
    ids = tok.encode(text)
    assert all(tok.num_special <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_merges_are_used_for_english(tok):
    text = "The quick brown fox jumps over the lazy dog."
    assert len(tok.encode(text)) < len(text.encode()) / 2


@pytest.mark.parametrize("text", ["[INST]", "</s>", "<s>[INST]hi[/INST]", "[AUDIO][TRANSCRIBE]"])
def test_special_looking_text_is_plain_text(tok, text):
    ids = tok.encode(text)
    assert all(i >= tok.num_special for i in ids)
    assert tok.special_id("[INST]") not in ids
    assert tok.decode(ids) == text


def test_decode_skips_or_names_special_tokens(tok):
    ids = [tok.bos_id, tok.special_id("[INST]"), *tok.encode("hello"), tok.special_id("[/INST]"), tok.eos_id]
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, keep_special=True) == "<s>[INST]hello[/INST]</s>"


def test_decode_rejects_ids_outside_the_vocabulary(tok):
    with pytest.raises(TokenizerError, match="1024"):
        tok.decode([5, 1024])
    with pytest.raises(TokenizerError):
        tok.decode([-1])


def test_every_bpe_token_encodes_to_itself(tok):
    # The fixture's merges were learned so tiktoken reaches every rank; a broken generator shows up here.
    for token_id in range(tok.num_special, tok.vocab_size):
        raw = tok.token_bytes(token_id)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert tok.encode(text) == [token_id], (token_id, raw)


# --- streaming ---


def _stream(tok, ids, **kw):
    dec = StreamDecoder(tok, **kw)
    pieces = [dec.feed(i) for i in ids]
    return pieces, "".join(pieces) + dec.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_one_id_at_a_time_reproduces_decode(tok, text):
    ids = tok.encode(text)
    pieces, joined = _stream(tok, ids)
    assert joined == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)  # nothing half-decoded leaks out


def test_stream_decoder_holds_back_split_characters(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji's 4 bytes span several byte-level tokens in this vocabulary
    pieces, joined = _stream(tok, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "😀"


@pytest.mark.parametrize("keep_special", [False, True])
def test_stream_decoder_with_special_tokens(tok, keep_special):
    ids = [tok.bos_id, *tok.encode("café 日本"), tok.special_id("[TRANSCRIBE]"), *tok.encode("🎉 ok"), tok.eos_id]
    _, joined = _stream(tok, ids, keep_special=keep_special)
    assert joined == tok.decode(ids, keep_special=keep_special)


def test_stream_decoder_matches_decode_on_broken_utf8(tok):
    # A special token cuts a character in half: decode() replaces the orphan bytes; the stream must agree.
    emoji = tok.encode("😀")
    ids = [emoji[0], tok.eos_id, *emoji[1:], *tok.encode("x")]
    _, joined = _stream(tok, ids)
    assert joined == tok.decode(ids)
    assert "\ufffd" in joined


# --- bad files ---


def _doc():
    return json.loads(TEKKEN.read_text(encoding="utf-8"))


def _bad(tmp_path, doc_or_text, match):
    path = tmp_path / "tekken.json"
    path.write_text(doc_or_text if isinstance(doc_or_text, str) else json.dumps(doc_or_text), encoding="utf-8")
    with pytest.raises(TokenizerError, match=match) as err:
        Tekken.from_file(path)
    assert str(path) in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(TokenizerError, match="not found") as err:
        Tekken.from_file(tmp_path / "tekken.json")
    assert "tekken.json" in str(err.value)


def test_not_json(tmp_path):
    _bad(tmp_path, "{ this is not json", "not readable JSON")


def test_missing_config(tmp_path):
    doc = _doc()
    del doc["config"]
    _bad(tmp_path, doc, "malformed")


def test_bad_base64(tmp_path):
    doc = _doc()
    doc["vocab"][300]["token_bytes"] = "***"
    _bad(tmp_path, doc, "malformed")


def test_vocab_too_short(tmp_path):
    doc = _doc()
    doc["vocab"] = doc["vocab"][:500]
    _bad(tmp_path, doc, "vocab has 500 entries")


def test_special_rank_out_of_order(tmp_path):
    doc = _doc()
    doc["special_tokens"][3]["rank"] = 7
    _bad(tmp_path, doc, r"\[INST\]")


def test_vocab_is_cut_to_default_vocab_size(tmp_path):
    doc = _doc()
    doc["config"]["default_vocab_size"] = 700
    path = tmp_path / "tekken.json"
    path.write_text(json.dumps(doc))
    small = Tekken.from_file(path)
    assert small.vocab_size == 700
    assert all(i < 700 for i in small.encode("The quick brown fox jumps over the lazy dog."))


def test_missing_special_tokens_list_uses_the_legacy_names(tmp_path):
    doc = _doc()
    del doc["special_tokens"]
    path = tmp_path / "tekken.json"
    path.write_text(json.dumps(doc))
    legacy = Tekken.from_file(path)
    assert legacy.special_id("[INST]") == 3 and legacy.special_id("<SPECIAL_24>") == 24


# --- the fixture itself ---


def test_fixture_is_what_the_generator_makes():
    spec = importlib.util.spec_from_file_location("make_tekken", FIXTURES / "make_tekken.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.build() == _doc()


def test_fixture_bpe_starts_with_the_256_bytes():
    vocab = _doc()["vocab"]
    assert [base64.b64decode(v["token_bytes"]) for v in vocab[:256]] == [bytes([b]) for b in range(256)]


# --- mistral-common (in the test extra: these run, never skip) ---


def test_matches_mistral_common(tok):
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    ref = Tekkenizer.from_file(str(TEKKEN))
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, bos=False, eos=False)
    special_id = getattr(ref, "get_special_token", None) or ref.get_control_token  # renamed in newer releases
    for name, rank in REAL_RANKS.items():
        assert special_id(name) == rank


AUDIO = FIXTURES / "audio"
PROMPT_AUDIO = ["speech.wav", "long_35s.flac", "speech_48k_stereo.wav"]  # 1 chunk, 2 chunks, resampled stereo


def _our_ids(tok, path, prompt=None, language=None) -> list[int]:
    """The ids `run` feeds the decoder for one file: the family's prompt, [AUDIO] at each audio position (375
    per 30 s chunk, as the audio encoder returns them)."""
    from runner.audio import TOKENS_PER_CHUNK
    from runner.audio_chunks import num_chunks
    from runner.families.voxtral import VoxtralFamily
    from runner.runtime.prompt import AudioSegment

    (segments,) = VoxtralFamily(tok).prompts(path, prompt, language, max_audio_chunks=4)
    ids: list[int] = []
    for seg in segments:
        n = TOKENS_PER_CHUNK * num_chunks(len(seg.samples)) if isinstance(seg, AudioSegment) else 0
        ids += [tok.special_id("[AUDIO]")] * n if n else list(seg.ids)
    return ids


def _mistral_audio(path):
    """Our decoded samples as mistral-common's Audio: both sides see the same waveform."""
    from mistral_common.tokens.tokenizers.audio import Audio

    from runner.audio import SAMPLE_RATE, load_audio

    return Audio(load_audio(path), SAMPLE_RATE, format="wav")


def _transcription(mistral, audio, language=None) -> list[int]:
    from mistral_common.protocol.transcription.request import TranscriptionRequest

    request = TranscriptionRequest(model="voxtral", audio=audio.to_base64("wav"), language=language)
    return mistral.encode_transcription(request).tokens


@pytest.fixture(scope="module")
def mistral():
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(str(TEKKEN))  # the fixture carries Voxtral's audio section


@pytest.mark.parametrize("language", [None, "en", "fr"])
@pytest.mark.parametrize("name", PROMPT_AUDIO)
def test_transcription_prompt_is_mistral_commons_id_for_id(tok, mistral, name, language):
    theirs = _transcription(mistral, _mistral_audio(AUDIO / name), language)
    assert _our_ids(tok, AUDIO / name, language=language) == theirs


@pytest.mark.parametrize("question", ["What is said here?", "Summarise [INST] this </s> audio, please."])
@pytest.mark.parametrize("name", PROMPT_AUDIO)
def test_chat_prompt_is_mistral_commons_id_for_id(tok, mistral, name, question):
    """The seed's chat prompt is mistral-common's chat request with the audio first, then the question; a
    control token's name typed in the question stays text on both sides."""
    from mistral_common.protocol.instruct.chunk import AudioChunk, TextChunk
    from mistral_common.protocol.instruct.messages import UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    content = [AudioChunk.from_audio(_mistral_audio(AUDIO / name)), TextChunk(text=question)]
    theirs = mistral.encode_chat_completion(ChatCompletionRequest(messages=[UserMessage(content=content)]))
    assert _our_ids(tok, AUDIO / name, prompt=question) == theirs.tokens


def test_mistral_common_counts_375_audio_tokens_per_30_s_chunk(tok, mistral):
    """What the comparisons above rest on, stated: [BEGIN_AUDIO] once, then 375 [AUDIO] per started chunk."""
    from mistral_common.tokens.tokenizers.audio import Audio

    for seconds, chunks in ((1, 1), (30, 1), (30.01, 2), (61, 3)):
        ids = _transcription(mistral, Audio(np.zeros(round(seconds * 16000), np.float32), 16000, format="wav"))
        assert ids.count(tok.special_id("[AUDIO]")) == 375 * chunks, seconds
        assert ids.count(tok.special_id("[BEGIN_AUDIO]")) == 1
