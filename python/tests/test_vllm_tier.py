"""KvstashSecondaryTier driven as vLLM's TieringOffloadingManager drives it, against kvstashd.

The manager polls get_finished() once per engine step, asks lookup() once per key (None: ask
again next step), submits one submit_load() per request at the end of a step for the keys that
answered True, and one submit_store() per secondary tier when blocks land in the primary. Here a
step is a short sleep; every wait is bounded.
"""

import collections
import mmap
import sys
import time
import types

import numpy as np
import pytest

import kvstash
from kvstash import vllm as tier_module
from kvstash.vllm import HIT, MISS, RETRY, JobMetadata, KvstashSecondaryTier

ReqContext = collections.namedtuple("ReqContext", ["req_id", "kv_transfer_params"])
STEP_S = 0.005
BLOCK_BYTES = 4096  # the nodes' --block-bytes (conftest.BASE_ARGS)


def make_keys(n, prefix=b"req"):
    return [kvstash.key(prefix + i.to_bytes(8, "big"), 0) for i in range(n)]


def make_primary(num_blocks=8, seed=0):
    """The primary tier's rows, (num_blocks, block bytes), filled with random bytes."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(num_blocks, BLOCK_BYTES), dtype=np.uint8)


class Manager:
    """The calls TieringOffloadingManager makes on one secondary tier."""

    def __init__(self, tier):
        self.tier = tier
        self.next_job_id = 0
        self.results = {}
        self.ctx = ReqContext("req-0", None)

    def step(self):
        """An engine step's poll of finished jobs."""
        for result in self.tier.get_finished():
            assert result.job_id not in self.results, f"job {result.job_id} finished twice"
            self.results[result.job_id] = result.success
        time.sleep(STEP_S)

    def _job(self, keys, block_ids, is_promotion):
        job_id = self.next_job_id
        self.next_job_id += 1
        job = JobMetadata(job_id=job_id, keys=list(keys),
                          block_ids=np.array(block_ids, dtype=np.int64),
                          is_promotion=is_promotion, req_context=self.ctx)
        (self.tier.submit_load if is_promotion else self.tier.submit_store)(job)
        return job_id

    def cascade(self, keys, block_ids):
        return self._job(keys, block_ids, is_promotion=False)

    def promote(self, keys, block_ids):
        return self._job(keys, block_ids, is_promotion=True)

    def wait_job(self, job_id, timeout=5.0):
        deadline = time.monotonic() + timeout
        while job_id not in self.results:
            assert time.monotonic() < deadline, f"job {job_id} did not finish in {timeout} s"
            self.step()
        return self.results[job_id]

    def lookup_until_decided(self, key, timeout=5.0):
        """Asks once per step until the answer is not "ask again"; returns every answer."""
        answers = []
        deadline = time.monotonic() + timeout
        while True:
            answers.append(self.tier.lookup(key, self.ctx))
            if answers[-1] is not RETRY:
                return answers
            assert time.monotonic() < deadline, f"lookup undecided after {timeout} s"
            self.step()


@pytest.fixture
def make_tier():
    """make_tier(node_or_nodes, primary, **config): a tier shut down at teardown."""
    tiers = []

    def make(node, primary, **config):
        nodes = [n.address for n in node] if isinstance(node, list) else [node.address]
        config.setdefault("namespace", "test")
        # Hits are counted exactly: the budget is the deadline (tests of the budget set it), and
        # the start check waits for the node.
        config.setdefault("lookup_budget_ms", config.get("timeout_ms", 5000))
        config.setdefault("start_check_ms", 10_000)
        config.setdefault("max_deferrals", 1000)  # a slow batch is waited for, never a miss
        tier = KvstashSecondaryTier(None, memoryview(primary) if isinstance(primary, np.ndarray)
                                    else primary, "kvstash", nodes=nodes, **config)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.shutdown()


def node_counter(node, name):
    with kvstash.Client([node.address]) as client:
        return client.stats()["nodes"][node.address][name]


