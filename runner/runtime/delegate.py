"""The AOTI delegate: `init(method spec, bundle dir, device) -> handle`, `execute`, `destroy`.

Everything one loaded `.so` needs lives in its handle: the library (dlopen'ed RTLD_LOCAL), the container
functions resolved from *that* library, the container, the bound weights and state, and on CUDA its own
stream. There is no symbol table outside the handle. The seed registered `...Run` & co. process-wide, so
running audio_encoder after loading text_decoder called text_decoder's code; and it skipped `...Delete`
because calling the last-registered library's Delete on another library's container crashed. With
per-handle symbols Delete is always the container's own, and `destroy` can run it safely, in any order.

Streams (tests/cuda/test_cuda_streams.py): an eager `execute` runs the container on the handle's own stream,
after the work queued on the caller's current stream and before the work queued there next; a graph-safe
`execute` (the decode graph, a captured prefill) runs on the caller's current stream, which a capture records.

An AtenTensorHandle is an `at::Tensor*`; torch converts tensors to and from them as PyCapsules. `Run`
steals the input handles and hands back output handles that we own (turned into tensors at once, so they
are freed with the tensor: no per-call leak).
"""

from __future__ import annotations

import _ctypes
import ctypes
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runner.bundle import MethodSpec, TensorSpec, safe_member
from runner.digests import sha256_file
from runner.dtypes import torch_dtype
from runner.errors import DelegateError
from runner.runtime.tensor_meta import MetaCache
from runner.runtime.weights import load_weights

log = logging.getLogger(__name__)

_c = ctypes
_vp, _sz = _c.c_void_p, _c.c_size_t

# (symbol, argtypes); the required ones make init fail with a message naming the symbol and the file.
_REQUIRED = {
    "AOTInductorModelContainerCreateWithDevice": [_c.POINTER(_vp), _sz, _c.c_char_p, _c.c_char_p],
    "AOTInductorModelContainerDelete": [_vp],
    "AOTInductorModelContainerGetNumInputs": [_vp, _c.POINTER(_sz)],
    "AOTInductorModelContainerGetNumOutputs": [_vp, _c.POINTER(_sz)],
    "AOTInductorModelContainerRun": [_vp, _c.POINTER(_vp), _sz, _c.POINTER(_vp), _sz, _vp, _vp],
    "AOTInductorModelContainerGetNumConstants": [_vp, _c.POINTER(_sz)],
    "AOTInductorModelContainerGetConstantName": [_vp, _sz, _c.POINTER(_c.c_char_p)],
    "AOTInductorModelContainerGetConstantOriginalFQN": [_vp, _sz, _c.POINTER(_c.c_char_p)],
    "AOTInductorModelContainerGetConstantDtype": [_vp, _sz, _c.POINTER(_c.c_int32)],
    "AOTInductorModelContainerGetConstantDataSize": [_vp, _sz, _c.POINTER(_sz)],
    "AOTInductorModelContainerUpdateUserManagedConstantBufferPairs": [_vp, _vp, _sz, _c.c_bool, _c.c_bool],
}
_OPTIONAL = {
    "AOTInductorModelContainerRunSingleThreaded": [_vp, _c.POINTER(_vp), _sz, _c.POINTER(_vp), _sz, _vp, _vp],
    "AOTInductorGetLastError": [_c.POINTER(_c.c_char_p)],
}


class _ConstantEntry(_c.Structure):
    _fields_ = [("name", _c.c_char_p), ("handle", _vp)]


_capsule_ptr = _c.pythonapi.PyCapsule_GetPointer
_capsule_ptr.restype, _capsule_ptr.argtypes = _vp, [_c.py_object, _c.c_char_p]
_capsule_new = _c.pythonapi.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = _c.py_object, [_vp, _c.c_char_p, _vp]

_to_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
_steal_handles = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs

# c10::ScalarType codes as the container reports constant dtypes
_SCALAR_TYPES = {
    0: torch.uint8,
    1: torch.int8,
    3: torch.int32,
    4: torch.int64,
    5: torch.float16,
    6: torch.float32,
    7: torch.float64,
    11: torch.bool,
    15: torch.bfloat16,
    24: torch.float8_e4m3fn,
}


