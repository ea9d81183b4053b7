#include <stdexcept>

#include "runtime/cpu_engine.hpp"
#include "runtime/engine.hpp"
#include "runtime/sim_engine.hpp"
#ifdef DUET_HAVE_CUDA
#include "runtime/cuda_engine.hpp"
#endif

namespace duet {

std::unique_ptr<engine> make_engine(const deployment_config& config, const actor_config& actor) {
  if (config.engine.kind == "cpu") return make_cpu_engine(config, actor);
#ifdef DUET_HAVE_CUDA
  if (config.engine.kind == "cuda") return make_cuda_engine(config, actor);
#endif
  if (config.engine.kind != "sim") {
    throw std::runtime_error("engine '" + config.engine.kind + "' is not available in this build");
  }
  auto shape = find_model_shape(config.model.preset);
  if (!shape) throw std::runtime_error("unknown model preset '" + config.model.preset + "'");
  auto gpu = find_gpu_spec(config.engine.gpu);
  if (!gpu) throw std::runtime_error("unknown GPU '" + config.engine.gpu + "'");
  return std::make_unique<sim_engine>(*shape, *gpu, config.model.name, config.model.max_context,
                                      config.model.block_tokens, actor.sm_share, config.engine.time_scale);
}

}  // namespace duet
