#include "scaletrain/models/hf_names.h"

#include <map>
#include <sstream>

#include "scaletrain/util/error.h"

namespace scaletrain::models {
namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  const auto e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

}  // namespace

std::string block_class_from_hf(const std::string& key, const std::string& names) {
  // Transformers' class of one repeated layer, per family this build has.
  static const std::map<std::string, std::string> kBlocks = {
      {"Block", "Block"},                          // ours (models/gpt.h)
      {"GPT2Block", "Block"},                      // transformers GPT2LMHeadModel
      {"LlamaDecoderLayer", "LlamaDecoderLayer"},  // ours (models/llama.h) and LlamaForCausalLM
      {"MistralDecoderLayer", "LlamaDecoderLayer"},
      {"Qwen2DecoderLayer", "LlamaDecoderLayer"},
  };
  std::string found;
  std::stringstream list(names);
  for (std::string item; std::getline(list, item, ',');) {
    const std::string name = trim(item);
    if (name.empty()) continue;
    const auto it = kBlocks.find(name);
    if (it == kBlocks.end())
      throw UsageError(key + ": '" + name + "' is not a layer class of this build's models (known: GPT2Block, Block, LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer)");
    if (!found.empty() && found != it->second)
      throw UsageError(key + ": '" + names + "' names layers of different models");
    found = it->second;
  }
  if (found.empty()) throw UsageError(key + " is empty");
  return found;
}

}  // namespace scaletrain::models
