#pragma once
// Typed reading of config values, shared by the config-file readers
// (config.cpp, accelerate_config.cpp). Each throws UsageError naming `key`.
#include <cstdint>
#include <string>
#include <vector>

namespace scaletrain::train {

int64_t to_int(const std::string& key, const std::string& v);     // also whole numbers written like 1e8
double to_double(const std::string& key, const std::string& v);
bool to_bool(const std::string& key, const std::string& v);       // true/false, True/False, 1/0, yes/no
std::string join(const std::vector<std::string>& v);              // "a | b | \"\""

}  // namespace scaletrain::train
