"""The 3B `text_decoder_step` alone through torch.export + AOTInductor, with uninitialised weights: does its
`.so` compile and link? About 40-100 s on the H200, where a whole export takes four to five minutes. Session 12
found the step with a cache-writing attention kernel failing at the link (`h200/step_link_s12.log`; fixed in
session 13, NOTES item 20).

    python benchmarks/step_only_check.py     (GPU)
"""

import tempfile
import time
from pathlib import Path

import torch

from runner.export.config import preset
from runner.export.exporter import ExportOptions, compile_method, plan_methods
from runner.export.model import Voxtral

t0 = time.time()
with torch.device("cuda"):
    m = Voxtral(preset("voxtral-mini-3b")).to(torch.bfloat16).eval()
m.setup_caches(1024, torch.bfloat16)
opts = ExportOptions(device="cuda", dtype="bf16", max_seq_len=1024, max_audio_chunks=1)
plan = next(p for p in plan_methods(m, opts) if p.name == "text_decoder_step")
print("built", type(plan.module).__name__, round(time.time() - t0), flush=True)
so = compile_method(plan, opts, Path(tempfile.mkdtemp()), None)
print("linked", so, so.stat().st_size, round(time.time() - t0), flush=True)
