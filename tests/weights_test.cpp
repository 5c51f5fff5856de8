// fulgur/weights.h against the real Python tools: files written by torch.save, a Lightning Trainer
// and the safetensors package are loaded and must reproduce Python's outputs; files Fulgur writes
// are read back by safetensors and compared byte for byte with what it writes itself; corrupt files
// fail with the file and the problem named; the `fulgur weights` command runs in a real process.
#include <fulgur/checkpoint_io.h>
#include <fulgur/error.h>
#include <fulgur/module.h>
#include <fulgur/weights.h>

#include <torch/torch.h>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cstdio>
#include <fstream>

#include "test_support.h"

namespace {

using fulgur::test::contains;
using fulgur::test::error_from;
using fulgur::test::TempDir;
namespace fs = std::filesystem;

// The Python side's network, under "net." as a Lightning module holding `self.net` names it.
struct Net : fulgur::Module {
  Net() {
    net = register_module("net", torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(),
                                                       torch::nn::BatchNorm1d(8), torch::nn::Linear(8, 3)));
  }
  fulgur::StepOutput training_step(const fulgur::Batch&, int64_t) override { return {}; }
  std::vector<fulgur::OptimizerConfig> configure_optimizers() override { return {}; }
  torch::nn::Sequential net{nullptr};
};

std::pair<int, std::string> run_python(const TempDir& dir, const std::string& script, const std::string& args) {
  const fs::path file = dir / "script.py";
  std::ofstream(file) << script;
  return fulgur::test::run_command(fmt::format("{} {} {}", FULGUR_TEST_PYTHON, file.string(), args));
}

void require_python_ok(const std::pair<int, std::string>& run) {
  INFO(run.second);
  REQUIRE(run.first == 0);
  REQUIRE(contains(run.second, "python-ok"));
}

at::Tensor entry(const c10::IValue& dict, const char* key) {
  return dict.toGenericDict().at(c10::IValue(std::string(key))).toTensor();
}

at::Tensor forward(Net& net, const at::Tensor& x) {
  net.eval();
  torch::NoGradGuard no_grad;
  return net.net->forward(x);
}

// Python writes the same weights three ways, plus a Lightning checkpoint after one training step,
// and the outputs of both models on one input.
constexpr const char* kPythonWriter = R"(
import sys, torch
import lightning as L
from safetensors.torch import save_file
d = sys.argv[1]
torch.manual_seed(0)
def make():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
net = make()
with torch.no_grad():
    net[2].running_mean.uniform_(-1, 1); net[2].running_var.uniform_(0.5, 2.0)
    net[2].weight.uniform_(0.5, 1.5); net[2].bias.uniform_(-1, 1); net[2].num_batches_tracked.fill_(7)
net.eval()
x = torch.randn(5, 4)
torch.save(net.state_dict(), f"{d}/plain.pt")
save_file({"model." + k: v for k, v in net.state_dict().items()}, f"{d}/model.safetensors", metadata={"format": "pt"})

class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make()
    def training_step(self, batch, i):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
lit = Lit()
data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,)))
trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=d)
trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=4))
trainer.save_checkpoint(f"{d}/lit.ckpt")
lit.eval()
with torch.no_grad():
    torch.save({"x": x, "y": net(x), "y_lit": lit.net(x)}, f"{d}/io.pt")
print("python-ok")
)";

}  // namespace

