// Weights in and out of a model: format detection, torch.save / Lightning files, key remapping and
// the load report. The copy into the module goes through the SDK's load_module_state_dict, the
// same path checkpoints take.
#include <fulgur/checkpoint_io.h>
#include <fulgur/error.h>
#include <fulgur/state_dict.h>
#include <fulgur/weights.h>

#include <torch/torch.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "weights_fit.h"

#include <fstream>
#include <set>

namespace fulgur {

namespace {

c10::impl::GenericDict string_dict() { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); }

bool ends_with(std::string_view s, std::string_view suffix) { return s.size() >= suffix.size() && s.ends_with(suffix); }

}  // namespace

WeightsFormat detect_weights_format(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorKind::io, fmt::format("cannot open weights file '{}'", path));
  char head[9] = {};
  in.read(head, sizeof(head));
  const auto got = in.gcount();
  if (got >= 4 && std::string_view(head, 4) == std::string_view("PK\x03\x04", 4)) return WeightsFormat::torch;
  if (got == 9 && head[8] == '{') return WeightsFormat::safetensors;
  // Neither signature: trust the extension so the error comes from the reader the user meant.
  return ends_with(path, ".safetensors") ? WeightsFormat::safetensors : WeightsFormat::torch;
}

namespace {

TensorMap tensors_of(const c10::IValue& dict, const std::string& path) {
  TensorMap out;
  for (const auto& entry : dict.toGenericDict()) {
    if (!entry.key().isString())
      throw Error(ErrorKind::checkpoint, fmt::format("weights file '{}': a key of its state dict is a {}, not a string",
                                                     path, entry.key().tagKind()));
    const std::string& name = entry.key().toStringRef();
    if (!entry.value().isTensor())
      throw Error(
          ErrorKind::checkpoint,
          fmt::format("weights file '{}': entry '{}' is a {}, not a tensor; the file is not a state dict (nor a "
                      "checkpoint with a \"state_dict\" entry)",
                      path, name, entry.value().tagKind()));
    out.emplace(name, entry.value().toTensor());
  }
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// When the file's keys and the module's differ by a prefix, says which option fixes it.
std::string prefix_hint(const std::vector<std::string>& missing, const std::vector<std::string>& unexpected,
                        const detail::WeightsHintSpelling& spelling) {
  for (const auto& u : unexpected)
    for (const auto& m : missing) {
      if (u.size() > m.size() && ends_with(u, m) && u[u.size() - m.size() - 1] == '.')
        return fmt::format("\n  the file's keys look prefixed: try {}",
                           fmt::format(fmt::runtime(spelling.strip_prefix), u.substr(0, u.size() - m.size())));
      if (m.size() > u.size() && ends_with(m, u) && m[m.size() - u.size() - 1] == '.')
        return fmt::format("\n  the module's keys have a prefix the file's lack: try {}",
                           fmt::format(fmt::runtime(spelling.add_prefix), m.substr(0, m.size() - u.size())));
    }
  return {};
}

}  // namespace

TensorMap read_weights(const std::string& path, WeightsFormat format) {
  if (format == WeightsFormat::auto_detect) format = detect_weights_format(path);
  if (format == WeightsFormat::safetensors) return read_safetensors(path);
  const c10::IValue whole = read_checkpoint_file(path);
  if (!whole.isGenericDict())
    throw Error(ErrorKind::checkpoint, fmt::format("weights file '{}' holds a {}, not a state dict or checkpoint dict",
                                                   path, whole.tagKind()));
  const auto dict = whole.toGenericDict();
  const auto it = dict.find(c10::IValue("state_dict"));
  if (it != dict.end() && it->value().isGenericDict()) return tensors_of(it->value(), path);
  return tensors_of(whole, path);
}

void save_weights(const TensorMap& tensors, const std::string& path,
                  const std::map<std::string, std::string>& metadata) {
  if (ends_with(path, ".safetensors")) return save_safetensors(tensors, path, metadata);
  auto state = string_dict();
  for (const auto& [name, t] : tensors) state.insert(name, t.detach());
  if (ends_with(path, ".ckpt")) {
    auto whole = string_dict();
    whole.insert("state_dict", state);
    return write_checkpoint_file(whole, path);
  }
  write_checkpoint_file(state, path);
}

TensorMap named_tensors(const torch::nn::Module& module) {
  TensorMap out;
  for (const auto& item : module.named_parameters(true)) out.emplace(item.key(), item.value());
  for (const auto& item : module.named_buffers(true)) out.emplace(item.key(), item.value());
  return out;
}

std::string LoadReport::to_string() const {
  std::vector<std::string> lines;
  if (!missing.empty()) lines.push_back(fmt::format("missing keys: {}", fmt::join(missing, ", ")));
  if (!unexpected.empty()) lines.push_back(fmt::format("unexpected keys: {}", fmt::join(unexpected, ", ")));
  if (!mismatched.empty()) {
    std::vector<std::string> items;
    for (const auto& m : mismatched)
      items.push_back(
          fmt::format("{} (file {}, module {})", m.key, shape_text(m.file_shape), shape_text(m.module_shape)));
    lines.push_back(fmt::format("shape mismatches: {}", fmt::join(items, ", ")));
  }
  if (!dropped.empty()) lines.push_back(fmt::format("dropped by the key mapping: {}", fmt::join(dropped, ", ")));
  if (lines.empty() || (missing.empty() && unexpected.empty() && mismatched.empty()))
    lines.insert(lines.begin(), fmt::format("all {} keys matched", loaded));
  return fmt::format("{}", fmt::join(lines, "\n"));
}

namespace detail {

c10::impl::GenericDict fit_weights(const TensorMap& targets, const TensorMap& tensors,
                                   const LoadWeightsOptions& options, const std::string& origin,
                                   const std::string& module_name, LoadReport& report,
                                   const WeightsHintSpelling& spelling) {
  report = LoadReport{};
  // File keys -> module keys.
  TensorMap renamed;
  std::map<std::string, std::string> source_of;
  for (const auto& [key, t] : tensors) {
    std::string name = key;
    if (!options.strip_prefix_.empty() && name.starts_with(options.strip_prefix_))
      name.erase(0, options.strip_prefix_.size());
    if (options.map_keys_) {
      std::optional<std::string> mapped = options.map_keys_(name);
      if (!mapped) {
        report.dropped.push_back(key);
        continue;
      }
      name = std::move(*mapped);
    }
    name = options.add_prefix_ + name;
    if (auto [it, inserted] = source_of.emplace(name, key); !inserted)
      throw Error(ErrorKind::checkpoint, fmt::format("weights '{}': keys '{}' and '{}' both map to '{}'; fix the key "
                                                     "mapping",
                                                     origin, it->second, key, name));
    renamed.emplace(std::move(name), t);
  }

  auto state = string_dict();
  for (const auto& [name, target] : targets)
    if (!renamed.count(name)) report.missing.push_back(name);
  for (const auto& [name, t] : renamed) {
    const auto it = targets.find(name);
    if (it == targets.end()) {
      report.unexpected.push_back(name);
      continue;
    }
    if (t.sizes() != it->second.sizes()) {
      report.mismatched.push_back({name, t.sizes().vec(), it->second.sizes().vec()});
      continue;
    }
    state.insert(name, t);
  }
  report.loaded = static_cast<int64_t>(state.size());

  const bool refuse = (options.strict_ && (!report.missing.empty() || !report.unexpected.empty())) ||
                      (!report.mismatched.empty() && !options.skip_mismatched_);
  if (refuse) {
    LoadReport shown = report;
    if (!options.strict_) {
      shown.missing.clear();
      shown.unexpected.clear();
    }
    shown.dropped.clear();
    std::string body = shown.to_string();
    for (size_t at = body.find('\n'); at != std::string::npos; at = body.find('\n', at + 1)) body.insert(at + 1, "  ");
    std::string message = fmt::format("weights '{}' do not fit the module ({}):\n  {}", origin, module_name, body);
    message += prefix_hint(report.missing, report.unexpected, spelling);
    if (!report.mismatched.empty() && !options.skip_mismatched_ && !spelling.skip_mismatched.empty())
      message += fmt::format("\n  ({} loads the rest and leaves those tensors as they are)", spelling.skip_mismatched);
    if (options.strict_ && (!report.missing.empty() || !report.unexpected.empty()))
      message += fmt::format("\n  ({} loads the keys that match and reports the rest)", spelling.not_strict);
    throw Error(ErrorKind::checkpoint, message);
  }
  return state;
}

}  // namespace detail

LoadReport load_weights(torch::nn::Module& module, const TensorMap& tensors, const LoadWeightsOptions& options,
                        const std::string& origin) {
  LoadReport report;
  const auto state = detail::fit_weights(named_tensors(module), tensors, options, origin, module.name(), report);
  // Values only: every key is known to exist with the right shape, so this copies them in place.
  load_module_state_dict(module, state, /*strict=*/false, origin);
  return report;
}

LoadReport load_weights(torch::nn::Module& module, const std::string& path, const LoadWeightsOptions& options) {
  return load_weights(module, read_weights(path, options.format_), options, path);
}

}  // namespace fulgur
