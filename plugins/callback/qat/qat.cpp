// Built-in callback `qat`: quantization-aware training for the model's fulgur::nn::Linear layers
// (fulgur/nn/linear.h), torchao's prepare/convert in two hooks. From setup on, in every stage, the
// chosen layers compute with their weights as int8 (per output channel) or int4 (per group)
// storage would hold them, and the gradient reaches the float weights straight through, so the
// model learns weights that survive quantization. Checkpoints keep the float weights; `fulgur
// quantize` with the same method turns any of them into the served model, and the values it
// serves are the ones validation saw. At the end of fit the layers are converted in place
// (convert_at_end), so a test or predict that follows in the same program runs the quantized model.
#include <fulgur/nn/linear.h>
#include <fulgur/plugin.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

namespace {

namespace nn = fulgur::nn;

constexpr char kOwner[] = "callback 'qat'";

class QuantizationAwareTraining final : public fulgur::CallbackBase<QuantizationAwareTraining> {
 public:
  FULGUR_OPTIONS(Options,
                 (string, method, "The storage to train for: \"int8\" (per output channel) or \"int4\" (per group)",
                  "int8"),
                 (integer, group_size, "int4: inputs per group (32, 64, 128 or 256)", 128),
                 (string, layers,
                  "Only the fulgur::nn::Linear layers whose dotted name matches this regex (\"\": all), "
                  "e.g. \"^(?!lm_head)\"",
                  ""),
                 (boolean, convert_at_end, "Quantize the layers in place when fit ends (torchao's convert)", true),
                 (string, activations,
                  "Also fake-quantize each layer's input to asymmetric int8: \"none\", \"per_token\" (a scale "
                  "per row, torchao's Int8DynActInt4Weight recipe) or \"per_tensor\"",
                  "none"),
                 (boolean, learnable_scales,
                  "LSQ: learn the weight scales (and the per_tensor input scale) with the training", false));

  explicit QuantizationAwareTraining(const Options& options)
      : method_(method_from(options)),
        group_size_(options.group_size),
        layers_(options.layers),
        convert_at_end_(options.convert_at_end),
        activations_(activations_from(options)),
        learnable_scales_(options.learnable_scales) {
    options.check(group_size_ == 32 || group_size_ == 64 || group_size_ == 128 || group_size_ == 256, "group_size",
                  "must be 32, 64, 128 or 256");
  }

  void setup(fulgur::TrainerContext& trainer, fulgur::Stage) override {
    const std::vector<std::string> set =
        nn::quantization_aware_training(trainer.model(),
                                        nn::QatOptions(nn::FakeQuantizeOptions(method_).group_size(group_size_))
                                            .activations(activations_)
                                            .learnable_scales(learnable_scales_),
                                        layers_);
    if (set.empty() && !announced_ && !has_quantized_layer(trainer.model()))
      throw fulgur::Error(
          fulgur::ErrorKind::config,
          fmt::format("{}: the model has no fulgur::nn::Linear layer{} to train for {} storage: "
                      "declare its linear layers as fulgur::nn::Linear (fulgur/nn/linear.h)",
                      kOwner, layers_.empty() ? "" : fmt::format(" matching '{}'", layers_), nn::to_string(method_)));
    if (!set.empty() && !announced_ && trainer.is_global_zero())
      fulgur::log::info(fmt::format("{}: training {} layer{} for {} storage{}{}{}: {}", kOwner, set.size(),
                                    set.size() == 1 ? "" : "s", nn::to_string(method_), group_text(),
                                    activations_ == nn::ActivationQuantization::none
                                        ? ""
                                        : fmt::format(", int8 {} activations", nn::to_string(activations_)),
                                    learnable_scales_ ? ", learned scales (LSQ)" : "", fmt::join(set, ", ")));
    announced_ = true;
  }

  void on_fit_end(fulgur::TrainerContext& trainer) override {
    if (!convert_at_end_) return;
    const std::vector<std::string> done =
        nn::quantize_linear_weights(trainer.model(), nn::QuantizeOptions(method_).group_size(group_size_), layers_);
    if (trainer.is_global_zero())
      fulgur::log::info(fmt::format(
          "{}: converted {} layer{} to {}{}; `fulgur quantize --method={}{}{}` writes the same "
          "from any checkpoint",
          kOwner, done.size(), done.size() == 1 ? "" : "s", nn::to_string(method_), group_text(),
          nn::to_string(method_),
          method_ == nn::WeightQuantization::int4 ? fmt::format(" --group_size={}", group_size_) : std::string(),
          // Learned per-tensor input scales are in the checkpoint; dynamic ones are not.
          activations_ != nn::ActivationQuantization::none &&
                  !(learnable_scales_ && activations_ == nn::ActivationQuantization::per_tensor)
              ? fmt::format(" --activations={}", nn::to_string(activations_))
              : std::string()));
  }

 private:
  static nn::WeightQuantization method_from(const Options& options) {
    if (options.method != "int8" && options.method != "int4") options.reject("method", "must be \"int8\" or \"int4\"");
    return nn::weight_quantization_from_string(options.method);
  }

  static nn::ActivationQuantization activations_from(const Options& options) {
    if (options.activations != "none" && options.activations != "per_token" && options.activations != "per_tensor")
      options.reject("activations", "must be \"none\", \"per_token\" or \"per_tensor\"");
    return nn::activation_quantization_from_string(options.activations);
  }

  // A model served from quantized weights (`fulgur test --ckpt_path=<fulgur quantize's file>` with
  // this callback still configured) has nothing left to train for: not an error.
  static bool has_quantized_layer(torch::nn::Module& model) {
    for (const auto& item : model.named_modules("", /*include_self=*/false))
      if (auto* linear = dynamic_cast<nn::LinearImpl*>(item.value().get());
          linear && linear->quantization() != nn::WeightQuantization::none)
        return true;
    return false;
  }

  std::string group_text() const {
    return method_ == nn::WeightQuantization::int4 ? fmt::format(" (group size {})", group_size_) : "";
  }

  nn::WeightQuantization method_;
  int64_t group_size_;
  std::string layers_;
  bool convert_at_end_;
  nn::ActivationQuantization activations_;
  bool learnable_scales_;
  bool announced_ = false;
};

}  // namespace

FULGUR_PLUGIN(QuantizationAwareTraining, "qat", "1.0.0",
              "Quantization-aware training of fulgur::nn::Linear layers for int8 or int4 weight-only storage")
