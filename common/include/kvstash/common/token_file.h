#pragma once

// Auth tokens kept in files: one reader for every program, so a token file that authenticates
// the daemon is read the same way by every client.

#include <string>
#include <string_view>

#include "kvstash/common/status.h"

namespace kvstash {

// The token in `path`: its first line, without trailing spaces, tabs or a CR (a file written on
// another system, or by `echo`). Errors name `flag` (the setting that gave the path):
// NotFound or PermissionDenied when the file cannot be read, InvalidArgument when it holds no
// token.
Result<std::string> ReadTokenFile(const std::string& path, std::string_view flag);

// The token given as `token` (TOKEN_FLAG) or in the file `token_file` (FILE_FLAG): at most one of
// them (InvalidArgument for both); neither gives the empty token.
Result<std::string> ResolveToken(const std::string& token, std::string_view token_flag,
                                 const std::string& token_file, std::string_view file_flag);

}  // namespace kvstash
