"""python3 -m kvstash.bench at a tiny size, so it cannot rot: its JSON carries every figure, the
content it read back matched, and bad settings are refused. Timings decide nothing here."""

import json
import os
import subprocess
import sys

import pytest

KVSTASHD = os.environ.get("KVSTASHD")
KVSTASH_CLI = os.environ.get("KVSTASH_CLI")
pytestmark = pytest.mark.skipif(not (KVSTASHD and KVSTASH_CLI),
                                reason="KVSTASHD and KVSTASH_CLI (the binaries) not set")


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvstash.bench", "--kvstashd", KVSTASHD, "--cli", KVSTASH_CLI,
         *args], capture_output=True, text=True, timeout=120)


def test_json_carries_every_figure_and_nothing_mismatched():
    out = run("--block-bytes", "64KiB", "--cpu-bytes", "16MiB", "--seconds", "0.3",
              "--rounds", "2", "--json", "--quiet")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    for name in ("python_gbps", "python_put_gbps", "python_get_gbps", "node_bench_gbps",
                 "ratio"):
        assert summary[name] is not None and summary[name] > 0, name
    assert summary["block_bytes"] == 65536
    assert summary["errors"] == 0
    assert summary["mismatches"] == 0
    assert len(summary["per_round"]) == 2


def test_bad_settings_are_refused():
    out = run("--rounds", "0")
    assert out.returncode == 2
    assert "--rounds" in out.stderr
    out = run("--block-bytes", "lots")
    assert out.returncode == 2
    assert "not a size" in out.stderr


def test_tier_mode_carries_every_figure_and_nothing_mismatched():
    out = run("--tier", "--block-bytes", "64KiB", "--cpu-bytes", "16MiB", "--seconds", "0.3",
              "--rounds", "2", "--job-blocks", "2", "--jobs-outstanding", "3", "--step-ms", "2",
              "--busy-ms", "1", "--json", "--quiet")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["bench"] == "tier"
    for name in ("cascade_gbps", "promotion_gbps", "client_put_gbps", "client_get_gbps",
                 "cascade_ratio", "promotion_ratio"):
        assert summary[name] is not None and summary[name] > 0, name
    assert summary["block_bytes"] == 65536
    assert summary["job_blocks"] == 2 and summary["jobs_outstanding"] == 3
    assert summary["errors"] == 0
    assert summary["mismatches"] == 0
    assert len(summary["per_round"]) == 2


def test_tier_mode_catches_a_corrupted_block(node):
    """The tier's promotions are checked against the rows they were stored from: a source row
    changed after its blocks were stored makes every load of them a mismatch."""
    from kvstash import bench_tier
    from kvstash.vllm import KvstashSecondaryTier

    rows = bench_tier._make_primary(4096, jobs_outstanding=2, job_blocks=2)
    tier = KvstashSecondaryTier(None, memoryview(rows.view("u1")), "kvstash",
                                nodes=[node.address], namespace="bench", start_check_ms=10_000)
    try:
        keys = bench_tier._Keys(b"corrupt-", held=64)
        counts = bench_tier._Counts()
        job_ids = iter(range(1000))
        phase = dict(seconds=0.05, job_blocks=2, outstanding=2, step_s=0.001, busy_s=0,
                     counts=counts, job_ids=job_ids)
        assert bench_tier._tier_phase(tier, rows, keys, False, **phase) > 0
        assert bench_tier._tier_phase(tier, rows, keys, True, **phase) > 0
        assert (counts.errors, counts.mismatches) == (0, 0)
        rows[:bench_tier._PATTERNS, 0] ^= 1  # every source row, after the stores
        bench_tier._tier_phase(tier, rows, keys, True, **phase)
        assert counts.errors == 0
        assert counts.mismatches > 0
    finally:
        tier.shutdown()


def test_tier_settings_out_of_range_are_refused():
    for args, flag in ((["--job-blocks", "0"], "--job-blocks"),
                       (["--jobs-outstanding", "257"], "--jobs-outstanding"),
                       (["--step-ms", "2", "--busy-ms", "3"], "--busy-ms")):
        out = run("--tier", *args)
        assert out.returncode == 2, args
        assert flag in out.stderr
