"""Load on a running `python -m runner serve`: N clients in a closed loop (each sends its next file when its answer
comes back) POST /v1/audio/transcriptions; requests/s, generated tokens/s, latency p50/p90/p99 and errors -> JSON,
with what the server's /metrics counted over the same stretch (requests, tokens, batch occupancy).

    python3 benchmarks/serve_load.py --url http://127.0.0.1:8000 --audio /tmp/tp30.wav --clients 8 32 \\
        --seconds 20 --language en --compare bench_tp.json --out serve_tp.json

It starts nothing: the server is the caller's (benchmarks/gpu.py's `serve` mode starts one). Each client count is
one run, after a warm-up of --warmup requests per client that is not counted. Answers are json, whose `usage`
counts the generated tokens (an answer's segments hold none where its text is empty). --compare reads `bench --throughput`'s JSON and sets each run beside its
tokens/s at batch = clients (issue 44's target: at least 85% of it). Exit 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROUTE = "/v1/audio/transcriptions"
AUDIO_SUFFIXES = {".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".webm", ".mp4"}
TARGET = 0.85  # issue 44: the server's tokens/s against bench --throughput's at the same batch


class BadInput(Exception):
    """Said as one `error:` line."""


@dataclass(frozen=True)
class Answer:
    seconds: float
    tokens: int = 0
    error: str | None = None


def audio_files(paths: list[Path]) -> list[tuple[str, bytes]]:
    """Each file (a folder: its audio files, sorted) as (name, bytes), read once."""
    files = []
    for p in paths:
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix.lower() in AUDIO_SUFFIXES)
            if not found:
                raise BadInput(f"--audio {p}: a folder with no audio files ({' '.join(sorted(AUDIO_SUFFIXES))})")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise BadInput(f"--audio {p}: no such file or folder")
    return [(f.name, f.read_bytes()) for f in files]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: a value that was measured."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else None


def samples(text: str) -> dict[str, float]:
    """Prometheus text: each sample's value by its name and labels as written (`name{a="x"}`)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


async def scrape(client: httpx.AsyncClient) -> dict[str, float] | None:
    """The server's /metrics now; None where it has none."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    return samples(r.text) if r.status_code == 200 else None


def counted(before: dict | None, after: dict | None) -> dict | None:
    """What the server counted between two scrapes: this route's answers (every status), tokens, batches."""
    if before is None or after is None:
        return None

    def delta(match) -> float:
        return sum(v for k, v in after.items() if match(k)) - sum(v for k, v in before.items() if match(k))

    batches = delta(lambda k: k == "runner_batch_occupancy_count")
    return {
        "requests": int(delta(lambda k: k.startswith(f'runner_requests_total{{route="{ROUTE}"'))),
        "generated_tokens": int(delta(lambda k: k == "runner_generated_tokens_total")),
        "batches": int(batches),
        "batch_occupancy_mean": delta(lambda k: k == "runner_batch_occupancy_sum") / batches if batches else None,
    }


