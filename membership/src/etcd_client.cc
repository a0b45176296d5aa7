#include "kvstash/membership/etcd_client.h"

#include <httplib.h>
#include <openssl/evp.h>

#include <charconv>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>

#include "kvstash/common/logging.h"

namespace kvstash::membership {
namespace {

using Json = nlohmann::json;

std::string Base64(std::string_view bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3), '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(bytes.data()),
                                static_cast<int>(bytes.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

Result<std::string> FromBase64(std::string_view text) {
  if (text.size() % 4 != 0) return InvalidArgumentError("base64 of {} characters", text.size());
  std::string out(3 * text.size() / 4, '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(text.data()),
                                static_cast<int>(text.size()));
  if (n < 0) return InvalidArgumentError("malformed base64 from etcd");
  size_t size = static_cast<size_t>(n);
  // EVP_DecodeBlock counts the padding's zero bytes.
  if (!text.empty() && text.back() == '=') --size;
  if (text.size() >= 2 && text[text.size() - 2] == '=') --size;
  out.resize(size);
  return out;
}

// The first key after every key that starts with `prefix` (etcd's range_end for a prefix).
std::string PrefixEnd(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    auto& last = reinterpret_cast<unsigned char&>(end.back());
    if (last < 0xff) {
      ++last;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

// etcd's JSON spells int64 as strings (proto3 JSON) and leaves out zero values. Anything else
// (not a number, out of range, another type) throws std::invalid_argument: the response is
// malformed, and Parsing turns that into an error.
int64_t Int(const Json& object, const char* name) {
  if (!object.is_object()) throw std::invalid_argument(fmt::format("{} of a non-object", name));
  auto it = object.find(name);
  if (it == object.end() || it->is_null()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    const std::string& text = it->get_ref<const std::string&>();
    int64_t value = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (error == std::errc() && end == text.data() + text.size() && !text.empty()) return value;
  }
  throw std::invalid_argument(fmt::format("{} is {}", name, it->dump().substr(0, 64)));
}

// Runs `parse` over a response body: what a malformed body makes the JSON library (a field of
// another type) or Int throw is etcd's answer being wrong, never a reason to end the process
// (this runs on the watcher's thread too): Unavailable naming it.
template <typename Parse>
auto Parsing(std::string_view what, Parse&& parse) -> decltype(parse()) {
  try {
    return parse();
  } catch (const std::exception& e) {
    return UnavailableError("etcd {}: a malformed response ({})", what, e.what());
  }
}

Result<KeyValue> ParseKeyValue(const Json& kv) {
  KeyValue out;
  auto key = FromBase64(kv.value("key", ""));
  if (!key.ok()) return key.status();
  auto value = FromBase64(kv.value("value", ""));
  if (!value.ok()) return value.status();
  out.key = std::move(*key);
  out.value = std::move(*value);
  out.mod_revision = Int(kv, "mod_revision");
  out.lease = Int(kv, "lease");
  return out;
}

// An error object of the gateway ({"error": ..., "code": N, "message": ...}) as a Status.
Status GatewayError(const Json& error, std::string_view what) {
  return Parsing(what, [&]() -> Status {
    const int64_t code = Int(error, "code");
    std::string message = error.value("message", error.value("error", std::string("no message")));
    const auto status_code =
        code > 0 && code <= 16 ? static_cast<StatusCode>(code) : StatusCode::kUnknown;
    return Status(status_code, fmt::format("etcd {}: {}", what, message));
  });
}

struct Endpoint {
  std::string host;
  int port = 0;
};

Result<Endpoint> SplitEndpoint(std::string_view url) {
  std::string_view rest = url;
  if (rest.rfind("http://", 0) == 0) rest.remove_prefix(7);
  if (rest.rfind("https://", 0) == 0) {
    return InvalidArgumentError("etcd endpoint {}: https is not supported (plain http only)", url);
  }
  while (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  const size_t colon = rest.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == rest.size()) {
    return InvalidArgumentError("etcd endpoint {}: expected http://HOST:PORT", url);
  }
  Endpoint endpoint;
  endpoint.host = std::string(rest.substr(0, colon));
  try {
    size_t used = 0;
    const std::string port(rest.substr(colon + 1));
    endpoint.port = std::stoi(port, &used);
    if (used != port.size() || endpoint.port <= 0 || endpoint.port > 65535) throw 0;
  } catch (...) {
    return InvalidArgumentError("etcd endpoint {}: bad port", url);
  }
  return endpoint;
}

// A client of `url` (checked by EtcdClient::Create) with `timeout` for connecting, reading and
// writing.
std::unique_ptr<httplib::Client> MakeClient(const std::string& url,
                                            std::chrono::milliseconds timeout) {
  const Endpoint endpoint = *SplitEndpoint(url);
  auto client = std::make_unique<httplib::Client>(endpoint.host, endpoint.port);
  const auto s = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(timeout - s);
  client->set_connection_timeout(s.count(), us.count());
  client->set_read_timeout(s.count(), us.count());
  client->set_write_timeout(s.count(), us.count());
  return client;
}

// A POST of JSON `body` to `path` whose response body goes to `receiver` as it arrives.
httplib::Request JsonPost(std::string_view path, std::string body,
                          httplib::ContentReceiverWithProgress receiver) {
  httplib::Request request;
  request.method = "POST";
  request.path = std::string(path);
  request.body = std::move(body);
  request.set_header("Content-Type", "application/json");
  request.content_receiver = std::move(receiver);
  return request;
}

}  // namespace

Result<std::vector<std::string>> ParseEtcdEndpoints(std::string_view list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = list.find(',', start);
    std::string_view item = list.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (item.empty()) return InvalidArgumentError("etcd endpoints '{}': an empty entry", list);
    auto endpoint = SplitEndpoint(item);
    if (!endpoint.ok()) return endpoint.status();
    out.push_back(fmt::format("http://{}:{}", endpoint->host, endpoint->port));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

Result<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdOptions options) {
  if (options.endpoints.empty()) return InvalidArgumentError("no etcd endpoint given");
  for (const std::string& url : options.endpoints) {
    auto endpoint = SplitEndpoint(url);
    if (!endpoint.ok()) return endpoint.status();
  }
  if (options.timeout <= std::chrono::milliseconds(0)) {
    return InvalidArgumentError("etcd timeout of {} ms", options.timeout.count());
  }
  return std::unique_ptr<EtcdClient>(new EtcdClient(std::move(options)));
}

EtcdClient::~EtcdClient() { StopWatches(); }

std::string EtcdClient::endpoint() const {
  return options_.endpoints[preferred_.load() % options_.endpoints.size()];
}

Result<std::string> EtcdClient::Post(std::string_view path, const std::string& body) {
  const size_t n = options_.endpoints.size();
  const size_t first = preferred_.load();
  Status last;
  for (size_t i = 0; i < n; ++i) {
    const size_t index = (first + i) % n;
    const std::string& url = options_.endpoints[index];
    auto client = MakeClient(url, options_.timeout);
    // etcd's gateway ends an error response with an HTTP trailer, which cpp-httplib 0.11 fails
    // to read (Error::Read) after the whole body has come: the status and the body are taken
    // as they arrive, and a read error after a complete JSON body counts as an answer.
    int status = 0;
    std::string received;
    httplib::Request request =
        JsonPost(path, body, [&received](const char* data, size_t length, uint64_t, uint64_t) {
          received.append(data, length);
          return true;
        });
    request.response_handler = [&status](const httplib::Response& response) {
      status = response.status;
      return true;
    };
    httplib::Result response = client->send(request);
    const bool answered = response || (status != 0 && response.error() == httplib::Error::Read &&
                                       Json::accept(received));
    if (!answered) {
      last = UnavailableError("etcd at {} did not answer {}: {}", url, path,
                              httplib::to_string(response.error()));
      continue;
    }
    if (status >= 500 && status != 503 && received.empty()) {
      last = UnavailableError("etcd at {} answered {} with HTTP {}", url, path, status);
      continue;
    }
    preferred_.store(index);
    if (status != 200) {
      Json error = Json::parse(received, nullptr, /*allow_exceptions=*/false);
      if (error.is_discarded() || !error.is_object()) {
        return UnavailableError("etcd at {} answered {} with HTTP {}: {}", url, path, status,
                                received.substr(0, 200));
      }
      const Status refused = GatewayError(error, path);
      if (refused.code() == StatusCode::kUnavailable) {
        last = refused;  // a member without a leader: another may have one
        continue;
      }
      return refused;
    }
    return received;
  }
  return last;
}

namespace {
// The JSON object of a response body; Unavailable (a broken gateway) when it does not parse.
Result<Json> ParseBody(const std::string& body, std::string_view what) {
  Json json = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return UnavailableError("etcd {}: a response that is not a JSON object: {}", what,
                            body.substr(0, 200));
  }
  return json;
}
}  // namespace

Result<int64_t> EtcdClient::GrantLease(int64_t ttl_s) {
  if (ttl_s <= 0) return InvalidArgumentError("a lease of {} s", ttl_s);
  auto body = Post("/v3/lease/grant", Json{{"TTL", std::to_string(ttl_s)}}.dump());
  if (!body.ok()) return body.status();
  auto json = ParseBody(*body, "lease grant");
  if (!json.ok()) return json.status();
  return Parsing("lease grant", [&]() -> Result<int64_t> {
    if (json->contains("error") && !json->value("error", "").empty()) {
      return UnavailableError("etcd lease grant: {}", json->value("error", ""));
    }
    const int64_t id = Int(*json, "ID");
    if (id == 0) {
      return UnavailableError("etcd lease grant: no lease id in {}", body->substr(0, 200));
    }
    return id;
  });
}

Result<int64_t> EtcdClient::KeepAlive(int64_t lease) {
  auto body = Post("/v3/lease/keepalive", Json{{"ID", std::to_string(lease)}}.dump());
  if (!body.ok()) return body.status();
  // The gateway answers a stream of one message: {"result": {...}} or {"error": {...}}.
  const size_t end = body->find('\n');
  auto json = ParseBody(end == std::string::npos ? *body : body->substr(0, end), "keepalive");
  if (!json.ok()) return json.status();
  if (json->contains("error")) return GatewayError((*json)["error"], "lease keepalive");
  return Parsing("lease keepalive", [&]() -> Result<int64_t> {
    const Json& result = json->contains("result") ? (*json)["result"] : *json;
    const int64_t ttl = Int(result, "TTL");
    if (ttl <= 0) return NotFoundError("etcd lease {:x} has expired", lease);
    return ttl;
  });
}

Status EtcdClient::RevokeLease(int64_t lease) {
  auto body = Post("/v3/lease/revoke", Json{{"ID", std::to_string(lease)}}.dump());
  if (!body.ok() && body.status().code() != StatusCode::kNotFound) return body.status();
  return Status::OK();
}

Status EtcdClient::Put(std::string_view key, std::string_view value, int64_t lease) {
  Json request{{"key", Base64(key)}, {"value", Base64(value)}};
  if (lease != 0) request["lease"] = std::to_string(lease);
  auto body = Post("/v3/kv/put", request.dump());
  return body.ok() ? Status::OK() : body.status();
}

Result<bool> EtcdClient::Delete(std::string_view key) {
  auto body = Post("/v3/kv/deleterange", Json{{"key", Base64(key)}}.dump());
  if (!body.ok()) return body.status();
  auto json = ParseBody(*body, "delete");
  if (!json.ok()) return json.status();
  return Parsing("delete", [&]() -> Result<bool> { return Int(*json, "deleted") > 0; });
}

Result<EtcdClient::Range> EtcdClient::GetPrefix(std::string_view prefix) {
  auto body = Post("/v3/kv/range",
                   Json{{"key", Base64(prefix)}, {"range_end", Base64(PrefixEnd(prefix))}}.dump());
  if (!body.ok()) return body.status();
  auto json = ParseBody(*body, "range");
  if (!json.ok()) return json.status();
  return Parsing("range", [&]() -> Result<Range> {
    Range range;
    if (json->contains("header")) range.revision = Int((*json)["header"], "revision");
    if (json->contains("kvs")) {
      const Json& kvs = (*json)["kvs"];
      if (!kvs.is_array()) throw std::invalid_argument("kvs is not an array");
      for (const Json& kv : kvs) {
        auto parsed = ParseKeyValue(kv);
        if (!parsed.ok()) return parsed.status();
        range.kvs.push_back(std::move(*parsed));
      }
    }
    return range;
  });
}

Status EtcdClient::Watch(std::string_view prefix, int64_t start_revision,
                         const std::function<void(const WatchEvent&)>& on_event,
                         const std::function<void()>& on_created) {
  Json create{{"key", Base64(prefix)}, {"range_end", Base64(PrefixEnd(prefix))}};
  if (start_revision > 0) create["start_revision"] = std::to_string(start_revision);
  const std::string request_body = Json{{"create_request", create}}.dump();
  const size_t index = preferred_.load() % options_.endpoints.size();
  const std::string url = options_.endpoints[index];
  auto client = MakeClient(url, options_.timeout);
  // A watch reads without limit: the stream is quiet while nothing changes.
  client->set_read_timeout(24 * 3600, 0);
  httplib::Client* raw = client.get();
  uint64_t id = 0;
  {
    MutexLock lock(&mu_);
    if (stopping_.load()) return CancelledError("etcd watch of {} stopped", prefix);
    id = next_watch_++;
    watch_stops_[id] = [raw] { raw->stop(); };
  }
  std::string buffer;
  Status outcome;
  auto on_bytes = [&](const char* data, size_t length, uint64_t, uint64_t) {
    buffer.append(data, length);
    try {
      size_t newline;
      while ((newline = buffer.find('\n')) != std::string::npos) {
        const std::string line = buffer.substr(0, newline);
        buffer.erase(0, newline + 1);
        if (line.empty()) continue;
        Json message = Json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (message.is_discarded() || !message.is_object()) {
          outcome =
              UnavailableError("etcd watch: a message that is not JSON: {}", line.substr(0, 200));
          return false;
        }
        if (message.contains("error")) {
          outcome = GatewayError(message["error"], "watch");
          return false;
        }
        const Json& result = message.contains("result") ? message["result"] : message;
        if (Int(result, "compact_revision") > 0) {
          outcome = OutOfRangeError("etcd watch of {}: revision {} compacted (now {})", prefix,
                                    start_revision, Int(result, "compact_revision"));
          return false;
        }
        if (result.value("canceled", false)) {
          outcome = UnavailableError("etcd cancelled the watch of {}: {}", prefix,
                                     result.value("cancel_reason", std::string("no reason")));
          return false;
        }
        if (result.value("created", false) && on_created) on_created();
        if (result.contains("events")) {
          if (!result["events"].is_array()) throw std::invalid_argument("events is not an array");
          for (const Json& event : result["events"]) {
            WatchEvent out;
            out.type = event.value("type", std::string("PUT")) == "DELETE"
                           ? WatchEvent::Type::kDelete
                           : WatchEvent::Type::kPut;
            if (!event.contains("kv")) continue;
            auto kv = ParseKeyValue(event["kv"]);
            if (!kv.ok()) {
              outcome = kv.status();
              return false;
            }
            out.kv = std::move(*kv);
            on_event(out);
          }
        }
      }
    } catch (const std::exception& e) {
      outcome = UnavailableError("etcd watch: a malformed message ({})", e.what());
      return false;
    }
    return true;
  };
  httplib::Request request = JsonPost("/v3/watch", request_body, on_bytes);
  httplib::Result response = client->send(request);
  {
    MutexLock lock(&mu_);
    watch_stops_.erase(id);
  }
  if (stopping_.load()) return CancelledError("etcd watch of {} stopped", prefix);
  if (!outcome.ok()) return outcome;
  if (!response) {
    return UnavailableError("etcd watch at {} ended: {}", url,
                            httplib::to_string(response.error()));
  }
  if (response->status != 200) {
    return UnavailableError("etcd watch at {}: HTTP {}", url, response->status);
  }
  return UnavailableError("etcd at {} closed the watch of {}", url, prefix);
}

void EtcdClient::StopWatches() {
  MutexLock lock(&mu_);
  stopping_.store(true);
  for (auto& [id, stop] : watch_stops_) stop();
}

}  // namespace kvstash::membership
