"""The AOTI delegate against the seed's bugs (DESIGN.md §3): per-handle symbols (methods and bundles interleaved
in one process), destroy in any order, no leaks over load/destroy cycles, clear errors naming the method and
the argument, and the text decoder's KV state. Every output is compared with the eager model that holds the
same weights (`model_from_bundle`)."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import itertools
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runner.audio import N_SAMPLES, TOKENS_PER_CHUNK
from runner.bundle import MethodSpec, TensorSpec, file_entries, read_manifest, write_manifest
from runner.errors import DelegateError
from runner.models import voxtral
from runner.reference.voxtral import model_from_bundle
from runner.runtime.delegate import _REQUIRED, AOTIBackend
from runner.runtime.program import Program

METHODS = ("preprocessor", "audio_encoder", "token_embedding", "text_decoder", "text_decoder_step")
RTOL = 1e-5  # fp32: max abs error relative to the reference's largest magnitude


# ---------------------------------------------------------------- eager reference and inputs


class Eager:
    """The eager model with a bundle's weights, called like the bundle's methods."""

    def __init__(self, bundle: Path):
        self.bundle = bundle
        self.manifest = read_manifest(bundle)
        self.model = model_from_bundle(bundle, self.manifest)
        self.config = self.model.config
        self.hidden = self.config.text.dim
        self.vocab = self.config.text.vocab_size
        self.max_chunks = self.manifest.model["max_audio_chunks"]
        self.max_seq = self.manifest.model["max_seq_len"]
        self.methods = voxtral.methods(self.model)  # the modules the exporter compiled

    @torch.no_grad()
    def __call__(self, method: str, *inputs: torch.Tensor) -> torch.Tensor:
        if method == "text_decoder_step":
            method = "text_decoder"  # the same decoder, at one position
        return getattr(self.methods, method)(*inputs)

    def reset(self) -> None:
        self.model.reset_caches()

    # inputs, seeded so that a failure reproduces
    def wave(self, chunks: int, seed: int) -> torch.Tensor:
        return torch.randn(chunks * N_SAMPLES, generator=torch.Generator().manual_seed(seed)) * 0.1

    def mel_in(self, chunks: int, seed: int) -> torch.Tensor:
        return torch.randn(chunks, self.config.audio.n_mels, 3000, generator=torch.Generator().manual_seed(seed))

    def ids(self, n: int, seed: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (1, n), generator=torch.Generator().manual_seed(seed))

    def embeds(self, n: int, seed: int) -> torch.Tensor:
        return torch.randn(1, n, self.hidden, generator=torch.Generator().manual_seed(seed)) * 0.5


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: got {got.dtype}{list(got.shape)}, eager {want.dtype}{list(want.shape)}"
    )
    scale = want.abs().max().item() or 1.0
    err = (got - want).abs().max().item() / scale
    assert err <= rtol, f"{what}: max relative error {err:.3g} > {rtol:g}"


@pytest.fixture(scope="module")
def tiny_eager(tiny_bundle) -> Eager:
    return Eager(tiny_bundle)


@pytest.fixture(scope="module")
def other_eager(other_bundle) -> Eager:
    return Eager(other_bundle)


def run(program: Program, ref: Eager, method: str, *inputs: torch.Tensor, what: str = "") -> torch.Tensor:
    """Call one method of the program and check it against eager; returns the program's output."""
    with torch.no_grad():
        got = program.methods[method](*inputs)
    assert len(got) == 1
    assert_close(got[0], ref(method, *inputs), f"{ref.bundle.name}/{method} {what}")
    return got[0]


# ---------------------------------------------------------------- per-handle symbols


