#include <fulgur/data/collate.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

namespace fulgur::data {

namespace {

// Stacks one field of every sample; all defined or all undefined.
at::Tensor stack_field(std::vector<Sample>& samples, at::Tensor Sample::*field, const char* name) {
  std::vector<at::Tensor> parts;
  parts.reserve(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    const at::Tensor& t = samples[i].*field;
    if (t.defined() != (samples[0].*field).defined())
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("collate: sample {} of the batch has {} {} but sample 0 {}", i, t.defined() ? "an" : "no",
                              name, t.defined() ? "has none" : "has one"));
    if (t.defined()) parts.push_back(t);
  }
  if (parts.empty()) return {};
  for (size_t i = 1; i < parts.size(); ++i)
    if (parts[i].sizes() != parts[0].sizes())
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("collate: {} of sample {} of the batch has shape {} but sample 0 has {} (use pad_collate "
                              "for variable-length samples, or a transform that gives one size)",
                              name, i, fmt::join(parts[i].sizes(), "x"), fmt::join(parts[0].sizes(), "x")));
  return at::stack(parts);
}

std::vector<at::Tensor> stack_extras(std::vector<Sample>& samples) {
  std::vector<at::Tensor> out;
  const size_t n = samples.empty() ? 0 : samples[0].extra.size();
  for (size_t i = 1; i < samples.size(); ++i)
    if (samples[i].extra.size() != n)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("collate: sample {} of the batch has {} extras but sample 0 has {}", i,
                              samples[i].extra.size(), n));
  for (size_t k = 0; k < n; ++k) {
    std::vector<at::Tensor> parts;
    for (auto& s : samples) parts.push_back(s.extra[k]);
    out.push_back(at::stack(parts));
  }
  return out;
}

// Pads (L_i, ...) tensors to (B, L_max, ...) with `value`.
at::Tensor pad_field(std::vector<Sample>& samples, at::Tensor Sample::*field, double value, const char* name) {
  int64_t longest = 0;
  for (auto& s : samples) {
    const at::Tensor& t = s.*field;
    if (!t.defined() || t.dim() == 0)
      throw Error(ErrorKind::invalid_argument, fmt::format("pad_collate: every sample needs a {} with a length", name));
    longest = std::max(longest, t.size(0));
  }
  const at::Tensor& first = samples[0].*field;
  std::vector<int64_t> shape{static_cast<int64_t>(samples.size()), longest};
  shape.insert(shape.end(), first.sizes().begin() + 1, first.sizes().end());
  at::Tensor out = at::full(shape, value, first.options());
  for (size_t i = 0; i < samples.size(); ++i) {
    const at::Tensor& t = samples[i].*field;
    out[static_cast<int64_t>(i)].narrow(0, 0, t.size(0)).copy_(t);
  }
  return out;
}

}  // namespace

Batch collate_stack(std::vector<Sample>& samples) {
  Batch b;
  if (samples.empty()) return b;
  b.input = stack_field(samples, &Sample::input, "input");
  b.target = stack_field(samples, &Sample::target, "target");
  b.extra = stack_extras(samples);
  return b;
}

Batch collate_pad(std::vector<Sample>& samples, const PadCollateOptions& options) {
  Batch b;
  if (samples.empty()) return b;
  b.input = pad_field(samples, &Sample::input, options.padding_value_, "input");
  const int64_t longest = b.input.size(1);
  at::Tensor lengths = at::empty({static_cast<int64_t>(samples.size())}, at::kLong);
  for (size_t i = 0; i < samples.size(); ++i) lengths[static_cast<int64_t>(i)] = samples[i].input.size(0);
  at::Tensor mask = at::arange(longest, at::kLong).unsqueeze(0) < lengths.unsqueeze(1);
  if (samples[0].target.defined())
    b.target = options.pad_target_ ? pad_field(samples, &Sample::target, options.target_padding_value_, "target")
                                   : stack_field(samples, &Sample::target, "target");
  b.extra = {mask, lengths};
  for (auto& t : stack_extras(samples)) b.extra.push_back(std::move(t));
  return b;
}

CollateFn pad_collate(PadCollateOptions options) {
  return [options](std::vector<Sample>& samples) { return collate_pad(samples, options); };
}

}  // namespace fulgur::data
