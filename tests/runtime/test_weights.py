"""runner/runtime/weights.py: a weights file streamed through buffers (as onto a GPU) gives what safetensors'
load_file gives, whatever the buffer size (tensors cut across buffers, several in one, empty ones); a malformed or
truncated file is an error, not a partial load."""

from __future__ import annotations

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from runner.runtime.weights import layout, load_weights


@pytest.fixture
def weights_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "z.big": torch.randn(64, 64, generator=g),  # 16 KiB
        "a.small": torch.randn(5, generator=g).to(torch.bfloat16),
        "m.ids": torch.arange(7, dtype=torch.int64),
        "b.half": torch.randn(3, 4, generator=g).to(torch.float16),
        "flag": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "codes": torch.randint(0, 255, (33,), generator=g, dtype=torch.uint8),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


@pytest.mark.parametrize("chunk_bytes", [1, 7, 100, 4096, 1 << 30])
def test_a_streamed_read_equals_load_file(weights_file, chunk_bytes):
    path, tensors = weights_file
    got = load_weights(path, torch.device("cpu"), chunk_bytes=chunk_bytes, streamed=True)
    want = load_file(str(path))
    assert got.keys() == want.keys() == tensors.keys()
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k


def test_the_layout_is_in_file_order_and_tiles_the_data(weights_file):
    path, tensors = weights_file
    start, entries = layout(path)
    assert sorted(e[0] for e in entries) == sorted(tensors)
    assert entries[0][3] == 0 and all(a[4] == b[3] for a, b in zip(entries, entries[1:]))
    assert start + entries[-1][4] == path.stat().st_size


def test_a_malformed_file_raises_safetensors_error(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(SafetensorError):
        load_weights(bad, torch.device("cpu"), streamed=True)


def test_a_truncated_file_is_refused(weights_file, tmp_path):
    path, _ = weights_file
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-40])
    with pytest.raises((SafetensorError, ValueError)):
        load_weights(cut, torch.device("cpu"), chunk_bytes=64, streamed=True)
