#pragma once
// Small POSIX file helpers shared by every writer that must not lose data
// (token files, safetensors, checkpoint indexes): an owned descriptor, a temp
// file that disappears unless committed, and a write loop.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <string>
#include <utility>

namespace scaletrain::util {

// Owns a POSIX file descriptor; closes it on scope exit. release_and_close()
// reports close()'s result, which on NFS and some other file systems carries
// a failed write.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release_and_close() { return ::close(std::exchange(fd_, -1)); }

 private:
  int fd_;
};

// Removes a temp file on scope exit unless commit() was called.
class TempFileGuard {
 public:
  explicit TempFileGuard(std::string path) : path_(std::move(path)) {}
  ~TempFileGuard() {
    if (!committed_) ::unlink(path_.c_str());
  }
  TempFileGuard(const TempFileGuard&) = delete;
  TempFileGuard& operator=(const TempFileGuard&) = delete;
  void commit() { committed_ = true; }

 private:
  std::string path_;
  bool committed_ = false;
};

// Writes all n bytes: write(2) may write less than asked (signals, quotas,
// requests above 2 GB). Returns 0, or the errno of the failure.
inline int write_all(int fd, const void* buf, std::size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<std::size_t>(n, std::size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return 0;
}

}  // namespace scaletrain::util
