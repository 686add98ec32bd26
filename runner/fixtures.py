"""Where the fixtures are (the tiny model's config.json, the tiny tekken.json, the sample audio, golden tokens).

They live in the repository's top-level `fixtures/` folder; a non-editable install carries them as the data-only
package `voxtral_fixtures` (pyproject.toml maps that folder to it), so `voxtral-runner export --preset tiny` works
outside a checkout too.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

PACKAGE = "voxtral_fixtures"
SOURCE_TREE = Path(__file__).resolve().parents[1] / "fixtures"


@cache
def fixtures_dir() -> Path:
    """The installed `voxtral_fixtures` package's folder, else the checkout's `fixtures/`."""
    spec = importlib.util.find_spec(PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "tekken.json").is_file():
            return Path(location)
    return SOURCE_TREE
