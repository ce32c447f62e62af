#pragma once
// A module library: your module trained by `scaletrain train` and
// `scaletrain launch` with the CLI's keys, without writing a main().
//
// Build a shared library against the installed package (scaletrain::scaletrain)
// holding one function that fills a ModuleTask, and export it:
//
//   scaletrain::train::ModuleTask make_task(const std::string& args) {
//     scaletrain::train::ModuleTask task;
//     task.module = MyNet(...).ptr();
//     task.loss = [](torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) { ... };
//     task.data = std::make_shared<scaletrain::train::ModuleData>(inputs, targets);
//     return task;
//   }
//   SCALETRAIN_MODULE_TASK(make_task)
//
// and name it in the config: model.library: /path/libmynet.so (and
// model.library_args: any text, handed to the function as it is). Every
// rank loads the library and calls the function once, after joining the
// job; the module trainer (module_trainer.h) then trains the task with the
// config's parallel.*, train.*, checkpoint.* and metrics.* keys, exactly as
// module_trainer_options() reads them; keys a user module cannot use are
// refused by name. docs/own-model.md, "The CLI trains your module".
#include <memory>
#include <string>

#include "scaletrain/parallel/fsdp/module_units.h"
#include "scaletrain/parallel/tensor/parallelize_module.h"
#include "scaletrain/train/module_trainer.h"

namespace scaletrain::train {

struct ModuleTask {
  std::shared_ptr<torch::nn::Module> module;  // required
  ModuleLoss loss;                            // required: the mean loss of one micro-batch
  std::shared_ptr<ModuleData> data;           // required: the samples, the same on every rank
  // The optimizer over what the engine hands out; empty: AdamW with the
  // train.* keys. Either way train.lr and the schedule set each step's rate.
  OptimizerFactory optimizer;
  // Units of the sharded strategies when the config names none
  // (parallel.fsdp.auto_wrap_policy); a config that names some wins.
  parallel::fsdp::ModuleUnits units;
  // The tensor-parallel plan of the module's names, used when parallel.tp > 1.
  parallel::tensor::ModulePlan tensor_plan;
};

// The symbol `scaletrain train` looks for, and its type. Versioned: a
// library built against another ModuleTask is not found rather than misread.
inline constexpr const char* kModuleTaskSymbol = "scaletrain_module_task_v1";
using ModuleTaskFunction = void (*)(const char* args, ModuleTask* task);

}  // namespace scaletrain::train

// Exports `fn` (ModuleTask fn(const std::string& args)) as the library's task.
#define SCALETRAIN_MODULE_TASK(fn)                                                                     \
  extern "C" __attribute__((visibility("default"))) void scaletrain_module_task_v1(                    \
      const char* args, ::scaletrain::train::ModuleTask* task) {                                      \
    *task = fn(std::string(args));                                                                     \
  }
