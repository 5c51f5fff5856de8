// The built-in strategy `single_device`, precision `32-true`, logger `csv` and profiler `simple`,
// each loaded through the registry exactly as the Trainer loads them, and the SDK's checkpoint
// files (atomic writes, precise read errors, Python's torch.load(weights_only=True) opens them).
#include "test_support.h"

#include <fulgur/checkpoint_io.h>
#include <fulgur/logger.h>
#include <fulgur/precision.h>
#include <fulgur/profiler.h>
#include <fulgur/registry/registry.h>
#include <fulgur/strategy.h>
#include <fulgur/testing/plugin_kit.h>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

namespace fulgur {
namespace {

using test::error_from;
using test::read_bytes;
using test::run_command;
using test::TempDir;
namespace fs = std::filesystem;

// The registry the Trainer would build with no [plugins] paths: finds the built-ins next to the
// registry library (build/lib/fulgur/plugins).
PluginRegistry& registry() {
  static PluginRegistry instance(plugin_search_path({}));
  return instance;
}

// A plugin's options as the config loader would pass them: every schema default, then `overrides`.
Options options_for(PluginKind kind, std::string_view name, const std::map<std::string, OptionValue>& overrides = {}) {
  Options options(fmt::format("{} '{}'", to_string(kind), name));
  for (const OptionSchema& schema : registry().resolve(kind, name).metadata.options) {
    REQUIRE_MESSAGE(schema.default_value.has_value(), "option without default: " << schema.key);
    options.set(schema.key, *schema.default_value);
  }
  for (const auto& [key, value] : overrides) {
    REQUIRE_MESSAGE(registry().resolve(kind, name).metadata.find_option(key) != nullptr, "no option " << key);
    options.set(key, value);
  }
  return options;
}

template <class Interface>
std::shared_ptr<Interface> create(PluginKind kind, std::string_view name,
                                  const std::map<std::string, OptionValue>& overrides = {}) {
  return plugin_cast<Interface>(registry().create(kind, name, options_for(kind, name, overrides)));
}

std::string read_text(const fs::path& file) { return read_bytes(file); }

void write_text(const fs::path& file, const std::string& text) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out << text;
  REQUIRE(out.good());
}

// Names in `dir` other than `keep` (temporary files left behind show up here).
std::vector<std::string> other_entries(const fs::path& dir, const std::set<std::string>& keep) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir))
    if (!keep.count(entry.path().filename().string())) names.push_back(entry.path().filename().string());
  return names;
}

c10::impl::GenericDict string_dict() { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); }

// A checkpoint shaped like the Trainer's: nested dicts, a list of dicts, typed lists, tensors of
// two dtypes, and scalars of every kind.
c10::impl::GenericDict sample_checkpoint() {
  auto state = string_dict();
  state.insert("layer.weight", torch::arange(6, torch::kFloat32).reshape({2, 3}));
  state.insert("layer.bias", torch::tensor({0.5, -1.5, 2.25}).to(torch::kBFloat16));
  auto optimizer = string_dict();
  optimizer.insert("lr", 0.01);
  optimizer.insert("params", c10::List<int64_t>({0, 1}));  // a TorchScript-specialised list
  auto optimizers = c10::impl::GenericList(c10::AnyType::get());
  optimizers.push_back(optimizer);
  auto checkpoint = string_dict();
  checkpoint.insert("epoch", int64_t{3});
  checkpoint.insert("global_step", int64_t{120});
  checkpoint.insert("state_dict", state);
  checkpoint.insert("optimizer_states", optimizers);
  checkpoint.insert("best_score", 0.125);
  checkpoint.insert("name", std::string("run-a"));
  checkpoint.insert("finished", true);
  checkpoint.insert("nothing", c10::IValue());
  checkpoint.insert("history", c10::List<double>({1.5, 0.75}));
  return checkpoint;
}

c10::IValue at_key(const c10::IValue& dict, const std::string& key) {
  REQUIRE(dict.isGenericDict());
  auto d = dict.toGenericDict();
  auto it = d.find(key);
  REQUIRE_MESSAGE(it != d.end(), "missing key " << key);
  return it->value();
}

// ----------------------------------------------------------------------------------------------
// checkpoint_io

