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

Status CheckHelloToken(const ServerOptions& options, std::string_view tenant,
                       std::string_view token) {
  if (auto it = options.tenant_tokens.find(std::string(tenant));
      it != options.tenant_tokens.end()) {
    if (!ConstantTimeEqual(token, it->second)) {
      return UnauthenticatedError("wrong auth token for the tenant");
    }
    return Status::OK();
  }
  if (!options.tenant_tokens.empty() && options.auth_token.empty()) {
    return PermissionDeniedError("the tenant is not served here");
  }
  if (!options.auth_token.empty() && !ConstantTimeEqual(token, options.auth_token)) {
    return UnauthenticatedError("wrong auth token");
  }
  return Status::OK();
}

Status CheckHello(const ServerOptions& options, std::string_view tenant, std::string_view token) {
  KVSTASH_RETURN_IF_ERROR(CheckHelloToken(options, tenant, token));
  if (options.admit_tenant) return options.admit_tenant(tenant);
  return Status::OK();
}

}  // namespace kvstash::transport
