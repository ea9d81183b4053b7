#pragma once
// The OpenAI-compatible API's pure parts, free of sockets and threads (runtime/http_frontend
// serves them): text <-> token codecs, the chat template interface and its plain fallback,
// request parsing and validation, the response and chunk shapes, SSE and chunked framing,
// stop strings matched on detokenized text, the <think> splitter, and the error mapping.
// docs/http.md describes the API these implement.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "messages/catalogue.hpp"
#include "runtime/vocab_check.hpp"

namespace duet {

struct deployment_config;
class tokenizer;

// ------------------------------------------------------------------ text <-> tokens

/// Turns generated token ids, arriving one at a time, into text. Emits only complete UTF-8
/// characters; the concatenation of everything push() and flush() return is the whole text.
class text_decoder {
 public:
  virtual ~text_decoder() = default;
  /// Adds one id; returns the text it completes (often empty).
  [[nodiscard]] virtual std::string push(int32_t id) = 0;
  /// Returns what is held back (an incomplete character becomes U+FFFD).
  [[nodiscard]] virtual std::string flush() = 0;
};

/// Text to prompt token ids and generated ids back to text. Thread-safe: one codec serves
/// every connection; decoders are per request.
class text_codec {
 public:
  virtual ~text_codec() = default;
  /// Token ids of `text`; `add_special` adds the model's bos where it wants one.
  [[nodiscard]] virtual std::vector<int32_t> encode(std::string_view text, bool add_special) const = 0;
  /// A fresh streaming decoder for one request's output.
  [[nodiscard]] virtual std::unique_ptr<text_decoder> decoder() const = 0;
  /// "bytes" or "tokenizer", for logs and /v1/models.
  [[nodiscard]] virtual std::string_view name() const = 0;
  /// The bytes one id stands for on its own (possibly part of a UTF-8 character), for
  /// log-probability entries. The default decodes the id alone with a fresh decoder.
  [[nodiscard]] virtual std::string token_bytes(int32_t id) const;
};

/// The sim engine's codec (it has no tokenizer): encode = one token per UTF-8 byte (ids
/// 0..255); decode = each id below 256 as that byte, any other id as the placeholder
/// " <id>" (the sim engine's ids are pseudo-random over the whole vocabulary).
class byte_text_codec final : public text_codec {
 public:
  [[nodiscard]] std::vector<int32_t> encode(std::string_view text, bool add_special) const override;
  [[nodiscard]] std::unique_ptr<text_decoder> decoder() const override;
  [[nodiscard]] std::string_view name() const override { return "bytes"; }
  /// Ids below 256: that byte; others: the placeholder " <id>".
  [[nodiscard]] std::string token_bytes(int32_t id) const override;
};

/// A real model's HF byte-level BPE tokenizer (runtime/tokenizer.hpp). Special tokens (eos,
/// end of turn) are left out of the decoded text.
class tokenizer_text_codec final : public text_codec {
 public:
  explicit tokenizer_text_codec(std::shared_ptr<const tokenizer> tok);
  [[nodiscard]] std::vector<int32_t> encode(std::string_view text, bool add_special) const override;
  [[nodiscard]] std::unique_ptr<text_decoder> decoder() const override;
  [[nodiscard]] std::string_view name() const override { return "tokenizer"; }
  [[nodiscard]] std::string token_bytes(int32_t id) const override;
  [[nodiscard]] const tokenizer& tok() const { return *tok_; }

