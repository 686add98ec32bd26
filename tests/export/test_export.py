"""The exporter and its bundles: layout, manifest, weights out of the `.so` files, every method run through our
delegate against eager, and the failure paths (nothing half-written, nothing published on a bad self-check).

The session bundles (conftest) are exported once; the compile cache makes a warm run re-export in seconds."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import AUDIO, CACHE, OTHER_HF_CONFIG
from safetensors import safe_open

from runner.audio import N_SAMPLES, TOKENS_PER_CHUNK, load_audio
from runner.audio_chunks import pad_to_chunks
from runner.bundle import FORMAT_VERSION, MANIFEST_NAME, METHOD_NAMES, STEP_METHOD, read_manifest, verify_bundle
from runner.digests import sha256_file
from runner.errors import DelegateError, ExportError
from runner.export import aoti, self_check
from runner.export import pipeline as exporter
from runner.export.checkpoint import load_checkpoint
from runner.export.options import ExportOptions
from runner.export.voxtral import export_voxtral, family_key
from runner.families.voxtral.tokenizer import Tekken
from runner.models.mel import LogMelSpectrogram
from runner.models.voxtral import AudioEncoderMethod, TokenEmbeddingMethod
from runner.models.voxtral_config import VoxtralConfig
from runner.publish import PublishError
from runner.reference.voxtral import model_from_bundle
from runner.runtime.program import Program

# exported vs eager, fp32: the exporter's own self-check allows 1e-4 relative; the measured error is ~1e-6
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module", params=["tiny", "other"])
def which(request):
    return request.param


@pytest.fixture(scope="module")
def bundle(which, request) -> Path:
    return request.getfixturevalue(f"{which}_bundle")


@pytest.fixture(scope="module")
def checkpoint(which, request) -> Path:
    return request.getfixturevalue(f"{which}_checkpoint")


@pytest.fixture(scope="module")
def loaded(bundle):
    """(program, eager model from the bundle's weights)."""
    program = Program.load(bundle)
    eager = model_from_bundle(bundle, program.manifest)
    yield program, eager
    program.close()


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
    )
    scale = want.abs().max().item() or 1.0
    err = (got - want).abs().max().item()
    assert err <= ATOL + RTOL * scale, f"{what}: max abs error {err:.3g} (scale {scale:.3g})"


# ---------------------------------------------------------------- layout and manifest


def test_bundle_has_five_methods_each_with_library_and_weights(bundle):
    m = verify_bundle(bundle)
    assert set(m.methods) == {*METHOD_NAMES, STEP_METHOD}
    for name, spec in m.methods.items():
        assert spec.name == name
        assert (bundle / spec.library).is_file() and spec.library == f"{name}.so"
        # the step method is the text_decoder module exported for one token: one weights file, one KV cache
        weights = "text_decoder" if name == STEP_METHOD else name
        assert (bundle / spec.weights).is_file() and spec.weights == f"{weights}.safetensors"
    assert m.methods[STEP_METHOD].state == m.methods["text_decoder"].state
    assert (bundle / "tekken.json").is_file()


def test_manifest_lists_every_file_with_its_sha256_and_size(bundle):
    m = read_manifest(bundle)
    on_disk = {p.name for p in bundle.iterdir()} - {MANIFEST_NAME}
    assert set(m.files) == on_disk
    for rel, entry in m.files.items():
        data = (bundle / rel).read_bytes()
        assert entry.size == len(data), rel
        assert entry.sha256 == hashlib.sha256(data).hexdigest(), rel


def test_manifest_records_build_and_model_facts(bundle, checkpoint, which):
    m = read_manifest(bundle)
    assert m.format_version == FORMAT_VERSION
    assert m.torch_version == torch.__version__
    assert m.device == "cpu" and m.gpu_arch is None and m.dtype == "float32"
    config = VoxtralConfig.from_hf_file(checkpoint / "config.json")
    assert VoxtralConfig.from_dict(m.model["config"]) == config
    assert m.model["tokens_per_chunk"] == TOKENS_PER_CHUNK == 375
    assert (m.model["max_seq_len"], m.model["max_audio_chunks"]) == ((1024, 2) if which == "tiny" else (512, 1))
    assert m.model["source"]["kind"] == "checkpoint" and m.model["source"]["name"] == checkpoint.name
    assert m.model["tokenizer"] == "tekken.json"
    assert (bundle / "tekken.json").read_bytes() == (checkpoint / "tekken.json").read_bytes()


