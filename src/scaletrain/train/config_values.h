#pragma once
// Typed reading of config values, shared by the config-file readers
// (config.cpp, accelerate_config.cpp). Each throws UsageError naming `key`.
#include <cstdint>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

namespace scaletrain::train {

int64_t to_int(const std::string& key, const std::string& v);  // also whole numbers written like 1e8
double to_double(const std::string& key, const std::string& v);
bool to_bool(const std::string& key, const std::string& v);  // true/false, True/False, 1/0, yes/no
std::string join(const std::vector<std::string>& v);         // "a | b | \"\""
// Several problems as one line: the problem itself, or "N problems in the
// config: A; B; C" (every reader reports all it found at once, Note [One plan]).
std::string join_problems(const std::vector<std::string>& problems);

// The YAML document of a config file; UsageError when it cannot be read or
// parsed (naming the file, line and column).
YAML::Node read_yaml_file(const std::string& path);

}  // namespace scaletrain::train
