#include "kvstash/transport/admission.h"

#include <string>

namespace kvstash::transport {
namespace {

// Compares every byte whatever the first difference, so the time taken says nothing about how
// much of a guessed token was right (only its length can show).
bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = diff | static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

}  // namespace

Status CheckHelloToken(const ServerOptions& options, std::string_view key_namespace,
                       std::string_view token) {
  if (auto it = options.namespace_tokens.find(std::string(key_namespace));
      it != options.namespace_tokens.end()) {
    if (!ConstantTimeEqual(token, it->second)) {
      return UnauthenticatedError("wrong auth token for the namespace");
    }
    return Status::OK();
  }
  if (!options.namespace_tokens.empty() && options.auth_token.empty()) {
    return PermissionDeniedError("the namespace is not served by this node");
  }
  if (!options.auth_token.empty() && !ConstantTimeEqual(token, options.auth_token)) {
    return UnauthenticatedError("wrong auth token");
  }
  return Status::OK();
}

Status CheckHello(const ServerOptions& options, std::string_view key_namespace,
                  std::string_view token) {
  KVSTASH_RETURN_IF_ERROR(CheckHelloToken(options, key_namespace, token));
  if (options.admit_namespace) return options.admit_namespace(key_namespace);
  return Status::OK();
}

}  // namespace kvstash::transport
