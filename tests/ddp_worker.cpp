// A small training program for the multi-process tests: the same binary runs as every rank, under
// Fulgur's launcher (devices = N), under torchrun, or alone. It trains a fixed MLP on fixed data,
// checks the collectives at fit start, and writes its final weights and metrics per rank.
//
//   fulgur_ddp_worker <config.toml> <out_dir> [--resume <ckpt>] [--save <ckpt>]
//   FULGUR_TEST_DIE_RANK=r FULGUR_TEST_DIE_STEP=s: rank r kills itself (SIGKILL) at step s.
//   FULGUR_TEST_UNUSED_LAYER=1: the model has a layer that forward never uses.
//   FULGUR_TEST_SCRAMBLE_INIT=1: ranks other than 0 perturb their initial weights.
//   FULGUR_TEST_SHARDING_MODEL=1: adds a 0-dim parameter and a frozen layer (what sharding must handle).
//   FULGUR_TEST_OPTIMIZER=adamw: AdamW with weight decay instead of SGD; =lion: fulgur::optim::Lion;
//   =muon: fulgur::optim::Muon on fc1's and fc2's weights, its AdamW on the rest.
//   FULGUR_TEST_BLOCKS=1: fc1 and fc2 run as blocks (fulgur::run_block): units of zero_stage = 3;
//   FULGUR_TEST_CHECKPOINT=1 adds activation checkpointing to them, FULGUR_TEST_DROPOUT=1 dropout
//   inside fc1's. The metrics file then records the storage fc1.weight holds after fit (0 when
//   resharded); the weights are read whole.
//   FULGUR_TEST_SEQUENTIAL=1: fc1, tanh and fc2 are held in a torch::nn::Sequential ("layers")
//   that forward calls (fsdp's auto_wrap_policy routes its elements through fulgur::run_block).
//   FULGUR_TEST_BUILT_BLOCKS=1: fc1 and fc2 are made in configure_model, each marked complete with
//   fulgur::built_block (zero_stage = 3 shards them as they are built); with
//   FULGUR_TEST_SCRAMBLE_INIT the ranks other than 0 then draw from other seeds instead.
//   FULGUR_TEST_VALIDATE_AFTER_FIT=1: trainer.validate after fit, in the same process.
//   FULGUR_TEST_UNKNOWN_LENGTH=1: the train loader does not know its length, and the last rank's
//   yields one batch fewer per epoch than the others (a streaming dataset split unevenly).
//   FULGUR_TEST_INF_RANK=r FULGUR_TEST_INF_STEP=s: rank r's loss is infinite at its s-th
//   training_step (counted from 1), so that its gradients, and after the all-reduce everyone's,
//   are not finite. The metrics file records `optimizer_step_count` (the first parameter's step
//   count in the Adam/AdamW state) and `loss_scale` (16-mixed) after fit.
//   FULGUR_TEST_RECORD_SAMPLES=1: each rank appends "epoch global_step index" for every training
//   sample it is handed to <out_dir>/samples_rank<r>.txt (elastic resume: each sample once per epoch);
//   =round: to samples_rank<r>_port<MASTER_PORT>.txt, one file per torchrun round.
//   FULGUR_TEST_TAR_SHARDS=<dir>: the training rows come from tar shards written under <dir>, in
//   order (an iterable dataset: TarShards in a DataLoader), instead of a tensor loader.
//   FULGUR_TEST_STEP_SLEEP_MS=n: every training batch starts n ms late (a run slow enough to be
//   interrupted from outside, as the torchrun elastic check does).
#include <fulgur/blocks.h>
#include <fulgur/callback.h>
#include <fulgur/config.h>
#include <fulgur/data.h>
#include <fulgur/data/data_loader.h>
#include <fulgur/data/tar_shards.h>
#include <fulgur/data/transforms.h>
#include <fulgur/error.h>
#include <fulgur/metrics.h>
#include <fulgur/module.h>
#include <fulgur/nn/batch_norm.h>
#include <fulgur/optim/lion.h>
#include <fulgur/optim/muon.h>
#include <fulgur/precision.h>
#include <fulgur/strategy.h>
#include <fulgur/trainer.h>
#include <fulgur/trainer_context.h>

