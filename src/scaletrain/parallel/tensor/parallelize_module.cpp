#include "scaletrain/parallel/tensor/parallelize_module.h"

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <fnmatch.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "scaletrain/parallel/tensor/tp_comm.h"
#include "scaletrain/util/error.h"

namespace scaletrain::parallel::tensor {

// The first failure inside forward, kept for check() (Note [Tensor
// parallelism without forward hooks]).
struct TensorParallelModule::Hooks {
  std::vector<at::Tensor> weights;  // the planned linears' weights (parameters), registered below
  std::mutex mu;
  std::string failure;
};

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

// A planned Linear, found by its weight's storage and offset when a product
// reads it (Note [Tensor parallelism under fully_shard]).
struct PlannedLinear {
  std::string name;
  ParallelStyle style = ParallelStyle::Colwise;
  comm::Group* tp = nullptr;
  std::shared_ptr<TensorParallelModule::Hooks> hooks;
  at::Tensor weight;  // the parameter, to find its place again after it moved
  at::Tensor bias;    // rowwise_to_sequence: taken out again on ranks other than 0
};

}  // namespace

const char* style_name(ParallelStyle s) {
  switch (s) {
    case ParallelStyle::Colwise:
      return "colwise";
    case ParallelStyle::Rowwise:
      return "rowwise";
    case ParallelStyle::ColwiseFromSequence:
      return "colwise_from_sequence";
    case ParallelStyle::RowwiseToSequence:
      return "rowwise_to_sequence";
    case ParallelStyle::SequenceParallel:
      return "sequence_parallel";
  }
  return "?";
}

namespace {

bool is_colwise(ParallelStyle s) { return s == ParallelStyle::Colwise || s == ParallelStyle::ColwiseFromSequence; }
bool is_rowwise(ParallelStyle s) { return s == ParallelStyle::Rowwise || s == ParallelStyle::RowwiseToSequence; }

// Where a weight's elements start: its storage and its offset there (a
// transposed view, as the product reads it, starts at the same place).
using Place = std::pair<const c10::StorageImpl*, int64_t>;
struct PlaceHash {
  size_t operator()(const Place& p) const {
    return std::hash<const void*>()(p.first) ^ (std::hash<int64_t>()(p.second) * 0x9e3779b97f4a7c15ULL);
  }
};
Place place_of(const at::Tensor& t) { return {t.storage().unsafeGetStorageImpl(), t.storage_offset()}; }

std::mutex g_mu;
at::CallbackHandle g_callback = 0;
thread_local int t_busy = 0;  // our own operators inside a callback are not looked at

std::unordered_map<Place, PlannedLinear, PlaceHash>& planned() {
  static std::unordered_map<Place, PlannedLinear, PlaceHash> m;
  return m;
}

struct Call : at::ObserverContext {
  PlannedLinear linear;
  at::Tensor input;         // the product's left operand (the layer's input)
  at::Tensor added;         // addmm: beta * self, the part of the output that is not a product
  uint64_t first_node = 0;  // the sequence number of the first autograd node the call creates
};

// f's backward for one call: all-reduce the gradients this node sends to the
// call's input (slots of its outputs).
struct AllReduceSlots : torch::autograd::FunctionPostHook {
  AllReduceSlots(std::vector<size_t> slots, comm::Group* tp) : slots(std::move(slots)), tp(tp) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    variable_list out = outputs;
    for (size_t i : slots) {
      if (i >= out.size() || !out[i].defined()) continue;
      at::Tensor sum = out[i].contiguous().clone();
      all_reduce_(sum, *tp);
      out[i] = sum;
    }
    return out;
  }
  std::vector<size_t> slots;
  comm::Group* tp;
};

