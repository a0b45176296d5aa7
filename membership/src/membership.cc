#include "kvstash/membership/membership.h"

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>
#include <utility>

#include "kvstash/common/logging.h"

namespace kvstash::membership {
namespace {

using Json = nlohmann::json;
using std::chrono::milliseconds;

constexpr milliseconds kRetry{1000};

// Deletes and revokes get this long at a stop, so a node stops promptly with etcd down.
constexpr milliseconds kStopTimeout{1000};

}  // namespace

Status ValidateClusterName(std::string_view cluster) {
  if (cluster.empty() || cluster.size() > 64) {
    return InvalidArgumentError("cluster name '{}': 1 to 64 characters", cluster);
  }
  for (const char c : cluster) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return InvalidArgumentError("cluster name '{}': only letters, digits, '.', '_' and '-'",
                                  cluster);
    }
  }
  return Status::OK();
}

Result<std::string> AdvertisedAddress(std::string_view advertise, std::string_view listen,
                                      uint16_t port) {
  std::string host(advertise);
  std::string port_text = std::to_string(port);
  if (!host.empty()) {
    const size_t colon = host.rfind(':');
    if (colon != std::string::npos && host.find(':') == colon) {  // HOST:PORT (not bare IPv6)
      port_text = host.substr(colon + 1);
      host = host.substr(0, colon);
      int value = 0;
      auto [end, error] =
          std::from_chars(port_text.data(), port_text.data() + port_text.size(), value);
      if (error != std::errc() || end != port_text.data() + port_text.size() || value <= 0 ||
          value > 65535) {
        return InvalidArgumentError("bad port in '{}'", advertise);
      }
    }
    if (host.empty()) return InvalidArgumentError("no host in '{}'", advertise);
  } else {
    host = std::string(listen);
    if (host == "0.0.0.0" || host == "::" || host.empty()) {
      return InvalidArgumentError("listening on every address ({}), no address to publish",
                                  host.empty() ? std::string("any") : host);
    }
  }
  return host + ":" + port_text;
}

std::string MembersPrefix(std::string_view cluster, MemberKind kind) {
  return fmt::format("/kvstash/{}/{}/", cluster, kind == MemberKind::kNode ? "nodes" : "workers");
}

std::string NodeRecord::ToJson() const {
  Json json{{"address", address},     {"block_bytes", block_bytes}, {"cpu_bytes", cpu_bytes},
            {"ssd_bytes", ssd_bytes}, {"policy", policy},           {"zone", zone}};
  // Written only when set: a record without them reads as before they existed.
  if (!kv_events.empty()) json["kv_events"] = kv_events;
  if (!kv_events_replay.empty()) json["kv_events_replay"] = kv_events_replay;
  if (!role.empty()) json["role"] = role;
  return json.dump();
}

Result<NodeRecord> NodeRecord::FromJson(std::string_view json) {
  Json parsed = Json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || !parsed.is_object()) {
    return InvalidArgumentError("node record is not a JSON object: {}", json.substr(0, 200));
  }
  NodeRecord record;
  try {
    record.address = parsed.value("address", std::string());
    record.block_bytes = parsed.value("block_bytes", uint64_t{0});
    record.cpu_bytes = parsed.value("cpu_bytes", uint64_t{0});
    record.ssd_bytes = parsed.value("ssd_bytes", uint64_t{0});
    record.policy = parsed.value("policy", std::string());
    record.zone = parsed.value("zone", std::string());
    record.kv_events = parsed.value("kv_events", std::string());
    record.kv_events_replay = parsed.value("kv_events_replay", std::string());
    record.role = parsed.value("role", std::string());
  } catch (const Json::exception& e) {
    return InvalidArgumentError("node record {}: {}", json.substr(0, 200), e.what());
  }
  if (record.address.empty()) {
    return InvalidArgumentError("node record without an address: {}", json.substr(0, 200));
  }
  return record;
}

// ---- Registration ----------------------------------------------------------------------------

