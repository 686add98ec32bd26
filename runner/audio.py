"""Runtime audio front end: read a file (or a WAV stream) into float32 mono 16 kHz samples, and the constants every
other module derives its shapes from, with how much audio one prompt's context is sized for.

The mel spectrogram itself is computed by the exported `preprocessor` method (runner/export/mel.py), so this
module needs no torch. Samples fitted to a bundle's chunks and windows: runner/audio_chunks.py; the WAV header's
bytes: runner/wav_header.py.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from runner.errors import AudioError
from runner.wav_header import WAV_CODECS, WAV_UNKNOWN_SIZES, check_wav_not_truncated, wav_format_tag, wav_stream_header

if (
    TYPE_CHECKING
):  # numpy is imported where samples are handled: the CLI's parser (and noxfile) import only the constants
    import numpy as np

SAMPLE_RATE = 16000  # Hz; Whisper / Voxtral front end
N_FFT = 400  # 25 ms STFT window
HOP_LENGTH = 160  # 10 ms hop
CHUNK_LENGTH = 30  # seconds of audio per encoder chunk
N_SAMPLES = CHUNK_LENGTH * SAMPLE_RATE  # 480000 samples in a 30-second chunk
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames in a chunk (the STFT's last frame is dropped)
N_MELS = 128  # Voxtral's mel bins (Whisper large-v3 style)
# 3000 frames -> 1500 after the encoder's stride-2 conv -> 375 after the projector groups 4 frames into one token.
TOKENS_PER_CHUNK = N_FRAMES // 2 // 4

MIN_RATE, MAX_RATE = 1000, 768000  # Hz; outside this a header is damaged, not a recording
MAX_SECONDS = 4 * 3600  # longer than any bundle takes by far; refused before decoding
MAX_SAMPLES = 1 << 29  # frames x channels: 2 GiB of float32


def load_audio(path: str | os.PathLike) -> np.ndarray:
    """Read an audio file into float32 mono at SAMPLE_RATE: channels averaged, any other rate resampled (soxr).

    libsndfile reads what it can (wav, flac, ogg, mp3, aiff: the fast path, no copy beyond its own read); PyAV
    (ffmpeg) reads the rest: m4a/AAC, the audio track of mp4/mov/mkv (video ignored), webm/Opus, anything ffmpeg
    demuxes. Raises AudioError, one line naming the file, for anything that is not complete, finite audio.
    Silence is valid audio.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise AudioError(f"audio file not found: {path}")
    if not os.path.isfile(path):
        raise AudioError(f"audio path is not a file: {path}")
    if os.path.getsize(path) == 0:
        raise AudioError(f"audio file is empty (0 bytes): {path}")
    check_wav_not_truncated(path)

    wave = _load_soundfile(path)
    if wave is None:
        wave = _read_av(path)
    return wave


def _to_mono(path: str, data: np.ndarray, sr: int) -> np.ndarray:
    """[frames, channels] float32 samples at `sr` as float32 mono at SAMPLE_RATE, in one piece."""
    import numpy as np

    # Imported here, not at the top: the constants and chunking must also work where only torch is installed
    # (the export machine imports them through runner/export/mel.py).
    import soxr

    _check_finite(path, data)
    # float64 sum: finite float32 samples near 3e38 in several channels overflowed to inf (found by atheris)
    wave = data.mean(axis=1, dtype=np.float64).astype(np.float32) if data.shape[1] > 1 else data[:, 0]
    if sr != SAMPLE_RATE:
        wave = soxr.resample(wave, sr, SAMPLE_RATE)
    return _checked_mono(path, wave, len(data), sr, lambda: float(np.abs(data).max()) if len(data) else 0.0)


def _check_finite(path: str, data: np.ndarray) -> None:
    import numpy as np

    if not np.isfinite(data).all():
        raise AudioError(f"audio file contains NaN or Inf samples: {path}")


