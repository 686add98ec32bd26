"""Paths into a nested JSON value and in-place edits at them: the mutations the manifest property tests
(tests/test_bundle.py) and the atheris fuzzer (tests/fuzz/fuzz_manifest.py) apply to a real manifest."""

from __future__ import annotations

import copy


def mutate(d, path, new) -> None:
    """Replace (or with "delete", remove) the value at `path` by a copy of `new` (a strategy's sampled values are
    shared between examples: a later edit inside one must not change it for the next, nor make it contain itself);
    a path an earlier mutation broke is skipped."""
    parent = d
    try:
        for key in path[:-1]:
            parent = parent[key]
        if new == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(new)
    except (KeyError, IndexError, TypeError):
        pass


def paths(d, prefix=()):
    """Every (path) into a nested JSON value, containers included."""
    yield prefix
    if isinstance(d, dict):
        for k, v in d.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from paths(v, prefix + (i,))
