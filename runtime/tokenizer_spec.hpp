#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace duet {

/// Everything a byte-level BPE tokenizer needs, independent of where it came from
/// (HF tokenizer.json + tokenizer_config.json, or a GGUF file's tokenizer.ggml.* keys).
struct tokenizer_spec {
  struct added_token {
    int32_t id = 0;
    std::string content;   // literal text matched before BPE
    bool special = false;  // skipped by decode(skip_special = true)
    bool lstrip = false;
    bool rstrip = false;
    bool single_word = false;
    bool normalized = false;
  };
  std::vector<std::string> vocab;  // id -> token in byte-level form ("Ġhello")
  std::vector<std::pair<std::string, std::string>> merges;  // in rank order
  std::vector<added_token> added;
  std::string pre_tokenizer;  // split-regex family: "llama3", "qwen2", "gpt2", "smollm", ...
  std::string normalizer;     // "" (none) or "nfc"
  std::optional<int32_t> bos_id;
  std::optional<int32_t> eos_id;
  bool add_bos = false;       // prepend bos when encoding with add_special
  std::string chat_template;  // Jinja source, empty when the model has none
};

}  // namespace duet