@dataclass(eq=False)
class Handle:
    spec: MethodSpec
    path: Path
    device: torch.device
    lib: ctypes.CDLL | None
    fns: dict[str, ctypes._CFuncPtr]
    container: ctypes.c_void_p
    stream: object | None  # torch.cuda.Stream on CUDA
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # keeps bound weights alive
    constant_handles: list = field(default_factory=list)  # capsules of at::Tensor* the container borrows
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # mutable buffers (KV cache) by FQN
    cache: MetaCache = field(default_factory=MetaCache)
    n_outputs: int = 0

    @property
    def alive(self) -> bool:
        return self.lib is not None


# The sha256 of every library file this process has loaded, by resolved path. Not a symbol table: it exists
# because glibc matches dlopen by path name and hands back the library already mapped under that name, and an
# AOTI library stays mapped for the life of the process once a thread has created or run a container from it
# (AOTI's thread_local destructors pin it). A bundle re-exported in place would silently run the old code;
# that case is refused instead.
_LOADED_FILES: dict[str, str] = {}


def _check_not_stale(path: Path, expect: str | None = None) -> None:
    key, digest = str(path.resolve()), sha256_file(path)  # a .so is small: hashing costs milliseconds
    if expect is not None and digest != expect:  # the last look before dlopen: replaced since it was verified?
        raise DelegateError(
            f"{path}: no longer the library the manifest pins (changed since the bundle was verified: replaced "
            "while it loaded?); load the bundle again"
        )
    if _LOADED_FILES.setdefault(key, digest) != digest:
        raise DelegateError(
            f"{path}: this process already loaded a different build from this path, and glibc would hand back "
            "that old library; load the new bundle from another directory or in a new process"
        )


@dataclass
class SharedTensors:
    """What containers borrow, one copy per weights file. Methods exported from one module (text_decoder for
    prefill, text_decoder_step for decode) name the same weights file: they bind the same weights and the same
    state, so the decode steps read the KV cache the prefill wrote, and the weights load once."""

    weights: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # by weights file
    state: dict[tuple[str | None, str], torch.Tensor] = field(default_factory=dict)  # by (weights file, FQN)
    weights_ms: float = 0.0  # reading the weights files onto the device, of the methods' init time


def _method_weights(h: Handle, bundle_dir: Path, shared: SharedTensors) -> dict[str, torch.Tensor]:
    """The method's weights file on its device, read once for every method that names it."""
    if not h.spec.weights:
        return {}
    weights = shared.weights.get(h.spec.weights)
    if weights is None:
        wpath = safe_member(bundle_dir, h.spec.weights)
        t0 = time.perf_counter()
        try:
            weights = load_weights(wpath, torch.device(h.device))
        except Exception as e:  # safetensors raises its own error types for malformed files
            raise DelegateError(f"{wpath}: cannot read weights ({e})") from None
        shared.weights_ms += (time.perf_counter() - t0) * 1e3
        shared.weights[h.spec.weights] = weights
    return weights


def _state_tensor(h: Handle, key: str, nbytes: int, shared: SharedTensors) -> torch.Tensor:
    """The declared state `key` (zeros), one tensor for every method over the same weights file."""
    st = h.spec.state[key]
    t = shared.state.get((h.spec.weights, key))
    if t is None:
        # the size the library holds for it, checked before allocating what the manifest claims
        size = math.prod(st.shape) * torch_dtype(st.dtype).itemsize
        if size != nbytes:
            raise DelegateError(
                f"{h.spec.name}: state {key} is {st.dtype}{list(st.shape)} ({size} bytes), "
                f"the library expects {nbytes} bytes"
            )
        t = torch.zeros(st.shape, dtype=torch_dtype(st.dtype), device=h.device)
        shared.state[(h.spec.weights, key)] = t
    elif list(t.shape) != list(st.shape) or t.dtype != torch_dtype(st.dtype):
        raise DelegateError(
            f"{h.spec.name}: state {key} is {st.dtype}{list(st.shape)}, another method over "
            f"{h.spec.weights} declares {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
        )
    return t


