"""Programmatic dependent launch (PDL) inside a captured CUDA graph.

In a graph captured from a stream, every kernel waits for the one before it to finish and flush before its first
block starts: each of the decode step's kernels pays a launch, a ramp to full bandwidth and a tail. Hopper can
start a kernel early, while its predecessor's last blocks run, if the edge between them is *programmatic*; the
kernel then waits (`griddepcontrol.wait`) at the point it first reads its predecessor's output. The decode kernels of `text_decoder_step` (runner/export/kernels.py, kernels_attention.py) load
their weights first and wait after, but AOTInductor launches them with plain `cuLaunchKernel`, so a capture records
only full edges. This module rewrites those edges in the captured graph, before it is instantiated: an edge becomes
programmatic only where both ends are kernels and the later one is one of ours (it waits before reading); every
other edge keeps full completion. Uses the CUDA driver API (12.3+: edge data, cuFuncGetName) through ctypes.
"""

from __future__ import annotations

import ctypes

# Kernels that execute griddepcontrol.wait before reading anything their predecessor wrote (AOTInductor names a
# call site's kernel by its Triton name, sometimes with a suffix).
WAITING_KERNELS = ("_gemv_kernel", "_attention_kernel")

_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC, and CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [
        ("func", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("kernel_params", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


class _Driver:
    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name: str, *args) -> None:
        rc = self.lib[name](*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed: CUresult {rc}")

    def kernel_name(self, node: int) -> str | None:
        kind = ctypes.c_int(-1)
        self("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
        if kind.value != _KERNEL_NODE:
            return None
        params = _KernelNodeParams()
        self("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
        name = ctypes.c_char_p()
        if params.func:
            self("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(params.func))
        elif params.kern:
            self("cuKernelGetName", ctypes.byref(name), ctypes.c_void_p(params.kern))
        return (name.value or b"").decode(errors="replace")


def pick_edges(edges: list[tuple[int, int, int, int]], name, waiting: tuple[str, ...]) -> list[int]:
    """Indices of the edges (src, dst, from_port, type) to make programmatic: full edges (port and type 0) from a
    kernel node to a kernel that waits before reading. name(node) is the kernel's name, None for other nodes
    (memset, memcpy, ...): programmatic edges exist only between kernels."""
    return [
        i
        for i, (a, b, port, kind) in enumerate(edges)
        if port == 0 and kind == 0 and name(a) is not None and (name(b) or "").startswith(waiting)
    ]


def programmatic_edges(graph: int, waiting: tuple[str, ...] = WAITING_KERNELS) -> int:
    """Turn graph's kernel -> waiting-kernel edges into programmatic ones; returns how many. `graph` is a
    cudaGraph_t (torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph()), not yet instantiated. All or nothing:
    an edge that cannot be added back as programmatic is restored, and the error raised."""
    cu = _Driver()
    g = ctypes.c_void_p(graph)
    n = ctypes.c_size_t(0)
    cu("cuGraphGetEdges_v2", g, None, None, None, ctypes.byref(n))
    src, dst = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)()
    data = (_EdgeData * n.value)()
    cu("cuGraphGetEdges_v2", g, src, dst, data, ctypes.byref(n))
    names: dict[int, str | None] = {}

    def name(node: int) -> str | None:
        if node not in names:
            names[node] = cu.kernel_name(node)
        return names[node]

    edges = [(src[i], dst[i], data[i].from_port, data[i].type) for i in range(n.value)]
    picked = pick_edges(edges, name, waiting)
    if not picked:
        return 0
    m = len(picked)
    a = (ctypes.c_void_p * m)(*[edges[i][0] for i in picked])
    b = (ctypes.c_void_p * m)(*[edges[i][1] for i in picked])
    programmatic = (_EdgeData * m)()
    for e in programmatic:
        e.from_port, e.type = _PROGRAMMATIC, _PROGRAMMATIC
    cu("cuGraphRemoveDependencies_v2", g, a, b, None, ctypes.c_size_t(m))
    try:
        cu("cuGraphAddDependencies_v2", g, a, b, programmatic, ctypes.c_size_t(m))
    except RuntimeError:
        cu("cuGraphAddDependencies_v2", g, a, b, None, ctypes.c_size_t(m))
        raise
    return m
