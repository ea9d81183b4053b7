#pragma once
// Renders the Jinja chat templates that models ship in tokenizer_config.json, the way HF
// transformers' apply_chat_template does (Jinja2 with trim_blocks and lstrip_blocks, its
// tojson, raise_exception and namespace), without Python. A small interpreter: lexer, parser,
// tree, evaluator, for the subset of Jinja that chat templates use (docs/chat-templates.md).

#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>

namespace duet {

/// A template that cannot be parsed; line and column (1-based, columns in characters) of the
/// offending token. what() reads "line L, column C: message".
class chat_template_syntax_error : public std::runtime_error {
 public:
  chat_template_syntax_error(const std::string& message, int line, int column);
  [[nodiscard]] int line() const noexcept { return line_; }
  [[nodiscard]] int column() const noexcept { return column_; }

 private:
  int line_;
  int column_;
};

/// A failure while rendering: an undefined value used as an object, a type error, an unknown
/// filter. what() reads "line L: message".
class chat_template_render_error : public std::runtime_error {
 public:
  chat_template_render_error(const std::string& message, int line);
  [[nodiscard]] int line() const noexcept { return line_; }

 private:
  int line_;
};

/// Thrown when the template calls raise_exception(message); what() is the message unchanged,
/// as HF's TemplateError carries it.
class chat_template_exception : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A parsed chat template. Immutable once built; render() may run on many threads at once.
class chat_template {
 public:
  /// Parses `source` (the chat_template string of tokenizer_config.json). Throws
  /// chat_template_syntax_error.
  explicit chat_template(std::string source);

  /// Renders with `context` as the template's variables: messages, add_generation_prompt,
  /// bos_token, eos_token, tools, ... Object keys keep their order (tools' JSON schemas are
  /// printed by tojson in the order given). Throws chat_template_render_error and
  /// chat_template_exception.
  [[nodiscard]] std::string render(const nlohmann::ordered_json& context) const;
  /// As above; a nlohmann::json context has its object keys in sorted order.
  [[nodiscard]] std::string render(const nlohmann::json& context) const;

  /// Renders `messages` (an array of {"role", "content", ...}) with the flags and tokens that
  /// apply_chat_template passes; tools and documents are none.
  [[nodiscard]] std::string render_chat(const nlohmann::ordered_json& messages,
                                        bool add_generation_prompt, std::string_view bos_token,
                                        std::string_view eos_token) const;

  /// The template source as given.
  [[nodiscard]] const std::string& source() const noexcept { return source_; }

  struct program;

 private:
  std::string source_;
  std::shared_ptr<const program> program_;
};

}  // namespace duet
