#pragma once
// QLoRA's frozen base: every models::Linear of a model (the linear layers of
// the blocks; embeddings and output heads are not models::Linear) keeps its
// weight in NF4 (Note [NF4 parameters] in models/linear.h), and LoRA
// adapters (models/lora.h) train on top of it in the parameter dtype.
//
// Quantization is per tensor (blocks of 64 along the flattened weight, the
// last one short when the size is not a multiple: nothing is padded into
// the model), so it is the same whoever does it: every rank quantizes the
// same full-precision weight to the same bytes, and an engine that keeps a
// shard of those bytes keeps what the single-process model holds.
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "scaletrain/models/causal_lm.h"
#include "scaletrain/interfaces/deferred.h"
#include "scaletrain/precision/nf4.h"

namespace scaletrain::models {

// Quantizes every models::Linear of `model`. Materialized weights are
// quantized now; a deferred model (built without bytes) gets NF4 parameters
// without bytes, filled later through an NF4Source. Returns the number of
// layers quantized; throws UsageError when the model has none.
int64_t quantize_base(CausalLM& model, const precision::NF4Options& o);

// True for the parameters of Note [NF4 parameters].
bool is_nf4_parameter(const std::string& name);

// Produces the bytes of NF4 parameters from full-precision weights, one
// layer at a time: the layer's weight is read whole through `read` (a
// tensor of the weight's shape and the model's dtype, filled with what the
// layer's "weight" would have held), quantized, and kept until another
// layer is asked for (a layer's four parameters come one after another).
// So no more than one layer's full-precision weight exists at a time.
class NF4Source {
 public:
  using Read = std::function<void(const std::string& weight_name, at::Tensor& out)>;
  // `model` after quantize_base().
  NF4Source(const CausalLM& model, Read read);
  bool owns(const std::string& name) const { return layers_.count(name) > 0; }
  // The whole byte tensor of NF4 parameter `name`.
  at::Tensor bytes(const std::string& name);

 private:
  struct Layer {
    std::string weight_name;  // "<layer>.weight"
    std::string suffix;       // "weight_nf4", ...
    std::vector<int64_t> shape;
    at::ScalarType dtype;
    precision::NF4Options options;
  };
  std::map<std::string, Layer> layers_;  // by NF4 parameter name
  Read read_;
  std::string cached_;  // weight name of `quantized_`
  precision::NF4Weight quantized_;
};

// `base` for every other parameter; NF4 parameters from the weights `base`
// gives for "<layer>.weight".
interfaces::InitFn with_nf4_init(interfaces::InitFn base, const CausalLM& model);

}  // namespace scaletrain::models
