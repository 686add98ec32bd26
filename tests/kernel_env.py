"""What the Triton kernel tests share.

Importing this module decides where the kernels run: on a GPU they are compiled; without one it sets
TRITON_INTERPRET=1, so the kernel modules imported after it define interpreted functions that Triton runs on the
CPU. The interpreter computes tl.dot on bfloat16 wrongly, so there dot-based kernels are tested in float16
(DOT_DTYPE).

`on_h200_target(code)` runs code in a fresh interpreter, where the kernels are JIT functions, with a stand-in
driver that names the H200's target when there is no GPU: Triton then compiles for sm_90 here, and `written()`
gives the inputs AOTInductor's analysis of the Triton IR finds a kernel writing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":  # before the kernels are defined: @triton.jit then makes interpreted functions
    os.environ["TRITON_INTERPRET"] = "1"
DOT_DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16

ROOT = Path(__file__).resolve().parents[1]

H200_PRELUDE = r"""
import json, torch, triton
import torch._higher_order_ops.triton_kernel_wrap as tkw
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H200 = GPUTarget("cuda", 90, 32)
if not torch.cuda.is_available():
    class Hopper:
        def get_current_target(self):
            return H200

    triton.runtime.driver.set_active(Hopper())

def written(kernel, kwargs):
    if hasattr(tkw, "identify_accessed_tensors"):  # torch >= 2.12
        return sorted(d.name for d in tkw.identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes)
    return sorted(tkw.identify_mutated_tensors(kernel, kwargs, {}))  # torch 2.11, the H200's
"""


def on_h200_target(code: str, env: dict[str, str] | None = None) -> dict:
    """H200_PRELUDE + code in a fresh interpreter (TRITON_INTERPRET unset, `env` added); the JSON its last line
    prints."""
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    proc = subprocess.run(
        [sys.executable, "-c", H200_PRELUDE + code], capture_output=True, text=True, env=full, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
