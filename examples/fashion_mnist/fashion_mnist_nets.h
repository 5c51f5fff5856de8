// The two Fashion-MNIST nets as classes (torch-heavy: only fashion_mnist.cpp and the plugin
// library include this; fashion_mnist.h stays cheap). Their [model] hyperparameters are
// FashionMnistClassifier's, less `arch`, which the class itself fixes.
#pragma once

#include "fashion_mnist.h"

#include <fulgur/nn/linear.h>

#include <torch/nn.h>
#include <torch/types.h>

namespace fulgur::examples {

// Records the net's arch among its hyperparameters (what loggers and checkpoints see).
inline Options with_arch(Options hp, const char* arch) {
  if (!hp.contains("arch")) hp.set("arch", std::string(arch));
  return hp;
}

// conv(1->32) -> pool -> conv(32->64) -> pool -> dropout -> fc(3136->128) -> fc(128->10).
// Padding keeps 28x28 through conv1, so the second conv runs on 14x14: about a third of the cost
// of the unpadded 26->24 layout of PyTorch's MNIST example, at the same ~91-92% test accuracy.
class FashionMnistCnn : public FashionMnistClassifier {
 public:
  static constexpr auto hparams_schema =
      option_schema(FULGUR_FASHION_MNIST_OPTIMIZER_OPTIONS, FULGUR_FASHION_MNIST_DROPOUT_OPTION);
  explicit FashionMnistCnn(Options hp) : FashionMnistClassifier(with_arch(std::move(hp), "cnn")) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
    dropout = register_module("dropout", torch::nn::Dropout(hparams.get_float("dropout")));
    fc1 = register_module("fc1", fulgur::nn::Linear(64 * 7 * 7, 128));
    fc2 = register_module("fc2", fulgur::nn::Linear(128, kFashionMnistClasses));
  }

  at::Tensor forward(const at::Tensor& images) override {
    namespace F = torch::nn::functional;
    at::Tensor x = F::max_pool2d(torch::relu(conv1->forward(images)), F::MaxPool2dFuncOptions(2));
    x = F::max_pool2d(torch::relu(conv2->forward(x)), F::MaxPool2dFuncOptions(2));
    x = dropout->forward(x.flatten(1));
    x = dropout->forward(torch::relu(fc1->forward(x)));
    return fc2->forward(x);
  }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Dropout dropout{nullptr};
  // fulgur::nn::Linear rather than torch::nn::Linear: the same layer, which `fulgur quantize` can
  // store int8 or int4 for serving.
  fulgur::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// 784 -> 256 -> 10.
class FashionMnistMlp : public FashionMnistClassifier {
 public:
  static constexpr auto hparams_schema = option_schema(FULGUR_FASHION_MNIST_OPTIMIZER_OPTIONS);
  explicit FashionMnistMlp(Options hp) : FashionMnistClassifier(with_arch(std::move(hp), "mlp")) {
    fc1 = register_module("fc1", fulgur::nn::Linear(28 * 28, 256));
    fc2 = register_module("fc2", fulgur::nn::Linear(256, kFashionMnistClasses));
  }

  at::Tensor forward(const at::Tensor& images) override {
    return fc2->forward(torch::relu(fc1->forward(images.flatten(1))));
  }

  fulgur::nn::Linear fc1{nullptr}, fc2{nullptr};
};

}  // namespace fulgur::examples