TEST_CASE("weights: torch.save, Lightning .ckpt and safetensors files from Python reproduce Python's outputs") {
  // Once per test case, not once per subcase (doctest runs the body again for each SUBCASE).
  static TempDir dir;
  static const bool written = [] {
    require_python_ok(run_python(dir, kPythonWriter, dir.path().string()));
    return true;
  }();
  REQUIRE(written);
  const c10::IValue io = fulgur::read_checkpoint_file((dir / "io.pt").string());
  const at::Tensor x = entry(io, "x");

  SUBCASE("a torch.save state dict, keys prefixed on the way in") {
    Net net;
    const auto report =
        fulgur::load_weights(net, (dir / "plain.pt").string(), fulgur::LoadWeightsOptions().add_prefix("net."));
    CHECK(report.complete());
    CHECK(report.loaded == static_cast<int64_t>(fulgur::named_tensors(net).size()));
    CHECK(torch::allclose(forward(net, x), entry(io, "y"), /*rtol=*/0, /*atol=*/1e-6));
    CHECK(net.net->named_buffers()["2.num_batches_tracked"].item<int64_t>() == 7);
  }
  SUBCASE("a safetensors file, one prefix stripped and another added") {
    Net net;
    std::map<std::string, std::string> metadata;
    CHECK(fulgur::read_safetensors((dir / "model.safetensors").string(), &metadata).size() == 9);
    CHECK(metadata == std::map<std::string, std::string>{{"format", "pt"}});
    const auto report = fulgur::load_weights(net, (dir / "model.safetensors").string(),
                                             fulgur::LoadWeightsOptions().strip_prefix("model.").add_prefix("net."));
    CHECK(report.complete());
    CHECK(torch::allclose(forward(net, x), entry(io, "y"), 0, 1e-6));
  }
  SUBCASE("a checkpoint written by a Lightning Trainer (its state_dict entry)") {
    Net net;
    const auto report = fulgur::load_weights(net, (dir / "lit.ckpt").string());
    CHECK(report.complete());
    CHECK(torch::allclose(forward(net, x), entry(io, "y_lit"), 0, 1e-6));
    CHECK_FALSE(torch::allclose(forward(net, x), entry(io, "y"), 0, 1e-3));  // it trained one step
  }
  SUBCASE("strict: a prefix mismatch names every key, the file and the fix") {
    Net net;
    const auto before = fulgur::named_tensors(net).at("net.0.weight").clone();
    const fulgur::Error e = error_from([&] { fulgur::load_weights(net, (dir / "plain.pt").string()); });
    CHECK(e.kind() == fulgur::ErrorKind::checkpoint);
    const std::string m = e.what();
    FULGUR_CHECK_CONTAINS(m, (dir / "plain.pt").string());
    FULGUR_CHECK_CONTAINS(m, "missing keys: net.0.bias, net.0.weight");
    FULGUR_CHECK_CONTAINS(m, "unexpected keys: 0.bias, 0.weight");
    FULGUR_CHECK_CONTAINS(m, "add_prefix(\"net.\")");
    CHECK(torch::equal(fulgur::named_tensors(net).at("net.0.weight"), before));  // nothing loaded
  }
  SUBCASE("not strict, with a mapping function that drops the last layer") {
    Net net;
    const auto head = fulgur::named_tensors(net).at("net.3.weight").clone();
    const auto report = fulgur::load_weights(
        net, (dir / "plain.pt").string(),
        fulgur::LoadWeightsOptions().strict(false).map_keys([](const std::string& k) -> std::optional<std::string> {
          if (k.starts_with("3.")) return std::nullopt;
          return "net." + k;
        }));
    CHECK(report.dropped == std::vector<std::string>{"3.bias", "3.weight"});
    CHECK(report.missing == std::vector<std::string>{"net.3.bias", "net.3.weight"});
    CHECK(report.unexpected.empty());
    CHECK(report.loaded == 7);
    CHECK(torch::equal(fulgur::named_tensors(net).at("net.3.weight"), head));
    FULGUR_CHECK_CONTAINS(report.to_string(), "missing keys: net.3.bias, net.3.weight");
    // Strict, the same mapping is refused and says why.
    const fulgur::Error e = error_from([&] {
      fulgur::load_weights(
          net, (dir / "plain.pt").string(),
          fulgur::LoadWeightsOptions().map_keys([](const std::string& k) -> std::optional<std::string> {
            if (k.starts_with("3.")) return std::nullopt;
            return "net." + k;
          }));
    });
    FULGUR_CHECK_CONTAINS(e.what(), "missing keys: net.3.bias, net.3.weight");
  }
}

