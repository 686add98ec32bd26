"""The batched decode step's attention kernel (runner/export/kernels_batch.py) against the written-out attention:
rows at their own positions in their own slots, splits (empty ones included), grouped query heads, nothing read
past a row's position; and the tiny model's batched step through it against the written-out step. On a GPU the
kernel is compiled; without one, Triton's interpreter runs it (float16: it computes tl.dot on bfloat16 wrongly)."""

from __future__ import annotations

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":  # before the kernels are defined: @triton.jit then makes interpreted functions
    os.environ["TRITON_INTERPRET"] = "1"
DOT_DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16
pytest.importorskip("triton")

from runner.export import kernels_batch as KB  # noqa: E402
from runner.models.voxtral import Voxtral  # noqa: E402
from runner.models.voxtral_batch import BatchDecoder, SlotCaches  # noqa: E402
from runner.models.voxtral_config import preset  # noqa: E402


def reference(q, keys, values, pos):
    """Row b against positions 0..pos[b] of its slot, in float32: [B, H_kv, rep, D]."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for b, p in enumerate(pos.tolist()):
        k, v = keys[b, :, : p + 1].float().cpu(), values[b, :, : p + 1].float().cpu()  # [H_kv, T, D]
        s = torch.einsum("hrd,htd->hrt", q[b].float().cpu(), k) * q.shape[-1] ** -0.5
        out[b] = torch.einsum("hrt,htd->hrd", torch.softmax(s, dim=-1), v)
    return out


@pytest.mark.parametrize("positions", [[0], [5], [0, 17, 63], [40, 1, 33, 63]])
@pytest.mark.parametrize("rep", [1, 4])
@pytest.mark.parametrize("splits,block_t", [(1, 16), (4, 16), (16, 16), (2, 32)])
def test_batch_attention_matches_the_rows_own_positions(positions, rep, splits, block_t):
    g = torch.Generator().manual_seed(len(positions) * 100 + rep)
    b, kv, d, slots, max_seq = len(positions), 2, 16, 6, 64
    q = torch.randn(b, kv, rep, d, generator=g).to(DEV, DOT_DTYPE)
    keys, values = (torch.randn(slots, kv, max_seq, d, generator=g).to(DEV, DOT_DTYPE) for _ in range(2))
    pos = torch.tensor(positions, device=DEV)
    for row, p in enumerate(positions):  # past each row's position: must not be read
        keys[row, :, p + 1 :], values[row, :, p + 1 :] = float("nan"), float("nan")
    keys[b:], values[b:] = float("nan"), float("nan")  # slots past the batch's rows
    got = KB._launch_batch(q, keys[:b], values[:b], pos, splits, block_t)
    assert got.shape == q.shape and got.dtype == q.dtype
    tol = 2e-3 if DOT_DTYPE == torch.float16 else 2e-2
    assert (got.float().cpu() - reference(q, keys, values, pos)).abs().max().item() < tol


@torch.no_grad()
def test_tiny_batched_step_through_the_op_matches_the_written_out_step():
    """Three rows at different positions in their slots, several steps: the op's logits and slot caches against
    the written-out step's (the same cache writes; the attention rounded differently)."""
    cfg = preset("tiny")
    m = Voxtral(cfg).init_weights(seed=5).to(DEV, DOT_DTYPE)
    g = torch.Generator().manual_seed(1)
    results = []
    for attend in (KB.attend, None):
        slots = SlotCaches(cfg.text, 4, 48, DOT_DTYPE, DEV)
        step = BatchDecoder(cfg.text, m.language_model, slots, attend=attend)
        g.manual_seed(1)
        logits = []
        for start in (0, 9, 20, 31):
            pos = torch.tensor([start, start + 3, 2 * start % 40], device=DEV)
            emb = (torch.randn(3, 1, cfg.text.dim, generator=g) * 0.5).to(DEV, DOT_DTYPE)
            logits.append(step(emb, pos))
        results.append((logits, [b.clone() for b in slots.buffers()]))
    (op, op_caches), (written, written_caches) = results
    for a, w in zip(op, written):
        assert (a - w).abs().max() <= 1e-2 * w.abs().max()
    assert torch.equal(op_caches[0], written_caches[0])  # the first layer's keys come before any attention


COMPILE = r"""
import json, torch, triton
import torch._higher_order_ops.triton_kernel_wrap as tkw
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from runner.export import kernels_batch as KB

H200 = GPUTarget("cuda", 90, 32)
if not torch.cuda.is_available():
    class Hopper:
        def get_current_target(self):
            return H200
    triton.runtime.driver.set_active(Hopper())

out = {}
for splits in (4, 16):  # the 1024 bundle's and the 10-minute bundle's
    consts = dict(H_KV=8, SM_SCALE=128**-0.5, REP=4, D=128, BLOCK_H=16, BLOCK_T=128, SPLITS=splits)
    sig = {**dict.fromkeys(("q_ptr", "k_ptr", "v_ptr"), "*bf16"), "pos_ptr": "*i64",
           **dict.fromkeys(("m_ptr", "l_ptr", "acc_ptr"), "*fp32"), "max_seq": "i32", **dict.fromkeys(consts, "constexpr")}
    k = triton.compile(ASTSource(KB._batch_attention_kernel, sig, consts), target=H200, options={"num_warps": 4})
    z = lambda n, dt=torch.bfloat16: torch.zeros(n, dtype=dt)
    kw = dict(q_ptr=z(2 * 8 * 4 * 128), k_ptr=z(2 * 8 * 64 * 128), v_ptr=z(2 * 8 * 64 * 128),
              pos_ptr=z(2, torch.int64), m_ptr=z(2 * 8 * splits * 16, torch.float32),
              l_ptr=z(2 * 8 * splits * 16, torch.float32), acc_ptr=z(2 * 8 * splits * 16 * 128, torch.float32),
              max_seq=64, **consts)
    if hasattr(tkw, "identify_accessed_tensors"):  # torch >= 2.12
        w = sorted(d.name for d in tkw.identify_accessed_tensors(KB._batch_attention_kernel, kw, {}).read_writes.writes)
    else:  # torch 2.11, the H200's
        w = sorted(tkw.identify_mutated_tensors(KB._batch_attention_kernel, kw, {}))
    out[splits] = {"shared": k.metadata.shared, "local": ".local" in k.asm["ptx"], "writes": w}
print(json.dumps(out))
"""


def test_the_3b_tile_compiles_for_the_h200_and_writes_only_its_partials():
    """Compiled for sm_90 here (no GPU needed) at the 3B's shapes with 4 and 16 splits: no spills to local memory;
    AOTInductor's analysis finds it writes its partials alone, never the slot caches it reads."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, cwd=root, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for splits in ("4", "16"):
        assert got[splits]["writes"] == ["acc_ptr", "l_ptr", "m_ptr"]
        assert not got[splits]["local"] and got[splits]["shared"] <= 227 * 1024
