#include "scaletrain/parallel/ddp/ddp.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/torch.h>

#include <chrono>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "scaletrain/comm/compat.h"
#include "scaletrain/parallel/ddp/ddp_comm.h"
#include "scaletrain/parallel/ddp/sync_batchnorm.h"
#include "scaletrain/parallel/fsdp/gather_on_use.h"
#include "scaletrain/precision/fp8.h"

namespace scaletrain::parallel {

namespace {

struct Bucket {
  std::vector<size_t> params;  // indices into State::params
  at::Tensor flat;             // gradients, in the parameters' dtype
  at::Tensor staging;          // comm-dtype copy when it differs, else undefined
  int pending = 0;             // gradients still missing in this backward
  comm::Work work;
  bool started = false;
};

}  // namespace

// Everything the autograd hooks touch. Hooks hold a weak_ptr, so a hook that
// outlives its DDP object (the module lives on) does nothing.
struct DistributedDataParallel::State : std::enable_shared_from_this<State> {
  comm::Group* group = nullptr;
  DDPOptions options;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> buffers;     // broadcast from rank 0 after each synchronized backward (broadcast_buffers)
  std::vector<comm::Group*> group_of;  // each parameter's averaging group (expert parameters: expert_group)
  std::vector<at::Tensor> views;       // params[i]'s gradient slot in its bucket
  std::vector<size_t> bucket_of;
  std::vector<bool> ready;
  std::vector<Bucket> buckets;
  // Keeps the AccumulateGrad nodes alive: a parameter only holds them weakly,
  // and a new node would not carry our hook.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  bool sync = true;
  bool in_backward = false;
  // Note [Bucket rebuild]: parameters in the order their gradients became
  // ready in this backward, recorded until the buckets have been rebuilt.
  std::vector<size_t> ready_order;
  bool rebuilt = false;
  size_t next_to_start = 0;
  double wait_ms = 0;
  int64_t bytes = 0;
  std::mutex mu;  // hooks may run on autograd worker threads (CUDA)