def test_cascade_store_reports_success(node, make_tier):
    primary = make_primary()
    manager = Manager(make_tier(node, primary))
    job = manager.cascade(make_keys(3), [0, 1, 2])
    assert manager.wait_job(job) is True
    assert node_counter(node, "cpu.resident_blocks") == 3
    assert manager.tier.get_finished() == []
    assert not manager.tier.has_pending_work()


def test_drain_jobs_returns_once_every_job_has_a_result(node, make_tier):
    primary = make_primary()
    tier = make_tier(node, primary)
    manager = Manager(tier)
    jobs = [manager.cascade(make_keys(2, b"drain%d" % i), [2 * i, 2 * i + 1]) for i in range(4)]
    tier.drain_jobs()
    assert sorted(r.job_id for r in tier.get_finished() if r.success) == jobs
    assert not tier.has_pending_work()


def test_lookup_answers_none_then_true(node, make_tier):
    primary = make_primary()
    manager = Manager(make_tier(node, primary))
    keys = make_keys(2)
    assert manager.wait_job(manager.cascade(keys[:1], [0])) is True

    stored = manager.lookup_until_decided(keys[0])
    absent = manager.lookup_until_decided(keys[1])
    # The first call never waits on the node; the answer arrives by a later step.
    assert stored[0] is RETRY and stored[-1] is HIT
    assert absent[0] is RETRY and absent[-1] is MISS
    # Answered from the batch's result, without asking again.
    assert manager.tier.lookup(keys[0], manager.ctx) is HIT


def test_submit_load_fills_other_primary_slots(node, make_tier):
    primary = make_primary(num_blocks=8, seed=1)
    manager = Manager(make_tier(node, primary))
    keys = make_keys(3)
    assert manager.wait_job(manager.cascade(keys, [0, 1, 2])) is True
    for key in keys:
        assert manager.lookup_until_decided(key)[-1] is HIT
    primary[4:7] = 0
    assert manager.wait_job(manager.promote(keys, [6, 4, 5])) is True
    np.testing.assert_array_equal(primary[6], primary[0])
    np.testing.assert_array_equal(primary[4], primary[1])
    np.testing.assert_array_equal(primary[5], primary[2])


def test_touch_reaches_the_nodes_arc_policy(start_node, make_tier):
    node = start_node("--cpu-policy", "arc")
    primary = make_primary()
    manager = Manager(make_tier(node, primary))
    keys = make_keys(3)
    assert manager.wait_job(manager.cascade(keys, [0, 1, 2])) is True
    assert node_counter(node, "cpu.arc_t2_blocks") == 0
    manager.tier.touch(keys, manager.ctx)  # returns at once; the background thread sends it
    deadline = time.monotonic() + 5.0
    while node_counter(node, "cpu.arc_t2_blocks") < 3:
        assert time.monotonic() < deadline, "the touch never reached the node"
        time.sleep(STEP_S)


def test_touches_of_a_moment_merge_last_call_first():
    merged = tier_module._merge_touches([[b"a", b"b"], [b"c", b"a"], [b"d"]])
    assert merged == [b"d", b"c", b"a", b"b"]


def test_node_killed_mid_job_fails_the_job_then_lookups_miss(node, make_tier):
    primary = make_primary()
    manager = Manager(make_tier(node, primary, timeout_ms=1000))
    keys = make_keys(3)
    assert manager.wait_job(manager.cascade(keys, [0, 1, 2])) is True
    for key in keys:
        assert manager.lookup_until_decided(key)[-1] is HIT

    node.pause()
    job = manager.promote(keys[:2], [4, 5])
    time.sleep(0.1)  # the job waits on the stalled node
    node.kill()
    assert manager.wait_job(job) is False
    # Nothing raises; every answer given before the failure is forgotten, also for keys[2],
    # which no failed job named.
    for key in keys:
        assert manager.lookup_until_decided(key)[-1] is MISS
    assert manager.wait_job(manager.cascade(keys, [0, 1, 2])) is False


