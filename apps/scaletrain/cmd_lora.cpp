// `scaletrain lora merge BASE_DIR ADAPTER_DIR -o OUT_DIR`: a PEFT LoRA
// adapter folded into its base model (hub/peft_adapter.h).
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "scaletrain/hub/peft_adapter.h"

namespace scaletrain::cli {

void add_lora(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("lora", "work with LoRA adapters (PEFT directories)");
  cmd->require_subcommand(1);
  auto base = std::make_shared<std::string>();
  auto adapter = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto dtype = std::make_shared<std::string>();
  auto* merge = cmd->add_subcommand("merge", "write base + adapter as one Hugging Face Hub model (W + scaling * B A)");
  merge->add_option("base", *base, "the base model's Hub directory (config.json, safetensors)")->required();
  merge->add_option("adapter", *adapter, "a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)")
      ->required();
  merge->add_option("-o,--output", *out, "output directory (must not exist, or be empty)")->required();
  merge->add_option("--dtype", *dtype, "fp32 | bf16 | fp16 (default: each base tensor's dtype)");
  merge->callback([&run, base, adapter, out, dtype] {
    run = [base, adapter, out, dtype] {
      const int64_t n = hub::merge_adapter(*base, *adapter, *out, *dtype);
      std::printf("wrote %s: %s with %lld adapted layers merged from %s (Hugging Face Hub layout)\n", out->c_str(),
                  base->c_str(), static_cast<long long>(n), adapter->c_str());
      return 0;
    };
  });
}

}  // namespace scaletrain::cli
