#pragma once
#include "messages/codec.hpp"

namespace duet::msg {

enum class dispatch_status { handled, unhandled, malformed };

struct dispatch_outcome {
  dispatch_status status = dispatch_status::unhandled;
  std::string error;  // why the body was malformed
};

namespace detail {
template <class Handler, class M, class... Ms>
dispatch_outcome dispatch_as(const envelope& env, const frames& in, Handler& handler,
                             const codec_limits& limits) {
  if (env.type == static_cast<uint16_t>(M::id)) {
    if constexpr (std::is_invocable_v<Handler&, const envelope&, M&>) {
      auto body = decode_body<M>(in, limits);
      if (!body) return {dispatch_status::malformed, body.error()};
      handler(env, *body);
      return {dispatch_status::handled, {}};
    } else {
      return {dispatch_status::unhandled, {}};
    }
  }
  if constexpr (sizeof...(Ms) > 0) {
    return dispatch_as<Handler, Ms...>(env, in, handler, limits);
  } else {
    return {dispatch_status::unhandled, {}};
  }
}
template <class Handler, class... Ms>
dispatch_outcome dispatch_list(const envelope& env, const frames& in, Handler& handler,
                               const codec_limits& limits, type_list<Ms...>) {
  return dispatch_as<Handler, Ms...>(env, in, handler, limits);
}
}  // namespace detail

/// Decodes the body by the envelope's type id and calls handler(env, message) with the
/// concrete struct, for the types the handler accepts. Never throws on bad input.
template <class Handler>
dispatch_outcome dispatch(const envelope& env, const frames& in, Handler&& handler,
                          const codec_limits& limits = {}) {
  return detail::dispatch_list(env, in, handler, limits, all_messages{});
}

}  // namespace duet::msg
