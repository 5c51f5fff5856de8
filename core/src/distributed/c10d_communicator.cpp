// Fulgur's Communicator over LibTorch c10d: TCPStore rendezvous, ProcessGroupGloo (CPU) or
// ProcessGroupNCCL (CUDA, nccl_backend.cpp), and c10d's Reducer for gradient buckets that are
// all-reduced while backward still runs. Every c10d include of the project is here or in
// nccl_backend.cpp.
//
// The torch wheel ships ProcessGroupGloo.hpp but not the gloo headers it includes; the Debian
// package libgloo-dev provides them. Only forward-declared gloo types are used from this TU (no
// gloo object is built or called here), so the header version only has to declare the names.
#include "distributed/process_group.h"

#include "distributed/host_staged_backend.h"
#include "distributed/local_launcher.h"
#include "distributed/nccl_backend.h"

#include <fulgur/device_mesh.h>
#include <fulgur/error.h>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <span>
#include <sstream>
#include <string_view>
#include <thread>

namespace fulgur::detail {

namespace {

std::mutex reporter_mutex;
std::function<std::string()> peer_reporter;

std::string first_line(std::string_view text) {
  const auto end = text.find('\n');
  return std::string(text.substr(0, end));
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::min:
      return c10d::ReduceOp::MIN;
    default:  // mean is a sum divided afterwards: Gloo has no AVG
      return c10d::ReduceOp::SUM;
  }
}

// The accelerator device types c10d dispatches collectives for that Gloo cannot move itself.
constexpr c10::DeviceType kHostStagedDeviceTypes[] = {c10::DeviceType::PrivateUse1, c10::DeviceType::XPU,
                                                      c10::DeviceType::MTIA};

bool is_loopback(const std::string& addr) { return addr == "localhost" || addr.starts_with("127."); }

class C10dPendingCollective final : public PendingCollective {
 public:
  C10dPendingCollective(c10::intrusive_ptr<c10d::Work> work, at::Tensor tensor, int64_t divide_by,
                        std::function<void(const std::exception&)> on_error)
      : work_(std::move(work)), tensor_(std::move(tensor)), divide_by_(divide_by), on_error_(std::move(on_error)) {}
  void wait() override {
    try {
      work_->wait();
    } catch (const std::exception& e) {
      on_error_(e);
    }
    if (divide_by_ > 1) tensor_.div_(divide_by_);
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor tensor_;
  int64_t divide_by_;
  std::function<void(const std::exception&)> on_error_;
};

// "Parameter indices which did not receive grad for rank 0: 4 5" -> the names of 4 and 5.
std::string unused_parameter_names(const std::string& message, const std::vector<std::string>& names) {
  const std::string marker = "did not receive grad for rank ";
  const size_t at = message.find(marker);
  if (at == std::string::npos) return "";
  const size_t colon = message.find(':', at);
  std::istringstream indices(message.substr(colon + 1, message.find('\n', colon) - colon - 1));
  std::vector<std::string> found;
  size_t index = 0;
  while (indices >> index) found.push_back(index < names.size() ? names[index] : fmt::format("#{}", index));
  return fmt::format("{}", fmt::join(found, ", "));
}

class ReducerGradientSync final : public GradientSync {
 public:
  ReducerGradientSync(std::shared_ptr<c10d::Reducer> reducer, c10::intrusive_ptr<c10d::ProcessGroup> group,
                      std::vector<std::string> names, int64_t rank)
      : reducer_(std::move(reducer)), group_(std::move(group)), names_(std::move(names)), rank_(rank) {}
  ~ReducerGradientSync() override {
    // The Reducer must go before the process group it references.
    reducer_.reset();
  }
  void prepare_for_forward() override {
    explain_unused([&] {
      reducer_->prepare_for_forward();
      // After the first iteration the buckets follow the order in which gradients became ready
      // (rank 0's order, broadcast): a collective, so every rank calls it every step.
      reducer_->rebuild_buckets();
    });
  }
  void prepare_for_backward(const std::vector<at::Tensor>& outputs) override {
    explain_unused([&] { reducer_->prepare_for_backward(outputs); });
  }

