#pragma once
// One CSV line per engine step of a prefill or decode worker, live or simulated, so the steps
// of a live run and of its simulation can be compared one by one (scripts/compare-steps.py).
// DUET_STEP_LOG=PREFIX turns it on: each worker appends to PREFIX.<worker>.<pid>.csv, where
// <worker> is its address with every character other than [A-Za-z0-9._-] replaced by '_'.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>

namespace duet {

struct step_record {
  std::string_view role;  // "prefill" or "decode"
  int64_t begin_ms = 0;   // the core's clock (virtual in the simulator) when the step began
  int64_t end_ms = 0;     // ... and when it finished
  int64_t engine_us = 0;  // live: the engine call's wall time; simulated: its modelled time
  uint32_t sequences = 0; // prefill chunks or decode rows
  uint64_t tokens = 0;    // tokens computed
  uint64_t context = 0;   // prefill: tokens before the chunks; decode: tokens attended
  std::string mix;        // prefill: the chunks as `duet bench engine --prefill-mix` reads them
};

struct step_output;
class step_log;
/// Completes `r` with the step's end and engine time (its modelled time where the engine
/// models one, else its wall time) and writes it.
void log_step(step_log& log, step_record& r, const step_output& out, int64_t end_ms);

class step_log {
 public:
  /// The log DUET_STEP_LOG names for `worker`, or null when it is unset or empty. Throws
  /// std::runtime_error when the file cannot be opened.
  [[nodiscard]] static std::unique_ptr<step_log> from_env(std::string_view worker);
  explicit step_log(const std::filesystem::path& file);
  void write(const step_record& r);

 private:
  std::ofstream out_;
};

/// A prefill step's chunks as a prefill mix: "1xT" or "1xT@P" per chunk (T tokens after P
/// cached), joined by '+'.
class prefill_mix_text {
 public:
  void add(uint32_t tokens, uint32_t prior);
  [[nodiscard]] const std::string& str() const { return text_; }

 private:
  std::string text_;
};

}  // namespace duet