#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <thread>

namespace {

struct Mlp : fulgur::Module {
  Mlp() {
    if (std::getenv("FULGUR_TEST_SEQUENTIAL")) {
      // The same layers (and initial weights) held in a Sequential, which calls them: what fsdp's
      // auto_wrap_policy can route through run_block. Parameter names: layers.0.*, layers.2.*.
      fc1 = torch::nn::Linear(16, 32);
      fc2 = torch::nn::Linear(32, 4);
      layers = register_module("layers", torch::nn::Sequential(fc1, torch::nn::Tanh(), fc2));
    } else if (!std::getenv("FULGUR_TEST_BUILT_BLOCKS")) {
      fc1 = register_module("fc1", torch::nn::Linear(16, 32));
      fc2 = register_module("fc2", torch::nn::Linear(32, 4));
    }
    // A layer that gets no gradient (ddp needs find_unused_parameters for it).
    if (std::getenv("FULGUR_TEST_UNUSED_LAYER")) register_module("unused", torch::nn::Linear(4, 4));
    // FULGUR_TEST_BATCH_NORM=fulgur|torch: a batch norm after fc1 ([trainer] sync_batchnorm).
    if (const char* bn = std::getenv("FULGUR_TEST_BATCH_NORM")) {
      if (std::string(bn) == "torch")
        torch_norm = register_module("norm", torch::nn::BatchNorm1d(32));
      else
        norm = register_module("norm", fulgur::nn::BatchNorm(32));
    }
    if (std::getenv("FULGUR_TEST_SHARDING_MODEL")) {
      scale = register_parameter("scale", torch::ones({}));  // 0-dim: one row, owned by one rank
      frozen = register_module("frozen", torch::nn::Linear(4, 4));
      for (auto& p : frozen->parameters()) p.set_requires_grad(false);
    }
  }
  void configure_model() override {
    if (fc1 || !std::getenv("FULGUR_TEST_BUILT_BLOCKS")) return;
    fc1 = register_module("fc1", fulgur::built_block(torch::nn::Linear(16, 32)));
    fc2 = register_module("fc2", fulgur::built_block(torch::nn::Linear(32, 4)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor out;
    if (layers) {
      out = layers->forward(x);
    } else if (std::getenv("FULGUR_TEST_BLOCKS")) {
      const auto options = fulgur::BlockOptions().checkpoint_activations(std::getenv("FULGUR_TEST_CHECKPOINT"));
      // FULGUR_TEST_DROPOUT: dropout inside the block, so that its recomputation must redraw the
      // same mask (the device generator's state restored, on a device with one).
      const double p = std::getenv("FULGUR_TEST_DROPOUT") ? 0.3 : 0.0;
      const at::Tensor h = fulgur::run_block(
          *fc1, x,
          [fc1 = fc1, p, training = is_training()](const at::Tensor& in) mutable {
            return torch::dropout(torch::tanh(fc1->forward(in)), p, training && p > 0);
          },
          options);
      out = fulgur::run_block(fc2, h, options);
    } else if (norm) {
      out = fc2->forward(torch::tanh(norm->forward(fc1->forward(x))));
    } else if (torch_norm) {
      out = fc2->forward(torch::tanh(torch_norm->forward(fc1->forward(x))));
    } else {
      out = fc2->forward(torch::tanh(fc1->forward(x)));
    }
    if (scale.defined()) out = frozen->forward(out) * scale;
    return out;
  }
  fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
    at::Tensor loss = torch::nn::functional::cross_entropy(forward(b.input), b.target);
    log("train/loss", loss, fulgur::LogOptions().sync_dist(true));
    // A step-level value that differs per rank (issue #34.3): with sync_dist every rank holds the mean.
    if (std::getenv("FULGUR_TEST_LOG_RANK_STEP"))
      log("train/rank", torch::full({}, static_cast<double>(rank + 1), at::kFloat),
          fulgur::LogOptions().sync_dist(true));
    ++calls;
    const char* inf_rank = std::getenv("FULGUR_TEST_INF_RANK");
    if (inf_rank && std::atoll(inf_rank) == rank && calls == std::atoll(std::getenv("FULGUR_TEST_INF_STEP")))
      loss = loss * std::numeric_limits<float>::infinity();
    return {loss};
  }
  fulgur::StepOutput validation_step(const fulgur::Batch& b, int64_t) override {
    log("val/loss", torch::nn::functional::cross_entropy(forward(b.input), b.target),
        fulgur::LogOptions().sync_dist(true));
    // Differs per rank: after sync_dist every rank must hold the mean.
    log("val/rank", torch::full({}, static_cast<double>(rank), at::kFloat), fulgur::LogOptions().sync_dist(true));
    // Not synced: each rank sees its own value (for decisions that must still agree).
    log("val/own_rank", torch::full({}, static_cast<double>(rank), at::kFloat));
    // Metric objects: states summed (accuracy) and gathered (AUROC's scores) across ranks at
    // epoch end, so every rank logs the value over the whole validation set.
    const at::Tensor logits = forward(b.input);
    val_acc.update(logits, b.target);
    val_auroc.update(logits, b.target);
    log("val/acc_metric", val_acc);
    log("val/auroc_metric", val_auroc);
    return {};
  }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
    const char* which = std::getenv("FULGUR_TEST_OPTIMIZER");
    if (which && std::string(which) == "adamw") {
      adamw = std::make_shared<torch::optim::AdamW>(parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      return {fulgur::OptimizerConfig(adamw)};
    }
    if (which && std::string(which) == "lion")
      return {fulgur::OptimizerConfig(
          std::make_shared<fulgur::optim::Lion>(parameters(), fulgur::optim::LionOptions(1e-3).weight_decay(0.1)))};
    if (which && std::string(which) == "muon")
      return {fulgur::OptimizerConfig(std::make_shared<fulgur::optim::Muon>(fulgur::optim::muon_param_groups(
          *this, fulgur::optim::MuonOptions(0.02), fulgur::optim::MuonOptions(1e-2).weight_decay(0.1))))};
    return {fulgur::OptimizerConfig(std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.1)))};
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, frozen{nullptr};
  torch::nn::Sequential layers{nullptr};
  fulgur::nn::BatchNorm norm{nullptr};
  torch::nn::BatchNorm1d torch_norm{nullptr};
  at::Tensor scale;
  int64_t rank = 0;
  int64_t calls = 0;
  std::shared_ptr<torch::optim::AdamW> adamw;
  fulgur::metrics::Accuracy val_acc{
      fulgur::metrics::ClassificationOptions::multiclass(4).average(fulgur::metrics::Average::micro)};
  fulgur::metrics::AUROC val_auroc{fulgur::metrics::ClassificationOptions::multiclass(4)};
};

// A loader of unknown length (num_batches() == -1) over another; on the last replica it ends one
// batch early.
struct UnknownLength : fulgur::BatchLoader {
  explicit UnknownLength(std::unique_ptr<fulgur::BatchLoader> inner) : inner(std::move(inner)) {}
  int64_t num_batches() const override { return -1; }
  void start_epoch(int64_t epoch, int64_t skip) override {
    inner->start_epoch(epoch, skip);
    left = inner->num_batches() - skip - (last_replica ? 1 : 0);
  }
  std::optional<fulgur::Batch> next() override {
    if (left-- <= 0) return std::nullopt;
    return inner->next();
  }
  void set_replica(int64_t rank, int64_t replicas) override {
    inner->set_replica(rank, replicas);
    last_replica = replicas > 1 && rank == replicas - 1;
  }
  std::unique_ptr<fulgur::BatchLoader> inner;
  bool last_replica = false;
  int64_t left = 0;
};

struct FixedData : fulgur::DataModule {
  FixedData(int64_t batch, bool shuffle) : batch(batch), shuffle(shuffle) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
    inputs = at::randn({96, 16}, gen);
    targets = at::randint(0, 4, {96}, gen, at::kLong);
  }
  std::unique_ptr<fulgur::BatchLoader> train_loader() override {
    if (const char* dir = std::getenv("FULGUR_TEST_TAR_SHARDS")) return tar_loader(dir);
    auto loader = fulgur::make_tensor_loader(inputs, targets,
                                             fulgur::TensorLoaderOptions().batch_size(batch).shuffle(shuffle).seed(5));
    if (std::getenv("FULGUR_TEST_UNKNOWN_LENGTH")) return std::make_unique<UnknownLength>(std::move(loader));
    return loader;
  }
  std::unique_ptr<fulgur::BatchLoader> val_loader() override {
    return fulgur::make_tensor_loader(inputs.slice(0, 0, 32), targets.slice(0, 0, 32),
                                      fulgur::TensorLoaderOptions().batch_size(8));
  }
  // The same rows as 3 tar shards of 32 samples (.bin: the 16 floats, .cls: the target), in this
  // rank's own folder under `dir`, read back in order by a DataLoader over TarShards.
  std::unique_ptr<fulgur::BatchLoader> tar_loader(const std::string& dir) const {
    namespace d = fulgur::data;
    const std::filesystem::path own =
        std::filesystem::path(dir) / fmt::format("rank{}", std::getenv("RANK") ? std::getenv("RANK") : "0");
    std::filesystem::create_directories(own);
    std::vector<std::filesystem::path> shards;
    for (int64_t shard = 0; shard < 3; ++shard) {
      std::vector<std::pair<std::string, std::string>> members;
      for (int64_t row = shard * 32; row < (shard + 1) * 32; ++row) {
        const at::Tensor x = inputs[row].contiguous();
        const std::string key = fmt::format("s{}/{:03}", shard, row);
        members.emplace_back(key + ".bin", std::string(static_cast<const char*>(x.data_ptr()), x.nbytes()));
        members.emplace_back(key + ".cls", std::to_string(targets[row].item<int64_t>()));
      }
      shards.push_back(own / fmt::format("shard{}.tar", shard));
      d::write_tar(shards.back(), members);
    }
    auto floats = d::lambda([](d::Sample s, d::SampleRng&) {
      s.input = s.input.view(at::kFloat).clone();
      return s;
    });
    return d::make_data_loader(std::make_shared<d::TarShards>(shards, d::TarShardOptions().input("bin")),
                               d::DataLoaderOptions().batch_size(batch).transform(floats));
  }
  int64_t batch;
  bool shuffle;
  at::Tensor inputs, targets;
};