TEST_CASE("checkpoint_io: a checkpoint round-trips in C++ and opens in Python with weights_only=True") {
  TempDir dir;
  const fs::path path = dir / "model.ckpt";
  write_checkpoint_file(sample_checkpoint(), path.string());
  CHECK(other_entries(dir.path(), {"model.ckpt"}).empty());

  const c10::IValue loaded = read_checkpoint_file(path.string());
  CHECK(at_key(loaded, "epoch").toInt() == 3);
  CHECK(at_key(loaded, "global_step").toInt() == 120);
  CHECK(at_key(loaded, "best_score").toDouble() == 0.125);
  CHECK(at_key(loaded, "name").toStringRef() == "run-a");
  CHECK(at_key(loaded, "finished").toBool());
  CHECK(at_key(loaded, "nothing").isNone());
  const c10::IValue state = at_key(loaded, "state_dict");
  CHECK(torch::equal(at_key(state, "layer.weight").toTensor(), torch::arange(6, torch::kFloat32).reshape({2, 3})));
  const at::Tensor bias = at_key(state, "layer.bias").toTensor();
  CHECK((bias.scalar_type() == torch::kBFloat16));
  CHECK(torch::equal(bias.to(torch::kFloat32), torch::tensor({0.5f, -1.5f, 2.25f})));
  const auto optimizers = at_key(loaded, "optimizer_states").toListRef();
  REQUIRE(optimizers.size() == 1);
  const auto params = at_key(optimizers[0], "params").toListRef();
  REQUIRE(params.size() == 2);
  CHECK(params[1].toInt() == 1);

  // Python reads ours, and writes one for us to read.
  const fs::path from_python = dir / "from_python.pt";
  const fs::path script = dir / "check.py";
  write_text(script, R"(
import sys, torch
d = torch.load(sys.argv[1], weights_only=True)
assert sorted(d.keys()) == sorted(["epoch", "global_step", "state_dict", "optimizer_states", "best_score", "name",
                                   "finished", "nothing", "history"]), sorted(d.keys())
assert d["epoch"] == 3 and d["global_step"] == 120 and d["best_score"] == 0.125 and d["name"] == "run-a"
assert d["finished"] is True and d["nothing"] is None and d["history"] == [1.5, 0.75]
sd = d["state_dict"]
assert sorted(sd.keys()) == ["layer.bias", "layer.weight"]
assert tuple(sd["layer.weight"].shape) == (2, 3) and sd["layer.weight"].dtype == torch.float32
assert torch.equal(sd["layer.weight"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
assert sd["layer.bias"].dtype == torch.bfloat16 and sd["layer.bias"].float().tolist() == [0.5, -1.5, 2.25]
assert d["optimizer_states"] == [{"lr": 0.01, "params": [0, 1]}], d["optimizer_states"]
torch.save({"step": 5, "weights": torch.full((2, 2), 7.0), "tags": ["a", "b"]}, sys.argv[2])
print("python-ok")
)");
  const auto [status, output] =
      run_command(fmt::format("{} {} {} {}", FULGUR_TEST_PYTHON, script.string(), path.string(), from_python.string()));
  INFO(output);
  REQUIRE(status == 0);
  CHECK(test::contains(output, "python-ok"));

  const c10::IValue python = read_checkpoint_file(from_python.string());
  CHECK(at_key(python, "step").toInt() == 5);
  CHECK(torch::equal(at_key(python, "weights").toTensor(), torch::full({2, 2}, 7.0)));
  CHECK(at_key(python, "tags").toListRef()[1].toStringRef() == "b");
}

TEST_CASE("checkpoint_io: a failed write keeps the previous file and leaves no temporary file") {
  TempDir dir;
  const fs::path path = dir / "last.ckpt";
  write_checkpoint_file(sample_checkpoint(), path.string());
  const std::string previous = read_bytes(path);

  auto big = string_dict();
  big.insert("weights", torch::ones({1 << 18}));  // 1 MiB of storage

  SUBCASE("the disk refuses the data (file size limit: works even as root)") {
    // RLIMIT_FSIZE makes write() fail with EFBIG past the limit, like a full disk would with ENOSPC.
    rlimit old_limit{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_limit) == 0);
    const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
    rlimit small = old_limit;
    small.rlim_cur = 64 * 1024;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    const Error e = error_from([&] { write_checkpoint_file(big, path.string()); });
    ::setrlimit(RLIMIT_FSIZE, &old_limit);
    std::signal(SIGXFSZ, old_handler);
    CHECK(e.kind() == ErrorKind::io);
    FULGUR_CHECK_CONTAINS(e.what(), path.string());
    FULGUR_CHECK_CONTAINS(e.what(), "File too large");
  }
  SUBCASE("the content cannot be serialized") {
    auto bad = string_dict();
    bad.insert("future", c10::IValue(c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get())));
    const Error e = error_from([&] { write_checkpoint_file(bad, path.string()); });
    CHECK(e.kind() == ErrorKind::checkpoint);
    FULGUR_CHECK_CONTAINS(e.what(), path.string());
  }
  SUBCASE("a directory is in the way of the rename") {
    const fs::path blocked = dir.subdir("blocked.ckpt");
    const Error e = error_from([&] { write_checkpoint_file(big, blocked.string()); });
    CHECK(e.kind() == ErrorKind::io);
    FULGUR_CHECK_CONTAINS(e.what(), blocked.string());
    CHECK(fs::is_directory(blocked));
  }
  SUBCASE("a file stands where the directory should be (fails as root too, unlike a read-only directory)") {
    write_text(dir / "not-a-directory", "a file");
    const fs::path inside = dir / "not-a-directory" / "last.ckpt";
    const Error e = error_from([&] { write_checkpoint_file(big, inside.string()); });
    CHECK(e.kind() == ErrorKind::io);
    FULGUR_CHECK_CONTAINS(e.what(), inside.string());
  }

  CHECK(read_bytes(path) == previous);
  CHECK(other_entries(dir.path(), {"last.ckpt", "blocked.ckpt", "not-a-directory"}).empty());
  CHECK(at_key(read_checkpoint_file(path.string()), "global_step").toInt() == 120);
}