class AOTIBackend:
    """Stateless: all state is in the handles it returns (and in the SharedTensors a Program passes in)."""

    def init(
        self,
        spec: MethodSpec,
        bundle_dir: Path,
        device: str | torch.device,
        shared: SharedTensors | None = None,
        expect_sha256: str | None = None,
    ) -> Handle:
        """Load the method's library (`expect_sha256`: the manifest's digest of it, checked once more just before
        dlopen) and create its container, with its weights and state bound."""
        device = torch.device(device)
        path = safe_member(Path(bundle_dir), spec.library)
        if not path.is_file():
            raise DelegateError(f"{path}: missing")
        _check_not_stale(path, expect_sha256)
        try:
            lib = ctypes.CDLL(str(path.resolve()), mode=os.RTLD_LOCAL | os.RTLD_NOW)
        except OSError as e:
            raise DelegateError(f"{path}: cannot load ({e})") from None
        fns = {}
        for table, required in ((_REQUIRED, True), (_OPTIONAL, False)):
            for sym, argtypes in table.items():
                try:
                    fn = lib[sym]
                except AttributeError:
                    if required:
                        _ctypes.dlclose(lib._handle)
                        raise DelegateError(f"{path}: missing symbol {sym} (not an AOTInductor library?)") from None
                    continue
                fn.argtypes, fn.restype = argtypes, ctypes.c_int32
                fns[sym] = fn
        handle = Handle(spec, path, device, lib, fns, ctypes.c_void_p(), None)
        try:
            device_str = f"cuda:{device.index or 0}" if device.type == "cuda" else device.type
            self._call(
                handle,
                "AOTInductorModelContainerCreateWithDevice",
                ctypes.byref(handle.container),
                1,
                device_str.encode(),
                None,
            )
            if device.type == "cuda":
                handle.stream = torch.cuda.Stream(device=device)
            n_in, n_out = _sz(), _sz()
            self._call(handle, "AOTInductorModelContainerGetNumInputs", handle.container, ctypes.byref(n_in))
            self._call(handle, "AOTInductorModelContainerGetNumOutputs", handle.container, ctypes.byref(n_out))
            if (n_in.value, n_out.value) != (len(spec.inputs), len(spec.outputs)):
                raise DelegateError(
                    f"{path}: method {spec.name} takes {n_in.value} inputs / {n_out.value} outputs, the manifest "
                    f"declares {len(spec.inputs)} / {len(spec.outputs)}"
                )
            handle.n_outputs = n_out.value
            self._bind_constants(handle, Path(bundle_dir), shared or SharedTensors())
        except BaseException:
            self.destroy(handle)
            raise
        log.debug("init %s: %d constants, %d state buffers", spec.name, len(handle.constants), len(handle.state))
        return handle

    def _bind_constants(self, h: Handle, bundle_dir: Path, shared: SharedTensors) -> None:
        weights = _method_weights(h, bundle_dir, shared)
        n = _sz()
        self._call(h, "AOTInductorModelContainerGetNumConstants", h.container, ctypes.byref(n))
        names: list[bytes] = []
        tensors: list[torch.Tensor] = []
        for i in range(n.value):
            name, fqn, dtype_code, nbytes = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_int32(), _sz()
            self._call(h, "AOTInductorModelContainerGetConstantName", h.container, i, ctypes.byref(name))
            self._call(h, "AOTInductorModelContainerGetConstantOriginalFQN", h.container, i, ctypes.byref(fqn))
            self._call(h, "AOTInductorModelContainerGetConstantDtype", h.container, i, ctypes.byref(dtype_code))
            self._call(h, "AOTInductorModelContainerGetConstantDataSize", h.container, i, ctypes.byref(nbytes))
            key = fqn.value.decode()
            if key in h.spec.state:
                t = h.state[key] = _state_tensor(h, key, nbytes.value, shared)
            elif key in weights:
                t = weights[key]
            else:
                raise DelegateError(f"{h.spec.name}: constant {key} is neither in {h.spec.weights} nor declared state")
            want = _SCALAR_TYPES.get(dtype_code.value)
            if want is not None and t.dtype != want:
                raise DelegateError(f"{h.spec.name}: weight {key} is {t.dtype}, the library expects {want}")
            if t.numel() * t.element_size() != nbytes.value:
                raise DelegateError(
                    f"{h.spec.name}: weight {key} has shape {list(t.shape)} "
                    f"({t.numel() * t.element_size()} bytes), the library expects {nbytes.value} bytes"
                )
            h.constants[key] = t.contiguous()
            names.append(name.value)
            tensors.append(h.constants[key])
        if not tensors:
            return
        # The container gets non-owning aliases, not our tensors: in user-managed mode it wraps each handle
        # in a MaybeOwningAtenTensorHandle that makes its own at::Tensor (aoti_torch_new_tensor_handle) and
        # never deletes it, even in ...Delete (torch 2.13 aoti_runtime/utils.h). Given our tensors, every
        # weight and the KV cache stayed pinned after destroy: RSS grew by the bundle's size per load. Over
        # an alias only a small non-owning TensorImpl leaks; the memory is ours (h.constants / h.state) and is
        # freed in destroy, after the container that borrows it is gone.
        h.constant_handles = _to_handles([_borrow(t) for t in tensors])
        pairs = (_ConstantEntry * len(tensors))(
            *[_ConstantEntry(nm, _capsule_ptr(c, None)) for nm, c in zip(names, h.constant_handles)]
        )
        # user-managed: the container uses our tensors zero-copy; the KV cache is mutated in our buffer
        self._call(
            h,
            "AOTInductorModelContainerUpdateUserManagedConstantBufferPairs",
            h.container,
            ctypes.cast(pairs, _vp),
            len(tensors),
            False,
            True,
        )

    def execute(self, h: Handle, inputs: list[torch.Tensor], *, graph_safe: bool = False) -> list[torch.Tensor]:
        """Run the method. `graph_safe` runs on the caller's current stream through `...RunSingleThreaded`,
        the entry point that can be captured into a CUDA graph (`...Run` fails under capture: "operation not
        permitted when stream is capturing")."""
        if not h.alive:
            raise DelegateError(f"{h.spec.name}: execute on a destroyed handle")
        if len(inputs) != len(h.spec.inputs):
            raise DelegateError(
                f"{h.spec.name}: expected {len(h.spec.inputs)} inputs "
                f"({'; '.join(x.describe() for x in h.spec.inputs)}), got {len(inputs)}"
            )
        bound = []
        for i, t in enumerate(inputs):
            b = h.cache.bind(i, t, lambda t, i=i: self._build_binding(h, i, t))
            # A binding holds a contiguous input itself (same memory as `t` whenever the metadata matches).
            # A non-contiguous input is copied on every call: a copy cached with the binding would hand the
            # container stale data when the caller writes new values into the same view.
            bound.append(b.tensor if b.tensor is not None else t.contiguous())
        in_caps = _to_handles(bound)
        in_arr = (_vp * len(bound))(*[_capsule_ptr(c, None) for c in in_caps])
        out_arr = (_vp * h.n_outputs)()
        if graph_safe:
            if "AOTInductorModelContainerRunSingleThreaded" not in h.fns:
                raise DelegateError(f"{h.path}: no AOTInductorModelContainerRunSingleThreaded; cannot graph-capture")
            stream = torch.cuda.current_stream(h.device).cuda_stream if h.device.type == "cuda" else None
            self._call(
                h,
                "AOTInductorModelContainerRunSingleThreaded",
                h.container,
                in_arr,
                len(bound),
                out_arr,
                h.n_outputs,
                ctypes.c_void_p(stream),
                None,
            )
            return _steal_handles([_capsule_new(out_arr[i], None, None) for i in range(h.n_outputs)])
        if h.stream is not None:
            caller = torch.cuda.current_stream(h.device)
            h.stream.wait_stream(caller)
            with torch.cuda.stream(h.stream):
                self._call(
                    h,
                    "AOTInductorModelContainerRun",
                    h.container,
                    in_arr,
                    len(bound),
                    out_arr,
                    h.n_outputs,
                    ctypes.c_void_p(h.stream.cuda_stream),
                    None,
                )
            caller.wait_stream(h.stream)
        else:
            self._call(
                h, "AOTInductorModelContainerRun", h.container, in_arr, len(bound), out_arr, h.n_outputs, None, None
            )
        outputs = _steal_handles([_capsule_new(out_arr[i], None, None) for i in range(h.n_outputs)])
        if h.stream is not None:
            for o in outputs:
                o.record_stream(torch.cuda.current_stream(h.device))
        return outputs

    def _build_binding(self, h: Handle, slot: int, t: torch.Tensor) -> torch.Tensor | None:
        check_tensor(h.spec.name, h.spec.inputs[slot], t, h.device)
        return t if t.is_contiguous() else None

    def destroy(self, h: Handle) -> None:
        """Delete the container, release the stream, free the constant handles, dlclose the library.
        Idempotent. Order matters: the container borrows our constants and runs on our stream, so it goes
        first; the library goes last because Delete is its code. glibc unmaps the library at once if no thread
        has created or run a container from it. A thread that has registers AOTI's thread_local destructors, and
        glibc then keeps the library mapped for the life of the process; loading the same file again reuses
        that mapping, so repeated loads do not grow (tests/runtime/test_delegate.py measures it)."""
        if h.lib is None:
            return
        if h.stream is not None:
            h.stream.synchronize()
        if h.container.value:
            self._call(h, "AOTInductorModelContainerDelete", h.container)
            h.container = ctypes.c_void_p()
        if h.constant_handles:
            _steal_handles(h.constant_handles)  # take ownership back so the at::Tensor* are freed
            h.constant_handles = []
        h.constants.clear()
        h.state.clear()
        h.cache.clear()
        h.stream = None
        lib, h.lib = h.lib, None
        h.fns.clear()
        _ctypes.dlclose(lib._handle)

    def _call(self, h: Handle, sym: str, *args) -> None:
        err = h.fns[sym](*args)
        if err != 0:
            detail = ""
            if "AOTInductorGetLastError" in h.fns:
                msg = ctypes.c_char_p()
                h.fns["AOTInductorGetLastError"](ctypes.byref(msg))
                detail = f": {msg.value.decode(errors='replace')}" if msg.value else ""
            raise DelegateError(f"{h.spec.name}: {sym} failed (code {err}){detail}")


