#include "scaletrain/checkpoint/torch_training.h"

#include "scaletrain/checkpoint/index.h"
#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/checkpoint/torch_file.h"
#include "scaletrain/util/error.h"

namespace scaletrain::checkpoint {

namespace {

// Per-parameter state tensors by kind, in trainable-parameter order: what
// the checkpoint writer asks an optimizer for.
class ImportedState final : public OptimizerState {
 public:
  std::vector<std::string> names;
  std::vector<std::vector<at::Tensor>> values;  // [kind][parameter]

  std::vector<std::string> kinds() const override { return names; }
  at::Tensor value(size_t kind, size_t i) const override { return values.at(kind).at(i); }
  void set_values(size_t, const std::vector<at::Tensor>&) override {}
  void set_steps(int64_t) override {}
};

// The trainable parameters, in the order an optimizer over parameters() sees them.
std::vector<std::pair<std::string, at::Tensor>> trainable(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : m.named_parameters())
    if (p.value().requires_grad()) out.emplace_back(p.key(), p.value());
  return out;
}

// The group's settings, numbers and booleans; "params" aside.
void group_settings(const std::string& file, const PyObject& g, TorchTrainingImport* out) {
  for (const auto& [k, v] : g.entries) {
    if (k->kind != PyKind::Str) torch_file_fail(file, "a param group key that is not a str");
    const std::string& key = k->text;
    if (key == "params") continue;
    if (v->kind == PyKind::Bool) out->flags[key] = v->boolean;
    else if (v->kind == PyKind::Int) out->params[key] = static_cast<double>(v->integer);
    else if (v->kind == PyKind::Float) out->params[key] = v->real;
    else if (key == "betas" && v->kind == PyKind::Tuple && v->items.size() == 2)
      for (int b = 0; b < 2; ++b) {
        const PyObject& x = *v->items[b];
        out->params[b ? "beta2" : "beta1"] = x.kind == PyKind::Float ? x.real : static_cast<double>(x.integer);
      }
  }
}

// Parameter id -> position, from the groups' "params" lists; the settings
// of all groups, which must agree.
std::map<int64_t, size_t> read_groups(const std::string& file, const PyObject& optim, TorchTrainingImport* out) {
  const PyObject* groups = optim.get("param_groups");
  if (!groups || groups->kind != PyKind::List || groups->items.empty())
    torch_file_fail(file, "the optimizer state has no param_groups list");
  std::map<int64_t, size_t> position;
  for (size_t g = 0; g < groups->items.size(); ++g) {
    const PyObject& group = *groups->items[g];
    const PyObject* ids = group.kind == PyKind::Dict ? group.get("params") : nullptr;
    if (!ids || ids->kind != PyKind::List) torch_file_fail(file, "param group " + std::to_string(g) + " has no params list");
    for (const PyRef& id : ids->items)
      if (id->kind != PyKind::Int || !position.emplace(id->integer, position.size()).second)
        torch_file_fail(file, "param group " + std::to_string(g) + " lists a parameter id twice or not as an int");
    TorchTrainingImport mine;
    group_settings(file, group, &mine);
    if (g == 0) {
      out->params = mine.params;
      out->flags = mine.flags;
    } else if (mine.params != out->params || mine.flags != out->flags) {
      torch_file_fail(file, "param groups 0 and " + std::to_string(g) +
                                " have different settings (one optimizer group is trained here)");
    }
  }
  return position;
}

double step_of(const TorchFile& f, const PyObject& v) {
  if (v.kind == PyKind::Int) return static_cast<double>(v.integer);
  if (v.kind == PyKind::Float) return v.real;
  if (v.kind == PyKind::Tensor) {
    const at::Tensor t = f.tensor(*v.tensor);
    if (t.numel() == 1) return t.item<double>();
  }
  torch_file_fail(f.path(), "an optimizer 'step' that is not a number");
}

// The state entries into `state`, by position; returns the common step.
int64_t read_state(const TorchFile& f, const PyObject& optim, const std::map<int64_t, size_t>& position,
                   const std::vector<std::pair<std::string, at::Tensor>>& params, ImportedState* state) {
  const PyObject* entries = optim.get("state");
  if (!entries || entries->kind != PyKind::Dict) torch_file_fail(f.path(), "the optimizer state has no state dict");
  double step = -1;
  bool first = true;
  for (const auto& [id, entry] : entries->entries) {
    const auto pos = id->kind == PyKind::Int ? position.find(id->integer) : position.end();
    if (pos == position.end() || entry->kind != PyKind::Dict)
      torch_file_fail(f.path(), "optimizer state for a parameter id no param group lists");
    const auto& [pname, p] = params.at(pos->second);
    std::vector<std::pair<std::string, at::Tensor>> found;
    for (const auto& [k, v] : entry->entries) {
      if (k->is_str("step")) {
        const double s = step_of(f, *v);
        if (step >= 0 && s != step) torch_file_fail(f.path(), "parameters at different optimizer steps");
        step = s;
        continue;
      }
      if (k->kind != PyKind::Str || v->kind != PyKind::Tensor)
        torch_file_fail(f.path(), "optimizer state that is not a named tensor");
      at::Tensor t = f.tensor(*v->tensor);
      if (t.sizes() != p.sizes())
        torch_file_fail(f.path(), "optimizer state '" + k->text + "' of parameter " + std::to_string(pos->second) +
                                      " ('" + pname + "') is " + c10::str(t.sizes()) + ", the parameter " +
                                      c10::str(p.sizes()));
      found.emplace_back(k->text, std::move(t));
    }
    if (first) {
      first = false;
      for (const auto& kt : found) {
        state->names.push_back(kt.first);
        state->values.emplace_back(params.size());
      }
    }
    if (found.size() != state->names.size())
      torch_file_fail(f.path(), "parameters with different kinds of optimizer state");
    for (size_t k = 0; k < found.size(); ++k) {
      if (found[k].first != state->names[k])
        torch_file_fail(f.path(), "parameters with different kinds of optimizer state");
      state->values[k][pos->second] = found[k].second;
    }
  }
  for (auto& per_param : state->values)  // never stepped: zeros, as a fresh optimizer
    for (size_t i = 0; i < params.size(); ++i)
      if (!per_param[i].defined()) per_param[i] = at::zeros_like(params[i].second, at::MemoryFormat::Contiguous);
  return step < 0 ? 0 : static_cast<int64_t>(step);
}

Layout whole_layout(const torch::nn::Module& module) {
  Layout l = replicated_layout(module, true);
  for (const auto& b : module.named_buffers())
    if (b.value().defined() && b.value().numel() > 0)
      l.slots.push_back({b.value().contiguous(), -1, {{b.key(), b.value().sizes().vec(), 0, 0, b.value().numel()}}});
  l.strategy = "torch.save import";
  l.mesh = "dp 1";
  return l;
}

}  // namespace

