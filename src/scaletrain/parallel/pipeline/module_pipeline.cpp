#include "scaletrain/parallel/pipeline/module_pipeline.h"

#include <map>
#include <numeric>
#include <stdexcept>
#include <utility>

namespace scaletrain::parallel::pipeline {

namespace {

constexpr int kMaxDims = 8;
constexpr int kTagBase = 1 << 20;  // apart from Pipeline's tags

// Note [Activations of any shape]: chunk `chunk`'s message for micro-batch
// `mb`, forward (activation) or backward (gradient), header or data.
int tag(int mb, int chunk, int m, bool grad, bool header) {
  return kTagBase + (((chunk * m + mb) * 2 + (grad ? 1 : 0)) * 2 + (header ? 1 : 0));
}

std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "] " + std::string(c10::toString(t.scalar_type()));
}

// Data parallelism per chunk: only the step's last backward reduces; the
// ones before it accumulate under the engine's no_sync.
template <typename Engine>
void backward_reducing_last(Engine& engine, const std::function<void()>& fn, bool last) {
  if (last) {
    fn();
  } else {
    auto guard = engine.no_sync();
    fn();
  }
}

}  // namespace

void DdpStageRunner::backward(const std::function<void()>& fn, bool last) { backward_reducing_last(*ddp_, fn, last); }

void ShardedStageRunner::backward(const std::function<void()>& fn, bool last) {
  backward_reducing_last(*engine_, fn, last);
}

StageModule stage(const torch::nn::Sequential& seq) {
  torch::nn::Sequential s = seq;  // a holder of its own, not const
  return {s.ptr(), [s](const at::Tensor& x) mutable { return s->forward(x); }};
}

std::vector<torch::nn::Sequential> split(const torch::nn::Sequential& seq, const std::vector<int64_t>& balance) {
  const int64_t total = std::accumulate(balance.begin(), balance.end(), int64_t{0});
  std::string listed;
  for (size_t i = 0; i < balance.size(); ++i) listed += (i ? " + " : "") + std::to_string(balance[i]);
  if (balance.empty() || total != static_cast<int64_t>(seq->size()))
    throw std::invalid_argument("pipeline split: the balance " + listed + " = " + std::to_string(total) +
                                " does not add up to the Sequential's " + std::to_string(seq->size()) + " children");
  std::vector<torch::nn::Sequential> out;
  auto names = seq->named_children();
  auto it = seq->begin();
  size_t next = 0;
  for (int64_t n : balance) {
    if (n <= 0) throw std::invalid_argument("pipeline split: the balance " + listed + " holds an empty stage");
    torch::nn::Sequential piece;
    for (int64_t i = 0; i < n; ++i, ++next, ++it) piece->push_back(names[next].key(), *it);
    out.push_back(piece);
  }
  return out;
}

struct ModulePipeline::Run {
  const at::Tensor* input = nullptr;
  const at::Tensor* target = nullptr;
  const LossFn* loss = nullptr;
  std::vector<at::Tensor> inputs, targets;  // per micro-batch
  struct Live {
    at::Tensor input, output;  // output: the chunk's output, or its loss / m
  };
  std::map<std::pair<int, int>, Live> live;                   // (micro-batch, chunk)
  std::map<std::pair<int, int>, at::Tensor> local_fwd, local_bwd;  // neighbours on this rank
  std::vector<comm::Work> sends;
  std::vector<at::Tensor> in_transit;  // kept alive until their sends complete
  std::vector<int> backwards;  // per local chunk, this step's so far
  double loss_sum = 0;
  bool grad = true;  // false: forward(), no loss, no backward
  std::vector<at::Tensor> outputs;  // forward(): the last chunk's outputs
};

ModulePipeline::ModulePipeline(std::vector<StageModule> chunks, comm::Group& pp, ModulePipelineOptions options)
    : chunks_(std::move(chunks)), pp_(pp), options_(options) {
  shape_ = {options_.schedule, pp_.size(), options_.microbatches, options_.virtual_stages};
  check_schedule(shape_);
  if (static_cast<int>(chunks_.size()) != options_.virtual_stages)
    throw std::invalid_argument("pipeline: rank " + std::to_string(pp_.rank()) + " was given " +
                                std::to_string(chunks_.size()) + " chunks for " +
                                std::to_string(options_.virtual_stages) + " virtual stages");
  for (auto& c : chunks_)
    if (!c.module || !c.forward) throw std::invalid_argument("pipeline: a chunk without its module or forward");
  actions_ = stage_actions(shape_, pp_.rank());
}