 private:
  // The Reducer's own message speaks of Python's DistributedDataParallel; say it in our terms.
  template <class F>
  void explain_unused(F&& body) {
    try {
      body();
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      if (message.find("Expected to have finished reduction") == std::string::npos) throw;
      const std::string unused = unused_parameter_names(message, names_);
      throw Error(ErrorKind::config,
                  fmt::format("gradient sync: {} got no gradient in the previous step on rank {}, so their "
                              "all-reduce never finished; use every parameter in the loss, freeze them "
                              "(requires_grad = false), or set find_unused_parameters = true under [strategy]",
                              unused.empty() ? "some parameters" : "parameters " + unused, rank_));
    }
  }

  std::shared_ptr<c10d::Reducer> reducer_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::vector<std::string> names_;
  int64_t rank_;
};

// A process group over `store` (already prefixed for it) for `rank` of `size`, on the backend of
// `options`. Defined below.
c10::intrusive_ptr<c10d::ProcessGroup> make_group(const c10::intrusive_ptr<c10d::Store>& root,
                                                  const c10::intrusive_ptr<c10d::Store>& store,
                                                  const std::string& prefix, const ClusterInfo& cluster, int rank,
                                                  int size, const CommunicatorOptions& options);

class C10dCommunicator final : public Communicator, public CommunicatorGroups {
 public:
  C10dCommunicator(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::ProcessGroup> group,
                   std::string backend, int64_t rank, int64_t world, ClusterInfo cluster = {},
                   CommunicatorOptions options = {}, std::vector<int64_t> global_ranks = {})
      : store_(std::move(store)),
        group_(std::move(group)),
        backend_(std::move(backend)),
        rank_(rank),
        world_(world),
        cluster_(std::move(cluster)),
        options_(std::move(options)),
        global_ranks_(std::move(global_ranks)) {
    if (global_ranks_.empty())
      for (int64_t r = 0; r < world_; ++r) global_ranks_.push_back(r);
  }

  // A sub-group over its own store prefix: only its members take part (torch.distributed's
  // new_group over a PrefixStore, without the world-wide agreement Python's needs).
  std::shared_ptr<Communicator> new_group(std::span<const int64_t> ranks, std::string_view name) override {
    const int64_t me = global_ranks_[static_cast<size_t>(rank_)];
    int64_t sub_rank = -1;
    std::vector<int64_t> members(ranks.begin(), ranks.end());
    for (size_t i = 0; i < members.size(); ++i) {
      const bool ascending = i == 0 || members[i] > members[i - 1];
      const bool known = std::find(global_ranks_.begin(), global_ranks_.end(), members[i]) != global_ranks_.end();
      if (!ascending || !known)
        throw Error(ErrorKind::invalid_argument,
                    fmt::format("new_group '{}': ranks ({}) must be ascending, distinct ranks of this group ({})", name,
                                fmt::join(members, ", "), fmt::join(global_ranks_, ", ")));
      if (members[i] == me) sub_rank = static_cast<int64_t>(i);
    }
    if (sub_rank < 0)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("new_group '{}': rank {} is not among the ranks ({}); only members form a group", name,
                              me, fmt::join(members, ", ")));
    const std::string prefix = fmt::format("fulgur/group/{}", name);
    auto group = make_group(store_, c10::make_intrusive<c10d::PrefixStore>(prefix, store_), prefix, cluster_,
                            static_cast<int>(sub_rank), static_cast<int>(members.size()), options_);
    return std::make_shared<C10dCommunicator>(store_, std::move(group), backend_, sub_rank,
                                              static_cast<int64_t>(members.size()), cluster_, options_, members);
  }

  ~C10dCommunicator() override {
    // Rank 0 serves the store: leave together so no rank loses its rendezvous mid-teardown. Not
    // after a failure on this rank: the others are in some other collective, and a barrier here
    // would hang until the timeout or pair with an unrelated one.
    try {
      if (!failed_ && !local_run_failed() && std::uncaught_exceptions() == 0) group_->barrier()->wait();
    } catch (...) {
    }
    group_.reset();
    store_.reset();
  }

  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return world_; }
  std::string backend() const override { return backend_; }

