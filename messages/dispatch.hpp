#pragma once
#include "messages/codec.hpp"

namespace duet::msg {

enum class dispatch_status { handled, unhandled, malformed };

struct dispatch_outcome {
  dispatch_status status = dispatch_status::unhandled;
  std::string error;  // why the body was malformed
};

namespace detail {
template <class Handler, class Frames, class M, class... Ms>
dispatch_outcome dispatch_as(const envelope& env, Frames&& in, Handler& handler,
                             const codec_limits& limits) {
  if (env.type == static_cast<uint16_t>(M::id)) {
    if constexpr (std::is_invocable_v<Handler&, const envelope&, M&>) {
      auto body = decode_body<M>(std::forward<Frames>(in), limits);
      if (!body) return {dispatch_status::malformed, body.error()};
      handler(env, *body);
      return {dispatch_status::handled, {}};
    } else {
      return {dispatch_status::unhandled, {}};
    }
  }
  if constexpr (sizeof...(Ms) > 0) {
    return dispatch_as<Handler, Frames, Ms...>(env, std::forward<Frames>(in), handler, limits);
  } else {
    return {dispatch_status::unhandled, {}};
  }
}
template <class Handler, class Frames, class... Ms>
dispatch_outcome dispatch_list(const envelope& env, Frames&& in, Handler& handler,
                               const codec_limits& limits, type_list<Ms...>) {
  return dispatch_as<Handler, Frames, Ms...>(env, std::forward<Frames>(in), handler, limits);
}
}  // namespace detail

/// Decodes the body by the envelope's type id and calls handler(env, message) with the
/// concrete struct, for the types the handler accepts. Never throws on bad input. Frames given
/// up (std::move) let raw arrays held as frames (KV chunk bytes) move into the message.
template <class Handler, class Frames>
  requires std::is_same_v<std::remove_cvref_t<Frames>, frames>
dispatch_outcome dispatch(const envelope& env, Frames&& in, Handler&& handler,
                          const codec_limits& limits = {}) {
  return detail::dispatch_list(env, std::forward<Frames>(in), handler, limits, all_messages{});
}

}  // namespace duet::msg
