#include <algorithm>
#include <stdexcept>

#include "runtime/cpu_engine.hpp"
#include "runtime/decode_buckets.hpp"
#include "runtime/engine.hpp"
#include "runtime/sim_engine.hpp"
#ifdef DUET_HAVE_CUDA
#include "runtime/cuda_engine.hpp"
#endif

namespace duet {

std::unique_ptr<engine> make_engine(const deployment_config& config, const actor_config& actor,
                                    const kv_pool_seat& seat) {
  if (config.engine.kind == "cpu") return make_cpu_engine(config, actor, seat);
#ifdef DUET_HAVE_CUDA
  if (config.engine.kind == "cuda") return make_cuda_engine(config, actor, seat);
#endif
  if (config.engine.kind != "sim") {
    throw std::runtime_error("engine '" + config.engine.kind + "' is not available in this build");
  }
  auto shape = find_model_shape(config.model.preset);
  if (!shape) throw std::runtime_error("unknown model preset '" + config.model.preset + "'");
  auto gpu = find_gpu_spec(config.engine.gpu);
  if (!gpu) throw std::runtime_error("unknown GPU '" + config.engine.gpu + "'");
  // A share below 1 priced as the SMs a green context of it gets (the CUDA engine's rounding).
  auto engine = std::make_unique<sim_engine>(*shape, *gpu, config.model.name, config.model.max_context,
                                             config.model.block_tokens,
                                             partition_share(*gpu, actor.sm_share),
                                             config.engine.time_scale);
  // It models the CUDA engine: a decode step costs as the graph it would replay.
  if (actor.role == actor_role::decode)
    engine->set_decode_graph_buckets(decode_graph_buckets(actor.max_batch, decode_bucket_step_from_env()));
  return engine;
}

std::map<std::string, kv_pool_seat> plan_shared_kv_pools(const deployment_config& config, const node_config& node) {
  std::map<std::string, kv_pool_seat> seats;
  // The sim engine holds no KV bytes; "copy" and "stream" ask for bytes to move.
  if (config.broker.transfer != "auto" || (config.engine.kind != "cpu" && config.engine.kind != "cuda")) return seats;
  std::map<int, std::vector<const actor_config*>> by_device;
  for (const auto& a : node.actors) {
    if (a.role != actor_role::prefill && a.role != actor_role::decode) continue;
    by_device[config.engine.kind == "cuda" ? a.device : 0].push_back(&a);
  }
  for (auto& [device, workers] : by_device) {
    const auto has = [&](actor_role role) {
      return std::any_of(workers.begin(), workers.end(), [&](const actor_config* a) { return a->role == role; });
    };
    if (!has(actor_role::prefill) || !has(actor_role::decode)) continue;  // no handover stays inside
    auto pool = std::make_shared<shared_kv_pool>();
    pool->members = workers;
    for (uint32_t m = 0; m < workers.size(); ++m) seats[workers[m]->name] = kv_pool_seat{pool, m};
  }
  return seats;
}

block_manager make_block_manager(const engine& engine, uint32_t configured_blocks) {
  const uint32_t block_tokens = engine.info().block_tokens;
  if (const auto seat = engine.pool_seat(); seat && seat.pool->arena) {
    return block_manager(seat.pool->arena, seat.member, block_tokens);
  }
  return block_manager(engine.info().kv_blocks ? engine.info().kv_blocks : configured_blocks, block_tokens);
}

}  // namespace duet
