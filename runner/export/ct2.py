"""A reader for CTranslate2's `model.bin` (binary version 6), with numpy only: no pickle, no ctranslate2.

The layout, as `ctranslate2/specs/model_spec.py` `ModelSpec._serialize` writes it (little-endian):

    u32 binary_version | str spec_name | u32 spec_revision | u32 n_variables
    n_variables x ( str name | u8 rank | u32 dims[rank] | u8 dtype_id | u32 n_bytes | n_bytes of data )
    u32 n_aliases | n_aliases x ( str alias | str target )

where `str` is a u16 length (counting a trailing NUL), the UTF-8 bytes and that NUL. dtype ids follow
`include/ctranslate2/types.h`: float32, int8, int16, int32, float16, bfloat16. Scalars (rank 0) hold flags and
enums (`decoder/activation`, `encoder/num_heads`, ...). Anything that does not parse exactly is a ConversionError
naming the file and the offset: a converter must never guess at weights.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runner.errors import ExportError

BINARY_VERSION = 6
# index = dtype id; bfloat16 has no numpy dtype and is refused (the Whisper files we read are float16/float32)
_DTYPES: tuple[np.dtype | None, ...] = (
    np.dtype("<f4"),
    np.dtype("i1"),
    np.dtype("<i2"),
    np.dtype("<i4"),
    np.dtype("<f2"),
    None,
)
_DTYPE_NAMES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
_MAX_RANK = 8


class ConversionError(ExportError):
    pass


@dataclass(frozen=True)
class CT2Model:
    spec: str
    revision: int
    variables: dict[str, np.ndarray]  # by name; aliases resolved to the same array
    aliases: dict[str, str]  # alias -> target name, as stored

    def scalar(self, name: str) -> int | float:
        v = self.variables.get(name)
        if v is None or v.ndim != 0:
            raise ConversionError(f"{self.spec}: expected scalar variable {name!r}")
        return v.item()


class _Reader:
    def __init__(self, data: bytes, source: str):
        self.data, self.pos, self.source = data, 0, source

    def fail(self, what: str) -> ConversionError:
        return ConversionError(f"{self.source}: {what} (at byte {self.pos})")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"truncated: wanted {n} more bytes, {len(self.data) - self.pos} left")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("H")
        raw = self.take(n)
        if n == 0 or raw[-1] != 0:
            raise self.fail("string without its NUL terminator")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("string is not UTF-8") from None


def read_ct2(path: str | Path, *, expect_spec: str | None = None, expect_revision: int | None = None) -> CT2Model:
    """Parse a whole `model.bin`; checks the binary version and, if given, the spec name and revision."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from None
    r = _Reader(data, str(path))
    version = r.unpack("I")
    if version != BINARY_VERSION:
        raise r.fail(f"CTranslate2 binary version {version}, this reader reads version {BINARY_VERSION}")
    spec, revision = r.string(), r.unpack("I")
    if expect_spec is not None and spec != expect_spec:
        raise r.fail(f"model spec {spec!r}, expected {expect_spec!r}")
    if expect_revision is not None and revision != expect_revision:
        raise r.fail(f"{spec} revision {revision}, expected {expect_revision}")
    variables: dict[str, np.ndarray] = {}
    for _ in range(r.unpack("I")):
        name = r.string()
        rank = r.unpack("B")
        if rank > _MAX_RANK:
            raise r.fail(f"{name}: rank {rank}")
        shape = tuple(r.unpack("I") for _ in range(rank))
        dtype_id = r.unpack("B")
        if dtype_id >= len(_DTYPES) or _DTYPES[dtype_id] is None:
            what = _DTYPE_NAMES[dtype_id] if dtype_id < len(_DTYPE_NAMES) else f"id {dtype_id}"
            raise r.fail(f"{name}: unsupported dtype {what}")
        dtype = _DTYPES[dtype_id]
        nbytes = r.unpack("I")
        want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes != want:
            raise r.fail(f"{name}: {nbytes} bytes for {_DTYPE_NAMES[dtype_id]}{list(shape)} ({want} expected)")
        if name in variables:
            raise r.fail(f"variable {name!r} appears twice")
        variables[name] = np.frombuffer(r.take(nbytes), dtype=dtype).reshape(shape)
    aliases: dict[str, str] = {}
    for _ in range(r.unpack("I")):
        alias, target = r.string(), r.string()
        if target not in variables or alias in variables or alias in aliases:
            raise r.fail(f"alias {alias!r} -> {target!r} does not name one stored variable")
        aliases[alias] = target
    if r.pos != len(data):
        raise r.fail(f"{len(data) - r.pos} unexpected trailing bytes")
    variables.update({a: variables[t] for a, t in aliases.items()})
    return CT2Model(spec, revision, variables, aliases)


def write_ct2(path: str | Path, spec: str, revision: int, variables: dict[str, np.ndarray], aliases=None) -> None:
    """The writer side of the same format (for tests: small synthetic files exercise every error path)."""

    def string(s: str) -> bytes:
        b = s.encode("utf-8") + b"\0"
        return struct.pack("<H", len(b)) + b

    ids = {np.dtype(d).str if d is not None else None: i for i, d in enumerate(_DTYPES)}
    out = [struct.pack("<I", BINARY_VERSION), string(spec), struct.pack("<I", revision)]
    out.append(struct.pack("<I", len(variables)))
    for name, v in sorted(variables.items()):
        v = np.asarray(v, order="C")  # not ascontiguousarray: it turns scalars into 1-d arrays
        out += [string(name), struct.pack("<B", v.ndim), *(struct.pack("<I", d) for d in v.shape)]
        out += [struct.pack("<B", ids[v.dtype.newbyteorder("<").str if v.dtype.itemsize > 1 else v.dtype.str])]
        out += [struct.pack("<I", v.nbytes), v.astype(v.dtype.newbyteorder("<")).tobytes()]
    aliases = aliases or {}
    out.append(struct.pack("<I", len(aliases)))
    for a, t in sorted(aliases.items()):
        out += [string(a), string(t)]
    Path(path).write_bytes(b"".join(out))
