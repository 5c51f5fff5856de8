// An out-of-tree model plugin, built against the installed Fulgur like divergence_guard: with the
// datamodule next to it (line_data.cpp), `fulgur fit --config line_model.toml` fits y = 3x - 1 with
// one linear layer, no main() needed. A model links the engine only (Fulgur::core).
#include <fulgur/module.h>
#include <fulgur/plugin.h>

#include <torch/torch.h>

class LineModel : public fulgur::Module {
 public:
  // The [model] hyperparameters, declared once: FULGUR_PLUGIN takes their schema, the constructor
  // gets them typed.
  FULGUR_OPTIONS(Options, (floating, lr, "SGD learning rate", 0.1));

  explicit LineModel(const Options& hp) : lr_(hp.lr) {
    if (!(lr_ > 0)) throw std::invalid_argument("line_model: lr must be positive");
    fc = register_module("fc", torch::nn::Linear(1, 1));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& batch, int64_t) override {
    at::Tensor loss = torch::mse_loss(fc->forward(batch.input), batch.target);
    log("train/loss", loss);
    return {loss};
  }
  fulgur::StepOutput validation_step(const fulgur::Batch& batch, int64_t) override {
    log("val/loss", torch::mse_loss(fc->forward(batch.input), batch.target));
    return {};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    return {fulgur::OptimizerConfig(std::make_shared<torch::optim::SGD>(parameters(), lr_))};
  }

  torch::nn::Linear fc{nullptr};

 private:
  double lr_;
};

FULGUR_PLUGIN(LineModel, "line_model", "1.0.0", "Fits y = 3x - 1 with one linear layer")
