// fulgur/metrics.h against torchmetrics: the test draws random batches, writes them to a file both
// sides read, and every metric must equal torchmetrics' value to 1e-6 after the same updates. The
// same values must come out when the batches are split over two simulated ranks and the states
// are synchronised at compute().
#include <fulgur/checkpoint_io.h>
#include <fulgur/config_builder.h>
#include <fulgur/error.h>
#include <fulgur/metrics.h>
#include <fulgur/testing/plugin_kit.h>
#include <fulgur/trainer.h>

#include <torch/torch.h>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <functional>

#include "test_support.h"

namespace {

namespace m = fulgur::metrics;
using fulgur::test::TempDir;
using Options = m::ClassificationOptions;

constexpr int64_t kBatches = 3, kN = 40, kC = 5, kL = 4;

// Inputs per family, stacked over batches on dim 0.
c10::impl::GenericDict make_inputs() {
  torch::manual_seed(1234);
  auto d = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
  d.insert("mc_preds", torch::randn({kBatches, kN, kC}, torch::kFloat64));
  d.insert("mc_target", torch::randint(0, kC, {kBatches, kN}));
  // Batch 1 in [0, 1] (taken as probabilities), the others logits (sigmoid applied).
  auto ml = torch::randn({kBatches, kN, kL}, torch::kFloat64);
  ml[1] = torch::rand({kN, kL}, torch::kFloat64);
  d.insert("ml_preds", ml);
  d.insert("ml_target", torch::randint(0, 2, {kBatches, kN, kL}));
  d.insert("bin_preds", torch::rand({kBatches, kN}, torch::kFloat64));
  d.insert("bin_target", torch::randint(0, 2, {kBatches, kN}));
  d.insert("reg_preds", torch::randn({kBatches, kN, 3}, torch::kFloat64));
  d.insert("reg_target", torch::randn({kBatches, kN, 3}, torch::kFloat64));
  d.insert("ppl_preds", torch::randn({kBatches, 4, 6, 7}, torch::kFloat64));
  auto tokens = torch::randint(0, 7, {kBatches, 4, 6});
  tokens.index_put_({torch::rand({kBatches, 4, 6}) < 0.2}, -100);
  d.insert("ppl_target", tokens);
  return d;
}

struct Case {
  std::string name;
  std::string family;  // which inputs: mc, ml, bin, reg, ppl
  std::function<std::unique_ptr<m::Metric>()> make;
  std::string python;  // the torchmetrics object
};

template <class M, class... A>
std::function<std::unique_ptr<m::Metric>()> make(A... args) {
  return [=] { return std::make_unique<M>(args...); };
}

std::vector<Case> cases() {
  using A = m::Average;
  const auto mc = Options::multiclass(kC);
  const auto ml = Options::multilabel(kL);
  std::vector<Case> c;
  for (auto [avg, name] :
       {std::pair{A::micro, "micro"}, {A::macro, "macro"}, {A::weighted, "weighted"}, {A::none, "none"}}) {
    auto o = mc;
    o.average(avg);
    const std::string a = name;
    c.push_back(
        {"acc_mc_" + a, "mc", make<m::Accuracy>(o), fmt::format("tm.MulticlassAccuracy({}, average='{}')", kC, a)});
    c.push_back(
        {"prec_mc_" + a, "mc", make<m::Precision>(o), fmt::format("tm.MulticlassPrecision({}, average='{}')", kC, a)});
    c.push_back({"rec_mc_" + a, "mc", make<m::Recall>(o), fmt::format("tm.MulticlassRecall({}, average='{}')", kC, a)});
    c.push_back(
        {"f1_mc_" + a, "mc", make<m::F1Score>(o), fmt::format("tm.MulticlassF1Score({}, average='{}')", kC, a)});
    auto k = o;
    k.top_k(2);
    c.push_back({"acc_mc_top2_" + a, "mc", make<m::Accuracy>(k),
                 fmt::format("tm.MulticlassAccuracy({}, top_k=2, average='{}')", kC, a)});
    c.push_back({"prec_mc_top2_" + a, "mc", make<m::Precision>(k),
                 fmt::format("tm.MulticlassPrecision({}, top_k=2, average='{}')", kC, a)});
    c.push_back({"f1_mc_top2_" + a, "mc", make<m::F1Score>(k),
                 fmt::format("tm.MulticlassF1Score({}, top_k=2, average='{}')", kC, a)});
    auto l = ml;
    l.average(avg);
    c.push_back(
        {"acc_ml_" + a, "ml", make<m::Accuracy>(l), fmt::format("tm.MultilabelAccuracy({}, average='{}')", kL, a)});
    c.push_back(
        {"prec_ml_" + a, "ml", make<m::Precision>(l), fmt::format("tm.MultilabelPrecision({}, average='{}')", kL, a)});
    c.push_back({"rec_ml_" + a, "ml", make<m::Recall>(l), fmt::format("tm.MultilabelRecall({}, average='{}')", kL, a)});
    c.push_back(
        {"f1_ml_" + a, "ml", make<m::F1Score>(l), fmt::format("tm.MultilabelF1Score({}, average='{}')", kL, a)});
  }
  // No .average(): the defaults of torchmetrics' entry point with the same arguments, the task
  // wrappers Lightning code uses (micro; AUROC macro).
  c.push_back({"default_acc_mc", "mc", make<m::Accuracy>(mc),
               fmt::format("tm.Accuracy(task='multiclass', num_classes={})", kC)});
  c.push_back({"default_prec_mc", "mc", make<m::Precision>(mc),
               fmt::format("tm.Precision(task='multiclass', num_classes={})", kC)});
  c.push_back(
      {"default_rec_mc", "mc", make<m::Recall>(mc), fmt::format("tm.Recall(task='multiclass', num_classes={})", kC)});
  c.push_back(
      {"default_f1_mc", "mc", make<m::F1Score>(mc), fmt::format("tm.F1Score(task='multiclass', num_classes={})", kC)});
  c.push_back({"default_acc_mc_top2", "mc", make<m::Accuracy>(Options::multiclass(kC).top_k(2)),
               fmt::format("tm.Accuracy(task='multiclass', num_classes={}, top_k=2)", kC)});
  c.push_back({"default_acc_ml", "ml", make<m::Accuracy>(ml),
               fmt::format("tm.Accuracy(task='multilabel', num_labels={})", kL)});
  c.push_back(
      {"default_f1_ml", "ml", make<m::F1Score>(ml), fmt::format("tm.F1Score(task='multilabel', num_labels={})", kL)});
  c.push_back(
      {"default_auroc_mc", "mc", make<m::AUROC>(mc), fmt::format("tm.AUROC(task='multiclass', num_classes={})", kC)});
  auto ignore = mc;
  ignore.ignore_index(0).average(A::macro);
  c.push_back({"acc_mc_macro_ignore0", "mc", make<m::Accuracy>(ignore),
               fmt::format("tm.MulticlassAccuracy({}, ignore_index=0)", kC)});
  c.push_back({"fbeta2_mc_macro", "mc", make<m::F1Score>(Options::multiclass(kC).average(A::macro), 2.0),
               fmt::format("tm.MulticlassFBetaScore(2.0, {})", kC)});
  const auto bin = Options::binary();
  c.push_back({"acc_bin", "bin", make<m::Accuracy>(bin), "tm.BinaryAccuracy()"});
  c.push_back({"prec_bin", "bin", make<m::Precision>(bin), "tm.BinaryPrecision()"});
  c.push_back({"rec_bin", "bin", make<m::Recall>(bin), "tm.BinaryRecall()"});
  c.push_back({"f1_bin", "bin", make<m::F1Score>(Options::binary().threshold(0.3)), "tm.BinaryF1Score(threshold=0.3)"});
  c.push_back({"auroc_bin", "bin", make<m::AUROC>(bin), "tm.BinaryAUROC()"});
  for (auto [avg, name] : {std::pair{A::macro, "macro"}, {A::weighted, "weighted"}, {A::none, "none"}}) {
    auto o = mc;
    o.average(avg);
    c.push_back({fmt::format("auroc_mc_{}", name), "mc", make<m::AUROC>(o),
                 fmt::format("tm.MulticlassAUROC({}, average='{}')", kC, name)});
  }
  c.push_back({"confmat", "mc", make<m::ConfusionMatrix>(kC, m::Normalize::none, std::nullopt),
               fmt::format("tm.MulticlassConfusionMatrix({})", kC)});
  c.push_back({"confmat_true", "mc", make<m::ConfusionMatrix>(kC, m::Normalize::true_, std::nullopt),
               fmt::format("tm.MulticlassConfusionMatrix({}, normalize='true')", kC)});
  c.push_back({"confmat_all", "mc", make<m::ConfusionMatrix>(kC, m::Normalize::all, std::nullopt),
               fmt::format("tm.MulticlassConfusionMatrix({}, normalize='all')", kC)});
  c.push_back({"mse", "reg", make<m::MeanSquaredError>(), "tm.MeanSquaredError()"});
  c.push_back({"mae", "reg", make<m::MeanAbsoluteError>(), "tm.MeanAbsoluteError()"});
  c.push_back(
      {"ppl", "ppl", make<m::Perplexity>(std::optional<int64_t>(-100)), "tm.text.Perplexity(ignore_index=-100)"});
  return c;
}

at::Tensor input(const c10::impl::GenericDict& d, const std::string& key) { return d.at(c10::IValue(key)).toTensor(); }

void check_close(const std::string& name, const at::Tensor& ours, const at::Tensor& theirs) {
  INFO(name << "\n  fulgur: " << ours << "\n  torchmetrics: " << theirs);
  REQUIRE(ours.sizes() == theirs.sizes());
  const at::Tensor a = ours.to(torch::kDouble), b = theirs.to(torch::kDouble);
  const double tolerance = 1e-6;
  CHECK(((a - b).abs() <= tolerance * torch::clamp_min(b.abs(), 1.0)).all().item<bool>());
}

// Two ranks in one process: rank 0's states combined with the peer's, in state order, exactly as
// compute() asks for them.
class PeerSync : public m::MetricSync {
 public:
  explicit PeerSync(const m::Metric& peer) : peer_(&peer) {}
  int64_t world_size() const override { return 2; }
  at::Tensor all_reduce(const at::Tensor& t, fulgur::ReduceOp op) override {
    const at::Tensor other = peer_->state_value(next_++);
    switch (op) {
      case fulgur::ReduceOp::max:
        return torch::maximum(t, other);
      case fulgur::ReduceOp::min:
        return torch::minimum(t, other);
      default:
        return t + other;
    }
  }
  std::vector<at::Tensor> all_gather(const at::Tensor& t) override { return {t, peer_->state_value(next_++)}; }

