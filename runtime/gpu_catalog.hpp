#pragma once
// GPU specs from a TOML file (config/gpus.toml) and measured calibration files, for the
// roofline cost model. find_gpu_spec (runtime/model_shape.hpp) reads the spec file when one
// is found and falls back to its built-in table otherwise. Formats: docs/sim.md.
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/model_shape.hpp"

namespace duet {

/// A malformed spec or calibration file: what() is "file:line: key 'k': what is wrong".
class gpu_catalog_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Every [gpus.NAME] table of a spec file, in file order. A table's `calibration` key names a
/// calibration file (relative to the spec file); without it, calibration/NAME.toml beside the
/// spec file is used when it exists. Throws gpu_catalog_error.
[[nodiscard]] std::vector<gpu_spec> load_gpu_specs(const std::filesystem::path& file);

/// Reads one calibration file. Throws gpu_catalog_error.
[[nodiscard]] gpu_calibration load_gpu_calibration(const std::filesystem::path& file);

/// The spec file find_gpu_spec reads, first that exists: $DUET_GPU_SPECS (which must exist),
/// ./config/gpus.toml, then config/gpus.toml of the source tree duet was built from. Empty
/// when there is none.
[[nodiscard]] std::filesystem::path gpu_spec_file();

/// The spec named `name` from gpu_spec_file(); nullopt when there is no file or no such GPU.
/// Files are parsed once per path and modification time. Throws gpu_catalog_error when the
/// file is malformed: a broken spec file is an error, never a silent fall-back.
[[nodiscard]] std::optional<gpu_spec> find_gpu_spec_in_file(std::string_view name);

/// Names find_gpu_spec knows: the spec file's and the built-in table's, sorted, unique.
[[nodiscard]] std::vector<std::string> known_gpu_names();

}  // namespace duet
