#include "messages/catalogue.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace duet::msg {

std::string_view to_string(type_id id) {
  switch (id) {
    case type_id::hello: return "hello";
    case type_id::heartbeat: return "heartbeat";
    case type_id::error: return "error";
    case type_id::submit: return "submit";
    case type_id::admitted: return "admitted";
    case type_id::rejected: return "rejected";
    case type_id::cancel: return "cancel";
    case type_id::token_batch: return "token_batch";
    case type_id::finish: return "finish";
    case type_id::prefill_request: return "prefill_request";
    case type_id::prefill_done: return "prefill_done";
    case type_id::stage_failed: return "stage_failed";
    case type_id::cancel_seq: return "cancel_seq";
    case type_id::request_done: return "request_done";
    case type_id::kv_adopt: return "kv_adopt";
    case type_id::kv_register: return "kv_register";
    case type_id::kv_registered: return "kv_registered";
    case type_id::kv_pull: return "kv_pull";
    case type_id::kv_moved: return "kv_moved";
    case type_id::kv_confirm: return "kv_confirm";
    case type_id::kv_release: return "kv_release";
    case type_id::kv_nack: return "kv_nack";
    case type_id::kv_renew: return "kv_renew";
    case type_id::kv_drop: return "kv_drop";
    case type_id::kv_send: return "kv_send";
    case type_id::kv_chunk: return "kv_chunk";
    case type_id::kv_chunk_ack: return "kv_chunk_ack";
    case type_id::load_report: return "load_report";
    case type_id::stats_request: return "stats_request";
    case type_id::stats_reply: return "stats_reply";
  }
  return "unknown";
}

std::string_view to_string(finish_reason reason) {
  switch (reason) {
    case finish_reason::stop: return "stop";
    case finish_reason::length: return "length";
    case finish_reason::cancelled: return "cancelled";
    case finish_reason::timeout: return "timeout";
    case finish_reason::error: return "error";
  }
  return "unknown";
}

std::string_view to_string(error_code code) {
  switch (code) {
    case error_code::none: return "none";
    case error_code::bad_request: return "bad_request";
    case error_code::unauthorized: return "unauthorized";
    case error_code::not_found: return "not_found";
    case error_code::prompt_too_long: return "prompt_too_long";
    case error_code::overloaded: return "overloaded";
    case error_code::internal: return "internal";
    case error_code::unavailable: return "unavailable";
    case error_code::timeout: return "timeout";
    case error_code::incompatible: return "incompatible";
  }
  return "unknown";
}

std::string_view to_string(kv_path path) {
  switch (path) {
    case kv_path::none: return "none";
    case kv_path::same_pool: return "same_pool";
    case kv_path::host_shm: return "host_shm";
    case kv_path::cuda_ipc: return "cuda_ipc";
    case kv_path::nccl: return "nccl";
    case kv_path::tcp: return "tcp";
  }
  return "unknown";
}

void token_batch_push(token_batch& batch, uint64_t request_id, int32_t token, uint32_t position,
                      const token_logprobs* lp) {
  const std::size_t before = batch.tokens.size();
  batch.request_ids.push_back(request_id);
  batch.tokens.push_back(token);
  batch.positions.push_back(position);
  if (lp == nullptr && batch.logprobs.empty()) return;
  // The first entry with log-probabilities: the earlier entries get "none".
  batch.logprobs.resize(before, std::numeric_limits<float>::quiet_NaN());
  batch.top_counts.resize(before, 0);
  if (lp == nullptr) {
    batch.logprobs.push_back(std::numeric_limits<float>::quiet_NaN());
    batch.top_counts.push_back(0);
    return;
  }
  const std::size_t n = std::min(lp->top_ids.size(), lp->top_logprobs.size());
  batch.logprobs.push_back(lp->logprob);
  batch.top_counts.push_back(static_cast<uint32_t>(n));
  batch.top_ids.insert(batch.top_ids.end(), lp->top_ids.begin(), lp->top_ids.begin() + static_cast<std::ptrdiff_t>(n));
  batch.top_logprobs.insert(batch.top_logprobs.end(), lp->top_logprobs.begin(),
                            lp->top_logprobs.begin() + static_cast<std::ptrdiff_t>(n));
}

std::vector<std::optional<token_logprobs>> token_batch_logprobs(const token_batch& batch) {
  std::vector<std::optional<token_logprobs>> out(batch.tokens.size());
  if (batch.logprobs.size() != batch.tokens.size() || batch.top_counts.size() != batch.tokens.size() ||
      batch.top_ids.size() != batch.top_logprobs.size()) {
    return out;
  }
  uint64_t total = 0;
  for (uint32_t c : batch.top_counts) total += c;
  if (total != batch.top_ids.size()) return out;
  std::size_t at = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::size_t n = batch.top_counts[i];
    if (!std::isnan(batch.logprobs[i])) {
      token_logprobs lp;
      lp.logprob = batch.logprobs[i];
      lp.top_ids.assign(batch.top_ids.begin() + static_cast<std::ptrdiff_t>(at),
                        batch.top_ids.begin() + static_cast<std::ptrdiff_t>(at + n));
      lp.top_logprobs.assign(batch.top_logprobs.begin() + static_cast<std::ptrdiff_t>(at),
                             batch.top_logprobs.begin() + static_cast<std::ptrdiff_t>(at + n));
      out[i] = std::move(lp);
    }
    at += n;
  }
  return out;
}

address parse_address(std::string_view text) {
  const auto slash = text.find('/');
  if (slash == std::string_view::npos || slash == 0 || slash + 1 == text.size() ||
      text.find('/', slash + 1) != std::string_view::npos) {
    return {};
  }
  return {std::string(text.substr(0, slash)), std::string(text.substr(slash + 1))};
}

}  // namespace duet::msg
