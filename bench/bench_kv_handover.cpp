// KV handover time per transfer path, for prompts of 1K / 8K / 32K tokens of the
// R1-Distill-Llama-8B KV shape (32 layers x 8 KV heads x 128 dims, bf16: 128 KiB per token),
// between two CUDA engines' pools on one GPU (docs/benchmarks.md, "KV handover"):
//   same_pool   ownership moves, no bytes: the broker's bookkeeping only;
//   in-process  another engine of this process copies device to device from the pool's address;
//   cuda_ipc    another process opens the pool's CUDA IPC handle and copies device to device;
//   stream      read to host, chunked + checksummed messages over ZeroMQ on tcp loopback, written
//               back to the device (the path between hosts without NCCL, or any engine).
// Every path's destination bytes are checked against the source (XXH3 of every block, in order).
// The floor is the device's own copy bandwidth (cudaMemcpy device to device, read + write),
// measured in the same run. Needs a GPU; writes a random checkpoint of the KV shape (weights are
// never run) unless --model names one.
//
//   bench_kv_handover [--tokens 1024,8192,32768] [--json FILE] [--model DIR] [--repeat N]
//
// Between two GPUs (issue 10; see "between GPUs" below): N bytes from a pool on GPU A to one on
// GPU B by peer copy (the floor), CUDA IPC to a process on B (raw buffers and engine pools) and
// NCCL send/receive between two processes; exits 2 when fewer than two GPUs are visible.
//
//   bench_kv_handover --gpus A,B [--sizes 128M,1G,4G] [--json FILE] [--model DIR] [--repeat N]
//                     [--timeout SECONDS] [--no-engine]
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>
#ifdef DUET_BENCH_NCCL
#include <nccl.h>
#endif

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <nlohmann/json.hpp>

#include "messages/codec.hpp"
#include "runtime/broker_core.hpp"
#include "runtime/cuda_engine.hpp"
#include "runtime/kv_pool_share.hpp"
#include "runtime/kv_stream.hpp"
#include "runtime/outbox.hpp"
#include "runtime/random_checkpoint.hpp"

extern char** environ;

namespace {

using namespace duet;
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<uint32_t> split_list(const std::string& s) {
  std::vector<uint32_t> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(static_cast<uint32_t>(std::stoul(item)));
  return out;
}

/// XXH3 of the blocks' bytes in order, read back through the engine.
uint64_t blocks_checksum(const engine& e, const std::vector<uint32_t>& blocks) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  std::vector<std::byte> buffer(e.info().block_bytes * 64);
  for (std::size_t i = 0; i < blocks.size(); i += 64) {
    const std::size_t n = std::min<std::size_t>(64, blocks.size() - i);
    const std::span<const uint32_t> part(blocks.data() + i, n);
    if (!e.read_blocks(part, std::span(buffer).first(n * e.info().block_bytes))) throw std::runtime_error("read_blocks");
    XXH3_64bits_update(state, buffer.data(), n * e.info().block_bytes);
  }
  const uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
}

cuda_engine_params engine_params(uint32_t blocks) {
  cuda_engine_params p;
  p.served_name = "kv-bench";
  p.kv_blocks = blocks;
  p.max_context = 32768 + 16;
  p.max_batch = 1;
  p.cuda_graphs = false;
  return p;
}

std::string export_line(const msg::kv_pool_export& e) {
  std::ostringstream o;
  o << "export " << int(e.path) << ' ' << e.host << ' ' << e.pid << ' ' << e.handle << ' ' << e.base << ' '
    << e.pool_bytes << ' ' << e.device;
  return o.str();
}

// ------------------------------------------------------------------ the other process

/// The adopter in another process: reads an export, then "copy N src... dst..." lines; answers
/// "done <seconds> <checksum of the destination blocks>" per copy.
int run_child(const std::filesystem::path& model, uint32_t blocks) {
  cuda_engine adopter(model, engine_params(blocks));
  msg::kv_pool_export from;
  std::string line;
  std::cout << "ready" << std::endl;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string word;
    in >> word;
    if (word == "export") {
      int path = 0;
      in >> path >> from.host >> from.pid >> from.handle >> from.base >> from.pool_bytes >> from.device;
      from.path = static_cast<msg::kv_path>(path);
    } else if (word == "copy") {
      std::size_t n = 0;
      in >> n;
      std::vector<uint32_t> src(n), dst(n);
      for (auto& b : src) in >> b;
      for (auto& b : dst) in >> b;
      std::string error;
      const auto t0 = clock_type::now();
      const bool ok = adopter.import_blocks(from, src, dst, error);
      const double t = seconds_since(t0);
      if (!ok) {
        std::cout << "error " << error << std::endl;
        continue;
      }
      // The same copy again at once: what the first one paid for the GPU switching over from the
      // other process's context (no MPS) shows as the difference.
      const auto t1 = clock_type::now();
      (void)adopter.import_blocks(from, src, dst, error);
      const double again = seconds_since(t1);
      std::cout << "done " << t << ' ' << blocks_checksum(adopter, dst) << ' ' << again << std::endl;
    } else if (word == "quit") {
      break;
    }
  }
  return 0;
}

/// A child process with pipes to its stdin and stdout.
struct child {
  pid_t pid = -1;
  FILE* to = nullptr;
  FILE* from = nullptr;
  void send(const std::string& line) {
    std::fprintf(to, "%s\n", line.c_str());
    std::fflush(to);
  }
  std::string ask(const std::string& line) {
    send(line);
    return read_line();
  }
  std::string read_line() {
    char buffer[4096];
    if (!std::fgets(buffer, sizeof buffer, from)) throw std::runtime_error("the adopter process died");
    std::string reply(buffer);
    while (!reply.empty() && reply.back() == '\n') reply.pop_back();
    return reply;
  }
};

child spawn_child(const std::filesystem::path& model, uint32_t blocks) {
  int in_pipe[2], out_pipe[2];
  if (pipe(in_pipe) != 0 || pipe(out_pipe) != 0) throw std::runtime_error("pipe");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in_pipe[0], 0);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], 1);
  posix_spawn_file_actions_addclose(&actions, in_pipe[1]);
  posix_spawn_file_actions_addclose(&actions, out_pipe[0]);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::string> args{self, "--child", "--model", model.string(), "--blocks", std::to_string(blocks)};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  child c;
  if (posix_spawn(&c.pid, self.c_str(), &actions, nullptr, argv.data(), environ) != 0) {
    throw std::runtime_error("posix_spawn");
  }
  posix_spawn_file_actions_destroy(&actions);
  close(in_pipe[0]);
  close(out_pipe[1]);
  c.to = fdopen(in_pipe[1], "w");
  c.from = fdopen(out_pipe[0], "r");
  if (c.read_line() != "ready") throw std::runtime_error("the adopter process did not start");
  return c;
}

// ------------------------------------------------------------------ the stream path