def test_special_token_ids_are_looked_up_by_name_in_tekken(bundle):
    m = read_manifest(bundle)
    tok = Tekken.from_file(bundle / "tekken.json")
    names = {
        "bos": "<s>",
        "eos": "</s>",
        "inst": "[INST]",
        "inst_end": "[/INST]",
        "audio": "[AUDIO]",
        "begin_audio": "[BEGIN_AUDIO]",
        "transcribe": "[TRANSCRIBE]",
    }
    assert m.model["special_tokens"] == {k: tok.special_id(v) for k, v in names.items()}
    assert m.model["special_tokens"]["audio"] == VoxtralConfig.from_dict(m.model["config"]).audio_token_id


def test_method_io_specs_carry_dtypes_and_dynamic_bounds(bundle):
    m = read_manifest(bundle)
    c = VoxtralConfig.from_dict(m.model["config"])
    K, S, H, V = m.model["max_audio_chunks"], m.model["max_seq_len"], c.text.dim, c.text.vocab_size

    def io(name):
        spec = m.methods[name]
        return ([(t.name, t.dtype, t.shape) for t in spec.inputs], [(t.name, t.dtype, t.shape) for t in spec.outputs])

    assert io("preprocessor") == (
        [("waveform", "float32", [{"min": N_SAMPLES, "max": K * N_SAMPLES, "multiple": N_SAMPLES}])],
        [("mel", "float32", [{"min": 1, "max": K}, 128, 3000])],
    )
    assert io("audio_encoder") == (
        [("mel", "float32", [{"min": 1, "max": K}, 128, 3000])],
        [("audio_embeds", "float32", [1, {"min": TOKENS_PER_CHUNK, "max": K * TOKENS_PER_CHUNK}, H])],
    )
    assert io("token_embedding") == (
        [("ids", "int64", [1, {"min": 1, "max": S}])],
        [("embeds", "float32", [1, {"min": 1, "max": S}, H])],
    )
    assert io("text_decoder") == (
        [("embeds", "float32", [1, {"min": 1, "max": S}, H]), ("cache_position", "int64", [{"min": 1, "max": S}])],
        [("logits", "float32", [1, V])],
    )
    state = m.methods["text_decoder"].state
    assert set(state) == {
        f"layers.{i}.self_attn.kv_cache.{kv}" for i in range(c.text.n_layers) for kv in ("k_cache", "v_cache")
    }
    for s in state.values():
        assert s.shape == [1, c.text.n_kv_heads, S, c.text.head_dim] and s.dtype == "float32"
    for name in ("preprocessor", "audio_encoder", "token_embedding"):
        assert m.methods[name].state == {}


# ---------------------------------------------------------------- weights live outside the .so files


def test_weight_files_hold_every_parameter_of_the_checkpoint(bundle, checkpoint):
    m = read_manifest(bundle)
    reference, _, _ = load_checkpoint(checkpoint)
    want = reference.state_dict()
    got = model_from_bundle(bundle, m).state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    with safe_open(str(bundle / m.methods["text_decoder"].weights), "pt") as f:
        assert not any("kv_cache" in k for k in f.keys())  # state is allocated by the runtime, not shipped
    with safe_open(str(bundle / m.methods["preprocessor"].weights), "pt") as f:
        assert set(f.keys()) == {"window", "filters"}
        mel = LogMelSpectrogram(VoxtralConfig.from_dict(m.model["config"]).audio.n_mels)
        assert torch.equal(f.get_tensor("filters"), mel.filters) and torch.equal(f.get_tensor("window"), mel.window)


def _distinctive_window(raw: bytes, size: int = 64) -> bytes | None:
    """A `size`-byte window of `raw`, from the middle outwards, with enough distinct bytes to be unique."""
    mid = len(raw) // 2
    for start in sorted(range(0, len(raw) - size + 1, 4), key=lambda i: abs(i - mid)):
        window = raw[start : start + size]
        if len(set(window)) >= 24:
            return window
    return None


