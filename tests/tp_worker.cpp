// The program every rank of the tensor-parallel tests runs (tests/tensor_parallel_test.cpp): it
// joins the job's process group through the core's c10d door, builds a DeviceMesh (dp x tp, tp = 2)
// and compares tensor-parallel layers against the same model computed whole in this process.
//
//   fulgur_tp_worker <scenario>     scenario: mesh | mlp | mlp_sp | vocab | rng
//   RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them; FULGUR_TEST_TP_SIZE (2):
//   the mesh is (WORLD_SIZE / tp) x tp.
//
// Prints `diff <name> <max abs difference>` for what must match and `check <name> <0|1>` for
// facts; the test requires every named line and judges them. Exit code 0 unless it threw.
#include <fulgur/communicator.h>
#include <fulgur/device_mesh.h>
#include <fulgur/error.h>
#include <fulgur/nn/tensor_parallel.h>

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "../core/src/distributed/process_group.h"

namespace {

namespace tp = fulgur::nn;

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::stoll(v) : fallback;
}

void diff(const std::string& name, const at::Tensor& a, const at::Tensor& b) {
  const double d = (a.detach().to(at::kDouble) - b.detach().to(at::kDouble)).abs().max().item<double>();
  std::printf("diff %s %.3g\n", name.c_str(), d);
}
void check(const std::string& name, bool value) { std::printf("check %s %d\n", name.c_str(), value ? 1 : 0); }

at::Tensor chunk(const at::Tensor& whole, const fulgur::DeviceMesh& mesh, int64_t dim) {
  return whole.chunk(mesh.size("tp"), dim)[static_cast<size_t>(mesh.local_rank("tp"))];
}

// Which global ranks share this rank's group, checked against the layout written out by hand and
// against an all-reduce of the global ranks over each group.
void mesh_scenario(fulgur::DeviceMesh& mesh) {
  const int64_t r = mesh.global_rank(), tp_size = mesh.size("tp"), dp_size = mesh.size("dp");
  std::vector<int64_t> tp_expected, dp_expected;
  for (int64_t i = 0; i < tp_size; ++i) tp_expected.push_back(r - r % tp_size + i);
  for (int64_t i = 0; i < dp_size; ++i) dp_expected.push_back(r % tp_size + i * tp_size);
  check("mesh_tp_ranks", mesh.group_ranks("tp") == tp_expected);
  check("mesh_dp_ranks", mesh.group_ranks("dp") == dp_expected);
  check("mesh_coordinate", mesh.coordinate() == std::vector<int64_t>{r / tp_size, r % tp_size});
  check("mesh_local_ranks", mesh.group("tp")->rank() == r % tp_size && mesh.group("dp")->rank() == r / tp_size);
  for (const char* name : {"tp", "dp"}) {
    at::Tensor value = torch::tensor({static_cast<double>(r)}, at::kDouble);
    mesh.group(name)->all_reduce(value, fulgur::ReduceOp::sum);
    double expected = 0;
    for (int64_t m : mesh.group_ranks(name)) expected += static_cast<double>(m);
    check(fmt::format("mesh_{}_all_reduce", name), value.item<double>() == expected);
  }
}