Result<std::unique_ptr<Registration>> Registration::Create(RegistrationOptions options) {
  KVSTASH_RETURN_IF_ERROR(ValidateClusterName(options.cluster));
  if (options.record.address.empty()) return InvalidArgumentError("no address to advertise");
  if (options.ttl_s < 2) {
    return InvalidArgumentError("etcd lease TTL of {} s (2 at least)", options.ttl_s);
  }
  auto etcd = EtcdClient::Create(options.etcd);
  if (!etcd.ok()) return etcd.status();
  auto registration =
      std::unique_ptr<Registration>(new Registration(std::move(options), std::move(*etcd)));
  registration->thread_ = std::thread([self = registration.get()] { self->Run(); });
  return registration;
}

Registration::Registration(RegistrationOptions options, std::unique_ptr<EtcdClient> etcd)
    : options_(std::move(options)),
      key_(MembersPrefix(options_.cluster, options_.kind) + options_.record.address),
      etcd_(std::move(etcd)) {}

Registration::~Registration() { Stop(); }

bool Registration::Sleep(milliseconds duration) {
  MutexLock lock(&mu_);
  const auto until = std::chrono::steady_clock::now() + duration;
  while (!stopping_) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) break;
    cv_.WaitFor(&mu_, until - now);
  }
  return !stopping_;
}

void Registration::Failed(const Status& status, std::string_view what) {
  bool first = false;
  {
    MutexLock lock(&mu_);
    ++stats_.errors;
    first = stats_.last_error.empty();
    stats_.last_error = status.ToString();
  }
  // Once per outage: the retries every second would flood the log.
  if (first) {
    KVSTASH_LOG_WARN("etcd: {} failed, serving on and retrying every {} ms: {}", what,
                     kRetry.count(), status.ToString());
  }
}

void Registration::Run() {
  const milliseconds refresh{options_.ttl_s * 1000 / 3};
  int64_t lease = 0;
  auto last_refresh = std::chrono::steady_clock::now();
  milliseconds wait = refresh;  // until the next refresh: a third of the TTL, a second if failing
  while (true) {
    {
      MutexLock lock(&mu_);
      if (stopping_) return;
    }
    if (lease == 0) {
      auto granted = etcd_->GrantLease(options_.ttl_s);
      if (!granted.ok()) {
        Failed(granted.status(), "granting a lease");
        if (!Sleep(kRetry)) return;
        continue;
      }
      const Status put = etcd_->Put(key_, options_.record.ToJson(), *granted);
      if (!put.ok()) {
        Failed(put, fmt::format("writing {}", key_));
        if (!Sleep(kRetry)) return;
        continue;
      }
      lease = *granted;
      last_refresh = std::chrono::steady_clock::now();
      uint64_t count = 0;
      {
        MutexLock lock(&mu_);
        lease_ = lease;
        stats_.registered = true;
        count = ++stats_.registrations;
        stats_.last_error.clear();
      }
      KVSTASH_LOG_INFO("etcd: registered as {} at {} (lease {:x}, TTL {} s){}", key_,
                       etcd_->endpoint(), lease, options_.ttl_s,
                       count > 1 ? fmt::format(", registration {}", count) : std::string());
    }
    if (!Sleep(wait)) return;
    auto ttl = etcd_->KeepAlive(lease);
    wait = refresh;
    if (ttl.ok()) {
      last_refresh = std::chrono::steady_clock::now();
      bool recovered = false;
      {
        MutexLock lock(&mu_);
        recovered = !stats_.last_error.empty();
        stats_.last_error.clear();
        stats_.registered = true;
      }
      if (recovered) KVSTASH_LOG_INFO("etcd: reachable again at {}", etcd_->endpoint());
      continue;
    }
    if (ttl.status().code() == StatusCode::kNotFound) {
      KVSTASH_LOG_WARN("etcd: lease {:x} of {} expired; registering again", lease, key_);
      lease = 0;
      MutexLock lock(&mu_);
      lease_ = 0;
      stats_.registered = false;
      continue;
    }
    Failed(ttl.status(), "refreshing the lease");
    if (std::chrono::steady_clock::now() - last_refresh > std::chrono::seconds(options_.ttl_s)) {
      MutexLock lock(&mu_);
      stats_.registered = false;  // etcd has let the lease go by now
    }
    wait = std::min(kRetry, refresh);
  }
}

