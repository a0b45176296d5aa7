"""kvstash as a secondary tier of vLLM's TieringOffloadingSpec.

vLLM keeps offloaded KV blocks in a CPU primary tier; a secondary tier holds blocks the primary
cascades to it and promotes them back on a hit. `KvstashSecondaryTier` is such a tier backed by
kvstash nodes, so blocks outlive the engine and are shared between engines:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "kvstash", "nodes": ["127.0.0.1:7070"]}]}}'

The `vllm.general_plugins` entry point `kvstash = "kvstash.vllm:register"` registers the type
"kvstash". Every node must store blocks of exactly one primary row (kvstashd --block-bytes); the
tier refuses to start otherwise and says which size to use.

vLLM calls the tier from its scheduler thread, once per key, and must never wait there:

- lookup() answers from what the nodes said in the last moment (`lookup_ttl_ms`). A key not asked
  yet joins one batched lookup that a background thread sends for every key asked since the last
  batch, and answers None ("ask again next step") meanwhile. The nodes answer the batch within
  `lookup_budget_ms` each, in parallel; keys of a node that has not answered by then (stopped,
  cut off, slow) read as misses, and a node that keeps not answering is skipped at once until it
  answers a probe, so one stalled node never delays the others' keys. A node that answers RETRY
  (a block being written or promoted from its SSD) reads as None once, then is asked again. A key
  whose batch has waited longer than `lookup_wait_ms` reads as a miss.
- The bound: a key reads None at most `max_deferrals` (2) times in a row, then False; and a key
  whose load failed reads False for `failed_load_ttl_ms` (30 s), so vLLM computes it instead of
  promoting it again. A request is deferred at most 2 steps per lookup of a key, and a load that
  always fails costs it one failed promotion, never a loop.
- submit_store() and submit_load() hand a job to C++ (kvstash._kvstash.TierJobs), which puts
  the primary rows to the nodes or gets the blocks into the primary rows, straight from and into
  vLLM's memory (no copy but the transfer's own). Each job's blocks are all in flight at once,
  up to `workers` jobs run at once, loads before queued stores, and neither a job nor its
  completion takes the GIL, so the scheduler thread never slows them. get_finished() returns
  what finished since the last call; any error is a job with success=False, logged once per
  operation and error code.
- touch() is merged with the other touches of the moment and sent by the background thread.

Config keys (the tier's dict in `secondary_tiers`, beside "type"):
  nodes           "HOST:PORT" or a list of them (this, or etcd and cluster)
  etcd            etcd client URLs ("http://HOST:PORT,..."): follow a cluster's live nodes
  cluster         the cluster's name in etcd (kvstashd --cluster)
  replicas        keep each block on this many nodes (default 1; a lost node then costs no
                  hits, but the nodes hold 1/replicas as many distinct blocks)
  namespace       key namespace on the nodes (default: a fingerprint of the model and KV layout,
                  so only engines whose blocks are interchangeable share them)
  token_file      file whose first line is the nodes' auth token
  timeout_ms      deadline of every node call (default 5000)
  tls             UCX transports for block traffic ("shm", "tcp", ...; default UCX's choice)
  lookup_ttl_ms   how long a node's answer is reused (default 1000)
  lookup_wait_ms  how long a key waits for its batch before it reads as a miss (default 500)
  lookup_budget_ms  how long a batch waits for each node (default 50); see above
  max_deferrals   how many steps in a row a key may read None (default 2)
  failed_load_ttl_ms  how long keys of a failed load read False (default 30000)
  workers         jobs running at once, each on a thread of its own (default 4; loads go
                  before queued stores)

The constructor does no network I/O of its own: the nodes' block size and the token are checked
by the background thread, and the constructor waits at most `start_check_ms` (default 200) for
the first node's answer. A node that answers in time with another block size or refuses the token
makes the constructor raise; one that answers later makes every job fail and every lookup miss,
logged (a node down at start is not an error).

This module imports without vLLM: the base class, JobMetadata and JobResult are vLLM's when it is
installed and stand-ins with the same fields otherwise.
"""

