#include "scaletrain/train/starting_model.h"

#include <memory>
#include <set>

#include "scaletrain/checkpoint/safetensors.h"
#include "scaletrain/hub/hf_gpt2.h"
#include "scaletrain/hub/hub_load.h"
#include "scaletrain/hub/peft_adapter.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/models/lora.h"
#include "scaletrain/models/qlora.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {

namespace fsdp = parallel::fsdp;

namespace {
// model.init_from reads Hugging Face GPT-2 files (make_plan refuses it for
// other families).
models::GPT as_gpt2(const models::ModelPtr& model) {
  auto gpt = std::dynamic_pointer_cast<models::GPTImpl>(model);
  if (!gpt) throw UsageError("model.init_from reads GPT-2 checkpoints only in this build");
  return models::GPT(gpt);
}
}  // namespace

// model.init_from: an HF GPT-2 file or a Hub directory into the whole, not
// yet wrapped model.
void init_from(models::ModelPtr& model, const std::string& path) {
  if (path.empty()) return;
  if (model->config().family != "gpt2") return hub::load_hub_weights(*model, path);
  try {
    models::GPT gpt = as_gpt2(model);
    hub::import_hf_gpt2(gpt, path);
  } catch (const checkpoint::SafetensorsError& e) {
    throw UsageError("model.init_from: " + std::string(e.what()));
  }
}

namespace {

interfaces::InitFn hf_init(const models::ModelPtr& model, const std::string& path) {
  if (model->config().family != "gpt2") return hub::hub_init(*model, path);
  try {
    return hub::hf_gpt2_init(as_gpt2(model), path);
  } catch (const checkpoint::SafetensorsError& e) {
    throw UsageError("model.init_from: " + std::string(e.what()));
  }
}

// The adapters' starting values, by parameter name: drawn (models/lora.h),
// or those of finetune.adapter_from, checked against the adapted `model`.
interfaces::InitFn adapter_values(const StartingPlan& s, const models::LoraOptions& lora,
                                  const models::CausalLM& model) {
  if (s.adapter_from.empty())
    return [lora](const std::string& name, at::Tensor& out) { models::init_adapter(name, out, lora); };
  auto a = std::make_shared<hub::Adapter>(hub::read_adapter(s.adapter_from, model.config().family));
  hub::check_adapter_fits(*a, model, s.adapter_from);
  return [a](const std::string& name, at::Tensor& out) {
    torch::NoGradGuard no_grad;
    out.copy_(a->tensors.at(name));
  };
}

// An eager model's adapters (lora; qlora models are built by whole_qlora_model).
void adapt(models::CausalLM& model, const StartingPlan& s) {
  if (!s.lora) return;
  models::apply_lora(model, *s.lora);
  if (s.adapter_from.empty()) return;
  const interfaces::InitFn values = adapter_values(s, *s.lora, model);
  for (auto& item : model.named_parameters())
    if (models::is_adapter_parameter(item.key())) values(item.key(), item.value());
}

// A deferred slice source that fills NF4 parameters: each rank reads the
// layer's whole weight (one layer at a time), quantizes it and keeps its part.
fsdp::FlatParam::SliceFill with_nf4_slices(fsdp::FlatParam::SliceFill base, const models::CausalLM& model) {
  auto source = std::make_shared<models::NF4Source>(model, [base](const std::string& name, at::Tensor& w) {
    at::Tensor flat = w.view(-1);
    base(name, 0, flat.numel(), flat);
  });
  return [base = std::move(base), source](const std::string& name, int64_t begin, int64_t count, at::Tensor& out) {
    if (!source->owns(name)) return base(name, begin, count, out);
    out.copy_(source->bytes(name).narrow(0, begin, count));
  };
}

// A deferred slice source that also draws adapters (they are not in the
// files): the whole adapter is drawn and this rank's elements kept.
fsdp::FlatParam::SliceFill with_adapter_slices(fsdp::FlatParam::SliceFill base, const models::CausalLM& model,
                                                interfaces::InitFn values) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& item : model.named_parameters())
    if (models::is_adapter_parameter(item.key())) shapes[item.key()] = item.value().sizes().vec();
  return [base = std::move(base), shapes = std::move(shapes), values = std::move(values)](
             const std::string& name, int64_t begin, int64_t count, at::Tensor& out) {
    auto it = shapes.find(name);
    if (it == shapes.end()) return base(name, begin, count, out);
    at::Tensor whole = at::empty(it->second, out.options());
    values(name, whole);
    out.copy_(whole.view(-1).narrow(0, begin, count));
  };
}

