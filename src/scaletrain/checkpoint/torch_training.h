#pragma once
// A training run moving between PyTorch and scaletrain mid-way.
//
// Note [Training state from PyTorch]
// A Python run saves `torch.save({"model": model.state_dict(), "optim":
// optimizer.state_dict(), ...})`. The optimizer's state dict keys its
// per-parameter state by position: parameter i is the i-th entry of the
// param_groups' "params" lists taken in order, which for an optimizer over
// `model.parameters()` is the i-th trainable parameter in module order. A
// C++ module with the same structure has the same order (named_parameters),
// so the module names each position.
//
// Import writes that state as a checkpoint of one process (every tensor
// whole: "model/NAME" for parameters and buffers, "KIND/NAME" for each
// per-parameter state tensor under PyTorch's own key, exp_avg, exp_avg_sq,
// max_exp_avg_sq, momentum_buffer, ...; the step count as the run's step).
// Checkpoints reload under any layout, so a ModuleTrainer on any number of
// processes with any strategy resumes from it (options.resume = the step
// directory). The optimizer's settings (lr, betas, eps, weight_decay) come
// back to the caller: they configure the optimizer, and groups that differ
// in them are refused (the trainer builds one group).
//
// Export is the reverse for Adam and AdamW: a checkpoint's whole tensors as
// {"model": state dict, "optim": {"state": {i: {"step", "exp_avg",
// "exp_avg_sq"}}, "param_groups": [...]}, "step": N}, which Python's
// `optimizer.load_state_dict` takes (its settings from the file).
#include <torch/torch.h>

#include <map>
#include <string>

namespace scaletrain::checkpoint {

struct TorchTrainingKeys {
  std::string model = "model";  // the state dict's key in the saved dict
  std::string optim = "optim";  // the optimizer state dict's key ("" = none)
};

struct TorchTrainingImport {
  std::string step_dir;                  // the checkpoint written
  int64_t step = 0;                      // the optimizer's step count
  std::map<std::string, double> params;  // the group's numbers: lr, beta1, beta2, eps, weight_decay, momentum, ...
  std::map<std::string, bool> flags;     // and its booleans: amsgrad, maximize, nesterov, ...
};

// Loads `file`'s model state into `module` (names and shapes checked, as
// load_state_dict) and writes module and optimizer state to ROOT/step-N
// (Note [Training state from PyTorch]). Throws TorchFileError / UsageError
// naming the file and the problem: a missing key, a parameter count or
// shape that does not fit the module, state entries of mixed steps, groups
// with different settings.
TorchTrainingImport import_torch_training(torch::nn::Module& module, const std::string& file,
                                          const std::string& root, const TorchTrainingKeys& keys = {});

// torch.optim.Adam / AdamW settings written into the exported param group.
struct TorchAdamGroup {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool amsgrad = false;
};

// Writes the checkpoint `step_dir` (any layout, any world size) as a
// torch.save file for `module`'s structure (Note [Training state from
// PyTorch]). `module` gives names, shapes and dtypes only; it is not
// changed. Throws UsageError for a checkpoint without Adam's moments.
void export_torch_training(const torch::nn::Module& module, const std::string& step_dir, const std::string& file,
                           const TorchAdamGroup& group);

}  // namespace scaletrain::checkpoint
