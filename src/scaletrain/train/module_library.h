#pragma once
// `scaletrain train` with model.library set: a user's module from a shared
// library (module_task.h) trained by the module trainer.
#include "scaletrain/train/plan/config.h"

namespace scaletrain::train {

// Loads model.library, joins the job (parallel.backend, timeout_s,
// debug_collectives), calls the library's task function with
// model.library_args and runs ModuleTrainer::fit with the config's other
// keys. A library that cannot be loaded, exports no task function or fills
// the task incompletely, and any key the trainer cannot use, is a UsageError
// naming it, before any step.
void run_module_library(const config::Config& config);

}  // namespace scaletrain::train