def _checked_mono(path: str, wave: np.ndarray, frames: int, sr: int, peak) -> np.ndarray:
    """The mixed and resampled samples, refusing none at all and any the resampler overflowed (`peak()`: the
    input's largest magnitude, for the message)."""
    import numpy as np

    if frames == 0:
        raise AudioError(f"audio file has no samples (empty or truncated): {path}")
    if len(wave) == 0:  # a few frames at a high rate
        raise AudioError(
            f"audio file is shorter than one sample at {SAMPLE_RATE} Hz: {path} ({frames} frames at {sr} Hz)"
        )
    if not np.isfinite(wave).all():  # resampling samples near the float32 limit can overflow
        raise AudioError(f"audio file has samples too large to process (peak {peak():.3g}): {path}")
    return np.ascontiguousarray(wave, dtype=np.float32)


# A file of more frames than one block holds is read, mixed and resampled block by block: memory then grows with
# the output (its duration at SAMPLE_RATE), not with the file's frames x channels. Smaller files: one read.
BLOCK_BYTES = 8 << 20  # float32 samples (all channels) per block


class _MonoStream:
    """Float32 mono SAMPLE_RATE samples built from [frames, channels] float32 blocks at `sr`, each mixed by mean
    and resampled by soxr's stream resampler (which gives exactly what soxr.resample gives the whole file) into
    one output array sized from the declared frame count (grown if a stream runs longer)."""

    def __init__(self, path: str, sr: int, declared: int):
        import numpy as np
        import soxr

        self.path, self.sr, self.frames, self.peak, self.n = path, sr, 0, 0.0, 0
        self.resampler = soxr.ResampleStream(sr, SAMPLE_RATE, 1, dtype="float32") if sr != SAMPLE_RATE else None
        self.out = np.empty(math.ceil(declared * SAMPLE_RATE / sr) + 16, np.float32)

    def add(self, block: np.ndarray, last: bool) -> None:
        import numpy as np

        _check_finite(self.path, block)
        if len(block):
            self.peak = max(self.peak, float(block.max()), -float(block.min()))
        self.frames += len(block)
        wave = block.mean(axis=1, dtype=np.float64).astype(np.float32) if block.shape[1] > 1 else block[:, 0]
        if self.resampler is not None:
            wave = self.resampler.resample_chunk(wave, last=last)
        if self.n + len(wave) > len(self.out):
            self.out = np.resize(self.out, max(2 * len(self.out), self.n + len(wave)))
        self.out[self.n : self.n + len(wave)] = wave
        self.n += len(wave)

    def result(self) -> np.ndarray:
        return _checked_mono(self.path, self.out[: self.n], self.frames, self.sr, lambda: self.peak)


