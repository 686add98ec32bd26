"""Every common container load_audio reads (runner/audio.py): libsndfile's formats on its fast path, PyAV
(ffmpeg) for the rest. Each file is made here from fixtures/audio/speech.wav by PyAV's encoders (sox for its mp3,
when installed) and transcribed by the tiny bundle. Lossless codecs must give the wav's samples and tokens;
lossy ones the samples and tokens of the same file decoded by PyAV directly (its own resampler converting the
sample format, not ours), written as a float WAV at the file's own rate and channels."""

from __future__ import annotations

import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import AUDIO, prompt_for, runner_for

from runner.audio import load_audio
from runner.errors import AudioError
from runner.runtime.generate import GenerationOptions
from runner.runtime.program import Program

av = pytest.importorskip("av")

SPEECH = AUDIO / "speech.wav"
# name -> (container format, audio codec, video codec or None, sample rate); the rate is the codec's own
LOSSLESS = {
    "alac.m4a": ("mp4", "alac", None, 16000),
    "flac.mka": ("matroska", "flac", None, 16000),
    "pcm_with_video.mov": ("mov", "pcm_s16le", "mpeg4", 16000),
}
LOSSY = {
    "aac.m4a": ("mp4", "aac", None, 16000),
    "aac_with_video.mp4": ("mp4", "aac", "mpeg4", 16000),
    "opus.webm": ("webm", "libopus", None, 48000),
    "raw.aac": ("adts", "aac", None, 16000),
}
TOKENS = GenerationOptions(max_new_tokens=24)


def encode(path: Path, container: str, codec: str, video: str | None, rate: int) -> Path:
    """speech.wav muxed by PyAV: its int16 samples (resampled by ffmpeg where the codec needs another rate)."""
    samples, sr = sf.read(SPEECH, dtype="int16")
    with av.open(str(path), "w", format=container) as out:
        audio = out.add_stream(codec, rate=rate, layout="mono")
        want = audio.codec_context.codec.audio_formats[0].name
        convert = av.AudioResampler(format=want, layout="mono", rate=rate)
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")
        frame.sample_rate, frame.pts = sr, 0
        frames = convert.resample(frame) + convert.resample(None)
        if video is not None:
            picture = out.add_stream(video, rate=10)
            picture.width = picture.height = 64
            picture.pix_fmt = "yuv420p"
            for i in range(int(len(samples) / sr * 10)):
                image = av.VideoFrame.from_ndarray(np.full((64, 64, 3), 40 * i % 256, np.uint8), format="rgb24")
                image.pts = i
                out.mux(picture.encode(image))
            out.mux(picture.encode(None))
        size = audio.codec_context.frame_size or 1024  # the encoder takes frames of its own size
        fifo = av.AudioFifo()
        for f in frames:
            f.pts = None  # numbered afresh below, in the encoder's frames
            fifo.write(f)
        done = 0
        while (f := fifo.read(size) or fifo.read(0)) is not None:
            f.pts, f.time_base, done = done, Fraction(1, rate), done + f.samples  # Matroska needs each packet's time
            out.mux(audio.encode(f))
        out.mux(audio.encode(None))
    return path


def reference_wav(path: Path, dest: Path) -> Path:
    """The first audio track of `path` decoded by PyAV and converted by its resampler to packed float32 at the
    track's own rate and layout, written as a float WAV: load_audio then mixes and resamples it as any file."""
    with av.open(str(path)) as f:
        stream = f.streams.audio[0]
        convert = av.AudioResampler(format="flt", layout=stream.layout.name, rate=stream.rate)
        blocks = [g.to_ndarray().reshape(-1, stream.channels) for fr in f.decode(stream) for g in convert.resample(fr)]
        blocks += [g.to_ndarray().reshape(-1, stream.channels) for g in convert.resample(None)]
    sf.write(dest, np.concatenate(blocks), stream.rate, subtype="FLOAT")
    return dest


@pytest.fixture(scope="module")
def runner(tiny_bundle):
    with Program.load(tiny_bundle) as program:
        yield runner_for(program)


def tokens(runner, path: Path) -> list[int]:
    return list(runner.generate(prompt_for(runner, path, language="en"), TOKENS).tokens)


@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_containers_give_the_wav_s_samples_and_tokens(tmp_path, runner, name):
    path = encode(tmp_path / name, *LOSSLESS[name])
    with pytest.raises(sf.LibsndfileError):  # this is PyAV's path: libsndfile cannot open the container
        sf.info(path)
    np.testing.assert_array_equal(load_audio(path), load_audio(SPEECH))
    assert tokens(runner, path) == tokens(runner, SPEECH)


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_containers_give_pyav_s_own_decode(tmp_path, runner, name):
    path = encode(tmp_path / name, *LOSSY[name])
    ref = reference_wav(path, tmp_path / "reference.wav")
    wave = load_audio(path)
    np.testing.assert_array_equal(wave, load_audio(ref))
    assert abs(len(wave) - sf.info(SPEECH).frames) <= 2048 + 1024  # the codec's priming and last frame at most
    assert tokens(runner, path) == tokens(runner, ref)