TEST_CASE("checkpoint_io: a successful write removes temporaries that killed writers left, and only those") {
  TempDir dir;
  const fs::path path = dir / "last.ckpt";
  // A writer killed inside its write (pid far above any pid_max: that process does not exist), a
  // live writer (this process), and another target's temporary from the same dead writer.
  const std::string dead = ".last.ckpt.tmp-999999999-0-abc", alive = fmt::format(".last.ckpt.tmp-{}-7-def", ::getpid()),
                    other = ".best.ckpt.tmp-999999999-1-abc";
  for (const std::string& name : {dead, alive, other}) write_text(dir / name, "partial");
  write_checkpoint_file(sample_checkpoint(), path.string());
  CHECK_FALSE(fs::exists(dir / dead));
  CHECK(fs::exists(dir / alive));
  CHECK(fs::exists(dir / other));
  CHECK(at_key(read_checkpoint_file(path.string()), "global_step").toInt() == 120);
}

TEST_CASE("checkpoint_io: writing into a missing directory names it and creates nothing") {
  TempDir dir;
  const fs::path path = dir / "gone" / "last.ckpt";
  const Error e = error_from([&] { write_checkpoint_file(sample_checkpoint(), path.string()); });
  CHECK(e.kind() == ErrorKind::io);
  FULGUR_CHECK_CONTAINS(e.what(), path.string());
  FULGUR_CHECK_CONTAINS(e.what(), "does not exist");
  CHECK(!fs::exists(dir / "gone"));
}

TEST_CASE("checkpoint_io: a missing, empty, foreign, truncated or corrupt file is ErrorKind::checkpoint") {
  TempDir dir;
  const fs::path good = dir / "good.ckpt";
  write_checkpoint_file(sample_checkpoint(), good.string());
  const std::string bytes = read_bytes(good);
  const fs::path bad = dir / "bad.ckpt";

  auto read_error = [&](const fs::path& file) {
    try {
      read_checkpoint_file(file.string());
    } catch (const Error& e) {
      return e;
    } catch (const c10::Error& e) {
      FAIL("a raw c10::Error escaped: " << e.what_without_backtrace());
    }
    FAIL("no error for " << file.string());
    return Error(ErrorKind::runtime, "unreachable");
  };

  fs::path file = bad;
  std::string expected;
  SUBCASE("missing") {
    file = dir / "nope.ckpt";
    expected = "does not exist";
  }
  SUBCASE("empty") {
    write_text(bad, "");
    expected = "empty";
  }
  SUBCASE("not a zip archive") {
    write_text(bad, "epoch: 3\nglobal_step: 120\n");
    expected = "not a PyTorch zip archive";
  }
  SUBCASE("truncated") {
    write_text(bad, bytes.substr(0, bytes.size() / 2));
    expected = "truncated";
  }
  SUBCASE("last bytes cut off") {
    write_text(bad, bytes.substr(0, bytes.size() - 10));
    expected = "truncated";
  }
  SUBCASE("corrupt central directory") {
    std::string corrupt = bytes;
    REQUIRE(test::replace_all(corrupt, std::string_view("PK\x01\x02", 4), "XXXX") > 0);
    write_text(bad, corrupt);
    expected = "corrupt";
  }
  const Error e = read_error(file);
  CHECK(e.kind() == ErrorKind::checkpoint);
  FULGUR_CHECK_CONTAINS(e.what(), file.string());
  FULGUR_CHECK_CONTAINS(e.what(), expected);
}

TEST_CASE("checkpoint_io: atomic_write_text replaces the whole file") {
  TempDir dir;
  const fs::path path = dir / "notes.txt";
  atomic_write_text(path.string(), "first version, which is longer\n");
  atomic_write_text(path.string(), "second\n");
  CHECK(read_text(path) == "second\n");
  CHECK(other_entries(dir.path(), {"notes.txt"}).empty());
  const Error e = error_from([&] { atomic_write_text((dir / "missing" / "x.txt").string(), "x"); });
  CHECK(e.kind() == ErrorKind::io);
  FULGUR_CHECK_CONTAINS(e.what(), (dir / "missing" / "x.txt").string());
}

// ----------------------------------------------------------------------------------------------
// strategy `single_device` with precision `32-true`

