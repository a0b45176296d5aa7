"""kvstash.Client against real kvstashd processes (conftest.py's fixtures): round trips with
bytes, numpy and torch buffers, every error class, a killed node, asynchronous handles, the GIL
released while a call waits. Needs KVSTASHD (the daemon's path; ctest sets it) and the built
package on PYTHONPATH; tests that need a node skip without KVSTASHD."""

import threading
import time

import numpy as np
import pytest

import kvstash

BLOCK = 4096


def keys_of(n, group=0, prefix=b"block"):
    return [kvstash.key(prefix + b"-%d" % i, group) for i in range(n)]


def pattern(i):
    return (np.arange(BLOCK, dtype=np.uint32)[: BLOCK // 4] * 2654435761 + i).astype(np.uint32)


def test_keys_follow_vllm_offload_key_layout():
    assert kvstash.key(b"\x01\x02", 7) == b"\x01\x02\x00\x00\x00\x07"
    with pytest.raises(kvstash.InvalidArgument):
        kvstash.key(b"", 0)
    with pytest.raises(kvstash.InvalidArgument):
        kvstash.key(b"x", 2**32)


def test_round_trips_with_bytes_numpy_and_torch(node):
    torch = pytest.importorskip("torch")
    with kvstash.Client(node.address, namespace="py") as client:
        assert client.block_bytes() == BLOCK
        keys = keys_of(6)
        blocks = [pattern(i) for i in range(6)]
        sources = [blocks[0].tobytes(), bytearray(blocks[1].tobytes()),
                   memoryview(blocks[2].tobytes()), blocks[3], blocks[4].view(np.uint8),
                   torch.from_numpy(blocks[5].view(np.int32).copy()).numpy()]
        client.put(keys, sources)
        assert client.lookup(keys) == [kvstash.KeyState.HIT] * 6
        outs = [bytearray(BLOCK), np.zeros(BLOCK, np.uint8), np.zeros(BLOCK // 4, np.uint32),
                torch.zeros(BLOCK, dtype=torch.uint8).numpy(), memoryview(bytearray(BLOCK)),
                np.zeros(BLOCK, np.uint8)]
        assert client.get(keys, outs) == [BLOCK] * 6
        for i, out in enumerate(outs):
            assert bytes(memoryview(out).cast("B")) == blocks[i].tobytes(), i


def test_lookups_prefix_and_window(node):
    with kvstash.Client([node.address], namespace="py") as client:
        keys = keys_of(6)
        client.put([keys[0], keys[1], keys[4], keys[5]], [pattern(i) for i in (0, 1, 4, 5)])
        S = kvstash.KeyState
        assert client.lookup(keys) == [S.HIT, S.HIT, S.MISS, S.MISS, S.HIT, S.HIT]
        assert client.prefix_lookup(keys) == 2
        assert client.window_lookup(keys, 2) == 6
        assert client.window_lookup(keys, 3) == 2  # no window of 3: the prefix
        assert client.lookup([]) == []


def test_groups_are_distinct_keys(node):
    with kvstash.Client(node.address) as client:
        client.put([kvstash.key(b"same", 0)], [pattern(0)])
        assert client.lookup([kvstash.key(b"same", 0), kvstash.key(b"same", 1)]) == [
            kvstash.KeyState.HIT, kvstash.KeyState.MISS]


def test_namespaces_do_not_see_each_other(node):
    with kvstash.Client(node.address, namespace="a") as a, \
            kvstash.Client(node.address, namespace="b") as b:
        a.put(keys_of(1), [pattern(0)])
        assert a.lookup(keys_of(1)) == [kvstash.KeyState.HIT]
        assert b.lookup(keys_of(1)) == [kvstash.KeyState.MISS]


def test_every_status_code_has_its_error_class():
    names = ["CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
             "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
             "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
             "UNAUTHENTICATED"]
    classes = set()
    for name in names:
        error = kvstash._error_for(name, "the message")
        assert isinstance(error, kvstash.Error)
        assert error.code == name
        assert str(error) == f"{name}: the message"
        classes.add(type(error))
    assert len(classes) == len(names)
    for cls in (kvstash.Unavailable, kvstash.Unauthenticated, kvstash.PermissionDenied,
                kvstash.InvalidArgument, kvstash.ResourceExhausted, kvstash.DeadlineExceeded):
        assert issubclass(cls, kvstash.Error)


def test_errors_from_the_nodes_carry_their_code_and_message(node, tmp_path):
    with kvstash.Client(node.address) as client:
        with pytest.raises(kvstash.InvalidArgument, match="block size is 4096"):
            client.put(keys_of(1), [b"short"])
        with pytest.raises(kvstash.NotFound, match="does not hold"):
            client.get(keys_of(1, prefix=b"absent"), [bytearray(BLOCK)])
        with pytest.raises(kvstash.InvalidArgument, match="C-contiguous"):
            client.put(keys_of(1), [np.zeros((64, 128), np.uint8)[:, ::2]])
        with pytest.raises(kvstash.InvalidArgument, match="writable"):
            client.get(keys_of(1), [b"\0" * BLOCK])
        with pytest.raises(kvstash.InvalidArgument, match="2 keys but 1 buffers"):
            client.put(keys_of(2), [pattern(0)])
        with pytest.raises(kvstash.InvalidArgument, match="a key is bytes"):
            client.lookup(["not bytes"])
        with pytest.raises(kvstash.InvalidArgument, match="at least 1 hash byte"):
            client.lookup([b"abc"])
    with pytest.raises(kvstash.FailedPrecondition, match="closed"):
        client.lookup(keys_of(1))
    with pytest.raises(kvstash.InvalidArgument, match="HOST:PORT"):
        kvstash.Client("no-port")
    with pytest.raises(kvstash.InvalidArgument):
        kvstash.Client(node.address, token="a", token_file=str(tmp_path / "t"))
    with pytest.raises(kvstash.NotFound, match="token_file"):
        kvstash.Client(node.address, token_file=str(tmp_path / "missing"))


def test_wrong_token_is_unauthenticated_and_a_namespace_token_is_checked(start_node, tmp_path):
    tokens = tmp_path / "namespaces"
    tokens.write_text("tenant secret-1\n")
    secured = start_node("--auth-token-file", str(_write(tmp_path / "token", "node-token\n")),
                         "--namespace-token-file", str(tokens))
    with pytest.raises(kvstash.Unauthenticated):
        kvstash.Client(secured.address, token="wrong").block_bytes()
    with kvstash.Client(secured.address, token_file=str(tmp_path / "token")) as client:
        assert client.block_bytes() == BLOCK
    with pytest.raises((kvstash.PermissionDenied, kvstash.Unauthenticated)):
        kvstash.Client(secured.address, namespace="tenant", token="node-token").block_bytes()
    with kvstash.Client(secured.address, namespace="tenant", token="secret-1") as client:
        assert client.block_bytes() == BLOCK


def test_a_lookup_with_a_wrong_token_raises_not_misses(start_node, tmp_path):
    # It answered MISS for every key: a misconfigured engine looked like a cold cache.
    secured = start_node("--auth-token", "node-token")
    with kvstash.Client(secured.address, token="node-token") as good:
        good.put([b"k" * 8], [bytes(BLOCK)])
        assert good.lookup([b"k" * 8]) == [kvstash.KeyState.HIT]
    with kvstash.Client(secured.address, token="wrong") as client:
        with pytest.raises(kvstash.Unauthenticated, match="token"):
            client.lookup([b"k" * 8])
        with pytest.raises(kvstash.Unauthenticated):
            client.prefix_lookup([b"k" * 8])
        assert client.stats()["client"]["refused"] >= 1


def _write(path, text):
    path.write_text(text)
    return path


def test_a_killed_node_reads_as_misses_and_its_reads_are_unavailable(start_node):
    victim = start_node()
    client = kvstash.Client(victim.address, timeout_ms=1000)
    client.put(keys_of(2), [pattern(0), pattern(1)])
    assert client.lookup(keys_of(2)) == [kvstash.KeyState.HIT] * 2
    victim.kill()
    assert client.lookup(keys_of(2)) == [kvstash.KeyState.MISS] * 2
    assert client.prefix_lookup(keys_of(2)) == 0
    with pytest.raises(kvstash.Unavailable):
        client.get(keys_of(1), [bytearray(BLOCK)])
    with pytest.raises(kvstash.Unavailable):
        client.put(keys_of(1, prefix=b"new"), [pattern(9)])
    stats = client.stats()
    assert stats["client"]["unreachable"] > 0
    assert "error" in stats["nodes"][victim.address]
    client.close()
    client.close()  # idempotent


def test_async_handles(node):
    with kvstash.Client(node.address) as client:
        keys = keys_of(8)
        blocks = [pattern(i) for i in range(8)]
        put = client.put_async(keys, blocks)
        assert put.wait(10)
        assert put.done()
        assert put.result() is None
        outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
        get = client.get_async(keys, outs)
        assert get.result() == [BLOCK] * 8
        assert all(out.tobytes() == b.tobytes() for out, b in zip(outs, blocks))
        missing = client.get_async(keys_of(1, prefix=b"absent"), [bytearray(BLOCK)])
        assert missing.wait(None)
        with pytest.raises(kvstash.NotFound):
            missing.result()
        with pytest.raises(kvstash.NotFound):  # the same error every time it is asked
            missing.result()


def test_the_gil_is_released_while_a_call_waits(start_node):
    stalled = start_node()
    client = kvstash.Client(stalled.address, timeout_ms=800)
    assert client.block_bytes() == BLOCK
    stalled.pause()
    done = threading.Event()

    def slow_lookup():
        client.lookup(keys_of(4))  # waits for the deadline: the node answers nothing
        done.set()

    thread = threading.Thread(target=slow_lookup)
    start = time.monotonic()
    thread.start()
    spins = 0
    while not done.is_set() and time.monotonic() - start < 10:
        spins += 1
    thread.join()
    assert time.monotonic() - start >= 0.5
    assert spins > 10000  # this thread ran Python all along
    stalled.resume()
    client.close()


def test_touch_reaches_the_node(node):
    with kvstash.Client(node.address) as client:
        client.put(keys_of(3), [pattern(i) for i in range(3)])
        client.touch(keys_of(3))
        stats = client.stats()
        assert stats["client"]["touched_keys"] == 3
        assert stats["nodes"][node.address]["node.touched_keys"] >= 3


def test_stats_has_every_counter_of_the_client_registry(node):
    """Every row of the client's counter registry (kvstash/common/client_counters.h) is in
    stats()["client"] by its name, with the names read before the registry kept."""
    counters = kvstash.client_counters()
    assert {"calls", "unreachable", "refused", "touched_keys", "pinned_keys", "unserved_keys",
            "repaired_blocks", "members_joined", "members_left", "skipped_calls", "late_keys",
            "probes", "abandoned_calls"} <= set(counters)
    assert all(isinstance(help, str) and help for help in counters.values())
    with kvstash.Client(node.address) as client:
        client.put(keys_of(2), [pattern(i) for i in range(2)])
        own = client.stats()["client"]
        for name in counters:
            assert name in own, name
            assert isinstance(own[name], int), name
        assert set(own) == set(counters) | {"replicas"}
        assert own["calls"] > 0


def test_a_client_follows_a_cluster_in_etcd_and_replicas_survive_a_killed_node(start_node, etcd):
    nodes = [start_node("--etcd", etcd, "--cluster", "py", "--etcd-ttl-s", "2")
             for _ in range(3)]
    client = kvstash.Client(etcd=etcd, cluster="py", replicas=2, timeout_ms=2000)
    deadline = time.monotonic() + 5
    while len(client.stats()["nodes"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(client.stats()["nodes"]) == sorted(n.address for n in nodes)
    client.put(keys_of(8), [pattern(i) for i in range(8)])
    nodes[0].kill()
    assert client.lookup(keys_of(8)) == [kvstash.KeyState.HIT] * 8
    out = [bytearray(BLOCK) for _ in range(8)]
    client.get(keys_of(8), out)
    assert [bytes(o) for o in out] == [bytes(pattern(i)) for i in range(8)]
    deadline = time.monotonic() + 8
    while client.stats()["client"]["members_left"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = client.stats()
    assert stats["client"]["members_left"] == 1
    assert stats["client"]["unserved_keys"] == 0
    assert stats["client"]["replicas"] == 2
    assert len(stats["nodes"]) == 2
    assert client.lookup(keys_of(8)) == [kvstash.KeyState.HIT] * 8
    client.close()


def test_a_node_source_is_checked():
    with pytest.raises(kvstash.InvalidArgument, match="cluster"):
        kvstash.Client(etcd="http://127.0.0.1:1")
    with pytest.raises(kvstash.InvalidArgument, match="not both"):
        kvstash.Client("127.0.0.1:1", etcd="http://127.0.0.1:1", cluster="c")
    with pytest.raises(kvstash.InvalidArgument, match="replicas"):
        kvstash.Client("127.0.0.1:1", replicas=0)
    with pytest.raises(kvstash.Unavailable, match="127.0.0.1:1"):
        kvstash.Client(etcd="http://127.0.0.1:1", cluster="c")