import collections
import dataclasses
import hashlib
import itertools
import json
import logging
import re
import threading
import time

import numpy as np

import kvstash

logger = logging.getLogger(__name__)

try:
    from vllm.v1.kv_offload.tiering.base import JobMetadata, JobResult
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager as _TierBase
except ImportError:
    _TierBase = object

    @dataclasses.dataclass
    class JobMetadata:
        """A transfer between the primary tier and this one (vLLM's fields)."""

        job_id: int
        keys: list
        block_ids: np.ndarray
        is_promotion: bool
        req_context: object = None

    @dataclasses.dataclass
    class JobResult:
        """A finished job (vLLM's fields)."""

        job_id: int
        success: bool


# What lookup() answers: True / False / None, or the HIT / MISS / RETRY of the LookupResult enum
# that later vLLM versions compare against, when the installed vLLM has it.
try:
    from vllm.v1.kv_offload.base import LookupResult as _LookupResult

    HIT, MISS, RETRY = _LookupResult.HIT, _LookupResult.MISS, _LookupResult.RETRY
except (ImportError, AttributeError):
    HIT, MISS, RETRY = True, False, None

try:
    from vllm.v1.kv_offload.base import RequestOffloadingContext as _RequestOffloadingContext
except (ImportError, AttributeError):
    _RequestOffloadingContext = None

__all__ = ["KvstashSecondaryTier", "JobMetadata", "JobResult", "HIT", "MISS", "RETRY", "register",
           "namespace_for"]

TIER_TYPE = "kvstash"

# Keys awaiting a batch, at most: past it (nodes stalled under a storm of new keys) lookups read
# as misses instead of growing the queue.
_MAX_PENDING_KEYS = 1 << 16
# Touch calls awaiting the background thread, at most; the oldest are dropped past it (a touch
# only orders eviction).
_MAX_PENDING_TOUCHES = 4096
# How long the background thread lets the scheduler go on asking before it sends a batch: the
# keys of one scheduling pass then travel together.
_GATHER_S = 0.0002

# Keys vLLM's factory may pass besides the tier's own (depending on its version).
_FRAMEWORK_KEYS = frozenset({"module_path", "tier_name", "backpressure_detector"})
_CONFIG_KEYS = frozenset({"nodes", "etcd", "cluster", "replicas", "namespace", "token_file",
                          "timeout_ms", "tls", "lookup_ttl_ms", "lookup_wait_ms", "workers",
                          "lookup_budget_ms", "max_deferrals", "failed_load_ttl_ms",
                          "start_check_ms"})
# Failed-load entries kept at most (the oldest expire first past it).
_MAX_FAILED_KEYS = 1 << 16


def register():
    """vLLM plugin entry point (`vllm.general_plugins`): registers the secondary tier "kvstash".

    Without vLLM (or a vLLM without tiering) it does nothing. Registering twice is harmless.
    """
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError as e:
        logger.debug("kvstash: vLLM tiering not importable (%s); tier %r not registered", e,
                     TIER_TYPE)
        return
    if TIER_TYPE in getattr(SecondaryTierFactory, "_registry", {}):
        return
    SecondaryTierFactory.register_tier(TIER_TYPE, __name__, "KvstashSecondaryTier")


def _attr(obj, path):
    """obj.a.b... for path "a.b...", or None where an attribute is missing or fails."""
    for name in path.split("."):
        if obj is None:
            return None
        try:
            obj = getattr(obj, name, None)
        except Exception:  # a property of a half-built config may raise anything
            return None
    return obj


def _find_vllm_config(config):
    """The VllmConfig in `config`: itself, or what an OffloadingSpec holds of it."""
    for candidate in (config, _attr(config, "vllm_config"), _attr(config, "config"),
                      _attr(config, "config.vllm_config")):
        if candidate is not None and (hasattr(candidate, "model_config")
                                      or hasattr(candidate, "cache_config")):
            return candidate
    return None