TEST_CASE("single_device: one process, identity collectives, backward and step through the precision") {
  auto strategy = create<Strategy>(PluginKind::strategy, "single_device");
  auto precision = create<Precision>(PluginKind::precision, "32-true");

  StrategyEnvironment environment;
  environment.cluster.master_port = 12345;
  strategy->setup_environment(environment);
  CHECK((strategy->root_device() == c10::Device(c10::DeviceType::CPU)));
  CHECK(strategy->cluster().master_port == 12345);
  CHECK(strategy->is_global_zero());
  CHECK(strategy->data_parallel_rank() == 0);
  CHECK(strategy->data_parallel_size() == 1);

  const at::Tensor t = torch::tensor({1.0, 2.0});
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::mean, ReduceOp::max, ReduceOp::min})
    CHECK(strategy->reduce(t, op).is_same(t));
  const auto gathered = strategy->all_gather(t);
  REQUIRE(gathered.size() == 1);
  CHECK(gathered[0].is_same(t));
  at::Tensor b = t.clone();
  strategy->broadcast(b, 0);
  CHECK(torch::equal(b, t));
  CHECK(strategy->broadcast_string("x", 0) == "x");
  strategy->barrier("test");
  CHECK(strategy->reduce_boolean_decision(true, true));
  CHECK(!strategy->reduce_boolean_decision(false, false));

  torch::nn::Linear layer(3, 1);
  strategy->setup_module(*layer);
  CHECK((layer->weight.device() == c10::Device(c10::DeviceType::CPU)));
  auto sgd_owner = std::make_shared<torch::optim::SGD>(layer->parameters(), torch::optim::SGDOptions(0.1));
  std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers{sgd_owner};
  strategy->setup_optimizers(optimizers);
  REQUIRE(optimizers.size() == 1);
  CHECK(optimizers[0] == sgd_owner);  // a replicated strategy keeps the optimizers as they are
  torch::optim::SGD& sgd = *sgd_owner;

  const at::Tensor x = torch::tensor({{1.0f, 2.0f, 3.0f}});
  const at::Tensor before = layer->weight.detach().clone();
  at::Tensor loss;
  {
    PrecisionScope scope(*precision);
    loss = layer->forward(x).sum();
  }
  strategy->backward(loss, *precision, /*sync_gradients=*/true);
  CHECK(torch::allclose(layer->weight.grad(), x));
  CHECK(strategy->optimizer_step(sgd, *precision));
  CHECK(torch::allclose(layer->weight.detach(), before - 0.1 * x));
  strategy->teardown();
}

TEST_CASE("single_device: more than one device is a config error") {
  auto strategy = create<Strategy>(PluginKind::strategy, "single_device");
  StrategyEnvironment environment;
  environment.devices = {c10::Device(c10::DeviceType::CPU), c10::Device(c10::DeviceType::CPU)};
  const Error e = error_from([&] { strategy->setup_environment(environment); });
  CHECK(e.kind() == ErrorKind::config);
  FULGUR_CHECK_CONTAINS(e.what(), "single_device");
}

TEST_CASE("single_device: checkpoints go through write/read_checkpoint_file, creating the directory") {
  TempDir dir;
  auto strategy = create<Strategy>(PluginKind::strategy, "single_device");
  strategy->setup_environment({});
  const fs::path path = dir / "checkpoints" / "epoch=0.ckpt";
  // The parts as the Trainer hands them over: model state, optimizer states, the other keys.
  c10::impl::GenericDict whole = sample_checkpoint();
  c10::IValue model_state = whole.at("state_dict");
  std::vector<c10::IValue> optimizer_states;
  REQUIRE(whole.erase("state_dict") == 1);
  REQUIRE(whole.erase("optimizer_states") == 1);
  c10::IValue metadata(whole);
  strategy->save_checkpoint(CheckpointParts{&model_state, &optimizer_states, &metadata}, path.string());
  CHECK(strategy->is_checkpoint(path.string()));
  // One Lightning-layout file on disk.
  const c10::IValue on_disk = read_checkpoint_file(path.string());
  CHECK(at_key(on_disk, "global_step").toInt() == 120);
  CHECK(on_disk.toGenericDict().contains("state_dict"));
  c10::IValue model_back, metadata_back;
  std::vector<c10::IValue> optimizers_back;
  strategy->load_checkpoint(path.string(), CheckpointParts{&model_back, &optimizers_back, &metadata_back});
  CHECK(at_key(metadata_back, "global_step").toInt() == 120);
  CHECK(model_back.isGenericDict());
  const Error e = error_from([&] {
    c10::IValue m, d;
    std::vector<c10::IValue> o;
    strategy->load_checkpoint((dir / "none.ckpt").string(), CheckpointParts{&m, &o, &d});
  });
  CHECK(e.kind() == ErrorKind::checkpoint);
}

// ----------------------------------------------------------------------------------------------
// precision `32-true`

// Two layers and a frozen one (no gradient); gradients made large enough to be clipped.
struct ClipFixture {
  int seeded = (torch::manual_seed(0), 0);  // before the layers: both fixtures get the same weights
  torch::nn::Linear a{4, 3}, b{3, 2}, frozen{2, 2};
  ClipFixture() {
    const at::Tensor x = torch::randn({5, 4});
    (b->forward(a->forward(x)) * 100).sum().backward();
  }
  std::vector<at::Tensor> params() const {
    auto p = a->parameters();
    auto q = b->parameters();
    p.insert(p.end(), q.begin(), q.end());
    auto f = frozen->parameters();
    p.insert(p.end(), f.begin(), f.end());
    return p;
  }
  std::vector<at::Tensor> grads_copy() const {
    std::vector<at::Tensor> out;
    for (const auto& p : params()) out.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    return out;
  }
};