TorchTrainingImport import_torch_training(torch::nn::Module& module, const std::string& file,
                                          const std::string& root, const TorchTrainingKeys& keys) {
  const TorchFile f(file);
  const NamedTensors model = state_dict_tensors(f, keys.model);
  check_state_dict(module, model);
  TorchTrainingImport out;
  ImportedState state;
  if (!keys.optim.empty()) {
    const PyObject* optim = f.root().kind == PyKind::Dict ? f.root().get(keys.optim) : nullptr;
    if (!optim || optim->kind != PyKind::Dict) torch_file_fail(file, "no optimizer state dict under '" + keys.optim + "'");
    const std::map<int64_t, size_t> position = read_groups(file, *optim, &out);
    const auto params = trainable(module);
    if (position.size() != params.size())
      torch_file_fail(file, "the optimizer holds " + std::to_string(position.size()) + " parameters, the module " +
                                std::to_string(params.size()) + " trainable ones");
    out.step = read_state(f, *optim, position, params, &state);
  }
  load_state_dict(module, model);  // after every check of the optimizer's state: nothing is half done
  SaveState save;
  save.run.step = save.run.optimizer_steps = out.step;
  out.step_dir = save_alone(root, whole_layout(module), keys.optim.empty() ? nullptr : &state, save);
  return out;
}

void export_torch_training(const torch::nn::Module& module, const std::string& step_dir, const std::string& file,
                           const TorchAdamGroup& group) {
  const Index index = read_index(step_dir);
  TorchFileWriter w;
  std::vector<std::pair<PyRef, PyRef>> model, state;
  std::vector<std::pair<std::string, at::Tensor>> reads;
  auto whole = [&](const std::string& name, const at::Tensor& like) {
    at::Tensor t = at::empty_like(like, at::MemoryFormat::Contiguous);
    if (!index.tensors.count(name)) throw UsageError("checkpoint " + step_dir + ": no tensor " + name);
    reads.emplace_back(name, t);
    return t;
  };
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& p : module.named_parameters()) named.emplace_back(p.key(), whole("model/" + p.key(), p.value()));
  for (const auto& b : module.named_buffers())
    if (b.value().defined() && b.value().numel() > 0) named.emplace_back(b.key(), whole("model/" + b.key(), b.value()));
  std::vector<const char*> kinds{"exp_avg", "exp_avg_sq"};
  if (group.amsgrad) kinds.push_back("max_exp_avg_sq");
  std::vector<std::vector<at::Tensor>> moments;
  for (const auto& p : module.named_parameters()) {
    if (!p.value().requires_grad()) continue;
    moments.emplace_back();
    for (const char* k : kinds) moments.back().push_back(whole(std::string(k) + "/" + p.key(), p.value()));
  }
  read_tensors(step_dir, index, reads);
  for (const auto& [name, t] : named) model.emplace_back(py_str(name), w.tensor(t));
  const at::Tensor step = at::full({}, static_cast<double>(index.state.optimizer_steps), at::kFloat);
  std::vector<PyRef> ids;
  for (size_t i = 0; i < moments.size(); ++i) {
    std::vector<std::pair<PyRef, PyRef>> entry{{py_str("step"), w.tensor(step)}};
    for (size_t k = 0; k < kinds.size(); ++k) entry.emplace_back(py_str(kinds[k]), w.tensor(moments[i][k]));
    state.emplace_back(py_int(static_cast<int64_t>(i)), py_dict(std::move(entry)));
    ids.push_back(py_int(static_cast<int64_t>(i)));
  }
  const PyRef settings = py_dict({{py_str("lr"), py_float(group.lr)},
                                  {py_str("betas"), py_tuple({py_float(group.beta1), py_float(group.beta2)})},
                                  {py_str("eps"), py_float(group.eps)},
                                  {py_str("weight_decay"), py_float(group.weight_decay)},
                                  {py_str("amsgrad"), py_bool(group.amsgrad)},
                                  {py_str("maximize"), py_bool(false)},
                                  {py_str("foreach"), py_none()},
                                  {py_str("capturable"), py_bool(false)},
                                  {py_str("params"), py_list(std::move(ids))}});
  const PyRef optim = py_dict({{py_str("state"), py_dict(std::move(state))},
                               {py_str("param_groups"), py_list({settings})}});
  w.write(file, *py_dict({{py_str("model"), py_dict(std::move(model), /*ordered=*/true)},
                          {py_str("optim"), optim},
                          {py_str("step"), py_int(index.state.step)}}));
}

}  // namespace scaletrain::checkpoint
