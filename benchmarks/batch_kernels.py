"""The batched decode step's linears (`runner/export/kernels_rows.py`) on the 3B shapes, on a GPU.

1. rows: for each linear kind, a grid of (BLOCK_N, BLOCK_K, warps, stages), each timed over the 30 layers'
   distinct weights in one CUDA graph (nothing served from L2) at each of --batches rows, in the row block a
   `--max-batch` bundle compiles; beside cuBLAS (F.linear at those rows) on the same weights. A config's score is
   its sum over the batches; the best per kind are printed as ROWS_CONFIGS lines and used by part 2.
2. step: the whole batched step (BatchDecoder over a slot cache of --max-batch rows filled to --fill, eager in one
   CUDA graph, programmatic edges where the GPU has them) at each of --batches: with torch's linears (cuBLAS) and
   with the row kernels, beside the batch-1 DecodeStep; ms per step and the ratio to the batch-1 step.

    python benchmarks/batch_kernels.py --out batch_kernels.json                 (GPU; the 3B bf16)
    python benchmarks/batch_kernels.py --fp8 --parts rows,step --batches 8,32    (on e4m3 codes)
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
from decode_kernels import BF16, DEV, build, rel_err, rms, to_fp8
from profile_decode import graph_ms

from runner.export import kernels as K
from runner.export import kernels_batch as KB
from runner.export import kernels_rows as KR
from runner.export.decode_step import DecodeStep, fp8_kernel
from runner.models.voxtral_batch import BatchDecoder, BatchKernels, SlotCaches
from runner.models.voxtral_config import TextConfig

GRIDS = {  # (BLOCK_N, BLOCK_K, num_warps, num_stages); each config compiles once per batch's specialisation
    "quick": list(itertools.product((16, 32, 64), (128, 256), (4,), (2, 3, 4))),
    "full": list(itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (2, 3, 4))),
}


def weight(lin):
    """(the tensor the kernel streams, its scale or None)."""
    return (lin.qweight, lin.weight_scale) if fp8_kernel(lin) else (lin.weight, None)


def cases(lm, c: TextConfig) -> dict:
    """kind -> (table key prefix, N, K, [(weight, scale)] per call, flags)."""
    L, d = lm.model.layers, c.head_dim
    return {
        "qkv": ("rms", (c.n_heads + 2 * c.n_kv_heads) * d, c.dim, [weight(la.self_attn.qkv_proj) for la in L], {}),
        "o_proj": ("add", c.dim, c.n_heads * d, [weight(la.self_attn.o_proj) for la in L], {}),
        "gate_up": ("rms_glu", c.ffn_dim, c.dim, [weight(la.mlp.gate_up_proj) for la in L], {"glu": True}),
        "down": ("add", c.dim, c.ffn_dim, [weight(la.mlp.down_proj) for la in L], {}),
        "lm_head": ("rms_f32", c.vocab_size, c.dim, [weight(lm.lm_head)] * 4, {"out_f32": True}),
    }


def sweep_rows(lm, c, batches: list[int], max_rows: int, results: dict, fp8: bool, grid: list) -> None:
    out = results["rows"] = {}
    for name, case in cases(lm, c).items():
        out[name] = r = sweep_kind(lm, c, case, batches, max_rows, fp8, grid)
        KR.ROWS_CONFIGS[r["key"]] = r["best"]  # part 2 runs the best
        tb = ", ".join(f"B={b} {v:.2f}" for b, v in r["tb_s"].items())
        cu = ", ".join(f"B={b} {v:.2f}" for b, v in r["cublas_tb_s"].items())
        print(f"{name:8s} best {r['best']}: TB/s {tb} | cuBLAS {cu or '-'} | rel err {r['rel_err']:.1e}", flush=True)
        print(f"    {r['key']!r}: {r['best']!r},", flush=True)


def sweep_kind(lm, c, case, batches: list[int], max_rows: int, fp8: bool, grid: list) -> dict:
    kind, n, k, ws, flags = case
    g, eps = lm.model.norm.weight, c.norm_eps
    key = (kind + ("_fp8" if fp8 else ""), n, k, KR.block_rows(max_rows))
    held = KR.rows_config(*key)
    nbytes = sum(w.numel() * w.element_size() for w, _ in ws)
    xs = {b: torch.randn(b, k, dtype=BF16, device=DEV) for b in batches}
    rs = {b: torch.randn(b, n, dtype=BF16, device=DEV) for b in batches}

    def launch(b, w, s, cfg):
        if kind == "add":
            return KR._launch_rows(xs[b], w, scale=s, residual=rs[b], max_rows=max_rows, config=cfg)
        return KR._launch_rows(xs[b], w, g=g, scale=s, eps=eps, max_rows=max_rows, config=cfg, **flags)

    w0, s0 = ws[0]
    wd = w0.to(BF16) * s0[:, None].to(BF16) if s0 is not None else w0
    b0 = batches[-1]
    y = F.linear(xs[b0] if kind == "add" else rms(xs[b0], g, eps), wd)
    want = rs[b0] + y if kind == "add" else F.silu(y[:, :n]) * y[:, n:] if kind == "rms_glu" else y
    err = rel_err(launch(b0, w0, s0, held), want)
    cublas = {} if fp8 else {b: graph_ms(lambda b=b: [F.linear(xs[b], w) for w, _ in ws], 20) for b in batches}
    rows, t0 = [], time.time()
    for cfg in sorted({held} | {g_ for g_ in grid if g_[1] <= max(16, 1 << (k - 1).bit_length())}):
        try:
            ms = {b: graph_ms(lambda b=b, cfg=cfg: [launch(b, w, s, cfg) for w, s in ws], 20) for b in batches}
        except Exception as e:  # a config Triton cannot compile (registers, shared memory): skip it, say so
            print(f"  {key} {cfg}: {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        rows.append((sum(ms.values()), cfg, ms))
    rows.sort(key=lambda r: r[0])
    best, best_ms = rows[0][1], rows[0][2]
    held_ms = next(r[2] for r in rows if r[1] == held)
    return {
        "key": key,
        "best": best,
        "held": held,
        "rel_err": err,
        "seconds": time.time() - t0,
        "us_per_call": {b: ms * 1e3 / len(ws) for b, ms in best_ms.items()},
        "held_us_per_call": {b: ms * 1e3 / len(ws) for b, ms in held_ms.items()},
        "tb_s": {b: nbytes / ms / 1e9 for b, ms in best_ms.items()},
        "cublas_tb_s": {b: nbytes / ms / 1e9 for b, ms in cublas.items()},
        "top5": [(round(t, 4), cfg) for t, cfg, _ in rows[:5]],
    }


def time_steps(lm, c, batches: list[int], max_rows: int, fill: int, results: dict) -> None:
    pdl = K.pdl_supported(torch.empty(0, device=DEV))
    slots = SlotCaches(c, max_rows, lm.model.layers[0].self_attn.kv_cache.k_cache.shape[2], BF16, DEV)
    gen = torch.Generator(device=DEV).manual_seed(1)
    for t in slots.buffers():
        t[:, :, :fill].copy_(torch.randn(t[:, :, :fill].shape, generator=gen, device=DEV))
    rows = KR.RowLinears(max_rows, pdl=pdl)
    kinds = {
        "torch linears": BatchKernels(attend=KB.attend),
        "row kernels": BatchKernels(KB.attend, rows.rms_linear, rows.linear_add),
    }
    out = results["step"] = {}
    with torch.no_grad():
        step1 = DecodeStep(c, lm, pdl=pdl)
        emb1, pos1 = torch.randn(1, 1, c.dim, dtype=BF16, device=DEV) * 0.5, torch.tensor([fill], device=DEV)
        out["batch1_decode_step_ms"] = one = graph_ms(lambda: step1(emb1, pos1), 30, pdl)
        print(f"batch-1 DecodeStep: {one:.3f} ms", flush=True)
        for b in batches:
            emb = torch.randn(b, 1, c.dim, dtype=BF16, device=DEV) * 0.5
            pos = fill - torch.arange(b, device=DEV) % 64  # rows at their own positions
            logits = {}
            for name, kernels in kinds.items():
                dec = BatchDecoder(c, lm, slots, kernels)
                logits[name] = dec(emb, pos)
                ms = min(graph_ms(lambda dec=dec, emb=emb, pos=pos: dec(emb, pos), 20, pdl) for _ in range(2))
                out[f"{name} B={b}"] = {"ms": ms, "vs_batch1": ms / one}
                print(f"B={b:3d} {name:14s} {ms:.3f} ms/step = {ms / one:.2f}x batch 1", flush=True)
            out[f"rel_err B={b}"] = rel_err(logits["row kernels"], logits["torch linears"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--fp8", action="store_true", help="the linears in e4m3 (--quant fp8)")
    ap.add_argument("--parts", default="rows,step", help="which of rows,step to run")
    ap.add_argument("--batches", default="1,8,32", help="rows per step, comma-separated")
    ap.add_argument("--max-batch", type=int, default=32, help="the bundle's --max-batch: the slots, the row block")
    ap.add_argument("--fill", type=int, default=450, help="cache positions already written")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="quick", help="the configs part 1 sweeps")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if parts - {"rows", "step"}:
        ap.error(f"--parts: unknown {sorted(parts - {'rows', 'step'})}")
    batches = [int(b) for b in args.batches.split(",")]
    if not all(1 <= b <= args.max_batch for b in batches):
        ap.error(f"--batches: 1 to --max-batch ({args.max_batch}) rows each")
    c = TextConfig()
    lm = build(c, 1024, args.fill + 1)
    if args.fp8:
        to_fp8(lm)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fp8": args.fp8}
    try:
        if "rows" in parts:
            sweep_rows(lm, c, batches, args.max_batch, results, args.fp8, GRIDS[args.grid])
        if "step" in parts:
            time_steps(lm, c, batches, args.max_batch, args.fill, results)
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
