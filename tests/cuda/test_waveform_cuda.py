"""The waveform's page-locked host buffer (runner/runtime/waveform.py) on a GPU: the padded waveform as the host
padding gives it, the buffer grown to the longest audio, and never written again while a copy out of it is still
queued. Skipped without a GPU (CI has none); the GPU machine runs tests/cuda."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.audio import N_SAMPLES
from runner.audio_chunks import pad_to_chunks
from runner.runtime.waveform import PinnedHostBuffer, wave_on_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_waveform_through_the_kept_buffer_is_the_host_padding():
    pinned, rng = PinnedHostBuffer(), np.random.default_rng(0)
    for n in (0, 1, N_SAMPLES - 1, N_SAMPLES, N_SAMPLES + 7, 5):
        wave = rng.standard_normal(n).astype(np.float32)
        got = wave_on_device(wave, 3, "cuda", pinned)
        assert got.dtype == torch.float32 and torch.equal(got.cpu(), torch.from_numpy(pad_to_chunks(wave, 3)))
    assert pinned.capacity == N_SAMPLES + 7  # grown to the longest, kept for the shorter after it
    wide = rng.standard_normal(1000)  # float64, as a caller's array may be
    assert torch.equal(wave_on_device(wide, 1, "cuda", pinned)[:1000].cpu(), torch.from_numpy(wide.astype(np.float32)))


def test_a_buffer_still_being_read_is_not_written_again():
    """The first copy waits behind a long kernel, so the buffer is unread when the second waveform comes: the second
    must go another way, or the first would arrive as the second's samples."""
    pinned, rng = PinnedHostBuffer(), np.random.default_rng(1)
    pinned.reserve(N_SAMPLES)
    a, b = (rng.standard_normal(N_SAMPLES).astype(np.float32) for _ in range(2))
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU clock cycles queued before the first copy
    got_a = wave_on_device(a, 1, "cuda", pinned)
    got_b = wave_on_device(b, 1, "cuda", pinned)
    torch.cuda.synchronize()
    assert torch.equal(got_a.cpu(), torch.from_numpy(a)) and torch.equal(got_b.cpu(), torch.from_numpy(b))
    assert pinned.capacity == N_SAMPLES