// finetune.method qlora on a strategy that holds the whole model: built
// without bytes, quantized in shape, then made whole one tensor at a time
// (each layer's full-precision weight read or drawn, quantized and dropped),
// so no rank ever holds the full-precision model.
models::ModelPtr whole_qlora_model(const StartingPlan& s, const models::ModelConfig& mcfg, at::ScalarType param_dtype) {
  models::ModelPtr model = models::make_model(mcfg, /*materialize=*/false);
  interfaces::set_deferred_dtype(*model, param_dtype);
  interfaces::InitFn init =
      s.init_from.empty()
          ? interfaces::init_through(at::kFloat, [raw = model.get()](const std::string& name,
                                                                     at::Tensor& t) { raw->init_parameter(name, t); })
          : hf_init(model, s.init_from);  // checks the files against the unquantized model
  models::quantize_base(*model, *s.nf4);
  models::apply_lora(*model, *s.lora);
  init = models::with_nf4_init(init, *model);
  const interfaces::InitFn values = adapter_values(s, *s.lora, *model);
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters()) {
    at::Tensor& p = item.value();
    if (p.numel() > 0) interfaces::alloc_storage(p);
    (models::is_adapter_parameter(item.key()) ? values : init)(item.key(), p);
  }
  return model;
}

}  // namespace

// The whole model on this rank, loaded from model.init_from, with its
// adapters (QLoRA's built tensor by tensor, whole_qlora_model).
models::ModelPtr whole_model(const StartingPlan& s, const models::ModelConfig& mcfg, at::ScalarType param_dtype,
                             const at::Device& device) {
  models::ModelPtr model;
  if (s.nf4) {
    model = whole_qlora_model(s, mcfg, param_dtype);
  } else {
    model = models::make_model(mcfg);
    model->to(param_dtype);
    init_from(model, s.init_from);
    adapt(*model, s);
  }
  model->to(device);  // parameters and buffers (Note [One device per rank])
  return model;
}

// A model without parameter bytes in the parameter dtype, and how the engine
// fills each parameter: drawn in fp32, or read from model.init_from (whole
// tensors, or each rank its slice), with the adapters and NF4 of the
// finetune section made when the engine asks.
DeferredModel deferred_model(const Plan& plan) {
  const models::ModelConfig& mcfg = plan.model;
  const StartingPlan& s = plan.engines.start;
  DeferredModel d;
  d.model = models::make_model(mcfg, /*materialize=*/false);
  interfaces::set_deferred_dtype(*d.model, plan.policy.param, plan.device);
  if (s.init_from.empty())
    d.init = interfaces::init_through(
        at::kFloat,
        [raw = d.model.get()](const std::string& name, at::Tensor& t) { raw->init_parameter(name, t); });
  else if (plan.dims.tp == 1 && d.model->config().family != "gpt2")
    d.slice_init = hub::hub_slice_init(*d.model, s.init_from);  // each rank reads its part
  else
    d.init = hf_init(d.model, s.init_from);  // one tensor at a time from the file
  if (s.lora) {                              // deferred adapters (and NF4 bytes), made when the engine asks
    if (s.nf4) models::quantize_base(*d.model, *s.nf4);
    models::apply_lora(*d.model, *s.lora);
    const interfaces::InitFn values = adapter_values(s, *s.lora, *d.model);
    if (d.init) {
      if (s.nf4) d.init = models::with_nf4_init(d.init, *d.model);
      d.init = [base = d.init, values](const std::string& name, at::Tensor& t) {
        (models::is_adapter_parameter(name) ? values : base)(name, t);
      };
    }
    if (d.slice_init) {
      if (s.nf4) d.slice_init = with_nf4_slices(d.slice_init, *d.model);
      d.slice_init = with_adapter_slices(d.slice_init, *d.model, values);
    }
  }
  return d;
}

}  // namespace scaletrain::train
