#include "runtime/step_log.hpp"

#include "runtime/engine.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>

namespace duet {

std::unique_ptr<step_log> step_log::from_env(std::string_view worker) {
  const char* prefix = std::getenv("DUET_STEP_LOG");
  if (!prefix || !*prefix) return nullptr;
  std::string name(worker);
  for (char& c : name) {
    const bool plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                       c == '.' || c == '_' || c == '-';
    if (!plain) c = '_';
  }
  return std::make_unique<step_log>(std::string(prefix) + "." + name + "." +
                                    std::to_string(::getpid()) + ".csv");
}

step_log::step_log(const std::filesystem::path& file) {
  const bool fresh = !std::filesystem::exists(file) || std::filesystem::file_size(file) == 0;
  out_.open(file, std::ios::app);
  if (!out_) throw std::runtime_error("DUET_STEP_LOG: cannot open " + file.string());
  if (fresh) out_ << "role,begin_ms,end_ms,engine_us,sequences,tokens,context,mix\n";
}

void step_log::write(const step_record& r) {
  out_ << r.role << ',' << r.begin_ms << ',' << r.end_ms << ',' << r.engine_us << ','
       << r.sequences << ',' << r.tokens << ',' << r.context << ',' << r.mix << '\n';
  out_.flush();  // a worker may be killed at the end of a run
}

void log_step(step_log& log, step_record& r, const step_output& out, int64_t end_ms) {
  r.end_ms = end_ms;
  const auto engine = out.modeled.count() > 0 ? out.modeled : out.engine_wall;
  r.engine_us = std::chrono::duration_cast<std::chrono::microseconds>(engine).count();
  log.write(r);
}

void prefill_mix_text::add(uint32_t tokens, uint32_t prior) {
  if (!text_.empty()) text_ += '+';
  text_ += "1x" + std::to_string(tokens);
  if (prior > 0) text_ += "@" + std::to_string(prior);
}

}  // namespace duet
