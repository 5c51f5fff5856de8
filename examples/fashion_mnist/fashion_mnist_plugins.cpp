// The Fashion-MNIST example as plugins, so that `fulgur fit --config fashion_mnist.toml` trains it
// with no program of its own: two model plugins (the CNN and the MLP) and the datamodule. With no
// options given, FULGUR_PLUGIN takes each class's hparams_schema, the same one
// fulgur::cli_main reads (fashion_mnist_cli.cpp); `fulgur plugins describe fashion_mnist_cnn`
// lists it.
#include <fulgur/plugin.h>

#include "fashion_mnist_nets.h"

namespace ex = fulgur::examples;

FULGUR_PLUGIN(ex::FashionMnistCnn, "fashion_mnist_cnn", "1.0.0",
              "Fashion-MNIST CNN: conv32-conv64-fc128, 91-92% test accuracy in 5 epochs")
FULGUR_PLUGIN(ex::FashionMnistMlp, "fashion_mnist_mlp", "1.0.0", "Fashion-MNIST MLP: 784-256-10")
FULGUR_PLUGIN(ex::FashionMnistDataModule, "fashion_mnist", "1.0.0",
              "Fashion-MNIST from the IDX files of the Debian package dataset-fashion-mnist")