  void all_reduce(at::Tensor& tensor, ReduceOp op) override {
    guarded("all_reduce", [&] {
      std::vector<at::Tensor> tensors{tensor};
      c10d::AllreduceOptions options;
      options.reduceOp = to_c10d(op);
      group_->allreduce(tensors, options)->wait();
    });
    if (op == ReduceOp::mean) tensor.div_(world_);
  }

  std::unique_ptr<PendingCollective> all_reduce_async(at::Tensor& tensor, ReduceOp op) override {
    c10::intrusive_ptr<c10d::Work> work;
    guarded("all_reduce", [&] {
      std::vector<at::Tensor> tensors{tensor};
      c10d::AllreduceOptions options;
      options.reduceOp = to_c10d(op);
      work = group_->allreduce(tensors, options);
    });
    return std::make_unique<C10dPendingCollective>(std::move(work), tensor, op == ReduceOp::mean ? world_ : 1,
                                                   [this](const std::exception& e) { fail("all_reduce", e); });
  }

  std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override {
    std::vector<std::vector<at::Tensor>> outputs(1);
    const at::Tensor input = tensor.contiguous();
    for (int64_t r = 0; r < world_; ++r) outputs[0].push_back(at::empty_like(input));
    guarded("all_gather", [&] {
      std::vector<at::Tensor> inputs{input};
      group_->allgather(outputs, inputs)->wait();
    });
    return outputs[0];
  }

  void broadcast(at::Tensor& tensor, int64_t src) override {
    guarded("broadcast", [&] {
      std::vector<at::Tensor> tensors{tensor};
      c10d::BroadcastOptions options;
      options.rootRank = src;
      group_->broadcast(tensors, options)->wait();
    });
  }

  void broadcast_coalesced(std::vector<at::Tensor>& tensors, int64_t src) override {
    if (tensors.empty()) return;
    guarded("broadcast", [&] {
      torch::NoGradGuard no_grad;  // parameters are leaves that require grad
      c10d::broadcast_coalesced(group_, tensors, size_t{256} << 20, static_cast<int>(src));
    });
  }

