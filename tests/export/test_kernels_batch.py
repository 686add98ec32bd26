"""The batched decode step's attention and merge kernels (runner/export/kernels_batch.py) against the written-out
attention: rows at their own positions in their own slots, splits (empty ones included, their partials never
read), grouped query heads, nothing read past a row's position; and the tiny model's batched step through them
against the written-out step. On a GPU the
kernel is compiled; without one, Triton's interpreter runs it (float16: it computes tl.dot on bfloat16 wrongly)."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEV, DOT_DTYPE, on_h200_target  # before the kernels: on a CPU machine they are interpreted

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


def nan_filled(monkeypatch):
    """torch.empty / empty_like give NaN-filled floats: a partial the merge reads but no program wrote shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


@pytest.mark.parametrize("positions", [[0], [5], [0, 17, 63], [40, 1, 33, 63]])
@pytest.mark.parametrize("rep", [1, 3, 4])
@pytest.mark.parametrize("splits,block_t", [(1, 16), (4, 16), (16, 16), (2, 32), (4, 64)])
def test_batch_attention_matches_the_rows_own_positions(positions, rep, splits, block_t, monkeypatch):
    nan_filled(monkeypatch)
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
from runner.export import kernels_batch as KB

out = {}
z = lambda n, dt=torch.bfloat16: torch.zeros(n, dtype=dt)
for splits in (4, 16):  # the 1024 bundle's and the 10-minute bundle's
    shape = dict(H_KV=8, REP=4, REP_P2=4, D=128, BLOCK_T=KB.BATCH_BLOCK_T, SPLITS=splits)
    parts = dict(pos_ptr=z(2, torch.int64), m_ptr=z(2 * 8 * splits * 4, torch.float32),
                 l_ptr=z(2 * 8 * splits * 4, torch.float32), acc_ptr=z(2 * 8 * splits * 4 * 128, torch.float32))
    kernels = {
        "attention": (KB._batch_attention_kernel, dict(SM_SCALE=128**-0.5, BLOCK_H=16),
                      dict(q_ptr=z(2 * 8 * 4 * 128), k_ptr=z(2 * 8 * 64 * 128), v_ptr=z(2 * 8 * 64 * 128), max_seq=64)),
        "merge": (KB._batch_merge_kernel, {}, dict(out_ptr=z(2 * 8 * 4 * 128))),
    }
    for name, (kernel, consts, tensors) in kernels.items():
        consts = {**shape, **consts}
        kw = {**parts, **tensors, **consts}
        sig = {a: ("constexpr" if a in consts else "i32" if a == "max_seq" else
                   "*" + {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int64: "i64"}[kw[a].dtype])
               for a in kernel.arg_names}
        k = triton.compile(ASTSource(kernel, sig, consts), target=H200, options={"num_warps": 4})
        out[f"{name}{splits}"] = {"shared": k.metadata.shared, "local": ".local" in k.asm["ptx"],
                                  "writes": written(kernel, kw)}
print(json.dumps(out))
"""


def test_the_3b_tiles_compile_for_the_h200_and_write_only_their_outputs():
    """Both kernels compiled for sm_90 here (no GPU needed) at the 3B's shapes with 4 and 16 splits: no spills to
    local memory; AOTInductor's analysis finds the attention writing its partials alone, never the slot caches it
    reads, and the merge writing the output alone."""
    got = on_h200_target(COMPILE)
    for splits in ("4", "16"):
        assert got["attention" + splits]["writes"] == ["acc_ptr", "l_ptr", "m_ptr"]
        assert got["merge" + splits]["writes"] == ["out_ptr"]
        for kernel in ("attention", "merge"):
            assert not got[kernel + splits]["local"] and got[kernel + splits]["shared"] <= 227 * 1024
