// ABI corpus, model `corpus_line_model`: a fulgur::Module built against the frozen SDK 1.0 headers
// (fulgur/module.h as installed with 1.0), linking the engine only. Fits y = 3x - 1 with one linear
// layer and SGD; logs train/loss and val/loss.
#include <fulgur/module.h>
#include <fulgur/plugin.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <vector>

namespace {

class CorpusLineModel final : public fulgur::Module {
 public:
  static constexpr auto hparams_schema = fulgur::option_schema(FULGUR_OPTION(floating, lr, "SGD learning rate", 0.2));

  explicit CorpusLineModel(const fulgur::Options& hp) : lr_(hp.get_float("lr")) {
    if (!(lr_ > 0)) throw fulgur::Error(fulgur::ErrorKind::config, "model 'corpus_line_model': lr must be positive");
    fc = register_module("fc", torch::nn::Linear(1, 1));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& batch, int64_t) override {
    at::Tensor loss = torch::nn::functional::mse_loss(fc->forward(batch.input), batch.target);
    log("train/loss", loss);
    return {loss};
  }
  fulgur::StepOutput validation_step(const fulgur::Batch& batch, int64_t) override {
    log("val/loss", torch::nn::functional::mse_loss(fc->forward(batch.input), batch.target));
    return {};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    return {fulgur::OptimizerConfig(std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(lr_)))};
  }

  torch::nn::Linear fc{nullptr};

 private:
  double lr_;
};

}  // namespace

FULGUR_PLUGIN(CorpusLineModel, "corpus_line_model", "1.0.0", "ABI corpus: fits y = 3x - 1 with one linear layer")
