#pragma once
// What the reference tests share: where the pinned npm packages are, and
// running a reference renderer or tokenizer as a child process.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace scaletrain::test {

// third_party/npm of the source tree (scripts/install-deps.sh), or $SCALETRAIN_NPM_DIR.
inline std::filesystem::path npm_dir() {
  const char* env = std::getenv("SCALETRAIN_NPM_DIR");
  return env != nullptr ? std::filesystem::path(env)
                        : std::filesystem::path(SCALETRAIN_SOURCE_DIR) / "third_party" / "npm";
}

// Runs a command; its stdout, and its exit status in `code` (-1 if it did not exit).
inline std::string capture(const std::string& cmd, int& code) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) {
    code = -1;
    return out;
  }
  char buf[65536];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  const int status = ::pclose(p);
  code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

}  // namespace scaletrain::test
