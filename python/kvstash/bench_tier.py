"""python3 -m kvstash.bench --tier: the vLLM tier's cascades and promotions against the client.

The tier (kvstash.vllm.KvstashSecondaryTier) is driven as vLLM's TieringOffloadingManager
drives it: jobs of --job-blocks blocks submitted with submit_store (cascades, primary rows to the
node) or submit_load (promotions, the node into primary rows), up to --jobs-outstanding of them
not yet reported finished (by default 64 MiB of jobs: the manager learns of a finished job only
at the next step, so fewer would bound the rate, not the tier), and get_finished() polled once
per step. A step is --step-ms long: the scheduler first computes in Python for --busy-ms
(holding the GIL, as vLLM's scheduler and model runner do for part of every step; 0 by default,
as on a small machine that also takes a share of the CPU the direct client keeps), then waits
for the rest (the GPU's share). A direct kvstash.Client on the same node moves the same jobs'
blocks from and into the same rows, one put or get per job, back to back.

Before the rounds, each side stores as many blocks as the node's tier holds (--cpu-bytes) and
reads some back, uncounted, so that no phase pays the first touch of the node's memory.

A round runs, for --seconds each: the tier's cascades then its promotions of blocks it stored,
and the client's puts then its gets of blocks it stored, alternating which side goes first, so
the machine's drift weighs on both. A phase's GB/s is the bytes of its jobs over the time from
its first submit to the step that saw its last job finish (the drain included). Every figure is
the median over rounds, a ratio the median of the rounds' own ratios. Every row loaded is checked
against the row it was stored from, word by word, on both sides.
"""

import collections
import statistics
import sys
import time

import numpy as np

import kvstash
from kvstash import vllm as tier_module

FIGURES = [
    ("cascade_gbps", "GB/s", "the tier's store jobs (cascades)"),
    ("promotion_gbps", "GB/s", "the tier's load jobs (promotions)"),
    ("client_put_gbps", "GB/s", "a direct kvstash.Client's puts of the same jobs"),
    ("client_get_gbps", "GB/s", "a direct kvstash.Client's gets of the same jobs"),
    ("cascade_ratio", "x", "cascade_gbps / client_put_gbps (median of the rounds' ratios)"),
    ("promotion_ratio", "x", "promotion_gbps / client_get_gbps (median of the rounds' ratios)"),
]

# Distinct block contents: key i is stored from source row i % _PATTERNS.
_PATTERNS = 16
# The bytes of the jobs outstanding by default: at 5 ms steps, up to 13 GB/s before polling
# once a step bounds the rate.
_OUTSTANDING_BYTES = 64 << 20


class _Counts:
    __slots__ = ("errors", "mismatches")

    def __init__(self):
        self.errors = 0
        self.mismatches = 0


def _make_primary(block, jobs_outstanding, job_blocks):
    """The primary rows: _PATTERNS source rows of random words, then one destination row per
    block a load in flight may write. Rows as uint64 words, so checks compare words."""
    words = block // 8
    rows = np.empty((_PATTERNS + jobs_outstanding * job_blocks, words), np.uint64)
    for i in range(_PATTERNS):
        rows[i] = np.random.default_rng(1000 + i).integers(0, 2**63, words, dtype=np.uint64)
    rows[_PATTERNS:] = 0
    return rows


def _check(rows, dest_rows, key_ids, counts):
    for row, key_id in zip(dest_rows, key_ids):
        if not np.array_equal(rows[row], rows[key_id % _PATTERNS]):
            counts.mismatches += 1


class _Keys:
    """One side's keys: a round's stores name new ones; loads pick among the last `held`."""

    def __init__(self, prefix, held):
        self.prefix = prefix
        self.held = held
        self.next = 0

    def key(self, i):
        return kvstash.key(self.prefix + b"%d" % i, 0)

    def new_job(self, n):
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids

    def stored_job(self, n, j):
        """`n` distinct ids among the last `held` stored, picked by job number `j`."""
        window = min(self.held, self.next)
        first = self.next - window
        start = (j * 7 * n) % window
        return [first + (start + k) % window for k in range(min(n, window))]


