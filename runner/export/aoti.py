"""One method through AOTInductor: torch.export'ed and compiled into its own `.so` (weights kept out of it), the
copies a finished compile still holds released, and the method's weights written as safetensors keyed by FQN."""

from __future__ import annotations

import contextlib
import gc
import shutil
import warnings
import zipfile
from pathlib import Path

import torch
import torch.fx.experimental._config as fx_config
from safetensors.torch import save_file

from runner.errors import ExportError
from runner.export.methods import MethodPlan, method_weights
from runner.export.options import ExportOptions


@contextlib.contextmanager
def _one_object_per_kernel():
    """AOTInductor before torch 2.13 embeds each kernel binary as `<cubin>.o`, its symbols renamed to the kernel's
    name. When two kernel names share one cubin (the same Triton kernel, specialised alike, at two call sites:
    seen with the cache-writing attention of the 3B step), the second object overwrites the first and is linked
    twice: "multiple definition of `___attention_kernel_N_start'". Each kernel name gets its own copy of the
    cubin here. torch 2.13 embeds all binaries in one batched object, named per kernel, and calls this function
    only as its fallback."""
    from torch._inductor import codecache

    original = getattr(codecache, "convert_cubin_to_obj", None)
    if original is None:
        yield
        return

    def convert(cubin_file: str, kernel_name: str, ld: str, objcopy: str) -> str:
        own = f"{cubin_file[: -len('.cubin')] if cubin_file.endswith('.cubin') else cubin_file}.{kernel_name}.cubin"
        shutil.copyfile(cubin_file, own)
        return original(own, kernel_name, ld, objcopy)

    codecache.convert_cubin_to_obj = convert
    try:
        yield
    finally:
        codecache.convert_cubin_to_obj = original


def compile_method(plan: MethodPlan, opts: ExportOptions, workdir: Path, debug_dir: Path | None) -> Path:
    """torch.export + AOTInductor; returns the path of the method's `.so` (weights not embedded)."""
    with torch.no_grad():
        ep = plan.exported()
    configs = {"aot_inductor.package_constants_in_so": False, "aot_inductor.debug_compile": opts.debug}
    if plan.name in opts.max_autotune:  # on CUDA: Triton GEMM templates beside cuBLAS, with fused epilogues
        configs["max_autotune"] = True
    if opts.device == "cuda":
        # Kernel binaries go inside the .so: by default it loads .cubin files from the compile directory, which
        # exists only on the machine that exported (seen: "CUDA driver error: file not found" elsewhere).
        configs["aot_inductor.embed_kernel_binary"] = True
    with _one_object_per_kernel(), fx_config.patch(backed_size_oblivious=plan.size_oblivious):
        package = torch._inductor.aoti_compile_and_package(
            ep, package_path=str(workdir / f"{plan.name}.pt2"), inductor_configs=configs
        )
    with zipfile.ZipFile(package) as z:
        libs = [n for n in z.namelist() if n.endswith(".so")]
        if len(libs) != 1:
            raise ExportError(f"{plan.name}: expected one .so in the AOTI package, found {libs}")
        so = workdir / f"{plan.name}.so"
        with z.open(libs[0]) as src, open(so, "wb") as dst:
            shutil.copyfileobj(src, dst)
        if debug_dir is not None:  # the seed's DEBUG option: keep the generated C++ next to the bundle
            for n in z.namelist():
                if n.endswith((".cpp", ".h", ".json")):
                    (debug_dir / plan.name).mkdir(parents=True, exist_ok=True)
                    (debug_dir / plan.name / Path(n).name).write_bytes(z.read(n))
    return so


def release_compile_copies() -> None:
    """Free what a finished compile still holds. AOTInductor clones every buffer the graph mutates (the KV caches,
    the streams' state) into the graph module's meta (`NAME__original__`, compile_fx._unlift_graph), and torch.export
    keeps its last trace, and with it that module, alive until the next one (torch 2.13: a module-level proxy map,
    cleared here; torch 2.11 holds it elsewhere). At the largest sizes the clone is as large as the state, and the
    next method's compile ran out of GPU memory. So the clones' storages are shrunk to nothing whoever holds them:
    the compile that read them is over."""
    from torch.fx.experimental import proxy_tensor

    getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", {}).clear()
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every live object touches deprecated module attributes
        warnings.simplefilter("ignore", FutureWarning)
        modules = [obj for obj in gc.get_objects() if isinstance(obj, torch.fx.GraphModule)]
    for obj in modules:
        for key in [k for k in obj.meta if isinstance(k, str) and k.endswith("__original__")]:
            free_storage(obj.meta.pop(key))
    del modules
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def free_storage(t: object) -> None:
    """A tensor's memory released in place, whoever still refers to it (it reads as empty after)."""
    if isinstance(t, torch.Tensor):
        t.untyped_storage().resize_(0)


def write_weights(plan: MethodPlan, stage: Path, written: dict[str, set[str]], weights_filter) -> None:
    """The method's weights into its file, or, for a second method over one module (text_decoder_step), its names
    checked against the file's. A function of its own so that nothing outlives it: the dict's tensors are views of
    the device's weights, and the self-check frees those by moving the eager model."""
    weights = method_weights(plan, weights_filter)
    if plan.spec.weights in written:
        if written[plan.spec.weights] != set(weights):
            raise ExportError(f"{plan.name}: its weights differ from those in {plan.spec.weights}")
    else:
        save_file({k: v.cpu() for k, v in weights.items()}, str(stage / plan.spec.weights))
        written[plan.spec.weights] = set(weights)
