"""Fixtures starting real kvstashd processes on loopback ports they choose.

KVSTASHD names the binary (ctest sets it); tests that need a node skip without it.
"""

import os
import pathlib
import re
import signal
import subprocess
import time

import pytest

# The line kvstashd prints on stdout once it accepts clients.
_LISTENING = re.compile(r"^kvstashd listening on (\S+):(\d+)\s*$", re.MULTILINE)

# Small nodes: 4 KiB blocks, 256 of them.
BASE_ARGS = ["--listen", "127.0.0.1", "--port", "0", "--metrics-address", "off",
             "--block-bytes", "4KiB", "--cpu-bytes", "1MiB"]
BLOCK_BYTES = 4096


@pytest.fixture(autouse=True)
def every_hit_counted(monkeypatch):
    """The tests count hits exactly: a client they make waits for the nodes' answers up to its
    call deadline, not the 50 ms lookup budget a busy machine can pass. A test of the budget
    gives lookup_budget_ms itself (the vLLM tier passes its own)."""
    import kvstash

    original = kvstash.Client.__init__

    def init(self, *args, **kwargs):
        kwargs.setdefault("lookup_budget_ms", int(kwargs.get("timeout_ms", 5000)))
        original(self, *args, **kwargs)

    monkeypatch.setattr(kvstash.Client, "__init__", init)


class Node:
    """One kvstashd process, its address and its logs. Owned by the start_node fixture."""

    def __init__(self, binary, args, workdir):
        self.args = BASE_ARGS + list(args)
        self._stdout_path = workdir / "stdout"
        self.log_path = workdir / "stderr"
        with open(self._stdout_path, "wb") as out, open(self.log_path, "wb") as err:
            self.proc = subprocess.Popen([binary] + self.args, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL)
        self.stopped = False
        self.address = self._wait_listening(timeout=10.0)

    def _wait_listening(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _LISTENING.search(self._stdout_path.read_text(errors="replace"))
            if match:
                return f"{match.group(1)}:{match.group(2)}"
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        self.close()
        raise RuntimeError(f"kvstashd {' '.join(self.args)} did not start "
                           f"(exit {self.proc.returncode}):\n{self.logs()}")

    def logs(self):
        return self.log_path.read_text(errors="replace")

    def pause(self):
        """SIGSTOP: the node keeps its sockets but answers nothing. Returns once every thread of
        it has stopped: kill() returns before a thread running on another CPU (or on a vCPU the
        host has descheduled) takes the signal, and that thread can still answer a request."""
        self.proc.send_signal(signal.SIGSTOP)
        self.stopped = True
        deadline = time.monotonic() + 5.0
        while not all(state in ("T", "t") for state in self._thread_states()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvstashd {self.proc.pid} did not stop after SIGSTOP")
            time.sleep(0.001)

    def _thread_states(self):
        states = []
        for stat in (pathlib.Path("/proc") / str(self.proc.pid) / "task").glob("*/stat"):
            try:
                # "TID (COMM) STATE ...": COMM may hold spaces and parentheses.
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                pass  # the thread ended meanwhile
        return states

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)
        self.stopped = False

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self):
        if self.proc.poll() is not None:
            return
        if self.stopped:
            self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def start_node(tmp_path):
    """start_node(*extra_args) -> Node: a kvstashd on a free loopback port, killed at teardown."""
    binary = os.environ.get("KVSTASHD")
    if not binary:
        pytest.skip("KVSTASHD (the kvstashd binary) is not set")
    nodes = []

    def start(*args):
        workdir = tmp_path / f"node{len(nodes)}"
        workdir.mkdir()
        node = Node(binary, args, workdir)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.close()


@pytest.fixture
def node(start_node):
    """A kvstashd with the base settings (LRU)."""
    return start_node()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd(tmp_path):
    """An etcd on free loopback ports, its data in tmp_path; its client URL. Skips without etcd."""
    import shutil
    import urllib.request
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    if not os.path.exists(binary):
        pytest.skip("etcd (Debian etcd-server) is not installed")
    client, peer = _free_port(), _free_port()
    url = f"http://127.0.0.1:{client}"
    log = open(tmp_path / "etcd.log", "w")
    proc = subprocess.Popen(
        [binary, "--name", "t", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"t=http://127.0.0.1:{peer}"],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if b'"true"' in r.read():
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"etcd did not start: {(tmp_path / 'etcd.log').read_text()[-2000:]}")
        time.sleep(0.1)
    yield url
    proc.kill()
    proc.wait()
    log.close()