TEST_CASE("32-true: clip_gradients equals torch's clip_grad_norm_ / clip_grad_value_ on the same gradients") {
  auto precision = create<Precision>(PluginKind::precision, "32-true");
  ClipFixture plugin_side;
  ClipFixture torch_side;
  REQUIRE(torch::equal(plugin_side.params()[0].grad(), torch_side.params()[0].grad()));
  torch::optim::SGD sgd(plugin_side.params(), torch::optim::SGDOptions(0.1));

  SUBCASE("by norm") {
    precision->clip_gradients(sgd, 0.5, GradClipAlgorithm::norm);
    std::vector<at::Tensor> with_grad;
    for (const auto& p : torch_side.params())
      if (p.grad().defined()) with_grad.push_back(p);
    const double norm_before = torch::nn::utils::clip_grad_norm_(with_grad, 0.5);
    CHECK(norm_before > 0.5);  // clipping really happened
  }
  SUBCASE("by value") {
    precision->clip_gradients(sgd, 0.25, GradClipAlgorithm::value);
    torch::nn::utils::clip_grad_value_(torch_side.params(), 0.25);
    CHECK(plugin_side.params()[0].grad().abs().max().item<double>() <= 0.25);
  }
  SUBCASE("zero means no clipping") {
    const auto before = plugin_side.grads_copy();
    precision->clip_gradients(sgd, 0.0, GradClipAlgorithm::norm);
    const auto params = plugin_side.params();
    for (size_t i = 0; i < 4; ++i) CHECK(torch::equal(params[i].grad(), before[i]));
    return;
  }

  const auto mine = plugin_side.params();
  const auto reference = torch_side.params();
  for (size_t i = 0; i < mine.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(mine[i].grad().defined() == reference[i].grad().defined());
    if (mine[i].grad().defined()) CHECK(torch::allclose(mine[i].grad(), reference[i].grad(), 1e-6, 1e-8));
  }
  CHECK(!mine[4].grad().defined());  // the frozen layer stayed without gradient
}

TEST_CASE("32-true: identity scaling, plain optimizer step, empty state") {
  auto precision = create<Precision>(PluginKind::precision, "32-true");
  const at::Tensor loss = torch::tensor(2.5);
  CHECK(precision->scale_loss(loss).is_same(loss));
  Batch batch{torch::ones({2, 2}, torch::kFloat64), torch::ones({2})};
  precision->convert_input(batch);
  CHECK((batch.input.scalar_type() == torch::kFloat64));  // 32-true converts nothing

  torch::nn::Linear layer(2, 1);
  torch::optim::SGD sgd(layer->parameters(), torch::optim::SGDOptions(1.0));
  layer->forward(torch::ones({1, 2})).sum().backward();
  const at::Tensor before = layer->weight.detach().clone();
  precision->unscale_gradients(sgd);
  CHECK(precision->optimizer_step(sgd));
  CHECK(torch::allclose(layer->weight.detach(), before - 1.0));

  c10::IValue state;
  precision->state_dict(state);
  REQUIRE(state.isGenericDict());
  CHECK(state.toGenericDict().empty());
  precision->load_state_dict(state);
  precision->load_state_dict(c10::IValue());
  auto scaler = string_dict();
  scaler.insert("scale", 65536.0);
  precision->load_state_dict(scaler);  // another plugin's state: ignored with a warning
  const Error e = error_from([&] { precision->load_state_dict(c10::IValue(int64_t{3})); });
  CHECK(e.kind() == ErrorKind::checkpoint);
}

// ----------------------------------------------------------------------------------------------
// logger `csv`

TEST_CASE("csv: Lightning's layout, sorted header with step, buffered rows, rewrite on a new key") {
  TempDir dir;
  auto logger = create<Logger>(PluginKind::logger, "csv");
  logger->setup({dir.path().string(), 0});
  const fs::path version_dir = dir / "lightning_logs" / "version_0";
  CHECK(logger->log_dir() == version_dir.string());
  CHECK(fs::is_directory(version_dir));
  const fs::path metrics = version_dir / "metrics.csv";

  logger->log_metrics({{"train_loss", 0.5}}, 0);
  logger->log_metrics({{"train_loss", 0.25}, {"acc", 0.75}}, 1);
  CHECK(!fs::exists(metrics));  // buffered: flush_logs_every_n_steps = 100
  logger->save();
  CHECK(read_text(metrics) ==
        "acc,step,train_loss\n"
        ",0,0.5\n"
        "0.75,1,0.25\n");

  // A new key widens the header; earlier rows get empty cells for it.
  logger->log_metrics({{"val_loss", 1.5}, {"epoch", 0}}, 2);
  logger->save();
  CHECK(read_text(metrics) ==
        "acc,epoch,step,train_loss,val_loss\n"
        ",,0,0.5,\n"
        "0.75,,1,0.25,\n"
        ",0,2,,1.5\n");

  // Known keys only: appended under the existing header.
  logger->log_metrics({{"train_loss", 0.125}, {"step", 99}}, 3);  // a metric named "step" yields to `step`
  logger->finalize(RunStatus::success);
  CHECK(read_text(metrics) ==
        "acc,epoch,step,train_loss,val_loss\n"
        ",,0,0.5,\n"
        "0.75,,1,0.25,\n"
        ",0,2,,1.5\n"
        ",,3,0.125,\n");
  CHECK(other_entries(version_dir, {"metrics.csv"}).empty());

  // The next logger in the same place takes the next version.
  auto second = create<Logger>(PluginKind::logger, "csv");
  second->setup({dir.path().string(), 0});
  CHECK(second->log_dir() == (dir / "lightning_logs" / "version_1").string());
}

