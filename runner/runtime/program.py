"""Program and Method over a verified bundle (ExecuTorch's vocabulary: Program -> Method -> Backend handle)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch

from runner.bundle import Manifest, MethodSpec, verify_bundle
from runner.digests import DigestCache, default_cache_dir
from runner.dtypes import torch_dtype
from runner.errors import BundleError
from runner.runtime.delegate import AOTIBackend, Handle, SharedTensors
from runner.runtime.options import RuntimeOptions
from runner.runtime.weights import release_pinned_buffers

log = logging.getLogger(__name__)


class Method:
    def __init__(self, backend: AOTIBackend, handle: Handle):
        self.backend, self.handle = backend, handle

    @property
    def spec(self) -> MethodSpec:
        return self.handle.spec

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        # named in profiler traces (the decode profile places the GPU's idle gaps by it); next to free otherwise
        with torch.profiler.record_function(f"method:{self.spec.name}"):
            return self.backend.execute(self.handle, list(inputs))

    def input_dtype(self, i: int = 0) -> torch.dtype:
        return torch_dtype(self.spec.inputs[i].dtype)

    def destroy(self) -> None:
        self.backend.destroy(self.handle)


def check_compatible(manifest: Manifest, bundle_dir: Path, device: str) -> None:
    """A `.so` runs only with the torch and the device it was built for: say so before any dlopen."""
    built = manifest.torch_version.split("+")[0]
    here = torch.__version__.split("+")[0]
    if built != here:
        raise BundleError(
            f"{bundle_dir}: built with torch {manifest.torch_version}, this is torch "
            f"{torch.__version__}; re-export the bundle with this torch"
        )
    if manifest.device != device:
        raise BundleError(f"{bundle_dir}: built for {manifest.device}, asked to run on {device}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise BundleError(f"{bundle_dir}: a CUDA bundle, but no CUDA device is visible")
        major, minor = torch.cuda.get_device_capability()
        if manifest.gpu_arch and manifest.gpu_arch != f"sm_{major}{minor}":
            raise BundleError(f"{bundle_dir}: built for {manifest.gpu_arch}, this GPU is sm_{major}{minor}")


class Program:
    """All four methods of one bundle, loaded once; `close()` (or the context manager) destroys them."""

    def __init__(self, bundle_dir: Path, manifest: Manifest, methods: dict[str, Method], load_ms: dict[str, float]):
        self.bundle_dir, self.manifest, self.methods, self.load_ms = bundle_dir, manifest, methods, load_ms
        # The methods' state (the KV cache) is one per Program, shared by every engine and runner over it: two
        # generate() calls at once would interleave their steps in it, so its user holds this lock.
        self.state_lock = threading.Lock()

    @classmethod
    def load(
        cls,
        bundle_dir: str | Path,
        device: str | None = None,
        backend: AOTIBackend | None = None,
        options: RuntimeOptions | None = None,
    ) -> Program:
        bundle_dir, options = Path(bundle_dir), options or RuntimeOptions()
        t0 = time.perf_counter()
        digests = DigestCache((options.cache_dir or default_cache_dir()) / "digests.json", rehash=options.rehash)
        manifest = verify_bundle(bundle_dir, digests=digests)  # every digest checked before the first dlopen
        device = device or manifest.device
        check_compatible(manifest, bundle_dir, device)
        load_ms = {"verify": (time.perf_counter() - t0) * 1e3}
        backend = backend or AOTIBackend()
        methods: dict[str, Method] = {}
        shared = SharedTensors()  # methods over one weights file bind one copy of its weights and state
        try:
            for name, spec in manifest.methods.items():
                t = time.perf_counter()
                pinned = manifest.files[spec.library].sha256
                methods[name] = Method(backend, backend.init(spec, bundle_dir, device, shared, pinned))
                load_ms[name] = (time.perf_counter() - t) * 1e3
                log.info("loaded %s in %.1f ms", name, load_ms[name])
        except BaseException:
            for m in methods.values():
                m.destroy()
            raise
        finally:
            release_pinned_buffers()
        load_ms["weights"] = shared.weights_ms  # part of the methods' times, not beside them
        return cls(bundle_dir, manifest, methods, load_ms)

    @property
    def device(self) -> str:
        return self.manifest.device

    def reset_state(self, keep: tuple[str, ...] = ()) -> None:
        """Zero the KV cache: each input starts from an empty context (a buffer two methods share, once). The
        state only the methods in `keep` hold is left as it is (text_decoder_batch's slots, while a prompt is
        prefilled beside the sequences in flight)."""
        seen: set[int] = set()
        for name, m in self.methods.items():
            if name in keep:
                continue
            for t in m.handle.state.values():
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    t.zero_()

    def close(self) -> None:
        for m in self.methods.values():
            m.destroy()

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
