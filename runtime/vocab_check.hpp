#pragma once
// Does a tokenizer belong to a model? A tokenizer with ids past the model's embedding rows
// indexes out of the embedding; one whose eos differs from the model's never stops generation
// where its chat template ends a turn. check_vocab refuses both with a message naming the
// files and ids, and warns (without failing) about embedding rows no token maps to, which is
// normal: Qwen2 checkpoints round vocab_size up (151936 or 152064 rows for 151665 tokens).
// docs/tokenizer.md, "Model and tokenizer agree".
#include <cstdint>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/tokenizer_spec.hpp"

namespace duet {

struct transformer_config;
class tokenizer;

/// What a model says about its vocabulary: config.json, and generation_config.json when the
/// checkpoint has one (HF's generate() takes bos/eos from there).
struct model_vocab {
  std::string source;             // "<dir>/config.json", for messages
  uint32_t vocab_size = 0;        // embedding rows (config.json vocab_size)
  std::optional<int32_t> bos_id;  // generation_config.json's bos_token_id, else config.json's
  std::vector<int32_t> eos_ids;   // config.json eos_token_id (an int or a list)
  std::vector<int32_t> generation_eos_ids;  // generation_config.json eos_token_id; empty when none
};

/// The model_vocab of a parsed config.json (no generation_config.json).
[[nodiscard]] model_vocab model_vocab_of(const transformer_config& config, std::string source);

/// Reads `<dir>/config.json` (through load_hf_config, so its errors) and
/// `<dir>/generation_config.json` when present. Throws std::runtime_error naming the file.
[[nodiscard]] model_vocab load_model_vocab(const std::filesystem::path& dir);

/// A model and a tokenizer that cannot work together. what() reads
/// "vocab check: <tokenizer file> does not fit <config file>: <what, with ids>".
class vocab_mismatch_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What check_vocab found when the pair is usable.
struct vocab_check_report {
  uint32_t tokenizer_ids = 0;  // one past the largest id the tokenizer has (added tokens included)
  uint32_t padding_rows = 0;   // embedding rows past tokenizer_ids (never produced by encode)
  std::vector<std::string> warnings;  // one sentence each, for stderr
};

/// Refuses (vocab_mismatch_error) when
///   - a token id of the tokenizer, added and special tokens included, is >= vocab_size;
///   - the tokenizer's eos_token is not among the model's eos ids (config.json and
///     generation_config.json together), or a model eos id is not a token of the tokenizer;
///   - both name a bos and the ids differ.
/// Warns when the model has padding rows, when the model declares no eos, and when the
/// tokenizer's eos is only in generation_config.json (the engines stop on config.json's ids).
/// `tokenizer_source` names the tokenizer in messages.
[[nodiscard]] vocab_check_report check_vocab(const model_vocab& model, const tokenizer_spec& tok,
                                             std::string_view tokenizer_source);
/// The same for a built tokenizer (its spec()).
[[nodiscard]] vocab_check_report check_vocab(const model_vocab& model, const tokenizer& tok,
                                             std::string_view tokenizer_source);

/// Checks a Hugging Face model directory against the tokenizer.json beside its config.json.
/// nullopt (nothing checked) when `dir` is not a directory or lacks either file, as for a
/// GGUF path or a checkpoint served by token ids only. Throws vocab_mismatch_error, and
/// std::runtime_error for files that do not parse.
[[nodiscard]] std::optional<vocab_check_report> check_model_dir_vocab(
    const std::filesystem::path& dir);

/// One past the largest id `spec` names (vocab entries and added tokens).
[[nodiscard]] uint32_t tokenizer_id_count(const tokenizer_spec& spec);

}  // namespace duet
