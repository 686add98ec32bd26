"""Which edges of a captured decode graph become programmatic (runner/pdl.py): only full edges from a kernel to a
kernel that waits (griddepcontrol.wait) before reading its predecessor's output. The rewrite itself runs on the
GPU: tests/test_cuda_runtime.py checks the decode kernels' edges are found and the tokens do not change."""

from __future__ import annotations

from runner.pdl import WAITING_KERNELS, pick_edges

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
