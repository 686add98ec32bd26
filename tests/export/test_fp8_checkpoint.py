"""FP8 checkpoints in compressed-tensors' layout (RedHatAI/Voxtral-Mini-3B-2507-FP8-dynamic's): written here from the
tiny seeded model, quantised per channel by the test's own code, with the quantization_config llm-compressor's
FP8_DYNAMIC scheme writes. Such a checkpoint loads dequantised (each weight its codes times its scales, within fp8
rounding of the original); `--quant fp8` stores its codes and scales byte for byte (the layers it left in bf16
quantised at export), `--quant none` its dequantised weights in bf16; every malformed field or tensor is one line
naming the file."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runner.app.cli import main
from runner.errors import ExportError
from runner.export import voxtral as export_module
from runner.export.checkpoint import load_checkpoint
from runner.export.methods import method_weights
from runner.export.options import ExportOptions
from runner.export.pipeline import ExportReport

FP8 = torch.float8_e4m3fn
QUANTISED = re.compile(
    r"^language_model\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"
)
# each fused layer of ours and the checkpoint's parts of it, in order
LAYER_PARTS = {
    "self_attn.qkv_proj": ("q", "k", "v"),
    "self_attn.o_proj": ("o",),
    "mlp.gate_up_proj": ("gate", "up"),
    "mlp.down_proj": ("down",),
}


def fp8_config() -> dict:
    """quantization_config as llm-compressor's FP8_DYNAMIC scheme writes it (ignore: as Red Hat's Voxtral FP8)."""
    args = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8, "observer_kwargs": {},
            "symmetric": True, "type": "float"}  # fmt: skip
    return {
        "config_groups": {
            "group_0": {
                "format": "float-quantized",
                "input_activations": {**args, "dynamic": True, "observer": None, "strategy": "token"},
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {**args, "dynamic": False, "observer": "minmax", "strategy": "channel"},
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ["language_model.lm_head", "re:audio_tower.*", "re:multi_modal_projector.*"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
    }


def per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own quantiser: each row's largest magnitude to 448, e4m3 round to nearest; scales [N, 1]."""
    scale = w.float().abs().amax(1, keepdim=True) / 448
    return (w.float() / scale).to(FP8), scale


def write_fp8_checkpoint(src: Path, dest: Path, scale_dtype=torch.float32, flat_scales=False, config=None) -> Path:
    dest.mkdir(parents=True)
    shutil.copyfile(src / "tekken.json", dest / "tekken.json")
    out = {}
    for k, v in load_file(str(src / "model.safetensors")).items():
        if QUANTISED.match(k):
            q, scale = per_channel(v)
            out[k], out[k + "_scale"] = q, (scale.reshape(-1) if flat_scales else scale).to(scale_dtype)
        else:
            out[k] = v
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    doc = json.loads((src / "config.json").read_text())
    doc["quantization_config"] = fp8_config() if config is None else config
    (dest / "config.json").write_text(json.dumps(doc, indent=2))
    return dest


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    return write_fp8_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("fp8") / "voxtral-tiny-fp8")


