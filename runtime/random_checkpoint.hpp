#pragma once
// Random-weight Hugging Face checkpoints of real model shapes (`duet model random`): for tests,
// benchmarks and rehearsals where the real weights cannot be downloaded.
//
// The values are a pure function of (seed, tensor name, element index), so any writer can
// reproduce a checkpoint bit for bit: tests/tools/make_tiny_checkpoint.py does, in Python, and
// the HF fixtures (tests/data/hf-fixtures/) are made from its output. The generator:
//   key   = mix64(fnv1a64(name) ^ mix64(seed))
//   z     = mix64(key + (i + 1) * 0x9e3779b97f4a7c15)              (splitmix64 finaliser)
//   s     = sum of the four 16-bit fields of z                      (0 .. 262140)
//   value = (s - 131070) * (stddev * sqrt(3) / 65536)               (double, then float;
//                                                                    norms: 1 + that)
// i.e. an Irwin-Hall(4) approximation of N(0, stddev^2) with only exactly rounded operations.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/hf_model.hpp"

namespace duet {

/// Shape values that replace a preset's.
struct shape_overrides {
  std::optional<uint32_t> layers;
  std::optional<uint32_t> hidden;
  std::optional<uint32_t> heads;
  std::optional<uint32_t> kv_heads;
  std::optional<uint32_t> head_dim;
  std::optional<uint32_t> ffn;
  std::optional<uint32_t> vocab;
  std::optional<uint32_t> max_position;
  std::optional<bool> tie_word_embeddings;
};

/// What write_random_checkpoint writes.
struct random_checkpoint_params {
  /// "llama": DeepSeek-R1-Distill-Llama-8B (Llama 3.1 with llama3 rope scaling);
  /// "qwen2": DeepSeek-R1-Distill-Qwen-1.5B (q/k/v biases).
  std::string arch = "llama";
  /// "full": the real shape above. "tiny": 2 layers, hidden 64, 4 heads, 2 KV heads, FFN 128,
  /// the real vocabulary (tests). "small": SmolLM2-135M (llama) / Qwen2.5-0.5B (qwen2) shapes.
  std::string size = "full";
  shape_overrides overrides;
  uint64_t seed = 0;
  std::string dtype = "bf16";  // bf16 | f16 | f32
  double stddev = 0.02;        // of every matrix, embedding and bias (HF's initializer_range)
  double norm_stddev = 0.0;    // norms are 1 + N(0, this); 0 = exactly 1, as HF initialises them
  /// Copy tokenizer.json and tokenizer_config.json from here ("" = write no tokenizer). The
  /// repository holds them in tests/data/tokenizers/{llama3_1,qwen3}.
  std::filesystem::path tokenizer_dir;
  /// A checkpoint over this size is split into model-0000i-of-0000n.safetensors shards.
  uint64_t max_shard_bytes = 5'000'000'000;
  /// With a tokenizer_dir, config.json follows the tokenizer copied beside it: its bos becomes
  /// bos_token_id and its eos joins eos_token_id (ids inside the vocabulary), so the pair passes
  /// check_vocab (runtime/vocab_check.hpp). The repository's Llama-3.1 tokenizer ends turns with
  /// <|eot_id|> 128009, which R1-Distill-Llama-8B's config does not list.
  bool special_ids_from_tokenizer = true;
  /// Replace bos_token_id / eos_token_id after that (empty: keep them). Ids outside the
  /// vocabulary are refused.
  std::optional<int32_t> bos_token_id;
  std::vector<int32_t> eos_token_ids;
  /// Called after each piece of tensor data is generated: (bytes so far, bytes in all). From
  /// the writing thread; may be empty.
  std::function<void(uint64_t done, uint64_t total)> progress;
};

/// The config write_random_checkpoint would write (arch, size and overrides applied; bos/eos
/// ids outside an overridden vocabulary dropped; the tokenizer's bos/eos taken, see above).
/// Throws std::invalid_argument naming a bad arch, size or dtype, and std::runtime_error for an
/// inconsistent shape or a tokenizer that does not load.
[[nodiscard]] transformer_config random_checkpoint_config(const random_checkpoint_params& params);

struct random_checkpoint_result {
  transformer_config config;
  std::vector<std::filesystem::path> files;  // config.json, weights (and index), tokenizer files
  uint64_t weight_bytes = 0;                 // bytes of tensor data written
};

/// Writes config.json, the safetensors weights and the tokenizer files into `dir` (created if
/// needed; an earlier checkpoint there is replaced).
random_checkpoint_result write_random_checkpoint(const std::filesystem::path& dir,
                                                 const random_checkpoint_params& params);

/// The same, in the form `duet model random` calls it.
random_checkpoint_result write_random_checkpoint(const std::filesystem::path& dir, std::string_view arch,
                                                 const shape_overrides& overrides, uint64_t seed,
                                                 std::string_view dtype,
                                                 const std::filesystem::path& tokenizer_dir = {});

/// The generator's per-tensor key (see the top of this file).
[[nodiscard]] uint64_t random_tensor_key(uint64_t seed, std::string_view tensor_name);
/// Element `index` of the tensor with `key`: mean + the Irwin-Hall(4) deviate times stddev.
[[nodiscard]] float random_tensor_value(uint64_t key, uint64_t index, double mean, double stddev);

}  // namespace duet