def test_lookup_storm_never_waits_on_a_stalled_node(node, make_tier):
    primary = make_primary()
    manager = Manager(make_tier(node, primary, timeout_ms=2000))
    assert manager.lookup_until_decided(make_keys(1, b"warm")[0])[-1] is MISS  # connected
    keys = make_keys(10_000)
    node.pause()
    try:
        start = time.perf_counter()
        answers = [manager.tier.lookup(key, manager.ctx) for key in keys]
        manager.tier.touch(keys[:100], manager.ctx)
        manager.tier.get_finished()
        elapsed = time.perf_counter() - start
    finally:
        node.resume()
    print(f"10000 lookups against a stalled node: {elapsed:.3f} s")
    assert elapsed < 0.5, f"10000 lookups took {elapsed:.3f} s against a 2 s timeout"
    assert set(answers) <= {RETRY, MISS} and RETRY in answers


def test_key_waiting_past_lookup_wait_reads_as_miss(node, make_tier):
    primary = make_primary()
    manager = Manager(make_tier(node, primary, timeout_ms=2000, lookup_wait_ms=100))
    assert manager.lookup_until_decided(make_keys(1, b"warm")[0])[-1] is MISS
    key = make_keys(1)[0]
    node.pause()
    try:
        assert manager.tier.lookup(key, manager.ctx) is RETRY
        time.sleep(0.15)
        assert manager.tier.lookup(key, manager.ctx) is MISS
    finally:
        node.resume()


def test_invalid_jobs_fail_without_raising(node, make_tier):
    primary = make_primary(num_blocks=4)
    manager = Manager(make_tier(node, primary))
    keys = make_keys(2)
    mismatched = manager.cascade(keys, [0])
    out_of_range = manager.promote(keys, [0, 4])
    negative = manager.cascade(keys, [-1, 0])
    empty = manager.promote([], [])
    assert manager.wait_job(mismatched) is False
    assert manager.wait_job(out_of_range) is False
    assert manager.wait_job(negative) is False
    assert manager.wait_job(empty) is True
    # A load of blocks no node holds fails too.
    assert manager.wait_job(manager.promote(keys, [0, 1])) is False


def test_namespaces_keep_blocks_apart(node, make_tier):
    primary = make_primary()
    a = Manager(make_tier(node, primary, namespace="model-a"))
    b = Manager(make_tier(node, primary, namespace="model-b"))
    keys = make_keys(1)
    assert a.wait_job(a.cascade(keys, [0])) is True
    assert a.lookup_until_decided(keys[0])[-1] is HIT
    assert b.lookup_until_decided(keys[0])[-1] is MISS


def test_shutdown_lets_the_primary_release_its_mapping(node, make_tier):
    # vLLM's primary is a memoryview over an mmap, closed after the tiers shut down.
    num_blocks = 4
    region = mmap.mmap(-1, num_blocks * BLOCK_BYTES)
    view = memoryview(region).cast("B", (num_blocks, BLOCK_BYTES))
    view[0, 0] = 7
    manager = Manager(make_tier(node, view))
    keys = make_keys(1)
    assert manager.wait_job(manager.cascade(keys, [0])) is True
    assert manager.wait_job(manager.promote(keys, [1])) is True
    assert view[1, 0] == 7
    manager.tier.shutdown()
    view.release()
    region.close()  # BufferError if the tier still held the rows


def test_block_size_other_than_the_row_size_is_refused(node):
    primary = np.zeros((4, 2 * BLOCK_BYTES), dtype=np.uint8)
    with pytest.raises(ValueError, match=f"--block-bytes {2 * BLOCK_BYTES}"):
        KvstashSecondaryTier(None, memoryview(primary), "kvstash", nodes=[node.address],
                             start_check_ms=10_000)


def test_a_wrong_token_is_refused_at_start(start_node, tmp_path):
    node = start_node("--auth-token", "right")
    token_file = tmp_path / "token"
    token_file.write_text("wrong\n")
    with pytest.raises(kvstash.Error, match="refuse this tier"):
        KvstashSecondaryTier(None, memoryview(make_primary()), "kvstash", nodes=[node.address],
                             token_file=str(token_file), start_check_ms=10_000)