// Column -> GELU -> row-parallel MLP (optionally behind a LayerNorm, sequence parallel) against the
// whole MLP: outputs, every parameter's gradient (as the shard PyTorch would hold) and the input's.
void mlp_scenario(fulgur::DeviceMesh& mesh, bool sequence_parallel) {
  const auto group = mesh.group("tp");
  constexpr int64_t S = 8, B = 2, H = 16, F = 32, O = 8;
  torch::manual_seed(7);
  torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({H}));
  torch::nn::Linear fc1(H, F), fc2(F, O);
  {
    torch::NoGradGuard no_grad;
    norm->weight.uniform_(0.5, 1.5);
    norm->bias.uniform_(-0.5, 0.5);
  }
  const at::Tensor x = torch::randn({S, B, H}).requires_grad_();
  const at::Tensor probe = torch::randn({S, B, O});
  const at::Tensor h = sequence_parallel ? norm(x) : x;
  const at::Tensor y = fc2(torch::gelu(fc1(h)));
  (y * probe).sum().backward();

  // The same seed draws the same whole weights, of which each layer keeps its chunk.
  torch::manual_seed(7);
  torch::nn::LayerNorm tp_norm(torch::nn::LayerNormOptions({H}));
  tp::ColumnParallelLinear col(tp::ParallelLinearOptions(H, F).group(group).sequence_parallel(sequence_parallel));
  tp::RowParallelLinear row(tp::ParallelLinearOptions(F, O).group(group).sequence_parallel(sequence_parallel));
  {
    torch::NoGradGuard no_grad;
    tp_norm->weight.copy_(norm->weight);
    tp_norm->bias.copy_(norm->bias);
  }
  diff("init_col_weight", col->weight, chunk(fc1->weight, mesh, 0));
  diff("init_row_weight", row->weight, chunk(fc2->weight, mesh, 1));
  diff("init_row_bias", row->bias, fc2->bias);

  at::Tensor x_local = (sequence_parallel ? chunk(x, mesh, 0) : x).detach().clone().requires_grad_();
  at::Tensor h_local = x_local;
  if (sequence_parallel)
    h_local = torch::layer_norm(x_local, {H}, tp::replicated_parameter(tp_norm->weight, group.get()),
                                tp::replicated_parameter(tp_norm->bias, group.get()));
  const at::Tensor y_local = row(torch::gelu(col(h_local)));
  // Sequence parallel: each rank's loss covers its part of the sequence; their sum is the whole
  // loss. Otherwise every rank computes the whole loss (Megatron's convention).
  (y_local * (sequence_parallel ? chunk(probe, mesh, 0) : probe)).sum().backward();

  diff("output", y_local, sequence_parallel ? chunk(y, mesh, 0) : y);
  diff("grad_col_weight", col->weight.grad(), chunk(fc1->weight.grad(), mesh, 0));
  diff("grad_col_bias", col->bias.grad(), chunk(fc1->bias.grad(), mesh, 0));
  diff("grad_row_weight", row->weight.grad(), chunk(fc2->weight.grad(), mesh, 1));
  diff("grad_row_bias", row->bias.grad(), fc2->bias.grad());
  diff("grad_input", x_local.grad(), sequence_parallel ? chunk(x.grad(), mesh, 0) : x.grad());
  if (sequence_parallel) {
    diff("grad_norm_weight", tp_norm->weight.grad(), norm->weight.grad());
    diff("grad_norm_bias", tp_norm->bias.grad(), norm->bias.grad());
  }

  // Clipping by the total norm counts each shard once and each replicated parameter once.
  std::vector<at::Tensor> whole_parameters = fc1->parameters();
  for (const auto& p : fc2->parameters()) whole_parameters.push_back(p);
  if (sequence_parallel)
    for (const auto& p : norm->parameters()) whole_parameters.push_back(p);
  const double whole_norm = torch::nn::utils::clip_grad_norm_(whole_parameters, 0.5);
  torch::nn::Module model;
  model.register_module("norm", tp_norm);
  model.register_module("col", col);
  model.register_module("row", row);
  const double tp_grad_norm = tp::clip_grad_norm_tensor_parallel(model, 0.5, group.get());
  std::printf("diff grad_norm_relative %.3g\n", std::abs(tp_grad_norm - whole_norm) / std::max(1.0, whole_norm));
  diff("clipped_col_weight", col->weight.grad(), chunk(fc1->weight.grad(), mesh, 0));
  diff("clipped_row_weight", row->weight.grad(), chunk(fc2->weight.grad(), mesh, 1));
  diff("clipped_row_bias", row->bias.grad(), fc2->bias.grad());
}

// Vocab-parallel embedding, a column-parallel head without gather_output, and the vocab-parallel
// cross-entropy against Embedding -> Linear -> cross_entropy, with and without sequence parallelism.
void vocab_scenario(fulgur::DeviceMesh& mesh) {
  const auto group = mesh.group("tp");
  constexpr int64_t S = 8, B = 2, V = 16, D = 8;
  for (bool sequence_parallel : {false, true}) {
    const std::string tag = sequence_parallel ? "sp_" : "";
    torch::manual_seed(11);
    torch::nn::Embedding embedding(V, D);
    torch::nn::Linear head(torch::nn::LinearOptions(D, V).bias(false));
    const at::Tensor ids = torch::randint(V, {S, B});
    const at::Tensor target = torch::randint(V, {S, B});
    const at::Tensor logits = head(embedding(ids));
    const at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({S * B, V}), target.reshape({-1}));
    loss.backward();

    torch::manual_seed(11);
    tp::VocabParallelEmbedding tp_embedding(
        tp::VocabParallelEmbeddingOptions(V, D).group(group).sequence_parallel(sequence_parallel));
    tp::ColumnParallelLinear tp_head(
        tp::ParallelLinearOptions(D, V).bias(false).group(group).sequence_parallel(sequence_parallel));
    diff(tag + "init_embedding", tp_embedding->weight, chunk(embedding->weight, mesh, 0));
    diff(tag + "init_head", tp_head->weight, chunk(head->weight, mesh, 0));
    const at::Tensor local_logits = tp_head(tp_embedding(ids));  // [S, B, V/tp]: never gathered
    check(tag + "logits_stay_split", local_logits.size(-1) == V / mesh.size("tp"));
    diff(tag + "logits", local_logits, chunk(logits, mesh, -1));
    const at::Tensor tp_loss = tp::vocab_parallel_cross_entropy(local_logits, target, group.get()).mean();
    tp_loss.backward();
    diff(tag + "loss", tp_loss, loss);
    diff(tag + "grad_embedding", tp_embedding->weight.grad(), chunk(embedding->weight.grad(), mesh, 0));
    diff(tag + "grad_head", tp_head->weight.grad(), chunk(head->weight.grad(), mesh, 0));
  }
}

