// The C++ chat-template renderer as a filter, for tests/tools/jinja_differential.py: reads JSON
// lines {"t": template source, "c": context}, writes one JSON line per input, {"o": rendered}
// or {"e": "syntax|render|raise: message"}.
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/chat_template.hpp"

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    const auto in = nlohmann::ordered_json::parse(line);
    nlohmann::ordered_json out = nlohmann::ordered_json::object();
    try {
      const duet::chat_template tpl(in.at("t").get<std::string>());
      out["o"] = tpl.render(in.at("c"));
    } catch (const duet::chat_template_syntax_error& e) {
      out["e"] = std::string("syntax: ") + e.what();
    } catch (const duet::chat_template_render_error& e) {
      out["e"] = std::string("render: ") + e.what();
    } catch (const duet::chat_template_exception& e) {
      out["e"] = std::string("raise: ") + e.what();
    }
    std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
  }
  return 0;
}
