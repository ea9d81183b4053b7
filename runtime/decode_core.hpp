#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "messages/catalogue.hpp"
#include "runtime/block_manager.hpp"
#include "runtime/engine.hpp"
#include "runtime/kv_stream.hpp"
#include "runtime/outbox.hpp"
#include "runtime/step_log.hpp"
#include "runtime/step_thread.hpp"

namespace duet {

/// Whether a decode worker of this engine kind computes its steps on a thread of its own
/// (decode_core::compute_in_background): every engine that computes (cpu, cuda), not the sim
/// engine, whose steps are timers. DUET_DECODE_THREAD=0 keeps them on the actor's thread,
/// where a sequence adopted during a step joins the batch two steps later instead of one.
[[nodiscard]] bool decode_steps_in_background(const std::string& engine_kind);

/// How a decode worker gives KV blocks to its sequences.
enum class kv_allocation : uint8_t {
  /// Blocks as the sequence grows (prompt + 1 at adoption, one more per block_tokens
  /// tokens); when the pool runs dry the youngest running sequence is preempted and later
  /// recomputed. Batches as large as the memory in use allows (vLLM, SGLang).
  on_demand,
  /// Blocks for prompt + max_new_tokens at adoption: never preempts, but a long max_tokens
  /// pins memory the sequence may never use.
  reserve,
};
/// "on_demand" | "reserve"; nullopt for anything else.
[[nodiscard]] std::optional<kv_allocation> kv_allocation_from_string(std::string_view text);
/// A decode actor's mode; validate_config admitted only known names, on_demand stands for the rest.
[[nodiscard]] inline kv_allocation kv_allocation_of(const actor_config& actor) {
  return kv_allocation_from_string(actor.kv_allocation).value_or(kv_allocation::on_demand);
}

/// The counter a decode step of `batch` sequences adds one to: "steps_batch_le_<B>", B the
/// batch rounded up to a multiple of 16 up to 256, to a power of two above. Summed over a run
/// these give the distribution of step batch sizes (a mean hides the bursts that matter).
[[nodiscard]] std::string decode_batch_counter(std::size_t batch);
inline constexpr std::string_view decode_batch_counter_prefix = "steps_batch_le_";

struct decode_settings {
  std::string router;
  std::string broker;
  uint32_t kv_blocks = 4096;
  uint32_t max_batch = 64;
  uint32_t transfer_timeout_ms = 5000;  // waiting for memory or for the KV to arrive
  uint32_t renew_every_ms = 2000;       // lease renewal while an adoption waits for memory
  kv_allocation allocation = kv_allocation::on_demand;
  uint32_t chunk_tokens = 2048;  // tokens per recompute step of a preempted sequence
  // broker.stream_prefill = "chunks": KV chunks of a prompt still being prefilled are taken
  // into blocks of their own before the adoption (kept transfer_timeout_ms past the last one)
  bool accept_early = false;
};

/// Ordered states of a sequence in a decode worker. Before `preempted` the broker still
/// holds the sequence's KV handle (lease renewals, transfer timeout); from `preempted` on
/// the KV was confirmed and the sequence belongs to this worker alone.
enum class decode_state : uint8_t {
  waiting_memory,  // adopted, waiting for blocks to pull the KV into
  pulling,         // blocks given, the KV on its way
  preempted,       // gave its blocks up to an older sequence; waits to be recomputed
  recomputing,     // blocks back; the engine rebuilds its KV chunk by chunk
  running,         // in the continuous batch
};

/// Continuous batching over a paged KV pool. An adopted sequence pulls its KV through the
/// broker, confirms, then joins the batch. With kv_allocation::on_demand it holds blocks
/// for the tokens it has and grows one block at a time before each step; when the pool is
/// empty, the most recently admitted sequence is preempted (all its blocks freed) and
/// resumes later by recomputing its KV with the engine's prefill. With reserve, blocks for
/// prompt + max_new_tokens are taken at adoption, so nothing ever runs out mid-stream.
class decode_core {
 public:
  decode_core(std::string self, decode_settings settings, engine& engine);

  void on_adopt(const msg::envelope& env, const msg::kv_adopt& m, int64_t now_ms);
  void on_moved(const msg::kv_moved& m, int64_t now_ms);
  /// A chunk of KV bytes on the stream path; the last one completes the pull.
  void on_chunk(const msg::envelope& env, msg::kv_chunk m, int64_t now_ms);
  void on_cancel(const msg::cancel_seq& m);

  /// From now on each step computes on a thread of its own (step_thread.hpp) and `notify` is
  /// called there when it ends: the caller then runs finish_step on its own thread. Messages
  /// keep being taken meanwhile, so an adoption's pull and its kv_moved complete during the
  /// step and the sequence joins the next one. The engine sees only its const info calls from
  /// the caller's thread during a step: KV imports and stream writes (the messages that need
  /// them) and releases wait for finish_step.
  void compute_in_background(std::function<void()> notify);
  /// A step computed on the caller's thread (no compute_in_background) calls `send` just
  /// before the engine runs, so what the step's start sent (first tokens owed, kv_adopt.
  /// send_first) leaves then, not after the step. The actor passes its outbox flush.
  void send_before_computing(std::function<void()> send) { send_before_computing_ = std::move(send); }

  /// Runs the engine on the next batch (or recompute chunk). Returns how long the actor must
  /// wait before finish_step (sim engine), or nothing when there is no work. A step in the
  /// background returns zero; the notify of compute_in_background says when it is done.
  [[nodiscard]] std::optional<std::chrono::nanoseconds> begin_step(int64_t now_ms);
  void finish_step(int64_t now_ms);
  void tick(int64_t now_ms);
  /// The step begun last computes in the background: wait for its notify, not for a timer.
  [[nodiscard]] bool step_in_background() const { return background_ && !in_flight_.empty(); }

