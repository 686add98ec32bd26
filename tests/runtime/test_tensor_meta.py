"""The delegate's sizes/strides cache (runner/runtime/tensor_meta.py). The seed cached tensor metadata by data pointer
and never re-validated it: a runner that slices one static buffer (`mel[:n_chunks]`) hands the next, shorter
input with the SAME pointer and a NEW shape, and the kernels got stale sizes. These tests drive exactly that
pattern through the real methods and compare with eager, then prove they would catch the bug by giving the
cache the seed's key (the data pointer alone)."""

from __future__ import annotations

import pytest
import torch

from runner.audio import N_SAMPLES, TOKENS_PER_CHUNK
from runner.bundle import read_manifest
from runner.models.mel import LogMelSpectrogram
from runner.models.voxtral import AudioEncoderMethod, TokenEmbeddingMethod
from runner.reference.voxtral import model_from_bundle
from runner.runtime.program import Program
from runner.runtime.tensor_meta import Binding, MetaCache, TensorMeta

RTOL = 1e-5


def seed_key(t: torch.Tensor) -> int:
    """The seed's cache key: the data pointer alone."""
    return t.data_ptr()


@pytest.fixture(scope="module")
def eager(tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    model = model_from_bundle(tiny_bundle, manifest)
    return model, LogMelSpectrogram(model.config.audio.n_mels).eval()


@pytest.fixture(scope="module")
def program(tiny_bundle):
    with Program.load(tiny_bundle) as p:
        yield p


def matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    return (got - want).abs().max().item() <= RTOL * (want.abs().max().item() or 1.0)


def static_buffer_sequence(program: Program, eager) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """One waveform buffer, one mel buffer, one ids buffer, each sliced to the current length: 2 chunks, then
    1 (same data pointer, new shape, new data), then 2 again. Returns (label, program output, eager output)."""
    model, mel_module = eager
    pre, enc, emb = (program.methods[m] for m in ("preprocessor", "audio_encoder", "token_embedding"))
    wave_buf = torch.empty(2 * N_SAMPLES)
    mel_buf = torch.empty(2, 128, 3000)
    ids_buf = torch.empty(1, 8, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    results = []
    with torch.no_grad():
        for k, n in ((2, 8), (1, 3), (2, 8)):
            wave = wave_buf[: k * N_SAMPLES]
            wave.copy_(torch.randn(k * N_SAMPLES, generator=g) * 0.1)
            mel_want = mel_module(wave)
            results.append((f"preprocessor[{k} chunks]", pre(wave)[0], mel_want))
            mel = mel_buf[:k]
            assert mel.data_ptr() == mel_buf.data_ptr()
            mel.copy_(mel_want)
            results.append((f"audio_encoder[{k} chunks]", enc(mel)[0], AudioEncoderMethod(model)(mel)))
            ids = ids_buf[:, :n]
            ids.copy_(torch.randint(0, model.config.text.vocab_size, (1, n), generator=g))
            results.append((f"token_embedding[{n} ids]", emb(ids)[0], TokenEmbeddingMethod(model)(ids)))
    return results


def test_static_buffers_sliced_to_new_shapes(program, eager):
    results = static_buffer_sequence(program, eager)
    for label, got, want in results:
        assert matches(got, want), f"{label}: got {list(got.shape)}, eager {list(want.shape)}"
    shapes = [list(got.shape) for label, got, _ in results if label.startswith("audio_encoder")]
    H = eager[0].config.text.dim
    assert shapes == [[1, 2 * TOKENS_PER_CHUNK, H], [1, TOKENS_PER_CHUNK, H], [1, 2 * TOKENS_PER_CHUNK, H]]


def test_without_validation_the_same_sequence_goes_wrong(tiny_bundle, eager):
    """With the cache keyed by pointer alone (the seed's behaviour), the 1-chunk call reuses the 2-chunk
    binding: the output has the stale shape. This is what makes the test above a regression test."""
    with Program.load(tiny_bundle) as p:  # fresh handles, given the seed's cache
        for m in p.methods.values():
            m.handle.cache = MetaCache(key=seed_key)
        results = static_buffer_sequence(p, eager)
    wrong = [label for label, got, want in results if not matches(got, want)]
    assert wrong, "switching validation off changed nothing: the sequence does not exercise the cache"
    got = dict((label, g) for label, g, _ in results[:6])
    H = eager[0].config.text.dim
    assert list(got["audio_encoder[1 chunks]"].shape) == [1, 2 * TOKENS_PER_CHUNK, H]  # stale: 2 chunks
    assert list(got["preprocessor[1 chunks]"].shape) == [2, 128, 3000]
    assert list(got["token_embedding[3 ids]"].shape) == [1, 8, H]


def test_non_contiguous_view_with_new_data(program, eager):
    """Same view, same metadata, new values: the call must see the new values (a contiguous copy cached with
    the binding would not)."""
    model, _ = eager
    g = torch.Generator().manual_seed(1)
    store = torch.empty(1, 3000, 128)
    mel = store.transpose(1, 2)  # [1, 128, 3000], not contiguous
    ids_store = torch.empty(1, 10, dtype=torch.int64)
    ids = ids_store[:, ::2]
    with torch.no_grad():
        for _ in range(2):
            store.copy_(torch.randn(store.shape, generator=g))
            assert matches(program.methods["audio_encoder"](mel)[0], AudioEncoderMethod(model)(mel))
            ids_store.copy_(torch.randint(0, model.config.text.vocab_size, (1, 10), generator=g))
            assert matches(program.methods["token_embedding"](ids)[0], TokenEmbeddingMethod(model)(ids))


def test_handle_cache_counters(program, eager):
    model, _ = eager
    h = program.methods["text_decoder"].handle
    h.cache.clear()
    hits, rebuilds = h.cache.hits, h.cache.rebuilds
    embeds = torch.randn(1, 4, model.config.text.dim)
    pos = torch.arange(4)
    with torch.no_grad():
        program.methods["text_decoder"](embeds, pos)  # 2 slots built
        program.methods["text_decoder"](embeds, pos)  # 2 hits
        program.methods["text_decoder"](embeds[:, :2], pos[:2])  # same pointers, new sizes: 2 rebuilds
    assert (h.cache.hits - hits, h.cache.rebuilds - rebuilds) == (2, 4)
    program.reset_state()


# ---------------------------------------------------------------- MetaCache unit tests


class Builder:
    def __init__(self):
        self.calls = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return t


def test_hit_on_identical_metadata():
    cache, build = MetaCache(), Builder()
    t = torch.zeros(2, 3)
    first = cache.bind(0, t, build)
    assert cache.bind(0, t, build) is first
    assert cache.bind(0, t.view(2, 3), build) is first  # another tensor object, same metadata
    assert (build.calls, cache.hits, cache.rebuilds) == (1, 2, 1)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda buf: buf[:1], id="sizes"),
        pytest.param(lambda buf: buf[:2, :2], id="sizes-same-ptr-smaller"),
        pytest.param(lambda buf: buf[:2].view(3, 2), id="sizes-same-numel"),
        pytest.param(lambda buf: buf[:2].t(), id="strides-transpose"),
        pytest.param(lambda buf: buf.as_strided((2, 3), (1, 2)), id="strides-as_strided"),
        pytest.param(lambda buf: buf.as_strided((2, 3), (3, 1), 1), id="data_ptr-offset"),
        pytest.param(lambda buf: buf[:2].clone(), id="data_ptr-clone"),
        pytest.param(lambda buf: buf[:2].view(torch.int32), id="dtype"),
    ],
)
def test_rebuild_on_any_field_change(change):
    buf = torch.arange(12.0).reshape(4, 3)
    base = buf[:2]  # [2, 3], strides (3, 1)
    other = change(buf)
    assert TensorMeta.of(other) != TensorMeta.of(base)
    cache, build = MetaCache(), Builder()
    first = cache.bind(0, base, build)
    second = cache.bind(0, other, build)
    assert second is not first and second.meta == TensorMeta.of(other)
    assert (build.calls, cache.hits, cache.rebuilds) == (2, 0, 2)
    assert cache.bind(0, base, build) is not second  # and back again
    assert cache.rebuilds == 3


