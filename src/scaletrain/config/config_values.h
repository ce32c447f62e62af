#pragma once
// Typed reading of config values, shared by the config-file readers
// (config.cpp, load.cpp, accelerate_config.cpp). Each throws UsageError naming `key`.
#include <cstdint>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "scaletrain/config/config.h"

namespace scaletrain::config {

int64_t to_int(const std::string& key, const std::string& v);  // also whole numbers written like 1e8
double to_double(const std::string& key, const std::string& v);
bool to_bool(const std::string& key, const std::string& v);  // true/false, True/False, 1/0, yes/no
std::string join(const std::vector<std::string>& v);         // "a | b | \"\""
// Several problems as one line: the problem itself, or "N problems in the
// config: A; B; C" (every reader reports all it found at once, Note [One plan]).
std::string join_problems(const std::vector<std::string>& problems);

// The key table (config.cpp) as the file reader (load.cpp) uses it: whether
// `prefix` is a section or sub-section ("parallel.fsdp"), whether `key` is
// a key, one key set from text (UsageError naming an unknown key and the
// keys of its section, or a bad value), and the error for an unknown section.
bool is_config_section(const std::string& prefix);
bool is_config_key(const std::string& key);
void set_config_key(Config& config, const std::string& key, const std::string& value);
std::string unknown_section(const std::string& name);

// The YAML document of a config file; UsageError when it cannot be read or
// parsed (naming the file, line and column).
YAML::Node read_yaml_file(const std::string& path);

}  // namespace scaletrain::config
