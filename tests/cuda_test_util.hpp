#pragma once
// Helpers of the GPU tests: device buffers, NaN poisoning, bf16 random data, relative errors,
// and the skip when no CUDA device is present (CI has none).
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/bf16_host.hpp"

namespace duet::cuda_test {

/// True when a CUDA device is present; otherwise the calling test reports the skip and returns.
inline bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  return true;
}

#define DUET_REQUIRE_GPU()                                                                 \
  do {                                                                                     \
    if (!::duet::cuda_test::have_gpu()) {                                                  \
      MESSAGE("skipped: cudaGetDeviceCount found no CUDA device (this test needs a GPU)"); \
      return;                                                                              \
    }                                                                                      \
  } while (0)

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

/// Small sweeps under compute-sanitizer (DUET_CUDA_TEST_SMALL=1).
inline bool small_sweep() {
  const char* v = std::getenv("DUET_CUDA_TEST_SMALL");
  return v && std::strcmp(v, "1") == 0;
}

template <class T>
class dbuf {
 public:
  dbuf() = default;
  explicit dbuf(std::size_t n) : n_(n) {
    if (n) check(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)), "cudaMalloc");
    poison();
  }
  explicit dbuf(const std::vector<T>& host) : dbuf(host.size()) { upload(host); }
  ~dbuf() {
    if (p_) cudaFree(p_);
  }
  dbuf(const dbuf&) = delete;
  dbuf& operator=(const dbuf&) = delete;
  dbuf(dbuf&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(o.n_) {}
  dbuf& operator=(dbuf&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  /// Every byte 0xff: NaN as bf16 and as fp32.
  void poison() {
    if (p_) check(cudaMemset(p_, 0xff, n_ * sizeof(T)), "cudaMemset");
  }
  void upload(const std::vector<T>& host) {
    check(
        cudaMemcpy(p_, host.data(), std::min(n_, host.size()) * sizeof(T), cudaMemcpyHostToDevice),
        "upload");
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> host(n_);
    check(cudaDeviceSynchronize(), "kernel");
    if (n_) check(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }
  [[nodiscard]] T* get() const { return p_; }
  [[nodiscard]] std::size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

inline std::vector<uint16_t> random_bf16(std::size_t n, std::mt19937& rng, float stddev = 1.0f,
                                         float mean = 0.0f) {
  std::normal_distribution<float> d(mean, stddev);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = kernels::f32_to_bf16(d(rng));
  return v;
}

struct error_stats {
  double rel = 0;       // ||out - ref|| / ||ref||
  std::size_t nan = 0;  // NaN or inf in out where ref is finite
  std::size_t n = 0;
};

template <class F>
error_stats compare(std::size_t n, F&& pair) {
  error_stats s;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto [out, ref] = pair(i);
    if (!std::isfinite(ref)) continue;
    ++s.n;
    if (!std::isfinite(out)) {
      ++s.nan;
      continue;
    }
    num += (static_cast<double>(out) - ref) * (static_cast<double>(out) - ref);
    den += static_cast<double>(ref) * ref;
  }
  s.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return s;
}

inline error_stats compare_bf16(const std::vector<uint16_t>& out,
                                const std::vector<uint16_t>& ref) {
  return compare(ref.size(), [&](std::size_t i) {
    return std::pair<float, float>{kernels::bf16_to_f32(out[i]), kernels::bf16_to_f32(ref[i])};
  });
}
inline error_stats compare_f32(const std::vector<float>& out, const std::vector<float>& ref) {
  return compare(ref.size(), [&](std::size_t i) {
    return std::pair<float, float>{out[i], ref[i]};
  });
}

}  // namespace duet::cuda_test