// Dropout masks: different across tp ranks inside fork(), equal outside it, and the default
// stream is untouched by the forked region.
void rng_scenario(fulgur::DeviceMesh& mesh) {
  const auto group = mesh.group("tp");
  auto masks = [&](const at::Tensor& mask) { return group->all_gather(mask); };
  torch::manual_seed(42);
  tp::TensorParallelRng rng(1234, mesh.local_rank("tp"));
  at::Tensor sharded, sharded_again;
  {
    auto scope = rng.fork();
    sharded = torch::dropout(torch::ones({256}), 0.5, true);
  }
  const at::Tensor replicated = torch::dropout(torch::ones({256}), 0.5, true);
  {
    auto scope = rng.fork();
    sharded_again = torch::dropout(torch::ones({256}), 0.5, true);
  }
  const auto all_sharded = masks(sharded);
  const auto all_replicated = masks(replicated);
  check("rng_sharded_differs_across_tp", !all_sharded[0].equal(all_sharded[1]));
  check("rng_replicated_equal_across_tp", all_replicated[0].equal(all_replicated[1]));
  check("rng_stream_advances", !sharded.equal(sharded_again));
  torch::manual_seed(42);
  check("rng_default_stream_untouched", torch::dropout(torch::ones({256}), 0.5, true).equal(replicated));
  tp::TensorParallelRng again(1234, mesh.local_rank("tp"));
  {
    auto scope = again.fork();
    check("rng_sharded_reproducible", torch::dropout(torch::ones({256}), 0.5, true).equal(sharded));
  }
}

// 2D training: a sequence-parallel LayerNorm + column/row MLP on (dp x tp), the batch split over
// dp (gradients summed over the dp group), norm clipping over the shards, 20 AdamW steps, against
// the whole model trained on the whole batch in this process.
void train_scenario(fulgur::Communicator& world, fulgur::DeviceMesh& mesh) {
  const auto group = mesh.group("tp");
  const auto dp = mesh.group("dp");
  constexpr int64_t S = 8, B = 4, H = 16, F = 32, O = 8, steps = 20;
  const double elements = static_cast<double>(S * B * O);
  torch::manual_seed(5);
  torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({H}));
  torch::nn::Linear fc1(H, F), fc2(F, O);
  const at::Tensor x = torch::randn({S, B, H});
  const at::Tensor target = torch::randn({S, B, O});
  std::vector<at::Tensor> whole = norm->parameters();
  for (auto* m : {&fc1, &fc2})
    for (const auto& p : (*m)->parameters()) whole.push_back(p);
  const at::Tensor initial = fc1->weight.detach().clone();
  torch::optim::AdamW whole_optimizer(whole, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));

  torch::manual_seed(5);
  torch::nn::LayerNorm tp_norm(torch::nn::LayerNormOptions({H}));
  tp::ColumnParallelLinear col(tp::ParallelLinearOptions(H, F).group(group).sequence_parallel(true));
  tp::RowParallelLinear row(tp::ParallelLinearOptions(F, O).group(group).sequence_parallel(true));
  torch::nn::Module model;
  model.register_module("norm", tp_norm);
  model.register_module("col", col);
  model.register_module("row", row);
  torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  // This rank's part of the data: its dp slice of the batch, its tp slice of the sequence.
  auto local = [&](const at::Tensor& t) {
    return chunk(t.chunk(mesh.size("dp"), 1)[static_cast<size_t>(mesh.local_rank("dp"))], mesh, 0).contiguous();
  };
  const at::Tensor x_local = local(x), target_local = local(target);

  double whole_loss = 0, tp_loss = 0;
  for (int64_t step = 0; step < steps; ++step) {
    whole_optimizer.zero_grad();
    const at::Tensor y = fc2(torch::gelu(fc1(norm(x))));
    const at::Tensor loss = (y - target).pow(2).sum() / elements;
    loss.backward();
    torch::nn::utils::clip_grad_norm_(whole, 0.05);
    whole_optimizer.step();
    whole_loss = loss.item<double>();

    optimizer.zero_grad();
    const at::Tensor h = torch::layer_norm(x_local, {H}, tp::replicated_parameter(tp_norm->weight, group.get()),
                                           tp::replicated_parameter(tp_norm->bias, group.get()));
    const at::Tensor local_loss = (row(torch::gelu(col(h))) - target_local).pow(2).sum() / elements;
    local_loss.backward();
    // Data parallelism: the dp replicas' gradients (each a sum over its slice) add up.
    for (auto& p : model.parameters()) dp->all_reduce(p.mutable_grad(), fulgur::ReduceOp::sum);
    const double grad_norm = tp::clip_grad_norm_tensor_parallel(model, 0.05, group.get());
    if (step == 0) check("train_clipping_engaged", grad_norm > 0.05);
    optimizer.step();
    at::Tensor total = local_loss.detach().reshape({1}).clone();
    world.all_reduce(total, fulgur::ReduceOp::sum);
    tp_loss = total.item<double>();
  }
  diff("train_loss", torch::tensor(tp_loss), torch::tensor(whole_loss));
  diff("train_col_weight", col->weight, chunk(fc1->weight, mesh, 0));
  diff("train_col_bias", col->bias, chunk(fc1->bias, mesh, 0));
  diff("train_row_weight", row->weight, chunk(fc2->weight, mesh, 1));
  diff("train_row_bias", row->bias, fc2->bias);
  diff("train_norm_weight", tp_norm->weight, norm->weight);
  diff("train_norm_bias", tp_norm->bias, norm->bias);
  // The weights moved (the comparison is not of two untouched initializations).
  check("train_weights_moved", (fc1->weight - initial).abs().max().item<double>() > 1e-2);
}

