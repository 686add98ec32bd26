"""int4 decode on the H200 at the 3B shapes: tinygemm (aten's `_weight_int4pack_mm`, what the int4 decode step
calls on the bundle's buffers) against the bf16 kernels.

1. check: tinygemm on each kind's stored buffers against float64 on the dequantised weight.
2. gemv: tinygemm at M = 1 per kind over the 30 layers' distinct weights in one CUDA graph (nothing served from
   L2), beside the bf16 kernel (with its fused epilogue) on the bf16 weights.
3. step: the whole decode step (30 layers + lm_head) in one CUDA graph: bf16 and int4 DecodeStep (the int4 one as
   eager torch around tinygemm: more launches than the exported step, where Inductor fuses the epilogues); each
   step's logits against its written-out decoder at S = 1.
4. prefill: each kind at a prompt's M rows (385: 30 s; 7510: 10 minutes) over the 30 layers: tinygemm, the
   weight dequantised by Inductor's kernel (the int4 prefill until session 25) or by our Triton op (kernels_int4.py,
   the prefill since) then a bf16 matmul, the bf16 matmul alone (the floor), and each dequantisation alone.
5. agree: teacher-forced top-1 agreement of int4 with bf16: a 385-token prompt (random ids), then 128 tokens the
   bf16 step decodes greedily; int4 prefills the same prompt (torch dequant) and steps through the same tokens
   with tinygemm. Also the prompt's positions (all logits, both models in torch), and bf16's own step against
   its written-out decoder (the kernels' rounding alone).

    python benchmarks/int4_kernels.py --parts check,gemv,step,agree --out int4.json      (GPU; about 3 minutes)
    python benchmarks/int4_kernels.py --parts prefill --rows 385,7510
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F
from profile_decode import graph_ms

from runner.export import kernels as K
from runner.export import kernels_int4 as KI
from runner.export.decode_step import DecodeStep
from runner.export.quant import apply_quant
from runner.export.registry import for_preset
from runner.models.quant_linear import QuantLinear, dequantize
from runner.models.voxtral import Voxtral, rope
from runner.models.voxtral_config import preset

DEV, BF16 = "cuda", torch.bfloat16


def build(max_seq: int) -> tuple[Voxtral, Voxtral]:
    """The 3B preset with seeded random weights (as `--random-init`), bf16, and an int4 copy of it."""
    with torch.device("meta"):
        m = Voxtral(preset("voxtral-mini-3b"))
    m = m.to_empty(device=DEV).to(BF16).init_weights(0).eval()
    m.setup_caches(max_seq, BF16)
    q = copy.deepcopy(m)
    record = apply_quant(q, for_preset("voxtral-mini-3b"), "int4")
    print(f"int4: {record}", flush=True)
    return m, q


def rel(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def cases(m: Voxtral, q: Voxtral) -> dict:
    """kind -> (x [1, K] bf16, the 30 layers' int4 linears, their bf16 weights, the bf16 kernel's launch(w)).
    The bf16 kernel with its epilogue (RMSNorm, residual, SiLU * up), tinygemm the plain matmul: the int4 step
    adds an Inductor kernel per epilogue around it."""
    c = m.config.text
    g = torch.Generator(device=DEV).manual_seed(1)
    x, xo, xf = (torch.randn(n, generator=g, device=DEV).to(BF16) for n in (c.dim, c.n_heads * c.head_dim, c.ffn_dim))
    r = torch.randn(c.dim, generator=g, device=DEV).to(BF16)
    norm = (1 + 0.1 * torch.randn(c.dim, generator=g, device=DEV)).to(BF16)
    eps = c.norm_eps
    lq, lb = q.language_model, m.language_model
    qa = lambda f: [f(la) for la in lq.model.layers]  # noqa: E731
    ba = lambda f: [f(la) for la in lb.model.layers]  # noqa: E731
    return {
        "rms qkv": (
            x, qa(lambda la: la.self_attn.qkv_proj), ba(lambda la: la.self_attn.qkv_proj.weight),
            lambda w: K._launch_gemv(x, w, g=norm, eps=eps),
        ),
        "add o_proj": (
            xo, qa(lambda la: la.self_attn.o_proj), ba(lambda la: la.self_attn.o_proj.weight),
            lambda w: K._launch_gemv(xo, w, residual=r),
        ),
        "rms_glu gate_up": (
            x, qa(lambda la: la.mlp.gate_up_proj), ba(lambda la: la.mlp.gate_up_proj.weight),
            lambda w: K._launch_gemv(x, w, g=norm, eps=eps, glu=True),
        ),
        "add down": (
            xf, qa(lambda la: la.mlp.down_proj), ba(lambda la: la.mlp.down_proj.weight),
            lambda w: K._launch_gemv(xf, w, residual=r),
        ),
        # 0.2 GB of codes: four times L2 by itself
        "rms_f32 lm_head": (
            x, [lq.lm_head] * 2, [lb.lm_head.weight] * 2, lambda w: K._launch_gemv(x, w, g=norm, eps=eps, out_f32=True)
        ),
    }  # fmt: skip


def nbytes(lin: QuantLinear) -> int:
    return sum(t.numel() * t.element_size() for t in (lin.qweight, lin.scales_and_zeros))


def rate(ms: float, nbytes: int, calls: int, prefix: str = "") -> dict:
    """A graph of `calls` kernels over `nbytes` of weights in `ms`: µs per call and the bandwidth it reached."""
    return {f"{prefix}us_per_call": ms * 1e3 / calls, f"{prefix}tb_s": nbytes / ms / 1e9}


def part_check(cs, results) -> None:
    """tinygemm on the stored buffers against float64 on the dequantised weight (the plain matmul)."""
    out = results["check"] = {}
    for kind, (x, lins, _ws, _launch_bf16) in cs.items():
        lin = lins[0]
        want = x.double()[None] @ lin.dequantize(torch.float32).double().T
        out[kind] = {"vs_float64": rel(lin.tinygemm(x[None]), want)}
        print(f"check {kind:16s} tinygemm vs float64 {out[kind]['vs_float64']:.2e}", flush=True)


def part_gemv(cs, results) -> None:
    """tinygemm at M = 1 over the 30 layers' weights in one CUDA graph, beside the bf16 kernel on the bf16 ones."""
    out = results["gemv"] = {}
    for kind, (x, lins, ws, launch_bf16) in cs.items():
        x2 = x[None]
        ms = graph_ms(lambda lins=lins, x2=x2: [lin.tinygemm(x2) for lin in lins])
        bf16_ms = graph_ms(lambda ws=ws, f=launch_bf16: [f(w) for w in ws])
        b, wb = sum(nbytes(lin) for lin in lins), sum(w.numel() * w.element_size() for w in ws)
        out[kind] = {"n": lins[0].out_features, "k": lins[0].in_features, **rate(ms, b, len(lins)),
                     **rate(bf16_ms, wb, len(ws), "bf16_")}  # fmt: skip
        o = out[kind]
        print(f"gemv {kind:16s} tinygemm {o['us_per_call']:.1f} us/call {o['tb_s']:.2f} TB/s | bf16 kernel "
              f"{o['bf16_us_per_call']:.1f} us {o['bf16_tb_s']:.2f} TB/s", flush=True)  # fmt: skip