  [[nodiscard]] outbox& out() { return out_; }
  [[nodiscard]] const block_manager& pool() const { return pool_; }
  [[nodiscard]] msg::load_report load() const;
  [[nodiscard]] std::map<std::string, uint64_t> counters() const { return counters_; }
  /// Sequences of the decode step in flight (0 between steps and during a recompute step).
  [[nodiscard]] std::size_t stepping_batch() const { return recompute_in_flight_ > 0 ? 0 : in_flight_.size(); }

 private:
  struct sequence {
    uint64_t seq_id = 0;
    uint64_t handle_id = 0;
    uint64_t layout_hash = 0;
    std::string client;
    uint64_t request_id = 0;
    msg::sampling_params sampling;
    std::vector<int32_t> tokens;  // prompt + generated
    uint32_t prompt_len = 0;
    uint32_t generated = 0;       // includes the first token from prefill
    uint64_t arrival = 0;         // adoption order: preempted sequences resume by it
    uint32_t recomputed = 0;      // recomputing: positions whose KV is rebuilt
    std::vector<uint32_t> blocks;
    decode_state state = decode_state::waiting_memory;
    int64_t deadline_ms = 0;
    int64_t wait_until_ms = 0;
    int64_t next_renew_ms = 0;
    std::chrono::steady_clock::time_point pulled;  // the kv_pull went out (handover time)
    bool cancelled = false;
    msg::finish_reason cancel_reason = msg::finish_reason::cancelled;
    kv_stream_receiver receiver;  // the stream path's progress
    // kv_adopt.send_first: the client has not had the first token; it goes out when the
    // sequence's first decode step starts (or before its finish).
    std::optional<msg::token_logprobs> first_logprobs;
    bool first_unsent = false;
  };
  /// KV that came ahead of its adoption (broker.stream_prefill), by handle.
  struct early_kv {
    std::string from;
    std::vector<uint32_t> blocks;
    kv_stream_receiver receiver;
    int64_t wait_until_ms = 0;
  };
  void on_early_chunk(const msg::envelope& env, const msg::kv_chunk& m, int64_t now_ms);
  [[nodiscard]] sequence* find_by_handle(uint64_t handle_id);
  /// The KV is in place: confirm to the broker and join the batch (or end if cancelled).
  void kv_arrived(sequence& s, msg::kv_path path);
  /// Sends the first tokens still owed to the clients of these sequences (kv_adopt.send_first).
  void send_first_tokens(const std::vector<uint64_t>& ids);
  void try_admit_waiting(int64_t now_ms);
  /// Gives preempted sequences their blocks back (oldest first); false while one must wait.
  [[nodiscard]] bool try_resume_preempted();
  /// Blocks free after taking `need` stay at the watermark (or the pool is all free).
  [[nodiscard]] bool can_admit(uint32_t need) const;
  [[nodiscard]] uint32_t reserved_tokens(const sequence& s) const;
  [[nodiscard]] uint32_t adoption_blocks(const sequence& s) const;
  [[nodiscard]] bool computing(uint64_t seq_id) const;
  /// Gives `s` blocks for every token it has, preempting younger sequences for them; false
  /// when `s` itself was preempted.
  [[nodiscard]] bool grow(sequence& s);
  void preempt(sequence& s);
  [[nodiscard]] sequence* next_recompute();
  [[nodiscard]] std::chrono::nanoseconds begin_recompute(sequence& s);
  [[nodiscard]] std::optional<std::chrono::nanoseconds> begin_decode();
  void finish_recompute(int64_t now_ms);
  void finish_decode(int64_t now_ms);
  void end(sequence& s, msg::finish_reason reason, msg::error_code code, const std::string& message);
  /// A background step holds the engine: calls that change it wait for finish_step.
  [[nodiscard]] bool engine_busy() const { return background_ && background_->busy(); }
  /// Starts the step: on the step thread with compute_in_background, else here.
  [[nodiscard]] std::chrono::nanoseconds launch(std::function<step_output()> step);
  /// The engine's work held back during a background step, in arrival order.
  void run_deferred(int64_t now_ms);

  decode_settings settings_;
  engine& engine_;
  outbox out_;
  block_manager pool_;
  std::unordered_map<uint64_t, sequence> seqs_;
  std::unordered_map<uint64_t, early_kv> early_;
  std::deque<uint64_t> waiting_;  // adoptions waiting for memory, FCFS
  std::deque<uint64_t> preempted_;  // in arrival order; they go before waiting_
  std::vector<uint64_t> running_; // running and recomputing, in admission order
  std::vector<uint64_t> in_flight_;
  step_output in_flight_output_;
  int64_t step_began_ms_ = 0;
  uint32_t recompute_in_flight_ = 0;  // tokens of the recompute step in flight (0: a decode step)
  bool last_step_recompute_ = false;  // recompute and decode steps take turns
  std::unique_ptr<step_thread> background_;
  std::function<void()> notify_;
  std::function<void()> send_before_computing_;
  std::unique_ptr<step_log> step_log_;  // DUET_STEP_LOG: decode steps (recompute chunks left out)
  step_record logged_step_;             // the decode step in flight, for step_log_
  /// Messages whose handling calls the engine (an import, a stream write), taken while a
  /// background step ran; replayed in order by finish_step.
  std::vector<std::pair<msg::envelope, std::variant<msg::kv_moved, msg::kv_chunk>>> deferred_;
  std::vector<uint64_t> deferred_releases_;  // sequences ended while the engine computed
  uint64_t next_arrival_ = 0;
  std::map<std::string, uint64_t> counters_;
};

}  // namespace duet