// What a wrong size or layout says.
void errors_scenario(fulgur::Communicator& world, fulgur::DeviceMesh& mesh) {
  auto message = [](auto&& body) -> std::string {
    try {
      body();
    } catch (const fulgur::Error& e) {
      return e.kind() == fulgur::ErrorKind::invalid_argument ? e.what() : "";
    }
    return "";
  };
  const std::string column =
      message([&] { tp::ColumnParallelLinear(tp::ParallelLinearOptions(16, 33).group(mesh.group("tp"))); });
  check("error_column_split", column.find("out_features = 33 does not split into 2 equal shards") != std::string::npos);
  const std::string embedding =
      message([&] { tp::VocabParallelEmbedding(tp::VocabParallelEmbeddingOptions(15, 4).group(mesh.group("tp"))); });
  check("error_vocab_split", embedding.find("num_embeddings = 15") != std::string::npos);
  const std::string layout = message([&] { fulgur::DeviceMesh::create(world, {3, 2}, {"dp", "tp"}); });
  check("error_mesh_size", layout.find("the sizes' product must equal the number of processes") != std::string::npos);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: fulgur_tp_worker mesh|mlp|mlp_sp|vocab|rng|errors|train\n";
    return 2;
  }
  try {
    const std::string scenario = argv[1];
    fulgur::ClusterInfo cluster;
    cluster.global_rank = env_int("RANK", 0);
    cluster.world_size = env_int("WORLD_SIZE", 1);
    cluster.local_rank = cluster.global_rank;
    cluster.local_world_size = cluster.world_size;
    if (const char* addr = std::getenv("MASTER_ADDR")) cluster.master_addr = addr;
    cluster.master_port = env_int("MASTER_PORT", 29500);
    torch::set_num_threads(1);
    auto world = fulgur::detail::connect_process_group(
        cluster, fulgur::CommunicatorOptions().set_timeout(std::chrono::seconds(60)));
    const int64_t tp_size = env_int("FULGUR_TEST_TP_SIZE", 2);
    auto mesh = fulgur::DeviceMesh::create(*world, {cluster.world_size / tp_size, tp_size}, {"dp", "tp"});
    if (scenario == "mesh")
      mesh_scenario(mesh);
    else if (scenario == "mlp" || scenario == "mlp_sp")
      mlp_scenario(mesh, scenario == "mlp_sp");
    else if (scenario == "vocab")
      vocab_scenario(mesh);
    else if (scenario == "train")
      train_scenario(*world, mesh);
    else if (scenario == "errors")
      errors_scenario(*world, mesh);
    else if (scenario == "rng")
      rng_scenario(mesh);
    else
      throw std::runtime_error("unknown scenario " + scenario);
    std::fflush(stdout);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::cerr << "fulgur_tp_worker: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