  void on_grad_ready(size_t i);
  void start_ready_buckets();
  void finish_backward();
  void reset_step();
  bool recording() const { return options.rebuild_buckets && !rebuilt; }
  // Lays the gradients out in buckets, filling them in `order` (see
  // DDPOptions for the caps). Gradients present in .grad are carried over into
  // the new bucket views, and .grad becomes those views.
  void build_buckets(const std::vector<size_t>& order);
  // Rebuilds the buckets in rank 0's recorded ready order (a collective).
  void rebuild_buckets();
};

namespace {

// Parameters (indices into params) of each bucket, in bucket order.
std::vector<std::vector<size_t>> bucket_groups(const std::vector<at::Tensor>& params,
                                               const std::vector<comm::Group*>& group_of,
                                               const std::vector<size_t>& order, const DDPOptions& options) {
  auto bytes_of = [&](size_t k) { return params[k].numel() * params[k].element_size(); };
  // A bucket holds one dtype, averaged over one group.
  auto same_dtype = [&](size_t a, size_t b) {
    return params[a].scalar_type() == params[b].scalar_type() && group_of[a] == group_of[b];
  };
  // Note [Bucket tail]: from the end of the order, buckets of at most
  // last_bucket_cap_bytes, then tail_growth times that, ..., while below
  // bucket_cap_bytes (a parameter larger than its cap gets a bucket of its own).
  // The first bucket is kept out of the tail: in a model smaller than the
  // taper the tail would otherwise take it, and the first all-reduce would
  // wait for the taper's largest bucket.
  size_t first_end = 0;
  for (int64_t bytes = 0; first_end < order.size(); ++first_end) {
    const size_t k = order[first_end];
    if (first_end > 0 && (bytes >= options.first_bucket_cap_bytes || !same_dtype(k, order[0]))) break;
    bytes += bytes_of(k);
  }
  std::vector<std::vector<size_t>> tail;
  size_t head_end = order.size();
  if (options.last_bucket_cap_bytes > 0) {
    double cap = static_cast<double>(options.last_bucket_cap_bytes);
    int64_t bytes = 0;
    while (head_end > first_end && cap < options.bucket_cap_bytes) {
      const size_t k = order[head_end - 1];
      if (!tail.empty() && !tail.back().empty() && (bytes + bytes_of(k) > cap || !same_dtype(k, tail.back().front()))) {
        cap *= options.tail_growth;
        bytes = 0;
        if (cap >= options.bucket_cap_bytes) break;
        tail.emplace_back();
      }
      if (tail.empty()) tail.emplace_back();
      tail.back().push_back(k);
      bytes += bytes_of(k);
      --head_end;
    }
  }
  // The rest from the front: the first bucket up to first_bucket_cap_bytes,
  // later ones up to bucket_cap_bytes (each closes once it reaches its cap).
  std::vector<std::vector<size_t>> groups;
  int64_t bytes = 0;
  for (size_t n = 0; n < head_end; ++n) {
    const size_t k = order[n];
    const int64_t cap = groups.size() <= 1 ? options.first_bucket_cap_bytes : options.bucket_cap_bytes;
    if (groups.empty() || bytes >= cap || !same_dtype(k, groups.back().front())) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(k);
    bytes += bytes_of(k);
  }
  for (auto it = tail.rbegin(); it != tail.rend(); ++it) groups.emplace_back(it->rbegin(), it->rend());
  return groups;
}

// A parameter's place in its bucket: the bucket's memory, but not an
// autograd view of it. libtorch's Optimizer::zero_grad() calls detach_() on
// every .grad, which a view refuses (with a message about Python's
// optimizer); the detach() of a view is no view, so it detaches as any
// tensor does, and zero_() still clears the bucket's memory.
at::Tensor bucket_alias(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  return flat.narrow(0, offset, c10::multiply_integers(sizes)).view(sizes).detach();
}

}  // namespace

void DistributedDataParallel::State::build_buckets(const std::vector<size_t>& order) {
  const std::vector<std::vector<size_t>> groups = bucket_groups(params, group_of, order, options);
  torch::NoGradGuard no_grad;
  std::vector<Bucket> fresh;
  views.assign(params.size(), at::Tensor());
  bucket_of.assign(params.size(), 0);
  for (auto& members : groups) {
    Bucket b;
    b.params = members;
    int64_t numel = 0;
    for (size_t i : members) numel += params[i].numel();
    b.flat = at::zeros({numel}, params[members.front()].options());
    // fp32 means "as computed": float64 gradients stay float64.
    if (options.comm_dtype == at::kBFloat16 && b.flat.scalar_type() != at::kBFloat16)
      b.staging = at::empty({numel}, b.flat.options().dtype(options.comm_dtype));
    int64_t off = 0;
    for (size_t i : members) {
      at::Tensor& p = params[i];
      views[i] = bucket_alias(b.flat, off, p.sizes());
      if (p.grad().defined()) views[i].copy_(p.grad());
      if (options.gradient_as_bucket_view) p.mutable_grad() = views[i];
      bucket_of[i] = fresh.size();
      off += p.numel();
    }
    fresh.push_back(std::move(b));
  }
  buckets = std::move(fresh);  // frees the previous buckets' buffers
}

void DistributedDataParallel::State::rebuild_buckets() {
  // Every rank takes rank 0's order (Note [Bucket order]).
  at::Tensor order_t = at::empty({static_cast<int64_t>(params.size())}, at::kLong);
  if (group->rank() == 0) {
    if (ready_order.size() != params.size())
      throw std::logic_error("DDP: recorded " + std::to_string(ready_order.size()) + " ready gradients of " +
                             std::to_string(params.size()));
    int64_t* out = order_t.data_ptr<int64_t>();
    for (size_t k = 0; k < ready_order.size(); ++k) out[k] = static_cast<int64_t>(ready_order[k]);
  }
  if (group->kind() == comm::BackendKind::Nccl) order_t = order_t.to(params.front().device());
  ddp_comm::broadcast_coalesced(*group, {order_t}, 0);
  order_t = order_t.cpu();  // host: read element by element
  const int64_t* in = order_t.data_ptr<int64_t>();
  std::vector<size_t> order;
  std::vector<bool> seen(params.size(), false);
  for (int64_t k = 0; k < order_t.numel(); ++k) {
    const int64_t i = in[k];
    if (i < 0 || i >= static_cast<int64_t>(params.size()) || seen[i])
      throw std::runtime_error("DDP: the bucket order received from rank 0 is not a permutation of the parameters");
    seen[i] = true;
    order.push_back(static_cast<size_t>(i));
  }
  build_buckets(order);
  rebuilt = true;
}

void DistributedDataParallel::State::reset_step() {
  std::fill(ready.begin(), ready.end(), false);
  for (auto& b : buckets) {
    b.pending = static_cast<int>(b.params.size());
    b.started = false;
  }
  next_to_start = 0;
  in_backward = false;
  ready_order.clear();
}

void DistributedDataParallel::State::on_grad_ready(size_t i) {
  std::lock_guard<std::mutex> lock(mu);
  if (!sync) return;
  if (!in_backward) {
    in_backward = true;
    // Runs once backward is over, on the thread that called backward.
    torch::autograd::Engine::get_default_engine().queue_callback(
        [self = shared_from_this()] { self->finish_backward(); });
  }
  if (ready[i])
    throw std::runtime_error("DDP: gradient of '" + names[i] +
                             "' became ready twice in one backward (reentrant backward is not supported)");
  // Make .grad the bucket view again if something replaced it (zero_grad
  // that sets gradients to None, or accumulation that began under no_sync);
  // without views, copy it in.
  at::Tensor& g = params[i].mutable_grad();
  if (!g.is_same(views[i])) {
    torch::NoGradGuard no_grad;
    views[i].copy_(g);
    if (options.gradient_as_bucket_view) g = views[i];
  }
  ready[i] = true;
  if (recording()) ready_order.push_back(i);
  Bucket& b = buckets[bucket_of[i]];
  if (--b.pending == 0) start_ready_buckets();
}

void DistributedDataParallel::State::start_ready_buckets() {
  while (next_to_start < buckets.size() && buckets[next_to_start].pending == 0) {
    Bucket& b = buckets[next_to_start++];
    comm::Group* g = group_of[b.params.front()];
    if (g == options.expert_group && options.expert_scale != 1.0) {
      torch::NoGradGuard no_grad;
      b.flat.mul_(options.expert_scale);
    }
    if (options.fp8_comm) {
      b.work = precision::fp8_all_reduce_avg(*g, b.flat, *options.fp8_comm);
      bytes += precision::fp8_all_reduce_bytes(b.flat.numel(), g->size());
    } else {
      b.work = ddp_comm::start_bucket_average(*g, b.flat, b.staging);
      bytes += (b.staging.defined() ? b.staging : b.flat).nbytes();
    }
    b.started = true;
  }
}

void DistributedDataParallel::State::finish_backward() {
  std::lock_guard<std::mutex> lock(mu);
  std::vector<std::string> missing;
  for (size_t i = 0; i < params.size(); ++i) {
    if (ready[i]) continue;
    if (!options.find_unused_parameters) {
      missing.push_back(names[i]);
      continue;
    }
    // Unused here: contributes zero (another rank may have used it).
    torch::NoGradGuard no_grad;
    views[i].zero_();
    at::Tensor& g = params[i].mutable_grad();
    if (options.gradient_as_bucket_view || !g.defined())
      g = options.gradient_as_bucket_view ? views[i] : views[i].clone();
    ready[i] = true;
    if (recording()) ready_order.push_back(i);
    --buckets[bucket_of[i]].pending;
  }
  if (!missing.empty()) {
    std::ostringstream s;
    s << "DDP: " << missing.size() << " parameter(s) received no gradient in this backward (";
    for (size_t k = 0; k < missing.size() && k < 5; ++k) s << (k ? ", " : "") << missing[k];
    if (missing.size() > 5) s << ", ...";
    s << "); set find_unused_parameters if parts of the model are legitimately unused";
    reset_step();
    throw std::runtime_error(s.str());
  }
  start_ready_buckets();
  auto t0 = std::chrono::steady_clock::now();
  for (auto& b : buckets) {
    b.work.wait();
    if (b.staging.defined()) b.flat.copy_(b.staging);
  }
  if (!options.gradient_as_bucket_view) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad().copy_(views[i]);
  }
  if (!buffers.empty()) ddp_comm::broadcast_coalesced(*group, buffers, 0);
  wait_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  // The first backward that communicated has shown the real gradient order;
  // from the next step on the buckets follow it (Note [Bucket rebuild]).
  if (recording()) {
    try {
      rebuild_buckets();
    } catch (...) {
      reset_step();
      throw;
    }
  }
  reset_step();
}

