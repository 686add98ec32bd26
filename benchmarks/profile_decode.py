"""Where a 3B decode step's GPU time goes (issue 6), in one GPU call.

1. GEMV ceilings: the decoder's weight matrices times one token through cuBLAS, 30 layers + lm_head captured in
   one CUDA graph (distinct weights per layer, so nothing is served from L2), as the bundle has them (q, k, v,
   gate, up separate) and fused (qkv, gate_up). This is the decode step with every non-matmul kernel removed.
2. The bundle's decode step: graph replays back to back (GPU time per step, no host loop), and a kernel table
   from torch.profiler over replays and over direct calls.
3. Prefill: the kernel tables of audio_encoder and of text_decoder's prefill, direct calls, on --chunks x 30 s of
   audio (1: the headline's 385-token prompt; 20: 10 minutes, 7510 tokens).
4. Time to first token: one runner.generate() on speech.wav (the bench's e2e figure), host and device on one
   clock: the GPU's busy time, and its idle gaps with the host event running in each (where the time goes
   beyond the kernels).
5. With --batches (a bundle exported with --max-batch): the batched step's CUDA graph at each batch, replays back to
   back and its kernel table (every row at position 385, as the batch-1 step).

    python benchmarks/profile_decode.py artifacts/3b > profile.txt
    python benchmarks/profile_decode.py --no-ceilings --batches 1,8,32 artifacts/3b-batch32 > profile.txt
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from runner.audio import N_SAMPLES, load_audio
from runner.families.voxtral import Tekken, transcription_prompt
from runner.runtime.engine import ProgramEngine, to_encoder_dtype
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.graphs import capture_graph
from runner.runtime.options import RuntimeOptions
from runner.runtime.program import Program
from runner.stats import Stats

AUDIO = Path(__file__).resolve().parents[1] / "fixtures" / "audio" / "speech.wav"


def graph_ms(fn, replays: int = 50, overlap: bool = False) -> float:
    """GPU time per call of `fn` captured as one CUDA graph, replayed back to back (with `overlap`, the decode
    kernels' edges programmatic: runner/runtime/pdl.py)."""
    g = capture_graph(fn, "cuda", overlap).graph
    g.replay()
    torch.cuda.synchronize()
    return replay_ms(g, replays)


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 100) -> float:
    """GPU time per replay of a captured graph, replayed back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def gemv_ceilings(dim=3072, q=4096, kv=1024, ffn=8192, vocab=131072, layers=30) -> None:
    bf16, dev = torch.bfloat16, "cuda"
    x, xo, xf = (torch.randn(1, n, dtype=bf16, device=dev) for n in (dim, q, ffn))
    head = torch.randn(vocab, dim, dtype=bf16, device=dev) * 0.02
    layouts = {
        "separate (as exported)": [(q, dim), (kv, dim), (kv, dim), (dim, q), (ffn, dim), (ffn, dim), (dim, ffn)],
        "fused qkv + gate_up": [(q + 2 * kv, dim), (dim, q), (2 * ffn, dim), (dim, ffn)],
    }
    print("## GEMV ceilings: 30 layers of decoder matmuls + lm_head, one token, one CUDA graph\n")
    print("| layout | matmuls/step | ms/step | weight GB | TB/s | tok/s if nothing else ran |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, shapes in layouts.items():
        ms, gb = _time_layout(shapes, layers, {dim: x, q: xo, ffn: xf}, head)
        print(f"| {name} | {layers * len(shapes) + 1} | {ms:.3f} | {gb:.2f} | {gb / ms:.2f} | {1e3 / ms:.0f} |")
        torch.cuda.empty_cache()
    print()


def _time_layout(shapes, layers, inputs, head) -> tuple[float, float]:
    ws = [[torch.randn(o, i, dtype=head.dtype, device="cuda") * 0.02 for o, i in shapes] for _ in range(layers)]

    def step():
        for lw in ws:
            for w in lw:
                torch.mm(inputs[w.shape[1]], w.t())
        torch.mm(inputs[head.shape[1]], head.t())

    gb = (sum(w.numel() for lw in ws for w in lw) + head.numel()) * 2 / 1e9
    return graph_ms(step), gb


# A kernel's kind by its name (cuBLAS's and Triton's GEMM/GEMV kernels, ours included; the attention kernels)
KINDS = (
    ("matmul", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk", "fp8_mm", "int4", "_mm_")),
    ("attention", ("attention", "attend", "flash", "merge")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in KINDS if any(m in low for m in marks)), "the rest")


def kernel_rows(events) -> dict[str, list[float]]:
    """name -> [count, µs] over the GPU's kernels; the `method:` ranges the runtime annotates are spans over
    kernels, not kernels, and left out."""
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("method:"):
            r = rows[e.name]
            r[0] += 1
            r[1] += e.time_range.elapsed_us()
    return rows


def kind_line(rows: dict[str, list[float]], per: int) -> str:
    """One line: each kind's kernels and ms per call."""
    kinds: dict[str, list[float]] = {kind: [0, 0.0] for kind in ("matmul", "attention", "the rest")}
    for name, (n, us) in rows.items():
        kind = kinds[kernel_kind(name)]
        kind[0] += n
        kind[1] += us
    return "By kind, per call: " + "; ".join(
        f"{kind} {us / per / 1e3:.3f} ms ({n / per:.0f} kernels)" for kind, (n, us) in kinds.items()
    )


