"""The batched decode step's attention and merge kernels (runner/export/kernels_batch.py) against the written-out
attention: rows at their own positions in their own slots, RoPE on the queries and the new key, the new key and
value written to each row's slot at its position and nothing else written, splits (empty ones included, their
partials never read), grouped query heads, nothing read past a row's position; and the tiny model's batched step
through them against the written-out step. On a GPU the kernels are compiled; without one, Triton's interpreter
runs them (float16: it computes tl.dot on bfloat16 wrongly)."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEV, DOT_DTYPE, on_h200_target  # before the kernels: on a CPU machine they are interpreted

pytest.importorskip("triton")

from runner.export import kernels_batch as KB  # noqa: E402
from runner.models.voxtral import Voxtral, rope  # noqa: E402
from runner.models.voxtral_batch import BatchDecoder, SlotCaches  # noqa: E402
from runner.models.voxtral_config import preset  # noqa: E402


def rotated(x, cos, sin):
    """RoPE (rotate-half) in float32, rounded once to x's dtype: x [..., D], cos/sin [D] in the model's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos.float() + torch.cat((-x2, x1), dim=-1) * sin.float()).to(x.dtype)


def reference(qkv, cos, sin, keys, values, pos, n_kv):
    """Row b: its rotated queries against slot b's positions 0..pos[b] - 1 and its own rotated key and value, in
    float32 -> ([B, H_kv, rep, D], the new keys [B, H_kv, D], the new values)."""
    b, rows, d = qkv.shape
    q, k, v = qkv.cpu().split([rows - 2 * n_kv, n_kv, n_kv], dim=1)
    out = torch.empty(b, n_kv, (rows - 2 * n_kv) // n_kv, d)
    new_k = torch.stack([rotated(k[i], cos[i].cpu(), sin[i].cpu()) for i in range(b)])
    for i, p in enumerate(pos.tolist()):
        qr = rotated(q[i], cos[i].cpu(), sin[i].cpu()).unflatten(0, (n_kv, -1)).float()  # [H_kv, rep, D]
        kk = torch.cat([keys[i, :, :p].cpu(), new_k[i][:, None]], dim=1).float()  # [H_kv, p + 1, D]
        vv = torch.cat([values[i, :, :p].cpu(), v[i][:, None]], dim=1).float()
        scores = torch.einsum("hrd,htd->hrt", qr, kk) * d**-0.5
        out[i] = torch.einsum("hrt,htd->hrd", torch.softmax(scores, dim=-1), vv)
    return out, new_k, v


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
    qkv = torch.randn(b, kv * rep + 2 * kv, d, generator=g).to(DEV, DOT_DTYPE)
    keys, values = (torch.randn(slots, kv, max_seq, d, generator=g).to(DEV, DOT_DTYPE) for _ in range(2))
    pos = torch.tensor(positions, device=DEV)
    cos, sin = rope(pos, d, 1e4, DOT_DTYPE)
    for row, p in enumerate(positions):  # the row's position and past it: written, or never read
        keys[row, :, p:], values[row, :, p:] = float("nan"), float("nan")
    keys[b:], values[b:] = float("nan"), float("nan")  # slots past the batch's rows
    before = keys.clone(), values.clone()
    want, new_k, new_v = reference(qkv, cos, sin, keys, values, pos, kv)
    got = KB._launch_batch(qkv, cos, sin, keys, values, pos, splits, block_t)
    assert got.shape == (b, kv, rep, d) and got.dtype == qkv.dtype
    tol = 2e-3 if DOT_DTYPE == torch.float16 else 2e-2
    assert (got.float().cpu() - want).abs().max().item() < tol
    rows = torch.arange(b, device=DEV)
    assert torch.equal(keys[rows, :, pos].cpu(), new_k) and torch.equal(values[rows, :, pos].cpu(), new_v)
    for cache, old in zip((keys, values), before):  # every other entry as it was (NaN included)
        cache[rows, :, pos] = old[rows, :, pos]
        assert torch.equal(cache.isnan(), old.isnan()) and torch.equal(cache.nan_to_num(), old.nan_to_num())


@torch.no_grad()
def test_tiny_batched_step_through_the_op_matches_the_written_out_step():
    """Three rows at different positions in their slots, several steps: the op's logits and slot caches against
    the written-out step's (the attention rounded differently)."""
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
    # the first layer's keys and values come before any attention: the values as written out, the keys within the
    # roundings RoPE in float32 saves (eager rounds x * cos and rotate_half(x) * sin before their sum, at the
    # terms' scale: a few units of the dtype's epsilon of the keys' scale)
    (k_op, v_op), (k_written, v_written) = op_caches[:2], written_caches[:2]
    assert torch.equal(v_op, v_written)
    scale = k_written.abs().max()
    assert scale > 0 and (k_op - k_written).abs().max() <= 2 * torch.finfo(DOT_DTYPE).eps * scale


COMPILE = r"""
from runner.export import kernels_batch as KB

out = {}
z = lambda n, dt=torch.bfloat16: torch.zeros(n, dtype=dt)
for splits in (4, 16):  # the 1024 bundle's and the 10-minute bundle's
    shape = dict(H_KV=8, REP_P2=4, D=128, BLOCK_T=KB.BATCH_BLOCK_T, SPLITS=splits)
    parts = dict(pos_ptr=z(2, torch.int64), m_ptr=z(2 * 8 * splits * 4, torch.float32),
                 l_ptr=z(2 * 8 * splits * 4, torch.float32), acc_ptr=z(2 * 8 * splits * 4 * 128, torch.float32))
    kernels = {
        "attention": (KB._batch_attention_kernel, dict(H=32, SM_SCALE=128**-0.5, BLOCK_H=16),
                      dict(qkv_ptr=z(2 * 48 * 128), cos_ptr=z(2 * 128), sin_ptr=z(2 * 128), k_ptr=z(2 * 8 * 64 * 128),
                           v_ptr=z(2 * 8 * 64 * 128), max_seq=64)),
        "merge": (KB._batch_merge_kernel, dict(REP=4), dict(out_ptr=z(2 * 8 * 4 * 128))),
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


def test_the_3b_tiles_compile_for_the_h200_and_write_only_what_the_op_declares():
    """Both kernels compiled for sm_90 here (no GPU needed) at the 3B's shapes with 4 and 16 splits: no spills to
    local memory; AOTInductor's analysis finds the attention writing its partials and the slot caches (the op's
    declared mutations) and nothing else, and the merge writing the output alone."""
    got = on_h200_target(COMPILE)
    for splits in ("4", "16"):
        assert got["attention" + splits]["writes"] == ["acc_ptr", "k_ptr", "l_ptr", "m_ptr", "v_ptr"]
        assert got["merge" + splits]["writes"] == ["out_ptr"]
        for kernel in ("attention", "merge"):
            assert not got[kernel + splits]["local"] and got[kernel + splits]["shared"] <= 227 * 1024


TRACE = r"""
import torch.fx.experimental._config as fx_config
from torch.export import Dim
from runner.export import kernels_batch as KB
from runner.models.voxtral import Voxtral
from runner.models.voxtral_batch import BatchDecoder, SlotCaches
from runner.models.voxtral_config import preset

