#include "kvstash/common/token_file.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>

namespace kvstash {

Result<std::string> ReadTokenFile(const std::string& path, std::string_view flag) {
  std::ifstream in(path);
  if (!in) {
    const int e = errno;
    return Status(e == EACCES ? StatusCode::kPermissionDenied : StatusCode::kNotFound,
                  fmt::format("{}: cannot read '{}': {}", flag, path, std::strerror(e)));
  }
  std::string token;
  std::getline(in, token);
  while (!token.empty() && (token.back() == '\r' || token.back() == ' ' || token.back() == '\t')) {
    token.pop_back();
  }
  if (token.empty()) return InvalidArgumentError("{}: '{}' holds no token", flag, path);
  return token;
}

Result<std::string> ResolveToken(const std::string& token, std::string_view token_flag,
                                 const std::string& token_file, std::string_view file_flag) {
  if (!token.empty() && !token_file.empty()) {
    return InvalidArgumentError("{} and {}: give one, not both", token_flag, file_flag);
  }
  if (token_file.empty()) return token;
  return ReadTokenFile(token_file, file_flag);
}

}  // namespace kvstash