def fused_stored(ckpt: Path, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused layer's codes and float32 scales [N] as the checkpoint holds its parts, concatenated."""
    state = load_file(str(ckpt / "model.safetensors"))
    block, _, _ = module.partition(".")
    parts = LAYER_PARTS[module]
    keys = [f"language_model.model.layers.{layer}.{block}.{p}_proj.weight" for p in parts]
    return torch.cat([state[k] for k in keys]), torch.cat([state[k + "_scale"].float().reshape(-1) for k in keys])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == FP8 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("scale_dtype,flat", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_an_fp8_checkpoint_loads_dequantised_within_fp8_rounding(tiny_checkpoint, tmp_path, scale_dtype, flat):
    ckpt = write_fp8_checkpoint(tiny_checkpoint, tmp_path / "ckpt", scale_dtype, flat)
    model, source, _ = load_checkpoint(ckpt)
    plain, _, _ = load_checkpoint(tiny_checkpoint)
    stored = load_file(str(ckpt / "model.safetensors"))
    got, orig = model.to_hf_layout(model.state_dict()), plain.to_hf_layout(plain.state_dict())
    assert set(got) == set(orig)
    for k, w in orig.items():
        if not QUANTISED.match(k):
            assert torch.equal(got[k], w), k  # lm_head, embeddings, audio tower, norms: as they were
            continue
        scale = stored[k + "_scale"].float().reshape(-1, 1)
        assert torch.equal(got[k], stored[k].float() * scale), k  # the codes times their scales, in float32
        # within half an e4m3 step of the weight quantised (1/16 of it; 2^-10 of the scale among subnormals), and a
        # bf16 scale's own rounding (2^-9)
        slack = w.abs() / 16 + scale * 2**-10 + (w.abs() / 256 if scale_dtype == torch.bfloat16 else 0)
        assert ((got[k] - w).abs() <= slack).all(), k
    assert sorted(source.fp8) == sorted(f"language_model.model.layers.{i}.{m}" for i in range(2) for m in LAYER_PARTS)
    q, scale = source.fp8["language_model.model.layers.1.self_attn.qkv_proj"]
    want_q, want_scale = fused_stored(ckpt, 1, "self_attn.qkv_proj")
    assert same_bytes(q, want_q) and scale.dtype == torch.float32 and torch.equal(scale, want_scale)


def captured_export(ckpt: Path, monkeypatch, tmp_path: Path, **opts) -> dict:
    """What export_voxtral hands the pipeline for this checkpoint (the model, its plans, the manifest fields),
    compiling nothing."""
    got = {}

    def build_bundle(model, plans, source, tokenizer, meta, out, options, progress=None, key=None):
        got.update(model=model, plans={p.name: p for p in plans}, meta=meta)
        return ExportReport()

    monkeypatch.setattr(export_module, "build_bundle", build_bundle)
    model, source, tekken = load_checkpoint(ckpt)
    options = ExportOptions(dtype="bf16", max_audio_chunks=1, cache_dir=tmp_path, **opts)
    export_module.export_voxtral(model, source, tekken, tmp_path / "bundle", options)
    return got


def test_fp8_export_stores_the_checkpoints_codes_and_scales_as_they_are(fp8_checkpoint, monkeypatch, tmp_path):
    got = captured_export(fp8_checkpoint, monkeypatch, tmp_path, quant="fp8")
    record = got["meta"]["quant"]
    assert record["scheme"] == "fp8" and record["n_linear"] == 9 and record["from_checkpoint"] == 8
    assert record["prefill"] == "dequantised"  # the CPU's: no _scaled_mm
    weights = method_weights(got["plans"]["text_decoder"])
    for layer in range(2):
        for module in LAYER_PARTS:
            q, scale = fused_stored(fp8_checkpoint, layer, module)
            assert same_bytes(weights[f"layers.{layer}.{module}.qweight"], q), (layer, module)
            assert torch.equal(weights[f"layers.{layer}.{module}.weight_scale"], scale), (layer, module)
    # the lm_head the checkpoint left in full precision: quantised at export, from its bf16 weight
    plain, _, _ = load_checkpoint(fp8_checkpoint)
    w = plain.language_model.lm_head.weight.to(torch.bfloat16).float()
    q, scale = weights["lm_head.qweight"], weights["lm_head.weight_scale"]
    assert q.dtype == FP8 and torch.equal(scale, w.abs().amax(1) / 448)
    assert ((q.float() * scale[:, None] - w).abs() <= w.abs() / 16 + scale[:, None] * 2**-10).all()
    assert not any(k.endswith("_proj.weight") or k == "lm_head.weight" for k in weights)


def test_any_other_export_starts_from_the_dequantised_weights(fp8_checkpoint, monkeypatch, tmp_path):
    got = captured_export(fp8_checkpoint, monkeypatch, tmp_path, quant="none")
    assert got["meta"]["quant"] is None
    weights = method_weights(got["plans"]["text_decoder"])
    q, scale = fused_stored(fp8_checkpoint, 0, "self_attn.qkv_proj")
    want = (q.float() * scale[:, None]).to(torch.bfloat16)
    assert torch.equal(weights["layers.0.self_attn.qkv_proj.weight"], want)


def mutate(doc: dict, path: str, value) -> dict:
    """doc with the dotted `path` set to `value` (a trailing key of None: deleted)."""
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node[p]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return doc


W = "config_groups.group_0.weights"
BAD_CONFIGS = [
    ("", "fp8", "quantization_config: 'fp8' is not a JSON object"),
    ("quant_method", "gptq", "quantization_config.quant_method: 'gptq' is not read (expected 'compressed-tensors')"),
    ("format", "pack-quantized", "quantization_config.format: 'pack-quantized' is not read"),
    ("quantization_status", "frozen", "quantization_config.quantization_status: 'frozen' is not read"),
    ("kv_cache_scheme", {"num_bits": 8, "type": "float"}, "quantization_config.kv_cache_scheme: {"),
    ("config_groups", {}, "quantization_config.config_groups: {} is not read"),
    (f"{W}.strategy", "tensor", f"quantization_config.{W}.strategy: 'tensor' is not read (expected 'channel'"),
    (f"{W}.strategy", None, f"quantization_config.{W}.strategy is missing"),
    (f"{W}.num_bits", 4, f"quantization_config.{W}.num_bits: 4 is not read (expected 8)"),
    (f"{W}.type", "int", f"quantization_config.{W}.type: 'int' is not read"),
    (f"{W}.group_size", 128, f"quantization_config.{W}.group_size: 128 is not read"),
    ("config_groups.group_0.input_activations.dynamic", False, "input_activations.dynamic: False is not read"),
    ("config_groups.group_0.targets", "Linear", "quantization_config.config_groups.group_0.targets: 'Linear'"),
]


@pytest.mark.parametrize("path,value,needle", BAD_CONFIGS, ids=[c[0] or "whole" for c in BAD_CONFIGS])
def test_a_malformed_quantization_config_is_one_line_naming_config_json(tiny_checkpoint, tmp_path, path, value, needle):
    config = value if not path else mutate(fp8_config(), path, value)
    ckpt = write_fp8_checkpoint(tiny_checkpoint, tmp_path / "ckpt", config=config)
    with pytest.raises(ExportError) as e:
        load_checkpoint(ckpt)
    msg = str(e.value)
    assert msg.startswith(f"{ckpt / 'config.json'}: ") and "\n" not in msg, msg
    assert needle in msg, msg


def rewrite_weights(ckpt: Path, change) -> Path:
    state = load_file(str(ckpt / "model.safetensors"))
    change(state)
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    return ckpt / "model.safetensors"


DOWN = "language_model.model.layers.1.mlp.down_proj.weight"
BAD_TENSORS = [
    (lambda s: s.pop(DOWN + "_scale"), f"{DOWN} is fp8 with no weight_scale beside it"),
    (lambda s: s.update({DOWN + "_scale": torch.ones(64, 2)}), "_scale is torch.float32 [64, 2], expected float32 or"),
    (lambda s: s[DOWN + "_scale"].__setitem__(3, float("nan")), "holds a scale that is negative, infinite or NaN"),
    (lambda s: s.update({DOWN: s[DOWN].float().to(torch.float8_e5m2)}), "is torch.float8_e5m2 [64, 128], expected"),
    (lambda s: s.update({DOWN + "_scale": s[DOWN + "_scale"].to(torch.int32)}), "_scale is torch.int32"),
]


@pytest.mark.parametrize("change,needle", BAD_TENSORS, ids=["no-scale", "scale-shape", "nan", "e5m2", "int-scale"])
def test_a_bad_weight_or_scale_is_one_line_naming_its_file(fp8_checkpoint, tmp_path, change, needle):
    ckpt = shutil.copytree(fp8_checkpoint, tmp_path / "ckpt")
    weights = rewrite_weights(ckpt, change)
    with pytest.raises(ExportError) as e:
        load_checkpoint(ckpt)
    msg = str(e.value)
    assert msg.startswith(f"{weights}: ") and "\n" not in msg and needle in msg, msg


def test_fp8_weights_without_a_quantization_config_and_a_config_without_them_are_refused(
    fp8_checkpoint, tiny_checkpoint, tmp_path
):
    no_config = shutil.copytree(fp8_checkpoint, tmp_path / "a")
    doc = json.loads((no_config / "config.json").read_text())
    del doc["quantization_config"]
    (no_config / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ExportError, match=r"model\.safetensors: .* but .*config\.json has no quantization_config"):
        load_checkpoint(no_config)
    no_fp8 = shutil.copytree(tiny_checkpoint, tmp_path / "b")
    doc = json.loads((no_fp8 / "config.json").read_text()) | {"quantization_config": fp8_config()}
    (no_fp8 / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ExportError, match=r"config\.json: quantization_config says float-quantized, but no weight"):
        load_checkpoint(no_fp8)


def test_the_cli_says_it_in_one_line(tiny_checkpoint, tmp_path, capsys):
    config = mutate(fp8_config(), f"{W}.strategy", "block")
    ckpt = write_fp8_checkpoint(tiny_checkpoint, tmp_path / "ckpt", config=config)
    argv = ["export", "--checkpoint", str(ckpt), "--device", "cpu", "--quant", "fp8", "--out", str(tmp_path / "b")]
    assert main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [f"error: {ckpt / 'config.json'}: quantization_config.{W}.strategy: 'block' is not read (expected "
                   "'channel': one scale per output channel)"]  # fmt: skip
    assert not (tmp_path / "b").exists()
