import time, tempfile, torch
from pathlib import Path
from runner.export.config import preset
from runner.export.model import Voxtral
from runner.export.exporter import ExportOptions, plan_methods, compile_method
t0 = time.time()
with torch.device("cuda"):
    m = Voxtral(preset("voxtral-mini-3b")).to(torch.bfloat16).eval()
m.setup_caches(1024, torch.bfloat16)
opts = ExportOptions(device="cuda", dtype="bf16", max_seq_len=1024, max_audio_chunks=1)
plan = [p for p in plan_methods(m, opts) if p.name == "text_decoder_step"][0]
print("built", type(plan.module).__name__, round(time.time() - t0), flush=True)
so = compile_method(plan, opts, Path(tempfile.mkdtemp()), None)
print("linked", so, so.stat().st_size, round(time.time() - t0), flush=True)