def namespace_for(vllm_config, row_bytes):
    """The default namespace: "vllm-" and a sha256 of what makes blocks interchangeable.

    That is the model (name, revision, dtype, layers, KV heads, head size), the KV cache (dtype,
    tokens per block, offloaded block size), the parallel layout (the rows interleave the
    workers' pages) and the row size. Whatever `vllm_config` (a VllmConfig, an OffloadingSpec or
    None) lacks is left out.
    """
    config = _find_vllm_config(vllm_config)
    fields = {"row_bytes": int(row_bytes)}
    paths = {
        "model": "model_config.model",
        "revision": "model_config.revision",
        "dtype": "model_config.dtype",
        "layers": "model_config.hf_text_config.num_hidden_layers",
        "kv_heads": "model_config.hf_text_config.num_key_value_heads",
        "head_dim": "model_config.hf_text_config.head_dim",
        "kv_cache_dtype": "cache_config.cache_dtype",
        "block_size": "cache_config.block_size",
        "tensor_parallel": "parallel_config.tensor_parallel_size",
        "pipeline_parallel": "parallel_config.pipeline_parallel_size",
        "decode_context_parallel": "parallel_config.decode_context_parallel_size",
    }
    for name, path in paths.items():
        value = _attr(config, path)
        if value is None and path.startswith("model_config.hf_text_config."):
            value = _attr(config, path.replace("hf_text_config", "hf_config"))
        if value is not None and not callable(value):
            fields[name] = str(value)
    extra = _attr(config, "kv_transfer_config.kv_connector_extra_config")
    if isinstance(extra, dict) and extra.get("block_size") is not None:
        fields["offloaded_block_size"] = str(extra["block_size"])
    if "model" not in fields:
        logger.warning("kvstash: no model found in the vLLM config; the namespace is derived "
                       "from the row size only (%d bytes): set 'namespace' to keep models apart",
                       row_bytes)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return "vllm-" + digest[:32]


def _primary_rows(primary_kv_view):
    """The primary tier as a (num_blocks, row) array sharing its memory; row b is contiguous."""
    rows = np.asarray(primary_kv_view)
    if rows.ndim != 2 or rows.shape[0] == 0 or rows.shape[1] == 0:
        raise ValueError(f"kvstash: the primary KV view has shape {rows.shape}; expected "
                         "(num_blocks, row_bytes)")
    if rows.strides[1] != rows.itemsize:
        raise ValueError(f"kvstash: the rows of the primary KV view are not contiguous (strides "
                         f"{rows.strides})")
    if not rows.flags.writeable:
        raise ValueError("kvstash: the primary KV view is read-only; loads write into it")
    return rows


def _merge_touches(calls):
    """One key list with the effect of the touch calls in order: the last call's keys first."""
    seen = set()
    merged = []
    for keys in reversed(calls):
        for key in keys:
            if key not in seen:
                seen.add(key)
                merged.append(key)
    return merged


class _Job:
    __slots__ = ("job_id", "keys", "is_load")

    def __init__(self, job_id, keys, is_load):
        self.job_id = job_id
        self.keys = keys
        self.is_load = is_load