TEST_CASE("csv: rows reach the disk every flush_logs_every_n_steps steps") {
  TempDir dir;
  auto logger = create<Logger>(PluginKind::logger, "csv",
                               {{"flush_logs_every_n_steps", int64_t{2}},
                                {"name", std::string("exp")},
                                {"version", int64_t{7}},
                                {"prefix", std::string("train")}});
  logger->setup({dir.path().string(), 0});
  const fs::path metrics = dir / "exp" / "version_7" / "metrics.csv";
  logger->log_metrics({{"loss", 1.0}}, 0);
  CHECK(!fs::exists(metrics));
  logger->log_metrics({{"loss", 0.5}}, 1);  // (step + 1) % 2 == 0, as Lightning's CSVLogger
  CHECK(read_text(metrics) == "step,train-loss\n0,1\n1,0.5\n");
}

TEST_CASE("csv: hparams.yaml holds one 'key: value' line per model, data or untabled hyperparameter") {
  TempDir dir;
  auto logger = create<Logger>(PluginKind::logger, "csv", {{"save_dir", (dir / "logs").string()}});
  logger->setup({"/nonexistent-default-root", 0});  // save_dir wins over the Trainer's root_dir
  logger->log_hyperparams({{"model.lr", "0.001"}, {"optimizer", "\"adamw\""}, {"model.layers", "[64, 32]"}});
  logger->log_hyperparams({{"trainer.max_epochs", "3"}, {"model.eps", "inf"}, {"data.batch_size", "8"}});
  CHECK(read_text(dir / "logs" / "lightning_logs" / "version_0" / "hparams.yaml") ==
        "data.batch_size: 8\n"
        "model.eps: .inf\n"
        "model.layers: [64, 32]\n"
        "model.lr: 0.001\n"
        "optimizer: \"adamw\"\n");  // #42.10: the trainer's keys are not the module's hyperparameters
}

TEST_CASE("csv: a log directory that cannot be written fails at setup, naming it") {
  TempDir dir;
  write_text(dir / "a-file", "not a directory");
  const fs::path save_dir = dir / "a-file" / "logs";
  auto logger = create<Logger>(PluginKind::logger, "csv", {{"save_dir", save_dir.string()}});
  const Error e = error_from([&] { logger->setup({dir.path().string(), 0}); });
  CHECK(e.kind() == ErrorKind::io);
  FULGUR_CHECK_CONTAINS(e.what(), (save_dir / "lightning_logs" / "version_0").string());

  // A run directory that exists as a file: refused at setup (as root too; chmod would not be).
  const fs::path taken = dir.subdir("taken");
  fs::create_directories(taken / "lightning_logs");
  write_text(taken / "lightning_logs" / "version_0", "a file, not a run directory");
  auto second = create<Logger>(PluginKind::logger, "csv", {{"save_dir", taken.string()}, {"version", int64_t{0}}});
  const Error refused = error_from([&] { second->setup({dir.path().string(), 0}); });
  CHECK(refused.kind() == ErrorKind::io);
  FULGUR_CHECK_CONTAINS(refused.what(), (taken / "lightning_logs" / "version_0").string());
}

TEST_CASE("csv: only global rank zero writes") {
  TempDir dir;
  auto logger = create<Logger>(PluginKind::logger, "csv");
  logger->setup({dir.path().string(), 1});
  CHECK(logger->log_dir() == (dir / "lightning_logs" / "version_0").string());
  logger->log_hyperparams({{"lr", "0.1"}});
  logger->log_metrics({{"loss", 1.0}}, 0);
  logger->finalize(RunStatus::success);
  CHECK(!fs::exists(dir / "lightning_logs"));
}

// ----------------------------------------------------------------------------------------------
// profiler `simple`

// The cells of the report row whose first cell is `action`.
std::vector<std::string> report_row(const std::string& report, const std::string& action) {
  std::istringstream lines(report);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '|') continue;
    std::vector<std::string> cells;
    std::istringstream parts(line.substr(1));
    for (std::string cell; std::getline(parts, cell, '|');) {
      const size_t first = cell.find_first_not_of(' ');
      const size_t last = cell.find_last_not_of(' ');
      cells.push_back(first == std::string::npos ? "" : cell.substr(first, last - first + 1));
    }
    if (!cells.empty() && cells[0] == action) return cells;
  }
  FAIL("no row for '" << action << "' in\n" << report);
  return {};
}