namespace {

// The hook after a parameter's gradient accumulation (Note [Bucket rebuild]
// and on_grad_ready); a live one also marks the parameter as taken.
struct ReadyHook final : torch::autograd::FunctionPostHook {
  ReadyHook(std::weak_ptr<DistributedDataParallel::State> s, size_t i) : state(std::move(s)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto st = state.lock()) st->on_grad_ready(index);
    return outputs;
  }
  std::weak_ptr<DistributedDataParallel::State> state;
  size_t index;
};

bool reduced_by_live_ddp(const at::Tensor& p) {
  if (!p.requires_grad() || !p.is_leaf()) return false;
  for (const auto& hook : torch::autograd::impl::grad_accumulator(p)->post_hooks()) {
    const auto* ready = dynamic_cast<const ReadyHook*>(hook.get());
    if (ready != nullptr && !ready->state.expired()) return true;
  }
  return false;
}

// One device for every parameter; no parameter already reduced by a live DDP
// (a module wrapped twice would average its gradients twice per backward),
// nor sharded by fully_shard (its storage is a unit's flat buffer, which DDP
// would read as a whole parameter).
void check_module(const torch::nn::Module& module) {
  const auto named = module.named_parameters();
  for (const auto& item : named) {
    const at::Tensor& p = item.value();
    if (p.device() != named[0].value().device())
      throw std::invalid_argument("DDP: parameters on different devices: '" + named[0].key() + "' on " +
                                  named[0].value().device().str() + ", '" + item.key() + "' on " + p.device().str());
    if (p.has_storage() && fsdp::GatherOnUse::claimed(p.storage().unsafeGetStorageImpl()))
      throw std::invalid_argument("DDP: parameter '" + item.key() +
                                  "' is already sharded by fully_shard (the module is wrapped twice)");
    if (reduced_by_live_ddp(p))
      throw std::invalid_argument("DDP: parameter '" + item.key() +
                                  "' is already in another live DDP (the module is wrapped twice)");
  }
  const std::string unbound = unbound_sync_batchnorm(module);
  if (!unbound.empty())
    throw std::invalid_argument("DDP: SyncBatchNorm '" + unbound +
                                "' is bound to no group: call convert_sync_batchnorm(module, group) first");
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, comm::Group& group,
                                                 DDPOptions options)
    : module_(std::move(module)), options_(options), state_(std::make_shared<State>()) {
  if (options_.comm_dtype != at::kFloat && options_.comm_dtype != at::kBFloat16)
    throw std::invalid_argument("DDP: comm_dtype must be float32 or bfloat16");
  if (options_.fp8_comm && options_.comm_dtype != at::kFloat)
    throw std::invalid_argument("DDP: FP8 gradient communication replaces comm_dtype, which must stay float32");
  if (options_.bucket_cap_bytes <= 0 || options_.first_bucket_cap_bytes <= 0)
    throw std::invalid_argument("DDP: bucket caps must be positive");
  if (options_.last_bucket_cap_bytes < 0) throw std::invalid_argument("DDP: the last bucket's cap must be >= 0");
  if (!(options_.tail_growth >= 1)) throw std::invalid_argument("DDP: tail_growth must be >= 1");
  check_module(*module_);
  State& s = *state_;
  s.group = &group;
  s.options = options_;

  if (static_cast<bool>(options_.expert_param) != (options_.expert_group != nullptr))
    throw std::invalid_argument("DDP: expert_param and expert_group go together");
  auto is_expert = [&](const std::string& name) { return options_.expert_param && options_.expert_param(name); };

  // 1. Every rank starts from rank 0's weights (an expert's from the first
  // rank of its expert group).
  std::vector<at::Tensor> states, expert_states;
  for (auto& item : module_->named_parameters())
    (is_expert(item.key()) ? expert_states : states).push_back(item.value());
  if (options_.broadcast_buffers)
    for (auto& b : module_->buffers()) {
      states.push_back(b);
      s.buffers.push_back(b);
    }
  ddp_comm::broadcast_coalesced(group, states, 0);
  if (!expert_states.empty()) ddp_comm::broadcast_coalesced(*options_.expert_group, expert_states, 0);

  // 2. Buckets, in reverse registration order until rebuilt (Note [Bucket rebuild]).
  for (auto& item : module_->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    s.names.push_back(item.key());
    s.params.push_back(item.value());
    s.group_of.push_back(is_expert(item.key()) ? options_.expert_group : &group);
  }
  if (s.params.empty()) throw std::invalid_argument("DDP: the module has no trainable parameters");
  std::vector<size_t> reverse;
  for (size_t k = s.params.size(); k-- > 0;) reverse.push_back(k);
  s.ready.assign(s.params.size(), false);
  s.build_buckets(reverse);
  s.reset_step();

  // 3. Hooks after each gradient's accumulation.
  std::weak_ptr<State> weak = state_;
  for (size_t i = 0; i < s.params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(s.params[i]);
    acc->add_post_hook(std::make_unique<ReadyHook>(weak, i));
    s.accumulators.push_back(std::move(acc));
  }
}