def test_libraries_do_not_contain_the_weights(bundle):
    """package_constants_in_so=False: no weight's bytes appear in any `.so`. For every tensor of a method's
    weight file, a distinctive 64-byte window of its data is searched for in the method's library."""
    m = read_manifest(bundle)
    for name, spec in m.methods.items():
        lib = (bundle / spec.library).read_bytes()
        checked = []
        with safe_open(str(bundle / spec.weights), "pt") as f:
            for key in f.keys():
                raw = f.get_tensor(key).contiguous().view(torch.uint8).numpy().tobytes()
                window = _distinctive_window(raw)
                if window is None:
                    continue  # constant (norm scales of one, zero biases): no unique bytes to look for
                assert window not in lib, f"{spec.library} contains the bytes of {key}"
                checked.append(key)
        biggest = {
            "preprocessor": "filters",
            "audio_encoder": "multi_modal_projector.linear_1.weight",
            "token_embedding": "embed_tokens.weight",
            "text_decoder": "lm_head.weight",
            "text_decoder_step": "lm_head.weight",
        }[name]
        assert biggest in checked, (name, checked)


# ---------------------------------------------------------------- each method through our delegate vs eager


def test_preprocessor_matches_log_mel_spectrogram(loaded):
    program, eager = loaded
    K = program.manifest.model["max_audio_chunks"]
    mel = LogMelSpectrogram(eager.config.audio.n_mels)
    speech = pad_to_chunks(load_audio(AUDIO / "speech.wav"), K)
    noise = (np.random.default_rng(0).standard_normal(K * N_SAMPLES) * 0.1).astype(np.float32)
    for wave in (speech, noise[:N_SAMPLES], noise):
        w = torch.from_numpy(wave)
        got = program.methods["preprocessor"](w)[0]
        _close(got, mel(w), f"preprocessor, {len(wave) // N_SAMPLES} chunk(s)")


def test_audio_encoder_matches_eager_for_each_chunk_count(loaded):
    program, eager = loaded
    K = program.manifest.model["max_audio_chunks"]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in [1, 2, 1][: 3 if K >= 2 else 1]:  # 1 -> 2 -> 1: shapes change between calls
            mel = torch.randn(n, 128, 3000, generator=g)
            got = program.methods["audio_encoder"](mel)[0]
            want = AudioEncoderMethod(eager)(mel)
            assert got.shape == (1, n * TOKENS_PER_CHUNK, eager.config.text.dim)
            _close(got, want, f"audio_encoder, {n} chunk(s)")


def test_audio_encoder_of_a_real_recording_matches_eager(loaded):
    """waveform -> preprocessor -> audio_encoder, all exported, against the eager chain."""
    program, eager = loaded
    w = torch.from_numpy(pad_to_chunks(load_audio(AUDIO / "speech.wav"), program.manifest.model["max_audio_chunks"]))
    with torch.no_grad():
        got = program.methods["audio_encoder"](program.methods["preprocessor"](w)[0])[0]
        want = AudioEncoderMethod(eager)(LogMelSpectrogram(eager.config.audio.n_mels)(w))
    _close(got, want, "preprocessor -> audio_encoder")


def test_audio_encoder_refuses_more_chunks_than_exported(loaded):
    program, _ = loaded
    K = program.manifest.model["max_audio_chunks"]
    with pytest.raises(DelegateError, match="audio_encoder"):
        program.methods["audio_encoder"](torch.zeros(K + 1, 128, 3000))


def test_token_embedding_matches_eager_exactly(loaded):
    program, eager = loaded
    V = eager.config.text.vocab_size
    strided = torch.arange(600).reshape(1, 600)[:, ::2]  # not contiguous: the delegate must cope
    for ids in (torch.tensor([[1]]), torch.tensor([[0, 3, 24, 25, V - 1]]), strided, torch.tensor([[7]])):
        got = program.methods["token_embedding"](ids)[0]
        assert torch.equal(got, TokenEmbeddingMethod(eager)(ids))


