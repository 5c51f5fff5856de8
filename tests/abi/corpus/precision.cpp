// ABI corpus, precision `corpus_bf16`: built against the frozen SDK 1.0 headers. bfloat16 autocast
// in the forward pass and nothing else: loss scaling, unscaling, clipping, the optimizer step and
// the (empty) state are the Precision identity defaults of the host's SDK library, which 1.0
// promises for all of 1.x.
#include <fulgur/plugin.h>

#include <ATen/autocast_mode.h>
#include <torch/nn/module.h>

#include <vector>

namespace {

class CorpusBf16 final : public fulgur::Precision {
 public:
  void convert_module(torch::nn::Module& module) override {
    for (const at::Tensor& p : module.parameters()) {
      device_type_ = p.device().type();
      break;
    }
  }
  void forward_enter() override {
    saved_.push_back({at::autocast::is_autocast_enabled(device_type_), at::autocast::get_autocast_dtype(device_type_)});
    at::autocast::set_autocast_enabled(device_type_, true);
    at::autocast::set_autocast_dtype(device_type_, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  void forward_exit() override {
    if (saved_.empty()) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_type_, saved_.back().enabled);
    at::autocast::set_autocast_dtype(device_type_, saved_.back().dtype);
    saved_.pop_back();
  }
  c10::ScalarType compute_dtype() const override { return at::kBFloat16; }

 private:
  struct Saved {
    bool enabled;
    at::ScalarType dtype;
  };
  c10::DeviceType device_type_ = c10::DeviceType::CPU;
  std::vector<Saved> saved_;
};

}  // namespace

FULGUR_PLUGIN(CorpusBf16, "corpus_bf16", "1.0.0", "ABI corpus: bfloat16 autocast, the rest Precision's defaults")
