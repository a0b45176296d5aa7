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
