"""The waveform's way to the device: zero-padded to whole 30 s chunks there, only the samples crossing, on CUDA
through a page-locked host buffer kept for the engine's life (PinnedHostBuffer)."""

from __future__ import annotations

import numpy as np
import torch

from runner.audio import N_SAMPLES
from runner.audio_chunks import checked_chunks


class PinnedHostBuffer:
    """A page-locked (pinned) float32 host buffer the samples are copied into before their copy to the device,
    which then runs without the host waiting. One per engine, reserved at warm-up for a 30 s chunk and grown to the
    longest audio seen: pinning a new tensor per prompt (`Tensor.pin_memory()`) was the largest gap in a profiled
    time to first token.

    The buffer is written again only once the device has read it (an event after each copy); where that copy is
    still queued behind other work (the batch scheduler encodes while slots decode), the samples go through a
    fresh pinned tensor instead, so the host never waits here."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._read: torch.cuda.Event | None = None  # recorded after the last copy out of _buf

    @property
    def capacity(self) -> int:
        """Samples the buffer holds now (0 before the first reserve)."""
        return 0 if self._buf is None else self._buf.numel()

    def reserve(self, n: int) -> None:
        """Room for n samples, pinned now rather than inside a prompt's time. A smaller buffer still being read may
        be dropped: torch's pinned-memory cache keeps its block until the copy that reads it has finished."""
        if n > self.capacity:
            self._buf, self._read = torch.empty(n, dtype=torch.float32, pin_memory=True), None

    def copy_to(self, out: torch.Tensor, samples: np.ndarray) -> None:
        """out[:] = samples (float32, on out's CUDA device) from page-locked memory, queued on the current stream."""
        if len(samples) == 0:
            return
        if self._read is not None and not self._read.query():  # the device has yet to read the buffer
            out.copy_(torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32)).pin_memory(), non_blocking=True)
            return
        self.reserve(len(samples))
        host = self._buf[: len(samples)]
        np.copyto(host.numpy(), samples, casting="same_kind")  # one memcpy (float64 input: cast as it copies)
        out.copy_(host, non_blocking=True)
        self._read = torch.cuda.Event()
        self._read.record(torch.cuda.current_stream(out.device))


def wave_on_device(
    samples: np.ndarray, audio_chunks: int, device: str | torch.device, pinned: PinnedHostBuffer | None = None
) -> torch.Tensor:
    """The samples zero-padded to whole 30 s chunks (at most `audio_chunks`: AudioError past them) on the device.
    The padding is made there and only the samples cross (padding on the host would write a copy of the whole
    waveform first), on CUDA from page-locked memory without the host waiting: through the `pinned` buffer, or
    without one through a tensor pinned for this call."""
    dev = torch.device(device)
    n = checked_chunks(len(samples), audio_chunks)
    out = torch.zeros(n * N_SAMPLES, dtype=torch.float32, device=dev)
    if dev.type == "cuda":
        (pinned or PinnedHostBuffer()).copy_to(out[: len(samples)], samples)
    else:
        out[: len(samples)].copy_(torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32)))
    return out