@pytest.mark.skipif(shutil.which("sox") is None, reason="sox is not installed (apt-get install sox libsox-fmt-mp3)")
@pytest.mark.parametrize("rate", [22050, 44100])
def test_an_mp3_written_by_sox_reads_whole(tmp_path, runner, rate):
    """libsndfile estimates an mp3's frame count; sox's at 22.05/44.1 kHz came out a frame longer than their
    samples, and load_audio refused them as truncated. ffmpeg decodes the same number of samples."""
    wav, mp3 = tmp_path / "in.wav", tmp_path / "speech.mp3"
    subprocess.run(["sox", "-D", str(SPEECH), "-r", str(rate), str(wav)], check=True)
    done = subprocess.run(["sox", "-D", str(wav), str(mp3)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"this sox writes no mp3 (apt-get install libsox-fmt-mp3): {done.stderr.strip()}")
    ref = reference_wav(mp3, tmp_path / "reference.wav")
    wave, expected = load_audio(mp3), load_audio(ref)
    assert len(wave) == len(expected)  # the whole file: libsndfile (mpg123) and ffmpeg decode as many samples
    # two mp3 decoders (mpg123, ffmpeg's) round differently: the same signal within 16-bit resolution
    assert np.abs(wave - expected).max() < 2**-15
    assert tokens(runner, mp3) == tokens(runner, ref)


def test_a_video_without_audio_names_the_container_and_its_streams(tmp_path):
    path = tmp_path / "silent_film.mp4"
    with av.open(str(path), "w", format="mp4") as out:
        picture = out.add_stream("mpeg4", rate=10)
        picture.width = picture.height = 64
        picture.pix_fmt = "yuv420p"
        for i in range(5):
            image = av.VideoFrame.from_ndarray(np.zeros((64, 64, 3), np.uint8), format="rgb24")
            image.pts = i
            out.mux(picture.encode(image))
        out.mux(picture.encode(None))
    with pytest.raises(
        AudioError, match=r"no audio track in .*silent_film\.mp4 \(container: MP4/M4A/MOV; streams: video\)"
    ):
        load_audio(path)


@pytest.mark.parametrize(
    "name, data, container",
    [
        ("song.m4a", b"\0\0\0\x20ftypM4A \0\0\0\0M4A mp42isom" + bytes(4000), "MP4/M4A/MOV"),
        ("clip.webm", b"\x1aE\xdf\xa3" + bytes(3000), "Matroska/WebM"),
        ("notes.mp3", b"not the samples you are looking for\n" * 40, None),
    ],
)
def test_a_file_nothing_reads_is_one_line_naming_it_and_its_container(tmp_path, name, data, container):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(AudioError) as err:
        load_audio(path)
    msg = str(err.value)
    assert msg.startswith(f"not a readable audio file: {path} (container: ") and "\n" not in msg
    if container is not None:
        assert f"(container: {container};" in msg


def test_the_wav_path_is_libsndfile_s_alone():
    """The fast path: a wav is read once by libsndfile; PyAV is not even imported."""
    code = "import sys, runner.audio as a; a.load_audio(sys.argv[1]); sys.exit('av' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code, str(AUDIO / "speech_48k_stereo.wav")], cwd=root).returncode == 0


def test_audio_module_imports_no_decoder_at_module_level():
    code = "import sys, runner.audio; sys.exit(any(m in sys.modules for m in ('numpy', 'soundfile', 'soxr', 'av')))"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0


def test_a_folder_lists_every_container_and_says_in_one_line_what_it_skipped(tmp_path, capsys):
    from runner.app.folder import audio_suffixes, list_dir

    names = ["a.wav", "b.M4A", "c.mp4", "d.webm", "e.opus", "f.mp3", "g.mkv", "h.txt", "i.txt", "j.jpg", ".k.wav"]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    found = list_dir(tmp_path, False, audio_suffixes())
    assert [p.name for p in found] == names[:7]
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"note: --audio-dir {tmp_path}: skipped 4 file(s): 2 .txt, 1 .jpg (not audio file names) and 1 hidden "
        '(names starting with ".")'
    ]


def test_a_wav_of_64_bit_pcm_reads_as_its_numbers(tmp_path):
    """libsndfile refuses 64-bit integer PCM; ffmpeg decodes it to a sample format PyAV cannot convert to an
    array: the samples are read from the frame's planes, scaled as the other integer widths are (x / 2^63)."""
    import struct

    from runner.audio import load_audio

    ints = (np.sin(np.arange(16000) / 7) * 0.5 * 2**63).astype("<i8")
    data = ints.tobytes()
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, 16000, 16000 * 8, 8, 64)
    path = tmp_path / "s64.wav"
    path.write_bytes(
        b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", len(data)) + data
    )
    got = load_audio(path)
    assert got.dtype == np.float32 and len(got) == len(ints)
    np.testing.assert_array_equal(got, (ints.astype(np.float64) / 2**63).astype(np.float32))
