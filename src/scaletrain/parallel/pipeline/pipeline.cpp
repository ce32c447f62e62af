#include "scaletrain/parallel/pipeline/pipeline.h"

#include <malloc.h>

#include <chrono>
#include <set>

#include "scaletrain/interfaces/deferred.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::parallel::pipeline {

Balance parse_balance(const std::string& s) {
  if (s == "params") return Balance::Parameters;
  if (s == "time") return Balance::Time;
  throw UsageError("unknown parallel.pp_balance '" + s + "' (params | time)");
}

void ChunkRunner::add_to_grad(const std::string& name, const at::Tensor& grad) {
  for (auto& item : module->named_parameters())
    if (item.key() == name) {
      at::Tensor& g = item.value().mutable_grad();
      if (g.defined()) g.add_(grad.to(g.scalar_type()));
      else g = grad.to(item.value().scalar_type()).clone();
      return;
    }
  throw std::logic_error("pipeline: no parameter " + name + " in the first chunk");
}

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Bytes the allocator has handed out and not taken back (heap + mmap'd
// blocks): what tensors hold, without the RSS's cached and fragmented pages.
int64_t heap_in_use() {
  struct mallinfo2 mi = mallinfo2();
  return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
}

// Message tags on the pp group (Note in pipeline.h: tags name the message).
constexpr int kHeadWeight = 1, kHeadGrad = 2, kShapeBase = 8, kActivationBase = 1 << 12;
int activation_tag(int mb, int chunk, int m, bool grad) { return kActivationBase + ((chunk * m + mb) * 2 + (grad ? 1 : 0)); }

std::string shape_string(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < 3; ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "] " + std::string(c10::toString(static_cast<at::ScalarType>(s[3])));
}

}  // namespace

Pipeline::Pipeline(std::shared_ptr<interfaces::Staged> model, comm::Group& pp, comm::Group* dp, PipelineOptions options,
                   comm::Group* everyone)
    : model_(std::move(model)), pp_(pp), dp_(dp), options_(options) {
  const int p = pp_.size(), v = options_.virtual_stages, s = pp_.rank();
  shape_ = {options_.schedule, p, options_.microbatches, v};
  check_schedule(shape_);
  if (options_.seq_len == 0) options_.seq_len = model_->stage_shape().max_sequence;
  act_options_ = model_->staged_module().parameters().front().options().requires_grad(false);

  // 1. Cut the blocks into p*v chunks; every rank must cut the same way.
  BlockCosts costs = options_.balance == Balance::Time ? measured_costs(*model_, options_.micro_batch)
                                                       : parameter_costs(*model_);
  if (options_.balance == Balance::Time) {
    std::vector<double> flat = costs.blocks;
    flat.push_back(costs.first_extra);
    flat.push_back(costs.last_extra);
    at::Tensor t = torch::tensor(flat, torch::kDouble);
    (everyone ? *everyone : pp_).broadcast(t, 0).wait();
    for (size_t i = 0; i < costs.blocks.size(); ++i) costs.blocks[i] = t[static_cast<int64_t>(i)].item<double>();
    costs.first_extra = t[static_cast<int64_t>(costs.blocks.size())].item<double>();
    costs.last_extra = t[static_cast<int64_t>(costs.blocks.size()) + 1].item<double>();
  }
  const auto runs = balance_blocks(costs.blocks, costs.first_extra, costs.last_extra, p * v);
  for (int c = 0; c < p * v; ++c)
    specs_.push_back({c, p * v, runs[static_cast<size_t>(c)].first, runs[static_cast<size_t>(c)].second});

  // 2. This stage's chunks; the rest of the model gives its bytes back.
  std::set<const void*> kept;
  for (int j = 0; j < v; ++j) {
    chunks_.push_back(Chunk(model_, specs_[static_cast<size_t>(j * p + s)]));
    for (const auto& t : chunks_.back()->parameters()) kept.insert(t.unsafeGetTensorImpl());
    auto r = std::make_shared<ChunkRunner>();
    r->module = chunks_.back().get();
    runners_.push_back(r);
  }
  std::tie(head_name_, head_) = model_->tied_head();
  // The last chunk is on stage p-1, the first on stage 0.
  head_copy_ = head_.defined() && p > 1 && s == p - 1;
  // A frozen head (fine-tuning with adapters) is the same on every stage
  // from the start and never changes: nothing to refresh, no gradient.
  head_moves_ = head_.defined() && head_.requires_grad() && p > 1;
  if (head_copy_) kept.insert(head_.unsafeGetTensorImpl());
  for (const auto& t : model_->staged_module().parameters())
    if (!kept.count(t.unsafeGetTensorImpl())) interfaces::free_storage(t);
  actions_ = stage_actions(shape_, s);
}