def test_text_decoder_prefill_and_decode_match_eager_with_kv_state(loaded):
    """An audio prompt (audio embeddings at the [AUDIO] positions) into text_decoder, then greedy decode steps of
    one position through text_decoder_step; the KV cache the two share holds what eager's buffers do."""
    program, eager = loaded
    sp = program.manifest.model["special_tokens"]
    m = program.methods
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor(
        [
            [sp["bos"], sp["inst"], sp["begin_audio"]]
            + [sp["audio"]] * TOKENS_PER_CHUNK
            + [100, 200, 300, sp["inst_end"]]
        ]
    )
    S = ids.shape[1]
    with torch.no_grad():
        mel = torch.randn(1, 128, 3000, generator=g)
        audio = m["audio_encoder"](mel)[0]
        embeds = m["token_embedding"](ids)[0].clone()
        embeds[0, ids[0] == sp["audio"]] = audio[0]
        eager_embeds = TokenEmbeddingMethod(eager)(ids)
        eager_embeds[0, ids[0] == sp["audio"]] = AudioEncoderMethod(eager)(mel)[0]
        _close(embeds, eager_embeds, "prefill embeddings")

        for run in range(2):  # a second prompt after reset_state must give the same answers
            program.reset_state()
            eager.reset_caches()
            decoder = eager.decoder()
            got = m["text_decoder"](embeds, torch.arange(S))[0]
            want = decoder(embeds, torch.arange(S))
            _close(got, want, f"run {run}: prefill logits")
            tokens = []
            for step in range(4):
                tok = int(want.argmax())
                assert int(got.argmax()) == tok
                tokens.append(tok)
                e = m["token_embedding"](torch.tensor([[tok]]))[0]
                got = m["text_decoder_step"](e, torch.tensor([S + step]))[0]
                want = decoder(e, torch.tensor([S + step]))
                _close(got, want, f"run {run}: decode step {step}")
            if run == 0:
                first_tokens = tokens
            else:
                assert tokens == first_tokens


def test_text_decoder_state_matters(loaded):
    """The decode step only matches because of the prefill's KV state (text_decoder wrote it, text_decoder_step
    reads it): after reset_state it differs."""
    program, eager = loaded
    m = program.methods
    g = torch.Generator().manual_seed(2)
    embeds = torch.randn(1, 20, eager.config.text.dim, generator=g) * 0.5
    step = m["token_embedding"](torch.tensor([[5]]))[0]
    program.reset_state()
    m["text_decoder"](embeds, torch.arange(20))
    warm = m["text_decoder_step"](step, torch.tensor([20]))[0]
    program.reset_state()
    cold = m["text_decoder_step"](step, torch.tensor([20]))[0]
    assert (warm - cold).abs().max() > 1e-3
    eager.reset_caches()
    with torch.no_grad():
        _close(cold, eager.decoder()(step, torch.tensor([20])), "decode step on an empty cache")


def test_other_bundle_matches_transformers_end_to_end(other_bundle, other_checkpoint):
    """The bundle nobody hard-codes, against transformers on the checkpoint it was exported from: mel from
    the exported preprocessor, audio prompt, last-position logits and one decode step."""
    from transformers import VoxtralForConditionalGeneration

    hf = VoxtralForConditionalGeneration.from_pretrained(other_checkpoint).eval()
    assert hf.config.text_config.num_key_value_heads == OTHER_HF_CONFIG["text_config"]["num_key_value_heads"]
    with Program.load(other_bundle) as program:
        m, sp = program.methods, program.manifest.model["special_tokens"]
        ids = torch.tensor(
            [[sp["bos"], sp["inst"], sp["begin_audio"]] + [sp["audio"]] * TOKENS_PER_CHUNK + [400, 500, sp["inst_end"]]]
        )
        S = ids.shape[1]
        w = torch.from_numpy(pad_to_chunks(load_audio(AUDIO / "speech.wav"), 1))
        mel = m["preprocessor"](w)[0]
        embeds = m["token_embedding"](ids)[0].clone()
        embeds[0, ids[0] == sp["audio"]] = m["audio_encoder"](mel)[0][0]
        program.reset_state()
        got = m["text_decoder"](embeds, torch.arange(S))[0]
        with torch.no_grad():
            want = hf(input_ids=ids, input_features=mel).logits[:, -1]
        _close(got, want, "prefill vs transformers")
        nxt = int(want.argmax())
        got = m["text_decoder_step"](m["token_embedding"](torch.tensor([[nxt]]))[0], torch.tensor([S]))[0]
        with torch.no_grad():
            want = hf(input_ids=torch.cat([ids, torch.tensor([[nxt]])], 1), input_features=mel).logits[:, -1]
        _close(got, want, "decode step vs transformers")