async def wait_ready(client: httpx.AsyncClient, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if (await client.get("/health", timeout=5)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise BadInput(f"--url {client.base_url}: /health did not answer 200 within {seconds:g} s (--wait-s)")
        await asyncio.sleep(0.5)


async def transcribe(client: httpx.AsyncClient, name: str, data: bytes, fields: dict) -> Answer:
    t0 = time.perf_counter()
    try:
        r = await client.post(ROUTE, files={"file": (name, data)}, data=fields)
    except httpx.HTTPError as e:
        return Answer(time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        return Answer(seconds, error=f"{r.status_code}: {' '.join(r.text.split())[:200]}")
    try:
        tokens = int(r.json()["usage"]["output_tokens"])
    except (ValueError, KeyError, TypeError):
        return Answer(seconds, error=f"200 without json's usage.output_tokens: {' '.join(r.text.split())[:200]}")
    return Answer(seconds, tokens=tokens)


async def closed_loop(client, files, clients: int, requests: int | None, seconds: float | None, fields) -> list:
    """Each client sends `requests` files (or until `seconds` have passed), the next when its answer is in; client i
    starts at file i, so the files are spread over the clients."""
    deadline = time.monotonic() + seconds if seconds else math.inf

    async def client_loop(i: int) -> list[Answer]:
        got = []
        for k in range(requests) if requests else itertools.count():
            if time.monotonic() >= deadline:
                break
            name, data = files[(i + k * clients) % len(files)]
            got.append(await transcribe(client, name, data, fields))
        return got

    return [a for answers in await asyncio.gather(*map(client_loop, range(clients))) for a in answers]


def bench_rate(records: list[dict] | None, batch: int) -> float | None:
    """bench --throughput's generated tokens / wall at `batch`, from its JSON records."""
    name = f"throughput_decode_tokens_per_s_b{batch}"
    rates = [float(r["metric"]["extra_info"]["median"]) for r in records or () if r["metric"]["name"] == name]
    return rates[0] if rates else None


async def run(client, files, clients: int, args, fields, bench) -> dict:
    if args.warmup:  # first-call costs (graph buckets, allocator growth) out of the timed stretch
        await closed_loop(client, files, clients, args.warmup, None, fields)
    before = await scrape(client)
    t0 = time.perf_counter()
    answers = await closed_loop(client, files, clients, args.requests, args.seconds, fields)
    wall = time.perf_counter() - t0
    server = counted(before, await scrape(client))
    ok = [a for a in answers if a.error is None]
    tokens = sum(a.tokens for a in ok)
    ref = bench_rate(bench, clients)
    return {
        "clients": clients,
        "requests": len(answers),
        "ok": len(ok),
        "errors": len(answers) - len(ok),
        "error_samples": list(dict.fromkeys(a.error for a in answers if a.error))[:5],
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "latency_ms": {f"p{q}": percentile([a.seconds * 1e3 for a in ok], q) for q in (50, 90, 99)},
        "server": server,
        "bench_tokens_per_s": ref,
        "vs_bench": tokens / wall / ref if ref else None,
    }


def line(r: dict) -> str:
    text = f"{r['clients']} clients: {r['requests_per_s']:.2f} req/s, {r['tokens_per_s']:.0f} tok/s"
    if r["vs_bench"] is not None:
        text += f" ({r['vs_bench']:.0%} of bench --throughput at batch {r['clients']}, target {TARGET:.0%})"
    if r["server"] and r["server"]["batch_occupancy_mean"] is not None:
        text += f", mean batch {r['server']['batch_occupancy_mean']:.1f}"
    if r["ok"]:
        text += f", p50 {r['latency_ms']['p50']:.0f} ms"
    return text + (f", {r['errors']} of {r['requests']} FAILED" if r["errors"] else "")


async def load(args, bench: list[dict] | None) -> dict:
    files = audio_files(args.audio)
    fields = {"response_format": "json", **({"language": args.language} if args.language else {})}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.clients) + 2, max_keepalive_connections=max(args.clients) + 2)
    # trust_env off: a proxy from the environment must not stand between the clients and a loopback server
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=args.timeout_s, limits=limits, trust_env=False
    ) as client:
        await wait_ready(client, args.wait_s)
        runs = []
        for n in args.clients:
            runs.append(await run(client, files, n, args, fields, bench))
            print(line(runs[-1]), flush=True)
    return {"url": args.url, "audio": [n for n, _ in files], "fields": fields, "runs": runs}


def at_least(low: float, kind=int):
    def check(text: str):
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text}: {low} or more")
        return value

    return check


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--audio", type=Path, nargs="+", required=True, help="files or folders, cycled over the requests")
    p.add_argument("--clients", type=at_least(1), nargs="+", default=[8], help="one run per count, in order")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--requests", type=at_least(1), help="requests per client (default 8 without --seconds)")
    stop.add_argument("--seconds", type=at_least(0.1, float), help="send for this long (what is in flight finishes)")
    p.add_argument("--warmup", type=at_least(0), default=1, help="requests per client before each run, not counted")
    p.add_argument("--language", help="the form's language field (bench --throughput runs with --language en)")
    p.add_argument("--api-key", help="the server's key, sent as `Authorization: Bearer KEY`")
    p.add_argument("--compare", type=Path, help="bench --throughput's JSON: its tokens/s at batch = clients")
    p.add_argument("--wait-s", type=at_least(0.0, float), default=60.0, help="wait this long for /health to answer")
    p.add_argument("--timeout-s", type=at_least(0.1, float), default=600.0, help="one request's limit")
    p.add_argument("--out", type=Path, help="the JSON (default: stdout, after the summary lines)")
    args = p.parse_args(argv)
    if args.requests is None and args.seconds is None:
        args.requests = 8
    return args


def read_bench(path: Path | None) -> list[dict] | None:
    if path is None:
        return None
    try:
        records = json.loads(path.read_text())
        bench_rate(records, 1)  # the shape bench writes: a list of records with metric names and medians
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise BadInput(f"--compare {path}: not bench's JSON ({type(e).__name__}: {e})") from None
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        bench = read_bench(args.compare)
        result = asyncio.run(load(args, bench))
    except (BadInput, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        print(text, end="")
    return 1 if any(r["errors"] for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
