#pragma once
// Internal to comm/'s group files: what group.cpp (Work, Group and the
// collectives), scratch.cpp (the scratch pool), tracker.cpp (the collective
// tracker) and profile.cpp (the communication profile) share.
#include "scaletrain/comm/group.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace scaletrain::comm::detail {

// --- Scratch buffers (Note [Scratch buffers] in group.h; scratch.cpp) -------

class ScratchPool : public std::enable_shared_from_this<ScratchPool> {
 public:
  // One checked-out buffer. `finish()` says the operation using it is over;
  // only then does destruction hand the buffer back to the pool.
  class Lease {
   public:
    Lease(std::weak_ptr<ScratchPool> pool, at::Tensor bytes, at::Tensor tensor)
        : pool_(std::move(pool)), bytes_(std::move(bytes)), tensor_(std::move(tensor)) {}
    ~Lease() {
      if (!finished_ || !bytes_.defined()) return;
      if (auto pool = pool_.lock()) pool->give_back(std::move(bytes_));
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;

    const at::Tensor& tensor() const { return tensor_; }
    void finish() { finished_ = true; }

   private:
    std::weak_ptr<ScratchPool> pool_;
    at::Tensor bytes_;   // the pooled storage (undefined when not pooled)
    at::Tensor tensor_;  // the caller's typed 1-D view of it
    bool finished_ = false;
  };
  using LeasePtr = std::shared_ptr<Lease>;

  // An uninitialised contiguous 1-D tensor of `numel` elements.
  LeasePtr take(int64_t numel, const at::TensorOptions& options);

  int64_t held_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }

 private:
  void give_back(at::Tensor bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(bytes));
  }

  mutable std::mutex mu_;
  std::vector<at::Tensor> free_;  // 1-D uint8 CPU tensors not checked out
  int64_t held_ = 0;              // bytes of all pooled buffers, free or out
};

inline bool is_16bit_float(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// Reduces the rows of `rows` ([n, k]) into `dst`, row 0 first (scratch.cpp).
void reduce_rows_into(const at::Tensor& rows, ReduceOp op, at::Tensor dst, ScratchPool& pool);

// `full` flattened and zero-padded to `numel` elements, in a scratch buffer.
ScratchPool::LeasePtr padded_copy(ScratchPool& pool, const at::Tensor& full, int64_t numel);

// The first line of an exception's message, without a c10 backtrace (tracker.cpp).
std::string first_line(const std::exception& e);

// --- Communication profile (Note [Communication profile] in group.h; profile.cpp)

// The record of a collective `ws` that has just been launched (`futures`:
// its works report their completion through futures, as Gloo's collectives
// do and its send and recv do not).
std::shared_ptr<CommProfile> launch_profile(const char* op, const std::string& group, int size, uint64_t seq,
                                            int64_t bytes, bool futures, const std::vector<compat::WorkPtr>& ws);

// Counts a finished collective into the totals and the trace (profile.cpp).
void count_collective(const CommProfile& p, int64_t wait_start, int64_t wait_end);

}  // namespace scaletrain::comm::detail
