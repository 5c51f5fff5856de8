// Weights in and out of a model, in the file formats people exchange them in:
//   - a state dict written by Python's torch.save(model.state_dict(), "model.pt"),
//   - a Lightning checkpoint (.ckpt: its "state_dict" entry), Fulgur's own checkpoints included,
//   - safetensors (.safetensors), read with every offset checked and written byte for byte as
//     Python's `safetensors.torch.save_file` writes it.
//
//   auto report = fulgur::load_weights(net, "lightning.ckpt",
//                                      fulgur::LoadWeightsOptions().strip_prefix("model.").strict(false));
//   if (!report.missing.empty()) fulgur::log::info(report.to_string());
//   fulgur::save_safetensors(fulgur::named_tensors(net), "net.safetensors", {{"format", "pt"}});
//
// Every failure is a fulgur::Error naming the file: ErrorKind::checkpoint for content that is not
// what it should be (truncated, corrupt, not a state dict, does not fit the model), ErrorKind::io for
// what the operating system refused.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace fulgur {

// Tensors by name, in name order (the order safetensors and `inspect` list them in).
using TensorMap = std::map<std::string, at::Tensor>;

enum class WeightsFormat {
  auto_detect,  // from the content: a zip archive is torch.save, an 8-byte length + '{' is safetensors
  torch,        // torch.save file: a plain state dict, or a checkpoint with a "state_dict" entry
  safetensors,
};

// One tensor as a safetensors header describes it (no data read).
struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // the file's dtype code: "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in data order
  std::map<std::string, std::string> metadata;
  uint64_t header_size = 0;  // the JSON header's length, padding included
};

// Reads and validates a safetensors header: its length against the file, the JSON, every dtype,
// shape and offset (overflow-checked; the data must be covered exactly, without gaps, as the
// reference reader requires). Throws fulgur::Error(checkpoint) naming the file and the problem.
SafetensorsHeader read_safetensors_header(const std::string& path);

// Reads every tensor of a safetensors file into CPU tensors (each read straight into its own
// storage: no second copy of the file in memory). `metadata`, when given, receives __metadata__.
TensorMap read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata = nullptr);

// Writes `tensors` as Python's safetensors writes them: tensors ordered by dtype (widest first)
// then name, compact JSON header with __metadata__ first, padded with spaces to a multiple of 8
// bytes, then the raw little-endian bytes. Device and non-contiguous tensors are copied to
// contiguous CPU memory one at a time. Atomic like write_checkpoint_file (temp file, fsync,
// rename): a failed write leaves a previous file untouched. Dtypes without a safetensors code
// (complex double, quantized, ...) throw fulgur::Error(invalid_argument).
void save_safetensors(const TensorMap& tensors, const std::string& path,
                      const std::map<std::string, std::string>& metadata = {});

// The safetensors dtype code of a torch dtype ("F32" for float32), or nullopt when it has none.
std::optional<std::string> safetensors_dtype(c10::ScalarType type);

// The format of a file from its first bytes (a zip archive is torch.save; an 8-byte length then
// '{' is safetensors), else from its extension. Throws fulgur::Error(io) if it cannot be opened.
WeightsFormat detect_weights_format(const std::string& path);

// Reads the tensors of any supported file (see WeightsFormat). For torch files, a dict whose
// "state_dict" entry is a dict (Lightning, Fulgur checkpoints) yields that entry; otherwise the
// dict itself must map names to tensors.
TensorMap read_weights(const std::string& path, WeightsFormat format = WeightsFormat::auto_detect);

// Writes tensors by the file's extension: ".safetensors" as safetensors, ".ckpt" as a checkpoint
// dict {"state_dict": ...} (what torch.load(...)["state_dict"] and read_weights expect), anything
// else as a plain torch.save state dict. `metadata` goes into safetensors files only.
void save_weights(const TensorMap& tensors, const std::string& path,
                  const std::map<std::string, std::string>& metadata = {});

// The module's parameters and buffers by dotted name (what state_dict() holds in Python).
TensorMap named_tensors(const torch::nn::Module& module);

// How file keys become module keys: strip_prefix (only from keys that carry it), then map_keys
// (returning nullopt drops the key), then add_prefix.
struct LoadWeightsOptions {
  using KeyMap = std::function<std::optional<std::string>(const std::string&)>;

  // strict: missing or unexpected keys are an error (as torch's load_state_dict(strict=True)).
  LoadWeightsOptions& strict(bool v) {
    strict_ = v;
    return *this;
  }
  // Shape mismatches are an error even when not strict (as in PyTorch); with skip_mismatched they
  // are left out of the load and only reported (fine-tuning a model with a new head).
  LoadWeightsOptions& skip_mismatched(bool v) {
    skip_mismatched_ = v;
    return *this;
  }
  LoadWeightsOptions& strip_prefix(std::string v) {
    strip_prefix_ = std::move(v);
    return *this;
  }
  LoadWeightsOptions& add_prefix(std::string v) {
    add_prefix_ = std::move(v);
    return *this;
  }
  LoadWeightsOptions& map_keys(KeyMap v) {
    map_keys_ = std::move(v);
    return *this;
  }
  LoadWeightsOptions& format(WeightsFormat v) {
    format_ = v;
    return *this;
  }

  bool strict_ = true;
  bool skip_mismatched_ = false;
  std::string strip_prefix_;
  std::string add_prefix_;
  KeyMap map_keys_;
  WeightsFormat format_ = WeightsFormat::auto_detect;
};

struct ShapeMismatch {
  std::string key;  // the module's name for it
  std::vector<int64_t> file_shape;
  std::vector<int64_t> module_shape;
};

// What a load did. Keys are the module's names (after remapping), except `dropped`, which lists
// the file's keys that map_keys dropped.
struct LoadReport {
  std::vector<std::string> missing;     // in the module, not in the file: left as they were
  std::vector<std::string> unexpected;  // in the file, not in the module: ignored
  std::vector<ShapeMismatch> mismatched;
  std::vector<std::string> dropped;
  int64_t loaded = 0;  // tensors copied into the module

  bool complete() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  // One line per non-empty list ("missing keys: a, b"), or "all N keys matched".
  std::string to_string() const;
};

// Loads the file's tensors into the module's parameters and buffers in place (values are copied,
// converted to each target's dtype and device; nothing is reallocated). Throws
// fulgur::Error(checkpoint) naming the file and listing every offending key when strict and
// anything is missing or unexpected, or when shapes differ (unless skip_mismatched).
LoadReport load_weights(torch::nn::Module& module, const std::string& path, const LoadWeightsOptions& options = {});
// The same from tensors in memory; `origin` names them in errors.
LoadReport load_weights(torch::nn::Module& module, const TensorMap& tensors, const LoadWeightsOptions& options = {},
                        const std::string& origin = "<tensors>");

}  // namespace fulgur
