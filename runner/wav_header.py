"""The RIFF/WAVE header, read chunk by chunk from the bytes: what libsndfile leaves unchecked (a data chunk cut
short), what it leaves unsaid (the codec of a WAV it refused) and the header of a WAV piped in, which no library
reads from a stream.

struct and the file only, no numpy: the checks run before any decoder is imported.
"""

from __future__ import annotations

import os
import struct

from runner.errors import AudioError

WAV_UNKNOWN_SIZES = (0, 0xFFFFFFFF)  # streaming writers leave the data size unset
# WAV format tags libsndfile decodes: PCM, MS ADPCM, float, A-law, mu-law, IMA ADPCM, GSM 6.10, G.721, MPEG-3,
# extensible. Only used to word the error for a file libsndfile has already refused.
WAV_CODECS = {0x0001, 0x0002, 0x0003, 0x0006, 0x0007, 0x0011, 0x0031, 0x0040, 0x0055, 0xFFFE}


def wav_stream_header(read, name: str) -> tuple[int, int, int, int, int]:
    """(format tag, channels, rate, bits, data size) from the chunks after RIFF/WAVE, stopping at `data`."""
    fmt = None
    while len(hdr := read(8)) == 8:
        chunk_id, size = struct.unpack("<4sI", hdr)
        if chunk_id == b"data":
            if fmt is None:
                break
            return (*fmt, size)
        body = read(size + (size & 1))
        if chunk_id == b"fmt " and len(body) >= 16:
            tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
            if tag == 0xFFFE and len(body) >= 26:  # extensible: the real tag opens the sub-format GUID
                tag = struct.unpack("<H", body[24:26])[0]
            fmt = (tag, channels, rate, bits)
    raise AudioError(f"WAV header on {name} has no {'data' if fmt else 'fmt '} chunk before the stream ended")


def check_wav_not_truncated(path: str) -> None:
    """libsndfile reads a WAV cut short without complaint, so compare the declared data size with the file's."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if f.read(12)[:4] != b"RIFF":
            return  # not a RIFF/WAVE file (or RF64): nothing to check here
        pos = 12
        while pos + 8 <= size:
            f.seek(pos)
            chunk_id, chunk_size = struct.unpack("<4sI", f.read(8))
            if chunk_id == b"data":
                have = size - (pos + 8)
                if chunk_size not in WAV_UNKNOWN_SIZES and have < chunk_size:
                    raise AudioError(
                        f"truncated audio file: {path} (WAV data chunk declares {chunk_size} bytes, {have} present)"
                    )
                return
            pos += 8 + chunk_size + (chunk_size & 1)  # chunks are padded to even sizes


def wav_format_tag(path: str) -> int | None:
    """The format tag of a RIFF/WAVE file's `fmt ` chunk; None for anything else."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
                return None
            while len(hdr := f.read(8)) == 8:
                chunk_id, chunk_size = struct.unpack("<4sI", hdr)
                if chunk_id == b"fmt ":
                    tag = f.read(2)
                    return struct.unpack("<H", tag)[0] if len(tag) == 2 else None
                f.seek(chunk_size + (chunk_size & 1), os.SEEK_CUR)
    except OSError:
        pass
    return None