  void reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp op) override {
    guarded("reduce_scatter", [&] {
      at::Tensor in = input.contiguous();
      c10d::ReduceScatterOptions options;
      options.reduceOp = to_c10d(op);
      group_->_reduce_scatter_base(output, in, options)->wait();
    });
    if (op == ReduceOp::mean) output.div_(world_);
  }

  std::unique_ptr<PendingCollective> reduce_scatter_async(at::Tensor& output, const at::Tensor& input,
                                                          ReduceOp op) override {
    c10::intrusive_ptr<c10d::Work> work;
    guarded("reduce_scatter", [&] {
      at::Tensor in = input.contiguous();
      c10d::ReduceScatterOptions options;
      options.reduceOp = to_c10d(op);
      work = group_->_reduce_scatter_base(output, in, options);
    });
    return std::make_unique<C10dPendingCollective>(std::move(work), output, op == ReduceOp::mean ? world_ : 1,
                                                   [this](const std::exception& e) { fail("reduce_scatter", e); });
  }

  void all_gather_into_tensor(at::Tensor& output, const at::Tensor& input) override {
    all_gather_into_tensor_async(output, input)->wait();
  }

  std::unique_ptr<PendingCollective> all_gather_into_tensor_async(at::Tensor& output,
                                                                  const at::Tensor& input) override {
    if (output.numel() != input.numel() * world_)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("all_gather_into_tensor: output has {} elements, expected {} ({} ranks x {})",
                              output.numel(), input.numel() * world_, world_, input.numel()));
    c10::intrusive_ptr<c10d::Work> work;
    guarded("all_gather", [&] {
      at::Tensor in = input.contiguous();
      work = group_->_allgather_base(output, in);
    });
    return std::make_unique<C10dPendingCollective>(std::move(work), output, 1,
                                                   [this](const std::exception& e) { fail("all_gather", e); });
  }

  void all_gather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                        const std::vector<at::Tensor>& inputs) override {
    if (outputs.size() != inputs.size())
      throw Error(ErrorKind::invalid_argument, "all_gather_into_tensor_coalesced: outputs and inputs differ in count");
    if (outputs.empty()) return;
    guarded("all_gather", [&] {
      std::vector<at::Tensor> in;
      for (const auto& t : inputs) in.push_back(t.contiguous());
      group_->allgather_into_tensor_coalesced(outputs, in)->wait();
    });
  }

  void reduce_scatter_coalesced(std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                ReduceOp op) override {
    if (outputs.size() != inputs.size())
      throw Error(ErrorKind::invalid_argument, "reduce_scatter_coalesced: outputs and inputs differ in count");
    if (outputs.empty()) return;
    guarded("reduce_scatter", [&] {
      std::vector<at::Tensor> in;
      for (const auto& t : inputs) in.push_back(t.contiguous());
      c10d::ReduceScatterOptions options;
      options.reduceOp = to_c10d(op);
      group_->reduce_scatter_tensor_coalesced(outputs, in, options)->wait();
    });
    if (op == ReduceOp::mean)
      for (auto& t : outputs) t.div_(world_);
  }

  void barrier() override {
    guarded("barrier", [&] { group_->barrier()->wait(); });
  }

  [[noreturn]] void rethrow(const char* operation, std::exception_ptr error) override {
    try {
      std::rethrow_exception(error);
    } catch (const Error&) {
      throw;
    } catch (const c10::DistError& e) {
      fail(operation, e);
    } catch (const std::exception& e) {
      // Gloo's transport errors reach the autograd engine as plain c10::Errors.
      const std::string text = e.what();
      if (text.find("gloo") != std::string::npos || text.find("NCCL") != std::string::npos ||
          !describe_peer_failures().empty())
        fail(operation, e);
      throw;
    }
  }

  std::unique_ptr<GradientSync> make_gradient_sync(std::vector<at::Tensor> parameters,
                                                   const GradientSyncOptions& options) override {
    if (parameters.empty())
      throw Error(ErrorKind::invalid_argument, "gradient sync: the module has no parameters that require grad");
    const int64_t cap = std::max<int64_t>(1, options.bucket_cap_mb) * 1024 * 1024;
    const std::vector<bool> sparse(parameters.size(), false);
    auto [buckets, limits] = c10d::compute_bucket_assignment_by_size(
        parameters,
        {static_cast<size_t>(std::min<int64_t>(c10d::kDefaultFirstBucketBytes, cap)), static_cast<size_t>(cap)},
        sparse);
    // Gradients of the last layers are ready first: their buckets go first (as PyTorch's DDP).
    std::reverse(buckets.begin(), buckets.end());
    std::reverse(limits.begin(), limits.end());
    std::vector<int64_t> limit_list(limits.begin(), limits.end());
    std::shared_ptr<c10d::Reducer> reducer;
    guarded("setting up gradient buckets", [&] {
      reducer = std::make_shared<c10d::Reducer>(std::move(parameters), std::move(buckets), group_, sparse, cap,
                                                options.find_unused_parameters, options.gradient_as_bucket_view,
                                                std::unordered_map<size_t, std::string>{},
                                                std::min<int64_t>(c10d::kDefaultFirstBucketBytes, cap),
                                                /*skip_all_reduce_unused_params=*/false,
                                                /*use_python_reducer=*/false, std::move(limit_list));
    });
    return std::make_unique<ReducerGradientSync>(std::move(reducer), group_, options.parameter_names, rank_);
  }

 private:
  template <class F>
  void guarded(const char* what, F&& body) {
    try {
      body();
    } catch (const std::exception& e) {
      fail(what, e);
    }
  }

  [[noreturn]] void fail(const char* what, const std::exception& e) {
    failed_ = true;
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    const std::string cause = first_line(c10_error ? c10_error->what_without_backtrace() : e.what());
    std::string peers = describe_peer_failures();
    if (peers.empty())
      peers = "a peer process probably ended or is stuck; its launcher (torchrun, srun, mpirun) reports which";
    throw Error(ErrorKind::distributed,
                fmt::format("{} failed on rank {} of {} ({}): {}; {}", what, rank_, world_, backend_, cause, peers));
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string backend_;
  int64_t rank_, world_;
  ClusterInfo cluster_;
  CommunicatorOptions options_;
  std::vector<int64_t> global_ranks_;  // this group's members by global rank
  bool failed_ = false;
};

