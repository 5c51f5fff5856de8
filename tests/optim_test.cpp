// fulgur/optim against its Python references, in a real Python process on the same torch wheel:
// Lion against lion-pytorch 0.2.5, Muon (with AdamW for the non-matrix parameters) against
// torch.optim.Muon + torch.optim.AdamW, Muon's Newton-Schulz iteration against
// torch.optim._muon._zeropower_via_newtonschulz, and SophiaG against a reference written below
// from sophia.py (Liuhong99/Sophia has no package) with its Gauss-Newton-Bartlett refresh. Both sides train the same
// two-layer network from the same initial weights on the same batch for 50 steps; every parameter after every step must
// agree to 1e-6. A tall (16x8) and a wide (4x16) matrix take both of Newton-Schulz's branches.
#include <fulgur/checkpoint_io.h>
#include <fulgur/optim/lion.h>
#include <fulgur/optim/muon.h>
#include <fulgur/optim/sophia.h>
#include <fulgur/state_dict.h>

#include <torch/torch.h>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <fstream>
#include <functional>

#include "test_support.h"

namespace {

using fulgur::test::TempDir;
namespace fo = fulgur::optim;

constexpr int kSteps = 50;
const std::vector<std::string> kNames = {"w1", "b1", "w2", "b2"};

// The problem both sides solve: inputs and initial weights.
c10::impl::GenericDict make_problem() {
  torch::manual_seed(37);
  auto d = c10::impl::GenericDict(c10::StringType::get(), c10::TensorType::get());
  d.insert("x", torch::randn({32, 8}));
  d.insert("y", torch::randn({32, 4}));
  d.insert("w1", torch::randn({16, 8}) * 0.3);
  d.insert("b1", torch::randn({16}) * 0.1);
  d.insert("w2", torch::randn({4, 16}) * 0.3);
  d.insert("b2", torch::randn({4}) * 0.1);
  d.insert("labels", torch::randint(0, 4, {32}));
  return d;
}

struct Net {
  std::vector<torch::Tensor> params;  // w1, b1, w2, b2
  torch::Tensor x, y;
  explicit Net(const c10::impl::GenericDict& d) {
    x = d.at("x").toTensor();
    y = d.at("y").toTensor();
    for (const auto& n : kNames) params.push_back(d.at(n).toTensor().clone().set_requires_grad(true));
  }
  torch::Tensor logits() const {
    auto h = torch::tanh(torch::nn::functional::linear(x, params[0], params[1]));
    return torch::nn::functional::linear(h, params[2], params[3]);
  }
  torch::Tensor loss() const { return torch::mse_loss(logits(), y); }
};

// Runs `steps` steps, returning every parameter after every step (stacked on dim 0).
std::vector<torch::Tensor> train(const Net& net, torch::optim::Optimizer& optimizer, int steps) {
  std::vector<std::vector<torch::Tensor>> trace(net.params.size());
  for (int s = 0; s < steps; ++s) {
    optimizer.zero_grad();
    net.loss().backward();
    optimizer.step();
    for (size_t i = 0; i < net.params.size(); ++i) trace[i].push_back(net.params[i].detach().clone());
  }
  std::vector<torch::Tensor> out;
  for (auto& t : trace) out.push_back(torch::stack(t));
  return out;
}

const char* kReference = R"(
import sys, torch
import torch.nn.functional as F
from torch.optim._muon import _zeropower_via_newtonschulz
torch.use_deterministic_algorithms(True)
mode, problem_file, out_file = sys.argv[1:4]
d = torch.load(problem_file, weights_only=True)
if mode == "ns":
    out = {k: _zeropower_via_newtonschulz(v, (3.4445, -4.7750, 2.0315), 5, 1e-7) for k, v in d.items()}
    torch.save(out, out_file)
    print("python-ok"); sys.exit(0)
names = ["w1", "b1", "w2", "b2"]
p = {n: d[n].clone().requires_grad_(True) for n in names}

# SophiaG as sophia.py (github.com/Liuhong99/Sophia, MIT) defines it: _single_tensor_sophiag with
# capturable=False, and update_hessian; the refresh every k steps as its train_sophiag.py does.
class SophiaG:
    def __init__(self, params, lr, betas, rho, weight_decay, bs):
        self.params, self.lr, self.betas, self.rho, self.wd, self.bs = list(params), lr, betas, rho, weight_decay, bs
        self.state = {}
    def _state(self, p):
        return self.state.setdefault(id(p), {"step": 0, "exp_avg": torch.zeros_like(p), "hessian": torch.zeros_like(p)})
    @torch.no_grad()
    def update_hessian(self):
        for p in self.params:
            if p.grad is not None:
                self._state(p)["hessian"].mul_(self.betas[1]).addcmul_(p.grad, p.grad, value=1 - self.betas[1])
    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is None: continue
            st = self._state(p)
            st["step"] += 1
            p.mul_(1 - self.lr * self.wd)
            st["exp_avg"].mul_(self.betas[0]).add_(p.grad, alpha=1 - self.betas[0])
            # sophia.py's rho*bs*h + 1e-15, floored at 0 as the paper's max(rho*h, eps) (the GNB
            # estimate is never negative; a Hutchinson one can be).
            ratio = (st["exp_avg"].abs() / ((self.rho * self.bs * st["hessian"]).clamp(min=0) + 1e-15)).clamp(None, 1)
            p.addcmul_(st["exp_avg"].sign(), ratio, value=-self.lr)
    def zero_grad(self):
        for q in self.params: q.grad = None

def logits():
    return F.linear(torch.tanh(F.linear(d["x"], p["w1"], p["b1"])), p["w2"], p["b2"])

if mode == "sophia":
    opt = SophiaG(p.values(), lr=0.01, betas=(0.965, 0.99), rho=0.05, weight_decay=0.1, bs=32)
    torch.manual_seed(0)
    trace = {n: [] for n in names}
    for it in range(50):
        opt.zero_grad()
        F.cross_entropy(logits(), d["labels"]).backward()
        opt.step()
        if it % 10 == 9:  # Gauss-Newton-Bartlett: labels sampled from the model's own logits
            opt.zero_grad()
            out = logits()
            sampled = torch.multinomial(torch.softmax(out.detach().reshape(-1, out.size(-1)), -1), 1, replacement=True).squeeze(-1)
            F.cross_entropy(out, sampled).backward()
            opt.update_hessian()
            opt.zero_grad()
        for n in names: trace[n].append(p[n].detach().clone())
    torch.save({n: torch.stack(t) for n, t in trace.items()}, out_file)
    print("python-ok"); sys.exit(0)

if mode == "sophia-h":
    # Sophia-H (the paper's Algorithm 1 with the Hutchinson estimator): u ~ N(0, I) per parameter,
    # h = b2*h + (1-b2) * u * (H u), H u by double backward; refreshed every 5 steps, bs = 1.
    opt = SophiaG(p.values(), lr=0.01, betas=(0.965, 0.99), rho=0.05, weight_decay=0.1, bs=1)
    torch.manual_seed(0)
    trace = {n: [] for n in names}
    params = list(p.values())
    for it in range(50):
        opt.zero_grad()
        F.mse_loss(logits(), d["y"]).backward()
        opt.step()
        if it % 5 == 4:
            opt.zero_grad()
            loss = F.mse_loss(logits(), d["y"])
            grads = torch.autograd.grad(loss, params, create_graph=True)
            us = [torch.randn_like(q) for q in params]
            inner = None
            for g, u in zip(grads, us):
                term = (g * u).sum()
                inner = term if inner is None else inner + term
            hvps = torch.autograd.grad(inner, params)
            with torch.no_grad():
                for q, u, hv in zip(params, us, hvps):
                    opt._state(q)["hessian"].mul_(opt.betas[1]).addcmul_(u, hv, value=1 - opt.betas[1])
            opt.zero_grad()
        for n in names: trace[n].append(p[n].detach().clone())
    torch.save({n: torch.stack(t) for n, t in trace.items()}, out_file)
    print("python-ok"); sys.exit(0)

if mode == "lion":
    from lion_pytorch import Lion
    opts = [Lion(p.values(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)]
else:
    adjust = mode.split(":")[1]
    nesterov = mode.split(":")[2] == "nesterov"
    opts = [torch.optim.Muon([p["w1"], p["w2"]], lr=0.02, weight_decay=0.1, momentum=0.95,
                             nesterov=nesterov, adjust_lr_fn=adjust),
            torch.optim.AdamW([p["b1"], p["b2"]], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                              weight_decay=0.01, foreach=False)]
trace = {n: [] for n in names}
for _ in range(50):
    for o in opts: o.zero_grad()
    h = torch.tanh(F.linear(d["x"], p["w1"], p["b1"]))
    F.mse_loss(F.linear(h, p["w2"], p["b2"]), d["y"]).backward()
    for o in opts: o.step()
    for n in names: trace[n].append(p[n].detach().clone())
torch.save({n: torch.stack(t) for n, t in trace.items()}, out_file)
print("python-ok")
)";

c10::impl::GenericDict run_reference(const TempDir& dir, const std::string& mode, const c10::IValue& problem) {
  fulgur::write_checkpoint_file(problem, (dir / "problem.pt").string());
  std::ofstream(dir / "reference.py") << kReference;
  const auto [status, output] = fulgur::test::run_command(
      fmt::format("{} {} '{}' {} {} 2>&1", FULGUR_TEST_PYTHON, (dir / "reference.py").string(), mode,
                  (dir / "problem.pt").string(), (dir / "expected.pt").string()));
  INFO(output);
  REQUIRE(status == 0);
  REQUIRE(fulgur::test::contains(output, "python-ok"));
  return fulgur::read_checkpoint_file((dir / "expected.pt").string()).toGenericDict();
}

void check_trace(const std::vector<torch::Tensor>& ours, const c10::impl::GenericDict& theirs, double tolerance) {
  for (size_t i = 0; i < kNames.size(); ++i) {
    const torch::Tensor expected = theirs.at(kNames[i]).toTensor();
    REQUIRE(expected.sizes() == ours[i].sizes());
    const double diff = (ours[i] - expected).abs().max().item<double>();
    // The weights must move: a no-op optimizer would match a no-op reference.
    const double moved = (expected[kSteps - 1] - expected[0]).abs().max().item<double>();
    INFO(kNames[i] << ": max |ours - reference| over " << kSteps << " steps = " << diff << ", moved " << moved);
    CHECK(diff <= tolerance);
    CHECK(moved > 1e-3);
  }
}

std::unique_ptr<fo::Muon> make_muon(const Net& net, const std::string& adjust, bool nesterov) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(
      std::vector<torch::Tensor>{net.params[0], net.params[2]},
      std::make_unique<fo::MuonOptions>(
          fo::MuonOptions(0.02).weight_decay(0.1).momentum(0.95).nesterov(nesterov).adjust_lr_fn(adjust)));
  groups.emplace_back(
      std::vector<torch::Tensor>{net.params[1], net.params[3]},
      std::make_unique<fo::MuonOptions>(
          fo::MuonOptions(1e-3).use_muon(false).betas({0.9, 0.999}).adamw_eps(1e-8).weight_decay(0.01)));
  return std::make_unique<fo::Muon>(groups);
}

}  // namespace