TEST_CASE("weights: shape mismatches are reported, refused by default and skipped on request") {
  Net net;
  fulgur::TensorMap tensors = fulgur::named_tensors(net);
  for (auto& [k, t] : tensors) t = torch::full_like(t, 0.5);
  tensors["net.0.weight"] = torch::zeros({2, 2});
  tensors["net.extra"] = torch::zeros({1});
  const fulgur::Error e =
      error_from([&] { fulgur::load_weights(net, tensors, fulgur::LoadWeightsOptions().strict(false), "memory"); });
  FULGUR_CHECK_CONTAINS(e.what(), "shape mismatches: net.0.weight (file [2, 2], module [8, 4])");
  CHECK_FALSE(contains(e.what(), "net.extra"));  // not strict: unexpected keys are not an error
  const auto report =
      fulgur::load_weights(net, tensors, fulgur::LoadWeightsOptions().strict(false).skip_mismatched(true), "memory");
  REQUIRE(report.mismatched.size() == 1);
  CHECK(report.mismatched[0].file_shape == std::vector<int64_t>{2, 2});
  CHECK(report.unexpected == std::vector<std::string>{"net.extra"});
  CHECK(torch::equal(fulgur::named_tensors(net).at("net.0.bias"), torch::full({8}, 0.5)));
  CHECK_FALSE(torch::equal(fulgur::named_tensors(net).at("net.0.weight"), torch::full({8, 4}, 0.5)));
}

TEST_CASE("weights: safetensors files Fulgur writes are read by Python's safetensors, byte for byte its layout") {
  TempDir dir;
  fulgur::TensorMap tensors{
      {"w.f32", torch::arange(6, torch::kFloat32).reshape({2, 3})},
      {"a.f64", torch::tensor({1.5, -2.25, 1e300}, torch::kFloat64)},
      {"b.bf16", torch::tensor({0.5, -1.5, 3.0, 7.0}).to(torch::kBFloat16).reshape({2, 2})},
      {"h.f16", torch::tensor({0.25, 65504.0}).to(torch::kHalf)},
      {"i.i64", torch::tensor({int64_t{1} << 40, int64_t{-3}})},
      {"i.i32", torch::tensor({7, -8, 9}, torch::kInt32)},
      {"i.i16", torch::tensor({-300, 300}, torch::kInt16)},
      {"i.i8", torch::tensor({-5, 5}, torch::kInt8)},
      {"i.u8", torch::tensor({250, 3}, torch::kUInt8)},
      {"mask", torch::tensor({true, false, true})},
      {"scalar", torch::scalar_tensor(3.5)},
      {"empty", torch::zeros({0, 3})},
      {"strided", torch::arange(12, torch::kFloat32).reshape({3, 4}).t()},  // not contiguous
  };
  const fs::path ours = dir / "fulgur.safetensors";
  fulgur::save_safetensors(tensors, ours.string(), {{"format", "pt"}});
  fulgur::save_weights(tensors, (dir / "reference.pt").string());

  // Fulgur reads its own file back exactly.
  std::map<std::string, std::string> metadata;
  const auto back = fulgur::read_safetensors(ours.string(), &metadata);
  CHECK(metadata.at("format") == "pt");
  REQUIRE(back.size() == tensors.size());
  for (const auto& [k, t] : tensors) {
    INFO(k);
    CHECK((back.at(k).scalar_type() == t.scalar_type()));
    CHECK(torch::equal(back.at(k), t));
  }

  require_python_ok(run_python(
      dir, R"(
import sys, torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
ours, ref_pt, theirs = sys.argv[1:4]
loaded = load_file(ours)
ref = torch.load(ref_pt, weights_only=True)
assert sorted(loaded) == sorted(ref), (sorted(loaded), sorted(ref))
for k, v in ref.items():
    assert loaded[k].dtype == v.dtype, (k, loaded[k].dtype, v.dtype)
    assert loaded[k].shape == v.shape, (k, loaded[k].shape, v.shape)
    assert torch.equal(loaded[k], v), k
with safe_open(ours, framework="pt") as f:
    assert f.metadata() == {"format": "pt"}, f.metadata()
save_file({k: v.contiguous() for k, v in ref.items()}, theirs, metadata={"format": "pt"})
a, b = open(ours, "rb").read(), open(theirs, "rb").read()
assert a == b, (a[:300], b[:300])
print("python-ok")
)",
      fmt::format("{} {} {}", ours.string(), (dir / "reference.pt").string(), (dir / "python.safetensors").string())));
}