void send_frames(zmq::socket_t& socket, const msg::frames& frames) {
  for (std::size_t i = 0; i < frames.size(); ++i) {
    socket.send(zmq::buffer(frames[i]), i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
}

/// Moves `src` of `owner` into `dst` of `adopter` with the stream path's sender and receiver
/// over a ZeroMQ PAIR on tcp loopback (the adopter's side on its own thread). Seconds.
double stream_transfer(const engine& owner, engine& adopter, const std::vector<uint32_t>& src,
                       const std::vector<uint32_t>& dst, bool& ok) {
  zmq::context_t context(1);
  zmq::socket_t out(context, zmq::socket_type::pair);
  out.bind("tcp://127.0.0.1:*");
  const std::string endpoint = out.get(zmq::sockopt::last_endpoint);
  ok = false;
  bool received_all = false;
  const auto t0 = clock_type::now();
  std::thread receiver_thread([&] {
    zmq::socket_t in(context, zmq::socket_type::pair);
    in.connect(endpoint);
    kv_stream_receiver receiver;
    while (true) {
      std::vector<zmq::message_t> parts;
      if (!zmq::recv_multipart(in, std::back_inserter(parts))) return;
      msg::frames frames;
      for (auto& p : parts) frames.emplace_back(static_cast<const char*>(p.data()), p.size());
      auto chunk = msg::decode_body<msg::kv_chunk>(frames);
      if (!chunk) return;
      const auto status = receiver.on_chunk(adopter, dst, *chunk);
      if (status == kv_stream_receiver::status::failed) {
        std::cerr << "stream: " << receiver.error() << "\n";
        return;
      }
      msg::envelope env;
      env.src = "bench/adopter";
      env.dst = "bench/owner";
      const auto ack = msg::encode(env, msg::kv_chunk_ack{chunk->handle_id, receiver.received()});
      send_frames(in, ack);
      if (status == kv_stream_receiver::status::complete) {
        received_all = true;
        return;
      }
    }
  });
  outbox box("bench/owner");
  kv_stream_sender sender(owner, box, kv_stream_settings{});
  auto flush = [&] {
    for (auto& item : box.take()) send_frames(out, item.frames);
  };
  sender.start(1, "bench/adopter", src);
  flush();
  while (sender.active() > 0) {
    std::vector<zmq::message_t> parts;
    if (!zmq::recv_multipart(out, std::back_inserter(parts))) break;
    msg::frames frames;
    for (auto& p : parts) frames.emplace_back(static_cast<const char*>(p.data()), p.size());
    auto ack = msg::decode_body<msg::kv_chunk_ack>(frames);
    if (!ack) break;
    sender.on_ack("bench/adopter", *ack);
    flush();
  }
  receiver_thread.join();
  ok = received_all;
  return seconds_since(t0);
}

// ------------------------------------------------------------------ the broker's share

/// CPU time of one handover's bookkeeping in the broker (register, pull, confirm), seconds.
double broker_bookkeeping(uint32_t blocks) {
  broker_core broker("bench/broker", broker_settings{10000, "cuda"});
  msg::kv_register reg;
  reg.handle.layout_hash = 1;
  reg.block_ids.resize(blocks);
  std::iota(reg.block_ids.begin(), reg.block_ids.end(), 0u);
  msg::kv_pull pull;
  pull.layout_hash = 1;
  pull.block_ids = reg.block_ids;
  constexpr int rounds = 2000;
  const auto t0 = clock_type::now();
  for (int i = 0; i < rounds; ++i) {
    reg.handle.handle_id = pull.handle_id = uint64_t(i) + 1;
    broker.on_register("n/prefill0", reg, 0);
    broker.on_pull("n/prefill0", pull, 0);  // the owner adopts: same pool
    broker.on_confirm("n/prefill0", msg::kv_confirm{pull.handle_id});
    (void)broker.out().take();
  }
  return seconds_since(t0) / rounds;
}

// ------------------------------------------------------------------ main

void fill_pool(engine& e, uint32_t blocks) {
  std::mt19937_64 rng(42);
  const uint32_t step = 64;
  std::vector<uint64_t> words(e.info().block_bytes * step / 8);
  for (uint32_t b = 0; b < blocks; b += step) {
    const uint32_t n = std::min(step, blocks - b);
    for (auto& w : words) w = rng();
    std::vector<uint32_t> ids(n);
    std::iota(ids.begin(), ids.end(), b);
    if (!e.write_blocks(ids, std::as_bytes(std::span(words)).first(n * e.info().block_bytes))) {
      throw std::runtime_error("write_blocks");
    }
  }
}

/// Device copy of `bytes` inside one allocation (the floor every path is measured against).
double device_copy_seconds(uint64_t bytes) {
  void* a = nullptr;
  void* b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc");
  cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
  cudaDeviceSynchronize();
  std::vector<double> t;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = clock_type::now();
    cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
    t.push_back(seconds_since(t0));
  }
  cudaFree(a);
  cudaFree(b);
  return median(t);
}

/// The KV shape of R1-Distill-Llama-8B, the rest as small as possible (weights are never run):
/// written once to the temporary directory.
std::filesystem::path default_checkpoint() {
  const auto model = std::filesystem::temp_directory_path() / "duet-kv-bench-checkpoint";
  if (!std::filesystem::exists(model / "config.json")) {
    random_checkpoint_params p;
    p.overrides.ffn = 128;
    p.overrides.vocab = 256;
    p.overrides.max_position = 65536;
    write_random_checkpoint(model, p);
  }
  return model;
}

// ------------------------------------------------------------------ between GPUs (--gpus A,B)
//
// N bytes of KV from GPU A to GPU B (issue 10), for sizes of 128 MiB / 1 GiB / 4 GiB:
//   peer_copy_src    cudaMemcpyPeerAsync A -> B in this process, peer access on, on a stream of A
//   peer_copy_dst    the same on a stream of B; the faster of the two (medians) is the floor
//   cuda_ipc         a process on B (spawned like the adopter above) opens this process's raw
//                    buffer on A (cudaIpcOpenMemHandle, cudaIpcMemLazyEnablePeerAccess) and copies
//                    it into its own buffer (one cudaMemcpyAsync on a stream of B); timed there
//   cuda_ipc_engine  the same between two cuda_engines' pools of the 8B KV shape: the engine on B
//                    import_blocks() shuffled 2 MiB blocks from the pool on A (gather kernel)
//   nccl             ncclSend (rank 0: this process, A) / ncclRecv (rank 1: the process on B) of
//                    the buffer as ncclInt8; timed in the receiver from a barrier (a one-int
//                    all-reduce) to the end of the receive
// Every transfer's destination (warm-up included) is cleared before and read back after, outside
// the timed region, and its XXH3 compared with the source's. Times are medians of --repeat after
// one warm-up; GB/s = bytes / median (one way). Waits are bounded: CUDA work is polled with a
// deadline (--timeout), NCCL runs non-blocking (polled, aborted at the deadline) and the process
// on B is killed when a reply does not come in time.

std::string seconds_label(double s) {
  char out[32];
  std::snprintf(out, sizeof out, "%g s", s);
  return out;
}

std::string env_or(const char* name, const char* otherwise) {
  const char* v = std::getenv(name);
  return v ? v : otherwise;
}

void cuda_ok(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw std::runtime_error(what + ": " + cudaGetErrorString(e));
}

/// Polls `s` until its work is done, at most `seconds`; then throws (the work may still run).
void wait_stream(cudaStream_t s, double seconds, const std::string& what) {
  const auto t0 = clock_type::now();
  while (true) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) cuda_ok(e, what);
    if (seconds_since(t0) > seconds) {
      throw std::runtime_error(what + ": not done after " + seconds_label(seconds));
    }
  }
}

std::string size_label(uint64_t bytes) {
  char out[48];
  if (bytes >= (1ull << 30) && bytes % (1ull << 30) == 0)
    std::snprintf(out, sizeof out, "%llu GiB", (unsigned long long)(bytes >> 30));
  else if (bytes >= (1ull << 20) && bytes % (1ull << 20) == 0)
    std::snprintf(out, sizeof out, "%llu MiB", (unsigned long long)(bytes >> 20));
  else
    std::snprintf(out, sizeof out, "%llu B", (unsigned long long)bytes);
  return out;
}

