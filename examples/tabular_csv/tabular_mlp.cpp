// A classifier for tabular features (README, "Tabular data"): one hidden layer, cross-entropy,
// accuracy on the validation split.
#include <fulgur/module.h>
#include <fulgur/plugin.h>

#include <torch/torch.h>

class TabularMlp : public fulgur::Module {
 public:
  // num_features and num_classes are required: give them, or link them to the datamodule's values
  // ([links] model.num_features = "data.num_features").
  FULGUR_OPTIONS(Options, (integer, num_features, "Input features (columns other than the target)"),
                 (integer, num_classes, "Target classes"), (integer, hidden, "Hidden units", 32),
                 (floating, lr, "Adam learning rate", 0.01));

  explicit TabularMlp(const Options& hp) : lr_(hp.lr) {
    hp.check(hp.num_features > 0, "num_features", "must be positive");
    hp.check(hp.num_classes > 1, "num_classes", "must be at least 2");
    net = register_module("net", torch::nn::Sequential(torch::nn::Linear(hp.num_features, hp.hidden), torch::nn::ReLU(),
                                                       torch::nn::Linear(hp.hidden, hp.num_classes)));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& batch, int64_t) override {
    at::Tensor loss = torch::cross_entropy_loss(net->forward(batch.input), batch.target);
    log("train/loss", loss);
    return {loss};
  }
  fulgur::StepOutput validation_step(const fulgur::Batch& batch, int64_t) override {
    const at::Tensor logits = net->forward(batch.input);
    log("val/loss", torch::cross_entropy_loss(logits, batch.target));
    log("val/acc", logits.argmax(1).eq(batch.target).to(at::kFloat).mean());
    return {};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    return {fulgur::OptimizerConfig(std::make_shared<torch::optim::Adam>(parameters(), lr_))};
  }

  torch::nn::Sequential net{nullptr};

 private:
  double lr_;
};

FULGUR_PLUGIN(TabularMlp, "tabular_mlp", "1.0.0", "A one-hidden-layer classifier for tabular features")