def test_device_is_part_of_the_metadata():
    t = torch.zeros(3)
    meta = TensorMeta.of(t)
    assert meta.device == torch.device("cpu")
    assert meta != TensorMeta(meta.data_ptr, meta.sizes, meta.strides, meta.dtype, torch.device("meta"))


def test_slots_are_independent_and_clear_forgets():
    cache, build = MetaCache(), Builder()
    a, b = torch.zeros(2), torch.zeros(3)
    cache.bind(0, a, build)
    cache.bind(1, b, build)
    assert cache.bind(0, a, build).meta == TensorMeta.of(a)
    assert cache.bind(1, b, build).meta == TensorMeta.of(b)
    assert (cache.hits, cache.rebuilds) == (2, 2)
    cache.clear()
    cache.bind(0, a, build)
    assert (cache.hits, cache.rebuilds) == (2, 3)


def test_pointer_only_key_is_the_seed_bug():
    """What the seed's key means: a new shape at the same pointer is a (wrong) hit, handing over the old view."""
    cache, build = MetaCache(key=seed_key), Builder()
    buf = torch.zeros(4, 3)
    first = cache.bind(0, buf[:2], build)
    assert cache.bind(0, buf[:1], build) is first
    assert first.tensor.shape == (2, 3)
    assert isinstance(first, Binding)