// Colwise: hook every node the call created that leads to its input.
void hook_input_gradient(const Call& call, const at::Tensor& out) {
  const at::Tensor& x = call.input;
  if (!x.requires_grad() || !out.grad_fn()) return;  // no gradient flows to the input
  const uint64_t end = at::sequence_number::peek();
  const Edge target = torch::autograd::impl::gradient_edge(x);
  std::vector<Node*> todo{out.grad_fn().get()};
  std::unordered_set<Node*> seen;
  size_t hooked = 0;
  while (!todo.empty()) {
    Node* n = todo.back();
    todo.pop_back();
    if (n->sequence_nr() < call.first_node || n->sequence_nr() >= end || !seen.insert(n).second) continue;
    std::vector<size_t> slots;
    for (size_t i = 0; i < n->num_outputs(); ++i) {
      const Edge& e = n->next_edge(i);
      if (e.function == target.function && e.input_nr == target.input_nr)
        slots.push_back(i);
      else if (e.function)
        todo.push_back(e.function.get());
    }
    if (slots.empty()) continue;
    hooked += slots.size();
    n->add_post_hook(std::make_unique<AllReduceSlots>(std::move(slots), call.linear.tp));
  }
  if (hooked == 0) throw std::runtime_error("found no gradient path from its output to its input");
}

// Rowwise: the partial products summed over tp, what addmm added (the
// bias) counted once. rowwise_to_sequence: the user's reduce-scatter sums
// them, so only the bias is taken out on ranks other than 0 (also where it
// is added after the product: matmul, then += b).
void reduce_output(const Call& call, const at::Tensor& out) {
  torch::NoGradGuard no_grad;
  at::Tensor y = out.data();  // the same memory, outside autograd
  comm::Group& tp = *call.linear.tp;
  if (call.linear.style == ParallelStyle::RowwiseToSequence) {
    if (tp.rank() != 0 && call.added.defined())
      y.sub_(call.added);
    else if (tp.rank() != 0 && call.linear.bias.defined())
      y.sub_(call.linear.bias);
    return;
  }
  if (call.added.defined() && tp.rank() != 0) y.sub_(call.added);
  if (y.is_contiguous()) {
    all_reduce_(y, tp);
  } else {
    at::Tensor sum = y.contiguous();
    all_reduce_(sum, tp);
    y.copy_(sum);
  }
}

void fail(const Call& call, const at::Tensor& out, const std::string& what) {
  const std::string line =
      "parallelize_module: '" + call.linear.name + "' (" + style_name(call.linear.style) + "): " + what;
  std::fprintf(stderr, "scaletrain: %s\n", line.c_str());
  if (out.defined()) {
    torch::NoGradGuard no_grad;
    out.data().fill_(std::numeric_limits<double>::quiet_NaN());
  }
  std::lock_guard<std::mutex> lock(call.linear.hooks->mu);
  if (call.linear.hooks->failure.empty()) call.linear.hooks->failure = line;
}

// The products a Linear's forward is made of (torch::nn::functional::linear:
// addmm(b, x, W.t()) for 2-d input with a bias, else matmul(x, W.t()) and
// then += b; aten::linear decomposes to the same two): which input is the
// layer's input and which the weight.
struct Product {
  const char* name;
  size_t x, weight;
};
constexpr Product kProducts[] = {{"aten::addmm", 1, 2}, {"aten::matmul", 0, 1}};

std::optional<Place> place_of(const c10::IValue& v) {
  if (!v.isTensor()) return std::nullopt;
  const at::Tensor& t = v.toTensor();
  if (!t.defined() || !t.has_storage()) return std::nullopt;
  return place_of(t);
}

// Note [A head count that tensor parallelism split]: a colwise layer gives
// each rank out/tp of its features, so a forward that reshapes that output
// with the model's whole head count (view({B, T, n_head, head_dim})) asks
// for tp times the elements there are, and libtorch's own error names
// neither the layer nor the fix. The storages of this thread's latest
// colwise outputs are remembered; a view or reshape of one of them to
// exactly tp times its elements prints one line naming the layer and what
// to change, before libtorch throws. Nothing is thrown from here (the
// callback cannot), and a shape with -1 is not judged.
struct ColwiseOutput {
  std::string name;
  int tp = 1;
  int64_t local = 0;
};
thread_local std::unordered_map<const c10::StorageImpl*, ColwiseOutput> t_colwise;

void remember_colwise(const Call& call, const at::Tensor& out) {
  if (!out.defined() || !out.has_storage() || out.dim() == 0) return;
  if (t_colwise.size() >= 64) t_colwise.clear();  // a forward's recent layers are enough
  t_colwise[out.storage().unsafeGetStorageImpl()] = {call.linear.name, call.linear.tp->size(), out.size(-1)};
}

