"""Reading a JSON file that came with a checkpoint or a bundle (config.json, params.json, tekken.json, a shard
index): whatever stops it being read is one error naming the file, never a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

from runner.errors import RunnerError

CONFIG_MAX_BYTES = 16 << 20  # a model's config or shard index: kilobytes in every real checkpoint
TOKENIZER_MAX_BYTES = 256 << 20  # tekken.json: about 15 MB for 150k tokens


def read_json_object(
    path: str | os.PathLike, error: type[RunnerError] = RunnerError, max_bytes: int = CONFIG_MAX_BYTES
) -> dict:
    """The JSON object in `path`, or `error` naming the file: missing, unreadable, larger than `max_bytes` (parsed,
    it would take many times that in memory), not UTF-8, not JSON, nested deeper than the parser recurses, or not
    an object."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise error(f"{path}: not found") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) > max_bytes:
        raise error(f"{path}: larger than {max_bytes >> 20} MiB, not a file of this kind")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{path}: not readable JSON (not UTF-8: byte {e.start})") from None
    except RecursionError:
        raise error(f"{path}: not readable JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, and an integer of more digits than Python converts
        raise error(f"{path}: not readable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise error(f"{path}: not a JSON object")
    return doc
