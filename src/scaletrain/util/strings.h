#pragma once
// Small string helpers that several files need.
#include <cstddef>
#include <string>

namespace scaletrain::util {

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// "[2, 3, 4]" for any sequence of integers (a shape: std::vector<int64_t>, at::IntArrayRef).
template <class Shape>
std::string shape_text(const Shape& shape) {
  std::string out = "[";
  std::size_t i = 0;
  for (auto d : shape) out += (i++ ? ", " : "") + std::to_string(d);
  return out + "]";
}

}  // namespace scaletrain::util