def test_methods_interleaved_match_eager(tiny_bundle, tiny_eager):
    """The seed resolved Run & co. process-wide: after text_decoder was loaded (last), audio_encoder ran
    text_decoder's code. Here every method runs its own library in any order."""
    e = tiny_eager
    with Program.load(tiny_bundle) as p:
        assert list(p.methods) == list(METHODS)  # loaded in this order: the decoders last
        e.reset()
        p.reset_state()
        enc = run(p, e, "audio_encoder", e.mel_in(2, 1), what="first call, 2 chunks")
        assert enc.shape == (1, 2 * TOKENS_PER_CHUNK, e.hidden)
        run(p, e, "token_embedding", e.ids(5, 2))
        run(p, e, "text_decoder", e.embeds(7, 3), torch.arange(7), what="prefill 7")
        mel = run(p, e, "preprocessor", e.wave(1, 4), what="1 chunk")
        assert mel.shape == (1, 128, 3000)
        run(p, e, "audio_encoder", mel, what="on the preprocessor's mel")
        ids = e.ids(1, 5)
        emb = run(p, e, "token_embedding", ids)
        # the step method binds text_decoder's KV cache: it attends to the positions the prefill wrote
        run(p, e, "text_decoder_step", emb, torch.tensor([7]), what="step at 7")
        run(p, e, "preprocessor", e.wave(2, 6), what="2 chunks")
        run(p, e, "token_embedding", e.ids(9, 7))
        more = e.embeds(3, 8)
        for i in range(3):
            run(p, e, "text_decoder_step", more[:, i : i + 1], torch.tensor([8 + i]), what=f"step at {8 + i}")
        run(p, e, "text_decoder_step", e.embeds(1, 10), torch.tensor([11]), what="and a step sees the steps'")


def test_two_bundles_side_by_side(tiny_bundle, other_bundle, tiny_eager, other_eager):
    """Two bundles of different configs (widths, heads, layers, vocab, chunk limits) in one process: the same
    method names and symbol names in two libraries. Interleaved calls each run their own library."""
    a, b = tiny_eager, other_eager
    assert (a.hidden, a.vocab) != (b.hidden, b.vocab)
    with Program.load(tiny_bundle) as pa, Program.load(other_bundle) as pb:
        for e, p in ((a, pa), (b, pb)):
            e.reset()
            p.reset_state()
        for step in range(2):
            for e, p in ((a, pa), (b, pb), (a, pa)):
                k = min(e.max_chunks, 2 - step)
                mel = run(p, e, "preprocessor", e.wave(k, 10 + step), what=f"step {step}")
                out = run(p, e, "audio_encoder", mel, what=f"step {step}")
                assert out.shape == (1, k * TOKENS_PER_CHUNK, e.hidden)
            for e, p in ((b, pb), (a, pa)):
                emb = run(p, e, "token_embedding", e.ids(4, 20 + step), what=f"step {step}")
                e.reset()  # text_decoder prefills into an empty cache
                p.reset_state()
                logits = run(p, e, "text_decoder", emb, torch.arange(4), what=f"step {step}")
                assert logits.shape == (1, e.vocab)


# ---------------------------------------------------------------- destroy


def _load_handles(backend: AOTIBackend, bundle: Path) -> dict:
    """The five handles of one program (Program.load: verified bundle, manifest order)."""
    program = Program.load(bundle, backend=backend)
    return {name: program.methods[name].handle for name in METHODS}


def _small_inputs(e: Eager, method: str) -> tuple[torch.Tensor, ...]:
    return {
        "preprocessor": (e.wave(1, 30),),
        "audio_encoder": (e.mel_in(1, 31),),
        "token_embedding": (e.ids(3, 32),),
        "text_decoder": (e.embeds(2, 33), torch.arange(2)),
        "text_decoder_step": (e.embeds(1, 34), torch.tensor([0])),
    }[method]


def _check_destroyed(backend: AOTIBackend, h, e: Eager, name: str) -> None:
    assert not h.alive
    backend.destroy(h)  # twice: a no-op
    assert not h.alive
    with pytest.raises(DelegateError, match=f"{name}: execute on a destroyed handle"):
        backend.execute(h, list(_small_inputs(e, name)))


