#pragma once
// The public C++ API in one include, for programs built against the
// installed package (find_package(scaletrain), target scaletrain::scaletrain;
// docs/own-model.md). Each header below can also be included alone.
//
//   comm::World::init()            join the job the launcher started (torchrun's variables)
//   comm::Mesh                     the rank grid: dp / tp / pp / ep subgroups
//   parallel::DistributedDataParallel   data parallelism over any torch::nn::Module
//   parallel::fsdp::fully_shard    ZeRO-1/2/3 and FSDP's sharding strategies over any module
//   parallel::pipeline::ModulePipeline   pipelines over stages you give (split a Sequential)
//   parallel::tensor::parallelize_module   tensor parallelism by a plan over module names
//   checkpoint::                   sharded checkpoints that reload under any layout
//   checkpoint::load_state_dict    PyTorch's torch.save files, read safely; a Python run's state imported
//   train::sharded_layout, ...     which piece of which tensor an engine's rank holds, for checkpoint::
//   optim::AdamW, clip_grad_norm   the optimizer over whole tensors or flat shards
//   data::DistributedSampler       sample order that depends on (seed, global batch) only
//   observe::StepTracer            Chrome traces of chosen steps, every rank's in one file
#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/checkpoint/torch_file.h"
#include "scaletrain/checkpoint/torch_training.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/observe/tracing.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/ddp/sync_batchnorm.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/pipeline/module_pipeline.h"
#include "scaletrain/parallel/tensor/parallelize_module.h"
#include "scaletrain/parallel/tensor/tp_comm.h"
#include "scaletrain/train/checkpoint_layout.h"
#include "scaletrain/train/module_checkpointing.h"
#include "scaletrain/train/module_task.h"
#include "scaletrain/train/module_trainer.h"
#include "scaletrain/train/recipe.h"
