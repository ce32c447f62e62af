#pragma once
// Tensor parallelism for any torch::nn::Module, by a plan over the names of
// its submodules, as DTensor's parallelize_module with ColwiseParallel and
// RowwiseParallel does in PyTorch:
//
//   auto tp = parallelize_module(model, tp_group, {{"net1", colwise}, {"net2", rowwise}});
//
//   style     module      this rank keeps            input         output
//   colwise   Linear      out/tp rows of W and b     replicated    its out/tp features
//   rowwise   Linear      in/tp columns of W; b      its in/tp     full (all-reduced),
//                         whole                      features      b added once
//   colwise   Embedding   C/tp columns of the table  ids           its C/tp features
//
// Sequence parallelism (Megatron's, DTensor's SequenceParallel with
// Shard(1) layouts) needs the activations between the tensor-parallel
// layers re-laid out along the sequence, which changes their shape, so the
// user's forward calls the two collectives of tp_comm.h itself and the plan
// says which layers sit between them:
//
//   style                  module      keeps / does
//   sequence_parallel      any         its parameters whole; each rank's
//                                      gradient, from its part of the
//                                      sequence, is summed over tp
//   colwise_from_sequence  Linear      as colwise; its input comes whole from
//                                      gather_from_sequence, whose backward
//                                      sums the input gradient
//   rowwise_to_sequence    Linear      as rowwise; its partial output goes to
//                                      reduce_scatter_to_sequence (b once)
//
//   h = norm(x_part);                                   // sequence_parallel
//   h = gather_from_sequence(h, tp, 1);                 // [B, T, C]
//   h = fc2(gelu(fc1(h)));                              // colwise_from_sequence, rowwise_to_sequence
//   x_part = x_part + reduce_scatter_to_sequence(h, tp, 1);   // [B, T/tp, C]
//
// A colwise output is this rank's slice of the features (DTensor's local
// tensor): elementwise work may follow, then a rowwise layer takes it, and
// gather_from_tp_region(y, tp, -1) (tp_comm.h) makes it whole where the
// user's forward needs the full width. Names are as in named_modules() and
// may hold fnmatch patterns ("blocks.*.fc1").
//
// Note [Tensor parallelism without forward hooks]: Megatron's f (identity
// forward, all-reduce of the input gradient) and g (all-reduce forward,
// identity backward) must sit in the autograd graph at each linear's input
// and output. A libtorch module offers no hook for them (Note [Gather on
// use]), so the products the module's forward is made of are observed
// through a process-wide at::RecordFunction callback: torch::nn::Linear
// computes addmm(b, x, W.t()) for 2-d input with a bias, else matmul(x,
// W.t()) and then adds b (aten::linear decomposes the same way), and the
// callback recognises a planned layer's product by its weight's storage:
//   - rowwise: when the product ends, its output (this rank's partial
//     product; addmm's added bias taken out again on ranks other than 0, so
//     it counts once) is all-reduced in place. g's backward is the
//     identity, so libtorch's own backward is already correct.
//   - colwise: the gradient the product sends to its input is this rank's
//     part of a sum. The autograd nodes the product created (sequence
//     numbers between its start and its end) that lead to the input get a
//     post hook that all-reduces that gradient: f for this call's
//     contribution only, so other readers of the same input (a residual)
//     are not summed.
// A weight read by anything else (the user's own torch::mm on it) is not
// seen.
//
// Note [Tensor parallelism under fully_shard]: a planned layer is found by
// where its weight's elements start (storage and offset), which a transposed
// view shares. fully_shard (parallel/fsdp) moves every parameter into its
// unit's flat buffer, so several weights then share one storage at different
// offsets, and that storage keeps its identity while the unit is freed and
// gathered again (only its bytes come and go). The engine calls
// tensor_parallel_weights_moved() once it has moved them, and each planned
// layer is found at its new place: 2-D parallelism, fully_shard over the dp
// group of a module split over tp.
// An observer can change values in place, never shapes or an operator's
// arguments. So what needs that is left to the user's forward (gathering a
// colwise output, sequence parallelism's collectives above) or refused
// rather than half done: a vocabulary-sharded (rowwise) Embedding, whose
// lookup needs shifted ids. Our own families do all of it through
// interfaces::TensorParallelHooks (tensor_parallel.h).
//
// Exceptions cannot leave a RecordFunction callback: a collective that fails
// inside forward fills the output with NaN, prints one line, and check()
// rethrows it. Backward's collectives throw as usual.
#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/comm/group.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"