at::Tensor ModulePipeline::run_forward(Run& run, const Action& a) {
  const int p = pp_.size(), m = options_.microbatches, last = p * options_.virtual_stages - 1;
  StageModule& chunk = chunks_[static_cast<size_t>(a.chunk / p)];
  const std::pair<int, int> key{a.microbatch, a.chunk};
  at::Tensor in;
  if (a.chunk == 0) {
    in = run.inputs[static_cast<size_t>(a.microbatch)];
  } else if (p == 1) {
    in = run.local_fwd.at(key);
    run.local_fwd.erase(key);
  } else {
    const int from = (a.chunk - 1) % p;
    at::Tensor header = at::empty({2 + kMaxDims}, at::kLong);
    pp_.recv(header, from, tag(a.microbatch, a.chunk - 1, m, false, true)).wait();
    const int64_t* h = header.data_ptr<int64_t>();
    in = at::empty(std::vector<int64_t>(h + 2, h + 2 + h[0]), at::TensorOptions().dtype(static_cast<at::ScalarType>(h[1])));
    pp_.recv(in, from, tag(a.microbatch, a.chunk - 1, m, false, false)).wait();
  }
  if (a.chunk > 0 && run.grad) in.requires_grad_(true);
  at::Tensor out;
  try {
    out = chunk.forward(in);
  } catch (const std::exception& e) {
    throw std::runtime_error("pipeline chunk " + std::to_string(a.chunk) + " (rank " + std::to_string(pp_.rank()) +
                             ") failed on an input of " + shape_of(in) + ": " + e.what());
  }
  if (a.chunk == last) {
    if (!run.grad) {
      run.outputs.push_back(out);
    } else {
      at::Tensor loss = (*run.loss)(out, run.targets[static_cast<size_t>(a.microbatch)]);
      run.loss_sum += loss.item<double>();
      out = loss / m;
    }
  } else {
    if (!at::isFloatingType(out.scalar_type()) || out.dim() > kMaxDims)
      throw std::invalid_argument("pipeline chunk " + std::to_string(a.chunk) + " returned " + shape_of(out) +
                                  ": activations between chunks must be floating point, at most 8-d");
    if (p == 1) {
      run.local_fwd[{a.microbatch, a.chunk + 1}] = out.detach();
    } else {
      std::vector<int64_t> h(2 + kMaxDims, 0);
      h[0] = out.dim();
      h[1] = static_cast<int64_t>(out.scalar_type());
      for (int64_t i = 0; i < out.dim(); ++i) h[static_cast<size_t>(2 + i)] = out.size(i);
      run.in_transit.push_back(at::tensor(h, at::kLong));
      run.sends.push_back(pp_.send(run.in_transit.back(), (a.chunk + 1) % p, tag(a.microbatch, a.chunk, m, false, true)));
      run.in_transit.push_back(out.detach().contiguous());
      run.sends.push_back(pp_.send(run.in_transit.back(), (a.chunk + 1) % p, tag(a.microbatch, a.chunk, m, false, false)));
    }
  }
  if (run.grad) run.live[key] = {in, out};
  return out;
}

void ModulePipeline::run_backward(Run& run, const Action& a) {
  const int p = pp_.size(), m = options_.microbatches, last = p * options_.virtual_stages - 1;
  const std::pair<int, int> key{a.microbatch, a.chunk};
  Run::Live l = std::move(run.live.at(key));
  run.live.erase(key);
  at::Tensor g;  // the gradient of the chunk's output; undefined for the loss
  if (a.chunk != last) {
    if (p == 1) {
      g = run.local_bwd.at(key);
      run.local_bwd.erase(key);
    } else {
      g = at::empty_like(l.output, at::MemoryFormat::Contiguous);
      pp_.recv(g, (a.chunk + 1) % p, tag(a.microbatch, a.chunk + 1, m, true, false)).wait();
    }
  }
  auto body = [&] {
    if (a.chunk == last)
      l.output.backward();
    else if (l.output.requires_grad())
      l.output.backward(g);
  };
  const size_t j = static_cast<size_t>(a.chunk / p);
  const bool last_of_step = ++run.backwards[j] == m;
  if (chunks_[j].runner)
    chunks_[j].runner->backward(body, last_of_step);
  else
    body();
  if (a.chunk == 0) return;
  at::Tensor gin = l.input.grad().defined() ? l.input.grad() : at::zeros_like(l.input);
  if (p == 1) {
    run.local_bwd[{a.microbatch, a.chunk - 1}] = gin;
  } else {
    run.in_transit.push_back(gin.contiguous());
    run.sends.push_back(pp_.send(run.in_transit.back(), (a.chunk - 1) % p, tag(a.microbatch, a.chunk, m, true, false)));
  }
}

double ModulePipeline::step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss) {
  const int m = options_.microbatches;
  if (input.size(0) % m != 0 || target.size(0) % m != 0)
    throw std::invalid_argument("pipeline step: a batch of " + std::to_string(input.size(0)) + " does not split into " +
                                std::to_string(m) + " equal micro-batches");
  Run run;
  run.loss = &loss;
  run.inputs = input.chunk(m, 0);
  run.targets = target.chunk(m, 0);
  run.backwards.assign(chunks_.size(), 0);
  for (const Action& a : actions_) {
    if (a.kind == Action::Kind::Forward)
      run_forward(run, a);
    else
      run_backward(run, a);
  }
  for (auto& w : run.sends) w.wait();
  // The mean loss, from the last chunk's rank to every rank.
  at::Tensor mean = at::tensor({run.loss_sum / m}, at::kDouble);
  pp_.broadcast(mean, pp_.size() - 1).wait();
  return mean.item<double>();
}

at::Tensor ModulePipeline::forward(const at::Tensor& input) {
  torch::NoGradGuard no_grad;
  const int m = options_.microbatches;
  Run run;
  run.grad = false;
  run.inputs = input.chunk(m, 0);
  // GPipe's order without its backwards: every forward, in order.
  ScheduleShape gpipe = shape_;
  gpipe.schedule = options_.virtual_stages > 1 ? Schedule::Interleaved : Schedule::GPipe;
  for (const Action& a : stage_actions(gpipe, pp_.rank()))
    if (a.kind == Action::Kind::Forward) run_forward(run, a);
  for (auto& w : run.sends) w.wait();
  return run.outputs.empty() ? at::Tensor() : at::cat(run.outputs, 0);
}

std::vector<at::Tensor> ModulePipeline::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& c : chunks_)
    for (auto& p : c.module->parameters()) out.push_back(p);
  return out;
}

void ModulePipeline::zero_grad() {
  for (auto& c : chunks_)
    for (auto& p : c.module->parameters()) p.mutable_grad().reset();
}

}  // namespace scaletrain::parallel::pipeline
