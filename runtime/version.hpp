#pragma once
#include <string_view>

namespace duet {
/// The duet release, as printed by `duet --version`.
inline constexpr std::string_view version_string = "0.1.0";
[[nodiscard]] std::string_view build_description();
}  // namespace duet
