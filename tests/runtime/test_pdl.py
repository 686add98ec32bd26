"""Which edges of a captured decode graph become programmatic (runner/runtime/pdl.py): only full edges from a kernel
to a kernel that waits (griddepcontrol.wait) before reading its predecessor's output. The rewrite itself runs on
the GPU: tests/cuda/test_cuda_runtime.py checks the decode kernels' edges are found and the tokens do not change."""

from __future__ import annotations

import pytest

from runner.runtime.pdl import WAITING_KERNELS, pick_edges

NAMES = {
    1: "triton_poi_fused_embedding_0",  # Inductor's: does not wait
    2: "_rope_table_kernel",
    3: "_gemv_kernel",
    4: "_attention_kernel_3",  # a call site's suffix
    5: "_gemv_kernel",
    6: None,  # a memset node
    7: "_gemv_kernel_1",
    8: "void at::native::reduce_kernel<...>",  # argmax
}


def test_only_full_edges_from_a_kernel_into_a_waiting_kernel():
    edges = [
        (1, 2, 0, 0),  # into a kernel that does not wait: stays
        (2, 3, 0, 0),  # picked
        (3, 4, 0, 0),  # picked: attention waits for the qkv GEMV
        (4, 5, 0, 0),  # picked
        (6, 7, 0, 0),  # from a memset: not a kernel, stays
        (5, 6, 0, 0),  # into the memset: stays
        (7, 8, 0, 0),  # into argmax: stays
        (3, 5, 1, 1),  # already programmatic: left as it is
    ]
    assert pick_edges(edges, NAMES.get, WAITING_KERNELS) == [1, 2, 3]


def test_nothing_to_pick_in_a_graph_of_other_kernels():
    edges = [(1, 2, 0, 0), (2, 8, 0, 0)]
    assert pick_edges(edges, NAMES.get, WAITING_KERNELS) == []


# the kernels as JIT functions in a fresh interpreter (tests/kernel_env.py: the H200's target, `written`)
ANALYSE = r"""
from runner.export import kernels as K
from runner.export import kernels_attention as KA

bf16, f32 = torch.bfloat16, torch.float32
z = lambda n, dt=bf16: torch.zeros(n, dtype=dt)
out = {}
for pdl in (False, True):
    gemv = dict(x_ptr=z(256), g_ptr=z(256), w_ptr=z(64 * 256), s_ptr=z(64, f32), r_ptr=z(64), out_ptr=z(64), N=64,
                K=256, EPS=1e-5, NORM=True, GLU=False, SCALED=False, RESIDUAL=True, OUT_F32=False, BLOCK_N=4,
                BLOCK_K=256, PDL=pdl)
    # the fp8 layers' form: e4m3 codes and a float32 scale per row
    fp8 = gemv | dict(w_ptr=z(64 * 256, torch.float8_e4m3fn), SCALED=True)
    attention = dict(qkv_ptr=z(12 * 64), cos_ptr=z(64), sin_ptr=z(64), k_ptr=z(2 * 32 * 64), v_ptr=z(2 * 32 * 64),
                     pos_ptr=z(1, torch.int64), count_ptr=z(2, torch.int32), count_offset=0, m_ptr=z(64, f32),
                     l_ptr=z(64, f32), acc_ptr=z(64 * 64, f32), out_ptr=z(8 * 64), max_seq=32, SM_SCALE=0.125, H=8,
                     H_KV=2, D=64, BLOCK_H=16, REP_P2=4, BLOCK_T=16, SPLITS=2, PDL=pdl)
    out[str(pdl)] = {"gemv": written(K._gemv_kernel, gemv), "gemv_fp8": written(K._gemv_kernel, fp8),
                     "attention": written(KA._attention_kernel, attention)}
print(json.dumps(out))
"""


def test_the_waiting_kernels_write_what_the_plain_ones_write():
    """AOTInductor decides from Triton IR which inputs a kernel writes; a kernel it cannot analyse counts as writing
    every input, and the exported method grows an output per input (torch 2.11 and Triton's gdc_wait: 21 outputs,
    NOTES item 26). The griddepcontrol asm must leave the analysis as it is without it."""
    pytest.importorskip("triton")
    from kernel_env import on_h200_target  # the analysis runs in a fresh interpreter, for the H200's target

    got = on_h200_target(ANALYSE, env={"VOXTRAL_RUNNER_PDL": "1"})
    assert got["True"] == got["False"]
    assert got["False"]["gemv"] == got["False"]["gemv_fp8"] == ["out_ptr"]
    assert "qkv_ptr" not in got["False"]["attention"] and "out_ptr" in got["False"]["attention"]