/// "128M", "1G", "4GiB", "65536": K/M/G/T are binary (KiB, MiB, GiB, TiB).
uint64_t parse_size(const std::string& text) {
  std::size_t pos = 0;
  const uint64_t value = std::stoull(text, &pos);
  std::string unit = text.substr(pos);
  for (auto& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (unit.size() >= 2 && unit.ends_with("ib"))
    unit.resize(unit.size() - 2);
  else if (!unit.empty() && unit.back() == 'b')
    unit.pop_back();
  int shift = 0;
  if (unit == "k")
    shift = 10;
  else if (unit == "m")
    shift = 20;
  else if (unit == "g")
    shift = 30;
  else if (unit == "t")
    shift = 40;
  else if (!unit.empty())
    throw std::invalid_argument("size '" + text + "': unit must be K, M, G or T");
  if (value == 0) throw std::invalid_argument("size '" + text + "' is zero");
  return value << shift;
}

/// cudaMalloc'd bytes on one device.
struct device_buffer {
  int device = 0;
  void* ptr = nullptr;
  uint64_t bytes = 0;
  device_buffer(int d, uint64_t n) : device(d), bytes(n) {
    cuda_ok(cudaSetDevice(d), "cudaSetDevice");
    cuda_ok(cudaMalloc(&ptr, n), "cudaMalloc of " + size_label(n) + " on GPU " + std::to_string(d));
  }
  ~device_buffer() {
    if (!ptr) return;
    cudaSetDevice(device);
    cudaFree(ptr);
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
};

/// Pinned host memory for filling and reading back device buffers in pieces.
struct host_staging {
  static constexpr uint64_t size = 64ull << 20;
  void* ptr = nullptr;
  host_staging() { cuda_ok(cudaHostAlloc(&ptr, size, cudaHostAllocPortable), "cudaHostAlloc"); }
  ~host_staging() {
    if (ptr) cudaFreeHost(ptr);
  }
  host_staging(const host_staging&) = delete;
  host_staging& operator=(const host_staging&) = delete;
};

/// A stream of one device and two events around the timed work.
struct gpu_stream {
  int device = 0;
  cudaStream_t s = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  explicit gpu_stream(int d) : device(d) {
    cuda_ok(cudaSetDevice(d), "cudaSetDevice");
    cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
    cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  }
  ~gpu_stream() {
    cudaSetDevice(device);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (s) cudaStreamDestroy(s);
  }
  gpu_stream(const gpu_stream&) = delete;
  gpu_stream& operator=(const gpu_stream&) = delete;
  void use() const { cuda_ok(cudaSetDevice(device), "cudaSetDevice"); }
  /// Seconds between the two events (both recorded and done).
  [[nodiscard]] double device_seconds() const {
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return ms / 1e3;
  }
  /// Zeroes `bytes` at `p` (on this stream's device) and waits, so a transfer that writes
  /// nothing cannot pass the check on the bytes of the previous one.
  void clear(void* p, uint64_t bytes, double timeout) const {
    use();
    cuda_ok(cudaMemsetAsync(p, 0, bytes, s), "cudaMemsetAsync");
    wait_stream(s, timeout, "clearing the destination");
  }
};

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Fills the first `bytes` of `b` with a pattern that differs at every 8-byte word, so a piece
/// that is missing, misplaced or stale anywhere changes the checksum.
void fill_pattern(const device_buffer& b, uint64_t bytes, uint64_t seed, host_staging& staging) {
  cuda_ok(cudaSetDevice(b.device), "cudaSetDevice");
  auto* words = static_cast<uint64_t*>(staging.ptr);
  for (uint64_t off = 0; off < bytes; off += host_staging::size) {
    const uint64_t n = std::min(host_staging::size, bytes - off);
    for (uint64_t i = 0; i < (n + 7) / 8; ++i) words[i] = splitmix64(seed + off / 8 + i);
    cuda_ok(cudaMemcpy(static_cast<char*>(b.ptr) + off, staging.ptr, n, cudaMemcpyHostToDevice), "filling the source");
  }
}

/// XXH3 of `bytes` at `p` on `device`, read back through pinned memory.
uint64_t device_xxh3(const void* p, uint64_t bytes, int device, host_staging& staging) {
  cuda_ok(cudaSetDevice(device), "cudaSetDevice");
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  XXH3_64bits_reset(state.get());
  for (uint64_t off = 0; off < bytes; off += host_staging::size) {
    const uint64_t n = std::min(host_staging::size, bytes - off);
    cuda_ok(cudaMemcpy(staging.ptr, static_cast<const char*>(p) + off, n, cudaMemcpyDeviceToHost), "reading back");
    XXH3_64bits_update(state.get(), staging.ptr, n);
  }
  return XXH3_64bits_digest(state.get());
}

#ifdef DUET_BENCH_NCCL
std::string nccl_unique_id_hex(const ncclUniqueId& id) {
  return to_hex(std::as_bytes(std::span(id.internal)));
}

/// One rank of a two-rank NCCL communicator, made non-blocking so every wait has a deadline:
/// on an error or at the deadline the communicator is aborted and the call throws.
class nccl_link {
 public:
  explicit nccl_link(double timeout) : timeout_(timeout) {}
  ~nccl_link() { abort(); }
  nccl_link(const nccl_link&) = delete;
  nccl_link& operator=(const nccl_link&) = delete;

  [[nodiscard]] bool ready() const { return comm_ != nullptr; }

  void init(const ncclUniqueId& id, int rank, int device) {
    flag_.emplace(device, sizeof(int32_t));
    cuda_ok(cudaMemset(flag_->ptr, 0, sizeof(int32_t)), "cudaMemset");
    cuda_ok(cudaSetDevice(device), "cudaSetDevice");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const auto t0 = clock_type::now();
    call(ncclCommInitRankConfig(&comm_, 2, id, rank, &config), "ncclCommInitRankConfig", t0);
  }
  /// A one-int all-reduce on `s`, waited for: both ranks have reached it when it returns.
  void barrier(cudaStream_t s) {
    const auto t0 = clock_type::now();
    call(ncclAllReduce(flag_->ptr, flag_->ptr, 1, ncclInt32, ncclSum, comm_, s), "barrier (ncclAllReduce)", t0);
    wait(s, "barrier (ncclAllReduce)", t0);
  }
  void send(const void* p, uint64_t bytes, int peer, cudaStream_t s) {
    call(ncclSend(p, bytes, ncclInt8, peer, comm_, s), "ncclSend", clock_type::now());
  }
  void recv(void* p, uint64_t bytes, int peer, cudaStream_t s) {
    call(ncclRecv(p, bytes, ncclInt8, peer, comm_, s), "ncclRecv", clock_type::now());
  }
  /// Polls `s` (and the communicator's error) until done, at most the timeout from `t0`.
  void wait(cudaStream_t s, const std::string& what, clock_type::time_point t0) {
    while (true) {
      const cudaError_t e = cudaStreamQuery(s);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) {
        abort();
        cuda_ok(e, what);
      }
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess && state != ncclInProgress) {
        fail(what, state);
      }
      if (seconds_since(t0) > timeout_) fail_timeout(what);
    }
  }
  /// ncclCommFinalize + ncclCommDestroy, at most `seconds`; else ncclCommAbort.
  void close(double seconds) {
    if (!comm_) return;
    const auto t0 = clock_type::now();
    const ncclResult_t r = ncclCommFinalize(comm_);
    while ((r == ncclSuccess || r == ncclInProgress) && seconds_since(t0) < seconds) {
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
      if (state == ncclSuccess) {
        ncclCommDestroy(comm_);
        comm_ = nullptr;
        return;
      }
      if (state != ncclInProgress) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    abort();
  }
  void abort() {
    if (!comm_) return;
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }

 private:
  void call(ncclResult_t r, const std::string& what, clock_type::time_point t0) {
    if (r != ncclSuccess && r != ncclInProgress) fail(what, r);
    while (true) {  // a non-blocking call may still be in progress: its state settles here
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
      if (q != ncclSuccess) fail(what, q);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) fail(what, state);
      if (seconds_since(t0) > timeout_) fail_timeout(what);
      std::this_thread::yield();
    }
  }
  [[noreturn]] void fail(const std::string& what, ncclResult_t r) {
    std::string message = what + ": " + ncclGetErrorString(r);
    const char* last = ncclGetLastError(comm_);
    if (last && *last) message += std::string(" (") + last + ")";
    abort();
    throw std::runtime_error(message);
  }
  [[noreturn]] void fail_timeout(const std::string& what) {
    abort();
    throw std::runtime_error(what + ": not done after " + seconds_label(timeout_) + " (communicator aborted)");
  }

  double timeout_;
  ncclComm_t comm_ = nullptr;
  std::optional<device_buffer> flag_;
};
#endif

