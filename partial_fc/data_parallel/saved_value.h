// Non-tensor values an autograd function needs again in backward (the Distributed runtime,
// a margin): kept in the context's saved_data as a typed capsule rather than an address
// squeezed into an integer.
#pragma once
#include <string>
#include <utility>

#include <torch/csrc/autograd/custom_function.h>

namespace faceshard {

template <typename T>
struct SavedValue : torch::CustomClassHolder {
  explicit SavedValue(T v) : value(std::move(v)) {}
  T value;
};

template <typename T>
void save_value(torch::autograd::AutogradContext* ctx, const std::string& key, T value) {
  ctx->saved_data[key] = c10::IValue::make_capsule(c10::make_intrusive<SavedValue<T>>(std::move(value)));
}

template <typename T>
T& saved_value(torch::autograd::AutogradContext* ctx, const std::string& key) {
  return static_cast<SavedValue<T>*>(ctx->saved_data.at(key).toCapsule().get())->value;
}

}  // namespace faceshard