class KvstashSecondaryTier(_TierBase):
    """vLLM's SecondaryTierManager over kvstash nodes.

    vLLM's tiering manager owns it and calls it from the scheduler thread; no call waits on the
    network. A background thread sends lookups and touches; the jobs run in C++
    (kvstash._kvstash.TierJobs), up to `workers` at once, never taking the GIL, and
    get_finished() collects them. Thread-safe. shutdown() stops the threads and drops every
    reference to the primary's memory, so the primary can release its mapping afterwards.
    """

    def __init__(self, vllm_config=None, primary_kv_view=None, tier_type=TIER_TYPE, *,
                 offloading_spec=None, **config):
        """Connects to the nodes and checks their block size against the primary rows.

        vLLM's factory passes its config (as `vllm_config` or, in later versions,
        `offloading_spec`), the primary tier's memoryview and the tier's dict without "type".
        Raises ValueError for a bad config or a node block size other than the row size, and
        kvstash.Error if the client cannot be created (bad address, unreadable token file).
        """
        source = vllm_config if vllm_config is not None else offloading_spec
        if _TierBase is not object:
            try:
                super().__init__(source, primary_kv_view, tier_type)
            except TypeError:  # a vLLM whose base takes other arguments; ours are set below
                pass
        self.tier_type = tier_type
        unknown = set(config) - _CONFIG_KEYS - _FRAMEWORK_KEYS
        if unknown:
            raise ValueError(f"kvstash tier: unknown config keys {sorted(unknown)}; accepted: "
                             f"{sorted(_CONFIG_KEYS)}")
        nodes = config.get("nodes")
        if isinstance(nodes, str):
            nodes = [n.strip() for n in nodes.split(",") if n.strip()]
        etcd = config.get("etcd")
        cluster = config.get("cluster")
        replicas = int(config.get("replicas", 1))
        if etcd is not None or cluster is not None:
            if nodes:
                raise ValueError("kvstash tier: give 'nodes' or 'etcd' with 'cluster', not both")
            if not isinstance(etcd, str) or not isinstance(cluster, str) or not etcd or not cluster:
                raise ValueError(f"kvstash tier: 'etcd' and 'cluster' must both be strings, got "
                                 f"{etcd!r} and {cluster!r}")
        elif not nodes or not all(isinstance(n, str) for n in nodes):
            raise ValueError(f"kvstash tier: 'nodes' must list HOST:PORT strings, got {nodes!r}")
        if replicas < 1:
            raise ValueError(f"kvstash tier: replicas {replicas} is not positive")
        timeout_ms = int(config.get("timeout_ms", 5000))
        if timeout_ms <= 0:
            raise ValueError(f"kvstash tier: timeout_ms {timeout_ms} is not positive")
        ttl_ms = float(config.get("lookup_ttl_ms", 1000))
        wait_ms = float(config.get("lookup_wait_ms", 500))
        workers = int(config.get("workers", 4))
        if ttl_ms < 0 or wait_ms < 0 or workers < 1:
            raise ValueError(f"kvstash tier: lookup_ttl_ms {ttl_ms} and lookup_wait_ms "
                             f"{wait_ms} must be >= 0 and workers {workers} >= 1")
        budget_ms = int(config.get("lookup_budget_ms", 50))
        max_deferrals = int(config.get("max_deferrals", 2))
        failed_ttl_ms = float(config.get("failed_load_ttl_ms", 30000))
        start_check_ms = float(config.get("start_check_ms", 200))
        if budget_ms <= 0 or max_deferrals < 0 or failed_ttl_ms < 0 or start_check_ms < 0:
            raise ValueError(f"kvstash tier: lookup_budget_ms {budget_ms} must be > 0, and "
                             f"max_deferrals {max_deferrals}, failed_load_ttl_ms "
                             f"{failed_ttl_ms} and start_check_ms {start_check_ms} >= 0")

        self._primary_kv_view = primary_kv_view
        self._rows = _primary_rows(primary_kv_view)
        self._row_bytes = self._rows[0].nbytes
        self.namespace = config.get("namespace") or namespace_for(source, self._row_bytes)
        self.nodes = list(nodes or [])
        self._timeout_s = timeout_ms / 1000.0
        self._ttl_s = ttl_ms / 1000.0
        self._wait_s = wait_ms / 1000.0
        self._max_deferrals = max_deferrals
        self._failed_ttl_s = failed_ttl_ms / 1000.0
        self._logged = set()

        self._client = kvstash.Client(self.nodes, namespace=self.namespace,
                                      token_file=config.get("token_file"),
                                      timeout_ms=timeout_ms, tls=config.get("tls"), etcd=etcd,
                                      cluster=cluster, replicas=replicas,
                                      lookup_budget_ms=budget_ms,
                                      block_bytes=self._row_bytes)

        self._lock = threading.Lock()
        # The start check (_check_nodes): None until a node answered; then None or the error
        # that makes the tier unusable (every job fails, every lookup misses).
        self._checked = threading.Event()
        self._unusable = None
        self._control_cv = threading.Condition(self._lock)  # lookups or touches queued
        self._stopping = False
        # key -> (answer, expiry): HIT/MISS until expiry; RETRY is answered once.
        self._answers = {}
        self._deferred = {}  # key -> None answers given in a row
        self._failed = {}  # key -> until when it reads as a miss (its load failed)
        self._last_purge = time.monotonic()
        self._asked = {}  # key -> when first asked, while its batch is queued or in flight
        self._queued = []  # keys for the next batch
        self._touches = collections.deque()  # touch calls (lists of keys), oldest first
        # The jobs submitted and not yet collected from self._jobs, by ticket (vLLM's job ids
        # are its own: a ticket is unique whatever it passes).
        self._running = {}
        self._tickets = itertools.count()
        self._finished = []
        self._jobs = kvstash._kvstash.TierJobs(self._client._c, self._rows, workers)

        self._threads = [threading.Thread(target=self._control_loop, daemon=True,
                                          name="kvstash-tier-lookup")]
        self._threads.append(threading.Thread(target=self._check_nodes, daemon=True,
                                              name="kvstash-tier-check"))
        for t in self._threads:
            t.start()
        if self._checked.wait(start_check_ms / 1000.0) and self._unusable is not None:
            self.shutdown()
            raise self._unusable
        logger.info("kvstash tier: nodes %s, namespace %s, rows of %d bytes", self.nodes,
                    self.namespace, self._row_bytes)

    # --- the SecondaryTierManager contract -------------------------------------------------

    def lookup(self, key, req_context=None):
        """True if the nodes hold `key`, False if not, None: asked, answer next step."""
        now = time.monotonic()
        with self._lock:
            if self._unusable is not None:
                return MISS
            failed = self._failed.get(key)
            if failed is not None:
                if now < failed:
                    return MISS
                del self._failed[key]
            answer = self._answers.get(key)
            if answer is not None:
                state, expiry = answer
                if now < expiry:
                    if state is RETRY:
                        del self._answers[key]
                        return self._defer(key)
                    self._deferred.pop(key, None)
                    return state
                del self._answers[key]
            asked = self._asked.get(key)
            if asked is not None:
                return self._defer(key) if now - asked < self._wait_s else self._undefer(key)
            if self._stopping or len(self._asked) >= _MAX_PENDING_KEYS:
                return self._undefer(key)
            self._asked[key] = now
            self._queued.append(key)
            if len(self._queued) == 1:
                self._control_cv.notify()
            return self._defer(key)

    def _defer(self, key):
        """None ("ask again next step") unless `key` had max_deferrals of them in a row: then a
        miss, so that vLLM computes it. Under the lock."""
        n = self._deferred.get(key, 0)
        if n >= self._max_deferrals:
            return self._undefer(key)
        if len(self._deferred) >= _MAX_PENDING_KEYS:
            self._deferred.clear()
        self._deferred[key] = n + 1
        return RETRY

    def _undefer(self, key):
        self._deferred.pop(key, None)
        return MISS

    def submit_store(self, job_metadata):
        """Queues a put of the primary rows `block_ids` under `keys` (a cascade)."""
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata):
        """Queues a get of `keys` into the primary rows `block_ids` (a promotion)."""
        self._submit(job_metadata, is_load=True)

    def get_finished(self):
        """The jobs finished since the last call, as JobResult(job_id, success)."""
        with self._lock:
            failures = self._collect()
            finished, self._finished = self._finished, []
        self._log_failures(failures)
        return finished

    # Later vLLM versions name it get_finished_jobs.
    get_finished_jobs = get_finished

    def touch(self, keys, req_context=None):
        """Marks `keys` recently used on the nodes (the first the most recent), in background."""
        keys = list(keys)
        if not keys:
            return
        with self._lock:
            if self._stopping:
                return
            if len(self._touches) >= _MAX_PENDING_TOUCHES:
                self._touches.popleft()
                self._log_once(("touch", "dropped"), "kvstash: touches pile up (nodes slow); "
                               "dropping the oldest")
            self._touches.append(keys)
            self._control_cv.notify()

    def on_new_request(self, req_context=None):
        """Later vLLM versions ask each tier how to offload a new request: the default way."""
        return _RequestOffloadingContext() if _RequestOffloadingContext is not None else None

    def has_pending_work(self):
        """Whether jobs are queued, running, or finished and not yet collected."""
        with self._lock:
            failures = self._collect()
            pending = bool(self._running or self._finished)
        self._log_failures(failures)
        return pending

    def drain_jobs(self):
        """Waits until no job is queued or running (each is bounded by timeout_ms)."""
        self._jobs.wait_idle()

    def shutdown(self):
        """Stops the threads, fails queued jobs, closes the client and drops the primary view.

        Waits for running calls (each bounded by timeout_ms). Idempotent.
        """
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._queued.clear()
            self._asked.clear()
            self._touches.clear()
            self._control_cv.notify_all()
        deadline = time.monotonic() + 2 * self._timeout_s + 1.0
        # Queued jobs finish as failed at once; running ones are waited for.
        if not self._jobs.close(2 * self._timeout_s + 1.0):
            logger.warning("kvstash: jobs still wait on the nodes at shutdown; the primary rows "
                           "they use stay referenced")
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            logger.warning("kvstash: threads %s still wait on the nodes at shutdown", stuck)
        with self._lock:
            failures = self._collect()
        self._log_failures(failures)
        self._client.close()
        self._rows = None
        self._primary_kv_view = None

    # --- internals -------------------------------------------------------------------------

    def _log_once(self, kind, message, *args):
        """Warns the first time for `kind`, then only at debug level. Any thread may call it:
        two threads failing at once may both warn, which is harmless."""
        if kind in self._logged:
            logger.debug(message, *args)
        else:
            self._logged.add(kind)
            logger.warning(message, *args)

    def _submit(self, job_metadata, is_load):
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        block_ids = np.asarray(job_metadata.block_ids, dtype=np.int64).reshape(-1)
        error = None
        if len(keys) != len(block_ids):
            error = f"{len(keys)} keys but {len(block_ids)} block ids"
        elif len(block_ids) and (block_ids.min() < 0 or block_ids.max() >= len(self._rows)):
            error = (f"block ids {block_ids.min()}..{block_ids.max()} outside the primary's "
                     f"{len(self._rows)} rows")
        with self._lock:
            if error is None and self._unusable is not None:
                error = str(self._unusable)
            if error is None and not self._stopping and keys:
                ticket = next(self._tickets)
                self._running[ticket] = _Job(job_id, keys, is_load)
                try:
                    # Straight from and into the primary's rows: C++ has them already.
                    self._jobs.submit(ticket, is_load,
                                      [k if type(k) is bytes else bytes(k) for k in keys],
                                      block_ids)
                    return
                except Exception as e:  # a key that is not a key: never raise into vLLM
                    del self._running[ticket]
                    error = str(e)
            if error is not None:
                self._log_once(("submit", "invalid"), "kvstash: job %d refused: %s", job_id,
                               error)
            ok = error is None and not self._stopping
            self._finished.append(JobResult(job_id=job_id, success=ok))

    def _collect(self):
        """Moves the jobs TierJobs finished into self._finished and applies what they tell the
        lookups. Returns the failures to log (outside the lock). Under the lock."""
        failures = []
        for ticket, code, message in self._jobs.finished():
            job = self._running.pop(ticket, None)
            if job is None:  # refused at submit, and reported then
                continue
            ok = code is None
            self._finished.append(JobResult(job_id=job.job_id, success=ok))
            if not job.is_load:
                # A miss answered before the store is stale now: ask the nodes again.
                for key in job.keys:
                    self._answers.pop(key, None)
            if ok:
                continue
            if not (self._stopping and code == "CANCELLED"):
                failures.append((job, code, message))
            # The nodes failed us: forget every answer, so lookups ask them again rather than
            # promise blocks they may no longer serve; and a failed load's keys read as misses
            # for a while, so vLLM computes them rather than promote them again from a node
            # that fails them.
            self._answers.clear()
            if job.is_load:
                until = time.monotonic() + self._failed_ttl_s
                if len(self._failed) + len(job.keys) > _MAX_FAILED_KEYS:
                    self._failed = {k: t for k, t in self._failed.items()
                                    if t > time.monotonic()}
                for key in job.keys:
                    if len(self._failed) < _MAX_FAILED_KEYS:
                        self._failed[key] = until
        return failures

    def _log_failures(self, failures):
        for job, code, message in failures:
            operation = "load" if job.is_load else "store"
            self._log_once((operation, code), "kvstash: %s of job %d (%d blocks) failed: %s: %s",
                           operation, job.job_id, len(job.keys), code, message)

    def _check_nodes(self):
        """The start check: asks the nodes for their block size (which also checks the token)
        until one answers, then says whether the tier can work."""
        delay = 0.05
        while True:
            with self._lock:
                if self._stopping:
                    return
            try:
                block_bytes = self._client.block_bytes()
            except kvstash.Error as e:
                sized = re.search(r"stores blocks of (\d+) bytes", e.message)
                if e.code == "FAILED_PRECONDITION" and sized:
                    self._set_unusable(self._size_error(int(sized.group(1))))
                    return
                if e.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"):
                    self._set_unusable(type(e)(
                        f"kvstash tier: the nodes refuse this tier: {e.message}"))
                    return
                self._log_once(("check", "unreachable"), "kvstash: cannot ask %s for its block "
                               "size yet (%s); asking again", self.nodes or "the cluster", e)
            except Exception as e:  # never let the check's failure escape
                self._log_once(("check", type(e).__name__), "kvstash: block size check: %r", e)
            else:
                if block_bytes != self._row_bytes:
                    self._set_unusable(self._size_error(block_bytes))
                else:
                    self._checked.set()
                return
            with self._lock:
                if self._stopping:
                    return
                self._control_cv.wait(delay)
            delay = min(delay * 2, 2.0)

    def _size_error(self, block_bytes):
        return ValueError(f"kvstash: the nodes store blocks of {block_bytes} bytes but vLLM's "
                          f"primary rows are {self._row_bytes} bytes: start kvstashd with "
                          f"--block-bytes {self._row_bytes}")

    def _set_unusable(self, error):
        with self._lock:
            self._unusable = error
        logger.error("%s; every job fails and every lookup misses", error)
        self._checked.set()

    def _control_loop(self):
        while True:
            with self._lock:
                while not (self._queued or self._touches or self._stopping):
                    self._control_cv.wait()
                if self._stopping:
                    return
            time.sleep(_GATHER_S)
            with self._lock:
                batch, self._queued = self._queued, []
                touches = list(self._touches)
                self._touches.clear()
            if batch:
                self._resolve(batch)
            if touches:
                self._send_touches(touches)

    def _resolve(self, batch):
        try:
            states = self._client.lookup(batch)
        except Exception as e:  # the client reads unreachable nodes as misses; this is worse
            self._log_once(("lookup", getattr(e, "code", type(e).__name__)),
                           "kvstash: lookup of %d keys failed: %s", len(batch), e)
            states = [kvstash.KeyState.MISS] * len(batch)
        now = time.monotonic()
        expiry = now + self._ttl_s
        answer_of = {kvstash.KeyState.HIT: HIT, kvstash.KeyState.MISS: MISS}
        with self._lock:
            if self._stopping:
                return
            for key in batch:
                self._asked.pop(key, None)
            for key, state in zip(batch, states):
                self._answers[key] = (answer_of.get(state, RETRY), expiry)
            if now - self._last_purge > self._ttl_s:
                self._last_purge = now
                self._answers = {k: a for k, a in self._answers.items() if a[1] > now}

    def _send_touches(self, touches):
        keys = _merge_touches(touches)
        try:
            self._client.touch([k if type(k) is bytes else bytes(k) for k in keys])
        except Exception as e:
            self._log_once(("touch", getattr(e, "code", type(e).__name__)),
                           "kvstash: touch of %d keys failed: %s", len(keys), e)