def _step(step_s, busy_s):
    """An engine step: Python work holding the GIL for busy_s, then a wait to step_s."""
    start = time.perf_counter()
    x = 0
    while time.perf_counter() - start < busy_s:
        for i in range(100):
            x += i
    rest = step_s - (time.perf_counter() - start)
    if rest > 0:
        time.sleep(rest)


def _tier_phase(tier, rows, keys, is_load, seconds, job_blocks, outstanding, step_s, busy_s,
                counts, job_ids, max_jobs=None):
    """Jobs for `seconds` (or `max_jobs` of them), then the drain; the bytes moved per
    second."""
    block = rows.shape[1] * 8
    free_slots = collections.deque(range(outstanding))  # groups of destination rows
    running = {}  # job id -> (key ids, destination slot or None)
    moved = 0
    jobs = 0
    start = time.perf_counter()
    end = start + seconds
    last = start
    while True:
        now = time.perf_counter()
        for result in tier.get_finished():
            key_ids, slot = running.pop(result.job_id)
            last = now
            if not result.success:
                counts.errors += 1
            else:
                moved += block * len(key_ids)
                if slot is not None:
                    _check(rows, _dest_rows(slot, job_blocks, len(key_ids)), key_ids, counts)
            if slot is not None:
                free_slots.append(slot)
        if now >= end or jobs == max_jobs:
            if not running:
                break
        else:
            while len(running) < outstanding and jobs != max_jobs:
                job_id = next(job_ids)
                if is_load:
                    slot = free_slots.popleft()
                    key_ids = keys.stored_job(job_blocks, jobs)
                    block_ids = _dest_rows(slot, job_blocks, len(key_ids))
                else:
                    slot = None
                    key_ids = keys.new_job(job_blocks)
                    block_ids = [i % _PATTERNS for i in key_ids]
                jobs += 1
                running[job_id] = (key_ids, slot)
                job = tier_module.JobMetadata(
                    job_id=job_id, keys=[keys.key(i) for i in key_ids],
                    block_ids=np.array(block_ids, dtype=np.int64), is_promotion=is_load)
                (tier.submit_load if is_load else tier.submit_store)(job)
        _step(step_s, busy_s)
    return moved / max(last - start, 1e-9)


def _dest_rows(slot, job_blocks, n):
    first = _PATTERNS + slot * job_blocks
    return list(range(first, first + n))


def _client_phase(client, rows, keys, is_load, seconds, job_blocks, counts, max_jobs=None):
    """The same jobs, one call each, back to back; the bytes moved per second."""
    block = rows.shape[1] * 8
    moved = 0
    jobs = 0
    start = time.perf_counter()
    end = start + seconds
    while time.perf_counter() < end and jobs != max_jobs:
        if is_load:
            key_ids = keys.stored_job(job_blocks, jobs)
            dest = _dest_rows(0, job_blocks, len(key_ids))
        else:
            key_ids = keys.new_job(job_blocks)
        jobs += 1
        names = [keys.key(i) for i in key_ids]
        try:
            if is_load:
                lengths = client.get(names, [rows[r] for r in dest])
                if any(n != block for n in lengths):
                    counts.errors += 1
                    continue
                _check(rows, dest, key_ids, counts)
            else:
                client.put(names, [rows[i % _PATTERNS] for i in key_ids])
            moved += block * len(key_ids)
        except kvstash.Error:
            counts.errors += 1
    return moved / (time.perf_counter() - start)


