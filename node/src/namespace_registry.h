#pragma once

// The namespaces a node serves, by their exact names (the namespace, its id and the key's field:
// docs/semantics.md §18). A namespace's id (the 32 bits its blocks' keys carry) is given by the
// node, in order of first appearance, never derived from the name: an id computed from a name
// (it was xxh3 of it) lets a client choose a name whose id is another tenant's and read and
// write that tenant's blocks. Two names can never share an id here.
//
// With a file (the node's SSD directory), the table survives restarts, so blocks on SSD stay
// with their namespace: a registration appends one line before the name is used, so no block of
// a namespace can exist on disk before its line does. A line lost with a power failure only
// loses its blocks: the SSD tier drops blocks whose id the table does not know (Known) when it
// reopens, before any id is given again.
//
// Thread-safe.

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"

namespace kvstash::node {

class NamespaceRegistry {
 public:
  // The longest namespace name a client may give.
  static constexpr size_t kMaxNameBytes = 256;

  // `path` empty: in memory only. Else the table is read from `path` (a missing file is an empty
  // table; a torn last line, from a crash mid-append, is dropped) and appended to. At most
  // `max_namespaces` names. InvalidArgument for a damaged file, Unavailable when it cannot be
  // read or written.
  static Result<std::unique_ptr<NamespaceRegistry>> Open(std::string path, size_t max_namespaces);
  ~NamespaceRegistry();

  // The id of `name`, given now if the name is new (and written to the file first).
  // InvalidArgument for an empty name or one over kMaxNameBytes; ResourceExhausted when the
  // table holds max_namespaces names; Unavailable when the file cannot be written.
  Result<NamespaceId> Register(std::string_view name);
  // The id of `name`, if registered.
  std::optional<NamespaceId> Find(std::string_view name) const;
  // Whether some name has `id`.
  bool Known(NamespaceId id) const;
  std::optional<std::string> NameOf(NamespaceId id) const;
  size_t size() const;

 private:
  NamespaceRegistry(std::string path, size_t max_namespaces);
  Status Load();

  const std::string path_;
  const size_t max_namespaces_;
  mutable Mutex mu_;
  int fd_ GUARDED_BY(mu_) = -1;
  size_t file_bytes_ GUARDED_BY(mu_) = 0;  // whole lines in the file
  std::unordered_map<std::string, NamespaceId> ids_ GUARDED_BY(mu_);
  std::unordered_map<NamespaceId, std::string> names_ GUARDED_BY(mu_);
  NamespaceId next_id_ GUARDED_BY(mu_) = 1;
};

}  // namespace kvstash::node
