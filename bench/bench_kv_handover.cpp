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
#include <cuda_runtime_api.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
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
      std::cout << "done " << t << ' ' << blocks_checksum(adopter, dst) << std::endl;
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

}  // namespace

int main(int argc, char** argv) {
  std::vector<uint32_t> token_counts{1024, 8192, 32768};
  std::string json_path;
  std::filesystem::path model;
  uint32_t blocks = 0;
  int repeat = 5;
  bool is_child = false;
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
    else {
      std::cerr << "usage: bench_kv_handover [--tokens 1024,8192,32768] [--json FILE] [--model DIR] [--repeat N]\n";
      return 2;
    }
  }
  try {
    if (is_child) return run_child(model, blocks);
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::cerr << "bench_kv_handover: no CUDA device\n";
      return 1;
    }
    if (model.empty()) {
      // The KV shape of R1-Distill-Llama-8B; the rest as small as possible (weights never run).
      model = std::filesystem::temp_directory_path() / "duet-kv-bench-checkpoint";
      if (!std::filesystem::exists(model / "config.json")) {
        random_checkpoint_params p;
        p.overrides.ffn = 128;
        p.overrides.vocab = 256;
        p.overrides.max_position = 65536;
        write_random_checkpoint(model, p);
      }
    }
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
      std::vector<double> ipc;
      double ipc_first = 0;
      bool ipc_equal = true;
      for (int r = 0; r <= repeat; ++r) {
        std::istringstream reply(other.ask(copy.str()));
        std::string word;
        double t = 0;
        uint64_t sum = 0;
        reply >> word >> t >> sum;
        if (word != "done") throw std::runtime_error("cuda_ipc: " + reply.str());
        ipc_equal = ipc_equal && sum == reference;
        if (r == 0) ipc_first = t;  // includes opening the handle
        else ipc.push_back(t);
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
      rows.push_back({{"tokens", tokens},
                      {"bytes", bytes},
                      {"same_pool_s", same_pool},
                      {"in_process_s", in_proc_s},
                      {"cuda_ipc_s", ipc_s},
                      {"cuda_ipc_first_s", ipc_first},
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