cfg = preset("tiny")
m = Voxtral(cfg).init_weights(seed=1).to(torch.bfloat16)
step = BatchDecoder(cfg.text, m.language_model, SlotCaches(cfg.text, 4, 32, torch.bfloat16), attend=KB.attend)
b = Dim("batch", min=1, max=4)
with fx_config.patch(backed_size_oblivious=True):  # as export/voxtral.py's batch_plan traces it
    ep = torch.export.export(step, (torch.randn(2, 1, cfg.text.dim).to(torch.bfloat16), torch.tensor([0, 0])),
                             dynamic_shapes=({0: b}, {0: b}), strict=False)
calls = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
mutated = sorted(ep.run_decompositions({}).graph_signature.buffers_to_mutate.values())  # as AOTInductor lowers it
print(json.dumps({"calls": calls, "mutated": mutated, "layers": cfg.text.n_layers}))
"""


def test_the_cuda_batched_step_traces_each_layers_attention_to_one_op_that_writes_its_slot_caches():
    """What the CUDA export traces (torch.export at a dynamic batch, size-obliviously; tracing launches nothing, so a
    CPU does): one op per layer for the RoPE, the cache writes and the attention, nothing of them written out
    beside, and every layer's slot caches among the mutated buffers of the program AOTInductor lowers."""
    got = on_h200_target(TRACE)
    calls = got["calls"]
    assert calls.count("voxtral.batch_attention.default") == got["layers"], calls
    assert not [c for c in calls if "index_put" in c or "softmax" in c or "index_copy" in c], calls
    caches = [f"batch.layers.{i}.self_attn.kv_cache.{kv}_cache" for i in range(got["layers"]) for kv in "kv"]
    assert sorted(caches) == got["mutated"]
