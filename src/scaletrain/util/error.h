#pragma once
// Error types shared by every layer.
//
// UsageError is bad input from the user (a malformed config, an unknown key, a
// missing file, a mesh that does not fit): the CLI prints its message on one
// line and exits with code 2, without a stack trace. Anything else that
// escapes is an internal failure (exit 1).
#include <stdexcept>
#include <string>

namespace scaletrain {

class UsageError : public std::runtime_error {
 public:
  explicit UsageError(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace scaletrain