 private:
  std::shared_ptr<const tokenizer> tok_;
};

/// The codec a deployment's model needs: bytes for the sim engine; for a GGUF model.path the
/// tokenizer in its tokenizer.ggml.* metadata (with tokenizer.chat_template); else the
/// tokenizer.json found at model.path. Throws std::runtime_error naming the path when none can
/// be loaded.
[[nodiscard]] std::shared_ptr<const text_codec> make_text_codec(const deployment_config& config);

/// Checks that the deployment's model and the tokenizer make_text_codec would use fit
/// (runtime/vocab_check.hpp): a GGUF's hyper-parameters against its own tokenizer.ggml.*, an
/// HF directory's config.json against its tokenizer.json. nullopt when there is nothing to
/// check (sim engine, no model.path, a directory without tokenizer.json). Throws
/// vocab_mismatch_error for a pair that cannot work, std::runtime_error for unreadable files.
[[nodiscard]] std::optional<vocab_check_report> check_model_vocab(const deployment_config& config);

// ------------------------------------------------------------------ chat

/// One message of a chat request, its content flattened to text.
struct chat_message {
  std::string role;  // system | user | assistant (developer arrives as system)
  std::string content;
};

/// Turns chat messages into prompt text. The Jinja renderer of the model's chat template
/// implements this; plain_chat_template is the fallback.
class chat_template_renderer {
 public:
  virtual ~chat_template_renderer() = default;
  /// The prompt for `messages`; with `add_generation_prompt`, followed by the prefix that
  /// starts the assistant's turn. Throws std::invalid_argument for messages it cannot render
  /// (the front end answers 400 with the message).
  [[nodiscard]] virtual std::string render(std::span<const chat_message> messages,
                                           bool add_generation_prompt) const = 0;
  /// Whether the rendered prompt's text should be encoded with the model's bos added (a
  /// template that writes bos itself says false).
  [[nodiscard]] virtual bool add_special_tokens() const { return true; }
};

/// "<|role|>\ncontent\n" per message, then "<|assistant|>\n" as the generation prompt.
class plain_chat_template final : public chat_template_renderer {
 public:
  [[nodiscard]] std::string render(std::span<const chat_message> messages,
                                   bool add_generation_prompt) const override;
};

/// The model's own Jinja chat template (runtime/chat_template.hpp), rendered as HF's
/// apply_chat_template does. The template writes bos itself, so its text is encoded without
/// special tokens. A template that fails on some messages (raise_exception, a render error)
/// throws std::invalid_argument with its message: the front end answers 400.
class jinja_chat_renderer final : public chat_template_renderer {
 public:
  /// Throws chat_template_syntax_error for a template that does not parse.
  jinja_chat_renderer(std::string source, std::string bos_token, std::string eos_token);
  ~jinja_chat_renderer() override;
  [[nodiscard]] std::string render(std::span<const chat_message> messages,
                                   bool add_generation_prompt) const override;
  [[nodiscard]] bool add_special_tokens() const override { return false; }

 private:
  struct state;
  std::unique_ptr<const state> state_;
};

/// The renderer for a codec: the tokenizer's chat template when it has one that parses,
/// else plain_chat_template (a template that does not parse is reported on stderr).
[[nodiscard]] std::shared_ptr<const chat_template_renderer> make_chat_renderer(const text_codec& codec);

// ------------------------------------------------------------------ errors

/// An error in OpenAI's shape: {"error":{"message","type","param","code"}} with a status.
struct api_error {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // "" is sent as null
  std::string code;   // "" is sent as null
  uint32_t retry_after_s = 0;  // > 0: a Retry-After header goes with it