/// "done <host seconds> <device seconds or -1> <XXH3 of the destination>" from the process on B.
struct transfer_reply {
  double host_s = 0, device_s = -1;
  uint64_t sum = 0;
};

std::string done_line(double host_s, double device_s, uint64_t sum) {
  std::ostringstream o;
  o.precision(9);
  o << "done " << host_s << ' ' << device_s << ' ' << sum;
  return o.str();
}

transfer_reply parse_done(const std::string& line) {
  std::istringstream in(line);
  std::string word;
  transfer_reply r;
  in >> word >> r.host_s >> r.device_s >> r.sum;
  if (word != "done" || in.fail()) throw std::runtime_error("the process on GPU B: " + line);
  return r;
}

/// The process on GPU B (--gpu-child): reads commands on stdin, answers one line each on the
/// descriptor that was its stdout (anything a library prints goes to stderr instead):
///   export ...           the pool of the engine on A (as export_line)
///   copy N src... dst... its engine imports N blocks of that pool   -> done
///   ipc_open HEX         opens the raw buffer on A                  -> opened <seconds>
///   ipc_copy BYTES       copies BYTES of it into its own buffer     -> done
///   nccl_init HEX        joins the communicator as rank 1           -> nccl_ready
///   nccl_recv BYTES      barrier, then receives BYTES from rank 0   -> done
///   quit
/// A failed command answers "error <why>".
int run_gpu_child(int device, const std::filesystem::path& model, uint32_t blocks, uint64_t bytes, double timeout) {
  const int proto_fd = ::dup(1);
  if (proto_fd < 0 || ::dup2(2, 1) < 0) return 1;
  FILE* proto = fdopen(proto_fd, "w");
  if (!proto) return 1;
  auto reply = [&](std::string line) {
    std::replace(line.begin(), line.end(), '\n', ' ');
    std::fprintf(proto, "%s\n", line.c_str());
    std::fflush(proto);
  };
  try {
    cuda_ok(cudaSetDevice(device), "cudaSetDevice");
    std::unique_ptr<cuda_engine> adopter;
    if (blocks > 0) {
      auto p = engine_params(blocks);
      p.device = device;
      adopter = std::make_unique<cuda_engine>(model, p);
    }
    const device_buffer dst(device, bytes);
    const gpu_stream gs(device);
    host_staging staging;
    void* opened = nullptr;  // the raw buffer on A, opened from its IPC handle
    msg::kv_pool_export from;
#ifdef DUET_BENCH_NCCL
    nccl_link nccl(timeout);
#endif
    reply("ready");
    std::string line;
    while (std::getline(std::cin, line)) {
      std::istringstream in(line);
      std::string word;
      in >> word;
      try {
        if (word == "export") {
          int path = 0;
          in >> path >> from.host >> from.pid >> from.handle >> from.base >> from.pool_bytes >> from.device;
          from.path = static_cast<msg::kv_path>(path);
        } else if (word == "copy") {
          if (!adopter) throw std::runtime_error("no engine in this process");
          std::size_t n = 0;
          in >> n;
          std::vector<uint32_t> src(n), dst_blocks(n);
          for (auto& b : src) in >> b;
          for (auto& b : dst_blocks) in >> b;
          gs.clear(adopter->kv_pool(), (uint64_t{adopter->kv_blocks()} + 1) * adopter->info().block_bytes, timeout);
          std::string error;
          const auto t0 = clock_type::now();
          const bool ok = adopter->import_blocks(from, src, dst_blocks, error);
          const double t = seconds_since(t0);
          if (!ok) throw std::runtime_error("import_blocks: " + error);
          reply(done_line(t, -1, blocks_checksum(*adopter, dst_blocks)));
        } else if (word == "ipc_open") {
          std::string hex;
          in >> hex;
          cudaIpcMemHandle_t handle;
          if (!from_hex(hex, std::as_writable_bytes(std::span(handle.reserved))))
            throw std::runtime_error("malformed handle");
          gs.use();
          const auto t0 = clock_type::now();
          cuda_ok(cudaIpcOpenMemHandle(&opened, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
          std::ostringstream o;
          o << "opened " << seconds_since(t0);
          reply(o.str());
        } else if (word == "ipc_copy") {
          uint64_t n = 0;
          in >> n;
          if (!opened || n > bytes) throw std::runtime_error("no buffer opened, or more bytes than it holds");
          gs.clear(dst.ptr, n, timeout);
          const auto t0 = clock_type::now();
          cuda_ok(cudaEventRecord(gs.start, gs.s), "cudaEventRecord");
          cuda_ok(cudaMemcpyAsync(dst.ptr, opened, n, cudaMemcpyDefault, gs.s), "cudaMemcpyAsync");
          cuda_ok(cudaEventRecord(gs.stop, gs.s), "cudaEventRecord");
          wait_stream(gs.s, timeout, "the copy from the opened buffer");
          const double t = seconds_since(t0);
          reply(done_line(t, gs.device_seconds(), device_xxh3(dst.ptr, n, device, staging)));
#ifdef DUET_BENCH_NCCL
        } else if (word == "nccl_init") {
          std::string hex;
          in >> hex;
          ncclUniqueId id;
          if (!from_hex(hex, std::as_writable_bytes(std::span(id.internal))))
            throw std::runtime_error("malformed NCCL id");
          nccl.init(id, 1, device);
          reply("nccl_ready");
        } else if (word == "nccl_recv") {
          uint64_t n = 0;
          in >> n;
          if (!nccl.ready() || n > bytes)
            throw std::runtime_error("no NCCL communicator, or more bytes than the buffer");
          gs.clear(dst.ptr, n, timeout);
          nccl.barrier(gs.s);
          const auto t0 = clock_type::now();
          cuda_ok(cudaEventRecord(gs.start, gs.s), "cudaEventRecord");
          nccl.recv(dst.ptr, n, 0, gs.s);
          cuda_ok(cudaEventRecord(gs.stop, gs.s), "cudaEventRecord");
          nccl.wait(gs.s, "ncclRecv", t0);
          const double t = seconds_since(t0);
          reply(done_line(t, gs.device_seconds(), device_xxh3(dst.ptr, n, device, staging)));
#endif
        } else if (word == "quit") {
          break;
        } else {
          reply("error unknown command " + word);
        }
      } catch (const std::exception& e) {
        reply(std::string("error ") + e.what());
      }
    }
#ifdef DUET_BENCH_NCCL
    nccl.close(10);
#endif
    if (opened) cudaIpcCloseMemHandle(opened);
    return 0;
  } catch (const std::exception& e) {
    reply(std::string("error ") + e.what());
    return 1;
  }
}

/// The process on GPU B, seen from this one: commands down a pipe to its stdin, replies up a
/// pipe from it, every reply awaited at most a deadline. Killed (SIGKILL) when it fails, does
/// not answer in time, or is still running when this goes out of scope.
class gpu_peer {
 public:
  gpu_peer() = default;
  ~gpu_peer() { stop(); }
  gpu_peer(const gpu_peer&) = delete;
  gpu_peer& operator=(const gpu_peer&) = delete;

  void spawn(std::vector<std::string> args) {
    int in_pipe[2], out_pipe[2];
    if (pipe2(in_pipe, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
    if (pipe2(out_pipe, O_CLOEXEC) != 0) {
      ::close(in_pipe[0]);
      ::close(in_pipe[1]);
      throw std::runtime_error("pipe");
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in_pipe[0], 0);  // dup2 clears close-on-exec
    posix_spawn_file_actions_adddup2(&actions, out_pipe[1], 1);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = posix_spawn(&pid_, args[0].c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(in_pipe[0]);
    ::close(out_pipe[1]);
    to_ = in_pipe[1];
    from_ = out_pipe[0];
    if (rc != 0) {
      pid_ = -1;
      stop();
      throw std::runtime_error(std::string("posix_spawn: ") + std::strerror(rc));
    }
    ::fcntl(to_, F_SETFL, ::fcntl(to_, F_GETFL) | O_NONBLOCK);
  }

  void send(const std::string& line, double seconds) {
    if (pid_ <= 0) throw std::runtime_error("the process on GPU B is gone");
    const std::string data = line + "\n";
    std::size_t done = 0;
    const auto t0 = clock_type::now();
    while (done < data.size()) {
      const ssize_t n = ::write(to_, data.data() + done, data.size() - done);
      if (n > 0) {
        done += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno != EAGAIN) fail(std::string("cannot write to it: ") + std::strerror(errno));
      const double left = seconds - seconds_since(t0);
      if (left <= 0) fail("it takes no commands (" + seconds_label(seconds) + ")");
      pollfd p{to_, POLLOUT, 0};
      ::poll(&p, 1, static_cast<int>(std::min(left, 1.0) * 1000) + 1);
    }
  }

  std::string read_line(double seconds) {
    if (pid_ <= 0) throw std::runtime_error("the process on GPU B is gone");
    const auto t0 = clock_type::now();
    while (true) {
      const auto nl = pending_.find('\n');
      if (nl != std::string::npos) {
        std::string line = pending_.substr(0, nl);
        pending_.erase(0, nl + 1);
        return line;
      }
      const double left = seconds - seconds_since(t0);
      if (left <= 0) fail("no answer in " + seconds_label(seconds));
      pollfd p{from_, POLLIN, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min(left, 1.0) * 1000) + 1);
      if (r <= 0) continue;
      char buffer[65536];
      const ssize_t n = ::read(from_, buffer, sizeof buffer);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) fail("it exited");
      pending_.append(buffer, static_cast<std::size_t>(n));
    }
  }

  std::string ask(const std::string& line, double seconds) {
    send(line, seconds);
    return read_line(seconds);
  }

  [[nodiscard]] bool alive() const { return pid_ > 0; }

  /// Asks it to quit (once); false when it could not be told.
  bool quit() {
    if (quit_sent_) return pid_ > 0;
    quit_sent_ = true;
    try {
      send("quit", 5);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  /// Asks it to quit and waits for its exit at most `seconds`, then kills it. Its exit status,
  /// or -1 when it had to be killed.
  int finish(double seconds) {
    if (pid_ <= 0 || !quit()) return -1;
    const auto t0 = clock_type::now();
    while (seconds_since(t0) < seconds) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        stop();
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (r < 0 && errno != EINTR) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    stop();
    return -1;
  }

  /// Kills it (if running) and waits for it at most 10 s.
  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      for (int i = 0; i < 1000 && ::waitpid(pid_, nullptr, WNOHANG) == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      pid_ = -1;
    }
    if (to_ >= 0) ::close(to_);
    if (from_ >= 0) ::close(from_);
    to_ = from_ = -1;
  }

 private:
  [[noreturn]] void fail(const std::string& why) {
    stop();
    throw std::runtime_error("the process on GPU B: " + why + " (killed)");
  }

  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  bool quit_sent_ = false;
  std::string pending_;
};

struct gpus_options {
  std::string gpus;
  std::string sizes = "128M,1G,4G";
  int repeat = 5;
  double timeout = 120;
  bool engine = true;
  std::filesystem::path model;
  std::string json_path;
};

/// One transfer's result.
struct sample {
  double host_s = 0, device_s = -1, sender_s = -1;
  bool equal = false;
};

/// One path at one size: a warm-up and `repeat` timed transfers, each checked.
struct gpu_row {
  uint64_t bytes = 0;
  std::string path, what;
  std::vector<double> host_s, device_s, sender_s;
  double warmup_s = 0;
  int transfers = 0, equal = 0;
  std::string error, skipped;

  [[nodiscard]] bool measured() const { return error.empty() && skipped.empty() && !host_s.empty(); }
  [[nodiscard]] bool ok() const { return measured() && equal == transfers; }

  template <class F>
  void run(int repeat, F&& once) {
    try {
      for (int r = 0; r <= repeat; ++r) {
        const sample s = once();
        ++transfers;
        equal += s.equal ? 1 : 0;
        if (r == 0) {
          warmup_s = s.host_s;
          continue;
        }
        host_s.push_back(s.host_s);
        if (s.device_s >= 0) device_s.push_back(s.device_s);
        if (s.sender_s >= 0) sender_s.push_back(s.sender_s);
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
};

int run_gpus(gpus_options o) {
  std::signal(SIGPIPE, SIG_IGN);  // a dead process on B shows as EPIPE, not as our death
  // NVLink multicast (NVLS) stays off whatever the environment says: on a shared host a program
  // that uses it can put the GPUs out of service. The process on B inherits this environment.
  const std::string nvls_before = env_or("NCCL_NVLS_ENABLE", "(unset)");
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  ::setenv("NCCL_SOCKET_IFNAME", "lo", 0);  // both ranks on this host: bootstrap on loopback

  std::vector<uint32_t> gpus;
  std::vector<uint64_t> sizes;
  try {
    gpus = split_list(o.gpus);
    std::stringstream in(o.sizes);
    for (std::string item; std::getline(in, item, ',');) sizes.push_back(parse_size(item));
  } catch (const std::exception& e) {
    std::cerr << "bench_kv_handover --gpus A,B [--sizes 128M,1G,4G]: " << e.what() << "\n";
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();
    devices = 0;
  }
  if (devices < 2) {
    std::cerr << "bench_kv_handover --gpus: needs 2 GPUs, " << devices
              << " visible (CUDA_VISIBLE_DEVICES=" << env_or("CUDA_VISIBLE_DEVICES", "unset")
              << "); run it on a host with two (nvidia-h200-x2)\n";
    return 2;
  }
  if (gpus.size() != 2 || gpus[0] == gpus[1] || gpus[0] >= uint32_t(devices) || gpus[1] >= uint32_t(devices) ||
      sizes.empty() || o.repeat < 1) {
    std::cerr << "bench_kv_handover --gpus A,B: two different GPUs of the " << devices << " visible (0.." << devices - 1
              << "), one or more sizes, --repeat >= 1\n";
    return 2;
  }
  const int a = int(gpus[0]), b = int(gpus[1]);
  const uint64_t most = *std::max_element(sizes.begin(), sizes.end());
  const double timeout = o.timeout;

  nlohmann::json info;
  info["mode"] = "gpus";
  info["gpus"] = {a, b};
  for (int d : {a, b}) {
    cudaDeviceProp prop{};
    cuda_ok(cudaGetDeviceProperties(&prop, d), "cudaGetDeviceProperties");
    char bus[32] = {};
    cudaDeviceGetPCIBusId(bus, sizeof bus, d);
    info["devices"].push_back(
        {{"ordinal", d}, {"name", prop.name}, {"pci_bus_id", bus}, {"memory_bytes", prop.totalGlobalMem}});
    std::printf("GPU %d: %s (%s, %.0f GiB)\n", d, prop.name, bus, prop.totalGlobalMem / 1073741824.0);
  }
  int can_ab = 0, can_ba = 0, rank_ab = -1;
  cudaDeviceCanAccessPeer(&can_ab, a, b);
  cudaDeviceCanAccessPeer(&can_ba, b, a);
  if (cudaDeviceGetP2PAttribute(&rank_ab, cudaDevP2PAttrPerformanceRank, a, b) != cudaSuccess) {
    cudaGetLastError();
    rank_ab = -1;
  }
  auto enable_peer = [](int from, int to) {
    if (cudaSetDevice(from) != cudaSuccess) return false;
    const cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
    cudaGetLastError();
    return e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled;
  };
  const bool peer_on = can_ab && can_ba && enable_peer(a, b) && enable_peer(b, a);
  std::printf("peer access %d<->%d: %s (performance rank %d)\n", a, b, peer_on ? "on" : "NOT AVAILABLE", rank_ab);
  info["peer_access"] = {
      {"a_to_b", bool(can_ab)}, {"b_to_a", bool(can_ba)}, {"enabled", peer_on}, {"performance_rank", rank_ab}};

  nlohmann::json nccl_info;
  nccl_info["NCCL_NVLS_ENABLE"] = "0";
  nccl_info["NCCL_NVLS_ENABLE_given"] = nvls_before;
  nccl_info["NCCL_SOCKET_IFNAME"] = env_or("NCCL_SOCKET_IFNAME", "(unset)");
#ifdef DUET_BENCH_NCCL
  int nccl_version = 0;
  ncclGetVersion(&nccl_version);
  nccl_info["built"] = true;
  nccl_info["version"] = nccl_version;
  std::printf("NCCL %d, NCCL_NVLS_ENABLE=0 (given: %s), NCCL_SOCKET_IFNAME=%s\n", nccl_version, nvls_before.c_str(),
              env_or("NCCL_SOCKET_IFNAME", "(unset)").c_str());
#else
  nccl_info["built"] = false;
  std::printf("NCCL: not built in (nccl.h or libnccl not found when configured): the nccl path is skipped\n");
#endif

  // The engines' pools (8B KV shape): a probe engine gives the block size, then the pool on A
  // holds the largest size that is whole blocks; the process on B makes one as large.
  std::unique_ptr<cuda_engine> owner;
  uint64_t block_bytes = 0;
  uint32_t pool_blocks = 0;
  std::string engine_note;
  if (o.engine) {
    if (o.model.empty()) o.model = default_checkpoint();
    auto p = engine_params(16);
    p.device = a;
    auto probe = std::make_unique<cuda_engine>(o.model, p);
    block_bytes = probe->info().block_bytes;
    uint64_t whole = 0;
    for (auto s : sizes) {
      if (s % block_bytes == 0) whole = std::max(whole, s / block_bytes);
    }
    if (whole == 0) {
      engine_note = "no size is a whole number of " + size_label(block_bytes) + " blocks";
    } else {
      pool_blocks = static_cast<uint32_t>(whole + 16);
      p.kv_blocks = pool_blocks;
      owner = std::make_unique<cuda_engine>(o.model, p);  // shares the probe's weights
    }
  } else {
    engine_note = "--no-engine";
  }
  if (owner) {
    std::printf("engines: cuda_engine pools of %u blocks of %s (8B KV shape, %llu bytes per token) on GPU %d and %d\n",
                pool_blocks, size_label(block_bytes).c_str(), (unsigned long long)(block_bytes / 16), a, b);
  } else {
    std::printf("engines: not used (%s)\n", engine_note.c_str());
  }
  std::printf(
      "buffers: peer_copy_*, cuda_ipc, nccl move raw cudaMalloc buffers; cuda_ipc_engine the engines' KV pools\n");
  info["engine"] = {
      {"used", owner != nullptr}, {"block_bytes", block_bytes}, {"pool_blocks", pool_blocks}, {"note", engine_note}};

  const gpu_stream stream_a(a), stream_b(b);
  host_staging staging;
  const device_buffer src(a, most), floor_dst(b, most);
  gpu_peer peer;  // after the buffers: it quits (or is killed) before they are freed
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  peer.spawn({self, "--gpu-child", "--gpu", std::to_string(b), "--model", o.model.string(), "--blocks",
              std::to_string(owner ? pool_blocks : 0), "--bytes", std::to_string(most), "--timeout",
              std::to_string(timeout)});
  std::cerr << "filling " << size_label(most) << " on GPU " << a;
  if (owner) std::cerr << " and the engine's " << pool_blocks << " blocks";
  std::cerr << "; the process on GPU " << b << " starts\n";
  fill_pattern(src, most, 0x5eedull, staging);
  if (owner) fill_pool(*owner, pool_blocks);

  std::string peer_error;
  auto peer_ready = [&] { return peer.alive() && peer_error.empty(); };
  double ipc_open_s = -1;
  try {
    const std::string hello = peer.read_line(2 * timeout);  // it loads the checkpoint first
    if (hello != "ready") throw std::runtime_error("the process on GPU B: " + hello);
    if (owner) {
      const auto exported = owner->export_pool();
      if (exported.path != msg::kv_path::cuda_ipc)
        throw std::runtime_error("the engine's pool cannot be exported over CUDA IPC");
      peer.send(export_line(exported), timeout);
    }
    cudaIpcMemHandle_t handle;
    cuda_ok(cudaSetDevice(a), "cudaSetDevice");
    cuda_ok(cudaIpcGetMemHandle(&handle, src.ptr), "cudaIpcGetMemHandle");
    std::istringstream opened(peer.ask("ipc_open " + to_hex(std::as_bytes(std::span(handle.reserved))), timeout));
    std::string word;
    opened >> word >> ipc_open_s;
    if (word != "opened") throw std::runtime_error("cuda_ipc: " + opened.str());
  } catch (const std::exception& e) {
    peer_error = e.what();
    peer.stop();
    std::cerr << "bench_kv_handover: " << peer_error << "\n";
  }

  std::string nccl_error;
#ifdef DUET_BENCH_NCCL
  nccl_link nccl(timeout);
  if (peer_ready()) {
    try {
      ncclUniqueId id;
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) throw std::runtime_error(std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
      peer.send("nccl_init " + nccl_unique_id_hex(id), timeout);
      nccl.init(id, 0, a);  // both ranks initialise at once (non-blocking, polled)
      const std::string answer = peer.read_line(timeout + 10);
      if (answer != "nccl_ready") throw std::runtime_error("rank 1: " + answer);
    } catch (const std::exception& e) {
      nccl_error = e.what();
      nccl.abort();
      std::cerr << "bench_kv_handover: NCCL: " << nccl_error << "\n";
    }
  } else {
    nccl_error = "the process on GPU B is not running";
  }
#endif
  nccl_info["error"] = nccl_error;
  info["nccl"] = nccl_info;
  info["cuda_ipc_open_s"] = ipc_open_s;

  std::printf("\n%-9s %-16s %10s %9s %9s  %s\n", "size", "path", "median ms", "GB/s", "of floor", "bytes checked");
  std::vector<gpu_row> rows;
  bool all_ok = true;
  std::mt19937 rng(7);
  for (const uint64_t bytes : sizes) {
    const uint64_t reference = device_xxh3(src.ptr, bytes, a, staging);
    const std::size_t first_row = rows.size();
    double floor = 0;
    auto add = [&](gpu_row row) {
      const bool with_peer = row.path.rfind("peer_copy", 0) != 0;
      if (with_peer && !row.error.empty() && !peer.alive() && peer_error.empty()) peer_error = row.error;
      const double med = row.measured() ? median(row.host_s) : 0;
      if (row.skipped.empty()) all_ok = all_ok && row.ok();
      if (row.measured()) {
        std::printf("%-9s %-16s %10.3f %9.1f %8.0f%%  %d/%d %s\n", size_label(bytes).c_str(), row.path.c_str(),
                    med * 1e3, bytes / med / 1e9, floor > 0 ? 100 * floor / med : 0.0, row.equal, row.transfers,
                    row.equal == row.transfers ? "ok" : "DIFFER");
      } else {
        std::printf("%-9s %-16s %10s %9s %9s  %s: %s\n", size_label(bytes).c_str(), row.path.c_str(), "-", "-", "-",
                    row.skipped.empty() ? "FAILED" : "skipped",
                    (row.skipped.empty() ? row.error : row.skipped).c_str());
      }
      std::fflush(stdout);
      rows.push_back(std::move(row));
    };

    // (1) the floor: peer copies in this process, on a stream of A, then of B
    for (const gpu_stream* gs : {&stream_a, &stream_b}) {
      gpu_row row;
      row.bytes = bytes;
      row.path = gs == &stream_a ? "peer_copy_src" : "peer_copy_dst";
      row.what = "cudaMemcpyPeerAsync GPU " + std::to_string(a) + " -> " + std::to_string(b) +
                 " in one process, peer access " + (peer_on ? "on" : "off") + ", on a stream of GPU " +
                 std::to_string(gs->device);
      row.run(o.repeat, [&] {
        stream_b.clear(floor_dst.ptr, bytes, timeout);
        gs->use();
        sample s;
        const auto t0 = clock_type::now();
        cuda_ok(cudaEventRecord(gs->start, gs->s), "cudaEventRecord");
        cuda_ok(cudaMemcpyPeerAsync(floor_dst.ptr, b, src.ptr, a, bytes, gs->s), "cudaMemcpyPeerAsync");
        cuda_ok(cudaEventRecord(gs->stop, gs->s), "cudaEventRecord");
        wait_stream(gs->s, timeout, "cudaMemcpyPeerAsync");
        s.host_s = seconds_since(t0);
        s.device_s = gs->device_seconds();
        s.equal = device_xxh3(floor_dst.ptr, bytes, b, staging) == reference;
        return s;
      });
      if (row.measured()) floor = floor > 0 ? std::min(floor, median(row.host_s)) : median(row.host_s);
      rows.push_back(std::move(row));
    }
    {  // printed once the floor is known
      std::vector<gpu_row> floors(std::make_move_iterator(rows.begin() + std::ptrdiff_t(first_row)),
                                  std::make_move_iterator(rows.end()));
      rows.resize(first_row);
      for (auto& row : floors) add(std::move(row));
    }

    // (2) CUDA IPC: the process on B copies from this process's buffer on A
    {
      gpu_row row;
      row.bytes = bytes;
      row.path = "cuda_ipc";
      row.what =
          "process on GPU " + std::to_string(b) + " opened the raw buffer on GPU " + std::to_string(a) +
          " (cudaIpcOpenMemHandle, lazy peer access), one cudaMemcpyAsync into its own buffer on a stream of GPU " +
          std::to_string(b) + "; timed there";
      if (!peer_ready())
        row.error = "the process on GPU B is not running: " + peer_error;
      else
        row.run(o.repeat, [&] {
          const auto r = parse_done(peer.ask("ipc_copy " + std::to_string(bytes), timeout));
          return sample{r.host_s, r.device_s, -1, r.sum == reference};
        });
      add(std::move(row));
    }
    {
      gpu_row row;
      row.bytes = bytes;
      row.path = "cuda_ipc_engine";
      row.what = "cuda_engine on GPU " + std::to_string(b) + " (other process) import_blocks() of shuffled " +
                 size_label(block_bytes) + " blocks from the engine pool on GPU " + std::to_string(a) +
                 " over its CUDA IPC export (gather kernel); timed there";
      if (!owner)
        row.skipped = "no engines (" + engine_note + ")";
      else if (bytes % block_bytes != 0)
        row.skipped = "not a whole number of " + size_label(block_bytes) + " blocks";
      else if (!peer_ready())
        row.error = "the process on GPU B is not running: " + peer_error;
      else {
        const auto n = static_cast<uint32_t>(bytes / block_bytes);
        std::vector<uint32_t> src_blocks(pool_blocks), dst_blocks(pool_blocks);
        std::iota(src_blocks.begin(), src_blocks.end(), 0u);
        std::iota(dst_blocks.begin(), dst_blocks.end(), 0u);
        std::shuffle(src_blocks.begin(), src_blocks.end(), rng);  // pools are fragmented after some traffic
        std::shuffle(dst_blocks.begin(), dst_blocks.end(), rng);
        src_blocks.resize(n);
        dst_blocks.resize(n);
        const uint64_t engine_reference = blocks_checksum(*owner, src_blocks);
        std::ostringstream copy;
        copy << "copy " << n;
        for (auto x : src_blocks) copy << ' ' << x;
        for (auto x : dst_blocks) copy << ' ' << x;
        row.run(o.repeat, [&] {
          const auto r = parse_done(peer.ask(copy.str(), timeout));
          return sample{r.host_s, -1, -1, r.sum == engine_reference};
        });
      }
      add(std::move(row));
    }

    // (3) NCCL: rank 0 (this process, A) sends, rank 1 (the process on B) receives
    {
      gpu_row row;
      row.bytes = bytes;
      row.path = "nccl";
      row.what = "ncclSend (rank 0, GPU " + std::to_string(a) + ", this process) / ncclRecv (rank 1, GPU " +
                 std::to_string(b) +
                 ", other process) as ncclInt8; timed in the receiver from a barrier (one-int ncclAllReduce) to the "
                 "end of the receive";
#ifdef DUET_BENCH_NCCL
      if (!nccl_error.empty())
        row.error = "NCCL: " + nccl_error;
      else if (!peer_ready())
        row.error = "the process on GPU B is not running: " + peer_error;
      else {
        row.run(o.repeat, [&] {
          peer.send("nccl_recv " + std::to_string(bytes), timeout);
          try {
            nccl.barrier(stream_a.s);
            const auto t0 = clock_type::now();
            nccl.send(src.ptr, bytes, 1, stream_a.s);
            nccl.wait(stream_a.s, "ncclSend", t0);
            const double sender = seconds_since(t0);
            const auto r = parse_done(peer.read_line(timeout + 10));
            return sample{r.host_s, r.device_s, sender, r.sum == reference};
          } catch (...) {
            peer.stop();  // it may wait in the communicator this side gave up on
            throw;
          }
        });
        if (!row.error.empty()) {
          nccl_error = row.error;
          nccl.abort();
        }
      }
#else
      row.skipped = "built without NCCL";
#endif
      add(std::move(row));
    }
  }

#ifdef DUET_BENCH_NCCL
  peer.quit();
  nccl.close(10);  // both ranks finalize at once
#endif
  const int peer_status = peer.finish(30);
  if (peer_status != 0 && peer_error.empty())
    std::cerr << "bench_kv_handover: the process on GPU B ended with " << peer_status << "\n";

  nlohmann::json jrows = nlohmann::json::array();
  std::map<uint64_t, double> floors;
  for (const auto& row : rows) {
    if (row.measured() && row.path.rfind("peer_copy", 0) == 0) {
      const double m = median(row.host_s);
      floors[row.bytes] = floors.count(row.bytes) ? std::min(floors[row.bytes], m) : m;
    }
  }
  for (const auto& row : rows) {
    nlohmann::json j{{"bytes", row.bytes}, {"size", size_label(row.bytes)}, {"path", row.path},
                     {"what", row.what},   {"transfers", row.transfers},    {"checked_equal", row.equal},
                     {"ok", row.ok()}};
    if (row.measured()) {
      const double m = median(row.host_s);
      j["median_s"] = m;
      j["min_s"] = *std::min_element(row.host_s.begin(), row.host_s.end());
      j["max_s"] = *std::max_element(row.host_s.begin(), row.host_s.end());
      j["times_s"] = row.host_s;
      j["warmup_s"] = row.warmup_s;
      j["gb_s"] = row.bytes / m / 1e9;
      if (floors.count(row.bytes)) j["of_floor"] = floors[row.bytes] / m;
      if (!row.device_s.empty()) j["device_median_s"] = median(row.device_s);
      if (!row.sender_s.empty()) j["sender_median_s"] = median(row.sender_s);
    }
    if (!row.error.empty()) j["error"] = row.error;
    if (!row.skipped.empty()) j["skipped"] = row.skipped;
    jrows.push_back(j);
  }
  info["repeat"] = o.repeat;
  info["timeout_s"] = timeout;
  info["floor"] = "per size, the faster median of peer_copy_src and peer_copy_dst; of_floor = floor / median";
  info["gb_s"] = "bytes / median seconds (one way, 1e9 bytes per GB)";
  info["rows"] = jrows;
  info["ok"] = all_ok;
  if (!o.json_path.empty()) std::ofstream(o.json_path) << info.dump(2) << "\n";
  if (!all_ok) {
    std::cerr << "bench_kv_handover --gpus: a path failed or its destination bytes differ from the source\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<uint32_t> token_counts{1024, 8192, 32768};
  std::string json_path;
  std::filesystem::path model;
  uint32_t blocks = 0;
  int repeat = 5;
  bool is_child = false;
  gpus_options gpus;  // --gpus A,B: between two GPUs
  bool gpu_child = false;
  int gpu = 0;
  uint64_t child_bytes = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--tokens") token_counts = split_list(next());
    else if (a == "--json") json_path = next();
    else if (a == "--model") model = next();
    else if (a == "--blocks") blocks = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--repeat") repeat = std::stoi(next());
    else if (a == "--child") is_child = true;
    else if (a == "--gpus") gpus.gpus = next();
    else if (a == "--sizes") gpus.sizes = next();
    else if (a == "--timeout") gpus.timeout = std::stod(next());
    else if (a == "--no-engine") gpus.engine = false;
    else if (a == "--gpu-child") gpu_child = true;
    else if (a == "--gpu") gpu = std::stoi(next());
    else if (a == "--bytes") child_bytes = std::stoull(next());
    else {
      std::cerr << "usage: bench_kv_handover [--tokens 1024,8192,32768] [--json FILE] [--model DIR] [--repeat N]\n"
                   "       bench_kv_handover --gpus A,B [--sizes 128M,1G,4G] [--json FILE] [--model DIR] [--repeat N]\n"
                   "                         [--timeout SECONDS] [--no-engine]\n";
      return 2;
    }
  }
  try {
    if (is_child) return run_child(model, blocks);
    if (gpu_child) return run_gpu_child(gpu, model, blocks, child_bytes, gpus.timeout);
    if (!gpus.gpus.empty()) {
      gpus.repeat = repeat;
      gpus.model = model;
      gpus.json_path = json_path;
      return run_gpus(gpus);
    }
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::cerr << "bench_kv_handover: no CUDA device\n";
      return 1;
    }
    if (model.empty()) model = default_checkpoint();
    const uint32_t most = *std::max_element(token_counts.begin(), token_counts.end());
    blocks = most / 16 + 16;
    cuda_engine owner(model, engine_params(blocks));
    cuda_engine adopter(model, engine_params(blocks));
    const uint64_t block_bytes = owner.info().block_bytes;
    std::cerr << "block " << block_bytes << " bytes (" << block_bytes / 16 << " per token); filling " << blocks
              << " blocks\n";
    fill_pool(owner, blocks);
    child other = spawn_child(model, blocks);
    const auto exported = owner.export_pool();
    if (exported.path != msg::kv_path::cuda_ipc) throw std::runtime_error("the pool cannot be exported over CUDA IPC");
    other.send(export_line(exported));
    std::mt19937 rng(7);
    nlohmann::json rows = nlohmann::json::array();
    std::printf("%8s %10s | %12s | %12s %8s | %12s %8s | %12s %8s | %10s | %s\n", "tokens", "MiB", "same_pool",
                "in-process", "of copy", "cuda_ipc", "of copy", "stream", "GB/s", "dev copy", "bytes equal");
    for (uint32_t tokens : token_counts) {
      const uint32_t n = tokens / 16;
      std::vector<uint32_t> src(blocks), dst(blocks);
      std::iota(src.begin(), src.end(), 0u);
      std::iota(dst.begin(), dst.end(), 0u);
      std::shuffle(src.begin(), src.end(), rng);  // pools are fragmented after some traffic
      std::shuffle(dst.begin(), dst.end(), rng);
      src.resize(n);
      dst.resize(n);
      const uint64_t bytes = uint64_t{n} * block_bytes;
      const uint64_t reference = blocks_checksum(owner, src);

      const double same_pool = broker_bookkeeping(n);

      std::vector<double> in_process;
      std::string error;
      for (int r = 0; r < repeat; ++r) {
        const auto t0 = clock_type::now();
        if (!adopter.import_blocks(exported, src, dst, error)) throw std::runtime_error("import: " + error);
        in_process.push_back(seconds_since(t0));
      }
      const bool in_process_equal = blocks_checksum(adopter, dst) == reference;

      std::ostringstream copy;
      copy << "copy " << n;
      for (auto b : src) copy << ' ' << b;
      for (auto b : dst) copy << ' ' << b;
      std::vector<double> ipc, ipc_again;
      double ipc_first = 0;
      bool ipc_equal = true;
      for (int r = 0; r <= repeat; ++r) {
        std::istringstream reply(other.ask(copy.str()));
        std::string word;
        double t = 0, again = 0;
        uint64_t sum = 0;
        reply >> word >> t >> sum >> again;
        if (word != "done") throw std::runtime_error("cuda_ipc: " + reply.str());
        ipc_equal = ipc_equal && sum == reference;
        if (r == 0) ipc_first = t;  // includes opening the handle
        else ipc.push_back(t), ipc_again.push_back(again);
      }

      std::vector<uint32_t> dst2(dst.rbegin(), dst.rend());
      bool stream_ok = false;
      const double stream = stream_transfer(owner, adopter, src, dst2, stream_ok);
      const bool stream_equal = stream_ok && blocks_checksum(adopter, dst2) == reference;

      const double floor = device_copy_seconds(bytes);
      const double in_proc_s = median(in_process), ipc_s = median(ipc);
      std::printf("%8u %10.0f | %9.2f us | %9.3f ms %7.0f%% | %9.3f ms %7.0f%% | %9.1f ms %8.2f | %7.3f ms | %s\n",
                  tokens, bytes / 1048576.0, same_pool * 1e6, in_proc_s * 1e3, 100 * floor / in_proc_s, ipc_s * 1e3,
                  100 * floor / ipc_s, stream * 1e3, bytes / stream / 1e9, floor * 1e3,
                  in_process_equal && ipc_equal && stream_equal ? "yes" : "NO");
      std::printf("%8u tokens: cuda_ipc repeated at once in the other process %.3f ms (%.0f%% of copy)\n", tokens,
                  median(ipc_again) * 1e3, 100 * floor / median(ipc_again));
      rows.push_back({{"tokens", tokens},
                      {"bytes", bytes},
                      {"same_pool_s", same_pool},
                      {"in_process_s", in_proc_s},
                      {"cuda_ipc_s", ipc_s},
                      {"cuda_ipc_first_s", ipc_first},
                      {"cuda_ipc_back_to_back_s", median(ipc_again)},
                      {"stream_s", stream},
                      {"device_copy_s", floor},
                      {"device_copy_tb_s", 2.0 * bytes / floor / 1e12},
                      {"cuda_ipc_tb_s", 2.0 * bytes / ipc_s / 1e12},
                      {"stream_gb_s", bytes / stream / 1e9},
                      {"in_process_equal", in_process_equal},
                      {"cuda_ipc_equal", ipc_equal},
                      {"stream_equal", stream_equal}});
      if (!(in_process_equal && ipc_equal && stream_equal)) {
        std::cerr << "bench_kv_handover: destination bytes differ from the source\n";
        return 1;
      }
    }
    other.send("quit");
    int status = 0;
    waitpid(other.pid, &status, 0);
    if (!json_path.empty()) {
      std::ofstream(json_path) << nlohmann::json{{"block_bytes", block_bytes}, {"rows", rows}}.dump(2) << "\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_kv_handover: " << e.what() << "\n";
    return 1;
  }
}