std::optional<std::vector<int64_t>> int_list(const c10::IValue& v) {
  if (v.isIntList()) return v.toIntVector();
  if (!v.isList()) return std::nullopt;
  std::vector<int64_t> out;
  for (const c10::IValue& e : v.toListRef()) {
    if (e.isInt())
      out.push_back(e.toInt());
    else if (e.isSymInt() && !e.toSymInt().is_symbolic())
      out.push_back(e.toSymInt().expect_int());
    else
      return std::nullopt;
  }
  return out;
}

void check_reshape(const at::RecordFunction& fn) {
  const auto inputs = fn.inputs();
  if (inputs.size() < 2 || !inputs[0].isTensor()) return;
  const at::Tensor& x = inputs[0].toTensor();
  if (!x.defined() || !x.has_storage()) return;
  auto it = t_colwise.find(x.storage().unsafeGetStorageImpl());
  const auto shape = it == t_colwise.end() ? std::nullopt : int_list(inputs[1]);
  if (!shape) return;
  int64_t n = 1;
  for (int64_t d : *shape) {
    if (d < 0) return;
    n *= d;
  }
  const ColwiseOutput& c = it->second;
  if (n != x.numel() * c.tp) return;
  static std::set<std::string> told;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!told.insert(c.name).second) return;
  std::string dims;
  for (int64_t d : *shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  std::fprintf(stderr,
               "scaletrain: parallelize_module: '%s' is colwise over tp=%d, so each rank holds %lld of its %lld "
               "output features, but the forward reshapes that output to [%s] (the whole width): give the "
               "split dimension its per-rank size (for attention heads: n_head / %d heads on each rank, or -1)\n",
               c.name.c_str(), c.tp, static_cast<long long>(c.local), static_cast<long long>(c.local * c.tp),
               dims.c_str(), c.tp);
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (t_busy > 0) return nullptr;
  const char* name = fn.name();
  if (!t_colwise.empty() && (std::strcmp(name, "aten::view") == 0 || std::strcmp(name, "aten::reshape") == 0)) {
    ++t_busy;
    try {
      check_reshape(fn);
    } catch (const std::exception&) {
      // Only a hint: libtorch's own error follows either way.
    }
    --t_busy;
    return nullptr;
  }
  const Product* product = nullptr;
  for (const Product& p : kProducts)
    if (std::strcmp(name, p.name) == 0) product = &p;
  if (product == nullptr) return nullptr;
  // Backward's own products (they read the weight too) are not the layer's forward.
  if (torch::autograd::get_current_graph_task_nodes_in_graph() != nullptr) return nullptr;
  const auto inputs = fn.inputs();
  if (inputs.size() <= product->weight) return nullptr;
  const std::optional<Place> weight = place_of(inputs[product->weight]);
  if (!weight) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = planned().find(*weight);
  if (it == planned().end()) return nullptr;
  auto call = std::make_unique<Call>();
  call->linear = it->second;
  call->input = inputs[product->x].toTensor();
  if (is_rowwise(call->linear.style) && call->linear.tp->rank() != 0 && product == &kProducts[0] &&
      inputs[0].isTensor() && inputs[0].toTensor().defined()) {
    const double beta = inputs.size() > 3 && inputs[3].isScalar() ? inputs[3].toScalar().toDouble() : 1.0;
    call->added = inputs[0].toTensor().detach() * beta;
  }
  call->first_node = at::sequence_number::peek();
  return call;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  auto* call = static_cast<Call*>(ctx);
  if (call == nullptr) return;
  ++t_busy;
  at::Tensor out;
  try {
    if (fn.outputs().empty() || !fn.outputs()[0].isTensor())
      throw std::runtime_error("the output of its product was not observed");
    out = fn.outputs()[0].toTensor();
    if (is_rowwise(call->linear.style))
      reduce_output(*call, out);
    else if (call->linear.style == ParallelStyle::Colwise)
      hook_input_gradient(*call, out);  // colwise_from_sequence: the user's all-gather reduce-scatters it
    if (is_colwise(call->linear.style)) remember_colwise(*call, out);
  } catch (const std::exception& e) {
    fail(*call, out, e.what());
  }
  --t_busy;
}