TEST_CASE("optim: Lion equals lion-pytorch 0.2.5 over 50 steps to 1e-6") {
  TempDir dir;
  const auto problem = make_problem();
  const auto expected = run_reference(dir, "lion", problem);
  Net net(problem);
  fo::Lion lion(net.params, fo::LionOptions(1e-3).betas({0.9, 0.99}).weight_decay(0.1));
  check_trace(train(net, lion, kSteps), expected, 1e-6);
}

TEST_CASE("optim: Muon with AdamW groups equals torch.optim.Muon + AdamW over 50 steps to 1e-6") {
  TempDir dir;
  const auto problem = make_problem();
  for (const auto& [adjust, nesterov] :
       std::vector<std::pair<std::string, bool>>{{"original", true}, {"match_rms_adamw", true}, {"original", false}}) {
    CAPTURE(adjust);
    CAPTURE(nesterov);
    const auto expected =
        run_reference(dir, fmt::format("muon:{}:{}", adjust, nesterov ? "nesterov" : "plain"), problem);
    Net net(problem);
    auto muon = make_muon(net, adjust, nesterov);
    check_trace(train(net, *muon, kSteps), expected, 1e-6);
  }
}

TEST_CASE("optim: SophiaG with a GNB refresh every 10 steps equals the sophia.py reference over 50 steps to 1e-6") {
  TempDir dir;
  const auto problem = make_problem();
  const auto expected = run_reference(dir, "sophia", problem);
  Net net(problem);
  const torch::Tensor labels = problem.at("labels").toTensor();
  fo::SophiaG sophia(net.params, fo::SophiaGOptions(0.01).betas({0.965, 0.99}).rho(0.05).weight_decay(0.1).bs(32));
  torch::manual_seed(0);  // the sampled labels follow the default generator, as in Python
  std::vector<std::vector<torch::Tensor>> trace(net.params.size());
  bool refreshed = false;
  for (int it = 0; it < kSteps; ++it) {
    sophia.zero_grad();
    torch::nn::functional::cross_entropy(net.logits(), labels).backward();
    sophia.step();
    if (it % 10 == 9) {
      sophia.refresh_hessian([&] {
        const torch::Tensor out = net.logits();
        return torch::nn::functional::cross_entropy(out, fo::gnb_sampled_labels(out));
      });
      refreshed = true;
    }
    for (size_t i = 0; i < net.params.size(); ++i) trace[i].push_back(net.params[i].detach().clone());
  }
  REQUIRE(refreshed);
  std::vector<torch::Tensor> ours;
  for (auto& t : trace) ours.push_back(torch::stack(t));
  check_trace(ours, expected, 1e-6);
  // The estimate is in the state: a nonzero Hessian EMA for every parameter.
  for (const auto& p : net.params) {
    const auto& state = static_cast<const fo::SophiaGParamState&>(*sophia.state().at(p.unsafeGetTensorImpl()));
    CHECK(state.step() == kSteps);
    CHECK(state.hessian().abs().sum().item<double>() > 0);
  }
}