def kernel_table(prof, per: int, title: str, top: int = 25) -> None:
    rows = kernel_rows(prof.events())
    total = sum(r[1] for r in rows.values())
    count = sum(r[0] for r in rows.values())
    print(f"## {title}: {count / per:.0f} kernels and {total / per / 1e3:.3f} ms of kernel time per call\n")
    print("| kernel | per call | us per call | share |")
    print("|---|---:|---:|---:|")
    for name, (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| `{name[:90]}` | {n / per:.0f} | {us / per:.1f} | {us / total:.1%} |")
    print(f"\n{kind_line(rows, per)}\n")


def ttft_timeline(engine: ProgramEngine, tok: Tekken, gaps: int = 12) -> None:
    runner = MultimodalRunner(engine, tok, tok.special_id("[AUDIO]"))
    segments = transcription_prompt(tok, load_audio(AUDIO), "en")
    opts = GenerationOptions(max_new_tokens=1)
    for _ in range(3):
        runner.generate(segments, opts)
    torch.cuda.synchronize()
    stats = Stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.generate(segments, opts, stats=stats)
    device = torch.autograd.DeviceType.CUDA
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == device)
    host = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type != device]
    busy, holes, last = 0.0, [], kernels[0][0]
    for start, end in kernels:
        if start > last:
            holes.append((start - last, last))
        busy += max(0.0, end - max(start, last))
        last = max(last, end)
    span = last - kernels[0][0]

    def during(t: float) -> str:
        on = [(e - s, name) for s, e, name in host if s <= t <= e]
        outer = [name for _, name in sorted(on, reverse=True) if name.startswith(("method:", "aten::", "cuda"))]
        if len(outer) > 3:  # the innermost says what the host is waiting in (e.g. cudaHostAlloc under a copy)
            outer = [*outer[:2], "…", outer[-1]]
        return " > ".join(outer) or "(no host event)"

    print(f"## time to first token, one generate(): TTFT {stats.ttft_ms:.2f} ms; GPU from first to last kernel")
    print(f"{span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms in {len(holes)} gaps\n")
    print("| gap (us) | at (ms after the first kernel) | host events running (outermost first, then the innermost) |")
    print("|---:|---:|---|")
    for length, at in sorted(holes, reverse=True)[:gaps]:
        print(f"| {length:.0f} | {(at - kernels[0][0]) / 1e3:.2f} | {during(at + length / 2)} |")
    methods = [(s, e, n) for s, e, n in host if n.startswith("method:")]
    print("\n| host call | starts at (ms) | host time (ms) |")
    print("|---|---:|---:|")
    for s, e, n in sorted(methods):
        print(f"| {n} | {(s - kernels[0][0]) / 1e3:.2f} | {(e - s) / 1e3:.2f} |")
    print()


