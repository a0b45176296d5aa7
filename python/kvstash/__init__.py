"""kvstash: a client of kvstash offload nodes (kvstashd), and a vLLM secondary tier.

    import kvstash
    with kvstash.Client(["127.0.0.1:7070"], namespace="my-model") as client:
        keys = [kvstash.key(b"block-hash-0", 0)]
        client.put(keys, [block_bytes])            # any buffer: bytes, bytearray, numpy, ...
        assert client.lookup(keys) == [kvstash.KeyState.HIT]
        client.get(keys, [bytearray(len(block_bytes))])

Keys are bytes in vLLM's OffloadKey layout: the block hash bytes followed by the KV group index as
4 big-endian bytes (`kvstash.key`). The node key's hash is the xxh3-128 of the hash bytes only and
its group is the group as it is, so any vLLM OffloadKey is a kvstash key as it is (a block's
identity: docs/semantics.md §18).

Block buffers are handed to the C++ client as they are (no copy in Python); each must be
C-contiguous and exactly the nodes' block size (`Client.block_bytes()`). The GIL is released
while a call waits on the nodes. Errors raise subclasses of `kvstash.Error` carrying the status
code and the C++ message. A node that cannot be reached reads as misses in lookups (and is
counted in `stats()`), never as an exception; puts and gets to it raise `Unavailable`.
"""

import enum as _enum

__all__ = [
    "Client", "Handle", "KeyState", "key", "client_counters", "Error", "Cancelled", "Unknown",
    "InvalidArgument", "DeadlineExceeded", "NotFound", "AlreadyExists", "PermissionDenied",
    "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented",
    "Internal", "Unavailable", "DataLoss", "Unauthenticated",
]


class Error(Exception):
    """A kvstash call failed. `code` is the status code's name ("UNAVAILABLE", ...)."""

    code = "UNKNOWN"

    def __init__(self, message):
        super().__init__(message)
        self.message = message

    def __str__(self):
        return f"{self.code}: {self.message}"


def _error_class(name, code):
    return type(name, (Error,), {"code": code, "__doc__": f"Status {code}."})


Cancelled = _error_class("Cancelled", "CANCELLED")
Unknown = _error_class("Unknown", "UNKNOWN")
InvalidArgument = _error_class("InvalidArgument", "INVALID_ARGUMENT")
DeadlineExceeded = _error_class("DeadlineExceeded", "DEADLINE_EXCEEDED")
NotFound = _error_class("NotFound", "NOT_FOUND")
AlreadyExists = _error_class("AlreadyExists", "ALREADY_EXISTS")
PermissionDenied = _error_class("PermissionDenied", "PERMISSION_DENIED")
ResourceExhausted = _error_class("ResourceExhausted", "RESOURCE_EXHAUSTED")
FailedPrecondition = _error_class("FailedPrecondition", "FAILED_PRECONDITION")
Aborted = _error_class("Aborted", "ABORTED")
OutOfRange = _error_class("OutOfRange", "OUT_OF_RANGE")
Unimplemented = _error_class("Unimplemented", "UNIMPLEMENTED")
Internal = _error_class("Internal", "INTERNAL")
Unavailable = _error_class("Unavailable", "UNAVAILABLE")
DataLoss = _error_class("DataLoss", "DATA_LOSS")
Unauthenticated = _error_class("Unauthenticated", "UNAUTHENTICATED")

_ERRORS = {cls.code: cls for cls in (
    Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
    PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange, Unimplemented,
    Internal, Unavailable, DataLoss, Unauthenticated)}


def _error_for(code, message):
    return _ERRORS.get(code, Unknown)(message)


from . import _kvstash  # noqa: E402  (the error classes exist before the extension uses them)

_kvstash._set_error_factory(_error_for)


class KeyState(_enum.IntEnum):
    """A lookup's answer for one key."""

    MISS = 0   # not stored (or its node cannot be reached)
    HIT = 1    # stored and readable now
    RETRY = 2  # not decided yet (being written, being promoted from SSD): ask again later


def key(hash_bytes, group=0):
    """The key of a block: its hash bytes then `group` as 4 big-endian bytes (vLLM's OffloadKey)."""
    if not isinstance(hash_bytes, (bytes, bytearray, memoryview)) or len(hash_bytes) == 0:
        raise InvalidArgument("key: hash_bytes must be non-empty bytes")
    if not 0 <= group < 2**32:
        raise InvalidArgument(f"key: group {group} is outside 0..2**32-1")
    return bytes(hash_bytes) + int(group).to_bytes(4, "big")