def part_prefill(cs, results, rows: list[int]) -> None:
    """A prompt's rows through each kind's 30 layers (ms for all 30): tinygemm, dequantise + bf16 matmul, bf16."""
    out = results["prefill"] = {}
    # Inductor's kernel for the dequantisation, as the bundle's prefill compiles it (eager would unpack in steps)
    deq = torch.compile(dequantize, dynamic=False)
    for kind, (x, lins, ws, _launch_bf16) in cs.items():
        if kind.endswith("lm_head"):  # the prefill's lm_head takes the last row only (tinygemm, as a step)
            continue
        for m_rows in rows:
            xm = x[None].expand(m_rows, -1).contiguous()
            ms = {
                "tinygemm": graph_ms(lambda lins=lins, xm=xm: [lin.tinygemm(xm) for lin in lins], 5),
                "dequant_mm": graph_ms(
                    lambda lins=lins, xm=xm: [F.linear(xm, deq(q.qweight, q.scales_and_zeros, BF16)) for q in lins], 5
                ),
                "triton_dequant_mm": graph_ms(
                    lambda lins=lins, xm=xm: [F.linear(xm, KI.dequantize(q)) for q in lins], 5
                ),
                "bf16_mm": graph_ms(lambda ws=ws, xm=xm: [F.linear(xm, w) for w in ws], 5),
                # the dequantisations alone (0.5 + 2 bytes per weight moved)
                "dequant_only": graph_ms(lambda lins=lins: [deq(q.qweight, q.scales_and_zeros, BF16) for q in lins], 5),
                "triton_dequant_only": graph_ms(lambda lins=lins: [KI.dequantize(q) for q in lins], 5),
            }
            w0 = lins[0].dequantize(BF16)
            want = F.linear(xm, w0)
            err = rel(lins[0].tinygemm(xm), want)
            same = torch.equal(KI.dequantize(lins[0]), w0)
            out[f"{kind} M={m_rows}"] = {**{k: round(v, 4) for k, v in ms.items()}, "tinygemm_vs_dequant": err,
                                         "triton_dequant_equal": same}  # fmt: skip
            print(f"prefill {kind:16s} M={m_rows:<5d} 30 layers: tinygemm {ms['tinygemm']:.3f} ms, dequant + mm "
                  f"{ms['dequant_mm']:.3f} (Triton's {ms['triton_dequant_mm']:.3f}, equal: {same}), bf16 mm "
                  f"{ms['bf16_mm']:.3f}; the dequantisation alone {ms['dequant_only']:.3f} (Triton's "
                  f"{ms['triton_dequant_only']:.3f}); tinygemm vs dequant {err:.1e}", flush=True)  # fmt: skip


