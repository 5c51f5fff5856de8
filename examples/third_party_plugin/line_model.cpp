// An out-of-tree model and datamodule, built against the installed Fulgur like divergence_guard:
// `fulgur fit --config line_model.toml` fits y = 3x - 1 with one linear layer, no main() needed.
#include <fulgur/data.h>
#include <fulgur/module.h>
#include <fulgur/plugin.h>

#include <torch/torch.h>

class LineModel : public fulgur::Module {
 public:
  static constexpr auto hparams_schema = fulgur::option_schema(FULGUR_OPTION(floating, lr, "SGD learning rate", 0.1));

  explicit LineModel(const fulgur::Options& hp) : lr_(hp.get_float("lr")) {
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

class LineData : public fulgur::DataModule {
 public:
  static constexpr auto hparams_schema =
      fulgur::option_schema(FULGUR_OPTION(integer, samples, "Points on the line", 256),
                            FULGUR_OPTION(integer, batch_size, "Points per batch", 32));

  explicit LineData(const fulgur::Options& hp) : samples_(hp.get_int("samples")), batch_(hp.get_int("batch_size")) {}
  std::unique_ptr<fulgur::BatchLoader> train_loader() override { return loader(/*shuffle=*/true); }
  std::unique_ptr<fulgur::BatchLoader> val_loader() override { return loader(/*shuffle=*/false); }

 private:
  std::unique_ptr<fulgur::BatchLoader> loader(bool shuffle) const {
    at::Tensor x = torch::linspace(-1, 1, samples_).unsqueeze(1);
    return fulgur::make_tensor_loader(x, 3 * x - 1,
                                      fulgur::TensorLoaderOptions().batch_size(batch_).shuffle(shuffle).seed(1));
  }
  int64_t samples_, batch_;
};

FULGUR_PLUGIN(LineModel, "line_model", "1.0.0", "Fits y = 3x - 1 with one linear layer")
FULGUR_PLUGIN(LineData, "line_data", "1.0.0", "Points on the line y = 3x - 1")
