#pragma once
#include <string>
#include <utility>
#include <variant>

namespace duet {

/// A value or a readable error message. Errors are values on the control plane
/// (DESIGN.md, "Error policy"); this is the small type that carries them.
template <class T>
class [[nodiscard]] result {
 public:
  result(T value) : state_(std::in_place_index<0>, std::move(value)) {}  // NOLINT: implicit by design
  static result failure(std::string message) {
    return result(std::in_place_index<1>, std::move(message));
  }
  [[nodiscard]] bool ok() const { return state_.index() == 0; }
  explicit operator bool() const { return ok(); }
  [[nodiscard]] T& value() { return std::get<0>(state_); }
  [[nodiscard]] const T& value() const { return std::get<0>(state_); }
  T& operator*() { return value(); }
  const T& operator*() const { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  [[nodiscard]] const std::string& error() const { return std::get<1>(state_); }

 private:
  template <std::size_t I, class U>
  result(std::in_place_index_t<I> tag, U&& u) : state_(tag, std::forward<U>(u)) {}
  std::variant<T, std::string> state_;
};

}  // namespace duet