def test_a_stopped_node_at_start_is_no_error_and_no_wait(node):
    """The constructor waits at most start_check_ms for the first answer; a node that answers
    later with another block size makes every job fail and every lookup miss."""
    primary = np.zeros((4, 2 * BLOCK_BYTES), dtype=np.uint8)
    node.pause()
    try:
        start = time.monotonic()
        tier = KvstashSecondaryTier(None, memoryview(primary), "kvstash", nodes=[node.address],
                                    namespace="test", start_check_ms=100, timeout_ms=1000)
        # Generous against the 100 ms it may wait: the point is it never waits for the node.
        assert time.monotonic() - start < 5.0
    finally:
        node.resume()
    try:
        manager = Manager(tier)
        deadline = time.monotonic() + 20
        while tier._unusable is None:  # the check thread asks until the node answers
            assert time.monotonic() < deadline, "the node's block size was never checked"
            time.sleep(0.01)
        assert "--block-bytes" in str(tier._unusable)
        assert manager.wait_job(manager.cascade(make_keys(1), [0])) is False
        assert tier.lookup(make_keys(1)[0], manager.ctx) is MISS
    finally:
        tier.shutdown()


class FailingLoads:
    """The tier's jobs, but every load fails (a node that holds blocks it cannot serve)."""

    def __init__(self, jobs):
        self._jobs = jobs
        self._failed = []
        self.gets = 0

    def submit(self, ticket, is_load, keys, block_ids):
        if not is_load:
            return self._jobs.submit(ticket, is_load, keys, block_ids)
        self.gets += 1
        self._failed.append((ticket, "UNAVAILABLE", "loads fail here"))

    def finished(self):
        failed, self._failed = self._failed, []
        return self._jobs.finished() + failed

    def __getattr__(self, name):
        return getattr(self._jobs, name)


def test_a_load_that_always_fails_is_computed_within_the_bound(node, make_tier):
    """The node says HIT, every promotion fails: after one failed load the keys read MISS, so
    the request is computed, within 3 steps of its first lookup (before, the tier forgot its
    answers, the node said HIT again, and vLLM promoted it again, every step)."""
    primary = make_primary()
    tier = make_tier(node, primary, max_deferrals=2)
    manager = Manager(tier)
    keys = make_keys(4)
    assert manager.wait_job(manager.cascade(keys, [0, 1, 2, 3])) is True
    failing = FailingLoads(tier._jobs)
    tier._jobs = failing
    steps = 0
    computed = False
    while not computed:
        steps += 1
        assert steps <= 50, "the request was never computed"
        answers = [tier.lookup(key, manager.ctx) for key in keys]
        if MISS in answers:
            computed = True
        elif all(a is HIT for a in answers):
            assert manager.wait_job(manager.promote(keys, [4, 5, 6, 7])) is False
        manager.step()
    # One promotion at most (none when a slow machine's batch passed max_deferrals first).
    assert failing.gets <= 1, f"{failing.gets} promotions of a load that always fails"
    # Steps answered None (ask again), at most max_deferrals (2), the promotion's, and the
    # step that computes: whatever the machine's speed.
    assert steps <= 4, f"computed after {steps} steps"


def test_a_key_reads_none_at_most_max_deferrals_times(node, make_tier):
    primary = make_primary()
    manager = Manager(make_tier(node, primary, timeout_ms=2000, lookup_wait_ms=60_000,
                                max_deferrals=2))
    assert manager.lookup_until_decided(make_keys(1, b"warm")[0])[-1] is MISS  # connected
    key = make_keys(1)[0]
    node.pause()
    try:
        answers = [manager.tier.lookup(key, manager.ctx) for _ in range(3)]
    finally:
        node.resume()
    assert answers == [RETRY, RETRY, MISS]


