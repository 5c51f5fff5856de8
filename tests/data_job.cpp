// fulgur_data_job: trains from a TOML whose [data] table names a file-backed dataset, the way a
// user's program would wire fulgur/data into a DataModule. The process-level data tests run it
// (with the kill-at-step fixture for a mid-epoch SIGKILL and a resume).
//
//   fulgur_data_job <config.toml>
//
// [data] format = "image_folder": path = a folder of class sub-directories; a tiny CNN classifies
//                 random-resized-cropped 16x16 images (random crop, flip, normalize: the RNG of
//                 every sample is in play).
//        format = "token_file":   path = a uint16 token file; a bigram language model predicts
//                 the next token of shuffled windows of block_size.
//        batch_size, num_workers, seed: the DataLoader's.
#include <fulgur/data.h>
#include <fulgur/data/data_loader.h>
#include <fulgur/data/image_folder.h>
#include <fulgur/data/token_file.h>
#include <fulgur/data/transforms.h>
#include <fulgur/error.h>
#include <fulgur/module.h>
#include <fulgur/trainer.h>

#include <torch/torch.h>

#include <cstdio>
#include <exception>

namespace {

namespace d = fulgur::data;

class FileData : public fulgur::DataModule {
 public:
  explicit FileData(const fulgur::Options& o)
      : format_(o.get_string("format")),
        path_(o.get_string("path")),
        batch_size_(o.get_int("batch_size")),
        workers_(o.get_int("num_workers")),
        seed_(static_cast<uint64_t>(o.get_int("seed"))) {}

  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    auto options = d::DataLoaderOptions().batch_size(batch_size_).shuffle(true).seed(seed_).num_workers(workers_);
    if (format_ == "image_folder") {
      options.transform(d::compose({d::random_resized_crop(d::RandomResizedCropOptions(16).scale(0.5, 1.0)),
                                    d::random_horizontal_flip(), d::normalize({0.5}, {0.25})}));
      return d::make_data_loader(std::make_shared<d::ImageFolder>(path_), options);
    }
    if (format_ == "token_file")
      return d::make_data_loader(std::make_shared<d::TokenFile>(path_, d::TokenFileOptions(8).vocab_size(64)), options);
    throw fulgur::Error(fulgur::ErrorKind::config, "[data] format must be \"image_folder\" or \"token_file\"");
  }

 private:
  std::string format_, path_;
  int64_t batch_size_, workers_;
  uint64_t seed_;
};

struct Cnn : fulgur::Module {
  Cnn() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(8 * 8 * 8, 3));
  }
  fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
    at::Tensor x = torch::max_pool2d(torch::relu(conv->forward(b.input)), 2).flatten(1);
    at::Tensor loss = torch::nn::functional::cross_entropy(fc->forward(x), b.target);
    log("train/loss", loss);
    return {loss};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    return {
        fulgur::OptimizerConfig(std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(1e-2)))};
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};

struct Bigram : fulgur::Module {
  Bigram() { table = register_module("table", torch::nn::Embedding(64, 64)); }
  fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
    at::Tensor logits = table->forward(b.input);
    at::Tensor loss = torch::nn::functional::cross_entropy(logits.flatten(0, 1), b.target.flatten());
    log("train/loss", loss);
    return {loss};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    return {
        fulgur::OptimizerConfig(std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(1e-2)))};
  }
  torch::nn::Embedding table{nullptr};
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fulgur_data_job <config.toml>\n");
    return 2;
  }
  try {
    fulgur::Trainer trainer = fulgur::Trainer::from_toml(argv[1]);
    FileData data(trainer.config().data);
    std::shared_ptr<fulgur::Module> model;  // after the Trainer: its seed fixes the weights
    if (trainer.config().data.get_string("format") == "image_folder")
      model = std::make_shared<Cnn>();
    else
      model = std::make_shared<Bigram>();
    trainer.fit(*model, data);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fulgur_data_job: %s\n", e.what());
    return 1;
  }
}
