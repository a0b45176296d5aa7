#include "namespace_registry.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "kvstash/common/logging.h"

namespace kvstash::node {
namespace {

// A name on disk: its bytes in hex, so any name (spaces, newlines, any byte) takes one line.
std::string Hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const char c : bytes) {
    const auto b = static_cast<unsigned char>(c);
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

std::optional<std::string> Unhex(std::string_view hex) {
  if (hex.size() % 2 != 0) return std::nullopt;
  std::string out;
  out.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    unsigned value = 0;
    const auto [end, error] = std::from_chars(hex.data() + i, hex.data() + i + 2, value, 16);
    if (error != std::errc() || end != hex.data() + i + 2) return std::nullopt;
    out.push_back(static_cast<char>(value));
  }
  return out;
}

}  // namespace

NamespaceRegistry::NamespaceRegistry(std::string path, size_t max_namespaces)
    : path_(std::move(path)), max_namespaces_(max_namespaces) {}

NamespaceRegistry::~NamespaceRegistry() {
  MutexLock lock(&mu_);
  if (fd_ >= 0) ::close(fd_);
}

Result<std::unique_ptr<NamespaceRegistry>> NamespaceRegistry::Open(std::string path,
                                                                   size_t max_namespaces) {
  if (max_namespaces == 0) return InvalidArgumentError("a node needs room for 1 namespace");
  std::unique_ptr<NamespaceRegistry> registry(
      new NamespaceRegistry(std::move(path), max_namespaces));
  if (!registry->path_.empty()) KVSTASH_RETURN_IF_ERROR(registry->Load());
  return registry;
}

Status NamespaceRegistry::Load() {
  MutexLock lock(&mu_);
  std::string text;
  {
    std::ifstream in(path_, std::ios::binary);
    if (in) {
      std::ostringstream all;
      all << in.rdbuf();
      text = std::move(all).str();
    }
  }
  // A last line without its newline is an append a crash cut short: its name was never used.
  const size_t whole = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
  if (whole != text.size()) {
    KVSTASH_LOG_WARN("namespace table {}: dropping a torn last line of {} bytes", path_,
                     text.size() - whole);
  }
  size_t line_number = 0;
  for (size_t start = 0; start < whole;) {
    const size_t end = text.find('\n', start);
    const std::string_view line(text.data() + start, end - start);
    start = end + 1;
    ++line_number;
    auto damaged = [&](std::string_view why) {
      return InvalidArgumentError(
          "namespace table {} line {} is damaged ({}); remove the file to start over (the SSD "
          "tier then drops every block, since no namespace owns them)",
          path_, line_number, why);
    };
    const size_t space = line.find(' ');
    if (space == std::string_view::npos) return damaged("no space");
    uint64_t id = 0;
    const auto [end_id, error] = std::from_chars(line.data(), line.data() + space, id);
    if (error != std::errc() || end_id != line.data() + space || id == 0 ||
        id > std::numeric_limits<NamespaceId>::max()) {
      return damaged("bad id");
    }
    std::optional<std::string> name = Unhex(line.substr(space + 1));
    if (!name || name->empty() || name->size() > kMaxNameBytes) return damaged("bad name");
    const auto ns = static_cast<NamespaceId>(id);
    if (names_.contains(ns) || ids_.contains(*name)) return damaged("a name or id twice");
    ids_.emplace(*name, ns);
    names_.emplace(ns, std::move(*name));
    next_id_ = std::max<NamespaceId>(next_id_, ns + 1);
  }
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    return UnavailableError("cannot open namespace table {}: {}", path_, std::strerror(errno));
  }
  // Later appends start after the last whole line.
  if (::ftruncate(fd_, static_cast<off_t>(whole)) != 0 ||
      ::lseek(fd_, static_cast<off_t>(whole), SEEK_SET) < 0) {
    return UnavailableError("cannot write namespace table {}: {}", path_, std::strerror(errno));
  }
  file_bytes_ = whole;
  return Status::OK();
}

Result<NamespaceId> NamespaceRegistry::Register(std::string_view name) {
  if (name.empty()) return InvalidArgumentError("an empty namespace name");
  if (name.size() > kMaxNameBytes) {
    return InvalidArgumentError("a namespace name of {} bytes; at most {}", name.size(),
                                kMaxNameBytes);
  }
  MutexLock lock(&mu_);
  if (auto it = ids_.find(std::string(name)); it != ids_.end()) return it->second;
  if (ids_.size() >= max_namespaces_ || next_id_ == 0) {
    return ResourceExhaustedError("this node serves {} namespaces, its most; no new one",
                                  ids_.size());
  }
  const NamespaceId ns = next_id_;
  if (!path_.empty() && fd_ < 0) {
    return UnavailableError("namespace table {} cannot be written since an earlier failure", path_);
  }
  if (fd_ >= 0) {
    const std::string line = fmt::format("{} {}\n", ns, Hex(name));
    size_t written = 0;
    while (written < line.size()) {
      const ssize_t n = ::write(fd_, line.data() + written, line.size() - written);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int error = n < 0 ? errno : ENOSPC;
        // What was written of the line goes, so the next append starts a line of its own.
        if (::ftruncate(fd_, static_cast<off_t>(file_bytes_)) != 0 ||
            ::lseek(fd_, static_cast<off_t>(file_bytes_), SEEK_SET) < 0) {
          ::close(std::exchange(fd_, -1));  // no more appends: Register fails from now on
        }
        return UnavailableError("cannot record namespace in {}: {}", path_, std::strerror(error));
      }
      written += static_cast<size_t>(n);
    }
    file_bytes_ += line.size();
  }
  ++next_id_;
  ids_.emplace(std::string(name), ns);
  names_.emplace(ns, std::string(name));
  return ns;
}

std::optional<NamespaceId> NamespaceRegistry::Find(std::string_view name) const {
  MutexLock lock(&mu_);
  if (auto it = ids_.find(std::string(name)); it != ids_.end()) return it->second;
  return std::nullopt;
}

bool NamespaceRegistry::Known(NamespaceId id) const {
  MutexLock lock(&mu_);
  return names_.contains(id);
}

std::optional<std::string> NamespaceRegistry::NameOf(NamespaceId id) const {
  MutexLock lock(&mu_);
  if (auto it = names_.find(id); it != names_.end()) return it->second;
  return std::nullopt;
}

size_t NamespaceRegistry::size() const {
  MutexLock lock(&mu_);
  return ids_.size();
}

}  // namespace kvstash::node