TEST_CASE("#37 optim: SophiaG with a Hutchinson refresh every 5 steps equals a Sophia-H reference over 50 steps") {
  TempDir dir;
  const auto problem = make_problem();
  const auto expected = run_reference(dir, "sophia-h", problem);
  Net net(problem);
  fo::SophiaG sophia(net.params, fo::SophiaGOptions(0.01).betas({0.965, 0.99}).rho(0.05).weight_decay(0.1).bs(1));
  torch::manual_seed(0);  // u follows the default generator, as in Python
  std::vector<std::vector<torch::Tensor>> trace(net.params.size());
  for (int it = 0; it < kSteps; ++it) {
    sophia.zero_grad();
    net.loss().backward();
    sophia.step();
    if (it % 5 == 4) sophia.refresh_hessian_hutchinson([&] { return net.loss(); });
    for (size_t i = 0; i < net.params.size(); ++i) trace[i].push_back(net.params[i].detach().clone());
  }
  std::vector<torch::Tensor> ours;
  for (auto& t : trace) ours.push_back(torch::stack(t));
  check_trace(ours, expected, 1e-6);
  // The estimate is u * Hu, not a squared gradient (the GNB refresh): the off-diagonal terms give
  // it negative entries, which g*g never has. The gradients are left zeroed.
  double most_negative = 0;
  for (const auto& p : net.params) {
    const auto& state = static_cast<const fo::SophiaGParamState&>(*sophia.state().at(p.unsafeGetTensorImpl()));
    CHECK(state.hessian().abs().sum().item<double>() > 0);
    most_negative = std::min(most_negative, state.hessian().min().item<double>());
    CHECK((!p.grad().defined() || p.grad().abs().sum().item<double>() == 0));
  }
  CHECK(most_negative < 0);
}