void Pipeline::set_runners(std::vector<std::shared_ptr<ChunkRunner>> runners) {
  if (runners.size() != chunks_.size()) throw std::invalid_argument("pipeline: one runner per local chunk");
  for (size_t j = 0; j < runners.size(); ++j) runners[j]->module = chunks_[j].get();
  runners_ = std::move(runners);
}

// Each chunk boundary crossing stages: the sender states the activation it
// will send, the receiver compares with what it expects. Every stage learns
// whether any boundary disagreed, so all fail together instead of one
// failing and the others waiting in a receive.
void Pipeline::check_shapes() {
  shapes_checked_ = true;
  const int p = pp_.size();
  if (p == 1) return;
  const int64_t width = model_->stage_shape().width;
  const int64_t seq = options_.sequence_parallel_tp ? options_.seq_len / options_.tp_size : options_.seq_len;
  const std::vector<int64_t> mine{options_.micro_batch, seq, width,
                                  static_cast<int64_t>(c10::typeMetaToScalarType(act_options_.dtype()))};
  std::vector<comm::Work> sends;
  std::vector<at::Tensor> bufs;
  for (const Chunk& ch : chunks_)
    if (!ch->spec().last()) {
      bufs.push_back(torch::tensor(mine, torch::kLong));
      sends.push_back(pp_.send(bufs.back(), (ch->spec().index + 1) % p, kShapeBase + ch->spec().index));
    }
  std::string problem;
  for (const Chunk& ch : chunks_) {
    if (ch->spec().first()) continue;
    const int from = ch->spec().index - 1;
    at::Tensor t = torch::zeros({4}, torch::kLong);
    pp_.recv(t, from % p, kShapeBase + from).wait();
    std::vector<int64_t> theirs(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + 4);
    if (theirs != mine && problem.empty())
      problem = "pipeline stages disagree on the activation between chunk " + std::to_string(from) + " (stage " +
                std::to_string(from % p) + " sends " + shape_string(theirs) + ") and chunk " +
                std::to_string(ch->spec().index) + " (stage " + std::to_string(pp_.rank()) + " expects " +
                shape_string(mine) + ")";
  }
  for (auto& w : sends) w.wait();
  at::Tensor bad = torch::full({1}, problem.empty() ? 0.0 : 1.0, torch::kDouble);
  pp_.all_reduce(bad, comm::ReduceOp::Max).wait();
  if (!problem.empty()) throw UsageError(problem);
  if (bad.item<double>() > 0)
    throw UsageError("pipeline stages disagree on the shape of the activations they exchange (see the stage that "
                     "reported it); every rank must run the same model and micro-batch");
}

at::Tensor Pipeline::recv_activation(int mb, int chunk, bool grad, const at::Tensor& like) {
  const int p = pp_.size();
  const int from = grad ? (chunk + 1) % p : (chunk - 1 + p) % p;
  const int tag = activation_tag(mb, grad ? chunk + 1 : chunk - 1, options_.microbatches, grad);
  at::Tensor t = at::empty_like(like, at::MemoryFormat::Contiguous);
  const auto t0 = Clock::now();
  pp_.recv(t, from, tag).wait();
  stats_.wait_ms += ms_since(t0);
  return t;
}

// What one step keeps between its actions.
struct Pipeline::StepRun {
  const std::vector<at::Tensor>& inputs;
  const std::vector<at::Tensor>& targets;
  double loss_scale;
  const ForwardWrapper& wrap;
  const std::vector<double>& weights;
  at::Tensor act_like;  // shape and dtype of an activation between chunks
  struct Live {
    at::Tensor input, output;  // output: the chunk's output, or its scaled loss
  };
  std::map<std::pair<int, int>, Live> live;                        // (micro-batch, chunk)
  std::map<std::pair<int, int>, at::Tensor> local_fwd, local_bwd;  // neighbours on this stage (p == 1)
  std::vector<comm::Work> sends;
  std::vector<at::Tensor> in_transit;  // kept alive until their sends complete
  std::vector<int> backwards;          // per local chunk
  double loss_sum = 0;
  bool head_sent = false, head_received = false;