def run(args, address):
    """The rounds against the node at `address`; the summary (bench.py prints it)."""
    with kvstash.Client(address, namespace="bench-probe") as probe:
        block = probe.block_bytes()
    if block % 8:
        raise SystemExit(f"kvstash.bench --tier: blocks of {block} bytes; a multiple of 8 is "
                         "needed")
    if args.jobs_outstanding is None:
        args.jobs_outstanding = max(1, min(256, _OUTSTANDING_BYTES // (block * args.job_blocks)))
    rows = _make_primary(block, args.jobs_outstanding, args.job_blocks)
    # Loads pick among the blocks each side stored last: a quarter of the node's tier each, so
    # the node evicts none of them while the other side stores.
    held = max(args.job_blocks, args.cpu_bytes // block // 4)
    counts = _Counts()
    per_round = []
    job_ids = iter(range(1 << 62))
    tier = tier_module.KvstashSecondaryTier(
        None, memoryview(rows.view(np.uint8)), "kvstash", nodes=[address],
        namespace="bench-tier", start_check_ms=10_000, **args.tier_config)
    try:
        with kvstash.Client(address, namespace="bench-client", tls=args.tls) as client:
            # Uncounted: each side stores as many blocks as the node's tier holds and reads
            # some back, so the first phase of a round pays no first touch of the node's tier
            # (the node's pages, each connection's mapping of them) for the others.
            fill = -(-args.cpu_bytes // block // args.job_blocks)
            tier_keys, client_keys = _Keys(b"tier-warm-", held), _Keys(b"client-warm-", held)
            for is_load in (False, True):
                _tier_phase(tier, rows, tier_keys, is_load, 60, args.job_blocks,
                            args.jobs_outstanding, 0, 0, counts, job_ids, max_jobs=fill)
            for is_load in (False, True):
                _client_phase(client, rows, client_keys, is_load, 60, args.job_blocks, counts,
                              max_jobs=fill)
            for r in range(args.rounds):
                tier_keys = _Keys(b"tier-%d-" % r, held)
                client_keys = _Keys(b"client-%d-" % r, held)

                def tier_side():
                    step = (args.step_ms / 1000, args.busy_ms / 1000)
                    cascade = _tier_phase(tier, rows, tier_keys, False, args.seconds,
                                          args.job_blocks, args.jobs_outstanding, *step,
                                          counts, job_ids)
                    promotion = _tier_phase(tier, rows, tier_keys, True, args.seconds,
                                            args.job_blocks, args.jobs_outstanding, *step,
                                            counts, job_ids)
                    return cascade, promotion

                def client_side():
                    put = _client_phase(client, rows, client_keys, False, args.seconds,
                                        args.job_blocks, counts)
                    get = _client_phase(client, rows, client_keys, True, args.seconds,
                                        args.job_blocks, counts)
                    return put, get

                if r % 2 == 0:
                    (cascade, promotion), (put, get) = tier_side(), client_side()
                else:
                    (put, get), (cascade, promotion) = client_side(), tier_side()
                row = {"cascade_gbps": cascade / 1e9, "promotion_gbps": promotion / 1e9,
                       "client_put_gbps": put / 1e9, "client_get_gbps": get / 1e9}
                row["cascade_ratio"] = cascade / put if put > 0 else None
                row["promotion_ratio"] = promotion / get if get > 0 else None
                per_round.append(row)
                if not args.quiet:
                    print(f"round {r + 1}/{args.rounds}: cascade {row['cascade_gbps']:.2f} "
                          f"(client put {row['client_put_gbps']:.2f}), promotion "
                          f"{row['promotion_gbps']:.2f} (client get "
                          f"{row['client_get_gbps']:.2f}) GB/s", file=sys.stderr)
    finally:
        tier.shutdown()

    def median(name):
        values = [row[name] for row in per_round if row[name] is not None]
        return statistics.median(values) if values else None

    summary = {"bench": "tier", "node": address, "block_bytes": block,
               "job_blocks": args.job_blocks, "jobs_outstanding": args.jobs_outstanding,
               "step_ms": args.step_ms, "busy_ms": args.busy_ms, "seconds": args.seconds,
               "rounds": args.rounds, "tls": args.tls, "tier_config": args.tier_config,
               "errors": counts.errors,
               "mismatches": counts.mismatches}
    for name, _, _ in FIGURES:
        summary[name] = median(name)
    summary["per_round"] = per_round
    return summary


def print_table(summary):
    print(f"vLLM tier vs kvstash.Client: node {summary['node']}, blocks of "
          f"{summary['block_bytes']} bytes, jobs of {summary['job_blocks']}, "
          f"{summary['jobs_outstanding']} outstanding, steps of {summary['step_ms']:g} ms "
          f"({summary['busy_ms']:g} busy), "
          f"{summary['rounds']} round(s) of {summary['seconds']:g} s")
    for name, unit, _ in FIGURES:
        value = summary[name]
        print(f"  {name:<18} {'-' if value is None else f'{value:.3f}'} {unit}")
    print(f"  errors {summary['errors']}, mismatches {summary['mismatches']}")
