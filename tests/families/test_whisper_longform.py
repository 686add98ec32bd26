"""Whisper's long form against openai-whisper's `transcribe` (20250625) and faster-whisper (1.2.1) on exactly our
tiny.en weights (tests/families/longform_refs.py), on long espeak-ng recordings of known sentences made here:
the same logit rules, WER within a point of openai-whisper's, no sentence lost that it keeps, segments in order
within the file, and each window's outcome (temperature, fallbacks, silence) recorded.

Fails where the Whisper package, openai-whisper or faster-whisper is missing (`pip install -e ".[test,whisper]"`);
skipped where espeak-ng (a system tool, .ci/run installs it) is."""

from __future__ import annotations

import copy
import sys

import faster_whisper  # the test extra, as openai-whisper: without them the comparisons fail, never skip
import pytest
import whisper as whisper_pkg
from longform_refs import espeak_recording, lost_sentences, openai_whisper_from

from runner.app.wer import score
from runner.audio import SAMPLE_RATE, load_audio
from runner.export.whisper_convert import ConversionError, load_whisper, package_model_dir
from runner.runtime.generate import GenerationOptions, MultimodalRunner


@pytest.fixture(scope="module")
def model_dir():
    try:
        return package_model_dir()
    except ConversionError as e:
        pytest.fail(f"Whisper model package unavailable: {e}")


@pytest.fixture(scope="module")
def loaded(model_dir):
    from runner.families.whisper import WhisperTokenizer

    model, _, path = load_whisper(model_dir)
    return model, WhisperTokenizer(path, model.config.text.vocab_size)


@pytest.fixture(scope="module")
def ours(loaded):
    """Our long form over the eager model (the runtime's loop and rules; the bundle runs the same loop)."""
    from runner.families.whisper import WhisperFamily
    from runner.reference.whisper import engine_for

    model, tok = copy.deepcopy(loaded[0]), loaded[1]
    model.setup_caches(model.config.text.max_target_positions)
    runner = MultimodalRunner(engine_for(model, eot=tok.eos_id), tok, None)

    def transcribe(path, **opts):
        return runner.generate_windows(WhisperFamily(tok).prompts(path, None, None, 1), GenerationOptions(**opts))

    return transcribe


@pytest.fixture(scope="module")
def reference(loaded):
    return openai_whisper_from(loaded[0])


def recording(tmp_path_factory, minutes):
    try:
        return espeak_recording(tmp_path_factory.mktemp("longform"), minutes)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_logit_rules_use_openai_whispers_token_ids(loaded, reference):
    """The suppressed tokens, the timestamp and no-speech ids: openai-whisper's own for this tokenizer."""
    from whisper.decoding import DecodingOptions, DecodingTask

    from runner.families.whisper.longform import Rules

    rules = Rules.of(loaded[1])
    task = DecodingTask(reference, DecodingOptions(language="en", fp16=False))
    t = task.tokenizer
    assert rules.suppress == task._get_suppress_tokens()
    assert (rules.timestamp_begin, rules.no_speech, rules.sot_prev, rules.no_timestamps, rules.eot) == (
        t.timestamp_begin, t.no_speech, t.sot_prev, t.no_timestamps, t.eot,
    )  # fmt: skip
    assert list(rules.blank) == t.encode(" ") + [t.eot]


def compare(tmp_path_factory, minutes, ours, reference, model_dir):
    path, said = recording(tmp_path_factory, minutes)
    script = " ".join(said)
    mine = ours(path, max_new_tokens=None)
    ref = whisper_pkg.transcribe(reference, load_audio(path), fp16=False, language="en")
    fw_model = faster_whisper.WhisperModel(str(model_dir), device="cpu", compute_type="float32", cpu_threads=2)
    # greedy, as openai-whisper's `transcribe` and ours decode by default (faster-whisper's own default is 5 beams)
    fw_segments, _ = fw_model.transcribe(load_audio(path), language="en", beam_size=1)
    fw_text = "".join(s.text for s in fw_segments)
    wers = {name: score(name, script, text).wer for name, text in
            (("ours", mine.text), ("openai-whisper", ref["text"]), ("faster-whisper", fw_text))}  # fmt: skip
    print(f"\n{minutes:g} min, WER: " + ", ".join(f"{k} {100 * v:.2f}%" for k, v in wers.items()), file=sys.stderr)
    return path, said, mine, ref, fw_text, wers


@pytest.mark.parametrize("minutes", [2.2, 10])
def test_long_recording_as_openai_whisper_transcribes_it(tmp_path_factory, minutes, ours, reference, model_dir):
    path, said, mine, ref, fw_text, wers = compare(tmp_path_factory, minutes, ours, reference, model_dir)
    assert wers["ours"] <= wers["openai-whisper"] + 0.01
    assert wers["ours"] <= wers["faster-whisper"] + 0.01
    assert set(lost_sentences(said, mine.text)) <= set(lost_sentences(said, ref["text"]))
    assert set(lost_sentences(said, mine.text)) <= set(lost_sentences(said, fw_text))
    duration = len(load_audio(path)) / SAMPLE_RATE
    starts = [s.start for s in mine.segments]
    assert starts == sorted(starts) and all(0 <= s.start <= s.end <= duration + 30 for s in mine.segments)
    assert all(a.end <= b.start + 1e-6 for a, b in zip(mine.segments, mine.segments[1:]))
    assert len(mine.parts) > minutes * 2  # windows cut at the segments' ends, not every 30 s only
    assert all(p.temperature is not None and not p.silent for p in mine.parts)