def _borrow(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory that does not own it (no deleter; as torch's cudagraph_trees makes them).
    The caller keeps `t` alive for as long as the alias is used."""
    nbytes = t.numel() * t.element_size()
    storage = torch._C._construct_storage_from_data_pointer(t.data_ptr(), t.device, nbytes)
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())


def check_tensor(method: str, spec: TensorSpec, t: torch.Tensor, device: torch.device) -> None:
    """Compare one input with the manifest's I/O spec; the error names the method and the argument."""
    where = f"{method}: input {spec.name!r}"
    if not isinstance(t, torch.Tensor):
        raise DelegateError(f"{where}: expected a tensor, got {type(t).__name__}")
    if t.dtype != torch_dtype(spec.dtype):
        raise DelegateError(f"{where}: dtype {str(t.dtype).removeprefix('torch.')}, expected {spec.dtype}")
    if t.device.type != device.type:
        raise DelegateError(f"{where}: on {t.device}, expected {device.type}")
    if t.dim() != len(spec.shape):
        raise DelegateError(f"{where}: rank {t.dim()} {list(t.shape)}, expected {spec.describe()}")
    for i, (n, d) in enumerate(zip(t.shape, spec.shape)):
        ok = n == d if isinstance(d, int) else d["min"] <= n <= d["max"] and n % d.get("multiple", 1) == 0
        if not ok:
            raise DelegateError(f"{where}: dim {i} is {n}, expected {spec.describe()}")