def _load_soundfile(path: str) -> np.ndarray | None:
    """Float32 mono SAMPLE_RATE samples by libsndfile; None for a container it does not know (or a WAV codec it
    lacks), which PyAV then tries."""
    import numpy as np
    import soundfile as sf

    try:
        with sf.SoundFile(os.fsencode(path)) as f:  # bytes: a name that is not UTF-8 (soundfile encodes str so)
            declared, sr, estimated = f.frames, f.samplerate, f.format == "MP3"
            _check_plausible(path, sr, declared, f.channels)  # before read() allocates what the header claims
            block = max(1, BLOCK_BYTES // (4 * f.channels))
            if declared <= block:
                data = f.read(dtype="float32", always_2d=True)  # [frames, channels]
                _check_complete(path, len(data), declared, estimated)
                return _to_mono(path, data, sr)
            mono = _MonoStream(path, sr, declared)
            for data in f.blocks(block, dtype="float32", always_2d=True):
                mono.add(data, last=False)
            mono.add(np.zeros((0, f.channels), np.float32), last=True)
            _check_complete(path, mono.frames, declared, estimated)
            return mono.result()
    except sf.LibsndfileError as e:
        if "Error opening" in str(e) or wav_format_tag(path) not in (None, *WAV_CODECS):
            return None  # "Format not recognised" / "Malformed 'fmt ' chunk": not libsndfile's to read
        raise AudioError(f"truncated or corrupt audio: {path} ({_one_line(e)})") from None
    except (RuntimeError, ValueError, TypeError) as e:
        raise AudioError(f"cannot read audio file: {path} ({_one_line(e)})") from None


def _check_complete(path: str, read: int, declared: int, estimated: bool) -> None:
    """libsndfile can stop early on a damaged stream without raising; a short read means the file lies. Not for
    MP3, whose frame count libsndfile only estimates (a sox-written mp3 at 22.05 kHz: 249 frames over; ffmpeg
    decodes exactly the frames libsndfile read)."""
    if read < declared and not estimated:
        raise AudioError(f"truncated audio file: {path} (read {read} of {declared} frames)")


def _read_av(path: str) -> np.ndarray:
    """Float32 mono SAMPLE_RATE samples of the first audio track, decoded by PyAV (ffmpeg), as faster-whisper
    reads audio, but without its resampler: the samples are converted exactly as libsndfile converts them
    (int16 / 32768, ...), so the mix-down and soxr resampling are the same for both readers."""
    import av

    with contextlib.ExitStack() as stack:
        try:
            try:
                container = stack.enter_context(av.open(path, metadata_errors="ignore"))
            except UnicodeError:  # a name that is not UTF-8: ffmpeg takes the open file instead
                file = stack.enter_context(open(path, "rb"))
                container = stack.enter_context(av.open(file, metadata_errors="ignore"))
        except av.error.FFmpegError as e:
            raise _unreadable(path, None, e) from None
        if not container.streams.audio:
            kinds = ", ".join(sorted({s.type for s in container.streams})) or "none"
            raise AudioError(
                f"no audio track in {path} (container: {_container_name(path, container)}; streams: {kinds})"
            )
        stream = container.streams.audio[0]
        if stream.codec_context is None:  # a track in a codec this ffmpeg has no decoder for
            raise _unreadable(path, container, "no decoder for its audio codec")
        expected = 0
        if stream.duration is not None and stream.time_base is not None and stream.rate:
            expected = int(stream.duration * stream.time_base * stream.rate)
            _check_plausible(path, stream.rate, expected, 1)
        try:
            wave = _decode_av(path, container, stream, expected)
        except av.error.FFmpegError as e:
            raise AudioError(f"truncated or corrupt audio: {path} (ffmpeg: {e.strerror})") from None
        if wave is None:  # ffmpeg guessed a container from the name or a few bytes, and decoded nothing
            raise _unreadable(path, container, "no audio decoded")
    return wave


def _decode_av(path: str, container, stream, expected: int) -> np.ndarray | None:
    """Every frame of `stream` as float32 mono SAMPLE_RATE samples (None when no frame decoded). The frames are
    gathered into blocks of BLOCK_BYTES; a stream longer than one is mixed and resampled block by block."""
    import numpy as np

    pending, held, sr, channels, total, mono = [], 0, None, None, 0, None
    for frame in container.decode(stream):
        shape = (frame.sample_rate, frame.layout.nb_channels)
        if sr is None:
            sr, channels = shape
            _check_plausible(path, sr, 0, channels)
        elif shape != (sr, channels):
            raise AudioError(f"audio changes rate or channels mid-stream ({sr} Hz x {channels} to "
                             f"{shape[0]} Hz x {shape[1]}): {path}")  # fmt: skip
        block = _frame_samples(frame, channels)
        total += len(block)
        _check_plausible(path, sr, total, channels)  # a stream longer than its header said (or had none)
        pending.append(block)
        held += block.nbytes
        if held >= BLOCK_BYTES:
            mono = mono or _MonoStream(path, sr, max(expected, total))
            mono.add(np.concatenate(pending), last=False)
            pending, held = [], 0
    if sr is None:
        return None
    data = np.concatenate(pending) if pending else np.zeros((0, channels), np.float32)
    if mono is None:
        return _to_mono(path, data, sr)
    mono.add(data, last=True)
    return mono.result()


# ffmpeg's sample formats by numpy dtype: integers scaled as libsndfile scales them to float (x / 2^(bits-1))
_INT_SCALE = {"int16": 1 / 32768, "int32": 1 / 2**31, "int64": 1 / 2**63}


def _frame_samples(frame, channels: int) -> np.ndarray:
    """One decoded frame as float32 [samples, channels]."""
    import numpy as np

    a = _frame_array(frame, channels)  # planar: [channels, samples]; packed: [1, samples * channels]
    a = a.T if frame.format.is_planar else a.reshape(-1, channels)
    if a.dtype == np.uint8:
        return ((a.astype(np.float32) - 128) / 128).astype(np.float32)
    if a.dtype.name in _INT_SCALE:
        return (a.astype(np.float64) * _INT_SCALE[a.dtype.name]).astype(np.float32)
    return a.astype(np.float32)


def _frame_array(frame, channels: int) -> np.ndarray:
    """The frame's samples as PyAV lays them out. PyAV converts every ffmpeg sample format but 64-bit integers
    (a WAV of 64-bit PCM decodes to them): those are read from the planes, each padded past its samples."""
    import numpy as np

    if frame.format.name not in ("s64", "s64p"):
        return frame.to_ndarray()
    per_plane = frame.samples * (1 if frame.format.is_planar else channels)
    return np.stack([np.frombuffer(bytes(p), dtype="<i8")[:per_plane] for p in frame.planes])


# The first bytes of the containers people have, to name what a file is when nothing could read it.
_MAGIC = (
    (0, b"RIFF", "RIFF (WAV)"), (0, b"RF64", "RF64 (WAV)"), (0, b"fLaC", "FLAC"), (0, b"OggS", "Ogg"),
    (0, b"ID3", "MP3 (ID3 tag)"), (4, b"ftyp", "MP4/M4A/MOV"), (0, b"\x1aE\xdf\xa3", "Matroska/WebM"),
    (0, b"FORM", "AIFF"), (0, b".snd", "AU"), (0, b"caff", "CAF"), (0, b"0&\xb2u", "ASF (WMA)"),
)  # fmt: skip


def _container_name(path: str, container=None) -> str:
    """The container a file's first bytes say it is, else ffmpeg's guess, else that none was recognised."""
    with open(path, "rb") as f:
        head = f.read(16)
    for offset, magic, name in _MAGIC:
        if head[offset : offset + len(magic)] == magic:
            return name
    if container is not None:
        return f"{container.format.name} (ffmpeg's guess)"
    return "none recognised"


def _unreadable(path: str, container, why: str | Exception) -> AudioError:
    from av.error import FFmpegError as av_error

    detail = f"ffmpeg: {why.strerror}" if isinstance(why, av_error) else why
    tag = wav_format_tag(path)
    if tag is not None and tag not in WAV_CODECS:  # libsndfile only says "Malformed 'fmt ' chunk"
        return AudioError(
            f"unsupported WAV codec (format tag 0x{tag:04x}): {path}; convert it to PCM WAV, FLAC or Ogg ({detail})"
        )
    return AudioError(f"not a readable audio file: {path} (container: {_container_name(path, container)}; {detail})")


# ---------------------------------------------------------------- capacity: how much audio one prompt takes

DEFAULT_AUDIO_CHUNKS = 20  # the export default: 10 minutes of audio in one prompt
PROMPT_ROOM = 16  # decoder positions a prompt's text takes beside its audio (transcription: 4 to 8)
# The answer room the default context leaves per chunk: 4 tokens a second, above dense read speech (~3 words a
# second at ~1.3 Tekken tokens a word), so the transcript of a full prompt fits after it.
ANSWER_TOKENS_PER_SECOND = 4
ANSWER_TOKENS_PER_CHUNK = ANSWER_TOKENS_PER_SECOND * CHUNK_LENGTH
DEFAULT_ANSWER_TOKENS = 128  # `run`'s cap on new tokens for short audio (longer audio: ANSWER_TOKENS_PER_SECOND)
MIN_ANSWER_ROOM = 64  # the least room for an answer an export may leave after its longest audio and the prompt


def context_for(chunks: int) -> int:
    """The default --max-seq-len for `chunks` 30 s chunks: their audio positions, the prompt and the answer room,
    rounded up to a multiple of 512 (1 chunk: 512, 2: 1024, 20: 10240, 60: 30208)."""
    need = chunks * (TOKENS_PER_CHUNK + ANSWER_TOKENS_PER_CHUNK) + PROMPT_ROOM
    return -(-need // 512) * 512


# ---------------------------------------------------------------- a WAV stream (stdin): header, then blocks

# numpy dtypes of the WAV sample encodings a stream may carry, by (format tag, bits per sample)
_WAV_STREAM_DTYPES = {(1, 8): "u1", (1, 16): "<i2", (1, 24): "i3", (1, 32): "<i4", (3, 32): "<f4", (3, 64): "<f8"}


def is_wav_header(head: bytes) -> bool:
    """Whether a stream's first 12 bytes are a RIFF/WAVE header (raw PCM never starts so)."""
    return len(head) >= 12 and head[:4] == b"RIFF" and head[8:12] == b"WAVE"


def wav_stream_blocks(read, block: int, name: str = "stdin") -> Iterator[np.ndarray]:
    """Float32 mono SAMPLE_RATE blocks of a WAV stream whose 12-byte RIFF header was already read: the chunks up
    to `data` are parsed, then its samples are read `block` frames at a time and mixed and resampled exactly as
    load_audio does a file (mean over channels in float64; soxr's stream resampler, which gives the samples
    soxr.resample gives a whole file). A streaming writer's unknown data size reads to the end of the stream."""
    import numpy as np
    import soxr

    tag, channels, rate, bits, size = wav_stream_header(read, name)
    dtype = _WAV_STREAM_DTYPES.get((tag, bits))
    if dtype is None:
        raise AudioError(f"unsupported WAV encoding on {name} (format tag 0x{tag:04x}, {bits} bits); pipe PCM or "
                         "float WAV")  # fmt: skip
    _check_plausible(name, rate, 0, channels)
    width = bits // 8 * channels
    resampler = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32") if rate != SAMPLE_RATE else None
    left = None if size in WAV_UNKNOWN_SIZES else size
    tail = b""
    while left is None or left > 0:
        chunk = read(block * width if left is None else min(block * width, left))
        last = not chunk
        if chunk:
            left = None if left is None else left - len(chunk)
            data, cut = tail + chunk, len(tail + chunk) // width * width  # a frame split across reads waits
            data, tail = data[:cut], data[cut:]
            wave = _wav_frames(np.frombuffer(data, np.uint8), dtype, channels)
        else:
            wave = np.zeros(0, np.float32)
        last = last or left == 0
        if resampler is not None:
            wave = resampler.resample_chunk(wave, last=last)
        if len(wave):
            yield wave
        if last:
            return


def _wav_frames(raw: np.ndarray, dtype: str, channels: int) -> np.ndarray:
    """Interleaved little-endian samples as float32 mono, scaled as libsndfile scales them and mixed by mean."""
    import numpy as np

    if dtype == "i3":  # 24-bit: each sample's 3 bytes under a zero byte make an int32 of 256x the value
        wide = np.zeros((len(raw) // 3, 4), np.uint8)
        wide[:, 1:] = raw.reshape(-1, 3)
        x = wide.view("<i4")[:, 0].astype(np.float64) / 2**31
    elif dtype == "u1":
        x = (raw.astype(np.float64) - 128) / 128
    else:
        x = np.frombuffer(raw.tobytes(), dtype)
        x = x.astype(np.float64) * _INT_SCALE[x.dtype.name] if x.dtype.kind == "i" else x
    frames = x.astype(np.float32).reshape(-1, channels)
    return frames.mean(axis=1, dtype=np.float64).astype(np.float32) if channels > 1 else frames[:, 0]


def _check_plausible(path: str, sr: int, frames: int, channels: int) -> None:
    """Header values no real recording has (seen fuzzing: a flipped AIFF byte made 67 MHz, which resampled to
    no samples at all), and sizes that would make read() allocate gigabytes on the header's word."""
    if not MIN_RATE <= sr <= MAX_RATE:
        raise AudioError(f"unsupported sample rate {sr} Hz (expected {MIN_RATE} to {MAX_RATE} Hz): {path}")
    if frames / sr > MAX_SECONDS or frames * channels > MAX_SAMPLES:
        raise AudioError(
            f"audio file too large: {path} ({frames / sr:.0f} s, {channels} channels; at most "
            f"{MAX_SECONDS // 3600} h and {MAX_SAMPLES:,} samples)"
        )


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
