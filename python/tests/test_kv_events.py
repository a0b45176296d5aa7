"""A node's KV events read as a vLLM subscriber reads them: a ZMQ SUB socket and a ROUTER replay
(python3-zmq), each batch decoded with python3-msgpack by a decoder written here from vLLM's
published schema (vllm/distributed/kv_events.py: KVEventBatch, BlockStored, BlockRemoved,
AllBlocksCleared; msgspec structs with array_like, omit_defaults and tag), every field checked.
Needs KVSTASHD (conftest.py) and the built package on PYTHONPATH."""

import json
import os
import pathlib
import re
import subprocess
import time
import urllib.request

import msgpack
import pytest
import zmq

import kvstash

from test_client import BLOCK, keys_of, pattern

# vLLM's field order, after the tag; the fields from `extra_keys` on have defaults (None), so
# an encoder leaves out those that trail.
BLOCK_STORED = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                "kv_cache_spec_sliding_window"]
BLOCK_STORED_REQUIRED = 7
BLOCK_REMOVED = ["block_hashes", "medium", "group_idx"]
BLOCK_REMOVED_REQUIRED = 2

_EVENTS = re.compile(r"^kvstashd KV events on (\S+?)(?:, replay on (\S+))?\s*$", re.MULTILINE)


def decode_event(array):
    assert isinstance(array, list) and array, array
    tag, fields = array[0], array[1:]
    if tag == "AllBlocksCleared":
        assert fields == []
        return {"type": tag}
    names, required = {"BlockStored": (BLOCK_STORED, BLOCK_STORED_REQUIRED),
                       "BlockRemoved": (BLOCK_REMOVED, BLOCK_REMOVED_REQUIRED)}[tag]
    assert required <= len(fields) <= len(names), (tag, fields)
    event = dict(zip(names, fields + [None] * (len(names) - len(fields))))
    event["type"] = tag
    # omit_defaults: a trailing field is present only when it is not its default.
    if len(fields) > required:
        assert fields[-1] is not None, (tag, fields)
    for h in event["block_hashes"]:
        assert isinstance(h, (int, bytes)), event
    assert isinstance(event["medium"], str), event
    assert event["group_idx"] is None or isinstance(event["group_idx"], int)
    if tag == "BlockStored":
        assert event["parent_block_hash"] is None or isinstance(event["parent_block_hash"],
                                                                (int, bytes))
        assert all(isinstance(t, int) for t in event["token_ids"])
        assert isinstance(event["block_size"], int)
        assert event["lora_id"] is None and event["lora_name"] is None
        assert event["kv_cache_spec_kind"] is None or isinstance(event["kv_cache_spec_kind"], str)
    return event


def decode_batch(payload):
    obj = msgpack.unpackb(payload, raw=False)
    # Exactly as msgspec writes it: the smallest encoding of each value (msgpack-python writes
    # the same), so re-encoding gives the same bytes.
    assert msgpack.packb(obj, use_bin_type=True) == payload
    assert isinstance(obj, list) and len(obj) in (2, 3), obj
    ts, events = obj[0], obj[1]
    assert isinstance(ts, float) and abs(ts - time.time()) < 600
    return [decode_event(e) for e in events]


class Subscriber:
    def __init__(self, endpoint):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVTIMEO, 10000)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)

    def receive(self):
        topic, seq, payload = self.sub.recv_multipart()
        return topic.decode(), int.from_bytes(seq, "big", signed=True), decode_batch(payload)

    def close(self):
        self.sub.close()
        self.ctx.term()


def start_with_events(start_node):
    node = start_node("--kv-events", "tcp://127.0.0.1:*", "--kv-events-replay",
                      "tcp://127.0.0.1:*")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        match = _EVENTS.search(pathlib.Path(node._stdout_path).read_text())
        if match:
            return node, match.group(1), match.group(2)
        time.sleep(0.01)
    raise AssertionError("kvstashd printed no KV events line")


def await_subscribed(client, sub, block_bytes=BLOCK):
    """A SUB socket joins asynchronously: stores probe blocks (of the node's block size) in a
    namespace of their own until one of its events arrives, then drains that namespace's events."""
    deadline = time.monotonic() + 10
    sub.sub.setsockopt(zmq.RCVTIMEO, 100)
    i = 0
    while time.monotonic() < deadline:
        client.put(keys_of(1, prefix=b"probe-%d" % i), [bytes([i % 256]) * block_bytes])
        i += 1
        try:
            sub.receive()
            break
        except zmq.Again:
            pass
    while True:
        try:
            sub.receive()
        except zmq.Again:
            break
    sub.sub.setsockopt(zmq.RCVTIMEO, 10000)