def client_counters():
    """{name: help} of every counter in Client.stats()["client"] (besides "replicas"), in the
    order of the client's counter registry (kvstash/common/client_counters.h)."""
    return {c["name"]: c["help"] for c in _kvstash.client_counters()}


Handle = _kvstash.Handle
Handle.__doc__ = """An asynchronous put or get: done(), wait(timeout=None) -> bool, result().

result() waits, then returns what the call returns (None for a put, the bytes read per key for a
get) or raises its error. The buffers stay in use until the call is done."""


def _keys(keys):
    if isinstance(keys, (bytes, bytearray)):
        raise InvalidArgument("keys: a list of keys, not one key")
    return keys if isinstance(keys, (list, tuple)) else list(keys)


class Client:
    """A client of one or more kvstash nodes.

    nodes: "HOST:PORT" or a list of them; each key lives on one node (rendezvous hashing).
    etcd and cluster, instead of nodes: etcd's client URLs ("http://HOST:PORT,...") and the
    cluster's name (kvstashd --cluster); the client follows the cluster's live nodes, so nodes
    that join or leave move only their share of the keys, with no restart.
    replicas: keep each block on this many nodes (a lost node then costs no hits, but the
    cluster holds 1/replicas as many distinct blocks).
    namespace: the key namespace (nodes keep namespaces apart); token or token_file: the nodes'
    auth token (at most one of them); timeout_ms: every call's deadline; tls: UCX transports
    ("shm", "tcp", ...; None: UCX's default). lookup_budget_ms: how long a lookup waits for the
    nodes; keys of a node that has not answered by then (stopped, cut off, slow) read as MISS,
    counted in stats()["client"]["late_keys"]; a node that keeps not answering is skipped at once
    (stats()["client"]["skipped_calls"]) until it answers a probe. block_bytes: the block size
    this client stores (0: any); a node of another size is left out of the members, logged once,
    and the call that found it raises FailedPrecondition. Thread-safe.
    """

    def __init__(self, nodes=None, namespace="default", token=None, token_file=None,
                 timeout_ms=5000, tls=None, etcd=None, cluster=None, replicas=1,
                 lookup_budget_ms=50, block_bytes=0):
        if isinstance(nodes, str):
            nodes = [nodes]
        self._c = _kvstash.Client(list(nodes or []), namespace, token, token_file, int(timeout_ms),
                                  tls, etcd, cluster, int(replicas), int(lookup_budget_ms),
                                  int(block_bytes))

    def lookup(self, keys):
        """Each key's KeyState, in order. Keys of an unreachable node are MISS (counted); a node
        that refuses the call (a wrong token, a namespace it does not serve) raises."""
        return [KeyState(s) for s in self._c.lookup(_keys(keys))]

    def prefix_lookup(self, keys):
        """The number of leading keys that are hits, or None: a RETRY among them, ask again."""
        return self._c.prefix_lookup(_keys(keys))

    def window_lookup(self, keys, window):
        """The end of the right-most run of `window` hits (the keys before it need not be held);
        with none, the run of hits from key 0. None: a RETRY decides it, ask again."""
        return self._c.window_lookup(_keys(keys), max(0, int(window)))

    def put(self, keys, buffers):
        """Stores buffers[i] under keys[i]; a node that holds a block already keeps its bytes."""
        self._c.put(_keys(keys), list(buffers))

    def get(self, keys, buffers):
        """Reads keys[i] into buffers[i] (writable); the bytes read per key."""
        return self._c.get(_keys(keys), list(buffers))

    def put_async(self, keys, buffers):
        """put() on a thread of its own: a Handle."""
        return self._c.put_async(_keys(keys), list(buffers))

    def get_async(self, keys, buffers):
        """get() on a thread of its own: a Handle."""
        return self._c.get_async(_keys(keys), list(buffers))

    def touch(self, keys):
        """Marks the keys used on their nodes, the first the most recent."""
        self._c.touch(_keys(keys))

    def block_bytes(self):
        """The nodes' block size: every buffer is exactly this long."""
        return self._c.block_bytes()

    def stats(self):
        """{"client": its counters, "nodes": {"HOST:PORT": the node's counters or {"error": ...}}}.

        "client" holds every counter of client_counters() by its name (calls, unreachable,
        refused, touched_keys, ..., probes, abandoned_calls) and "replicas"."""
        return self._c.stats()

    def close(self):
        """Waits for asynchronous touches, then disconnects. Idempotent."""
        self._c.close()

    @property
    def closed(self):
        return self._c.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
