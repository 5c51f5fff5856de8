// fashion_mnist_cli: the `fulgur fit | validate | test | predict` command line for a program that
// links its own classes instead of loading model and datamodule plugins. [model] / [data] are
// checked and defaulted against the classes' hparams_schema, exactly as `fulgur fit` checks the
// plugins' tables; every other plugin is still selected by name.
//
//   fashion_mnist_cli fit --config run.toml --trainer.max_epochs=2 --model.lr=3e-4
#include "fashion_mnist_nets.h"

#include <fulgur/cli.h>

int main(int argc, char** argv) {
  return fulgur::cli_main<fulgur::examples::FashionMnistMlp, fulgur::examples::FashionMnistDataModule>(argc, argv);
}