def test_a_nodes_events_decode_as_vllms_schema_in_order(start_node):
    node, endpoint, replay = start_with_events(start_node)
    sub = Subscriber(endpoint)
    try:
        with kvstash.Client(node.address, namespace="probe") as probe:
            await_subscribed(probe, sub)
        with kvstash.Client(node.address, namespace="events-a") as client:
            keys = keys_of(3, group=2)
            client.put(keys, [pattern(i) for i in range(3)])
            topic, seq, events = sub.receive()
            assert topic == "events-a"
            assert seq == 0
            # A topic starts with AllBlocksCleared, then what the node stored.
            assert events[0] == {"type": "AllBlocksCleared"}
            stored = [e for e in events[1:] if e["type"] == "BlockStored"]
            hashes = [h for e in stored for h in e["block_hashes"]]
            assert len(hashes) == 3 and len(set(hashes)) == 3
            for e in stored:
                assert e["medium"] == "CPU"
                assert e["group_idx"] == 2
                assert e["block_size"] == 0 and e["token_ids"] == []
                assert e["parent_block_hash"] is None
                # The Python client's keys are 128-bit hashes: 16 bytes, big-endian.
                assert all(isinstance(h, bytes) and len(h) == 16 for h in e["block_hashes"])

            # Filling the tier (256 blocks) evicts them: removed in the same namespace, after.
            for start in range(0, 300, 50):
                client.put(keys_of(50, prefix=b"filler-%d" % start),
                           [pattern(i) for i in range(50)])
            removed = set()
            last = seq
            deadline = time.monotonic() + 10
            while not set(hashes) <= removed and time.monotonic() < deadline:
                topic, seq, events = sub.receive()
                if topic != "events-a":
                    continue  # the probes' namespace loses its blocks too
                assert seq == last + 1, "sequence numbers of a topic have no gaps"
                last = seq
                for e in events:
                    assert e["type"] in ("BlockStored", "BlockRemoved")
                    if e["type"] == "BlockRemoved":
                        assert e["medium"] == "CPU"
                        removed.update(e["block_hashes"])
            assert set(hashes) <= removed

        # The replay socket gives the topic's batches again from a number, then -1.
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10000)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big"), b"events-a"])
        seqs = []
        while True:
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                assert payload == b""
                break
            events = decode_batch(payload)
            if seq == 0:
                assert events[0] == {"type": "AllBlocksCleared"}
            seqs.append(seq)
        assert seqs == list(range(last + 1))
        dealer.close()
        ctx.term()
    finally:
        sub.close()