 private:
  const m::Metric* peer_;
  size_t next_ = 0;
};

}  // namespace

TEST_CASE("metrics: every metric equals torchmetrics after the same updates, on one rank and on two") {
  TempDir dir;
  const auto inputs = make_inputs();
  fulgur::write_checkpoint_file(inputs, (dir / "inputs.pt").string());
  const auto all = cases();

  std::string script = R"(
import sys, types, torch
import torchmetrics.classification as C, torchmetrics.regression as R, torchmetrics.text as T
tm = types.SimpleNamespace(**{k: getattr(m, k) for m in (C, R) for k in dir(m) if not k.startswith("_")}, text=T)
inputs = torch.load(sys.argv[1], weights_only=True)
cases = {
)";
  for (const auto& c : all) script += fmt::format("  {:?}: ({}, {:?}),\n", c.name, c.python, c.family);
  script += R"(}
out = {}
for name, (metric, family) in cases.items():
    for b in range(inputs[family + "_preds"].shape[0]):
        metric.update(inputs[family + "_preds"][b], inputs[family + "_target"][b])
    out[name] = metric.compute().to(torch.float64)
torch.save(out, sys.argv[2])
print("python-ok")
)";
  std::ofstream(dir / "metrics.py") << script;
  const auto [status, output] =
      fulgur::test::run_command(fmt::format("{} {} {} {}", FULGUR_TEST_PYTHON, (dir / "metrics.py").string(),
                                            (dir / "inputs.pt").string(), (dir / "expected.pt").string()));
  INFO(output);
  REQUIRE(status == 0);
  REQUIRE(fulgur::test::contains(output, "python-ok"));
  const auto expected = fulgur::read_checkpoint_file((dir / "expected.pt").string()).toGenericDict();

  for (const auto& c : all) {
    const at::Tensor preds = input(inputs, c.family + "_preds"), target = input(inputs, c.family + "_target");
    const at::Tensor theirs = expected.at(c10::IValue(c.name)).toTensor();
    // One rank, all batches; compute twice (compute leaves the states alone), then reset.
    auto metric = c.make();
    for (int64_t b = 0; b < kBatches; ++b) metric->update(preds[b], target[b]);
    check_close(c.name, metric->compute(), theirs);
    check_close(c.name + " (again)", metric->compute(), theirs);
    metric->reset();
    for (int64_t b = 0; b < kBatches; ++b) metric->update(preds[b], target[b]);
    check_close(c.name + " (after reset)", metric->compute(), theirs);

    // Two ranks: batches 0-1 here, batch 2 on the peer.
    auto rank0 = c.make(), rank1 = c.make();
    rank0->update(preds[0], target[0]);
    rank0->update(preds[1], target[1]);
    rank1->update(preds[2], target[2]);
    rank0->sync_with(std::make_shared<PeerSync>(*rank1));
    check_close(c.name + " (2 ranks)", rank0->compute(), theirs);
  }
}