  [[nodiscard]] nlohmann::json to_json() const;
  [[nodiscard]] std::string body() const;
};

[[nodiscard]] api_error bad_request(std::string message, std::string param = {});
/// The HTTP answer to a router rejection or an error finish: bad_request 400,
/// prompt_too_long 400 (code context_length_exceeded), overloaded 429 and unavailable 503
/// (both with Retry-After), not_found 404, unauthorized 401, timeout 504, else 500.
[[nodiscard]] api_error error_from_cluster(msg::error_code code, std::string message,
                                           uint32_t retry_after_ms = 0);

// ------------------------------------------------------------------ requests

enum class api_kind : uint8_t { completion, chat };

/// What happens to <think>...</think> in chat output.
enum class reasoning_format : uint8_t {
  split,  ///< reasoning goes to reasoning_content, the rest to content
  raw,    ///< the text is left as the model wrote it
};

/// A parsed, validated completion or chat request. Sampling holds everything but
/// max_new_tokens, which resolve_max_tokens settles once the prompt's length is known.
struct api_request {
  api_kind kind = api_kind::completion;
  std::string model;
  std::string prompt;                  // completion: text (when prompt_tokens is empty)
  std::vector<int32_t> prompt_tokens;  // completion: token ids given by the client
  bool prompt_is_tokens = false;
  std::vector<chat_message> messages;  // chat
  std::optional<uint32_t> max_tokens;  // max_tokens, max_completion_tokens or max_new_tokens
  std::string max_tokens_param;        // which of them the client sent (errors name it)
  msg::sampling_params sampling;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool logprobs = false;       // also sets sampling.logprobs; top_logprobs goes to sampling
  std::string user;
  std::optional<reasoning_format> reasoning;  // extension "reasoning_format"; none = default
};

struct api_parse_options {
  std::string model_name;           // the served model; another "model" is a 404
  uint32_t max_stop_strings = 16;
  uint32_t max_stop_bytes = 256;    // per stop string
  uint32_t max_json_depth = 64;     // deeper bodies are refused before parsing
};

/// Parses and validates a request body. Unknown fields are ignored (as OpenAI does); a
/// wrong type or out-of-range value is a 400 naming the parameter; another model a 404.
[[nodiscard]] std::variant<api_request, api_error> parse_api_request(api_kind kind, std::string_view body,
                                                                     const api_parse_options& options);

/// The max_new_tokens to request: the client's max_tokens, else `default_max_tokens`
/// (0 = whatever the context leaves), capped by `max_new_tokens_limit`. A client value that
/// does not fit in the context beside the prompt is a 400 (context_length_exceeded); a prompt
/// that alone fills the context is left for the router to refuse.
[[nodiscard]] std::variant<uint32_t, api_error> resolve_max_tokens(const api_request& request,
                                                                   std::size_t prompt_tokens,
                                                                   uint32_t max_context,
                                                                   uint32_t default_max_tokens,
                                                                   uint32_t max_new_tokens_limit);

/// Nesting depth of a JSON text (brackets outside strings), without parsing it.
[[nodiscard]] std::size_t json_nesting_depth(std::string_view text);

// ------------------------------------------------------------------ responses

struct api_usage {
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
  [[nodiscard]] nlohmann::json to_json() const;
};

/// What every response and chunk of one request shares.
struct api_response_head {
  api_kind kind = api_kind::completion;
  std::string id;  // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;  // Unix seconds
  std::string model;
};

/// A whole non-streaming response. `reasoning` (chat only) is sent as reasoning_content
/// when it has a value.
/// `logprobs` is choices[0].logprobs as logprobs_writer renders it (null: none).
[[nodiscard]] nlohmann::json full_response(const api_response_head& head, const std::string& text,
                                           const std::optional<std::string>& reasoning,
                                           std::string_view finish_reason, const api_usage& usage,
                                           const nlohmann::json& logprobs = nullptr);

/// One streamed chunk. Completion: choices[0].text = content. Chat: a delta with content
/// and/or reasoning_content (and role on the first chunk). finish_reason "" is sent as null.
/// With `usage_null`, "usage": null is present (stream_options.include_usage).
struct chunk_delta {
  std::optional<std::string> content;
  std::optional<std::string> reasoning;
  bool role = false;  // chat: the first chunk names the role
  nlohmann::json logprobs;  // choices[0].logprobs of this chunk's tokens (null: none)
};
[[nodiscard]] nlohmann::json stream_chunk(const api_response_head& head, const chunk_delta& delta,
                                          std::string_view finish_reason, bool usage_null);
/// The events of one stream whose chunks differ only in their content text, pre-rendered
/// around that text: content_event(t) is byte for byte sse_event(stream_chunk(head, {content
/// = t}, "", usage_null)), without building a JSON document per token.
class content_event_writer {
 public:
  content_event_writer(const api_response_head& head, bool usage_null);
  [[nodiscard]] std::string content_event(std::string_view text) const;

 private:
  std::string prefix_;  // "data: {...\"content\":\"" (or "text")
  std::string suffix_;  // "\"...}\n\n"
};

/// Renders the log-probabilities of one request's output tokens in OpenAI's shapes, as they
/// arrive. Chat: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
/// bytes}]}]}. Completion: {tokens, token_logprobs, top_logprobs: [{text: logprob}],
/// text_offset}, text_offset counting characters (code points) of the generated text.
/// A token's text is the codec's token_bytes (invalid UTF-8 is sent as U+FFFD; `bytes` keeps
/// the real bytes). Non-streaming responses take() once at the end; streams take() per chunk
/// (text offsets keep counting across takes).
class logprobs_writer {
 public:
  logprobs_writer(api_kind kind, std::shared_ptr<const text_codec> codec);
  void add(int32_t token, const msg::token_logprobs& lp);
  /// Entries added since the last take, then forgets them; null when there are none.
  [[nodiscard]] nlohmann::json take();
  [[nodiscard]] bool empty() const { return count_ == 0; }

