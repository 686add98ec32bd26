"""Why an exported text_decoder_step can disagree with eager: its steps and its KV cache side by side.

Loads a CUDA bundle exported with DEBUG=1 (generated C++ kept in <bundle>/debug), rebuilds the eager decoder from
the bundle's weights, and for positions 0, 1, 2 from an empty cache prints the step's error against the eager
decoder and whether the step wrote each layer's cache slot. Then greps the step's generated wrapper for the
attention launches and for anything that copies or clones.

    DEBUG=1 python -m runner export --preset tiny --random-init --device cuda --dtype bf16 --no-check --out B
    python benchmarks/step_debug.py B tiny
"""

import re
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from runner.export.config import preset
from runner.export.model import Voxtral
from runner.program import Program

if len(sys.argv) != 3 or not (Path(sys.argv[1]) / "text_decoder.safetensors").is_file():
    sys.exit("usage: python benchmarks/step_debug.py BUNDLE PRESET  (a CUDA bundle exported with DEBUG=1)")
bundle, name = Path(sys.argv[1]), sys.argv[2]
with torch.device("cuda"):
    m = Voxtral(preset(name)).to(torch.bfloat16).eval()
m.setup_caches(1024, torch.bfloat16)
dec = m.decoder()
missing, unexpected = dec.load_state_dict(
    load_file(str(bundle / "text_decoder.safetensors"), device="cuda"), strict=False
)
print("weights: missing", [k for k in missing if "cache" not in k][:5], "unexpected", unexpected[:5])
caches = [(la.self_attn.kv_cache.k_cache, la.self_attn.kv_cache.v_cache) for la in dec.layers]
g = torch.Generator(device="cuda").manual_seed(0)
embeds = [torch.randn(1, 1, m.config.text.dim, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3)]
with Program.load(bundle, device="cuda") as program, torch.no_grad():
    step = program.methods["text_decoder_step"]
    state = step.handle.state
    print("state:", {k: list(v.shape) for k, v in list(state.items())[:4]}, len(state))
    program.reset_state()
    m.reset_caches()
    for i, e in enumerate(embeds):
        pos = torch.tensor([i], device="cuda")
        want = dec(e, pos)
        got = step(e, pos)[0]
        torch.cuda.synchronize()
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        written = []
        for li, (kc, _vc) in enumerate(caches):
            sk = next(v for k, v in state.items() if f"layers.{li}." in k and "k_cache" in k)
            written.append(round(((sk[0, :, i].float() - kc[0, :, i].float()).abs().max()).item(), 4))
        print(f"pos {i}: step vs decoder {err:.3e}; |step cache - eager cache| at slot {i} per layer: {written[:6]}")
cpp = sorted((bundle / "debug" / "text_decoder_step").glob("*.cpp"))
for f in cpp:
    src = f.read_text()
    print(f.name, len(src), "chars")
    for pat in ("_attention_kernel", "clone", "copy_", "zero", "fill", "empty_strided", "k_cache"):
        print(f"  {pat}: {len(re.findall(pat, src))}")
    for line in src.splitlines():
        if "_attention_kernel" in line and "launchKernel" in line or re.search(r"copy_|clone", line):
            print("   ", line.strip()[:220])
