#pragma once
// Byte-level BPE tokenizer (the HF `tokenizers` BPE model with a ByteLevel pre-tokenizer),
// exact against HF on Llama-3, Qwen2/3, GPT-2 and SmolLM vocabularies. See docs/tokenizer.md.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/tokenizer_spec.hpp"

namespace duet {

/// Reads an HF tokenizer: `dir_or_file` is a directory holding tokenizer.json or the file
/// itself; tokenizer_config.json beside it, when present, supplies bos/eos, add_bos_token,
/// added_tokens_decoder and chat_template. Throws std::runtime_error naming the file and the
/// problem for a missing, malformed or unsupported (not byte-level BPE) tokenizer.
[[nodiscard]] tokenizer_spec load_tokenizer_json(const std::filesystem::path& dir_or_file);

/// The split regexes of a pre-tokenizer family as GGUF's `tokenizer.ggml.pre` names it
/// ("llama3"/"llama-bpe", "qwen2", "deepseek-r1-qwen", "gpt2", "smollm", ...), in the order
/// they apply. Throws std::invalid_argument for a family it does not know.
[[nodiscard]] std::vector<std::string> pre_tokenizer_family_regexes(std::string_view family);

/// Whether a family implies HF's `ignore_merges` (Llama-3 does).
[[nodiscard]] bool pre_tokenizer_family_ignores_merges(std::string_view family);

/// The normalizer a family's HF tokenizer.json uses ("nfc" for Qwen2/3), "" for none. A spec
/// without regexes and without a normalizer gets it, so GGUF-built tokenizers match HF.
[[nodiscard]] std::string pre_tokenizer_family_normalizer(std::string_view family);

/// Encodes text to token ids and back. Immutable after construction except for an internal,
/// lock-protected word cache: every method is safe to call from several threads at once.
class tokenizer {
 public:
  /// Builds the merge table, regexes and added-token matcher. Throws std::invalid_argument
  /// for an inconsistent spec (a merge of unknown tokens, a bad regex, an unknown family).
  explicit tokenizer(tokenizer_spec spec);
  ~tokenizer();
  tokenizer(tokenizer&&) noexcept;
  tokenizer& operator=(tokenizer&&) noexcept;
  tokenizer(const tokenizer&) = delete;
  tokenizer& operator=(const tokenizer&) = delete;

  /// Token ids of `text`. Added tokens (special or not) written in the text are matched first,
  /// as HF does; `add_special` prepends bos when the spec says add_bos. Bytes that are not
  /// valid UTF-8 are kept and encoded as their byte tokens.
  [[nodiscard]] std::vector<int32_t> encode(std::string_view text, bool add_special = true) const;

  /// Text of `ids`. With `skip_special`, special added tokens are left out. Ids outside the
  /// vocabulary are skipped; byte sequences that are not valid UTF-8 become U+FFFD, one per
  /// maximal invalid subpart (as Rust's from_utf8_lossy, so equal to HF's decode).
  [[nodiscard]] std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  /// The raw bytes one id stands for (possibly part of a UTF-8 character); empty when the id
  /// is out of range.
  [[nodiscard]] std::string_view token_bytes(int32_t id) const;

  /// The id of a token given in vocab form ("Ġhello") or as an added token's content.
  [[nodiscard]] std::optional<int32_t> token_to_id(std::string_view token) const;

  /// The vocab form of an id ("Ġhello", or an added token's content); empty when out of range.
  [[nodiscard]] std::string_view id_to_token(int32_t id) const;

  /// Whether `id` is a special added token (skipped by decode with skip_special).
  [[nodiscard]] bool is_special(int32_t id) const;

  /// The spec's normalizer applied to `text` (NFC for Qwen; identity when there is none).
  [[nodiscard]] std::string normalize(std::string_view text) const;

  /// Number of ids: one past the largest id of the vocab and the added tokens.
  [[nodiscard]] std::size_t vocab_size() const;
  /// Beginning-of-sequence id, when the tokenizer has one.
  [[nodiscard]] std::optional<int32_t> bos_id() const;
  /// End-of-sequence id, when the tokenizer has one.
  [[nodiscard]] std::optional<int32_t> eos_id() const;
  /// Whether encode(text, add_special = true) prepends bos.
  [[nodiscard]] bool add_bos() const;
  /// The Jinja chat template source, empty when the model has none.
  [[nodiscard]] const std::string& chat_template() const;
  /// The spec this tokenizer was built from.
  [[nodiscard]] const tokenizer_spec& spec() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

/// Turns ids arriving one at a time into text, emitting only complete UTF-8 characters: a
/// character split across tokens is held back until its last byte arrives. Bytes that can
/// never complete a character become U+FFFD, so the concatenation of everything push() and
/// flush() return equals tokenizer::decode of all the ids. The tokenizer must outlive it.
class stream_decoder {
 public:
  explicit stream_decoder(const tokenizer& tok, bool skip_special = false);

  /// Adds one id; returns the text it completes (often empty).
  [[nodiscard]] std::string push(int32_t id);
  /// Adds several ids; returns the text they complete.
  [[nodiscard]] std::string push(std::span<const int32_t> ids);
  /// Returns what is held back (an incomplete character becomes U+FFFD) and empties the buffer.
  [[nodiscard]] std::string flush();
  /// Drops whatever is held back.
  void reset() { pending_.clear(); }
  /// Bytes held back waiting for the rest of a character (at most 3).
  [[nodiscard]] std::size_t pending_bytes() const { return pending_.size(); }

 private:
  std::string take_complete();

  const tokenizer* tok_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace duet