TEST_CASE("optim: Muon's Newton-Schulz is bitwise torch.optim.Muon's on fp32 inputs") {
  TempDir dir;
  torch::manual_seed(5);
  auto inputs = c10::impl::GenericDict(c10::StringType::get(), c10::TensorType::get());
  inputs.insert("square", torch::randn({64, 64}));
  inputs.insert("tall", torch::randn({96, 40}) * 3);
  inputs.insert("wide", torch::randn({24, 130}) * 0.01);
  inputs.insert("tiny", torch::full({3, 5}, 1e-9));  // the eps floor of the norm
  const auto expected = run_reference(dir, "ns", inputs);
  for (const auto& entry : inputs) {
    const std::string name = entry.key().toStringRef();
    const torch::Tensor ours =
        fo::zeropower_via_newtonschulz(entry.value().toTensor(), std::make_tuple(3.4445, -4.7750, 2.0315), 5, 1e-7);
    const torch::Tensor theirs = expected.at(name).toTensor();
    INFO(name << ": " << ours.scalar_type() << " vs " << theirs.scalar_type());
    CHECK((ours.scalar_type() == theirs.scalar_type()));
    CHECK(torch::equal(ours, theirs));
  }
}

TEST_CASE("optim: Lion, Muon and SophiaG state survives a Fulgur checkpoint and resumes bitwise") {
  TempDir dir;
  const auto problem = make_problem();
  using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(const Net&)>;
  const std::vector<std::pair<std::string, Factory>> optimizers = {
      {"lion",
       [](const Net& n) { return std::make_unique<fo::Lion>(n.params, fo::LionOptions(1e-3).weight_decay(0.1)); }},
      {"muon", [](const Net& n) { return make_muon(n, "match_rms_adamw", true); }},
      {"sophia",
       [](const Net& n) { return std::make_unique<fo::SophiaG>(n.params, fo::SophiaGOptions(0.01).rho(0.05).bs(32)); }},
  };
  for (const auto& [name, make] : optimizers) {
    CAPTURE(name);
    Net straight(problem);
    auto a = make(straight);
    const auto whole = train(straight, *a, 20);

    Net first(problem);
    auto b = make(first);
    train(first, *b, 10);
    // Through the checkpoint file the Trainer writes (optimizer_states[i]), with the learning
    // rate changed in between as a scheduler would: the checkpoint's must come back.
    fulgur::write_checkpoint_file(fulgur::optimizer_state_dict(*b), (dir / "opt.ckpt").string());
    Net second(problem);
    for (size_t i = 0; i < second.params.size(); ++i) {
      torch::NoGradGuard no_grad;
      second.params[i].copy_(first.params[i]);
    }
    auto c = make(second);
    for (auto& g : c->param_groups()) g.options().set_lr(123.0);
    fulgur::load_optimizer_state_dict(*c, fulgur::read_checkpoint_file((dir / "opt.ckpt").string()), "opt.ckpt");
    for (size_t g = 0; g < c->param_groups().size(); ++g)
      CHECK(c->param_groups()[g].options().get_lr() == b->param_groups()[g].options().get_lr());
    const auto rest = train(second, *c, 10);
    for (size_t i = 0; i < whole.size(); ++i) CHECK(torch::equal(rest[i], whole[i].slice(0, 10)));
  }
}