def _check_alive(backend: AOTIBackend, handles: dict, expected: dict) -> None:
    for name, h in handles.items():
        if h.alive:
            inputs, want = expected[name]
            if name.startswith("text_decoder"):
                for t in h.state.values():  # the KV cache: start from empty
                    t.zero_()
            with torch.no_grad():
                got = backend.execute(h, list(inputs))[0]
            assert_close(got, want, f"{name} after other handles were destroyed")


def _expected(e: Eager) -> dict:
    out = {}
    for name in METHODS:
        inputs = _small_inputs(e, name)
        e.reset()
        out[name] = (inputs, e(name, *inputs))
    return out


def test_destroy_in_every_order(tiny_bundle, tiny_eager):
    """All 120 orders: no crash (each Delete is the container's own), the others keep working in between (the
    decoder whose weights and KV cache the other shares, too)."""
    backend = AOTIBackend()
    expected = _expected(tiny_eager)
    for order in itertools.permutations(METHODS):
        handles = _load_handles(backend, tiny_bundle)
        for name in order:
            backend.destroy(handles[name])
            _check_destroyed(backend, handles[name], tiny_eager, name)
            _check_alive(backend, handles, expected)
        assert not any(h.alive for h in handles.values())


def test_destroy_interleaved_across_bundles(tiny_bundle, other_bundle, tiny_eager, other_eager):
    backend = AOTIBackend()
    ea, eb = _expected(tiny_eager), _expected(other_eager)
    orders = [
        [(x, m) for m in METHODS for x in "ab"],  # alternate, same method order
        [(x, m) for m in reversed(METHODS) for x in "ba"],
        [("a", m) for m in METHODS[::2]] + [("b", m) for m in METHODS] + [("a", m) for m in METHODS[1::2]],
    ]
    for order in orders:
        handles = {"a": _load_handles(backend, tiny_bundle), "b": _load_handles(backend, other_bundle)}
        for x, name in order:
            backend.destroy(handles[x][name])
            _check_destroyed(backend, handles[x][name], tiny_eager if x == "a" else other_eager, name)
            _check_alive(backend, handles["a"], ea)
            _check_alive(backend, handles["b"], eb)


def test_program_close_twice_and_use_after_close(tiny_bundle, tiny_eager):
    p = Program.load(tiny_bundle)
    p.close()
    p.close()
    for name, m in p.methods.items():
        assert not m.handle.alive
        with pytest.raises(DelegateError, match=f"{name}: execute on a destroyed handle"):
            m(*_small_inputs(tiny_eager, name))


# ---------------------------------------------------------------- unloading and leaks


def mapped_paths() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


