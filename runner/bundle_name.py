"""A bundle's name: one rule for `python -m runner export`'s default --out, the nox sessions' bundles and the CI
artifacts (ci_scripts/bundle_name.py):

    voxtral-bundle-<model>-<device>-<dtype>[-<quant>]-torch<major>.<minor>   in   artifacts/<name>/

<model> is the preset (with "-random" for random weights), a hub checkpoint id with "/" as "--" (artifact names
may not contain "/"), or a checkpoint directory's name. <quant> is there when it is not "none": an int4 bundle is
another artifact than its bf16 twin. The torch release is there because a bundle's .so files load only under the
torch that compiled them; patch releases keep the ABI, so major.minor.

Stdlib only: the CI step that names a bundle runs in a bare Python, before the package or torch is installed."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from runner.errors import RunnerError

ARTIFACTS = "artifacts"  # where a bundle lands when no directory is given
PREFIX = "voxtral-bundle"


def slug(part: str) -> str:
    """`part` as one piece of an artifact name: an absolute path's last part, "/" as "--", nothing but
    [A-Za-z0-9._-]."""
    part = PurePosixPath(part.rstrip("/")).name if part.startswith("/") else part
    return re.sub(r"[^A-Za-z0-9._-]+", "-", part.replace("/", "--")).strip("-.") or "model"


def torch_tag(version: str) -> str:
    """'2.13.0+cpu' -> 'torch2.13' (also '2.13.0a0+git1234', '2.14.0.dev20260101')."""
    found = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if found is None:
        raise RunnerError(f"torch version {version!r}: expected MAJOR.MINOR[.PATCH...]")
    return f"torch{found[1]}.{found[2]}"


def bundle_name(
    model: str, device: str, dtype: str, torch_version: str, *, quant: str = "none", random_init: bool = False
) -> str:
    """The name (see the module's docstring); `model` is the preset or the checkpoint, `torch_version` the full
    version of the torch that compiles the bundle."""
    parts = [PREFIX, slug(model + ("-random" if random_init else "")), slug(device), slug(dtype)]
    if quant not in ("", "none"):
        parts.append(slug(quant))
    return "-".join([*parts, torch_tag(torch_version)])