def test_config_errors_are_refused():
    primary = make_primary()
    with pytest.raises(ValueError, match="unknown config keys"):
        KvstashSecondaryTier(None, primary, "kvstash", nodes=["127.0.0.1:1"], timeout=5)
    with pytest.raises(ValueError, match="nodes"):
        KvstashSecondaryTier(None, primary, "kvstash")
    with pytest.raises(ValueError, match="shape"):
        KvstashSecondaryTier(None, np.zeros(16, np.uint8), "kvstash", nodes=["127.0.0.1:1"])
    with pytest.raises(ValueError, match="not both"):
        KvstashSecondaryTier(None, primary, "kvstash", nodes=["127.0.0.1:1"],
                             etcd="http://127.0.0.1:1", cluster="c")
    with pytest.raises(ValueError, match="'etcd' and 'cluster'"):
        KvstashSecondaryTier(None, primary, "kvstash", etcd="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="replicas"):
        KvstashSecondaryTier(None, primary, "kvstash", nodes=["127.0.0.1:1"], replicas=0)


def test_a_tier_follows_a_cluster_in_etcd(start_node, etcd):
    node = start_node("--etcd", etcd, "--cluster", "tier")
    primary = make_primary()
    tier = KvstashSecondaryTier(None, primary, "kvstash", etcd=etcd, cluster="tier", replicas=1)
    deadline = time.monotonic() + 5
    while not tier._client.stats()["nodes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tier._client.stats()["nodes"]) == [node.address]
    tier.shutdown()


def test_default_namespace_fingerprints_model_and_layout():
    def config(model="org/model-a", block_size=16, layers=32):
        hf = types.SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=8, head_dim=128)
        return types.SimpleNamespace(
            model_config=types.SimpleNamespace(model=model, revision=None, dtype="bfloat16",
                                               hf_text_config=hf),
            cache_config=types.SimpleNamespace(block_size=block_size, cache_dtype="auto"),
            parallel_config=types.SimpleNamespace(tensor_parallel_size=1))

    base = tier_module.namespace_for(config(), 4096)
    assert base.startswith("vllm-")
    assert base == tier_module.namespace_for(config(), 4096)
    # An OffloadingSpec holding the VllmConfig gives the same namespace.
    assert base == tier_module.namespace_for(types.SimpleNamespace(vllm_config=config()), 4096)
    assert base != tier_module.namespace_for(config(model="org/model-b"), 4096)
    assert base != tier_module.namespace_for(config(block_size=32), 4096)
    assert base != tier_module.namespace_for(config(layers=40), 4096)
    assert base != tier_module.namespace_for(config(), 8192)
    # Whatever is missing is left out, never an error.
    assert tier_module.namespace_for(None, 4096).startswith("vllm-")
    assert tier_module.namespace_for(types.SimpleNamespace(model_config=None), 4096)


def test_register_adds_the_tier_to_vllms_factory(monkeypatch):
    registered = {}

    class SecondaryTierFactory:
        _registry = registered

        @classmethod
        def register_tier(cls, tier_type, module_path, class_name):
            if tier_type in cls._registry:
                raise ValueError(f"Tier '{tier_type}' is already registered.")
            cls._registry[tier_type] = (module_path, class_name)

    names = ["vllm", "vllm.v1", "vllm.v1.kv_offload", "vllm.v1.kv_offload.tiering",
             "vllm.v1.kv_offload.tiering.factory"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].SecondaryTierFactory = SecondaryTierFactory

    tier_module.register()
    tier_module.register()  # plugins may load twice in one process
    assert registered == {"kvstash": ("kvstash.vllm", "KvstashSecondaryTier")}


def test_register_without_vllm_does_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    assert tier_module.register() is None


def test_promotions_as_the_manager_runs_them(node, make_tier):
    """Four requests of 16 blocks each, held by the node, promoted into a 64-row primary."""
    primary = make_primary(num_blocks=128, seed=2)
    manager = Manager(make_tier(node, primary))
    requests = {f"req-{r}": make_keys(16, b"r%d" % r) for r in range(4)}
    source = {}
    for r, keys in enumerate(requests.values()):
        slots = list(range(16 * r, 16 * r + 16))
        assert manager.wait_job(manager.cascade(keys, slots)) is True
        source.update(zip(keys, slots))
    tier = make_tier(node, primary)  # a fresh tier: nothing asked yet, no connection reused
    calls_before = tier._client.stats()["client"]["calls"]

    lookup_calls = None
    promoted = {}  # key -> primary slot it was promoted into
    free_slots = iter(range(64, 128))
    jobs = {}
    deadline = time.monotonic() + 5.0
    while len(promoted) < 64 or jobs:
        assert time.monotonic() < deadline, f"{len(promoted)} of 64 promoted"
        for result in tier.get_finished():  # the once-per-step poll
            assert result.success is True
            jobs.pop(result.job_id)
        pending = {}
        for req_id, keys in requests.items():  # maximal-prefix scans: None counts as a hit
            for key in keys:
                if key in promoted:
                    continue
                answer = tier.lookup(key, ReqContext(req_id, None))
                if answer is MISS:
                    break
                if answer is HIT:  # prepare_write in the primary, load at the step's end
                    promoted[key] = next(free_slots)
                    pending.setdefault(req_id, []).append(key)
        if pending and lookup_calls is None:  # answers came, no load sent yet
            lookup_calls = tier._client.stats()["client"]["calls"] - calls_before
        for req_id, keys in pending.items():  # one submit_load per request
            job_id = 1000 + len(jobs) + len(promoted)
            jobs[job_id] = keys
            tier.submit_load(JobMetadata(job_id=job_id, keys=keys,
                                         block_ids=np.array([promoted[k] for k in keys]),
                                         is_promotion=True, req_context=ReqContext(req_id, None)))
        time.sleep(STEP_S)

    for key, slot in promoted.items():
        np.testing.assert_array_equal(primary[slot], primary[source[key]])
    # The 64 keys asked in the first step went to the node in one batch or a few, not one call
    # each.
    assert lookup_calls < 8, f"{lookup_calls} lookup calls for 64 keys"


def test_a_stopped_node_leaves_the_other_nodes_keys_to_hit_within_steps(start_node, make_tier):
    """Two nodes, one stopped (SIGSTOP): keys of the healthy node still read HIT within a few
    scheduler steps, and no tier call of a step waits on the network (before, a lookup batch
    waited for the stopped node's 5 s deadline: about 200 steps of 25 ms). Counts steps, with
    generous bounds; prints the figures."""
    nodes = [start_node(), start_node()]
    primary = make_primary(num_blocks=64)
    tier = make_tier(nodes, primary, timeout_ms=5000, lookup_budget_ms=20)
    manager = Manager(tier)
    rounds, per_round = 12, 8
    keys = make_keys(rounds * per_round * 3)  # each node holds about half
    for start in range(0, len(keys), 32):
        chunk = keys[start:start + 32]
        assert manager.wait_job(manager.cascade(chunk, list(range(len(chunk))))) is True
    with kvstash.Client([nodes[0].address], namespace="test") as first:
        on_first = [s == kvstash.KeyState.HIT for s in first.lookup(keys)]
    healthy = [k for k, hit in zip(keys, on_first) if hit]
    stopped = [k for k, hit in zip(keys, on_first) if not hit]
    assert len(healthy) >= rounds * per_round and len(stopped) >= rounds * per_round, \
        "the keys did not spread over the two nodes"
    nodes[1].pause()
    steps_to_hit, call_ms = [], []
    try:
        for r in range(rounds):
            # One step asks keys of both nodes, as requests spanning them make vLLM do: they
            # travel in one batch.
            batch = healthy[r * per_round:(r + 1) * per_round]
            other = stopped[r * per_round:(r + 1) * per_round]
            steps = 0
            while True:
                steps += 1
                assert steps <= 40, f"round {r}: healthy keys undecided after {steps} steps"
                t = time.perf_counter()
                answers = [tier.lookup(k, manager.ctx) for k in batch]
                others = [tier.lookup(k, manager.ctx) for k in other]
                tier.get_finished()
                call_ms.append((time.perf_counter() - t) * 1000)
                assert HIT not in others, f"round {r}: the stopped node's keys read HIT"
                if all(a is HIT for a in answers):
                    break
                time.sleep(0.025)  # a scheduler step
            steps_to_hit.append(steps)
    finally:
        nodes[1].resume()
    call_ms.sort()
    p99 = call_ms[min(len(call_ms) - 1, int(0.99 * len(call_ms)))]
    skipped = tier._client.stats()["client"]["skipped_calls"]
    print(f"steps to HIT per round {steps_to_hit}; tier calls per step p99 {p99:.3f} ms; "
          f"skipped calls {skipped}")
    assert skipped > 0, "the stopped node was never skipped"
    assert p99 < 100, f"a step's tier calls took {p99:.1f} ms (p99)"


def test_a_job_stalled_on_a_node_holds_up_no_job_on_another(start_node, make_tier):
    """Three loads wait on a stopped node (more than the two job threads the tier had); a load
    from the other node, submitted after them, finishes while they still wait (before, it
    queued behind them until they failed). Each job is reported as it finishes."""
    nodes = [start_node(), start_node()]
    primary = make_primary(num_blocks=64)
    tier = make_tier(nodes, primary, timeout_ms=10_000)
    manager = Manager(tier)
    keys = make_keys(32)
    assert manager.wait_job(manager.cascade(keys, list(range(32)))) is True
    with kvstash.Client([nodes[0].address], namespace="test") as first:
        on_first = [s == kvstash.KeyState.HIT for s in first.lookup(keys)]
    stalled = [k for k, hit in zip(keys, on_first) if hit]
    healthy = [k for k, hit in zip(keys, on_first) if not hit]
    assert len(stalled) >= 3 and healthy, "the keys did not spread over the two nodes"
    nodes[0].pause()
    try:
        waiting = {manager.promote([stalled[i]], [32 + i]) for i in range(3)}
        other = manager.promote(healthy[:1], [40])
        assert manager.wait_job(other) is True
        assert not waiting & set(manager.results), "a load of the stopped node finished first"
    finally:
        nodes[0].resume()
    for job in waiting:  # they end: read once the node is back, or failed on its probe
        manager.wait_job(job, timeout=15.0)
    np.testing.assert_array_equal(primary[40], primary[keys.index(healthy[0])])


def test_jobs_run_while_the_scheduler_holds_the_gil(node, make_tier):
    """vLLM's scheduler thread holds the GIL for most of a step. A store runs to its end while
    this thread holds it throughout (the switch interval raised so that it never hands it over):
    no job takes the GIL to start or to finish (before, job threads were Python threads)."""
    primary = make_primary()
    tier = make_tier(node, primary)
    manager = Manager(tier)
    assert manager.wait_job(manager.cascade(make_keys(1, b"warm"), [0])) is True  # connected
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        job = manager.cascade(make_keys(4), [0, 1, 2, 3])
        finished = []
        deadline = time.monotonic() + 10.0
        while not finished and time.monotonic() < deadline:
            # Pure Python and C++ that keeps the GIL: it is never released here.
            finished = tier.get_finished()
    finally:
        sys.setswitchinterval(interval)
    assert [(r.job_id, r.success) for r in finished] == [(job, True)], \
        "the store did not run while the scheduler held the GIL"


def test_shutdown_fails_queued_jobs_and_waits_for_running_ones(node, make_tier):
    """One job thread, its job waiting on a stopped node, two more queued: shutdown reports
    the queued ones failed, waits for the running one, reports each job once, and gives the
    primary's memory back."""
    num_blocks = 8
    region = mmap.mmap(-1, num_blocks * BLOCK_BYTES)
    view = memoryview(region).cast("B", (num_blocks, BLOCK_BYTES))
    tier = make_tier(node, view, workers=1, timeout_ms=2000)
    manager = Manager(tier)
    keys = make_keys(3)
    assert manager.wait_job(manager.cascade(keys, [0, 1, 2])) is True
    node.pause()
    try:
        jobs = [manager.promote([key], [4 + i]) for i, key in enumerate(keys)]
        deadline = time.monotonic() + 5.0
        while tier._jobs.busy() != 3:  # the first taken, two queued
            assert time.monotonic() < deadline
            time.sleep(0.001)
        tier.shutdown()
    finally:
        node.resume()
    results = {}
    for result in tier.get_finished():
        assert result.job_id not in results, f"job {result.job_id} reported twice"
        results[result.job_id] = result.success
    assert set(results) == set(jobs)
    assert results[jobs[1]] is False and results[jobs[2]] is False
    assert not tier.has_pending_work()
    view.release()
    region.close()  # BufferError if the tier still held the rows