# ---------------------------------------------------------------- the exporter's failure paths and its cache


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_reexport_hits_the_compile_cache(tiny_bundle, tiny_checkpoint, tmp_path):
    m = read_manifest(tiny_bundle)
    model, source, tekken = load_checkpoint(tiny_checkpoint)
    t0 = time.perf_counter()
    sizes = {"max_audio_chunks": m.model["max_audio_chunks"], "max_seq_len": m.model["max_seq_len"]}
    report = export_voxtral(model, source, tekken, tmp_path / "again", ExportOptions(cache_dir=CACHE, **sizes))
    wall = time.perf_counter() - t0
    assert report.cached == {name: True for name in (*METHOD_NAMES, STEP_METHOD)}
    assert all(s < 1.0 for s in report.compile_seconds.values()), report.compile_seconds
    assert wall < 30, f"a cached re-export took {wall:.1f} s"
    cold = sum(m.model["compile_seconds"].values())
    if cold > 10:  # the session bundle was compiled in this run: a cached export must be far faster
        assert wall < cold / 3, f"cached re-export {wall:.1f} s vs cold compile {cold:.1f} s"
    again = read_manifest(tmp_path / "again")
    for name in (*METHOD_NAMES, STEP_METHOD):  # the same libraries and weights
        for rel in (m.methods[name].library, m.methods[name].weights):
            assert again.files[rel] == m.files[rel], rel
    assert set(report.max_error) == {*METHOD_NAMES, STEP_METHOD}
    assert all(e <= self_check.TOLERANCE[torch.float32] for e in report.max_error.values())
    assert _leftovers(tmp_path) == []


def test_an_export_over_the_bundle_it_would_build_leaves_it_as_it_is(
    tiny_bundle, tiny_checkpoint, tmp_path, monkeypatch
):
    """`export` into a directory holding exactly the bundle its inputs build: nothing staged, compiled, checked or
    written. Other inputs (here: not self-checked), or a file changed since, build it again."""
    m = read_manifest(tiny_bundle)
    opts = ExportOptions(
        cache_dir=CACHE, max_audio_chunks=m.model["max_audio_chunks"], max_seq_len=m.model["max_seq_len"]
    )
    out = tmp_path / "tiny"
    shutil.copytree(tiny_bundle, out)
    model, source, tekken = load_checkpoint(tiny_checkpoint)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}

    def stage(dest):
        raise AssertionError(f"{dest} was built again")

    with monkeypatch.context() as patched:
        patched.setattr(exporter, "make_stage", stage)
        report = export_voxtral(model, source, tekken, out, opts)
    assert report.up_to_date and report.max_error == {}
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == before

    unchecked = export_voxtral(model, source, tekken, out, replace(opts, check=False))
    assert not unchecked.up_to_date and unchecked.max_error == {}
    assert read_manifest(out).model["inputs"] != m.model["inputs"]
    checked = export_voxtral(model, source, tekken, out, opts)  # the unchecked bundle is not the checked one
    assert not checked.up_to_date and set(checked.max_error) == {*METHOD_NAMES, STEP_METHOD}
    assert read_manifest(out).model["inputs"] == m.model["inputs"]

    weights = out / m.methods["token_embedding"].weights
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 1
    weights.write_bytes(bytes(damaged))
    assert not export_voxtral(model, source, tekken, out, opts).up_to_date
    verify_bundle(out)
    assert _leftovers(tmp_path) == []