TEST_CASE("simple: counts, totals and shares per action, nested and repeated") {
  TempDir dir;
  auto profiler = create<Profiler>(PluginKind::profiler, "simple", {{"filename", std::string("perf")}});
  profiler->setup(Stage::fit, dir.path().string(), 0);
  for (int i = 0; i < 3; ++i) {
    ProfileScope outer(profiler.get(), "run_training_batch");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    {
      ProfileScope inner(profiler.get(), "optimizer_step");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    // Same text at another address: the same action.
    const std::string copy = "optimizer_step";
    profiler->start(copy);
    profiler->stop(copy);
  }
  profiler->teardown(Stage::fit);
  const std::string report = profiler->summary();
  INFO(report);
  CHECK(test::contains(report, "FIT Profiler Report"));
  const auto header = report_row(report, "Action");
  CHECK(header ==
        std::vector<std::string>{"Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %"});

  const auto batch = report_row(report, "run_training_batch");
  const auto step = report_row(report, "optimizer_step");
  const auto total = report_row(report, "Total");
  CHECK(batch[2] == "3");
  CHECK(step[2] == "6");
  CHECK(total[2] == "9");
  CHECK(std::stod(batch[3]) >= 0.009);  // 3 x (2 ms + 1 ms) at least
  CHECK(std::stod(step[3]) >= 0.003);
  CHECK(std::stod(batch[3]) >= std::stod(step[3]));
  CHECK(std::stod(batch[1]) == doctest::Approx(std::stod(batch[3]) / 3).epsilon(1e-3));
  CHECK(std::stod(total[3]) >= std::stod(batch[3]));
  CHECK(std::stod(batch[4]) <= 100.0);
  CHECK(std::stod(batch[4]) == doctest::Approx(100 * std::stod(batch[3]) / std::stod(total[3])).epsilon(1e-3));
  CHECK(report.find("run_training_batch") < report.find("optimizer_step"));  // sorted by total time

  CHECK(read_text(dir / "fit-perf.txt") == report);
  CHECK(other_entries(dir.path(), {"fit-perf.txt"}).empty());

  // A new stage starts from zero.
  profiler->setup(Stage::validate, dir.path().string(), 0);
  profiler->start("validation_step");
  profiler->stop("validation_step");
  const std::string validate = profiler->summary();
  CHECK(report_row(validate, "Total")[2] == "1");
  CHECK(!test::contains(validate, "run_training_batch"));
}

TEST_CASE("simple: misuse of start/stop") {
  auto profiler = create<Profiler>(PluginKind::profiler, "simple", {{"extended", false}});
  profiler->setup(Stage::fit, "", 0);
  profiler->stop("never_started");  // a warning, never an exception (stop runs in destructors)
  profiler->start("twice");
  const Error e = error_from([&] { profiler->start("twice"); });
  CHECK(e.kind() == ErrorKind::runtime);
  profiler->stop("twice");
  const std::string report = profiler->summary();
  CHECK(report_row(report, "Action") == std::vector<std::string>{"Action", "Mean duration (s)", "Total time (s)"});
  CHECK(report_row(report, "twice").size() == 3);
}

}  // namespace
}  // namespace fulgur

// The testing kit's conformance checks (fulgur/testing/plugin_kit.h), which third parties run on
// their plugins, pass for every built-in callback, logger and strategy.
TEST_CASE("every built-in plugin passes the testing kit's conformance checks for its kind") {
  namespace kit = fulgur::testing;
  const std::vector<std::pair<std::string, std::vector<std::pair<std::string, fulgur::OptionValue>>>> callbacks = {
      {"model_checkpoint", {}},
      {"early_stopping", {{"monitor", std::string("val/loss")}, {"patience", int64_t{100}}}},
      {"progress_bar", {}},
      {"model_summary", {}},
      {"lr_monitor", {}},
      {"timer", {{"duration", std::string("00:01:00:00")}}},
      {"throughput_monitor", {}},
      {"device_stats", {}},
      {"ema", {}},
      {"swa", {{"swa_lrs", std::vector<double>{0.05}}}},
      {"backbone_finetuning", {{"backbone", std::string("layer")}, {"unfreeze_backbone_at_epoch", int64_t{0}}}},
      {"freeze_schedule", {{"schedule", std::vector<std::string>{"0:freeze:layer.bias", "1:unfreeze:layer.*"}}}},
      {"gradient_accumulation_scheduler", {{"scheduling", std::vector<std::string>{"2:2"}}}},  // after the 2 epochs
      {"spike_detection", {{"action", std::string("warn")}}},
      {"prediction_writer", {}},
      {"model_pruning", {}},
      {"model_pruning",
       {{"pruning_fn", std::string("ln_structured")}, {"pruning_norm", 2.0}, {"use_global_unstructured", false}}},
      {"lr_finder", {{"num_training_steps", int64_t{4}}, {"skip_begin", int64_t{1}}, {"skip_end", int64_t{1}}}}};
  for (const auto& [name, overrides] : callbacks) {
    INFO("callback " << name);
    CHECK_NOTHROW(kit::check_callback_conformance(
        kit::create_plugin<fulgur::Callback>(fulgur::PluginKind::callback, name, overrides)));
  }
  for (const char* name : {"csv", "tensorboard"}) {
    INFO("logger " << name);
    CHECK_NOTHROW(kit::check_logger_conformance(kit::create_plugin<fulgur::Logger>(fulgur::PluginKind::logger, name)));
  }
  for (const char* name : {"single_device", "ddp", "fsdp", "model_parallel"}) {
    INFO("strategy " << name);
    CHECK_NOTHROW(
        kit::check_strategy_conformance(kit::create_plugin<fulgur::Strategy>(fulgur::PluginKind::strategy, name)));
  }
  {
    INFO("accelerator cpu");
    CHECK_NOTHROW(kit::check_accelerator_conformance(
        kit::create_plugin<fulgur::Accelerator>(fulgur::PluginKind::accelerator, "cpu")));
  }
  for (const char* name : {"32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"}) {
    INFO("precision " << name);
    CHECK_NOTHROW(
        kit::check_precision_conformance(kit::create_plugin<fulgur::Precision>(fulgur::PluginKind::precision, name)));
  }
  for (const char* name : {"simple", "pytorch"}) {
    INFO("profiler " << name);
    CHECK_NOTHROW(
        kit::check_profiler_conformance(kit::create_plugin<fulgur::Profiler>(fulgur::PluginKind::profiler, name)));
  }
  // The checks can fail: a callback that stops the run early is caught.
  struct StopsAtOnce : fulgur::CallbackBase<StopsAtOnce> {
    void on_train_start(fulgur::TrainerContext& trainer) override { trainer.request_stop("at once"); }
  };
  CHECK_THROWS_WITH_AS(kit::check_callback_conformance(std::make_shared<StopsAtOnce>()),
                       doctest::Contains("conformance:"), std::runtime_error);
}

