// Reading a run's config: the YAML file's sections (and an Accelerate file's
// keys among them), then the overrides, then what the Accelerate and
// DeepSpeed readers settle (config/config.h, load_config). The key table
// these fill is config.cpp's.
#include <yaml-cpp/yaml.h>

#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "scaletrain/config/accelerate_config.h"
#include "scaletrain/config/config.h"
#include "scaletrain/config/config_values.h"
#include "scaletrain/util/error.h"

namespace scaletrain::config {
namespace {

// Sets every scalar of a YAML map under `prefix` ("train", "parallel.fsdp");
// each key's problem is added to `problems` (a file's problems are reported together).
void load_map(Config& c, const YAML::Node& map, const std::string& prefix, std::set<std::string>& given,
              std::vector<std::string>& problems) {
  std::set<std::string> here;  // YAML leaves a repeated key to the reader: we refuse it
  for (const auto& kv : map) {
    const std::string key = prefix + "." + kv.first.as<std::string>();
    try {
      if (!here.insert(key).second) throw UsageError(key + " is given twice (which one should count?)");
      if (kv.second.IsMap() && is_config_section(key)) {
        load_map(c, kv.second, key, given, problems);
        continue;
      }
      if (kv.second.IsSequence() &&
          (key == "finetune.target_modules" || key == "metrics.trace_steps" || key == "data.mixture")) {  // lists
        std::string joined;
        for (const auto& item : kv.second) {
          if (!item.IsScalar())
            throw UsageError(key + " must be a list of " + (key[0] == 'f' ? "layer names" : "steps"));
          joined += (joined.empty() ? "" : ",") + item.Scalar();
        }
        set_config_key(c, key, joined);
        given.insert(key);
        continue;
      }
      if (!kv.second.IsScalar() && (is_config_key(key) || !kv.second.IsMap()))
        throw UsageError(key + " must be a single value");
      set_config_key(c, key, kv.second.IsScalar() ? kv.second.Scalar() : "");  // an unknown map: the error names it
      given.insert(key);
    } catch (const UsageError& e) {
      problems.push_back(e.what());
    }
  }
}

// Reads the YAML file into `c`; returns the keys it set and Accelerate's settings.
struct Loaded {
  std::set<std::string> given;    // "section.key" set explicitly
  AccelerateSettings accelerate;  // Note [Accelerate keys] (accelerate_config.cpp)
};

void load_file(Config& c, const std::string& path, Loaded& loaded) {
  const YAML::Node root = read_yaml_file(path);
  if (!root || root.IsNull()) return;
  if (!root.IsMap()) throw UsageError("config file " + path + ": the top level must be a map of sections");
  std::vector<std::string> problems;  // every problem of the file, in one error
  std::set<std::string> sections;
  for (const auto& section : root) {
    const std::string name = section.first.as<std::string>();
    try {
      if (!sections.insert(name).second)
        throw UsageError("section '" + name + "' is given twice (merge its keys into one)");
      if (is_accelerate_key(name)) {
        read_accelerate_key(c, loaded.accelerate, name, section.second, path);
        continue;
      }
      if (!is_config_section(name)) throw UsageError(unknown_section(name));
      if (!section.second.IsMap() && !section.second.IsNull())
        throw UsageError("section '" + name + "' must be a map of keys");
      load_map(c, section.second, name, loaded.given, problems);
    } catch (const UsageError& e) {
      problems.push_back(e.what());
    }
  }
  if (!problems.empty()) throw UsageError("config file " + path + ": " + join_problems(problems));
}

}  // namespace

Config load_config(const std::string& path, const std::vector<std::string>& overrides, const ModelWidth& model_width) {
  Config c;
  Loaded loaded;
  if (!path.empty()) load_file(c, path, loaded);
  // An Accelerate file handed down by `scaletrain launch --config_file`.
  if (const char* acc = std::getenv(kAccelerateConfigEnv); acc && *acc) {
    std::error_code ec;
    if (path.empty() || !std::filesystem::equivalent(path, acc, ec)) load_file(c, acc, loaded);
  }
  for (const auto& o : overrides) {
    apply_override(c, o);
    const std::string a = o.rfind("--", 0) == 0 ? o.substr(2) : o;
    loaded.given.insert(a.substr(0, a.find('=')));
  }
  finish_accelerate(c, loaded.accelerate, loaded.given, model_width);  // Note [Accelerate keys]
  validate_config(c);
  return c;
}

}  // namespace scaletrain::config
