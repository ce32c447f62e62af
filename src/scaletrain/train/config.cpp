#include "scaletrain/train/config.h"

#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>

#include "scaletrain/util/error.h"

namespace scaletrain::train {
namespace {

using Setter = std::function<void(Config&, const std::string&)>;

int64_t to_int(const std::string& key, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno == ERANGE) throw UsageError(key + ": '" + v + "' is not an integer");
  return x;
}

double to_double(const std::string& key, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno == ERANGE) throw UsageError(key + ": '" + v + "' is not a number");
  return x;
}

bool to_bool(const std::string& key, const std::string& v) {
  if (v == "true" || v == "True" || v == "1" || v == "yes") return true;
  if (v == "false" || v == "False" || v == "0" || v == "no") return false;
  throw UsageError(key + ": '" + v + "' is not true or false");
}


// The table of keys: one line per field.
const std::map<std::string, Setter>& fields() {
  static const std::map<std::string, Setter> table = [] {
    std::map<std::string, Setter> t;
#define ST_INT(section, name) \
  t[#section "." #name] = [](Config& c, const std::string& v) { c.section.name = to_int(#section "." #name, v); };
#define ST_DBL(section, name) \
  t[#section "." #name] = [](Config& c, const std::string& v) { c.section.name = to_double(#section "." #name, v); };
#define ST_BOOL(section, name) \
  t[#section "." #name] = [](Config& c, const std::string& v) { c.section.name = to_bool(#section "." #name, v); };
#define ST_STR(section, name) t[#section "." #name] = [](Config& c, const std::string& v) { c.section.name = v; };
    ST_STR(model, preset) ST_INT(model, n_layer) ST_INT(model, n_head) ST_INT(model, n_embd)
    ST_INT(model, block_size) ST_INT(model, vocab_size) ST_DBL(model, dropout)
    ST_STR(data, path)
    ST_INT(train, steps) ST_INT(train, global_batch) ST_INT(train, micro_batch) ST_DBL(train, lr)
    ST_INT(train, warmup_steps) ST_DBL(train, min_lr_ratio) ST_DBL(train, weight_decay) ST_DBL(train, beta1)
    ST_DBL(train, beta2) ST_DBL(train, grad_clip) ST_INT(train, seed) ST_INT(train, sample_tokens)
    ST_STR(train, sample_prompt)
    ST_STR(parallel, strategy) ST_INT(parallel, dp_replicate) ST_INT(parallel, dp_shard) ST_INT(parallel, tp)
    ST_INT(parallel, pp) ST_DBL(parallel, bucket_cap_mb) ST_DBL(parallel, first_bucket_mb)
    ST_BOOL(parallel, find_unused_parameters) ST_STR(parallel, comm_dtype) ST_STR(parallel, backend)
    ST_DBL(parallel, timeout_s)
    ST_STR(metrics, path) ST_DBL(metrics, peak_flops) ST_INT(metrics, log_every) ST_BOOL(metrics, progress)
#undef ST_INT
#undef ST_DBL
#undef ST_BOOL
#undef ST_STR
    return t;
  }();
  return table;
}

void set_key(Config& c, const std::string& key, const std::string& value) {
  auto it = fields().find(key);
  if (it == fields().end()) {
    std::string section = key.substr(0, key.find('.')), known;
    for (auto& [k, s] : fields())
      if (k.compare(0, section.size() + 1, section + ".") == 0) known += (known.empty() ? "" : ", ") + k;
    if (known.empty())
      throw UsageError("unknown config section '" + section + "' (known: model, data, train, parallel, metrics)");
    throw UsageError("unknown config key '" + key + "' (known in " + section + ": " + known + ")");
  }
  it->second(c, value);
}

void validate(const Config& c) {
  if (c.train.steps < 1) throw UsageError("train.steps must be at least 1");
  if (c.train.global_batch < 1 || c.train.micro_batch < 1)
    throw UsageError("train.global_batch and train.micro_batch must be at least 1");
  if (c.train.lr <= 0) throw UsageError("train.lr must be positive");
  if (c.parallel.comm_dtype != "fp32" && c.parallel.comm_dtype != "bf16")
    throw UsageError("parallel.comm_dtype must be fp32 or bf16, got '" + c.parallel.comm_dtype + "'");
  if (c.parallel.bucket_cap_mb <= 0 || c.parallel.first_bucket_mb <= 0)
    throw UsageError("parallel.bucket_cap_mb and parallel.first_bucket_mb must be positive");
  if (c.parallel.timeout_s <= 0) throw UsageError("parallel.timeout_s must be positive");
  if (c.metrics.log_every < 1) throw UsageError("metrics.log_every must be at least 1");
}

}  // namespace

std::vector<std::string> config_keys() {
  std::vector<std::string> keys;
  for (auto& [k, s] : fields()) keys.push_back(k);
  return keys;
}

void apply_override(Config& config, const std::string& assignment) {
  std::string a = assignment;
  if (a.rfind("--", 0) == 0) a = a.substr(2);
  auto eq = a.find('=');
  if (eq == std::string::npos || a.find('.') > eq)
    throw UsageError("override '" + assignment + "' is not of the form --section.key=value");
  set_key(config, a.substr(0, eq), a.substr(eq + 1));
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  Config c;
  if (!path.empty()) {
    std::ifstream probe(path);
    if (!probe) throw UsageError("config file " + path + " cannot be read");
    YAML::Node root;
    try {
      root = YAML::LoadFile(path);
    } catch (const YAML::Exception& e) {
      throw UsageError("config file " + path + " is not valid YAML (line " + std::to_string(e.mark.line + 1) +
                       ", column " + std::to_string(e.mark.column + 1) + "): " + e.msg);
    }
    if (root && !root.IsNull()) {
      if (!root.IsMap()) throw UsageError("config file " + path + ": the top level must be a map of sections");
      for (const auto& section : root) {
        const std::string name = section.first.as<std::string>();
        if (!section.second.IsMap() && !section.second.IsNull())
          throw UsageError("config file " + path + ": section '" + name + "' must be a map of keys");
        for (const auto& kv : section.second) {
          const std::string key = name + "." + kv.first.as<std::string>();
          if (!kv.second.IsScalar())
            throw UsageError("config file " + path + ": " + key + " must be a single value");
          set_key(c, key, kv.second.Scalar());
        }
      }
    }
  }
  for (const auto& o : overrides) apply_override(c, o);
  validate(c);
  return c;
}

}  // namespace scaletrain::train
