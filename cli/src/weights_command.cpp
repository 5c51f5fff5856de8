// `fulgur weights convert IN OUT` and `fulgur weights inspect FILE` on top of fulgur/weights.h.
#include "weights_command.h"

#include "storage_paths.h"

#include <fulgur/error.h>
#include <fulgur/weights.h>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <iostream>
#include <map>

namespace fulgur::cli {

namespace {

constexpr const char* kWeightsUsage =
    "usage:\n"
    "  fulgur weights convert IN OUT   (.pt / .ckpt / .safetensors, by OUT's extension)\n"
    "  fulgur weights inspect FILE     (names, dtypes and shapes)\n"
    "IN, OUT and FILE may be s3:// URLs; --config FILE takes [storage] (endpoint, profile...) from a run's TOML.\n";

std::string dtype_name(c10::ScalarType type) { return std::string(c10::toString(type)); }

int inspect(const std::string& shown) {
  const LocalInput input(shown);  // an s3:// URL is read from a local copy
  const std::string& path = input.path();
  // A safetensors file is listed from its header alone: no tensor data is read.
  const bool safetensors = detect_weights_format(path) == WeightsFormat::safetensors;
  struct Row {
    std::string name, dtype, shape;
    int64_t bytes;
  };
  std::vector<Row> rows;
  std::map<std::string, std::string> metadata;
  if (safetensors) {
    const SafetensorsHeader header = read_safetensors_header(path);
    metadata = header.metadata;
    for (const auto& e : header.entries)
      rows.push_back(
          {e.name, e.dtype, fmt::format("[{}]", fmt::join(e.shape, ", ")), static_cast<int64_t>(e.end - e.begin)});
    std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.name < b.name; });
  } else {
    for (const auto& [name, t] : read_weights(path, WeightsFormat::torch))
      rows.push_back({name, safetensors_dtype(t.scalar_type()).value_or(dtype_name(t.scalar_type())),
                      fmt::format("[{}]", fmt::join(t.sizes(), ", ")), static_cast<int64_t>(t.nbytes())});
  }
  int64_t total = 0;
  size_t width = 4;
  for (const auto& r : rows) {
    total += r.bytes;
    width = std::max(width, r.name.size());
  }
  std::cout << fmt::format("{}: {}, {} tensors, {} bytes\n", shown, safetensors ? "safetensors" : "torch.save",
                           rows.size(), total);
  for (const auto& [k, v] : metadata) std::cout << fmt::format("metadata {} = {}\n", k, v);
  for (const auto& r : rows) std::cout << fmt::format("{:<{}}  {:<7} {}\n", r.name, width, r.dtype, r.shape);
  return 0;
}

// IN and OUT may be s3:// URLs (storage_paths.h).
int convert(const std::string& shown_in, const std::string& out) {
  const LocalInput input(shown_in);
  const std::string& in = input.path();
  std::map<std::string, std::string> metadata;
  const TensorMap tensors =
      detect_weights_format(in) == WeightsFormat::safetensors ? read_safetensors(in, &metadata) : read_weights(in);
  // What transformers and the Hub expect of a PyTorch safetensors file.
  if (metadata.empty()) metadata["format"] = "pt";
  LocalOutput output(out);
  save_weights(tensors, output.path(), metadata);
  output.publish();
  std::cout << fmt::format("wrote {} ({} tensors)\n", out, tensors.size());
  return 0;
}

}  // namespace

int weights_main(const std::vector<std::string>& p) {
  if (p.size() == 4 && p[1] == "convert") return convert(p[2], p[3]);
  if (p.size() == 3 && p[1] == "inspect") return inspect(p[2]);
  std::cerr << kWeightsUsage;
  return 2;
}

}  // namespace fulgur::cli