TEST_CASE("fsdp: overlap_reduce and reduce_bucket_mb: bad bucket sizes and options off their stage are refused") {
  using fulgur::OptionValue;
  auto make = [](const std::map<std::string, OptionValue>& options) {
    return fulgur::create<fulgur::Strategy>(fulgur::PluginKind::strategy, "fsdp", options);
  };
  for (const double bad :
       {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(), 2e6}) {
    CAPTURE(bad);
    const fulgur::Error error = fulgur::test::error_from([&] { make({{"reduce_bucket_mb", OptionValue(bad)}}); });
    FULGUR_CHECK_CONTAINS(error.what(), "strategy 'fsdp': reduce_bucket_mb = ");
    FULGUR_CHECK_CONTAINS(error.what(), "must be a number of MiB above 0");
  }
  const fulgur::Error stage3 = fulgur::test::error_from([&] {
    make({{"zero_stage", OptionValue(int64_t{3})}, {"reduce_bucket_mb", OptionValue(4.0)}});
  });
  FULGUR_CHECK_CONTAINS(stage3.what(), "reduce_bucket_mb = 4 applies to zero_stage = 1 and 2");
  const fulgur::Error blocking = fulgur::test::error_from([&] {
    make({{"overlap_reduce", OptionValue(false)}, {"reduce_bucket_mb", OptionValue(4.0)}});
  });
  FULGUR_CHECK_CONTAINS(blocking.what(), "applies with overlap_reduce = true only");
  const fulgur::Error typed = fulgur::test::error_from([&] {
    make({{"overlap_reduce", OptionValue(std::string("yes"))}});
  });
  FULGUR_CHECK_CONTAINS(typed.what(), "overlap_reduce");
  CHECK_NOTHROW(make({{"zero_stage", OptionValue(int64_t{1})}, {"reduce_bucket_mb", OptionValue(0.5)}}));
  CHECK_NOTHROW(make({{"reduce_bucket_mb", OptionValue(4.0)}}));
  CHECK_NOTHROW(make({{"zero_stage", OptionValue(int64_t{3})}, {"overlap_reduce", OptionValue(false)}}));
}

TEST_CASE("fsdp: stages that do not exist, and reshard_after_forward off a sharded-parameter stage, are refused") {
  const fulgur::Error seven = fulgur::test::error_from([&] {
    fulgur::create<fulgur::Strategy>(fulgur::PluginKind::strategy, "fsdp",
                                     {{"zero_stage", fulgur::OptionValue(int64_t{7})}});
  });
  FULGUR_CHECK_CONTAINS(seven.what(), "zero_stage = 7 is not a ZeRO stage");
  FULGUR_CHECK_CONTAINS(seven.what(), "3 (and parameters)");
  const fulgur::Error reshard = fulgur::test::error_from([&] {
    fulgur::create<fulgur::Strategy>(
        fulgur::PluginKind::strategy, "fsdp",
        {{"zero_stage", fulgur::OptionValue(int64_t{2})}, {"reshard_after_forward", fulgur::OptionValue(false)}});
  });
  FULGUR_CHECK_CONTAINS(reshard.what(), "reshard_after_forward = false applies to zero_stage = 3");
  CHECK_NOTHROW(fulgur::create<fulgur::Strategy>(
      fulgur::PluginKind::strategy, "fsdp",
      {{"zero_stage", fulgur::OptionValue(int64_t{3})}, {"reshard_after_forward", fulgur::OptionValue(false)}}));
}