namespace {

// A safetensors file from a header text and a data section, for the corruption cases.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  const uint64_t n = header.size();
  std::string bytes(reinterpret_cast<const char*>(&n), 8);
  return bytes + header + data;
}

}  // namespace

TEST_CASE("weights: truncated or corrupt safetensors files fail with the file and the problem named") {
  TempDir dir;
  const fs::path path = dir / "bad.safetensors";
  fulgur::save_safetensors({{"t", torch::ones({2, 3})}}, path.string());
  const std::string valid = fulgur::test::read_bytes(path);

  auto expect = [&](const std::string& bytes, const std::string& part) {
    fulgur::test::write_bytes(path, bytes);
    const fulgur::Error e = error_from([&] { fulgur::read_safetensors(path.string()); });
    CHECK(e.kind() == fulgur::ErrorKind::checkpoint);
    FULGUR_CHECK_CONTAINS(e.what(), path.string());
    FULGUR_CHECK_CONTAINS(e.what(), part);
    // Every entry point gives the same answer.
    Net net;
    const fulgur::Error via_load = error_from([&] { fulgur::load_weights(net, path.string()); });
    CHECK(std::string(via_load.what()) == std::string(e.what()));
  };
  const std::string four_floats(16, '\0');

  SUBCASE("shorter than the length field") { expect(valid.substr(0, 5), "shorter than the 8-byte header length"); }
  SUBCASE("truncated inside the header") { expect(valid.substr(0, 20), "(truncated?)"); }
  SUBCASE("truncated inside the data") { expect(valid.substr(0, valid.size() - 4), "but the file holds 20"); }
  SUBCASE("trailing bytes") { expect(valid + "xx", "more than its tensors use"); }
  SUBCASE("absurd header length") {
    std::string bytes = valid;
    const uint64_t huge = ~uint64_t{0};
    bytes.replace(0, 8, reinterpret_cast<const char*>(&huge), 8);
    expect(bytes, "more than the 100000000 the format allows");
  }
  SUBCASE("header is not JSON") {
    std::string bytes = valid;
    bytes[9] = '\x01';
    expect(bytes, "the header is not valid JSON");
  }
  SUBCASE("header is not an object") { expect(safetensors_bytes("[1, 2]  ", ""), "not a JSON object"); }
  SUBCASE("unknown dtype") {
    std::string bytes = valid;
    REQUIRE(fulgur::test::replace_all(bytes, "\"F32\"", "\"F31\"") == 1);
    expect(bytes, "dtype 'F31' is unknown");
  }
  SUBCASE("offsets disagree with dtype and shape") {
    expect(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", four_floats),
           "data_offsets [0, 16] do not hold F32 of shape [3] (12 bytes)");
  }
  SUBCASE("offsets beyond the file") {
    expect(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})", four_floats),
           "describes 32 bytes of tensor data but the file holds 16");
  }
  SUBCASE("a gap between tensors") {
    expect(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                             R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                             four_floats.substr(0, 12)),
           "tensor 'b' starts at byte 8 of the data, expected 4");
  }
  SUBCASE("a shape whose size overflows") {
    expect(safetensors_bytes(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,16]}})",
                             four_floats),
           "overflows");
  }
  SUBCASE("a negative dimension") {
    expect(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", four_floats),
           "shape must hold non-negative integers, got -4");
  }
  SUBCASE("data_offsets that are not a pair") {
    expect(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0]}})", four_floats),
           "data_offsets is not a pair");
  }
  SUBCASE("a missing field") {
    expect(safetensors_bytes(R"({"a":{"dtype":"F32","data_offsets":[0,16]}})", four_floats),
           "lacks one of dtype, shape, data_offsets");
  }
}

