#include "scaletrain/optim/file_backed.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace scaletrain::optim {

at::Tensor file_backed_zeros(const std::string& dir, int64_t numel, at::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  auto fail = [&](const char* what) {
    return std::runtime_error("optimizer offload to " + dir + ": " + what + ": " + std::strerror(errno));
  };
  std::string pattern = dir + "/scaletrain-optim-XXXXXX";
  std::vector<char> path(pattern.begin(), pattern.end());
  path.push_back('\0');
  const int fd = ::mkstemp(path.data());
  if (fd < 0) throw fail("cannot create a state file");
  ::unlink(path.data());  // lives until unmapped and closed
  // ftruncate leaves a sparse file of zeros: no bytes are written up front.
  if (bytes > 0 && ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    ::close(fd);
    throw fail("cannot size the state file");
  }
  void* p = bytes > 0 ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : nullptr;
  ::close(fd);  // the mapping keeps the file
  if (p == MAP_FAILED) throw fail("cannot map the state file");
  return at::from_blob(
      p, {numel},
      [bytes](void* q) {
        if (q) ::munmap(q, bytes);
      },
      at::TensorOptions().dtype(dtype));
}

}  // namespace scaletrain::optim
