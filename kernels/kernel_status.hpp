#pragma once
// What every kernel launcher returns, and the checks that produce it. Host-only; no CUDA
// headers needed by callers beyond cuda_runtime_api.h.
#include <cuda_runtime_api.h>

#include <string>

namespace duet::kernels {

/// The result of a launch: ok, a violated precondition (code cudaErrorInvalidValue and a static
/// message naming it), or the CUDA error the launch reported, with the file:line that saw it.
struct [[nodiscard]] kstatus {
  cudaError_t code = cudaSuccess;
  const char* what = "";  // static text: the failed precondition or the CUDA call
  const char* file = "";
  int line = 0;

  [[nodiscard]] bool ok() const { return code == cudaSuccess; }
  /// "file:line: what: cuda error name (description)".
  [[nodiscard]] std::string message() const {
    if (ok()) return "ok";
    return std::string(file) + ":" + std::to_string(line) + ": " + what + ": " +
           cudaGetErrorName(code) + " (" + cudaGetErrorString(code) + ")";
  }
};

}  // namespace duet::kernels

/// Returns a precondition failure from a launcher when `cond` is false.
#define DUET_KREQUIRE(cond, text)                                                                  \
  do {                                                                                             \
    if (!(cond)) return ::duet::kernels::kstatus{cudaErrorInvalidValue, text, __FILE__, __LINE__}; \
  } while (0)

/// Returns the error of a CUDA runtime call from a launcher.
#define DUET_KCHECK(call)                                                          \
  do {                                                                             \
    const cudaError_t duet_kcheck_err = (call);                                    \
    if (duet_kcheck_err != cudaSuccess)                                            \
      return ::duet::kernels::kstatus{duet_kcheck_err, #call, __FILE__, __LINE__}; \
  } while (0)

/// Returns the launch error of the kernel just launched.
#define DUET_KLAUNCHED(name) DUET_KCHECK(cudaGetLastError())