TEST_CASE("optim: Muon refuses a non-matrix in a Muon group and says how to fix it") {
  auto bias = torch::zeros({4}, torch::requires_grad());
  try {
    fo::Muon muon(std::vector<torch::Tensor>{bias});
    FAIL("Muon accepted a 1-D parameter");
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    CHECK(fulgur::test::contains(message, "2-D matrices only"));
    CHECK(fulgur::test::contains(message, "use_muon(false)"));
  }
  CHECK_THROWS_WITH_AS(fo::Muon(std::vector<torch::Tensor>{torch::zeros({2, 2}, torch::requires_grad())},
                                fo::MuonOptions().adjust_lr_fn("sqrt")),
                       doctest::Contains("adjust_lr_fn 'sqrt'"), c10::Error);
}

TEST_CASE("optim: muon_param_groups gives hidden matrices to Muon and the rest to AdamW") {
  struct Model : torch::nn::Module {
    Model() {
      register_module("embed", torch::nn::Embedding(10, 6));
      register_module("hidden", torch::nn::Linear(6, 6));
      register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})));
      register_module("lm_head", torch::nn::Linear(6, 10));
    }
  } model;
  auto groups = fo::muon_param_groups(model, fo::MuonOptions(0.02), fo::MuonOptions(3e-4).weight_decay(0.01));
  REQUIRE(groups.size() == 2);
  const auto params = model.named_parameters();
  const auto& muon = static_cast<const fo::MuonOptions&>(groups[0].options());
  const auto& adamw = static_cast<const fo::MuonOptions&>(groups[1].options());
  CHECK(muon.use_muon());
  CHECK_FALSE(adamw.use_muon());
  CHECK(adamw.lr() == 3e-4);
  REQUIRE(groups[0].params().size() == 1);
  CHECK(groups[0].params()[0].is_same(params["hidden.weight"]));
  CHECK(groups[1].params().size() == 6);  // embed.weight, hidden.bias, norm x2, lm_head x2
  fo::Muon optimizer(groups);             // accepted: every Muon parameter is 2-D
}
