#pragma once
// The --trace argument of `duet sim` and `duet plan`: a trace file, or a synthetic trace
// written as one word (docs/sim.md, "Traces"):
//
//   synthetic:PROCESS[:key=value,...]      PROCESS = poisson | gamma | onoff
//
//   rate=R       mean requests/s (default 1)        count=N     stop after N requests
//   duration=S   stop at S seconds (default 60 when count is not given)
//   cv=C         gamma: CV of inter-arrival times   on=S,off=S  onoff: burst and pause lengths
//   in=N, out=N  mean prompt / output tokens (default 512 / 128)
//   in_cv=C, out_cv=C   lognormal lengths with this CV (default 0: every request the mean)
//   in_min, in_max, out_min, out_max   clamp the lengths      seed=N   (default 0)
//
// e.g. synthetic:gamma:rate=5,cv=3,duration=600,in=1000,in_cv=1,out=200,out_cv=1,seed=7
#include <string_view>
#include <vector>

#include "sim/trace.hpp"

namespace duet {

/// Reads a synthetic spec (the part after "synthetic:" included or not). Throws trace_error
/// naming the bad key.
[[nodiscard]] synthetic_trace_params parse_synthetic_spec(std::string_view spec);

/// A trace file (.csv: Azure, .jsonl/.json: Mooncake) or a synthetic spec. Throws trace_error.
[[nodiscard]] std::vector<trace_request> load_trace_spec(std::string_view spec);

}  // namespace duet