def gnu_unique_symbols(path: Path) -> list[str]:
    """Dynamic symbols with binding STB_GNU_UNIQUE (10). glibc never unloads a library that defines one
    (it marks it NODELETE), so dlclose cannot unmap it."""
    data = Path(path).read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2, f"{path}: not an ELF64 file"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != 11:  # SHT_DYNSYM
            continue
        stroff = sections[link][4]
        for i in range(size // entsize):
            st_name, st_info = struct.unpack_from("<IB", data, off + i * entsize)
            if st_info >> 4 == 10:
                end = data.index(b"\0", stroff + st_name)
                names.append(data[stroff + st_name : end].decode())
    return names


def test_reexport_in_place_is_refused(tiny_bundle, tmp_path):
    """glibc returns the already-mapped library for a known path: loading a rebuilt file at the same path
    must be refused, not run the old code."""
    copy = tmp_path / "b"
    shutil.copytree(tiny_bundle, copy)
    with Program.load(copy) as program:
        program.methods["token_embedding"](torch.zeros(1, 3, dtype=torch.int64))  # main thread: stays mapped
    lib = copy / "token_embedding.so"
    data = lib.read_bytes()
    lib.unlink()
    lib.write_bytes(data + b"\0")  # a new build at the same path (trailing bytes do not matter to the loader)
    with pytest.raises(DelegateError, match="already loaded a different build from this path"):
        AOTIBackend().init(read_manifest(copy).methods["token_embedding"], copy, "cpu")


def test_a_library_replaced_after_verification_is_refused_before_dlopen(tiny_bundle, tmp_path, monkeypatch):
    """The bundle verifies, then a library changes before it is loaded (another export publishing into the
    directory, a writer racing the load): the delegate hashes each library just before dlopen, and refuses one
    that is no longer what the manifest pins, instead of running it beside another build's weights."""
    import runner.runtime.program as program_module

    copy = Path(shutil.copytree(tiny_bundle, tmp_path / "b"))
    verify = program_module.verify_bundle

    def verify_then_replace(*a, **k):
        manifest = verify(*a, **k)
        lib = copy / "audio_encoder.so"
        data = bytearray(lib.read_bytes())
        data[len(data) // 2] ^= 1
        lib.unlink()
        lib.write_bytes(bytes(data))
        return manifest

    monkeypatch.setattr(program_module, "verify_bundle", verify_then_replace)
    with pytest.raises(DelegateError, match="no longer the library the manifest pins"):
        Program.load(copy)
    with open("/proc/self/maps") as f:
        assert str(copy / "audio_encoder.so") not in f.read()


# A fake AOTI library in C: every symbol the delegate requires, a container that counts its Delete calls
# (in the file named by $STUB_LOG) and a Run that hands the (stolen) input handle back as the output.
_STUB_FUNCS = {
    "AOTInductorModelContainerCreateWithDevice": '(void **c, size_t n, const char *d, const char *cubin) { *c = malloc(16); note("create"); return 0; }',
    "AOTInductorModelContainerDelete": '(void *c) { free(c); note("delete"); return 0; }',
    "AOTInductorModelContainerGetNumInputs": "(void *c, size_t *n) { *n = 1; return 0; }",
    "AOTInductorModelContainerGetNumOutputs": "(void *c, size_t *n) { *n = 1; return 0; }",
    "AOTInductorModelContainerRun": "(void *c, void **in, size_t nin, void **out, size_t nout, void *s, void *p) { out[0] = in[0]; return 0; }",
    "AOTInductorModelContainerGetNumConstants": "(void *c, size_t *n) { *n = 0; return 0; }",
}
_STUB_PRELUDE = """#include <stdio.h>
#include <stdlib.h>
static void note(const char *what) {
    const char *path = getenv("STUB_LOG");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (f) { fprintf(f, "%s\\n", what); fclose(f); }
}
"""


def build_stub(dest: Path, omit: tuple[str, ...] = ()) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build a stub library")
    body = [_STUB_PRELUDE]
    for sym in _REQUIRED:
        if sym in omit:
            continue
        impl = _STUB_FUNCS.get(sym, "() { return 1; }")  # never called by these tests
        body.append(f"int {sym}{impl}\n")
    src = dest.with_suffix(".c")
    src.write_text("".join(body))
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(dest), str(src)], check=True, capture_output=True)
    return dest


STUB_SPEC = MethodSpec("stub", "stub.so", None, [TensorSpec("x", "float32", [3])], [TensorSpec("y", "float32", [3])])


