#include "runtime/version.hpp"

namespace duet {
std::string_view build_description() {
#ifdef NDEBUG
  return "duet 0.1.0 (release)";
#else
  return "duet 0.1.0 (debug)";
#endif
}
}  // namespace duet
