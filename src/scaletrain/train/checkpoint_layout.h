#pragma once
// What a strategy's rank holds, described for checkpoints (checkpoint::Layout:
// pieces of full tensors). The engines and the checkpoint format meet here,
// in the training glue, so checkpoint/ never includes an engine.
#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"

namespace scaletrain::train {

// The shards of a sharded engine (Note [Flat parameters]): trainable shards
// are optimizer states 0..n-1 in order.
checkpoint::Layout sharded_layout(const parallel::fsdp::ShardedDataParallel& engine);
// `local` describes a tensor-parallel rank's parameters (replicated_layout or
// sharded_layout of the split model); the result describes the same tensors
// as pieces of the full parameters: each piece of a split parameter becomes
// the runs it occupies in the full tensor (parallel::tensor::full_runs), and
// pieces of replicated parameters are saved by tp rank 0 only. So the
// checkpoint holds the single-process model's tensors and any layout loads it.
checkpoint::Layout tensor_parallel_layout(checkpoint::Layout local, const parallel::tensor::TensorParallelPlan& plan);

// Pipeline chunks: appends `chunk`'s slots to `out`, its optimizer states
// numbered after the `*states` already there (which it advances), and takes
// its writer flag; so one optimizer over every chunk's tensors in turn maps
// onto the layout.
void append_chunk_layout(checkpoint::Layout& out, checkpoint::Layout chunk, int* states);

// A user's module: appends its non-empty buffers (BatchNorm's running
// statistics) to `l`, each whole, written where `saved` (every rank loads
// them). Throws UsageError for a buffer that is not contiguous.
void append_buffers(checkpoint::Layout& l, const torch::nn::Module& module, bool saved);

}  // namespace scaletrain::train
