// kvstash._kvstash: the C++ side of the Python package. A thin binding of connector::NodeClient
// (python/kvstash/__init__.py wraps it in the documented API): keys arrive as bytes, block
// buffers as buffer-protocol objects whose memory is handed to the client as is (no copy in
// Python or here), and the GIL is released while a call waits on the nodes. Errors become the
// Python exceptions kvstash/__init__.py defines (one per status code), with the C++ message.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/client_counters.h"
#include "kvstash/common/hash.h"
#include "kvstash/common/status.h"
#include "kvstash/common/token_file.h"
#include "kvstash/connector/node_client.h"
#include "tier_jobs.h"

namespace py = pybind11;

namespace kvstash::python {
namespace {

// Makes the exception for a status: kvstash._error_for(code_name, message), set at import.
py::object& ErrorFactory() {
  static py::object* factory = new py::object();  // never destroyed: outlives the interpreter
  return *factory;
}

[[noreturn]] void Raise(const Status& status) {
  const std::string name(StatusCodeName(status.code()));
  const std::string message(status.message());
  if (!ErrorFactory()) throw std::runtime_error(name + ": " + message);
  py::object error = ErrorFactory()(name, message);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw py::error_already_set();
}

// vLLM's OffloadKey packing: block hash bytes, then the group index as 4 big-endian bytes. The
// hash bytes (any length) become the key's 128-bit hash by xxh3-128; the group is kept as is.
BlockKey KeyOf(const py::handle& object) {
  if (!PyBytes_Check(object.ptr())) {
    Raise(InvalidArgumentError("a key is bytes (hash bytes + 4-byte big-endian group), not {}",
                               std::string(py::str(py::type::of(object).attr("__name__")))));
  }
  char* data = nullptr;
  Py_ssize_t size = 0;
  PyBytes_AsStringAndSize(object.ptr(), &data, &size);
  if (size <= 4) {
    Raise(InvalidArgumentError(
        "a key of {} bytes: a key is at least 1 hash byte followed by a 4-byte group", size));
  }
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  const size_t hash_bytes = static_cast<size_t>(size) - 4;
  const auto* group = reinterpret_cast<const uint8_t*>(data + hash_bytes);
  BlockKey key;
  key.hash = Xxh3Hash128(std::span(bytes, hash_bytes));
  key.group = (uint32_t{group[0]} << 24) | (uint32_t{group[1]} << 16) | (uint32_t{group[2]} << 8) |
              uint32_t{group[3]};
  return key;
}

std::vector<BlockKey> KeysOf(const py::sequence& keys) {
  std::vector<BlockKey> out;
  out.reserve(keys.size());
  for (const py::handle& k : keys) out.push_back(KeyOf(k));
  return out;
}

// A buffer-protocol object's memory, held (and the object kept alive) until released with the
// GIL held.
class HeldBuffer {
 public:
  HeldBuffer(const py::handle& object, bool writable) {
    const int flags = writable ? PyBUF_CONTIG : PyBUF_CONTIG_RO;
    if (PyObject_GetBuffer(object.ptr(), &view_, flags) != 0) {
      PyErr_Clear();
      Raise(InvalidArgumentError(
          "a block buffer must be a C-contiguous{} buffer (bytes, bytearray, memoryview, a "
          "numpy array; a torch tensor through .numpy()), not {}",
          writable ? ", writable" : "",
          std::string(py::str(py::type::of(object).attr("__name__")))));
    }
    held_ = true;
  }
  HeldBuffer(HeldBuffer&& other) noexcept : view_(other.view_), held_(other.held_) {
    other.held_ = false;
  }
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  HeldBuffer& operator=(HeldBuffer&&) = delete;
  ~HeldBuffer() {
    if (held_) PyBuffer_Release(&view_);
  }