TEST_CASE("weights: a truncated torch.save file and a file that is no state dict fail clearly") {
  TempDir dir;
  Net net;
  const fs::path pt = dir / "net.pt";
  fulgur::save_weights(fulgur::named_tensors(net), pt.string());
  const std::string bytes = fulgur::test::read_bytes(pt);
  fulgur::test::write_bytes(pt, bytes.substr(0, bytes.size() / 2));
  const fulgur::Error truncated = error_from([&] { fulgur::load_weights(net, pt.string()); });
  CHECK(truncated.kind() == fulgur::ErrorKind::checkpoint);
  FULGUR_CHECK_CONTAINS(truncated.what(), pt.string());

  auto dict = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("epoch", int64_t{3});
  fulgur::write_checkpoint_file(dict, pt.string());
  const fulgur::Error not_weights = error_from([&] { fulgur::read_weights(pt.string()); });
  FULGUR_CHECK_CONTAINS(not_weights.what(), "entry 'epoch' is a Int, not a tensor");
}

TEST_CASE("weights: `fulgur weights convert` and `inspect` in a real process") {
  TempDir dir;
  Net net;
  fulgur::save_weights(fulgur::named_tensors(net), (dir / "net.pt").string());
  auto fulgur_cli = [&](std::vector<std::string> args) {
    args.insert(args.begin(), FULGUR_TEST_FULGUR_BIN);
    return fulgur::test::run_process(args, {{"FULGUR_LOG_LEVEL", "warn"}}, dir.path());
  };

  auto run = fulgur_cli({"weights", "convert", "net.pt", "net.safetensors"});
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  FULGUR_CHECK_CONTAINS(run.output, "wrote net.safetensors (9 tensors)");

  run = fulgur_cli({"weights", "inspect", "net.safetensors"});
  REQUIRE(run.exit_code == 0);
  FULGUR_CHECK_CONTAINS(run.output, "net.safetensors: safetensors, 9 tensors, ");
  FULGUR_CHECK_CONTAINS(run.output, "metadata format = pt");
  FULGUR_CHECK_CONTAINS(run.output, "net.0.weight               F32     [8, 4]");
  FULGUR_CHECK_CONTAINS(run.output, "net.2.num_batches_tracked  I64     []");

  run = fulgur_cli({"weights", "convert", "net.safetensors", "back.ckpt"});
  REQUIRE(run.exit_code == 0);
  const auto original = fulgur::read_weights((dir / "net.pt").string());
  const auto back = fulgur::read_weights((dir / "back.ckpt").string());
  REQUIRE(back.size() == original.size());
  for (const auto& [k, t] : original) CHECK(torch::equal(back.at(k), t));

  run = fulgur_cli({"weights", "inspect", "back.ckpt"});
  REQUIRE(run.exit_code == 0);
  FULGUR_CHECK_CONTAINS(run.output, "back.ckpt: torch.save, 9 tensors, ");
  FULGUR_CHECK_CONTAINS(run.output, "net.3.bias                 F32     [3]");

  fulgur::test::write_bytes(dir / "broken.safetensors",
                            fulgur::test::read_bytes(dir / "net.safetensors").substr(0, 100));
  run = fulgur_cli({"weights", "inspect", "broken.safetensors"});
  CHECK(run.exit_code == 1);
  FULGUR_CHECK_CONTAINS(run.output, "fulgur: error: safetensors file 'broken.safetensors' is not valid");
  run = fulgur_cli({"weights", "convert", "broken.safetensors", "x.pt"});
  CHECK(run.exit_code == 1);
  CHECK_FALSE(fs::exists(dir / "x.pt"));
  run = fulgur_cli({"weights", "frobnicate"});
  CHECK(run.exit_code == 2);
  FULGUR_CHECK_CONTAINS(run.output, "fulgur weights inspect FILE");
}
