"""python3 -m kvstash.bench: the Python client's put/get rate against `kvstash bench node`.

Both load the same node with the same work in paired rounds: one client storing new blocks and
reading back blocks it stored (half and half), --batch blocks per call, for --seconds. A round
runs the C++ bench (`kvstash bench node --clients 1`) and this package's client back to back,
alternating which goes first, so the machine's drift weighs on both; every figure is the median
over rounds, the ratio the median of the rounds' own ratios. A ratio near 1 says the Python layer
adds no copy and no cost of its own. Every block read back is checked against what was stored.

With --tier it measures the vLLM tier instead (kvstash/bench_tier.py): its cascades and
promotions, driven as vLLM's tiering manager drives them, against a direct kvstash.Client moving
the same jobs' blocks; --block-bytes then defaults to 2MiB.

Starts a kvstashd of its own (--kvstashd, else $KVSTASHD, else `kvstashd` on the PATH) unless
--node names one. Prints a table, or one JSON object with --json; progress on standard error.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

import kvstash
from kvstash import bench_tier

FIGURES = [
    ("python_gbps", "GB/s", "this package: put_gbps + get_gbps"),
    ("python_put_gbps", "GB/s", "bytes stored / --seconds"),
    ("python_get_gbps", "GB/s", "bytes read back / --seconds"),
    ("node_bench_gbps", "GB/s", "kvstash bench node --clients 1, the same work: its gbps"),
    ("ratio", "x", "python_gbps / node_bench_gbps (median of the rounds' ratios)"),
]


def _parse_bytes(text):
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size like 256KiB")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit]


def _find(explicit, env, name, flag):
    path = explicit or os.environ.get(env) or shutil.which(name)
    if not path or not os.path.exists(path):
        raise SystemExit(f"kvstash.bench: {name} not found: give {flag}, set ${env}, or put it "
                         "on the PATH")
    return path


class _Node:
    def __init__(self, path, block_bytes, cpu_bytes):
        self.process = subprocess.Popen(
            [path, "--listen", "127.0.0.1", "--port", "0", "--metrics-address", "off",
             "--block-bytes", str(block_bytes), "--cpu-bytes", str(cpu_bytes)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.address = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            m = re.search(r"listening on (\S+:\d+)", line)
            if m:
                self.address = m.group(1).rstrip(":")
                break
        if not self.address:
            self.stop()
            raise SystemExit("kvstash.bench: kvstashd did not start")
        threading.Thread(target=self.process.stdout.read, daemon=True).start()

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)


def _python_round(client, seconds, batch, keys_per_client, round_index):
    """One client: a put of `batch` new blocks, then a read of `batch` it stored, until
    `seconds` pass. Returns (put_bytes, get_bytes, errors, mismatches, misses)."""
    block = client.block_bytes()
    # Checked word by word (numpy compares 8-byte words about 3x faster than bytes), as the C++
    # bench checks its blocks.
    pool = [np.random.default_rng(i).integers(0, 2**63, block // 8, dtype=np.uint64)
            for i in range(64)]
    outs = [np.empty(block // 8, np.uint64) for _ in range(batch)]
    stored = []  # key index of blocks stored, most recent last
    put_bytes = get_bytes = errors = mismatches = misses = 0
    n = 0
    prefix = b"pybench-%d-" % round_index
    start = time.perf_counter()
    end = start + seconds
    while time.perf_counter() < end:
        ids = list(range(n, n + batch))
        n += batch
        keys = [kvstash.key(prefix + b"%d" % i, 0) for i in ids]
        try:
            client.put(keys, [pool[i % 64] for i in ids])
            put_bytes += block * batch
            stored.extend(ids)
            del stored[:-keys_per_client]
        except kvstash.Error:
            errors += 1
        if not stored:
            continue
        picks = [stored[(n * 7 + j * 13) % len(stored)] for j in range(batch)]
        keys = [kvstash.key(prefix + b"%d" % i, 0) for i in picks]
        try:
            got = client.get(keys, outs)
        except kvstash.NotFound:
            misses += 1
            continue
        except kvstash.Error:
            errors += 1
            continue
        get_bytes += sum(got)
        for i, out in zip(picks, outs):
            if not np.array_equal(out, pool[i % 64]):
                mismatches += 1
    elapsed = time.perf_counter() - start
    return put_bytes / elapsed, get_bytes / elapsed, errors, mismatches, misses


def _node_bench_round(cli, address, seconds, batch, keys_per_client):
    out = subprocess.run(
        [cli, "bench", "node", "--node", address, "--clients", "1", "--batch", str(batch),
         "--seconds", str(seconds), "--keys-per-client", str(keys_per_client),
         "--namespace", "bench-cpp", "--json", "--quiet"],
        capture_output=True, text=True, timeout=seconds * 10 + 120)
    if out.returncode != 0:
        raise SystemExit(f"kvstash.bench: kvstash bench node failed ({out.returncode}): "
                         f"{out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python3 -m kvstash.bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Figures (table rows and --json keys):\n" + "\n".join(
            f"  {name} ({unit}): {what}" for name, unit, what in FIGURES) +
        "\nWith --tier:\n" + "\n".join(
            f"  {name} ({unit}): {what}" for name, unit, what in bench_tier.FIGURES))
    parser.add_argument("--node", help="an offload node as HOST:PORT (default: start one)")
    parser.add_argument("--kvstashd", help="the kvstashd to start (default: $KVSTASHD, PATH)")
    parser.add_argument("--cli", help="the kvstash CLI (default: $KVSTASH_CLI, PATH)")
    parser.add_argument("--block-bytes", type=_parse_bytes,
                        help="block size of the node started (default 256KiB; 2MiB with --tier)")
    parser.add_argument("--cpu-bytes", type=_parse_bytes, default=_parse_bytes("512MiB"),
                        help="CPU tier of the node started (default 512MiB)")
    parser.add_argument("--seconds", type=float, default=3.0, help="per side and round (3)")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds (3)")
    parser.add_argument("--batch", type=int, default=8, help="blocks per call (8)")
    parser.add_argument("--keys-per-client", type=int, default=64,
                        help="reads pick among the last this many blocks stored (64)")
    parser.add_argument("--tier", action="store_true",
                        help="the vLLM tier's cascades and promotions against a direct client")
    parser.add_argument("--job-blocks", type=int, default=8,
                        help="--tier: blocks per job (8)")
    parser.add_argument("--jobs-outstanding", type=int,
                        help="--tier: jobs submitted and not yet reported finished, at most "
                        "(default: 64 MiB of them, so that polling once a step does not bound "
                        "the rate)")
    parser.add_argument("--step-ms", type=float, default=5.0,
                        help="--tier: an engine step, between polls of get_finished (5)")
    parser.add_argument("--busy-ms", type=float, default=0.0,
                        help="--tier: of each step, Python work holding the GIL (0; on a small "
                        "machine it also takes CPU the direct client keeps)")
    parser.add_argument("--tier-workers", type=int,
                        help="--tier: the tier's `workers` setting (default: the tier's own)")
    parser.add_argument("--tls", help="--tier: UCX transports of the tier and the client "
                        "(shm, tcp, ...; default UCX's choice)")
    parser.add_argument("--json", action="store_true", help="one JSON object on standard output")
    parser.add_argument("--quiet", action="store_true", help="no progress on standard error")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.rounds > 1000:
        parser.error(f"--rounds: {args.rounds} is outside 1..1000")
    if args.seconds <= 0:
        parser.error("--seconds: must be positive")
    if not 1 <= args.batch <= 1024:
        parser.error(f"--batch: {args.batch} is outside 1..1024")
    if not 1 <= args.job_blocks <= 1024:
        parser.error(f"--job-blocks: {args.job_blocks} is outside 1..1024")
    if args.jobs_outstanding is not None and not 1 <= args.jobs_outstanding <= 256:
        parser.error(f"--jobs-outstanding: {args.jobs_outstanding} is outside 1..256")
    if not 0 <= args.step_ms <= 1000:
        parser.error(f"--step-ms: {args.step_ms} is outside 0..1000")
    if not 0 <= args.busy_ms <= args.step_ms:
        parser.error(f"--busy-ms: {args.busy_ms} is outside 0..--step-ms")
    if args.tier_workers is not None and args.tier_workers < 1:
        parser.error(f"--tier-workers: {args.tier_workers} is not positive")
    if args.block_bytes is None:
        args.block_bytes = _parse_bytes("2MiB" if args.tier else "256KiB")
    if args.tier:
        return _tier_main(args)

    cli = _find(args.cli, "KVSTASH_CLI", "kvstash", "--cli")
    node, address = _node_for(args)
    per_round = []
    errors = mismatches = misses = 0
    try:
        with kvstash.Client(address, namespace="bench-python") as client:
            block = client.block_bytes()
            for r in range(args.rounds):
                def python_side():
                    return _python_round(client, args.seconds, args.batch,
                                         args.keys_per_client, r)

                def cpp_side():
                    return _node_bench_round(cli, address, args.seconds, args.batch,
                                             args.keys_per_client)

                if r % 2 == 0:
                    py, cpp = python_side(), cpp_side()
                else:
                    cpp, py = cpp_side(), python_side()
                put, get, e, m, miss = py
                errors += e + int(cpp.get("errors", 0))
                mismatches += m + int(cpp.get("mismatches", 0))
                misses += miss
                row = {"python_put_gbps": put / 1e9, "python_get_gbps": get / 1e9,
                       "python_gbps": (put + get) / 1e9, "node_bench_gbps": cpp["gbps"]}
                row["ratio"] = row["python_gbps"] / row["node_bench_gbps"] if row[
                    "node_bench_gbps"] > 0 else None
                per_round.append(row)
                if not args.quiet:
                    print(f"round {r + 1}/{args.rounds}: python {row['python_gbps']:.2f} GB/s, "
                          f"kvstash bench node {row['node_bench_gbps']:.2f} GB/s", file=sys.stderr)
    finally:
        if node:
            node.stop()

    def median(name):
        values = [row[name] for row in per_round if row[name] is not None]
        return statistics.median(values) if values else None

    summary = {"bench": "python", "node": address, "block_bytes": block, "batch": args.batch,
               "seconds": args.seconds, "rounds": args.rounds, "errors": errors,
               "mismatches": mismatches, "misses": misses}
    for name, _, _ in FIGURES:
        summary[name] = median(name)
    summary["per_round"] = per_round
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"python client vs kvstash bench node: node {address}, blocks of {block} bytes, "
              f"{args.batch} per call, {args.rounds} round(s) of {args.seconds:g} s")
        for name, unit, _ in FIGURES:
            value = summary[name]
            print(f"  {name:<18} {'-' if value is None else f'{value:.3f}'} {unit}")
        print(f"  errors {errors}, mismatches {mismatches}, misses {misses}")
    return 1 if errors or mismatches else 0


def _node_for(args):
    """The node to measure: --node's, else one started here (returned, for the caller to stop)."""
    if args.node:
        return None, args.node
    node = _Node(_find(args.kvstashd, "KVSTASHD", "kvstashd", "--kvstashd"), args.block_bytes,
                 args.cpu_bytes)
    return node, node.address


def _tier_main(args):
    args.tier_config = {} if args.tier_workers is None else {"workers": args.tier_workers}
    if args.tls:
        args.tier_config["tls"] = args.tls
    node, address = _node_for(args)
    try:
        summary = bench_tier.run(args, address)
    finally:
        if node:
            node.stop()
    if args.json:
        print(json.dumps(summary))
    else:
        bench_tier.print_table(summary)
    return 1 if summary["errors"] or summary["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
