"""A method's weights file onto its device: streamed through pinned buffers onto a GPU, in one go on the CPU.

safetensors maps the file and copies each tensor out of the mapping. Onto a GPU that costs twice: every 4 KiB page
is a minor fault on first touch, and every touched page stays in the process's resident set until the mapping
closes (the whole file's size in peak host memory). Here the file is read instead, by a few threads with
`os.preadv` (no mapping, no faults; the GIL is released) into a handful of pinned buffers, each copied onto the
GPU on its own stream while the next is read: the host holds the buffers alone. The header is validated by
safetensors itself before a byte of data is trusted.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

CHUNK_BYTES = 16 << 20  # a preadv this size runs at the page cache's speed; 8 of them pinned: 128 MiB
READERS = 4  # threads reading the file; two buffers each, so a read never waits for its own copy

_DTYPES = {  # safetensors' dtype names
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I16": torch.int16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "F32": torch.float32,
    "I64": torch.int64,
    "F64": torch.float64,
}


def load_weights(
    path: Path, device: torch.device, chunk_bytes: int = CHUNK_BYTES, streamed: bool | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file at `path`, on `device`; `streamed` (default: off the CPU) reads the
    file through buffers of `chunk_bytes`. Raises what safetensors raises for a malformed header, ValueError for
    a dtype torch lacks or a file shorter than its header says (the caller words them)."""
    if not (device.type != "cpu" if streamed is None else streamed):
        return load_file(str(path), device=str(device))
    data_start, entries = layout(path)
    out = {name: torch.empty(shape, dtype=dtype, device=device) for name, dtype, shape, _, _ in entries}
    dests = [(out[name].view(-1).view(torch.uint8), lo, hi) for name, _, _, lo, hi in entries if hi > lo]
    end = max((hi for _, _, hi in dests), default=0)
    chunks = [(lo, min(lo + chunk_bytes, end)) for lo in range(0, end, chunk_bytes)]
    readers = max(1, min(READERS, os.cpu_count() or 1, len(chunks)))
    slots: queue.Queue[_Slot] = queue.Queue()
    made = [_Slot(min(chunk_bytes, end), device) for _ in range(min(2 * readers, len(chunks)))]
    for s in made:
        slots.put(s)
    fd = os.open(path, os.O_RDONLY)
    try:

        def one(chunk: tuple[int, int]) -> None:
            slot = slots.get()
            try:
                slot.read(fd, data_start, chunk, [d for d in dests if d[1] < chunk[1] and d[2] > chunk[0]])
            finally:
                slots.put(slot)

        with ThreadPoolExecutor(readers, thread_name_prefix="weights") as pool:
            futures = [pool.submit(one, c) for c in chunks]
            try:
                for f in futures:
                    f.result()
            except BaseException:  # a failed read or Ctrl-C: the chunks not started are not read
                for f in futures:
                    f.cancel()
                raise
    finally:
        for s in made:
            s.wait()
        os.close(fd)
    return out


def release_pinned_buffers() -> None:
    """Give the pinned buffers back to the system once a bundle's files are read: torch's pinned allocator keeps
    freed ones for reuse (the next file of the load reuses them: pinning is slow), and they would stay in the
    RSS."""
    if torch.cuda.is_initialized() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


def layout(path: Path) -> tuple[int, list[tuple[str, torch.dtype, list[int], int, int]]]:
    """Where the data starts and (name, dtype, shape, begin, end) of every tensor, in file order."""
    with safe_open(str(path), framework="pt"):  # its checks: the header parses, offsets tile the data, sizes fit
        pass
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    entries = []
    for name, v in header.items():
        if v["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name} has dtype {v['dtype']}, which this loader does not read")
        entries.append((name, _DTYPES[v["dtype"]], list(v["shape"]), *v["data_offsets"]))
    return 8 + n, sorted(entries, key=lambda e: e[3])


class _Slot:
    """A buffer (pinned for a GPU) and the stream that copies out of it; the copy's event says when it is free."""

    def __init__(self, nbytes: int, device: torch.device):
        cuda = device.type == "cuda"
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.view = memoryview(self.buf.numpy())
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.event = torch.cuda.Event() if cuda else None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def read(self, fd: int, data_start: int, chunk: tuple[int, int], dests) -> None:
        self.wait()  # the last copy out of this buffer is done
        lo, hi = chunk
        got = 0
        while got < hi - lo:
            n = os.preadv(fd, [self.view[got : hi - lo]], data_start + lo + got)
            if n <= 0:
                raise ValueError(f"the file ends {hi - lo - got} bytes before its header's last tensor does")
            got += n
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for dst, a, b in dests:  # the part of each tensor [a, b) inside [lo, hi)
                s, e = max(a, lo), min(b, hi)
                dst[s - a : e - a].copy_(self.buf[s - lo : e - lo], non_blocking=self.stream is not None)
            if self.event is not None:
                self.event.record(self.stream)


def free_device_bytes() -> int:
    """The GPU's free memory once what nothing refers to is collected and the allocator's cached blocks are given
    back (a finished compile's or program's cached blocks would read as taken): where a second copy of a model's
    weights is to go (the export's self-check, bench's transformers peers)."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]