def step_inputs(m: Voxtral, pos: int):
    g = torch.Generator(device=DEV).manual_seed(2)
    emb = (torch.randn(1, 1, m.config.text.dim, generator=g, device=DEV) * 0.5).to(BF16)
    return emb, torch.tensor([pos], device=DEV)


def part_step(m, q, results, fill: int, pdl: bool) -> None:
    out = results["step"] = {}
    emb, pos = step_inputs(m, fill)
    with torch.no_grad():
        for name, model in (("bf16", m), ("int4", q)):
            step, dec = DecodeStep(model.config.text, model.language_model, pdl=pdl), model.decoder()
            model.reset_caches()
            want = dec(emb, pos)
            model.reset_caches()
            got = step(emb, pos)
            ms = min(graph_ms(lambda step=step: step(emb, pos), 50, overlap=pdl) for _ in range(3))
            out[name] = {"ms": ms, "tok_s_step_only": 1e3 / ms, "rel_err": rel(got, want),
                         "argmax_equal": bool(got.argmax() == want.argmax())}  # fmt: skip
            print(f"step {name}: {ms:.4f} ms/step ({1e3 / ms:.0f} tok/s, the step alone) | vs its written-out "
                  f"decoder rel err {out[name]['rel_err']:.2e}, argmax equal {out[name]['argmax_equal']}", flush=True)  # fmt: skip


def all_logits(model: Voxtral, embeds, positions, hidden: list | None = None) -> torch.Tensor:
    """The written-out decoder's logits at every position [S, vocab] (TextDecoder keeps only the last); each
    layer's output appended to `hidden`."""
    dec = model.decoder()
    max_seq = dec.layers[0].self_attn.kv_cache.k_cache.shape[2]
    mask = torch.arange(max_seq, device=DEV)[None, :] <= positions[:, None]
    cos, sin = rope(positions, dec.c.head_dim, dec.c.rope_theta, embeds.dtype)
    x = embeds
    for layer in dec.layers:
        x = layer(x, cos, sin, positions, mask)
        if hidden is not None:
            hidden.append(x[0].float())
    return dec.lm_head(dec.norm(x[0])).float()