// Every collective a callback may use, checked against what the ranks must agree on.
struct CollectiveCheck : fulgur::Callback {
  fulgur::HookSet hooks() const override { return static_cast<fulgur::HookSet>(fulgur::Hook::fit_start); }
  void on_fit_start(fulgur::TrainerContext& trainer) override {
    fulgur::TrainerContext& s = trainer;
    const int64_t rank = s.cluster().global_rank, world = s.cluster().world_size;
    auto expect = [&](bool ok, const std::string& what) {
      if (!ok) throw std::runtime_error(fmt::format("rank {}: collective check failed: {}", rank, what));
    };
    const at::Tensor mine = torch::full({2}, static_cast<double>(rank + 1));
    expect(s.reduce(mine, fulgur::ReduceOp::sum)[0].item<double>() == world * (world + 1) / 2.0, "reduce sum");
    expect(s.reduce(mine, fulgur::ReduceOp::mean)[1].item<double>() == (world + 1) / 2.0, "reduce mean");
    expect(s.reduce(mine, fulgur::ReduceOp::max)[0].item<double>() == world, "reduce max");
    expect(s.reduce(mine, fulgur::ReduceOp::min)[0].item<double>() == 1, "reduce min");
    const auto gathered = s.all_gather(torch::full({1}, static_cast<double>(rank)));
    expect(static_cast<int64_t>(gathered.size()) == world, "all_gather size");
    for (int64_t r = 0; r < world; ++r) expect(gathered[r].item<double>() == r, "all_gather value");
    expect(s.broadcast(rank == world - 1 ? "from the last rank" : "other", world - 1) == "from the last rank",
           "broadcast from the last rank");
    expect(s.broadcast(rank == 0 ? "dir/from rank 0" : "other", 0) == "dir/from rank 0", "broadcast");
    expect(s.agree(rank == 0, /*all=*/false), "decision any");
    expect(s.agree(rank == 0, /*all=*/true) == (world == 1), "decision all");
    s.barrier("check");
  }
};

