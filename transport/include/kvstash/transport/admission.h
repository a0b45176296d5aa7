// What a server decides at a client's hello, the same on every transport (UCX, loopback).
#pragma once

#include <string_view>

#include "kvstash/common/status.h"
#include "kvstash/transport/channel.h"

namespace kvstash::transport {

// The client's token against its tenant's own token, else the server's: OK, Unauthenticated (a
// wrong token) or PermissionDenied (a tenant this server does not serve).
// Compares in constant time.
Status CheckHelloToken(const ServerOptions& options, std::string_view tenant,
                       std::string_view token);

// CheckHelloToken, then the server's own say on the tenant (ServerOptions::admit_tenant).
Status CheckHello(const ServerOptions& options, std::string_view tenant, std::string_view token);

}  // namespace kvstash::transport