def profile_prefill(engine: ProgramEngine, chunks: int, acts) -> None:
    """Part 3 at `chunks` x 30 s of audio (a prompt of 375 per chunk + 10 text tokens): the kernel tables of the
    encoder's call and of the text_decoder's prefill, each called directly after three warm-up runs."""
    g = torch.Generator().manual_seed(0)
    wave = (torch.randn(chunks * N_SAMPLES, generator=g) * 0.1).cuda()
    ids = torch.randint(0, 1000, (1, 10), generator=g).cuda()
    mel = to_encoder_dtype(engine.preprocess(wave), engine.encoder_dtype)
    audio = engine.encode(mel)
    embeds = torch.cat([engine.embed(ids[:, :3]), audio, engine.embed(ids[:, 3:])], dim=1)
    pos = torch.arange(embeds.shape[1], device="cuda")
    for name, fn in (
        ("audio_encoder", lambda: engine.encode(mel)),
        ("text_decoder", lambda: engine.decode(embeds, pos)),
    ):
        for _ in range(3):
            engine.reset()
            fn()
        engine.reset()
        torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            fn()
            torch.cuda.synchronize()
        what = f"{chunks} chunk(s)" if name == "audio_encoder" else f"a prefill of {embeds.shape[1]} tokens"
        kernel_table(prof, 1, f"{name}, {what}, direct call", 30)


def profile_batches(engine: ProgramEngine, batches: list[int], steps: int, acts) -> None:
    """Part 5: the batched step's graph of each batch (BatchGraphs captures them all at the first step)."""
    for b in batches:
        tokens = torch.zeros(b, 1, dtype=torch.int64, device="cuda")
        engine.decode_batch(tokens, torch.full((b,), 385, dtype=torch.int64, device="cuda"))
        graph = engine.batch_graphs.graph_for(b)[0]
        print(f"## batched step, B = {b}: graph replays back to back: {replay_ms(graph):.3f} ms/step\n")
        with profile(activities=acts) as prof:
            for _ in range(steps):
                graph.replay()
            torch.cuda.synchronize()
        kernel_table(prof, steps, f"batched step B = {b}, graph replay")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bundle")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-ceilings", action="store_true", help="skip part 1 (the GEMV ceilings)")
    p.add_argument("--no-pdl", action="store_true", help="plain graph edges even where the kernels wait")
    p.add_argument(
        "--chunks",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1],
        help="part 3's audio lengths in 30 s chunks, comma-separated (the bundle must take the most): 1 = the "
        "headline's 385-token prompt, 20 = 10 minutes",
    )
    p.add_argument(
        "--batches",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[],
        help="part 5's batch sizes, comma-separated (a bundle exported with --max-batch at least the largest)",
    )
    args = p.parse_args()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]

    if not args.no_ceilings:
        gemv_ceilings()

    program = Program.load(args.bundle, device="cuda")
    engine = ProgramEngine(program, RuntimeOptions(pdl=not args.no_pdl))
    if args.batches and max(args.batches) > engine.max_batch:
        p.error(f"--batches: the bundle decodes at most {engine.max_batch} rows (export it with --max-batch)")
    engine.reset()  # captures the decode graph
    tok = engine.graph.token
    for chunks in args.chunks:
        profile_prefill(engine, chunks, acts)

    pos = 385
    for _ in range(5):
        engine.graph.step(tok, pos)
    torch.cuda.synchronize()
    print(f"## decode step: graph replays back to back: {replay_ms(engine.graph.graph):.3f} ms/step\n")
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            engine.graph.graph.replay()
        torch.cuda.synchronize()
    kernel_table(prof, args.steps, "decode step, graph replay")
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            engine.decode(engine.embed(tok), torch.tensor([pos], device="cuda"))
        torch.cuda.synchronize()
    kernel_table(prof, args.steps, "decode step, direct calls")
    ttft_timeline(engine, Tekken.from_file(Path(args.bundle) / program.manifest.model["tokenizer"]))
    if args.batches:
        profile_batches(engine, args.batches, args.steps, acts)
    program.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
