#pragma once
// Hugging Face Hub model directories, written: the weights as one
// `model.safetensors`, or as shards `model-00001-of-0000N.safetensors` with
// `model.safetensors.index.json` ({"metadata": {"total_size": BYTES},
// "weight_map": {tensor: file}}), each file with metadata {"format": "pt"}.
// The reading side is checkpoint/hub.h. Names and values are the caller's:
// mapping a model's parameters to Hub names is the model family's business.
//
// Note [Hub shards]
// Shards are cut as huggingface_hub's split_torch_state_dict_into_shards
// does: tensors in the caller's order fill the current shard until the next
// one would take it past `max_shard_bytes`, which then starts a new shard; a
// tensor larger than the limit on its own gets a shard of its own. Sizes are
// tensor bytes (what "total_size" counts), not file sizes (each file adds its
// header). One shard is written as model.safetensors, without an index.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "scaletrain/checkpoint/safetensors.h"

namespace scaletrain::hub {

// Hugging Face's default max_shard_size ("5GB").
constexpr int64_t kDefaultMaxShardBytes = 5'000'000'000;

// "5GB", "500MB", "2.5GB", "64KB", "60000" (bytes), "2GiB": decimal units
// as Hugging Face reads them (KB = 10^3, MB = 10^6, GB = 10^9, TB = 10^12),
// binary ones with "i" (KiB = 2^10 ...). Throws UsageError naming the text
// when it is not a positive size.
int64_t parse_shard_size(const std::string& text);

// One tensor of a Hub directory: its name, dtype and shape there, and where
// its bytes come from (called once, when its shard is written; the result
// must be contiguous, of `dtype` and `shape`, and stay alive until the next
// call).
struct HubTensor {
  std::string name;
  checkpoint::Dtype dtype = checkpoint::Dtype::F32;
  std::vector<int64_t> shape;
  std::function<at::Tensor()> read;
  int64_t nbytes() const;
};

// The shards of Note [Hub shards]: for each, the positions of its tensors in
// `tensors`.
std::vector<std::vector<std::size_t>> plan_hub_shards(const std::vector<HubTensor>& tensors, int64_t max_shard_bytes);

// Writes the weights into the existing directory `dir` (Note [Hub shards]),
// one tensor in memory at a time. Returns the file names written.
// Throws UsageError naming the file on a write failure.
std::vector<std::string> write_hub_weights(const std::string& dir, const std::vector<HubTensor>& tensors,
                                           int64_t max_shard_bytes);

}  // namespace scaletrain::hub