  // A strided view (for the primary's rows), writable.
  struct Strided {};
  HeldBuffer(const py::handle& object, Strided) {
    if (PyObject_GetBuffer(object.ptr(), &view_, PyBUF_RECORDS) != 0) {
      PyErr_Clear();
      Raise(InvalidArgumentError("the primary's rows must be a writable buffer, not {}",
                                 std::string(py::str(py::type::of(object).attr("__name__")))));
    }
    held_ = true;
  }

  std::span<std::byte> bytes() const {
    return {static_cast<std::byte*>(view_.buf), static_cast<size_t>(view_.len)};
  }
  const Py_buffer& view() const { return view_; }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

std::vector<HeldBuffer> BuffersOf(const py::sequence& buffers, size_t expected, bool writable) {
  if (buffers.size() != expected) {
    Raise(InvalidArgumentError("{} keys but {} buffers", expected, buffers.size()));
  }
  std::vector<HeldBuffer> out;
  out.reserve(buffers.size());
  for (const py::handle& b : buffers) out.emplace_back(b, writable);
  return out;
}

// The outcome of a put or a get: the first error, or the bytes read per key.
struct Outcome {
  Status status;
  std::vector<size_t> lengths;
};

Outcome RunPut(connector::NodeClient* client, const std::vector<BlockKey>& keys,
               const std::vector<HeldBuffer>& buffers) {
  std::vector<transport::Bytes> blocks;
  blocks.reserve(buffers.size());
  for (const HeldBuffer& b : buffers) blocks.push_back(b.bytes());
  return {client->Put(keys, blocks), {}};
}

Outcome RunGet(connector::NodeClient* client, const std::vector<BlockKey>& keys,
               const std::vector<HeldBuffer>& buffers) {
  std::vector<transport::MutableBytes> outs;
  outs.reserve(buffers.size());
  for (const HeldBuffer& b : buffers) outs.push_back(b.bytes());
  Outcome outcome;
  std::vector<Result<size_t>> got = client->Get(keys, outs);
  for (size_t i = 0; i < got.size(); ++i) {
    if (!got[i].ok()) {
      if (outcome.status.ok()) {
        outcome.status =
            Status(got[i].status().code(),
                   fmt::format("key {} of {}: {}", i, got.size(), got[i].status().message()));
      }
      outcome.lengths.push_back(0);
    } else {
      outcome.lengths.push_back(*got[i]);
    }
  }
  return outcome;
}

py::object Finish(const Outcome& outcome, bool is_get) {
  if (!outcome.status.ok()) Raise(outcome.status);
  if (!is_get) return py::none();
  return py::cast(outcome.lengths);
}

// A put or get running on a thread of its own; the buffers stay held until it is done and the
// handle goes. The client stays alive as long as the handle.
class Handle {
 public:
  Handle(std::shared_ptr<connector::NodeClient> client, std::vector<BlockKey> keys,
         std::vector<HeldBuffer> buffers, bool is_get)
      : client_(std::move(client)),
        keys_(std::move(keys)),
        buffers_(std::move(buffers)),
        is_get_(is_get) {
    future_ = std::async(std::launch::async, [this] {
      return is_get_ ? RunGet(client_.get(), keys_, buffers_)
                     : RunPut(client_.get(), keys_, buffers_);
    });
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() {
    if (future_.valid()) {
      py::gil_scoped_release release;
      future_.wait();
    }
  }

  bool done() const {
    return outcome_ || future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  // True once done; false when `timeout` (seconds) passed first. None: no limit.
  bool wait(std::optional<double> timeout) const {
    if (outcome_) return true;
    py::gil_scoped_release release;
    if (!timeout) {
      future_.wait();
      return true;
    }
    const auto limit = std::chrono::duration<double>(std::max(0.0, *timeout));
    return future_.wait_for(limit) == std::future_status::ready;
  }
  // Waits, then raises the call's error or returns its result (get: the bytes per key), the
  // same every time.
  py::object result() {
    if (!outcome_) {
      {
        py::gil_scoped_release release;
        future_.wait();
      }
      outcome_ = future_.get();
    }
    return Finish(*outcome_, is_get_);
  }

 private:
  std::shared_ptr<connector::NodeClient> client_;
  const std::vector<BlockKey> keys_;
  const std::vector<HeldBuffer> buffers_;
  const bool is_get_;
  std::future<Outcome> future_;
  std::optional<Outcome> outcome_;
};

class Client {
 public:
  Client(const std::vector<std::string>& nodes, const std::string& key_namespace,
         const std::optional<std::string>& token, const std::optional<std::string>& token_file,
         int64_t timeout_ms, const std::optional<std::string>& tls,
         const std::optional<std::string>& etcd, const std::optional<std::string>& cluster,
         int64_t replicas, int64_t lookup_budget_ms, int64_t block_bytes) {
    connector::NodeClientOptions options;
    if (nodes.empty() && !etcd) {
      Raise(InvalidArgumentError("nodes: at least one HOST:PORT, or etcd and cluster"));
    }
    if (replicas < 1) Raise(InvalidArgumentError("replicas: {} is not positive", replicas));
    connector::NodeSource source;
    source.nodes = nodes;
    source.etcd = etcd.value_or("");
    source.cluster = cluster.value_or("");
    source.replicas = static_cast<size_t>(replicas);
    if (Status s = connector::ApplyNodeSource(source, &options); !s.ok()) {
      // The Python names of the flags.
      std::string message(s.message());
      for (auto [flag, arg] : {std::pair{"--node(s)", "nodes"},
                               {"--etcd", "etcd"},
                               {"--cluster", "cluster"},
                               {"--replicas", "replicas"}}) {
        for (size_t at; (at = message.find(flag)) != std::string::npos;) {
          message.replace(at, std::string_view(flag).size(), arg);
        }
      }
      Raise(Status(s.code(), message));
    }
    if (key_namespace.empty()) Raise(InvalidArgumentError("namespace: empty"));
    options.key_namespace = key_namespace;
    Result<std::string> resolved =
        ResolveToken(token.value_or(""), "token", token_file.value_or(""), "token_file");
    if (!resolved.ok()) Raise(resolved.status());
    options.auth_token = *resolved;
    if (timeout_ms <= 0) Raise(InvalidArgumentError("timeout_ms: {} is not positive", timeout_ms));
    options.timeout = std::chrono::milliseconds(timeout_ms);
    options.connect_timeout = std::min(options.connect_timeout, options.timeout);
    if (lookup_budget_ms <= 0) {
      Raise(InvalidArgumentError("lookup_budget_ms: {} is not positive", lookup_budget_ms));
    }
    options.lookup_budget = std::chrono::milliseconds(lookup_budget_ms);
    if (block_bytes < 0) Raise(InvalidArgumentError("block_bytes: {} is negative", block_bytes));
    options.block_bytes = static_cast<uint64_t>(block_bytes);
    options.transport.tls = tls.value_or("");
    Result<std::unique_ptr<connector::NodeClient>> client = InternalError("not created");
    {
      py::gil_scoped_release release;
      client = connector::NodeClient::Create(std::move(options));
    }
    if (!client.ok()) Raise(client.status());
    client_ = std::shared_ptr<connector::NodeClient>(std::move(*client));
  }

  // A node's refusal (a wrong token, a namespace it does not serve) raises, as every other call
  // does; keys of a node that cannot be reached read as misses (counted in stats()).
  std::vector<LookupResult> Results(const py::sequence& keys) {
    const std::vector<BlockKey> k = KeysOf(keys);
    const std::shared_ptr<connector::NodeClient> client = Get();
    Result<std::vector<LookupResult>> results = InternalError("not run");
    {
      py::gil_scoped_release release;
      results = client->LookupStrict(k);
    }
    if (!results.ok()) Raise(results.status());
    return std::move(*results);
  }

  // The connector's scans (kvstash/common/block_key.h) over one batched lookup: a number of
  // keys, or None for "ask again".
  std::optional<size_t> PrefixLookup(const py::sequence& keys) {
    const std::vector<LookupResult> r = Results(keys);
    return MaximalPrefix(r.size(), [&r](size_t i) { return r[i]; });
  }
  std::optional<size_t> WindowLookup(const py::sequence& keys, size_t window) {
    const std::vector<LookupResult> r = Results(keys);
    return SlidingWindow(r.size(), window, [&r](size_t i) { return r[i]; });
  }

  std::vector<int> Lookup(const py::sequence& keys) {
    const std::vector<LookupResult> results = Results(keys);
    std::vector<int> out;
    out.reserve(results.size());
    for (LookupResult r : results) out.push_back(static_cast<int>(r));
    return out;
  }

  void Put(const py::sequence& keys, const py::sequence& buffers) {
    const std::vector<BlockKey> k = KeysOf(keys);
    const std::vector<HeldBuffer> held = BuffersOf(buffers, k.size(), /*writable=*/false);
    const std::shared_ptr<connector::NodeClient> client = Get();
    Outcome outcome;
    {
      py::gil_scoped_release release;
      outcome = RunPut(client.get(), k, held);
    }
    Finish(outcome, false);
  }

  py::object GetBlocks(const py::sequence& keys, const py::sequence& buffers) {
    const std::vector<BlockKey> k = KeysOf(keys);
    const std::vector<HeldBuffer> held = BuffersOf(buffers, k.size(), /*writable=*/true);
    const std::shared_ptr<connector::NodeClient> client = Get();
    Outcome outcome;
    {
      py::gil_scoped_release release;
      outcome = RunGet(client.get(), k, held);
    }
    return Finish(outcome, true);
  }

  std::unique_ptr<Handle> Async(const py::sequence& keys, const py::sequence& buffers,
                                bool is_get) {
    std::vector<BlockKey> k = KeysOf(keys);
    std::vector<HeldBuffer> held = BuffersOf(buffers, k.size(), is_get);
    return std::make_unique<Handle>(Get(), std::move(k), std::move(held), is_get);
  }

  void Touch(const py::sequence& keys) {
    const std::vector<BlockKey> k = KeysOf(keys);
    const std::shared_ptr<connector::NodeClient> client = Get();
    Status status;
    {
      py::gil_scoped_release release;
      status = client->TouchSync(k);
    }
    if (!status.ok()) Raise(status);
  }

  uint64_t BlockBytes() {
    const std::shared_ptr<connector::NodeClient> client = Get();
    Result<uint64_t> bytes = InternalError("not asked");
    {
      py::gil_scoped_release release;
      const std::vector<connector::NodeAddress> nodes = client->nodes();
      bytes = nodes.empty() ? Result<uint64_t>(UnavailableError("no live offload node to ask"))
                            : client->BlockBytes(nodes.front());
    }
    if (!bytes.ok()) Raise(bytes.status());
    return *bytes;
  }

  py::dict Stats() {
    const std::shared_ptr<connector::NodeClient> client = Get();
    py::dict own;
    // Every counter of the client's registry (kvstash/common/client_counters.h) by its name.
    client->counters().ForEach(
        [&own](const ClientCounterDef& def, uint64_t value) { own[def.name] = value; });
    own["replicas"] = client->replicas();
    py::dict nodes;
    // The members now (a followed cluster's may change meanwhile: one that left is an error).
    for (const connector::NodeAddress& node : client->nodes()) {
      Result<std::map<std::string, uint64_t>> stats = InternalError("not asked");
      {
        py::gil_scoped_release release;
        stats = client->Stats(node);
      }
      const std::string name = node.ToString();
      if (stats.ok()) {
        nodes[py::str(name)] = py::cast(*stats);
      } else {
        py::dict error;
        error["error"] = stats.status().ToString();
        nodes[py::str(name)] = error;
      }
    }
    py::dict out;
    out["client"] = own;
    out["nodes"] = nodes;
    return out;
  }

  // Waits for the asynchronous touches in flight, then disconnects. Idempotent; handles still
  // running keep the connections until they are done.
  void Close() {
    if (!client_) return;
    std::shared_ptr<connector::NodeClient> client = std::move(client_);
    py::gil_scoped_release release;
    client->WaitForTouches();
    client.reset();
  }

  bool closed() const { return client_ == nullptr; }

  // The client, for objects that use it after this one closes.
  std::shared_ptr<connector::NodeClient> node_client() const { return Get(); }

 private:
  // The client, kept alive for the call even if another thread closes this one meanwhile.
  std::shared_ptr<connector::NodeClient> Get() const {
    if (!client_) Raise(FailedPreconditionError("the client is closed"));
    return client_;
  }

  std::shared_ptr<connector::NodeClient> client_;
};

// TierJobs over the primary's rows, a 2-D buffer held from construction until close() found no
// job running (held for good when one still ran: it writes into them).
class PyTierJobs {
 public:
  PyTierJobs(const Client& client, const py::handle& rows, size_t threads)
      : rows_(std::make_unique<HeldBuffer>(rows, HeldBuffer::Strided{})) {
    const Py_buffer& v = rows_->view();
    if (v.ndim != 2 || v.shape[0] <= 0 || v.shape[1] <= 0) {
      Raise(
          InvalidArgumentError("the primary's rows have {} dimension(s) (shape {}); expected "
                               "(num_blocks, row)",
                               v.ndim, v.ndim >= 1 ? v.shape[0] : 0));
    }
    const auto row_bytes = static_cast<size_t>(v.shape[1] * v.itemsize);
    if (v.strides[1] != v.itemsize || v.strides[0] < static_cast<Py_ssize_t>(row_bytes)) {
      Raise(
          InvalidArgumentError("the primary's rows are not contiguous rows (strides {}, {} "
                               "for items of {} bytes)",
                               v.strides[0], v.strides[1], v.itemsize));
    }
    if (v.readonly) Raise(InvalidArgumentError("the primary's rows are read-only"));
    if (threads == 0) Raise(InvalidArgumentError("threads: 0; at least 1"));
    Rows r{static_cast<std::byte*>(v.buf), static_cast<size_t>(v.shape[0]),
           static_cast<size_t>(v.strides[0]), row_bytes};
    jobs_ = std::make_unique<TierJobs>(client.node_client(), r, threads);
  }
  PyTierJobs(const PyTierJobs&) = delete;
  PyTierJobs& operator=(const PyTierJobs&) = delete;
  // Never waits: jobs still running keep the rows (see the class comment).
  ~PyTierJobs() { Close(0.0); }

  void Submit(uint64_t ticket, bool is_load, const py::sequence& keys,
              const std::vector<int64_t>& rows) {
    std::vector<size_t> at;
    at.reserve(rows.size());
    for (int64_t r : rows) {
      if (r < 0) Raise(InvalidArgumentError("row {} is negative", r));
      at.push_back(static_cast<size_t>(r));
    }
    if (Status s = jobs_->Submit(ticket, is_load, KeysOf(keys), std::move(at)); !s.ok()) {
      Raise(s);
    }
  }

  // [(ticket, None or the error's code name, message)] of the jobs finished since the last call.
  py::list Finished() {
    py::list out;
    for (const TierJobs::Finished& f : jobs_->TakeFinished()) {
      if (f.status.ok()) {
        out.append(py::make_tuple(f.ticket, py::none(), ""));
      } else {
        out.append(py::make_tuple(f.ticket, std::string(StatusCodeName(f.status.code())),
                                  std::string(f.status.message())));
      }
    }
    return out;
  }

  size_t Busy() const { return jobs_->Busy(); }

  void WaitIdle() const {
    py::gil_scoped_release release;
    jobs_->WaitIdle();
  }

  // Stops: queued jobs finish as cancelled (finished() has them); waits up to `timeout`
  // seconds for running ones. True when none runs: the rows are released then. Idempotent.
  bool Close(double timeout) {
    bool done = false;
    {
      py::gil_scoped_release release;
      done = jobs_->Close(std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(std::max(0.0, timeout))));
    }
    if (done) {
      rows_.reset();
    } else {
      (void)rows_.release();  // a running job writes into them: never given back
    }
    return done;
  }

 private:
  std::unique_ptr<HeldBuffer> rows_;
  std::unique_ptr<TierJobs> jobs_;
};

}  // namespace
}  // namespace kvstash::python

PYBIND11_MODULE(_kvstash, m) {
  using namespace kvstash::python;
  m.doc() = "kvstash's C++ client (use the kvstash package, not this module)";
  m.def(
      "_set_error_factory", [](py::object factory) { ErrorFactory() = std::move(factory); },
      "Sets the callable (code_name, message) -> exception that errors are raised with.");
  m.def(
      "key_hash",
      [](const py::bytes& key) {
        const kvstash::BlockKey k = KeyOf(key);
        return py::make_tuple(k.hash.lo, k.hash.hi, k.group);
      },
      "The (hash_lo, hash_hi, group) a key maps to.");

  m.def(
      "client_counters",
      [] {
        py::list out;
        for (const kvstash::ClientCounterDef& def : kvstash::kClientCounterDefs) {
          py::dict row;
          row["name"] = def.name;
          row["help"] = def.help;
          row["kind"] = def.kind == kvstash::CounterKind::kCounter ? "counter" : "gauge";
          out.append(row);
        }
        return out;
      },
      "The client's counter registry: [{name, help, kind}], the keys of stats()['client'].");

  py::class_<Handle>(m, "Handle")
      .def("done", &Handle::done)
      .def("wait", &Handle::wait, py::arg("timeout") = py::none())
      .def("result", &Handle::result);

  py::class_<PyTierJobs>(m, "TierJobs")
      .def(py::init<const Client&, const py::handle&, size_t>(), py::arg("client"), py::arg("rows"),
           py::arg("threads"))
      .def("submit", &PyTierJobs::Submit)
      .def("finished", &PyTierJobs::Finished)
      .def("busy", &PyTierJobs::Busy)
      .def("wait_idle", &PyTierJobs::WaitIdle)
      .def("close", &PyTierJobs::Close, py::arg("timeout"));

  py::class_<Client>(m, "Client")
      .def(py::init<const std::vector<std::string>&, const std::string&,
                    const std::optional<std::string>&, const std::optional<std::string>&, int64_t,
                    const std::optional<std::string>&, const std::optional<std::string>&,
                    const std::optional<std::string>&, int64_t, int64_t, int64_t>(),
           py::arg("nodes"), py::arg("namespace"), py::arg("token"), py::arg("token_file"),
           py::arg("timeout_ms"), py::arg("tls"), py::arg("etcd") = py::none(),
           py::arg("cluster") = py::none(), py::arg("replicas") = 1,
           py::arg("lookup_budget_ms") = 50, py::arg("block_bytes") = 0)
      .def("lookup", &Client::Lookup)
      .def("prefix_lookup", &Client::PrefixLookup)
      .def("window_lookup", &Client::WindowLookup)
      .def("put", &Client::Put)
      .def("get", &Client::GetBlocks)
      .def("put_async", [](Client& c, const py::sequence& keys,
                           const py::sequence& buffers) { return c.Async(keys, buffers, false); })
      .def("get_async", [](Client& c, const py::sequence& keys,
                           const py::sequence& buffers) { return c.Async(keys, buffers, true); })
      .def("touch", &Client::Touch)
      .def("block_bytes", &Client::BlockBytes)
      .def("stats", &Client::Stats)
      .def("close", &Client::Close)
      .def_property_readonly("closed", &Client::closed);
}