TEST_CASE("metrics: bad inputs and options are refused with what is wrong") {
  const auto top = fulgur::test::error_from([] { m::Accuracy(Options::multiclass(3).top_k(4)); });
  FULGUR_CHECK_CONTAINS(top.what(), "top_k = 4 must be in [1, num_classes = 3]");
  m::Accuracy acc(Options::multiclass(3));
  const auto batch = fulgur::test::error_from([&] {
    acc.update(torch::randn({4, 3}), torch::zeros({5}, torch::kLong));
  });
  FULGUR_CHECK_CONTAINS(batch.what(), "do not describe the same batch");
  const auto range = fulgur::test::error_from([&] { acc.update(torch::randn({2, 3}), torch::tensor({0, 7})); });
  FULGUR_CHECK_CONTAINS(range.what(), "not a class in [0, 3)");
  m::Perplexity ppl;
  const auto shape = fulgur::test::error_from([&] {
    ppl.update(torch::randn({2, 3}), torch::zeros({2}, torch::kLong));
  });
  FULGUR_CHECK_CONTAINS(shape.what(), "(B, T, V) logits");
}

namespace {

// Lightning's pattern: update the metric in the step, log the object; the Trainer computes and
// resets it at the end of the epoch.
struct AccuracyModule : fulgur::testing::BoringModule {
  fulgur::StepOutput validation_step(const fulgur::Batch& batch, int64_t) override {
    accuracy.update(layer->forward(batch.input), batch.target);
    log("val/acc", accuracy, fulgur::LogOptions().prog_bar(true));
    return {};
  }
  m::Accuracy accuracy{Options::multiclass(2).average(m::Average::micro)};
};

}  // namespace

