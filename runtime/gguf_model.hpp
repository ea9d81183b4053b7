#pragma once
// GGUF files (llama.cpp's format) as models of the CPU engine: the hyper-parameters of a
// llama- or qwen2-architecture GGUF as a transformer_config, and its tensors dequantized into
// model_weights in Hugging Face's conventions (the row permutation llama.cpp's converter
// applies to llama q/k weights undone). docs/gguf.md: the tensor mapping and how it is checked
// against llama.cpp.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>

#include "runtime/gguf.hpp"
#include "runtime/hf_model.hpp"
#include "runtime/tokenizer_spec.hpp"

namespace duet {

/// Whether `path` names a GGUF file: a regular file whose first four bytes are "GGUF".
[[nodiscard]] bool is_gguf_file(const std::filesystem::path& path);

/// The transformer_config of a GGUF, as Hugging Face's config.json would state it: arch and
/// architecture (LlamaForCausalLM / Qwen2ForCausalLM), sizes, rms_norm_eps, rope_theta,
/// max_position_embeddings = context length, tied embeddings, q/k/v biases (tensors present),
/// bos and eos ids from tokenizer.ggml.{bos,eos,eot}_token_id. Refuses, naming them, what the
/// CPU engine cannot run: rope scaling of any kind (metadata or rope_freqs.weight), partial
/// rotary (rope.dimension_count != head_dim). Errors: "gguf: <file>: ...".
[[nodiscard]] transformer_config gguf_transformer_config(const gguf_file& file);

/// Undoes llama.cpp's convert_hf_to_gguf `LlamaModel.permute` on the rows of one q or k
/// weight (or bias: row_length 1): within each head of `head_dim` rows, GGUF row 2i + j holds
/// Hugging Face row j * head_dim / 2 + i (j in {0, 1}). `rows` is heads * head_dim rows of
/// `row_length` floats, rewritten in place.
void gguf_unpermute_rope_rows(std::span<float> rows, uint32_t heads, uint32_t head_dim, uint64_t row_length);

/// Every weight of a llama or qwen2 GGUF, dequantized to float, in model_weights' conventions
/// (row-major [out, in]; GGUF stores shape [in, out], so the bytes already are that order), with
/// llama q/k rows un-permuted. Tensors of unsupported types are refused by name; every tensor
/// must have its expected shape. validate()d before it is returned.
[[nodiscard]] model_weights load_gguf_model(const std::filesystem::path& path);
/// load_gguf_model, shared: one copy per process while any user holds it, keyed by the
/// canonical path (as load_hf_model_shared).
[[nodiscard]] std::shared_ptr<const model_weights> load_gguf_model_shared(const std::filesystem::path& path);

/// One weight matrix kept in the GGUF's block format, for the CPU engine's native path (which
/// multiplies as ggml's CPU backend does: docs/cpu-engine.md). Row r is output feature r.
struct ggml_matrix {
  ggml_type type = ggml_type::f32;  // f32, q4_0, q4_1 or q8_0 (other file types arrive as f32)
  uint64_t rows = 0;                // output features
  uint64_t cols = 0;                // input features: the row length, a multiple of 32 when quantized
  std::vector<std::byte> data;      // rows * row_bytes(); floats when f32
  [[nodiscard]] uint64_t row_bytes() const { return ggml_type_bytes(type, cols); }
};

/// The matrices of one layer (q/k rows un-permuted, like model_weights').
struct ggml_layer_matrices {
  ggml_matrix q, k, v, o, gate, up, down;
};

/// A GGUF model as the CPU engine's native path runs it: `weights` holds the config, the
/// embedding (dequantized: rows are looked up), the norms and any biases, with every matrix
/// left empty; `matrices` holds the matrices in the file's formats (`output` is token_embd when
/// the embeddings are tied).
struct gguf_native_model {
  model_weights weights;
  std::vector<ggml_layer_matrices> layers;
  ggml_matrix output;
  /// Checks every tensor's size against the config; throws naming the tensor.
  void validate() const;
  /// Bytes held (embedding and norms as floats, matrices as stored).
  [[nodiscard]] uint64_t bytes() const;
};

/// Whether the native path multiplies `type` in its block format (q4_0, q4_1, q8_0).
[[nodiscard]] bool ggml_native_matrix_type(ggml_type type);

/// Loads a llama or qwen2 GGUF for the native path: matrices of q4_0, q4_1 and q8_0 kept as
/// stored (llama q/k rows un-permuted block row by block row), matrices of other types
/// dequantized to f32, embedding/norms/biases as floats.
[[nodiscard]] gguf_native_model load_gguf_native(const std::filesystem::path& path);
/// load_gguf_native, shared per canonical path (as load_gguf_model_shared).
[[nodiscard]] std::shared_ptr<const gguf_native_model> load_gguf_native_shared(const std::filesystem::path& path);

/// The tokenizer description of a GGUF file (gguf_read_tokenizer on the opened file), for
/// duet::tokenizer.
[[nodiscard]] tokenizer_spec load_gguf_tokenizer(const std::filesystem::path& path);

}  // namespace duet