def test_max_autotune_reaches_only_the_methods_named(default_tiny_bundle, tiny_checkpoint, tmp_path, monkeypatch):
    """`--max-autotune audio_encoder`: that method is compiled with Inductor's max_autotune and cached under its own
    key; every other method's key is the one an export without the flag uses (so it comes from the cache). A name
    that is no method fails before anything is compiled."""
    model, source, tekken = load_checkpoint(tiny_checkpoint)
    plain, tuned = ExportOptions(cache_dir=CACHE), ExportOptions(cache_dir=CACHE, max_autotune=("audio_encoder",))
    for method in METHOD_NAMES:
        same = exporter.cache_key(model, source, plain, method, {}) == exporter.cache_key(
            model, source, tuned, method, {}
        )
        assert same == (method != "audio_encoder"), method
    compiled = {}

    def compile_(ep, package_path, inductor_configs):
        compiled[Path(package_path).stem] = inductor_configs.get("max_autotune", False)
        raise RuntimeError("stop at the first compile")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_)
    with pytest.raises(ExportError, match=r"--max-autotune nope: no such method \(these are: preprocessor, "):
        export_voxtral(model, source, tekken, tmp_path / "out", replace(tuned, max_autotune=("nope",)))
    assert compiled == {}
    with pytest.raises(RuntimeError, match="stop at the first compile"):
        export_voxtral(model, source, tekken, tmp_path / "out", tuned)  # the preprocessor from the cache
    assert compiled == {"audio_encoder": True}


def test_failed_compile_leaves_no_half_bundle(tiny_bundle, tiny_checkpoint, tmp_path, monkeypatch):
    """A private compile cache holding only the preprocessor: it is staged, then audio_encoder's compile fails.
    Nothing may be left: no bundle, no staging directory."""

    def boom(plan, *a, **k):
        raise RuntimeError(f"inductor fell over compiling {plan.name}")

    monkeypatch.setattr(exporter, "compile_method", boom)
    model, source, tekken = load_checkpoint(tiny_checkpoint)
    opts = ExportOptions(cache_dir=tmp_path / "cache")
    cached = (
        tmp_path
        / "cache"
        / "compiled"
        / exporter.cache_key(model, source, opts, "preprocessor", family_key(opts))
        / f"preprocessor.{sha256_file(tiny_bundle / 'preprocessor.so')}.so"  # an entry is named after its digest
    )
    cached.parent.mkdir(parents=True)
    shutil.copyfile(tiny_bundle / "preprocessor.so", cached)
    staged = []
    monkeypatch.setattr(aoti, "save_file", lambda tensors, path, *a, **k: staged.append(Path(path).name))
    out = tmp_path / "bundles" / "tiny"
    with pytest.raises(RuntimeError, match="compiling audio_encoder"):
        export_voxtral(model, source, tekken, out, opts)
    assert staged == ["preprocessor.safetensors"]  # the failure came after something was staged
    assert not out.exists()
    assert _leftovers(out.parent) == []


def test_failed_self_check_keeps_the_previous_bundle(tiny_bundle, tiny_checkpoint, tmp_path, monkeypatch):
    """Re-exporting over an existing bundle: if the new export fails, the old bundle is still there, intact."""
    out = tmp_path / "tiny"
    shutil.copytree(tiny_bundle, out)
    before = (out / MANIFEST_NAME).read_bytes()

    def fail(*a, **k):
        raise ExportError("self-check says no")

    monkeypatch.setattr(self_check, "compare", fail)
    model, source, tekken = load_checkpoint(tiny_checkpoint)
    with pytest.raises(ExportError, match="self-check says no"):
        export_voxtral(model, source, tekken, out, ExportOptions())
    assert (out / MANIFEST_NAME).read_bytes() == before
    verify_bundle(out)
    assert _leftovers(tmp_path) == []


def test_self_check_mismatch_aborts_and_publishes_nothing(tiny_bundle, tiny_checkpoint, tmp_path, monkeypatch):
    """The real self-check, with the eager audio encoder changed after the weights were written: it must see
    the difference, name the method, and publish nothing."""
    real = self_check.eager_outputs

    def tampered(plans, model):
        with torch.no_grad():
            model.multi_modal_projector.linear_2.weight.mul_(1.01)
        return real(plans, model)

    monkeypatch.setattr(self_check, "eager_outputs", tampered)
    model, source, tekken = load_checkpoint(tiny_checkpoint)
    out = tmp_path / "tiny"
    with pytest.raises(ExportError, match=r"audio_encoder: exported output differs from eager"):
        export_voxtral(model, source, tekken, out, ExportOptions())
    assert not out.exists()
    assert _leftovers(tmp_path) == []