  double weight(int mb, int m) const { return weights.empty() ? 1.0 / m : weights[static_cast<size_t>(mb)]; }
};

void Pipeline::send(StepRun& run, at::Tensor t, int to, int tag) {
  run.in_transit.push_back(t.contiguous());
  run.sends.push_back(pp_.send(run.in_transit.back(), to, tag));
}

double Pipeline::step(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets, double loss_scale,
                      const ForwardWrapper& wrap, const std::vector<double>& weights, const BeforeMicroBatch& before) {
  const int p = pp_.size(), m = options_.microbatches;
  if (static_cast<int>(inputs.size()) != m || static_cast<int>(targets.size()) != m ||
      (!weights.empty() && static_cast<int>(weights.size()) != m))
    throw std::invalid_argument("pipeline step: expected " + std::to_string(m) + " micro-batches");
  stats_ = StepStats{};
  const auto t_step = Clock::now();
  const int64_t heap0 = heap_in_use();
  if (!shapes_checked_) check_shapes();

  const int64_t width = model_->stage_shape().width;
  const int64_t seq = options_.sequence_parallel_tp ? options_.seq_len / options_.tp_size : options_.seq_len;
  StepRun run{inputs, targets, loss_scale, wrap, weights, at::empty({options_.micro_batch, seq, width}, act_options_)};
  run.backwards.assign(chunks_.size(), 0);
  for (const Action& a : actions_) {
    if (before) before(a.microbatch);
    if (a.kind == Action::Kind::Forward) {
      run_forward(run, a);
      stats_.peak_activation_bytes = std::max(stats_.peak_activation_bytes, heap_in_use() - heap0);
    } else {
      run_backward(run, a);
    }
  }
  {
    const auto t0 = Clock::now();
    for (auto& w : run.sends) w.wait();
    stats_.wait_ms += ms_since(t0);
  }
  for (auto& r : runners_) r->end_step();
  exchange_head_grad();
  // The loss is computed once, on the last stage; every stage reports it.
  at::Tensor l = torch::full({1}, run.loss_sum, torch::kDouble);
  if (p > 1) pp_.broadcast(l, p - 1).wait();
  stats_.step_ms = ms_since(t_step);
  return l.item<double>();
}

void Pipeline::run_forward(StepRun& run, const Action& a) {
  const int p = pp_.size(), m = options_.microbatches;
  const size_t j = static_cast<size_t>(a.chunk / p);
  Chunk& chunk = chunks_[j];
  const ChunkSpec& spec = chunk->spec();
  const std::pair<int, int> key{a.microbatch, a.chunk};
  at::Tensor in;
  if (spec.first()) {
    in = run.inputs[static_cast<size_t>(a.microbatch)];
  } else {
    if (p == 1) {
      in = run.local_fwd.at(key);
      run.local_fwd.erase(key);
    } else {
      in = recv_activation(a.microbatch, a.chunk, false, run.act_like);
    }
    in.requires_grad_(true);
  }
  if (head_copy_ && head_moves_ && spec.last() && !run.head_received) {
    // Note [Tied head across stages]: this step's weights of the embedding.
    at::Tensor w = at::empty_like(head_, at::MemoryFormat::Contiguous).detach();
    const auto t0 = Clock::now();
    pp_.recv(w, 0, kHeadWeight).wait();
    stats_.wait_ms += ms_since(t0);
    torch::NoGradGuard no_grad;
    head_.copy_(w);
    run.head_received = true;
  }
  const auto t0 = Clock::now();
  trace::Span span("pipeline", "forward micro-batch", a.microbatch);
  at::Tensor tgt = spec.last() ? run.targets[static_cast<size_t>(a.microbatch)] : at::Tensor();
  auto body = [&] {
    at::Tensor out = chunk->forward(in, tgt);
    if (head_moves_ && spec.first() && !run.head_sent) {  // whole here, even under ZeRO-3
      send(run, head_.detach().clone(), p - 1, kHeadWeight);
      run.head_sent = true;
    }
    return out;
  };
  at::Tensor out = runners_[j]->forward([&] { return run.wrap ? run.wrap(body) : body(); });
  if (spec.last()) {
    run.loss_sum += out.item<double>() * run.weight(a.microbatch, m);
    out = out * (run.loss_scale * run.weight(a.microbatch, m));
  } else if (p == 1) {
    run.local_fwd[{a.microbatch, a.chunk + 1}] = out.detach();
  } else {
    send(run, out.detach(), (a.chunk + 1) % p, activation_tag(a.microbatch, a.chunk, m, false));
  }
  run.live[key] = {in, out};
  stats_.compute_ms += ms_since(t0);
}

