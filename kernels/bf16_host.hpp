#pragma once
// bf16 on the host, for CPU references and tests: round to nearest even, NaN stays NaN.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace duet::kernels {

/// bf16 values travel as their 16-bit patterns in params structs (host and device alike).
using bf16_bits = uint16_t;

[[nodiscard]] inline float bf16_to_f32(bf16_bits b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

[[nodiscard]] inline bf16_bits f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<bf16_bits>((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<bf16_bits>(u >> 16);
}

/// f rounded to bf16 and back: one bf16 rounding step of a reference computation.
[[nodiscard]] inline float round_bf16(float f) {
  return bf16_to_f32(f32_to_bf16(f));
}

}  // namespace duet::kernels