def test_zero_tolerance_fails_the_self_check(tiny_bundle, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(self_check.TOLERANCE, torch.float32, 0.0)
    model, source, tekken = load_checkpoint(tiny_checkpoint)
    out = tmp_path / "tiny"
    with pytest.raises(ExportError, match="differs from eager"):
        export_voxtral(model, source, tekken, out, ExportOptions())
    assert not out.exists()
    assert _leftovers(tmp_path) == []


def test_max_seq_len_too_small_for_the_audio_is_an_export_error(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(exporter, "compile_method", lambda *a, **k: pytest.fail("compiled despite a bad option"))
    model, source, tekken = load_checkpoint(tiny_checkpoint)
    out = tmp_path / "tiny"
    with pytest.raises(ExportError, match=r"--max-seq-len 700 .*2 audio chunks"):
        export_voxtral(
            model, source, tekken, out, ExportOptions(max_seq_len=700, max_audio_chunks=2, cache_dir=tmp_path / "cache")
        )
    assert not out.exists()
    with pytest.raises(ExportError, match="--max-seq-len 380"):
        export_voxtral(
            model, source, tekken, out, ExportOptions(max_seq_len=380, max_audio_chunks=1, cache_dir=tmp_path / "cache")
        )
    assert not out.exists() and _leftovers(tmp_path) == []


def test_refuses_to_replace_a_directory_that_is_not_a_bundle(tiny_bundle, tiny_checkpoint, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    model, source, tekken = load_checkpoint(tiny_checkpoint)
    with pytest.raises(PublishError, match="not a bundle"):
        export_voxtral(model, source, tekken, out, ExportOptions())
    assert (out / "thesis.tex").read_text() == "years of work"
    assert _leftovers(tmp_path) == []


def test_tokenizer_that_disagrees_with_the_config_is_an_export_error(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(exporter, "compile_method", lambda *a, **k: pytest.fail("compiled despite a bad tokenizer"))
    ckpt = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["audio_token_id"] = 25
    (ckpt / "config.json").write_text(json.dumps(cfg))
    model, source, tekken = load_checkpoint(ckpt)
    with pytest.raises(ExportError, match=r"\[AUDIO\] is id 24"):
        export_voxtral(model, source, tekken, tmp_path / "out", ExportOptions(cache_dir=tmp_path / "cache"))
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not (shutil.which("ld") and shutil.which("objcopy") and shutil.which("nm")), reason="binutils")
def test_kernel_binaries_sharing_a_cubin_embed_as_separate_objects(tmp_path):
    """torch 2.11's AOTInductor names the embedded object `<cubin>.o` whatever the kernel: two kernel names over one
    cubin (the 3B step's attention) gave one object linked twice ("multiple definition of ___attention_kernel_N_start").
    Inside `_one_object_per_kernel` each name gets its own object defining its own symbols, and both link together."""
    import subprocess

    from torch._inductor import codecache

    cubin = tmp_path / "abc.cubin"
    cubin.write_bytes(bytes(range(256)) * 4)
    convert = codecache.convert_cubin_to_obj
    assert convert(str(cubin), "kern_0", "ld", "objcopy") == convert(str(cubin), "kern_1", "ld", "objcopy")  # the bug
    with aoti._one_object_per_kernel():
        objs = [codecache.convert_cubin_to_obj(str(cubin), f"kern_{i}", "ld", "objcopy") for i in (0, 1)]
    assert codecache.convert_cubin_to_obj is convert  # restored
    assert len(set(objs)) == 2
    for i, obj in enumerate(objs):
        symbols = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
        assert f"__kern_{i}_start" in symbols and f"__kern_{1 - i}_start" not in symbols
    so = tmp_path / "both.so"
    subprocess.run(["gcc", "-shared", "-o", str(so), *objs], capture_output=True, text=True, check=True)
    assert so.stat().st_size > 2 * 1024