void Registration::Stop() {
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
  int64_t lease = 0;
  {
    MutexLock lock(&mu_);
    lease = lease_;
  }
  if (lease == 0) return;
  EtcdOptions quick = options_.etcd;
  quick.timeout = std::min(quick.timeout, kStopTimeout);
  auto etcd = EtcdClient::Create(quick);
  if (!etcd.ok()) return;
  auto deleted = (*etcd)->Delete(key_);
  const Status revoked = (*etcd)->RevokeLease(lease);
  if (!deleted.ok()) {
    KVSTASH_LOG_WARN("etcd: could not delete {} at stop ({}); it goes when its lease expires", key_,
                     deleted.status().ToString());
  } else {
    KVSTASH_LOG_INFO("etcd: deleted {}", key_);
  }
  (void)revoked;
  MutexLock lock(&mu_);
  stats_.registered = false;
  lease_ = 0;
}

RegistrationStats Registration::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

// ---- MembershipWatcher -----------------------------------------------------------------------

Result<std::unique_ptr<MembershipWatcher>> MembershipWatcher::Create(WatcherOptions options,
                                                                     OnChange on_change) {
  KVSTASH_RETURN_IF_ERROR(ValidateClusterName(options.cluster));
  auto etcd = EtcdClient::Create(options.etcd);
  if (!etcd.ok()) return etcd.status();
  auto watcher = std::unique_ptr<MembershipWatcher>(
      new MembershipWatcher(std::move(options), std::move(*etcd), std::move(on_change)));
  // The first read, retried until its deadline: a client starting with etcd down says so.
  const auto give_up = std::chrono::steady_clock::now() + watcher->options_.first_read_timeout;
  Result<int64_t> revision = watcher->ReadAll();
  while (!revision.ok() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(milliseconds(200));
    revision = watcher->ReadAll();
  }
  if (!revision.ok()) {
    return Status(revision.status().code(),
                  fmt::format("reading the members of cluster '{}' from etcd: {}",
                              watcher->options_.cluster, revision.status().message()));
  }
  watcher->notify_.store(true);
  watcher->thread_ = std::thread([self = watcher.get(), rev = *revision] { self->Run(rev); });
  return watcher;
}

MembershipWatcher::MembershipWatcher(WatcherOptions options, std::unique_ptr<EtcdClient> etcd,
                                     OnChange on_change)
    : options_(std::move(options)),
      prefix_(MembersPrefix(options_.cluster, options_.kind)),
      etcd_(std::move(etcd)),
      on_change_(std::move(on_change)) {}

MembershipWatcher::~MembershipWatcher() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    cv_.SignalAll();
  }
  // A watch still opening its connection misses one stop: stop until the thread is done.
  while (thread_.joinable() && !done_.load()) {
    etcd_->StopWatches();
    std::this_thread::sleep_for(milliseconds(5));
  }
  if (thread_.joinable()) thread_.join();
}

Result<int64_t> MembershipWatcher::ReadAll() {
  auto range = etcd_->GetPrefix(prefix_);
  if (!range.ok()) return range.status();
  std::map<std::string, NodeRecord> next;
  for (const KeyValue& kv : range->kvs) {
    auto record = NodeRecord::FromJson(kv.value);
    if (!record.ok()) {
      KVSTASH_LOG_WARN("etcd: ignoring {}: {}", kv.key, record.status().ToString());
      continue;
    }
    next.emplace(kv.key, std::move(*record));
  }
  Apply(std::move(next));
  return range->revision;
}