struct DieAtStep : fulgur::Callback {
  DieAtStep(int64_t rank, int64_t step) : rank(rank), step(step) {}
  fulgur::HookSet hooks() const override { return static_cast<fulgur::HookSet>(fulgur::Hook::train_batch_start); }
  void on_train_batch_start(fulgur::TrainerContext& t, const fulgur::Batch&, int64_t) override {
    if (t.cluster().global_rank == rank && t.global_step() == step) raise(SIGKILL);
  }
  int64_t rank, step;
};

struct SlowSteps : fulgur::Callback {
  explicit SlowSteps(int64_t ms) : ms(ms) {}
  fulgur::HookSet hooks() const override { return static_cast<fulgur::HookSet>(fulgur::Hook::train_batch_start); }
  void on_train_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  }
  int64_t ms;
};

// Writes which dataset rows each training batch holds (found by their first feature, which the
// fixed random data makes unique), with the epoch and the global step it trains in.
struct RecordSamples : fulgur::Callback {
  RecordSamples(const at::Tensor& inputs, const std::string& file) : out(file, std::ios::app) {
    const at::Tensor first = inputs.select(1, 0).contiguous();
    for (int64_t i = 0; i < first.size(0); ++i) row_of[first[i].item<float>()] = i;
  }
  fulgur::HookSet hooks() const override { return static_cast<fulgur::HookSet>(fulgur::Hook::train_batch_start); }
  void on_train_batch_start(fulgur::TrainerContext& t, const fulgur::Batch& batch, int64_t) override {
    const at::Tensor first = batch.input.select(1, 0).to(at::kCPU).contiguous();
    for (int64_t i = 0; i < first.size(0); ++i)
      out << t.current_epoch() << ' ' << t.global_step() << ' ' << row_of.at(first[i].item<float>()) << '\n';
    out.flush();
  }
  std::map<float, int64_t> row_of;
  std::ofstream out;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: fulgur_ddp_worker <config.toml> <out_dir> [--resume ckpt] [--save ckpt]\n";
    return 2;
  }
  std::string resume, save;
  for (int i = 3; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--resume") resume = argv[i + 1];
    if (std::string(argv[i]) == "--save") save = argv[i + 1];
  }
  try {
    fulgur::Trainer trainer = fulgur::Trainer::from_toml(argv[1]);
    const fulgur::Config& config = trainer.config();
    auto module = std::make_shared<Mlp>();  // after the Trainer: its seed fixes the weights
    FixedData data(config.data.get_int("batch_size"), config.data.get_bool("shuffle"));
    trainer.add_callback(std::make_shared<CollectiveCheck>());
    if (const char* record = std::getenv("FULGUR_TEST_RECORD_SAMPLES")) {
      // "round": one file per rank and process group (MASTER_PORT differs between torchrun's rounds).
      const std::string round = std::string(record) == "round" && std::getenv("MASTER_PORT")
                                    ? fmt::format("_port{}", std::getenv("MASTER_PORT"))
                                    : "";
      trainer.add_callback(std::make_shared<RecordSamples>(
          data.inputs,
          fmt::format("{}/samples_rank{}{}.txt", argv[2], std::getenv("RANK") ? std::getenv("RANK") : "0", round)));
    }
    if (const char* r = std::getenv("FULGUR_TEST_DIE_RANK"))
      trainer.add_callback(std::make_shared<DieAtStep>(std::atoll(r), std::atoll(std::getenv("FULGUR_TEST_DIE_STEP"))));
    if (const char* ms = std::getenv("FULGUR_TEST_STEP_SLEEP_MS"))
      trainer.add_callback(std::make_shared<SlowSteps>(std::atoll(ms)));
    module->rank = std::getenv("RANK") ? std::atoll(std::getenv("RANK")) : 0;
    if (std::getenv("FULGUR_TEST_SCRAMBLE_INIT") && module->rank != 0 && std::getenv("FULGUR_TEST_BUILT_BLOCKS")) {
      // The layers are made during fit: these ranks would draw other weights, unless they build
      // from rank 0's random state.
      torch::manual_seed(1000 + module->rank);
    } else if (std::getenv("FULGUR_TEST_SCRAMBLE_INIT") && module->rank != 0) {
      // Ranks other than 0 start elsewhere: ddp must overwrite them with rank 0's weights.
      torch::NoGradGuard no_grad;
      for (auto& p : module->parameters()) p.add_(torch::randn_like(p));
    }
    trainer.fit(*module, data, resume);
    // A second stage of the same model in the same process (its val/loss is what the metrics hold).
    if (std::getenv("FULGUR_TEST_VALIDATE_AFTER_FIT")) trainer.validate(*module, data);
    if (!save.empty()) trainer.save_checkpoint(save);

    const std::string rank = std::getenv("RANK") ? std::getenv("RANK") : "0";
    const size_t fc1_weight_bytes = module->fc1->weight.storage().nbytes();
    std::printf("rank %s: parameters on %s\n", rank.c_str(), module->fc1->weight.device().str().c_str());
    std::fflush(stdout);
    std::vector<at::Tensor> weights;
    {
      fulgur::FullParameters whole(*module);  // under zero_stage = 3: gathered for the copy
      // On the CPU: the file is read by the test, where no plugin device is registered.
      for (const auto& p : module->parameters()) weights.push_back(p.detach().to(at::kCPU, false, /*copy=*/true));
      // Floating buffers too (a batch norm's running statistics).
      for (const auto& b : module->buffers())
        if (b.is_floating_point()) weights.push_back(b.detach().to(at::kCPU, false, /*copy=*/true));
    }
    torch::save(weights, fmt::format("{}/weights_rank{}.pt", argv[2], rank));
    std::ofstream metrics(fmt::format("{}/metrics_rank{}.txt", argv[2], rank));
    if (std::getenv("FULGUR_TEST_BLOCKS") || std::getenv("FULGUR_TEST_SEQUENTIAL"))
      metrics << "fc1_weight_bytes " << fc1_weight_bytes << '\n';
    for (const auto& [k, v] : trainer.callback_metrics()) metrics << k << ' ' << fmt::format("{:.9g}", v) << '\n';
    metrics << "global_step " << trainer.global_step() << '\n';
    metrics << "current_epoch " << trainer.current_epoch() << '\n';
    if (module->adamw && !module->adamw->state().empty()) {
      const auto& first = module->adamw->param_groups().front().params().front();
      metrics
          << "optimizer_step_count "
          << static_cast<torch::optim::AdamWParamState&>(*module->adamw->state().at(first.unsafeGetTensorImpl())).step()
          << '\n';
    }
    c10::IValue precision_state;
    trainer.precision().state_dict(precision_state);
    if (precision_state.isGenericDict() && precision_state.toGenericDict().contains("scale"))
      metrics << "loss_scale " << precision_state.toGenericDict().at("scale").toDouble() << '\n';
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "fulgur_ddp_worker: " << e.what() << '\n';
    return 1;
  }
}
