#pragma once
// Note [Gather on use]: how fully_shard gathers a unit of a user's module
// before its forward and its backward, without touching the module's code.
//
// PyTorch's FSDP gathers in module forward pre-hooks and in hooks on the
// forward's outputs. libtorch's C++ modules have neither: forward is not
// virtual, a holder (torch::nn::Linear) always calls its own impl, and a
// wrapper put in a submodule's place is not what the parent's field points
// to. What every operator does pass through is the dispatcher, and the
// dispatcher's observer callbacks (at::RecordFunction, the profiler's
// mechanism) see each operator's inputs before its kernel runs. So the
// engine registers a start callback that looks at the storage of every
// tensor an operator receives: when it is the flat buffer of a unit that is
// not gathered (or whose gather is in flight, or, under ZeRO-1/2, stale),
// the engine gathers that unit first, and the kernel then reads the
// gathered values. Views count too: autograd saves weight.t() for backward,
// which shares the flat buffer's storage (Note [Flat parameters]), so the
// backward of a resharded unit gathers it again on its first read.
//
// Why not the alternatives: a wrapper module in the unit's place does not
// reach the parent's holder field; an autograd function around the unit's
// call needs the user to write that call into forward; gathering everything
// before forward would hold the whole model in forward, which is not FSDP.
//
// When things happen:
//   - forward: the first read of unit u gathers it (and the next unit with
//     forward_prefetch); under FULL_SHARD/ZeRO-3/HYBRID_SHARD the unit used
//     before u is resharded then (the root stays until backward ends);
//   - backward: a read of a resharded unit gathers it again, the unit before
//     it is prefetched (BACKWARD_PRE), and the unit is resharded once its
//     gradients are all accumulated, as for our own families.
// Correctness never depends on the guesses: whatever is read is gathered
// first. An order that differs from registration order (a unit used twice,
// units used out of order) costs extra gathers, not wrong values.
//
// The callback is thread-local: libtorch's autograd engine carries it into
// the threads that run backward, and the communication threads (Gloo's)
// never see it. The engine's own work (gathers, reduces, the optimizer
// step on shards) runs inside a Quiet scope, which the callback ignores.
//
// The thread rule is checked. Another thread does not carry the callback,
// so a forward there would read freed buffers (libtorch's "data is not
// allocated yet", naming nothing) or, under ZeRO-1/2, stale ones in
// silence. A second, process-wide callback watches the other threads: an
// operator there whose input is one of a live engine's parameters (the
// parameter tensor itself, which every path into a module's weights starts
// from) is noted with the parameter and its unit, one line goes to stderr,
// and the engine's next call (the end of a backward, zero_grad, after_step,
// clip_grad_norm, full_parameters) throws UsageError saying to run forward
// and backward on the thread that called fully_shard. It cannot throw on
// the offending thread: exceptions do not leave a RecordFunction callback.
// Matching parameters rather than storage keeps out what legitimately
// touches a unit's buffer elsewhere: Gloo's worker copying a gather into it,
// a thread reading ZeRO-1/2 shards (views of the buffer). Operators inside
// a parallel region (intra-op workers of an operator already seen) are
// skipped. On a thread that carries an engine's callback, the watcher's
// whole work per operator is one pass over that thread's callback list (one
// or two entries): the hot path stays the thread-local callback. A thread
// that carries one engine's callback and reads another engine's parameters
// is noted for that engine the same way, rather than gathering on the
// wrong thread.
#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <functional>

namespace scaletrain::parallel::fsdp {

class GatherOnUse {
 public:
  struct Hooks {
    // The unit whose flat buffer this storage is, or -1.
    std::function<int64_t(const c10::StorageImpl*)> unit_of;
    // Make `unit` readable now (called outside any Quiet scope, on the
    // thread running the operator, which carries this engine's callback).
    std::function<void(size_t unit)> use;
    // An operator on a thread that does not carry this engine's callback
    // reads `t`: note it if it is one of the engine's parameters. Called
    // from any thread under the registry's lock: it must neither throw nor
    // wait for the engine.
    std::function<void(const at::Tensor& t)> foreign;
    // An operator `op` on the engine's thread reads `storage` (any input):
    // the engine notes reads it forbids (Note [Spent gradients] in
    // fully_shard.cpp). Same rules as `foreign`; may be empty.
    std::function<void(const c10::StorageImpl* storage, const char* op)> read;
  };
  // Registers the thread-local callback on the calling thread (the engine's).
  explicit GatherOnUse(Hooks hooks);
  ~GatherOnUse();
  GatherOnUse(const GatherOnUse&) = delete;
  GatherOnUse& operator=(const GatherOnUse&) = delete;

  // While one lives on this thread, operators gather nothing.
  class Quiet {
   public:
    Quiet();
    ~Quiet();
    Quiet(const Quiet&) = delete;
    Quiet& operator=(const Quiet&) = delete;
  };

  // Whether a live engine's unit keeps its buffer in this storage (a
  // module given to fully_shard twice).
  static bool claimed(const c10::StorageImpl* storage);

  struct Impl;  // gather_on_use.cpp

 private:
  Impl* impl_;
};

}  // namespace scaletrain::parallel::fsdp