void Pipeline::run_backward(StepRun& run, const Action& a) {
  const int p = pp_.size(), m = options_.microbatches;
  const size_t j = static_cast<size_t>(a.chunk / p);
  const ChunkSpec& spec = chunks_[j]->spec();
  const std::pair<int, int> key{a.microbatch, a.chunk};
  StepRun::Live l = std::move(run.live.at(key));
  run.live.erase(key);
  at::Tensor g;
  if (!spec.last()) {
    if (p == 1) {
      g = run.local_bwd.at(key);
      run.local_bwd.erase(key);
    } else {
      g = recv_activation(a.microbatch, a.chunk, true, l.output);
    }
  }
  const auto t0 = Clock::now();
  trace::Span span("pipeline", "backward micro-batch", a.microbatch);
  const bool last = ++run.backwards[j] == m;
  runners_[j]->backward(
      [&] {
        if (spec.last())
          l.output.backward();
        else
          l.output.backward(g);
      },
      last);
  if (!spec.first()) {
    at::Tensor gi = l.input.grad();
    if (p == 1)
      run.local_bwd[{a.microbatch, a.chunk - 1}] = gi;
    else
      send(run, gi, (a.chunk - 1 + p) % p, activation_tag(a.microbatch, a.chunk, m, true));
  }
  stats_.compute_ms += ms_since(t0);
}

// The head's share of the tied embedding's gradient, averaged like every
// other gradient (Note [Tied head across stages]).
void Pipeline::exchange_head_grad() {
  if (head_copy_ && head_moves_) {
    at::Tensor g = head_.grad().contiguous();
    if (dp_ && dp_->size() > 1) dp_->all_reduce(g, comm::ReduceOp::Avg).wait();
    pp_.send(g, 0, kHeadGrad).wait();
    head_.mutable_grad().reset();
  } else if (head_moves_ && chunks_.front()->spec().first()) {
    at::Tensor g = at::empty_like(head_, at::MemoryFormat::Contiguous).detach();
    const auto t0 = Clock::now();
    pp_.recv(g, pp_.size() - 1, kHeadGrad).wait();
    stats_.wait_ms += ms_since(t0);
    runners_.front()->add_to_grad(head_name_, g);
  }
}

double clip_grad_norm(const std::vector<at::Tensor>& counted, const std::vector<at::Tensor>& shared,
                      int shared_copies, const std::vector<comm::Group*>& groups, double max_norm) {
  torch::NoGradGuard no_grad;
  double sq = 0;
  auto add = [&](const std::vector<at::Tensor>& ts, double weight) {
    for (const auto& t : ts)
      if (t.grad().defined()) sq += weight * t.grad().to(at::kDouble).pow(2).sum().item<double>();
  };
  add(counted, 1.0);
  add(shared, 1.0 / shared_copies);
  at::Tensor total = torch::full({1}, sq, torch::kDouble);
  for (comm::Group* g : groups)
    if (g && g->size() > 1) g->all_reduce(total, comm::ReduceOp::Sum).wait();
  const double norm = std::sqrt(total.item<double>());
  if (max_norm > 0 && norm > max_norm) {
    const double coef = max_norm / (norm + 1e-6);
    for (const auto* ts : {&counted, &shared})
      for (const auto& t : *ts)
        if (t.grad().defined()) t.grad().mul_(coef);
  }
  return norm;
}

void Pipeline::zero_grad() {
  torch::NoGradGuard no_grad;
  for (const Chunk& c : chunks_)
    for (auto& p : c->parameters())
      if (p.grad().defined()) p.mutable_grad().zero_();  // in place: a DDP bucket view stays one
  if (head_copy_) head_.mutable_grad().reset();
}

}  // namespace scaletrain::parallel::pipeline
