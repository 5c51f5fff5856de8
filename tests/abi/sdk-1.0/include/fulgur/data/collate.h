// Collate: samples into a fulgur::Batch.
#pragma once

#include <fulgur/data/dataset.h>
#include <fulgur/types.h>

#include <functional>
#include <vector>

namespace fulgur::data {

using CollateFn = std::function<Batch(std::vector<Sample>&)>;

// Stacks input, target and each extra along a new first dimension (all samples must agree in shape;
// an undefined field stays undefined).
Batch collate_stack(std::vector<Sample>& samples);

struct PadCollateOptions {
  // Value the padded positions of input (and of target, when it is padded too) take.
  PadCollateOptions& padding_value(double v) {
    padding_value_ = v;
    return *this;
  }
  PadCollateOptions& target_padding_value(double v) {
    target_padding_value_ = v;
    return *this;
  }
  // Pad the target along its first dimension too (sequence labelling); otherwise it is stacked.
  PadCollateOptions& pad_target(bool v) {
    pad_target_ = v;
    return *this;
  }
  double padding_value_ = 0;
  double target_padding_value_ = -100;  // torch.nn.CrossEntropyLoss's default ignore_index
  bool pad_target_ = true;
};

// Variable-length sequences: each sample's input is (L_i, ...) and is padded to (B, L_max, ...).
// extra[0] is the mask, bool (B, L_max), true at real positions; extra[1] the lengths, int64 (B);
// the samples' own extras are stacked after them.
Batch collate_pad(std::vector<Sample>& samples, const PadCollateOptions& options = {});
CollateFn pad_collate(PadCollateOptions options = {});

}  // namespace fulgur::data