// Registers the planned linears; the callback lives while any is planned.
void plan_linears(const std::vector<PlannedLinear>& linears) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (const PlannedLinear& l : linears) planned()[place_of(l.weight)] = l;
  if (g_callback == 0 && !planned().empty())
    g_callback = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_start, &on_end).needsInputs(true).needsOutputs(true).scopes(
            {at::RecordScope::FUNCTION}));
}

void unplan_linears(const std::vector<at::Tensor>& weights) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::set<const c10::TensorImpl*> gone;
  for (const at::Tensor& w : weights) gone.insert(w.unsafeGetTensorImpl());
  for (auto it = planned().begin(); it != planned().end();)
    it = gone.count(it->second.weight.unsafeGetTensorImpl()) ? planned().erase(it) : std::next(it);
  if (g_callback != 0 && planned().empty()) {
    at::removeCallback(g_callback);
    g_callback = 0;
  }
}

bool is_planned(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (const auto& entry : planned())
    if (entry.second.weight.unsafeGetTensorImpl() == weight.unsafeGetTensorImpl()) return true;
  return planned().count(place_of(weight)) > 0;
}

// One submodule the plan names, with what its style splits.
struct Target {
  std::string name;
  ParallelStyle style;
  std::shared_ptr<torch::nn::Module> module;
  int64_t weight_dim = -1;  // which dimension of the weight is split
  int64_t bias_dim = -1;    // -1: the bias (if any) is replicated
};

// Checks the module's type and the split dimension; throws UsageError naming both.
Target target_of(const std::string& name, ParallelStyle style, std::shared_ptr<torch::nn::Module> m, int tp) {
  Target t{name, style, m};
  const std::string where = "parallelize_module: '" + name + "' ";
  if (style == ParallelStyle::SequenceParallel) {
    if (m->parameters().empty())
      throw UsageError(where +
                       "has no parameters: sequence_parallel marks parameters whose gradient each rank "
                       "computes from its part of the sequence");
    return t;
  }
  int64_t extent = 0;
  std::string what;
  if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(m.get())) {
    const bool col = is_colwise(style);
    t.weight_dim = col ? 0 : 1;
    t.bias_dim = col ? 0 : -1;
    extent = col ? linear->options.out_features() : linear->options.in_features();
    what = col ? "output features" : "input features";
  } else if (auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(m.get())) {
    if (style != ParallelStyle::Colwise)
      throw UsageError(where + "is an Embedding: " + style_name(style) +
                       " does not apply (rowwise, vocabulary sharding, needs its lookup's ids shifted, which an "
                       "unmodified module cannot do); use colwise");
    if (embedding->options.max_norm())
      throw UsageError(where + "is an Embedding with max_norm: the norm of a row would be taken over this rank's "
                               "columns only");
    t.weight_dim = 1;
    extent = embedding->options.embedding_dim();
    what = "embedding dimensions";
  } else {
    throw UsageError(where + "is a " + m->name() + "; colwise and rowwise apply to torch::nn::Linear (and colwise "
                             "to torch::nn::Embedding)");
  }
  if (extent % tp != 0)
    throw UsageError(where + "(" + style_name(style) + "): its " + std::to_string(extent) + " " + what +
                     " are not divisible by the tensor-parallel degree " + std::to_string(tp));
  if (is_planned(m->named_parameters(false)["weight"]))
    throw UsageError(where + "is already tensor-parallel (given to parallelize_module before)");
  return t;
}

// The submodules the plan names, in plan order; every pattern must match.
std::vector<Target> resolve(torch::nn::Module& root, const ModulePlan& plan, int tp) {
  const auto modules = root.named_modules("", /*include_self=*/false);
  std::vector<Target> out;
  std::map<std::string, std::string> matched_by;
  for (const auto& [pattern, style] : plan) {
    bool any = false;
    for (const auto& item : modules) {
      if (fnmatch(pattern.c_str(), item.key().c_str(), 0) != 0) continue;
      any = true;
      auto [it, fresh] = matched_by.emplace(item.key(), pattern);
      if (!fresh)
        throw UsageError("parallelize_module: '" + item.key() + "' is matched by both '" + it->second + "' and '" +
                         pattern + "'");
      out.push_back(target_of(item.key(), style, item.value(), tp));
    }
    if (!any) throw UsageError("parallelize_module: '" + pattern + "' names no submodule of " + root.name());
  }
  return out;
}

}  // namespace