def test_segments_and_their_numbers_are_openai_whispers_where_the_decodes_agree(tmp_path_factory, ours, reference):
    """On the first window (no previous text yet) the segments are openai-whisper's: same times, text, tokens,
    avg_logprob and no-speech probability (fp32 on both sides: within float rounding)."""
    path, _ = recording(tmp_path_factory, 0.4)
    mine = ours(path, max_new_tokens=None)
    ref = whisper_pkg.transcribe(reference, load_audio(path), fp16=False, language="en")["segments"]
    n = min(len(mine.segments), len(ref))
    assert n >= 3
    for a, b in zip(mine.segments[:n], ref[:n]):
        assert (a.start, a.end, a.text, list(a.tokens)) == (pytest.approx(b["start"]), pytest.approx(b["end"]),
                                                             b["text"], b["tokens"])  # fmt: skip
        assert a.avg_logprob == pytest.approx(b["avg_logprob"], abs=1e-3)
        assert a.no_speech_prob == pytest.approx(b["no_speech_prob"], abs=1e-3)


def test_a_window_judged_implausible_falls_back_and_says_so(tmp_path_factory, ours):
    """A log-probability threshold no decode meets: every temperature is tried, the last kept and recorded."""
    path, _ = recording(tmp_path_factory, 0.3)
    r = ours(path, max_new_tokens=None, logprob_threshold=0.0, no_speech_threshold=None)
    assert [(p.temperature, p.fallbacks, p.silent) for p in r.parts] == [(1.0, 5, False)] * len(r.parts)
    assert all(s.temperature == 1.0 for s in r.segments)
    none = ours(path, max_new_tokens=None, logprob_threshold=0.0, temperature_increment_on_fallback=None)
    assert {(p.temperature, p.fallbacks) for p in none.parts} == {(0.0, 0)}


def test_silence_is_judged_as_openai_whisper_judges_it(tmp_path, ours, reference):
    """The fixture's silence is skipped whole (its window recorded as silent, nothing kept), and a recording of
    digital zeros comes out as openai-whisper transcribes it (whatever that is: tiny.en says " you")."""
    import numpy as np
    import soundfile
    from conftest import AUDIO

    quiet = ours(AUDIO / "silence.wav", max_new_tokens=None)
    ref = whisper_pkg.transcribe(reference, load_audio(AUDIO / "silence.wav"), fp16=False, language="en")
    assert quiet.text == ref["text"] == "" and quiet.segments == ()
    assert [p.silent for p in quiet.parts] == [True]
    path = tmp_path / "zeros.wav"
    soundfile.write(path, np.zeros(40 * SAMPLE_RATE, np.float32), SAMPLE_RATE)
    zeros = ours(path, max_new_tokens=None)
    ref = whisper_pkg.transcribe(reference, load_audio(path), fp16=False, language="en")
    assert zeros.text == ref["text"]
    assert [(s.start, s.end) for s in zeros.segments] == [(s["start"], s["end"]) for s in ref["segments"]]
    assert sum(p.stats.audio_seconds for p in zeros.parts) == pytest.approx(40, abs=0.02)  # the windows tile it


def test_word_timestamps_are_openai_whispers(tmp_path_factory, ours, reference):
    """--word-timestamps: the words and their times as openai-whisper's `word_timestamps=True` finds them on the
    same audio and weights (its alignment heads for tiny.en, set from its own constant): the same words, each
    start within 50 ms in the median (fp32 both sides: in practice equal), and the segments' bounds moved to
    their words' as its are."""
    import difflib
    import statistics

    path, _ = recording(tmp_path_factory, 1.2)
    mine = ours(path, max_new_tokens=None, word_timestamps=True)
    reference.set_alignment_heads(whisper_pkg._ALIGNMENT_HEADS["tiny.en"])
    ref = whisper_pkg.transcribe(reference, load_audio(path), fp16=False, language="en", word_timestamps=True)
    got = [w for s in mine.segments for w in s.words]
    want = [w for s in ref["segments"] for w in s["words"]]
    assert len(got) > 100 and all(w.start <= w.end for w in got)
    blocks = difflib.SequenceMatcher(a=[w.word for w in got], b=[w["word"] for w in want], autojunk=False)
    pairs = [(got[b.a + k], want[b.b + k]) for b in blocks.get_matching_blocks() for k in range(b.size)]
    assert len(pairs) >= 0.95 * len(want)
    print(
        f"\n{len(pairs)} of {len(want)} words matched; median |start - openai-whisper's|: "
        f"{statistics.median(abs(a.start - b['start']) for a, b in pairs) * 1000:.1f} ms",
        file=sys.stderr,
    )
    assert statistics.median(abs(a.start - b["start"]) for a, b in pairs) <= 0.05
    assert statistics.median(abs(a.end - b["end"]) for a, b in pairs) <= 0.05
    assert all(abs(a.probability - b["probability"]) < 0.01 for a, b in pairs)
    first = mine.segments[0]
    assert (first.start, first.end) == (first.words[0].start, first.words[-1].end) or first.words == ()


def test_alignment_heads_are_openai_whispers_constant(loaded):
    """tiny.en's alignment heads, as our converter sets them, are openai-whisper's public constant for it."""
    import numpy as np

    mask = np.zeros((4, 6), bool)
    for layer, head in loaded[0].alignment_heads:
        mask[layer, head] = True
    assert (mask == _decoded_heads(whisper_pkg._ALIGNMENT_HEADS["tiny.en"])).all()


def _decoded_heads(dump: bytes):
    import base64
    import gzip

    import numpy as np

    return np.frombuffer(gzip.decompress(base64.b85decode(dump)), dtype=bool).reshape(4, 6)
