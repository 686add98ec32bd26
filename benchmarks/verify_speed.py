"""Cold-cache digest verification: one sha256 per file (format 1) vs per-chunk digests on every core (format 2).

A file of --gib GiB (random bytes, in the page cache after writing, as a just-fetched bundle is) is verified
--runs times each way with an empty digest cache; prints the medians.

    python benchmarks/verify_speed.py --gib 2 --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from runner import bundle as rb
from runner.digests import DigestCache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        cold = DigestCache(d / "cache" / "digests.json", rehash=True)  # a cold digest cache every time
        f = d / "text_decoder.safetensors"
        with open(f, "wb") as out:
            for _ in range(int(args.gib * 1024 / 64)):
                out.write(os.urandom(64 << 20))
        chunked = rb.file_entries(d, [f.name], digests=cold)
        whole = {f.name: rb.FileEntry(chunked[f.name].sha256, chunked[f.name].size)}
        size = f.stat().st_size
        results = {}
        for label, entries in (("one sha256 (format 1)", whole), ("64 MiB pieces (format 2)", chunked)):
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                rb._verify_digests(entries, {f.name: f}, cold)
                times.append(time.perf_counter() - t0)
            results[label] = statistics.median(times)
        print(f"{size / 2**30:.2f} GiB, {os.cpu_count()} CPUs, median of {args.runs} cold verifications:\n")
        print("| digests | seconds | GB/s |")
        print("|---|---:|---:|")
        for label, t in results.items():
            print(f"| {label} | {t:.2f} | {size / t / 1e9:.2f} |")


if __name__ == "__main__":
    main()