// torchrun's agent serves a store itself (TORCHELASTIC_USE_AGENT_STORE=True, torch's default) and
// keeps it for its whole life: keys of an earlier group are still there when the group re-forms,
// and no prefix tells the groups apart (TORCHELASTIC_RESTART_COUNT is counted per agent, and a
// group re-formed for a node that joined is no restart at all; pytorch/pytorch#135712). So the
// agent's store only carries where rank 0 of this group serves a store of its own, fresh for the
// group, as without the agent store: an address left by a dead group is refused or answers with
// another nonce, and is read again until this group's rank 0 has written its own.
bool torchelastic_agent_store() {
  const char* v = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  return v && std::string_view(v) == "True";
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

c10::intrusive_ptr<c10d::Store> store_beside_agent_store(const ClusterInfo& cluster,
                                                         const CommunicatorOptions& options) {
  constexpr const char* kAddress = "/worker/fulgur/group_store";
  auto client_options = [](uint16_t port, std::chrono::milliseconds timeout) {
    c10d::TCPStoreOptions o;
    o.port = port;
    o.isServer = false;
    o.waitWorkers = false;
    o.timeout = timeout;
    return o;
  };
  auto agent = c10::make_intrusive<c10d::TCPStore>(
      cluster.master_addr, client_options(static_cast<uint16_t>(cluster.master_port), options.timeout));
  if (cluster.global_rank == 0) {
    c10d::TCPStoreOptions own;
    own.port = 0;  // any free port
    own.isServer = true;
    own.numWorkers = static_cast<size_t>(cluster.world_size);
    own.waitWorkers = false;
    own.timeout = options.timeout;
    auto store = c10::make_intrusive<c10d::TCPStore>(cluster.master_addr, own);
    const std::string nonce =
        fmt::format("{}-{}", ::getpid(), std::chrono::steady_clock::now().time_since_epoch().count());
    store->set("fulgur/nonce", bytes(nonce));
    agent->set(kAddress, bytes(fmt::format("{} {}", store->getPort(), nonce)));
    return store;
  }
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  std::string last_error = "no address published yet";
  while (true) {
    const std::vector<uint8_t> published = agent->get(kAddress);  // waits for the first group's rank 0
    std::istringstream in(std::string(published.begin(), published.end()));
    int port = 0;
    std::string nonce;
    in >> port >> nonce;
    try {
      auto store = c10::make_intrusive<c10d::TCPStore>(
          cluster.master_addr, client_options(static_cast<uint16_t>(port), std::chrono::milliseconds(2000)));
      const std::vector<uint8_t> answer = store->get("fulgur/nonce");
      if (std::string(answer.begin(), answer.end()) == nonce) {
        store->setTimeout(options.timeout);
        return store;
      }
      last_error = fmt::format("the store at port {} belongs to another group", port);
    } catch (const std::exception& e) {
      last_error = e.what();  // a dead group's address
    }
    if (std::chrono::steady_clock::now() > deadline)
      throw Error(ErrorKind::distributed,
                  fmt::format("rank {} of {} found no store of this group's rank 0 through torchrun's agent store at "
                              "{}:{} within {} s (last: {}); is rank 0 running?",
                              cluster.global_rank, cluster.world_size, cluster.master_addr, cluster.master_port,
                              std::chrono::duration_cast<std::chrono::seconds>(options.timeout).count(),
                              first_line(last_error)));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

c10::intrusive_ptr<c10d::Store> rendezvous(const ClusterInfo& cluster, const CommunicatorOptions& options) {
  c10d::TCPStoreOptions store_options;  // fields assigned one by one: torch appends new ones
  store_options.port = static_cast<uint16_t>(cluster.master_port);
  store_options.isServer = cluster.global_rank == 0;
  store_options.numWorkers = static_cast<size_t>(cluster.world_size);
  store_options.waitWorkers = true;
  store_options.timeout = options.timeout;
  try {
    if (torchelastic_agent_store()) return store_beside_agent_store(cluster, options);
    return c10::make_intrusive<c10d::TCPStore>(cluster.master_addr, store_options);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    const std::string cause = first_line(c10_error ? c10_error->what_without_backtrace() : e.what());
    const bool in_use = cause.find("EADDRINUSE") != std::string::npos || cause.find("in use") != std::string::npos;
    if (in_use)
      throw Error(ErrorKind::distributed,
                  fmt::format("rank 0 cannot serve the rendezvous on {}:{}: the port is already in use ({}); set "
                              "MASTER_PORT to a free port, or leave it unset under `devices = N` so that Fulgur "
                              "picks one",
                              cluster.master_addr, cluster.master_port, cause));
    throw Error(ErrorKind::distributed,
                fmt::format("rank {} of {} could not join the rendezvous at {}:{} within {} s: {}; check that "
                            "every rank was started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE and that "
                            "rank 0 is running",
                            cluster.global_rank, cluster.world_size, cluster.master_addr, cluster.master_port,
                            std::chrono::duration_cast<std::chrono::seconds>(options.timeout).count(), cause));
  }
}

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const ClusterInfo& cluster, int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
  // Like torch.distributed: GLOO_SOCKET_IFNAME picks the interface. A single-node job talks over
  // loopback, which exists in every container (the hostname often resolves to an unusable address).
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  else if (cluster.local_world_size == cluster.world_size && is_loopback(cluster.master_addr))
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  else
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, gloo_options);
}

c10::intrusive_ptr<c10d::ProcessGroup> make_group(const c10::intrusive_ptr<c10d::Store>& root,
                                                  const c10::intrusive_ptr<c10d::Store>& prefixed,
                                                  const std::string& prefix, const ClusterInfo& cluster, int rank,
                                                  int size, const CommunicatorOptions& options) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(prefixed, rank, size);
  try {
    if (options.backend == "gloo") {
      auto gloo = make_gloo_backend(prefixed, cluster, rank, size, options.timeout);
      group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
      group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
      // Gloo also moves CUDA tensors (through host memory), as torch.distributed allows. Any
      // other accelerator's tensors (a PrivateUse1 plugin device, XPU, ...) are staged through
      // host memory around Gloo: without it c10d finds no backend for their device type.
      group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);
      const auto staged = make_host_staged_backend(gloo);
      for (c10::DeviceType type : kHostStagedDeviceTypes)
        group->setBackend(type, c10d::ProcessGroup::BackendType::CUSTOM, staged);
    } else {
      auto nccl = make_nccl_backend(prefixed, rank, size, options.timeout);
      group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
      group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
      // Host tensors (decisions, strings, metrics kept on the CPU) travel over Gloo, as with
      // torch.distributed's "cpu:gloo,cuda:nccl".
      auto cpu_store = c10::make_intrusive<c10d::PrefixStore>(prefix + "_cpu", root);
      group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO,
                        make_gloo_backend(cpu_store, cluster, rank, size, options.timeout));
    }
    group->setGroupName(prefix == "fulgur/default_pg" ? "0" : prefix);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    throw Error(ErrorKind::distributed,
                fmt::format("rank {} of {} could not create the {} process group '{}': {}", rank, size, options.backend,
                            prefix, first_line(c10_error ? c10_error->what_without_backtrace() : e.what())));
  }
  return group;
}

}  // namespace

void set_peer_failure_reporter(std::function<std::string()> reporter) {
  std::lock_guard lock(reporter_mutex);
  peer_reporter = std::move(reporter);
}

std::string describe_peer_failures() {
  std::function<std::string()> reporter;
  {
    std::lock_guard lock(reporter_mutex);
    reporter = peer_reporter;
  }
  return reporter ? reporter() : std::string();
}

std::shared_ptr<Communicator> connect_process_group(const ClusterInfo& cluster, const CommunicatorOptions& options) {
  if (options.backend != "gloo" && options.backend != "nccl")
    throw Error(
        ErrorKind::config,
        fmt::format("unknown process group backend '{}': use \"gloo\" (CPU) or \"nccl\" (CUDA)", options.backend));

  auto store = rendezvous(cluster, options);
  const int rank = static_cast<int>(cluster.global_rank);
  const int size = static_cast<int>(cluster.world_size);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("fulgur/default_pg", store);
  auto group = make_group(store, prefixed, "fulgur/default_pg", cluster, rank, size, options);
  return std::make_shared<C10dCommunicator>(store, group, options.backend, rank, size, cluster, options);
}

}  // namespace fulgur::detail