def test_destroy_dlcloses_an_unloadable_library(tmp_path, monkeypatch):
    """With a library that can be unloaded (no GNU_UNIQUE symbols), destroy calls the container's own
    Delete and dlclose really unmaps it."""
    lib = build_stub(tmp_path / "stub.so")
    log = tmp_path / "stub.log"
    monkeypatch.setenv("STUB_LOG", str(log))
    assert not gnu_unique_symbols(lib)
    backend = AOTIBackend()
    h = backend.init(STUB_SPEC, tmp_path, "cpu")
    assert str(lib.resolve()) in mapped_paths()
    x = torch.arange(3.0)
    assert torch.equal(backend.execute(h, [x])[0], x)
    backend.destroy(h)
    assert log.read_text().split() == ["create", "delete"]
    assert str(lib.resolve()) not in mapped_paths()


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _snapshot() -> dict:
    """RSS after glibc returned its free pages (malloc_trim): memory still held, not allocator slack, which
    with several arenas (OpenMP and hashing threads) is noisy at this scale."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return {
        "rss_kb": _rss_kb(),
        "fds": len(os.listdir("/proc/self/fd")),
        "mapped_so": len({p for p in mapped_paths() if ".so" in Path(p).name}),
    }


def test_load_destroy_loop_does_not_leak(tiny_bundle, tiny_eager):
    """30 load/run/close cycles: RSS, open fds and mapped libraries stay flat after warm-up. Before the
    delegate bound non-owning aliases, the container's own (never deleted) constant handles pinned every weight
    and the KV cache: RSS grew by the bytes bound per load (~2.4 MB per cycle for the tiny bundle)."""
    e = tiny_eager
    inputs = {name: _small_inputs(e, name) for name in METHODS}

    def cycle() -> int:
        with Program.load(tiny_bundle) as p, torch.no_grad():
            for name in METHODS:
                p.methods[name](*inputs[name])
            return sum(t.numel() * t.element_size() for m in p.methods.values() for t in m.handle.constants.values())

    for _ in range(5):  # warm-up: allocator pools, digest cache, first dlopen
        bound = cycle()
    n = 30
    before = _snapshot()
    for _ in range(n):
        cycle()
    after = _snapshot()
    growth_kb = after["rss_kb"] - before["rss_kb"]
    print(
        f"\nload/destroy x{n}: before {before}, after {after}; RSS growth {growth_kb} kB "
        f"({growth_kb / n:.0f} kB per cycle; {bound // 1024} kB of weights and state bound per cycle)"
    )
    assert after["fds"] <= before["fds"], (before, after)
    assert after["mapped_so"] <= before["mapped_so"], (before, after)
    # a leak of what is bound would be ~bound per cycle; allow a tenth of it plus 2 MB (measured: ~45 kB per
    # cycle, the container's small never-deleted handles of the aliases)
    assert growth_kb * 1024 < 0.1 * bound * n + (2 << 20), (before, after, bound)


# ---------------------------------------------------------------- errors naming the method and the argument


@pytest.fixture(scope="module")
def tiny_program(tiny_bundle):
    with Program.load(tiny_bundle) as p:
        yield p


BAD_INPUT_IDS = [
    "count-0",
    "count-2",
    "count-1-of-2",
    "dtype-float64-mel",
    "dtype-int32-ids",
    "dtype-float-position",
    "rank-mel",
    "rank-ids",
    "rank-waveform",
    "waveform-not-whole-chunks",
    "waveform-half-chunk",
    "waveform-too-many-chunks",
    "mel-too-many-chunks",
    "mel-80-bins",
    "mel-1500-frames",
    "ids-over-max-seq",
    "ids-batch-2",
    "embeds-over-max-seq",
    "embeds-wrong-hidden",
    "position-over-max-seq",
]


@pytest.mark.parametrize(
    "method, inputs, arg",
    [
        ("audio_encoder", lambda e: (), "mel"),
        ("audio_encoder", lambda e: (e.mel_in(1, 0), e.mel_in(1, 0)), "mel"),
        ("text_decoder", lambda e: (e.embeds(3, 0),), "cache_position"),
        ("audio_encoder", lambda e: (e.mel_in(1, 0).double(),), "mel"),  # dtype
        ("token_embedding", lambda e: (e.ids(3, 0).int(),), "ids"),  # dtype
        ("text_decoder", lambda e: (e.embeds(3, 0), torch.arange(3.0)), "cache_position"),  # dtype
        ("audio_encoder", lambda e: (e.mel_in(1, 0)[0],), "mel"),  # rank
        ("token_embedding", lambda e: (e.ids(3, 0)[0],), "ids"),  # rank
        ("preprocessor", lambda e: (e.wave(1, 0)[None],), "waveform"),  # rank
        ("preprocessor", lambda e: (torch.zeros(N_SAMPLES + 1),), "waveform"),  # not whole 30 s chunks
        ("preprocessor", lambda e: (torch.zeros(N_SAMPLES // 2),), "waveform"),
        ("preprocessor", lambda e: (e.wave(e.max_chunks + 1, 0),), "waveform"),  # too many chunks
        ("audio_encoder", lambda e: (e.mel_in(e.max_chunks + 1, 0),), "mel"),
        ("audio_encoder", lambda e: (torch.zeros(1, 80, 3000),), "mel"),  # fixed dim
        ("audio_encoder", lambda e: (torch.zeros(1, 128, 1500),), "mel"),
        ("token_embedding", lambda e: (e.ids(e.max_seq + 1, 0),), "ids"),  # seq > max_seq_len
        ("token_embedding", lambda e: (torch.zeros(2, 3, dtype=torch.long),), "ids"),  # batch 2
        ("text_decoder", lambda e: (e.embeds(e.max_seq + 1, 0), torch.arange(e.max_seq + 1)), "embeds"),
        ("text_decoder", lambda e: (e.embeds(3, 0)[..., :-1], torch.arange(3)), "embeds"),  # hidden size
        ("text_decoder", lambda e: (e.embeds(1, 0), torch.arange(e.max_seq + 1)), "cache_position"),
    ],
    ids=BAD_INPUT_IDS,
)
def test_bad_inputs_name_method_and_argument(tiny_program, tiny_eager, method, inputs, arg):
    with pytest.raises(DelegateError) as info:
        tiny_program.methods[method](*inputs(tiny_eager))
    msg = str(info.value)
    assert msg.startswith(f"{method}: ") and (repr(arg) in msg or f"{arg}: " in msg), msg


def test_bad_inputs_leave_the_method_usable(tiny_program, tiny_eager):
    """A rejected call (before Run, or an index the kernel refuses) does not poison the handle."""
    e, p = tiny_eager, tiny_program
    good = e.mel_in(2, 40)
    run(p, e, "audio_encoder", good, what="before")
    with pytest.raises(DelegateError, match="audio_encoder: input 'mel'"):
        p.methods["audio_encoder"](e.mel_in(3, 41))
    run(p, e, "audio_encoder", good[:1], what="after a rejected call")
    # values are the kernels' business: Inductor's bounds checks fail the call
    with pytest.raises(DelegateError, match="token_embedding: .*index out of bounds"):
        p.methods["token_embedding"](torch.tensor([[e.vocab]]))
    run(p, e, "token_embedding", e.ids(3, 42), what="after an out-of-range id")
    with pytest.raises(DelegateError, match="text_decoder: .*index out of bounds"):
        p.methods["text_decoder"](e.embeds(1, 43), torch.tensor([e.max_seq]))
    p.reset_state()
    e.reset()
    run(p, e, "text_decoder", e.embeds(2, 44), torch.arange(2), what="after an out-of-range position")


def test_library_missing_a_symbol(tmp_path):
    lib = build_stub(tmp_path / "stub.so", omit=("AOTInductorModelContainerRun",))
    with pytest.raises(DelegateError) as info:
        AOTIBackend().init(STUB_SPEC, tmp_path, "cpu")
    msg = str(info.value)
    assert "AOTInductorModelContainerRun" in msg and str(lib) in msg, msg
    assert str(lib.resolve()) not in mapped_paths()  # closed again on the failed init


def test_not_a_library(tmp_path):
    (tmp_path / "stub.so").write_bytes(b"\x7fELF not really")
    with pytest.raises(DelegateError, match=r"stub\.so: cannot load"):
        AOTIBackend().init(STUB_SPEC, tmp_path, "cpu")


def _copy_bundle(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _rewrite_weights(bundle: Path, method: str, edit) -> None:
    """Rewrite one method's safetensors file and fix up the manifest's digests (so only the delegate objects)."""
    manifest = read_manifest(bundle)
    wfile = bundle / manifest.methods[method].weights
    weights = load_file(str(wfile))
    edit(weights)
    wfile.unlink()  # a new inode: the digest cache must not vouch for the old bytes
    save_file(weights, str(wfile))
    files = file_entries(bundle, sorted(manifest.files))
    write_manifest(bundle, dataclasses.replace(manifest, files=files))


def test_weight_with_wrong_shape(tiny_bundle, tmp_path):
    bundle = _copy_bundle(tiny_bundle, tmp_path / "bad")

    def widen(w):
        t = w["embed_tokens.weight"]
        w["embed_tokens.weight"] = torch.zeros(t.shape[0], t.shape[1] + 1)

    _rewrite_weights(bundle, "token_embedding", widen)
    with pytest.raises(DelegateError) as info:
        Program.load(bundle)
    msg = str(info.value)
    assert msg.startswith("token_embedding: ") and "embed_tokens.weight" in msg and "bytes" in msg, msg


def test_weight_with_wrong_dtype_or_missing(tiny_bundle, tmp_path):
    manifest = read_manifest(tiny_bundle)
    spec = manifest.methods["text_decoder"]
    bundle = _copy_bundle(tiny_bundle, tmp_path / "bad")
    wfile = bundle / spec.weights
    weights = load_file(str(wfile))
    save_file({**weights, "norm.weight": weights["norm.weight"].double()}, str(wfile))
    with pytest.raises(DelegateError, match=r"text_decoder: weight norm\.weight is torch\.float64"):
        AOTIBackend().init(spec, bundle, "cpu")  # init itself does not check digests
    del weights["lm_head.weight"]
    save_file(weights, str(wfile))
    with pytest.raises(DelegateError, match=r"text_decoder: constant lm_head\.weight is neither in"):
        AOTIBackend().init(spec, bundle, "cpu")


# ---------------------------------------------------------------- KV state


def test_kv_state(tiny_program, tiny_eager):
    e, dec, one = tiny_eager, tiny_program.methods["text_decoder"], tiny_program.methods["text_decoder_step"]
    prompt, pos = e.embeds(7, 50), torch.arange(7)
    step, at7 = e.embeds(1, 51), torch.tensor([7])
    with torch.no_grad():
        tiny_program.reset_state()
        first = dec(prompt, pos)[0]
        tiny_program.reset_state()
        again = dec(prompt, pos)[0]
        assert torch.equal(first, again), "prefill after reset_state differs"
        rewritten = dec(prompt, pos)[0]  # no reset: positions 0..6 are overwritten with the same values
        assert torch.equal(first, rewritten), "a second prefill at the same positions differs"
        warm = one(step, at7)[0]  # attends to the 7 cached positions
        tiny_program.reset_state()
        cold = one(step, at7)[0]  # attends to an empty (zero) cache
    assert (warm - cold).abs().max().item() > 1e-3 * warm.abs().max().item(), "the KV cache made no difference"
    e.reset()
    assert_close(first, e("text_decoder", prompt, pos), "prefill")
    assert_close(warm, e("text_decoder", step, at7), "decode at 7 after prefill")
    e.reset()
    assert_close(cold, e("text_decoder", step, at7), "decode at 7 after reset")


def test_kv_state_is_per_handle(tiny_bundle, tiny_eager):
    """Two programs of the same bundle share the library (dlopen refcount) but not the KV cache."""
    e = tiny_eager
    with Program.load(tiny_bundle) as p1, Program.load(tiny_bundle) as p2, torch.no_grad():
        for p in (p1, p2):
            p.reset_state()
        p1.methods["text_decoder"](e.embeds(7, 60), torch.arange(7))
        p2.methods["text_decoder"](e.embeds(7, 61), torch.arange(7))
        step = e.embeds(1, 62)
        a = p1.methods["text_decoder_step"](step, torch.tensor([7]))[0]
        b = p2.methods["text_decoder_step"](step, torch.tensor([7]))[0]
    e.reset()
    e("text_decoder", e.embeds(7, 60), torch.arange(7))
    assert_close(a, e("text_decoder", step, torch.tensor([7])), "program 1")
    e.reset()
    e("text_decoder", e.embeds(7, 61), torch.arange(7))
    assert_close(b, e("text_decoder", step, torch.tensor([7])), "program 2")
