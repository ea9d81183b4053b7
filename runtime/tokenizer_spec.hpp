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
  std::vector<std::string> vocab;  // id -> token in byte-level form ("Ġhello"); may be empty
                                   // for ids that only an added token names
  std::vector<std::pair<std::string, std::string>> merges;  // in rank order
  std::vector<added_token> added;
  std::string pre_tokenizer;  // split-regex family: "llama3", "qwen2", "gpt2", "smollm", ...
  // Split regexes applied in order, each one splitting the pieces of the one before (matches
  // and the gaps between them both kept, as HF's Split with behavior "Isolated"). Filled from
  // tokenizer.json; when empty, the `pre_tokenizer` family name chooses them.
  std::vector<std::string> pre_tokenizer_regexes;
  // A word that is a whole vocab entry becomes that one token without merging (HF BPE
  // "ignore_merges", set by Llama-3). The "llama3" family implies it when no regexes are given.
  bool ignore_merges = false;
  std::string normalizer;     // "" (none) or "nfc" ("nfd", "nfkc", "nfkd" also accepted)
  std::optional<int32_t> bos_id;
  std::optional<int32_t> eos_id;
  bool add_bos = false;       // prepend bos when encoding with add_special
  std::string chat_template;  // Jinja source, empty when the model has none
};

}  // namespace duet