DistributedDataParallel::~DistributedDataParallel() = default;

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& ddp) : ddp_(ddp), previous_(ddp.state_->sync) {
  ddp_.state_->sync = false;
}
DistributedDataParallel::NoSync::~NoSync() { ddp_.state_->sync = previous_; }

void DistributedDataParallel::zero_grad(bool set_to_none) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < s.params.size(); ++i) {
    at::Tensor& g = s.params[i].mutable_grad();
    if (set_to_none && !s.options.gradient_as_bucket_view) {
      g = at::Tensor();
    } else if (g.defined()) {
      g.zero_();
    }
  }
}

int DistributedDataParallel::num_buckets() const { return static_cast<int>(state_->buckets.size()); }
bool DistributedDataParallel::buckets_rebuilt() const { return state_->rebuilt; }

std::vector<std::vector<std::string>> DistributedDataParallel::bucket_layout() const {
  std::vector<std::vector<std::string>> out;
  for (auto& b : state_->buckets) {
    out.emplace_back();
    for (size_t i : b.params) out.back().push_back(state_->names[i]);
  }
  return out;
}

bool DistributedDataParallel::reduces(const at::Tensor& param) { return reduced_by_live_ddp(param); }

double DistributedDataParallel::comm_wait_ms() const { return state_->wait_ms; }
int64_t DistributedDataParallel::bytes_reduced() const { return state_->bytes; }
void DistributedDataParallel::reset_stats() {
  state_->wait_ms = 0;
  state_->bytes = 0;
}

}  // namespace scaletrain::parallel
