#include "scaletrain/hub/hub_write.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "scaletrain/checkpoint/index.h"
#include "scaletrain/util/error.h"

namespace scaletrain::hub {
namespace fs = std::filesystem;
using checkpoint::dtype_size;
using checkpoint::SafetensorsError;
using checkpoint::TensorRef;
using checkpoint::write_file_durably;
using checkpoint::write_safetensors_streamed;

int64_t parse_shard_size(const std::string& text) {
  auto bad = [&](const std::string& why) -> int64_t {
    throw UsageError("--max-shard-size " + (text.empty() ? std::string("''") : text) + ": " + why +
                     " (e.g. 5GB, 500MB, 2GiB or a number of bytes)");
  };
  std::size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  const std::string number = text.substr(0, i);
  std::string unit = text.substr(i);
  for (auto& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  if (number.empty() || number == "." || std::count(number.begin(), number.end(), '.') > 1) return bad("not a size");
  static const std::vector<std::pair<std::string, double>> units = {
      {"", 1},       {"B", 1},      {"KB", 1e3},        {"MB", 1e6},        {"GB", 1e9},
      {"TB", 1e12},  {"KIB", 1024}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  double scale = 0;
  for (const auto& [name, s] : units)
    if (unit == name) scale = s;
  if (scale == 0) return bad("unknown unit '" + text.substr(i) + "'");
  const double bytes = std::stod(number) * scale;
  if (!(bytes >= 1)) return bad("must be at least one byte");
  if (bytes > 9e18) return bad("too large");
  return static_cast<int64_t>(std::llround(bytes));
}

int64_t HubTensor::nbytes() const {
  int64_t n = static_cast<int64_t>(dtype_size(dtype));
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<std::vector<std::size_t>> plan_hub_shards(const std::vector<HubTensor>& tensors,
                                                      int64_t max_shard_bytes) {
  std::vector<std::vector<std::size_t>> shards;
  std::vector<std::size_t> current;
  int64_t current_bytes = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const int64_t n = tensors[i].nbytes();
    if (n > max_shard_bytes) {  // alone in a shard of its own; the current one goes on
      shards.push_back({i});
      continue;
    }
    if (current_bytes + n > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(i);
    current_bytes += n;
  }
  if (!current.empty() || shards.empty()) shards.push_back(std::move(current));
  return shards;
}

std::vector<std::string> write_hub_weights(const std::string& dir, const std::vector<HubTensor>& tensors,
                                           int64_t max_shard_bytes) {
  const auto shards = plan_hub_shards(tensors, max_shard_bytes);
  const std::size_t n = shards.size();
  std::vector<std::string> files;
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total = 0;
  for (std::size_t s = 0; s < n; ++s) {
    std::string file = "model.safetensors";
    if (n > 1) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", s + 1, n);
      file = buf;
    }
    std::vector<TensorRef> refs;
    std::map<std::string, std::size_t> by_name;
    for (std::size_t i : shards[s]) {
      const HubTensor& t = tensors[i];
      refs.push_back({t.name, t.dtype, t.shape, nullptr, static_cast<std::size_t>(t.nbytes())});
      by_name[t.name] = i;
      weight_map[t.name] = file;
      total += t.nbytes();
    }
    at::Tensor held;  // the tensor being written, alive until the next is asked for
    const std::string path = (fs::path(dir) / file).string();
    auto source = [&](const TensorRef& ref) -> const void* {
      const HubTensor& t = tensors[by_name.at(ref.name)];
      held = t.read();
      if (!held.is_contiguous() || held.nbytes() != ref.nbytes || held.sizes().vec() != t.shape)
        throw UsageError("hub " + path + ": tensor " + t.name + " was read with shape " + c10::str(held.sizes()) +
                         ", expected " + c10::str(t.shape));
      return held.data_ptr();
    };
    try {
      write_safetensors_streamed(path, refs, source, {{"format", "pt"}});
    } catch (const SafetensorsError& e) {
      throw UsageError(std::string(e.what()));
    }
    files.push_back(file);
  }
  if (n > 1) {
    const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_durably((fs::path(dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
    files.push_back("model.safetensors.index.json");
  }
  return files;
}

}  // namespace scaletrain::hub