bool is_tensor_parallel_weight(const at::Tensor& weight) {
  return weight.defined() && weight.has_storage() && is_planned(weight);
}

TensorParallelModule::TensorParallelModule(std::shared_ptr<torch::nn::Module> module, TensorParallelPlan plan)
    : module_(std::move(module)), plan_(std::move(plan)), hooks_(std::make_shared<Hooks>()) {}

TensorParallelModule::~TensorParallelModule() { unplan_linears(hooks_->weights); }

void tensor_parallel_weights_moved() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::unordered_map<Place, PlannedLinear, PlaceHash> moved;
  for (auto& entry : planned()) moved[place_of(entry.second.weight)] = std::move(entry.second);
  planned() = std::move(moved);
}

void TensorParallelModule::check() const {
  std::lock_guard<std::mutex> lock(hooks_->mu);
  if (!hooks_->failure.empty()) throw std::runtime_error(hooks_->failure);
}

std::unique_ptr<TensorParallelModule> parallelize_module(std::shared_ptr<torch::nn::Module> module, comm::Group& tp,
                                                         const ModulePlan& plan, ParallelizeOptions options) {
  if (!module) throw UsageError("parallelize_module: no module given");
  const std::vector<Target> targets = resolve(*module, plan, tp.size());
  // Which dimension each parameter is split along, by full name; which
  // modules' parameters see part of the sequence.
  std::unordered_map<std::string, int64_t> split;
  std::vector<std::string> sequence_parts;
  for (const Target& t : targets) {
    if (t.style == ParallelStyle::SequenceParallel) {
      sequence_parts.push_back(t.name + ".");
      continue;
    }
    split[t.name + ".weight"] = t.weight_dim;
    if (t.bias_dim >= 0) split[t.name + ".bias"] = t.bias_dim;
  }
  // Every parameter's layout first: a refused plan splits nothing.
  TensorParallelPlan layout;
  layout.tp = &tp;
  for (const auto& item : module->named_parameters()) {
    ParamLayout l;
    l.name = item.key();
    l.full_shape = item.value().sizes().vec();
    auto it = split.find(item.key());
    if (it != split.end()) l.dim = it->second;
    for (const std::string& prefix : sequence_parts)
      if (item.key().rfind(prefix, 0) == 0) l.partial_grad = true;
    if (l.partial_grad && l.sharded())
      throw UsageError("parallelize_module: '" + item.key() +
                       "' is split by its own style and cannot also be sequence_parallel");
    layout.params.push_back(std::move(l));
  }
  torch::NoGradGuard no_grad;
  size_t i = 0;
  for (auto& item : module->named_parameters()) {
    at::Tensor p = item.value();
    const ParamLayout& l = layout.params[i++];
    if (options.broadcast_initial_weights && tp.size() > 1) tp.broadcast(p.data(), 0).wait();
    if (l.sharded()) p.set_data(split_parameter(p.data(), l, tp.rank(), tp.size()));
    if (l.partial_grad && tp.size() > 1 && p.requires_grad()) {
      // Note [Sequence-parallel gradients] (tensor_parallel.h): each rank's
      // gradient covers its part of the sequence; sum before accumulation.
      comm::Group* g = &tp;
      p.register_hook([g](const at::Tensor& grad) {
        at::Tensor full = grad.contiguous().clone();
        all_reduce_(full, *g);
        return full;
      });
    }
  }
  std::unique_ptr<TensorParallelModule> out(new TensorParallelModule(module, std::move(layout)));
  std::vector<PlannedLinear> linears;
  for (const Target& t : targets) {
    auto* linear = dynamic_cast<torch::nn::LinearImpl*>(t.module.get());
    if (linear == nullptr) continue;  // a colwise Embedding needs no communication
    linears.push_back(PlannedLinear{t.name, t.style, &tp, out->hooks_, linear->weight, linear->bias});
    out->hooks_->weights.push_back(linear->weight);
  }
  plan_linears(linears);
  return out;
}

}  // namespace scaletrain::parallel::tensor
