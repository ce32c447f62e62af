#pragma once
// Tensors whose bytes live in a file-backed shared mapping instead of
// anonymous memory: optimizer-state offload on CPU runs (ZeRO-Infinity's idea
// without a GPU). The kernel writes cold pages back to the file and may drop
// them from RAM, so states larger than the memory left can still be stepped;
// hot pages stay in the page cache. The file is unlinked as soon as it is
// mapped: nothing is left on disk when the process ends, however it ends.
#include <ATen/ATen.h>

#include <string>

namespace scaletrain::optim {

// A zero-filled contiguous tensor of `numel` elements of `dtype` mapped from a
// new file in `dir`. Throws std::runtime_error naming the directory when the
// file cannot be created, sized or mapped.
at::Tensor file_backed_zeros(const std::string& dir, int64_t numel, at::ScalarType dtype);

}  // namespace scaletrain::optim