namespace scaletrain::parallel::tensor {

enum class ParallelStyle { Colwise, Rowwise, ColwiseFromSequence, RowwiseToSequence, SequenceParallel };
inline constexpr ParallelStyle colwise = ParallelStyle::Colwise;
inline constexpr ParallelStyle rowwise = ParallelStyle::Rowwise;
inline constexpr ParallelStyle colwise_from_sequence = ParallelStyle::ColwiseFromSequence;
inline constexpr ParallelStyle rowwise_to_sequence = ParallelStyle::RowwiseToSequence;
inline constexpr ParallelStyle sequence_parallel = ParallelStyle::SequenceParallel;
const char* style_name(ParallelStyle s);  // "colwise", ..., "sequence_parallel"

// (submodule name or fnmatch pattern, style), applied in order.
using ModulePlan = std::vector<std::pair<std::string, ParallelStyle>>;

struct ParallelizeOptions {
  // Broadcast every parameter from tp rank 0 before splitting, so all ranks
  // split the same model even if their initializations differed.
  bool broadcast_initial_weights = true;
};

// What parallelize_module did. While it lives, the planned submodules run
// tensor-parallel; destroy it only after the last forward and backward.
class TensorParallelModule {
 public:
  ~TensorParallelModule();
  TensorParallelModule(const TensorParallelModule&) = delete;
  TensorParallelModule& operator=(const TensorParallelModule&) = delete;

  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  // Every parameter's layout, in named_parameters() order: for
  // gather_full_parameters, grad_norm_params and clip_grad_norm.
  const TensorParallelPlan& plan() const { return plan_; }
  // Throws the first failure of a collective run inside forward, if any.
  void check() const;

  struct Hooks;  // parallelize_module.cpp

 private:
  friend std::unique_ptr<TensorParallelModule> parallelize_module(std::shared_ptr<torch::nn::Module>, comm::Group&,
                                                                  const ModulePlan&, ParallelizeOptions);
  TensorParallelModule(std::shared_ptr<torch::nn::Module> module, TensorParallelPlan plan);

  std::shared_ptr<torch::nn::Module> module_;
  TensorParallelPlan plan_;
  std::shared_ptr<Hooks> hooks_;
};

// Splits the planned submodules' parameters in place (they keep their
// identity; build the optimizer afterwards) and makes them compute
// tensor-parallel. Collective over `tp`, which must outlive the result.
// Throws UsageError naming the pattern or module for: a pattern that
// matches no submodule, a module matched twice or already parallelized, a
// module that is not a Linear or an Embedding (any module for
// sequence_parallel, if it has parameters), an Embedding in any style but
// colwise, an Embedding with max_norm, a dimension that tp does not divide,
// or a parameter both split and sequence_parallel.
std::unique_ptr<TensorParallelModule> parallelize_module(std::shared_ptr<torch::nn::Module> module, comm::Group& tp,
                                                         const ModulePlan& plan, ParallelizeOptions options = {});

// Whether `weight` is the weight of a Linear a live TensorParallelModule planned.
bool is_tensor_parallel_weight(const at::Tensor& weight);

// Finds every planned layer again after an engine gave the weights new
// storage (Note [Tensor parallelism under fully_shard]).
void tensor_parallel_weights_moved();

}  // namespace scaletrain::parallel::tensor
