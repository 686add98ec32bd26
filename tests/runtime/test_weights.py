"""runner/runtime/weights.py: a weights file read in groups (as onto a GPU) gives what safetensors' load_file
gives, whatever the group size; groups follow the file's order and hold at most the group size."""

from __future__ import annotations

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from runner.runtime.weights import groups, load_weights


@pytest.fixture
def weights_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "z.big": torch.randn(64, 64, generator=g),  # 16 KiB
        "a.small": torch.randn(5, generator=g).to(torch.bfloat16),
        "m.ids": torch.arange(7, dtype=torch.int64),
        "b.half": torch.randn(3, 4, generator=g).to(torch.float16),
        "flag": torch.tensor([True, False]),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.mark.parametrize("group_bytes", [1, 100, 4096, 1 << 30])
def test_grouped_read_equals_load_file(weights_file, group_bytes):
    path, tensors = weights_file
    got = load_weights(path, torch.device("cpu"), group_bytes=group_bytes, grouped=True)
    want = load_file(str(path))
    assert got.keys() == want.keys() == tensors.keys()
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t)


def test_groups_hold_at_most_the_group_size_in_file_order(weights_file):
    path, tensors = weights_file
    nbytes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    cut = groups(path, 100)
    flat = [n for g in cut for n in g]
    assert sorted(flat) == sorted(tensors)
    for g in cut:  # a tensor over the size is alone; otherwise the group fits
        assert len(g) == 1 or sum(nbytes[n] for n in g) <= 100
    assert groups(path, 1 << 30) == [flat]  # one group when it all fits, in the same (file) order


def test_a_malformed_file_raises_safetensors_error(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(SafetensorError):
        load_weights(bad, torch.device("cpu"), grouped=True)
