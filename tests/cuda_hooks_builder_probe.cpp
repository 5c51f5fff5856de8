// The programmatic entry point for the CUDA-hooks test: builds a seeded Trainer with ConfigBuilder
// (the accelerator named on the command line), trains the Fashion-MNIST MLP for two batches, and
// reports the outcome. `--seed-first` seeds torch before the Trainer exists: the reordering that
// fixes ATen's CUDA hooks to the CPU stub, which the cuda accelerator must then refuse.
//
//   fulgur_cuda_hooks_builder_probe ACCELERATOR ROOT_DIR [--seed-first]
#include <fulgur/config_builder.h>
#include <fulgur/error.h>
#include <fulgur/trainer.h>

#include <ATen/Context.h>
#include <ATen/Utils.h>
#include <ATen/core/Generator.h>

#include <cstdio>
#include <exception>
#include <string>
#include <string_view>

#include "fashion_mnist.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: fulgur_cuda_hooks_builder_probe ACCELERATOR ROOT_DIR [--seed-first]\n");
    return 2;
  }
  namespace ex = fulgur::examples;
  try {
    if (argc > 3 && std::string_view(argv[3]) == "--seed-first") at::manual_seed(1);
    fulgur::ConfigBuilder builder;
    builder.accelerator(argv[1])
        .max_epochs(1)
        .limit_train_batches(int64_t{2})
        .limit_val_batches(int64_t{0})
        .set("seed", int64_t{7})
        .set("enable_checkpointing", false)
        .set("enable_progress_bar", false)
        .set("default_root_dir", std::string(argv[2]))
        .model_hparams(fulgur::Options("[model]").set("arch", std::string("mlp")))
        .data_hparams(fulgur::Options("[data]").set("batch_size", int64_t{32}));
    fulgur::Trainer trainer(builder);
    auto model = ex::make_fashion_mnist_model(trainer.config().model);
    ex::FashionMnistDataModule data(trainer.config().data);
    trainer.fit(*model, data);
    std::printf("fit finished\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fulgur_cuda_hooks_builder_probe: error: %s\n", e.what());
    return 1;
  }
}
