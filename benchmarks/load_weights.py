"""Weights onto the GPU: our streamed loader against safetensors' load_file and session 19's grouped mappings.

    python benchmarks/load_weights.py --dir artifacts/wbench --rounds 2 --out weights.md

Writes two files of the 3B bundle's sizes (token_embedding 805 MB; a decoder of 30 layers plus lm_head, 6.85 GB;
bf16, ones: the bytes do not matter to the copy), then loads them in a fresh process per loader and round (the
first pinned allocation, the first copy and the process's peak RSS are part of what a bundle's load pays), the
loaders alternating. Each process checks its tensors against the file's (sum of every tensor, in float64).
The files stay in the page cache, as after an export: what is timed is the copy, not the disk.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

LOADERS = ("ours", "safetensors", "grouped-s19")
D, FF, KV, VOCAB, LAYERS = 3072, 8192, 1024, 131072, 30


def make_files(d: Path) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    emb, dec = d / "token_embedding.safetensors", d / "text_decoder.safetensors"
    if not emb.is_file():
        save_file({"tok_embeddings.weight": torch.ones(VOCAB, D, dtype=torch.bfloat16)}, str(emb))
    if not dec.is_file():
        w = {}
        for i in range(LAYERS):
            w[f"layers.{i}.attention.wqkv.weight"] = torch.ones(D + 2 * KV, D, dtype=torch.bfloat16)
            w[f"layers.{i}.attention.wo.weight"] = torch.ones(D, D, dtype=torch.bfloat16)
            w[f"layers.{i}.feed_forward.w13.weight"] = torch.ones(2 * FF, D, dtype=torch.bfloat16)
            w[f"layers.{i}.feed_forward.w2.weight"] = torch.ones(D, FF, dtype=torch.bfloat16)
            w[f"layers.{i}.attention_norm.weight"] = torch.ones(D, dtype=torch.bfloat16)
            w[f"layers.{i}.ffn_norm.weight"] = torch.ones(D, dtype=torch.bfloat16)
        w["norm.weight"] = torch.ones(D, dtype=torch.bfloat16)
        w["output.weight"] = torch.ones(VOCAB, D, dtype=torch.bfloat16)
        save_file(w, str(dec))
    return [emb, dec]


def grouped_s19(path: Path, device):
    """Session 19's loader (runner/runtime/weights.py before session 21): groups of ≤ 512 MiB, each through its
    own safetensors mapping, closed before the next."""
    import math

    from safetensors import safe_open

    size = {"BF16": 2, "F32": 4}
    groups, n = [[]], 0
    with safe_open(str(path), framework="pt") as f:
        for name in f.offset_keys() if hasattr(f, "offset_keys") else f.keys():
            s = f.get_slice(name)
            b = math.prod(s.get_shape()) * size[s.get_dtype()]
            if groups[-1] and n + b > 512 << 20:
                groups.append([])
                n = 0
            groups[-1].append(name)
            n += b
    out = {}
    for names in groups:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def child(loader: str, files: list[Path]) -> dict:
    import torch

    dev = torch.device("cuda")
    torch.empty(1, device=dev)  # the context, as a bundle's load has it before its first weights
    torch.cuda.synchronize()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    per = {}
    loaded = []
    for p in files:
        t = time.perf_counter()
        if loader == "ours":
            from runner.runtime.weights import load_weights

            w = load_weights(p, dev)
        elif loader == "safetensors":
            from safetensors.torch import load_file

            w = load_file(str(p), device="cuda")
        else:
            w = grouped_s19(p, dev)
        torch.cuda.synchronize()
        per[p.stem] = (time.perf_counter() - t) * 1e3
        loaded.append(w)
    total = (time.perf_counter() - t0) * 1e3
    nbytes = sum(t.numel() * t.element_size() for w in loaded for t in w.values())
    ok = all(float(t.double().sum()) == t.numel() for w in loaded for t in w.values())  # every element is 1
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"loader": loader, "ms": total, "per_file_ms": per, "gb_s": nbytes / total / 1e6, "ok": ok,
            "peak_rss_mib": rss, "rss_before_mib": rss0, "bytes": nbytes}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("artifacts/wbench"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="markdown table (and a .json beside it)")
    ap.add_argument("--child", choices=LOADERS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    files = make_files(a.dir)
    if a.child:
        print(json.dumps(child(a.child, files)))
        return 0
    rows = []
    for r in range(a.rounds):
        for loader in LOADERS:
            cmd = [sys.executable, __file__, "--dir", str(a.dir), "--child", loader]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"  round {r} {loader}: failed\n{proc.stderr[-3000:]}", flush=True)
                return 1
            res = json.loads(proc.stdout.splitlines()[-1])
            res["round"] = r
            rows.append(res)
            print(f"  round {r} {loader:12s} {res['ms']:8.1f} ms {res['gb_s']:6.2f} GB/s "
                  f"peak RSS {res['peak_rss_mib']:7.0f} MiB (before {res['rss_before_mib']:.0f}) ok={res['ok']}",
                  flush=True)  # fmt: skip
    lines = [
        f"Weights onto the GPU: {rows[0]['bytes'] / 1e9:.2f} GB in two files (3B token_embedding + text_decoder "
        f"sizes), page-cached; a fresh process per loader and round, alternating; `{' '.join(sys.argv)}`",
        "",
        "| loader | load ms (each round) | GB/s (best) | peak host RSS MiB (max) | RSS before MiB | values ok |",
        "|---|---|---:|---:|---:|---|",
    ]
    for loader in LOADERS:
        rs = [x for x in rows if x["loader"] == loader]
        each = " / ".join(f"{x['ms']:.0f}" for x in rs)
        lines.append(
            f"| {loader} | {each} | {max(x['gb_s'] for x in rs):.2f} | "
            f"{max(x['peak_rss_mib'] for x in rs):.0f} | {max(x['rss_before_mib'] for x in rs):.0f} | "
            f"{all(x['ok'] for x in rs)} |"
        )
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
        a.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0 if all(x["ok"] for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
