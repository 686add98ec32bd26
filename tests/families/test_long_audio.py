"""Audio of any length. One prompt takes audio up to the bundle's capacity (recorded in the manifest, shown by
`inspect`; the default covers 10 minutes); longer audio is transcribed in windows, each its own prompt, cut at the
quietest 100 ms near each limit, each giving the tokens it gives alone and the eager model gives; the windows are
views into the one decoded recording; a chat prompt beyond the capacity is one error line naming the flags."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from runner.app.cli import build_parser, main
from runner.audio import N_SAMPLES, PROMPT_ROOM, SAMPLE_RATE, TOKENS_PER_CHUNK, context_for, load_audio
from runner.audio_chunks import CUT_FRAME, CUT_SEARCH, audio_windows, window_bounds
from runner.bundle import read_manifest
from runner.errors import AudioError
from runner.export.options import ExportOptions
from runner.families import voxtral as voxtral_family
from runner.families.voxtral import Tekken, VoxtralFamily, transcription_prompt
from runner.reference import eager_engine
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.program import Program
from runner.runtime.prompt import AudioSegment
from runner.runtime.results import join_texts

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
AUDIO = FIXTURES / "audio"
SR = SAMPLE_RATE
VOXTRAL_CONTEXT = 32768  # the 3B's trained context: ~30 min transcribed in one prompt (DESIGN.md §3)
GAPS = ((24.0, 25.0), (50.0, 51.0))  # the only quiet places in the long test recording, in seconds
NEW_TOKENS = "6"


def speech_with_gaps(seconds: float, gaps=GAPS, seed: int = 0) -> np.ndarray:
    """Fixture speech end to end over a noise floor louder than its own pauses, with digital silence over each
    (start, end) of `gaps`: the only quiet places."""
    speech = load_audio(AUDIO / "speech.wav")
    x = (np.random.default_rng(seed).standard_normal(int(seconds * SR)) * 0.01).astype(np.float32)
    for start in range(0, len(x), len(speech)):
        piece = speech[: len(x) - start]
        x[start : start + len(piece)] += piece
    for a, b in gaps:
        x[int(a * SR) : int(b * SR)] = 0.0
    return x


def write(path: Path, x: np.ndarray) -> Path:
    sf.write(path, x, SR, subtype="FLOAT")  # float WAV: load_audio gives back exactly these samples
    return path


def run_cli(bundle: Path, *args: str, json_lines: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "runner", "run", "--bundle", str(bundle), *(["--json"] if json_lines else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def records(out: subprocess.CompletedProcess) -> list[dict]:
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


def audio_args(*paths: Path) -> list[str]:
    return [a for p in paths for a in ("--audio", str(p))]


# ---------------------------------------------------------------- the capacity a bundle is exported with


def test_default_capacity_is_ten_minutes_and_flags_reach_thirty():
    args = build_parser().parse_args(["export"])
    opts = ExportOptions(max_audio_chunks=args.max_audio_chunks, max_seq_len=args.max_seq_len)
    assert opts.max_audio_chunks * N_SAMPLES / SR >= 600
    assert opts.max_seq_len == context_for(opts.max_audio_chunks)
    thirty = ExportOptions(max_audio_chunks=60)  # one flag: the context follows
    assert thirty.max_audio_chunks * N_SAMPLES / SR == 1800 and thirty.max_seq_len <= VOXTRAL_CONTEXT
    assert ExportOptions(max_audio_chunks=60, max_seq_len=VOXTRAL_CONTEXT).max_seq_len == VOXTRAL_CONTEXT


@pytest.mark.parametrize("chunks", range(1, 61))
def test_the_default_context_holds_the_audio_a_prompt_and_four_answer_tokens_a_second(chunks):
    seq = context_for(chunks)
    answer = seq - chunks * TOKENS_PER_CHUNK - PROMPT_ROOM
    assert answer >= 4 * chunks * N_SAMPLES // SR
    assert seq % 512 == 0 and answer - 512 < 4 * chunks * N_SAMPLES // SR  # rounded up, not more


# ---------------------------------------------------------------- where long audio is cut


@pytest.mark.parametrize("n", [0, 1, N_SAMPLES - 1, N_SAMPLES])
def test_audio_that_fits_is_one_window(n):
    assert window_bounds(np.zeros(n, np.float32), N_SAMPLES) == [(0, n)]


@pytest.mark.parametrize("seed", range(4))
def test_each_cut_is_the_quietest_100ms_frame_in_the_10s_before_the_limit(seed):
    """Against a plain loop over the frames, on audio whose loudness wanders (so every frame differs)."""
    rng = np.random.default_rng(seed)
    capacity = N_SAMPLES * int(rng.integers(1, 3))
    n = int(capacity * rng.uniform(2.2, 4.5))
    envelope = np.repeat(rng.uniform(0.01, 1.0, n // 1000 + 1), 1000)[:n]
    wave = (rng.standard_normal(n) * envelope).astype(np.float32)
    bounds = window_bounds(wave, capacity)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # consecutive, nothing lost or repeated
    assert all(0 < end - start <= capacity for start, end in bounds)
    for start, cut in bounds[:-1]:
        limit = start + capacity
        frames = range(limit - CUT_SEARCH, limit, CUT_FRAME)
        energy = {f: sum(float(v) ** 2 for v in wave[f : f + CUT_FRAME]) for f in frames}
        quietest = max(f for f in frames if energy[f] == min(energy.values()))
        assert cut == quietest + CUT_FRAME // 2


def test_the_cut_lands_in_the_silence():
    bounds = window_bounds(speech_with_gaps(70.0), N_SAMPLES)
    assert len(bounds) == 3
    for (_, cut), (a, b) in zip(bounds, GAPS):
        assert a * SR < cut < b * SR


def test_windows_are_views_of_the_one_recording_and_copy_nothing():
    """30 minutes cut into 30 s windows: every window shares the recording's memory, and the cutting allocates
    a small fraction of one copy (a copy per window would be the whole recording again)."""
    wave = np.zeros(30 * 60 * SR, np.float32)
    wave[::7] = 0.25  # audible, evenly: every search region has to be read
    tracemalloc.start()
    try:
        windows = audio_windows(wave, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(windows) >= 60 and sum(len(w) for w in windows) == len(wave)
    assert all(np.shares_memory(w, wave) and w.base is wave for w in windows)
    assert peak < wave.nbytes / 20, f"cutting allocated {peak / 2**20:.1f} MiB for a {wave.nbytes / 2**20:.0f} MiB file"


def test_a_long_file_is_decoded_once_and_every_window_is_a_view(monkeypatch, tmp_path):
    tok = Tekken.from_file(FIXTURES / "tekken.json")
    decoded = []

    def load_once(path):
        decoded.append(load_audio(path))
        return decoded[-1]

    monkeypatch.setattr(voxtral_family, "load_audio", load_once)
    path = write(tmp_path / "long.wav", speech_with_gaps(70.0))
    prompts = VoxtralFamily(tok).prompts(path, None, "en", 1)
    assert len(decoded) == 1 and len(prompts) == 3
    for prompt, (start, end) in zip(prompts, window_bounds(decoded[0], N_SAMPLES)):
        (audio,) = [s for s in prompt if isinstance(s, AudioSegment)]
        assert np.shares_memory(audio.samples, decoded[0]) and len(audio.samples) == end - start
        assert [s for s in prompt if s is not audio] == [
            s for s in transcription_prompt(tok, audio.samples, "en") if not isinstance(s, AudioSegment)
        ]


def test_a_chat_prompt_beyond_the_capacity_is_an_error_naming_the_flags(tmp_path):
    tok = Tekken.from_file(FIXTURES / "tekken.json")
    path = write(tmp_path / "long.wav", speech_with_gaps(70.0))
    with pytest.raises(AudioError) as e:
        VoxtralFamily(tok).prompts(path, "What is said?", None, 2)
    msg = str(e.value)
    for part in (
        str(path),
        "70.0 s long",
        "at most 60 s (exported with --max-audio-chunks 2)",
        "--max-audio-chunks 3",
        "--max-seq-len 1536",
    ):
        assert part in msg
    assert context_for(3) == 1536


def test_windowed_texts_join_with_a_space_only_where_words_would_run_together():
    assert join_texts(["Hello", "world.", " Next", "", "end "]) == "Hello world. Next end "
    assert join_texts([" a", " b"]) == " a b"  # Whisper's texts begin with a space: joined as they are


# ---------------------------------------------------------------- through the runner: a 30 s bundle


@pytest.fixture(scope="module")
def long_file(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("long") / "long_70s.wav", speech_with_gaps(70.0))


@pytest.fixture(scope="module")
def windowed(other_bundle, long_file) -> dict:
    """The 70 s file through a bundle that takes 30 s a prompt, checked against the eager model."""
    assert read_manifest(other_bundle).model["max_audio_chunks"] == 1
    out = run_cli(other_bundle, *audio_args(long_file), "--max-new-tokens", NEW_TOKENS, "--reference", "eager")
    (record,) = records(out)
    return record


def test_long_audio_is_transcribed_in_windows_cut_in_the_silence(windowed, other_bundle):
    tok = Tekken.from_file(other_bundle / "tekken.json")
    w = windowed["windows"]
    assert len(w) == 3 and windowed["stats"]["windows"] == 3
    assert w[0]["start_s"] == 0 and w[-1]["end_s"] == pytest.approx(70.0)
    for (a, b), first, second in zip(GAPS, w, w[1:]):
        assert a < first["end_s"] == second["start_s"] < b
    assert windowed["tokens"] == [t for x in w for t in x["tokens"]]
    assert windowed["reference"]["ok"] and windowed["reference"]["first_divergence"] is None
    # each window its own prompt: <s> three times, one chunk of audio positions each
    assert windowed["prompt_ids"].count(tok.bos_id) == 3
    assert windowed["prompt_ids"].count(tok.special_id("[AUDIO]")) == 3 * TOKENS_PER_CHUNK
    # stats per window, and in total
    total = windowed["stats"]
    assert total["prompt_tokens"] == len(windowed["prompt_ids"]) == sum(x["stats"]["prompt_tokens"] for x in w)
    assert total["generated_tokens"] == len(windowed["tokens"]) == sum(x["stats"]["generated_tokens"] for x in w)
    assert total["audio_seconds"] == pytest.approx(70.0) == sum(x["stats"]["audio_seconds"] for x in w)
    assert all(x["stats"]["windows"] == 1 and x["stop_reason"] in ("eos", "max_new_tokens") for x in w)
    assert windowed["text"] == join_texts(x["text"] for x in w)


def test_each_window_gives_the_tokens_it_gives_alone_and_the_eager_model_gives(windowed, other_bundle, long_file):
    wave = load_audio(long_file)
    cuts = [(round(x["start_s"] * SR), round(x["end_s"] * SR)) for x in windowed["windows"]]
    assert cuts == window_bounds(wave, N_SAMPLES)
    pieces = [write(long_file.with_name(f"piece{i}.wav"), wave[a:b]) for i, (a, b) in enumerate(cuts)]
    alone = records(run_cli(other_bundle, *audio_args(*pieces), "--max-new-tokens", NEW_TOKENS))
    assert [r["tokens"] for r in alone] == [x["tokens"] for x in windowed["windows"]]
    assert [i for r in alone for i in r["prompt_ids"]] == windowed["prompt_ids"]
    # the eager model, decoding freely (not teacher-forced), window by window
    with Program.load(other_bundle) as program:
        family = voxtral_family.VoxtralFamily.from_bundle(other_bundle, program.manifest.model)
        eager = MultimodalRunner(eager_engine(other_bundle, program.manifest), family.tokenizer, family.audio_id)
        opts = GenerationOptions(max_new_tokens=int(NEW_TOKENS))
        for (a, b), x in zip(cuts, windowed["windows"]):
            assert eager.generate(transcription_prompt(family.tokenizer, wave[a:b], None), opts).tokens == x["tokens"]


def test_streamed_text_of_windows_is_the_joined_text(windowed, other_bundle, long_file):
    out = run_cli(other_bundle, *audio_args(long_file), "--max-new-tokens", NEW_TOKENS, json_lines=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == windowed["text"] + "\n"
    assert "Audio: 70.00 s in 3 prompt windows" in out.stderr
    starts = [line.split(": ")[1].split(" s,")[0] for line in out.stderr.splitlines() if line.startswith("window ")]
    assert starts == [f"{x['start_s']:.1f}-{x['end_s']:.1f}" for x in windowed["windows"]]


def test_chat_beyond_the_capacity_is_one_error_line(other_bundle, long_file):
    out = run_cli(other_bundle, *audio_args(long_file), "--prompt", "What is said?", json_lines=False)
    assert out.returncode != 0 and out.stdout == ""
    lines = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("== ")]
    assert len(lines) == 1 and lines[0].startswith(f"error: {long_file}: audio is 70.0 s long"), out.stderr
    assert (
        "at most 30 s (exported with --max-audio-chunks 1)" in lines[0]
        and "--max-audio-chunks 3 (--max-seq-len 1536" in lines[0]
    )


def test_inspect_shows_the_capacity(other_bundle, default_tiny_bundle, capsys):
    for bundle in (other_bundle, default_tiny_bundle):
        m = read_manifest(bundle).model
        k, seq = m["max_audio_chunks"], m["max_seq_len"]
        assert main(["inspect", str(bundle), "--no-verify"]) == 0
        text = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
        seconds = k * N_SAMPLES // SR
        length = f"{seconds // 60} min" if seconds >= 60 else f"{seconds} s"
        answer = seq - k * TOKENS_PER_CHUNK - PROMPT_ROOM
        assert (
            f"capacity: {length} of audio in one prompt ({k * TOKENS_PER_CHUNK} decoder positions, {answer} left "
            "for the answer); longer audio is transcribed in windows" in text
        )
        assert main(["inspect", str(bundle), "--json", "--no-verify"]) == 0
        cap = json.loads(capsys.readouterr().out)["model"]["capacity"]
        assert cap == {"audio_seconds": seconds, "audio_positions": k * TOKENS_PER_CHUNK, "answer_positions": answer}


# ---------------------------------------------------------------- the default tiny bundle: 70 s in one prompt


def test_default_bundle_takes_a_70s_clip_in_one_prompt_alike_in_one_process_and_in_several(
    default_tiny_bundle, tmp_path
):
    """A clip no other test uses (two recordings and a pause, 70 s): one window of three chunks, the same tokens
    whether it runs beside other files in one process or alone, and the eager model's."""
    long, speech = load_audio(AUDIO / "long_35s.flac"), load_audio(AUDIO / "speech.wav")
    head = np.concatenate([long, np.zeros(SR, np.float32), speech])
    clip = write(tmp_path / "clip_70s.wav", np.concatenate([head, long[: 70 * SR - len(head)]]))
    assert read_manifest(default_tiny_bundle).model["capacity"]["audio_seconds"] >= 600
    files = [clip, AUDIO / "speech.wav", clip]
    together = records(
        run_cli(default_tiny_bundle, *audio_args(*files), "--max-new-tokens", "24", "--reference", "eager")
    )
    first, audio_id = together[0], Tekken.from_file(default_tiny_bundle / "tekken.json").special_id("[AUDIO]")
    assert len(first["windows"]) == 1 and first["prompt_ids"].count(audio_id) == 3 * TOKENS_PER_CHUNK
    assert first["reference"]["ok"] and first["reference"]["first_divergence"] is None
    assert together[2]["tokens"] == first["tokens"]  # the program's state carries nothing from file to file
    for path, record in zip(files[:2], together):
        (alone,) = records(run_cli(default_tiny_bundle, *audio_args(path), "--max-new-tokens", "24"))
        assert alone["tokens"] == record["tokens"] and alone["prompt_ids"] == record["prompt_ids"], path