 private:
  [[nodiscard]] nlohmann::json text_json(const std::string& bytes) const;
  api_kind kind_;
  std::shared_ptr<const text_codec> codec_;
  nlohmann::json pending_;  // chat: the content array; completion: the object of arrays
  std::size_t count_ = 0;
  uint64_t text_offset_ = 0;
};

/// The last chunk with include_usage: no choices, the usage.
[[nodiscard]] nlohmann::json usage_chunk(const api_response_head& head, const api_usage& usage);

/// GET /v1/models.
[[nodiscard]] nlohmann::json models_response(const std::string& model, int64_t created);

/// "cmpl-" or "chatcmpl-" and 24 hex digits.
[[nodiscard]] std::string make_response_id(api_kind kind);

/// OpenAI's finish_reason for the cluster's: stop and length as they are; others "".
[[nodiscard]] std::string_view openai_finish_reason(msg::finish_reason reason);

// ------------------------------------------------------------------ framing

/// JSON text that never throws: invalid UTF-8 in strings is replaced by U+FFFD.
[[nodiscard]] std::string dump_json(const nlohmann::json& j);
/// One server-sent event: "data: <json>\n\n".
[[nodiscard]] std::string sse_event(const nlohmann::json& j);
/// The terminating event: "data: [DONE]\n\n".
[[nodiscard]] std::string_view sse_done();
/// One HTTP/1.1 chunk of a chunked body: "<hex size>\r\n<data>\r\n"; empty data gives "".
[[nodiscard]] std::string http_chunk(std::string_view data);
/// The last chunk: "0\r\n\r\n".
[[nodiscard]] std::string_view http_last_chunk();

// ------------------------------------------------------------------ stop strings

/// Matches stop strings on the detokenized output, across token boundaries: text that could
/// still be the start of a stop string is held back until it cannot. Once a stop string
/// matched, the output ends just before it (the stop string is not part of it) and nothing
/// more is emitted.
class stop_matcher {
 public:
  explicit stop_matcher(std::vector<std::string> stops);

  struct output {
    std::string text;      // safe to send now
    bool stopped = false;  // a stop string matched; `text` ends before it
  };
  /// Adds newly decoded text.
  [[nodiscard]] output feed(std::string_view text);
  /// At the end of generation: whatever was held back (nothing after a stop).
  [[nodiscard]] std::string flush();
  [[nodiscard]] bool stopped() const { return stopped_; }
  /// Bytes held back now.
  [[nodiscard]] std::size_t held() const { return held_.size(); }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

// ------------------------------------------------------------------ reasoning

/// Splits DeepSeek-R1 style output: text between "<think>" and "</think>" is reasoning, the
/// rest is content. One think block, at most: after "</think>" everything is content. Tags
/// split across chunks are held back until they can be told apart from text.
class think_splitter {
 public:
  /// `start_in_reasoning`: the prompt ended with "<think>" (R1's chat template opens the
  /// block itself), so the output starts inside it.
  explicit think_splitter(bool start_in_reasoning = false);

  struct output {
    std::string reasoning;
    std::string content;
  };
  [[nodiscard]] output feed(std::string_view text);
  /// At the end: what was held back, a partial tag as text of the part it was in.
  [[nodiscard]] output flush();
  /// Whether any reasoning was seen (a think block opened).
  [[nodiscard]] bool saw_reasoning() const { return opened_; }

  /// Whether a prompt ends with "<think>" (and optional whitespace).
  [[nodiscard]] static bool prompt_opens_think(std::string_view prompt);

 private:
  enum class phase : uint8_t { before, inside, after };
  phase phase_;
  bool opened_;
  std::string held_;
};

}  // namespace duet
