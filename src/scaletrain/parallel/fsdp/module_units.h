#pragma once
// Units of any torch::nn::Module: which submodules fully_shard gathers and
// frees as one, chosen by a wrap policy over the module tree (FSDP's
// ModuleWrapPolicy / size_based_auto_wrap_policy, or a list of names).
//
// Units do not nest: a submodule inside a chosen one is never a unit of its
// own, and naming both is an error. Parameters outside every unit form the
// root unit, gathered from their first use in forward until backward ends.
// Units are listed in registration order (a pre-order walk of the tree),
// which the engine takes as the order forward uses them (Note [Gather on
// use] in gather_on_use.h says what happens when it does not).
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/interfaces/blocks.h"

namespace scaletrain::parallel::fsdp {

struct ModuleUnits {
  // Every submodule whose class is one of these is a unit: the name
  // torch::nn::Module::name() gives, e.g. "BasicBlockImpl" for a user's
  // struct BasicBlockImpl, "torch::nn::LinearImpl" for a Linear; a name
  // without its namespaces matches too ("LinearImpl").
  std::vector<std::string> types;
  // These submodules (dotted names, as named_modules() gives them) are units.
  std::vector<std::string> names;
  // Size policy: the smallest submodules holding at least this many
  // parameters become units (a module none of whose descendants became one);
  // 0: off.
  int64_t min_num_params = 0;
};

// The chosen submodules' dotted names, in registration order. Throws
// std::invalid_argument naming the problem: a name that is no submodule, a
// type no submodule has, units that nest, a policy that chose nothing while
// asking for something.
std::vector<std::string> select_units(const torch::nn::Module& module, const ModuleUnits& units);

// The engine's view of a user module: one "block" per chosen submodule, in
// the order select_units() gives. Nothing calls set_block_runner's runner:
// units are gathered when an operator first reads their parameters (Note
// [Gather on use]), so the module's forward stays the user's.
class ModuleBlocks : public interfaces::Blockwise {
 public:
  explicit ModuleBlocks(std::vector<std::string> names) : names_(std::move(names)) {}
  int64_t num_blocks() const override { return static_cast<int64_t>(names_.size()); }
  std::string block_prefix(int64_t i) const override { return names_.at(static_cast<size_t>(i)) + "."; }
  std::string block_class() const override { return "unit"; }
  void set_block_runner(interfaces::BlockRunner) override {}

 private:
  std::vector<std::string> names_;
};

}  // namespace scaletrain::parallel::fsdp