def part_agree(m, q, results, prompt_len: int, new: int, pdl: bool) -> None:
    c = m.config.text
    g = torch.Generator(device=DEV).manual_seed(3)
    ids = torch.randint(0, c.vocab_size, (1, prompt_len), generator=g, device=DEV)
    embed = m.language_model.model.embed_tokens  # the embedding is not quantised: the same in both
    pos = torch.arange(prompt_len, device=DEV)
    out = results["agree"] = {}
    with torch.no_grad():
        m.reset_caches()
        q.reset_caches()
        hb, hq = [], []
        lb, lq = all_logits(m, embed(ids), pos, hb), all_logits(q, embed(ids), pos, hq)
        out["prompt_positions"] = prompt_len
        out["prompt_top1_agreement"] = (lb.argmax(-1) == lq.argmax(-1)).float().mean().item()
        out["prompt_top1_in_int4_top5"] = (
            (lq.topk(5, -1).indices == lb.argmax(-1)[:, None]).any(-1).float().mean().item()
        )
        # how the int4 error grows through the random layers: |h_int4 - h_bf16| / |h_bf16| per layer, and the logits
        out["hidden_rel_err_per_layer"] = [round(((a - b).norm() / b.norm()).item(), 4) for a, b in zip(hq, hb)]
        out["logits_rel_err"] = ((lq - lb).norm() / lb.norm()).item()
        out["logits_cosine"] = F.cosine_similarity(lq, lb, dim=-1).mean().item()
        print(f"agree: hidden rel err by layer {out['hidden_rel_err_per_layer']}; logits rel err "
              f"{out['logits_rel_err']:.3f}, cosine {out['logits_cosine']:.4f}", flush=True)  # fmt: skip
        # bf16 decodes greedily with its kernels; the decoder's written-out step and int4's kernels are forced
        steps = {n: DecodeStep(mod.config.text, mod.language_model, pdl=pdl) for n, mod in (("bf16", m), ("int4", q))}
        tokens, picks = [], {"bf16_decoder": [], "int4": []}
        last = {"bf16": lb[-1], "int4": lq[-1]}
        tok = int(last["bf16"].argmax())
        picks["int4"].append(int(last["int4"].argmax()))
        picks["bf16_decoder"].append(tok)
        dec_b = m.decoder()
        for i in range(new):
            tokens.append(tok)
            e, p = embed(torch.tensor([[tok]], device=DEV)), torch.tensor([prompt_len + i], device=DEV)
            ld = dec_b(e, p)  # the written-out bf16 decoder first: the step then rewrites slot p its own way
            lb_step = steps["bf16"](e, p)
            lq_step = steps["int4"](e, p)
            tok = int(lb_step.argmax())
            if i + 1 < new:
                picks["int4"].append(int(lq_step.argmax()))
                picks["bf16_decoder"].append(int(ld.argmax()))
        want = tokens  # bf16's picks: the token after the prompt, then each step's
        for name, got in picks.items():
            out[f"decode_top1_agreement_{name}"] = sum(a == b for a, b in zip(got, want)) / len(want)
        out["decode_steps"] = len(want)
    print(f"agree: prompt ({prompt_len} positions, torch) int4 vs bf16 top-1 {out['prompt_top1_agreement']:.3f}; "
          f"decode ({out['decode_steps']} teacher-forced steps, kernels) int4 vs bf16 "
          f"{out['decode_top1_agreement_int4']:.3f}; bf16 written-out vs bf16 kernels "
          f"{out['decode_top1_agreement_bf16_decoder']:.3f}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="check,gemv,step,agree")
    ap.add_argument("--fill", type=int, default=450, help="cache positions already written (step)")
    ap.add_argument("--rows", default="385,7510", help="prompt rows for the prefill part")
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - {"check", "gemv", "prefill", "step", "agree"})
    if unknown:  # before the model is built: minutes on a GPU
        ap.error(f"--parts: unknown {unknown}")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows: comma-separated integers, got {args.rows!r}")
    if min(rows) < 1:
        ap.error(f"--rows: at least 1 row each, got {args.rows!r}")
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    t0 = time.time()
    m, q = build(1024)
    print(f"built in {time.time() - t0:.0f} s", flush=True)
    pdl = K.pdl_supported(torch.empty(0, device=DEV))
    try:
        for part in parts:
            t0 = time.time()
            with torch.no_grad():
                if part in ("check", "gemv"):
                    {"check": part_check, "gemv": part_gemv}[part](cases(m, q), results)
                elif part == "prefill":
                    part_prefill(cases(m, q), results, rows)
                elif part == "step":
                    part_step(m, q, results, args.fill, pdl)
                elif part == "agree":
                    part_agree(m, q, results, 385, 128, pdl)
            print(f"[{part}: {time.time() - t0:.0f} s]", flush=True)
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