TEST_CASE("metrics: Module::log(name, metric) computes at epoch end and resets, like a torchmetrics object") {
  TempDir dir;
  fulgur::Trainer trainer(fulgur::ConfigBuilder()
                              .set("default_root_dir", dir.path().string())
                              .set("enable_progress_bar", false)
                              .set("enable_model_summary", false)
                              .set("enable_checkpointing", false)
                              .set("logger", false));
  AccuracyModule module;
  fulgur::testing::BoringData data(8);
  torch::NoGradGuard no_grad;
  const double expected =
      (module.layer->forward(data.inputs).argmax(1) == data.targets).to(torch::kDouble).mean().item<double>();
  for (int run = 0; run < 2; ++run) {  // the second run sees a reset metric, so the same value
    const auto results = trainer.validate(module, data);
    REQUIRE(results.size() == 1);
    CHECK(results[0].at("val/acc") == doctest::Approx(expected).epsilon(1e-12));
    CHECK(trainer.callback_metrics().at("val/acc") == doctest::Approx(expected).epsilon(1e-12));
  }
  CHECK(module.accuracy.compute().item<double>() == 0.0);  // reset after the epoch
  CHECK(module.accuracy.synced());                         // bound to the module's strategy

  struct StepLogged : AccuracyModule {
    fulgur::StepOutput validation_step(const fulgur::Batch& batch, int64_t) override {
      log("val/acc", accuracy, fulgur::LogOptions().on_step(true));
      return {};
    }
  } step_logged;
  const auto error = fulgur::test::error_from([&] { trainer.validate(step_logged, data); });
  FULGUR_CHECK_CONTAINS(error.what(), "metric objects are logged once per epoch");
}