def _start(argv, lines, timeout=30.0):
    """Starts a program and reads its standard output until every line prefix in `lines` came:
    the process and each such line's rest."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True)
    found = {}
    deadline = time.monotonic() + timeout
    while len(found) < len(lines) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        for prefix in lines:
            if line.startswith(prefix) and prefix not in found:
                found[prefix] = line[len(prefix):].strip()
    if len(found) < len(lines):
        proc.kill()
        proc.wait()
        raise AssertionError(f"{argv[0]} did not start: {found}")
    return proc, found


def test_a_workers_and_its_nodes_stored_blocks_say_their_parents_and_sizes(tmp_path):
    """kvstash-engine serve --kv-events (a worker's own cache, medium GPU) over a kvstashd
    --kv-events (what the worker's connector stored, medium CPU): every field decoded as vLLM's
    schema says, each BlockStored's block_size its group's block size, and its parent the block
    before its first in the same group (None for a request's first block), as the worker said
    it and, through the put's metadata, as the node says it. The worker says a parent before its
    children; the node's events link by parent in any order (docs/semantics.md §19: the cluster
    client commits a request's blocks last first, in batches that may end in either order)."""
    kvstashd = os.environ.get("KVSTASHD")
    engine = os.environ.get("KVSTASH_ENGINE")
    if not kvstashd or not engine:
        pytest.skip("KVSTASHD and KVSTASH_ENGINE (ctest sets them) are not set")
    node, node_lines = _start(
        [kvstashd, "--listen", "127.0.0.1", "--port", "0", "--metrics-address", "off",
         "--block-bytes", "4152", "--cpu-bytes", "16MiB", "--kv-events", "tcp://127.0.0.1:*"],
        ["kvstashd listening on ", "kvstashd KV events on "])
    worker = None
    subs = []
    try:
        node_address = node_lines["kvstashd listening on "].split()[-1]
        worker, worker_lines = _start(
            [engine, "serve", "--model", "builtin:tiny-hybrid", "--nodes", node_address,
             "--port", "0", "--kv-events", "tcp://127.0.0.1:*"],
            ["kvstash-engine serving ", "kvstash-engine KV events on "])
        http = worker_lines["kvstash-engine serving "].split()[-1]
        models = json.load(urllib.request.urlopen(f"http://{http}/v1/models", timeout=10))
        details = models["data"][0]["kvstash"]
        groups = details["groups"]
        node_sub = Subscriber(node_lines["kvstashd KV events on "].split(",")[0])
        subs = [node_sub]
        # The node's SUB socket joins before any prompt (probes in a namespace of their own), so
        # it sees every event of the worker's blocks; a chain seen from its middle would name a
        # parent it never saw.
        with kvstash.Client(node_address, namespace="probe") as probe:
            await_subscribed(probe, node_sub, block_bytes=4152)
        worker_sub = Subscriber(worker_lines["kvstash-engine KV events on "].split(",")[0])
        subs.append(worker_sub)
        for s in subs:
            s.sub.setsockopt(zmq.RCVTIMEO, 50)

        stored = {"node": [], "worker": []}
        def drain():
            for name, s in (("node", node_sub), ("worker", worker_sub)):
                while True:
                    try:
                        topic, _, events = s.receive()
                    except zmq.Again:
                        break
                    if topic != "probe":
                        stored[name] += [e for e in events if e["type"] == "BlockStored"]

        def unlinked():
            """The node's events whose parent is none of the node's blocks of that group yet."""
            held = {}
            for e in stored["node"]:
                held.setdefault(e["group_idx"], set()).update(e["block_hashes"])
            return [e for e in stored["node"] if e["parent_block_hash"] is not None
                    and e["parent_block_hash"] not in held.get(e["group_idx"], set())]

        # The worker's SUB socket joins asynchronously: prompts (each new) until both have said
        # something.
        deadline = time.monotonic() + 30
        i = 0
        while (not stored["node"] or not stored["worker"]) and time.monotonic() < deadline:
            prompt = [(7 * j + 131 * i) % 250 + 1 for j in range(200)]
            body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
            request = urllib.request.Request(f"http://{http}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            reply = json.load(urllib.request.urlopen(request, timeout=60))
            assert reply["choices"][0]["token_ids"], reply
            i += 1
            end = time.monotonic() + 1
            while time.monotonic() < end and (not stored["node"] or not stored["worker"]):
                drain()
        # A request's later batch may still be on its way: until the node's events link up.
        drain()
        deadline = time.monotonic() + 30
        while unlinked() and time.monotonic() < deadline:
            drain()
        assert stored["worker"], "the worker published no BlockStored"
        assert stored["node"], "the node published no BlockStored"

        for source, medium in (("worker", "GPU"), ("node", "CPU")):
            seen = {}  # the worker's: group -> hashes stored so far
            for e in stored[source]:
                assert e["medium"] == medium, e
                group = e["group_idx"]
                assert isinstance(group, int) and 0 <= group < len(groups), e
                spec = groups[group]
                # A worker's block is its group's; a node's, the connector's offloaded block of
                # that group: a whole number of the group's blocks.
                assert e["block_size"] > 0 and e["block_size"] % spec["block_size"] == 0, (e, spec)
                if source == "worker":
                    assert e["block_size"] == spec["block_size"], (e, spec)
                    kinds = {"full": "full_attention", "sliding_window": "sliding_window",
                             "chunked_local": "chunked_local_attention", "state": "mamba"}
                    assert e["kv_cache_spec_kind"] == kinds.get(spec["kind"], spec["kind"]), (e, spec)
                    if spec["kind"] == "sliding_window":
                        assert e["kv_cache_spec_sliding_window"] == spec["window"], (e, spec)
                else:
                    assert e["kv_cache_spec_kind"] is None, e
                assert e["token_ids"] == [], e
                # The worker's parent: None (a request's first block) or a block of the same group
                # it said it stored before (the node's: unlinked(), below).
                if source == "worker":
                    parent = e["parent_block_hash"]
                    assert parent is None or parent in seen.get(group, set()), (source, e)
                    seen.setdefault(group, set()).update(e["block_hashes"])
            if source == "node":
                assert not unlinked(), unlinked()
            # Some event of every source chains onto an earlier one (the prompts are 200
            # tokens: several blocks each).
            assert any(e["parent_block_hash"] is not None for e in stored[source]) or any(
                len(e["block_hashes"]) > 1 for e in stored[source]), stored[source]
    finally:
        for s in subs:
            s.close()
        for proc in (worker, node):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