void MembershipWatcher::Apply(std::map<std::string, NodeRecord> next) {
  std::vector<NodeRecord> members;
  {
    MutexLock lock(&mu_);
    uint64_t changed = 0;
    for (const auto& [key, record] : members_) {
      auto it = next.find(key);
      if (it == next.end()) {
        KVSTASH_LOG_INFO("cluster {}: {} {} left", options_.cluster,
                         options_.kind == MemberKind::kNode ? "node" : "worker", record.address);
        ++changed;
      } else if (!(it->second == record)) {
        KVSTASH_LOG_INFO("cluster {}: {} {} changed", options_.cluster,
                         options_.kind == MemberKind::kNode ? "node" : "worker", record.address);
        ++changed;
      }
    }
    // The first read's members are the start, not joins: one line for them, at debug.
    const bool first = !notify_.load();
    for (const auto& [key, record] : next) {
      if (members_.count(key) == 0) {
        if (!first) {
          KVSTASH_LOG_INFO("cluster {}: {} {} joined", options_.cluster,
                           options_.kind == MemberKind::kNode ? "node" : "worker", record.address);
        }
        ++changed;
      }
    }
    if (first) {
      KVSTASH_LOG_DEBUG("cluster {}: {} live node(s) at the first read", options_.cluster,
                        next.size());
    }
    if (changed == 0) return;
    stats_.changes += changed;
    members_ = std::move(next);
    for (const auto& [key, record] : members_) members.push_back(record);
  }
  std::sort(members.begin(), members.end(),
            [](const NodeRecord& a, const NodeRecord& b) { return a.address < b.address; });
  if (on_change_ && notify_.load()) on_change_(members);
}

void MembershipWatcher::Run(int64_t revision) {
  bool failing = false;
  while (true) {
    {
      MutexLock lock(&mu_);
      if (stopping_) break;
    }
    std::map<std::string, NodeRecord> current;
    {
      MutexLock lock(&mu_);
      current = members_;
    }
    const Status watched = etcd_->Watch(
        prefix_, revision + 1,
        [&](const WatchEvent& event) {
          revision = std::max(revision, event.kv.mod_revision);
          if (event.type == WatchEvent::Type::kDelete) {
            current.erase(event.kv.key);
          } else {
            auto record = NodeRecord::FromJson(event.kv.value);
            if (!record.ok()) {
              KVSTASH_LOG_WARN("etcd: ignoring {}: {}", event.kv.key, record.status().ToString());
              return;
            }
            current[event.kv.key] = std::move(*record);
          }
          Apply(current);
        },
        [&] {
          MutexLock lock(&mu_);
          stats_.connected = true;
          if (failing) KVSTASH_LOG_INFO("etcd: watching {} again", prefix_);
          failing = false;
        });
    {
      MutexLock lock(&mu_);
      stats_.connected = false;
      if (stopping_) break;
    }
    if (watched.code() != StatusCode::kOutOfRange) {
      {
        MutexLock lock(&mu_);
        ++stats_.errors;
      }
      if (!failing) {
        KVSTASH_LOG_WARN(
            "etcd: the watch of {} ended, keeping the last {} members and retrying: {}", prefix_,
            members().size(), watched.ToString());
      }
      failing = true;
      MutexLock lock(&mu_);
      if (stopping_) break;
      cv_.WaitFor(&mu_, kRetry);
      if (stopping_) break;
    }
    // Read the set again (changes missed while the watch was down), and watch from there.
    Result<int64_t> read = ReadAll();
    if (read.ok()) {
      revision = *read;
    } else {
      MutexLock lock(&mu_);
      ++stats_.errors;
    }
  }
  done_.store(true);
}

std::vector<NodeRecord> MembershipWatcher::members() const {
  std::vector<NodeRecord> members;
  {
    MutexLock lock(&mu_);
    for (const auto& [key, record] : members_) members.push_back(record);
  }
  std::sort(members.begin(), members.end(),
            [](const NodeRecord& a, const NodeRecord& b) { return a.address < b.address; });
  return members;
}

WatcherStats MembershipWatcher::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace kvstash::membership
