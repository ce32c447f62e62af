#pragma once
// Input checks the element kernels share (norm_activation.cpp,
// layer_norm_gelu.cpp): each problem is one scaletrain::UsageError line that
// starts with the operation's name.
#include <ATen/ATen.h>

#include <sstream>
#include <string>

#include "scaletrain/util/error.h"

namespace scaletrain::kernels::detail {

template <typename T>
constexpr at::ScalarType dtype_of() {
  return c10::CppTypeToScalarType<T>::value;
}

// A value as it prints (sizes, dtypes, devices, numbers).
template <typename T>
std::string str(const T& value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

[[noreturn]] inline void fail(const char* op, const std::string& message) {
  throw UsageError(std::string(op) + ": " + message);
}

inline void check_floating(const char* op, const at::Tensor& t, const char* name) {
  if (!at::isFloatingType(t.scalar_type()))
    fail(op, std::string(name) + " must be a floating tensor, got " + str(t.scalar_type()));
}

}  // namespace scaletrain::kernels::detail
