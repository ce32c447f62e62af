// A user's module from a shared library, trained by the CLI (module_library.h).
#include "scaletrain/train/module_library.h"

#include <dlfcn.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "scaletrain/comm/world.h"
#include "scaletrain/config/config.h"
#include "scaletrain/config/config_values.h"
#include "scaletrain/train/module_task.h"
#include "scaletrain/train/module_trainer.h"
#include "scaletrain/train/run_internal.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {

namespace {

// The library's task function; the library stays loaded for the process's
// life (the module's code lives in it).
ModuleTaskFunction load_task_function(const std::string& path) {
  if (!std::filesystem::exists(path)) throw UsageError("model.library: no file " + path);
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    throw UsageError("model.library: cannot load " + path + ": " + (why ? why : "unknown error"));
  }
  void* fn = dlsym(handle, kModuleTaskSymbol);
  if (fn == nullptr)
    throw UsageError("model.library: " + path + " exports no " + kModuleTaskSymbol +
                     " (define it with SCALETRAIN_MODULE_TASK(fn) from scaletrain/train/module_task.h, built "
                     "against this version of the package)");
  return reinterpret_cast<ModuleTaskFunction>(fn);
}

void check_task(const ModuleTask& task, const std::string& path) {
  std::vector<std::string> missing;
  if (!task.module) missing.push_back("module");
  if (!task.loss) missing.push_back("loss");
  if (!task.data) missing.push_back("data");
  if (missing.empty()) return;
  std::string list;
  for (const auto& m : missing) list += (list.empty() ? "" : ", ") + m;
  throw UsageError("model.library: the task of " + path + " has no " + list + " (ModuleTask in module_task.h)");
}

// What the module route reads itself, taken out of the config the trainer
// options are read from, and the world's options from it.
comm::WorldOptions take_world_options(config::Config& c) {
  static const config::Config defaults;
  comm::WorldOptions wo;
  wo.backend = comm::parse_backend(c.parallel.backend);
  wo.timeout = std::chrono::milliseconds(static_cast<int64_t>(c.parallel.timeout_s * 1000));
  wo.debug_collectives = c.parallel.debug_collectives;
  c.parallel.backend = defaults.parallel.backend;
  c.parallel.timeout_s = defaults.parallel.timeout_s;
  c.parallel.debug_collectives = defaults.parallel.debug_collectives;
  c.model.library.clear();
  c.model.library_args.clear();
  return wo;
}

// With the library's own optimizer, AdamW's settings would be ignored.
void refuse_adamw_keys(const config::Config& c) {
  static const config::Config defaults;
  std::vector<std::string> problems;
  for (const char* key : {"train.beta1", "train.beta2", "train.eps", "train.weight_decay"})
    if (config::config_value(c, key) != config::config_value(defaults, key))
      problems.push_back(std::string(key) + "=" + config::config_value(c, key) +
                         " would have no effect: the library's task brings its own optimizer");
  if (!problems.empty()) throw UsageError(config::join_problems(problems));
}

}  // namespace

void run_module_library(const config::Config& config) {
  config::Config c = config;
  const std::string path = c.model.library, args = c.model.library_args;
  const ModuleTaskFunction fn = load_task_function(path);
  const comm::WorldOptions wo = take_world_options(c);
  ModuleTrainerOptions options = module_trainer_options(c);  // refuses what a user module cannot use
  detail::set_threads();
  auto world = comm::World::init(wo);
  ModuleTask task;
  fn(args.c_str(), &task);
  check_task(task, path);
  const auto& u = options.units;
  if (options.strategy != ModuleStrategy::DDP && u.names.empty() && u.types.empty() && u.min_num_params == 0)
    options.units = task.units;
  if (options.tp > 1) options.tensor_plan = task.tensor_plan;
  if (task.optimizer) {
    refuse_adamw_keys(c);
    options.adamw.reset();
  }
  // What only the module shows (its device for fp16, its names for the units) is the config's problem here.
  std::unique_ptr<ModuleTrainer> trainer;
  try {
    trainer = std::make_unique<ModuleTrainer>(task.module, *world, task.optimizer, task.loss, options);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string(e.what()) + " (from the config's keys and " + path + "'s module)");
  }
  trainer->fit(*task.data);
}

}  // namespace scaletrain::train
