#include <fulgur/cluster_environment.h>
#include <fulgur/error.h>

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>

namespace fulgur {
namespace {

// torch.distributed's default rendezvous port, for launchers that carry none (mpirun).
constexpr int64_t kDefaultMasterPort = 29500;

class Reader {
 public:
  Reader(const EnvironmentLookup& env, const char* launcher) : env_(env), launcher_(launcher) {}

  bool has(const std::string& name) const { return env_(name).has_value(); }
  std::optional<std::string> text(const std::string& name) const { return env_(name); }

  std::optional<int64_t> integer(const std::string& name) const {
    const auto value = env_(name);
    if (!value) return std::nullopt;
    int64_t parsed = 0;
    const char* end = value->data() + value->size();
    auto [ptr, ec] = std::from_chars(value->data(), end, parsed);
    if (ec != std::errc() || ptr != end || parsed < 0)
      throw Error(ErrorKind::config,
                  fmt::format("{} environment: {}=\"{}\" is not a non-negative integer", launcher_, name, *value));
    return parsed;
  }

  int64_t required(const std::string& name) const {
    if (auto v = integer(name)) return *v;
    throw Error(
        ErrorKind::config,
        fmt::format("{} environment: {} is not set (the launcher sets it; set it by hand otherwise)", launcher_, name));
  }

 private:
  const EnvironmentLookup& env_;
  const char* launcher_;
};

void validate(const ClusterEnvironment& c) {
  const ClusterInfo& i = c.info;
  const char* who = to_string(c.kind);
  auto fail = [&](std::string what) { throw Error(ErrorKind::config, fmt::format("{} environment: {}", who, what)); };
  if (i.world_size < 1) fail("the world size is 0");
  if (i.global_rank >= i.world_size)
    fail(fmt::format("rank {} is not below the world size {}", i.global_rank, i.world_size));
  if (i.local_world_size < 1 || i.local_world_size > i.world_size)
    fail(fmt::format("local world size {} must be between 1 and the world size {}", i.local_world_size, i.world_size));
  if (i.local_rank >= i.local_world_size)
    fail(fmt::format("local rank {} is not below the local world size {}", i.local_rank, i.local_world_size));
  if (i.master_port < 1 || i.master_port > 65535) fail(fmt::format("master port {} is not a TCP port", i.master_port));
  if (i.master_addr.empty()) fail("the master address is empty");
}

std::optional<ClusterEnvironment> torchrun_like(const EnvironmentLookup& env) {
  if (!env("RANK") || !env("WORLD_SIZE") || !env("MASTER_ADDR") || !env("MASTER_PORT")) return std::nullopt;
  ClusterEnvironment c;
  c.kind = env("FULGUR_LAUNCHER") ? ClusterKind::fulgur_launcher : ClusterKind::torchrun;
  Reader r(env, to_string(c.kind));
  c.info.global_rank = r.required("RANK");
  c.info.world_size = r.required("WORLD_SIZE");
  // By hand, on one node, RANK and WORLD_SIZE are enough.
  c.info.local_rank = r.integer("LOCAL_RANK").value_or(c.info.global_rank);
  c.info.local_world_size = r.integer("LOCAL_WORLD_SIZE").value_or(c.info.world_size);
  c.info.node_rank = r.integer("GROUP_RANK").value_or(0);
  c.info.master_addr = *r.text("MASTER_ADDR");
  c.info.master_port = r.required("MASTER_PORT");
  return c;
}

// "2(x3),1" -> 2: tasks on the first node (all nodes in the common homogeneous case).
std::optional<int64_t> first_tasks_per_node(const std::optional<std::string>& spec) {
  if (!spec || spec->empty()) return std::nullopt;
  int64_t n = 0;
  auto [ptr, ec] = std::from_chars(spec->data(), spec->data() + spec->size(), n);
  if (ec != std::errc() || n < 1) return std::nullopt;
  return n;
}

std::optional<ClusterEnvironment> slurm(const EnvironmentLookup& env) {
  if (!env("SLURM_NTASKS") || !env("SLURM_PROCID")) return std::nullopt;
  // Lightning's rule: in an interactive allocation (`salloc` then a shell) the shell is not a task.
  if (auto job = env("SLURM_JOB_NAME"); job && (*job == "bash" || *job == "interactive")) return std::nullopt;
  ClusterEnvironment c;
  c.kind = ClusterKind::slurm;
  Reader r(env, "SLURM");
  c.info.global_rank = r.required("SLURM_PROCID");
  c.info.world_size = r.required("SLURM_NTASKS");
  c.info.local_rank = r.integer("SLURM_LOCALID").value_or(0);
  c.info.node_rank = r.integer("SLURM_NODEID").value_or(0);
  auto per_node = r.integer("SLURM_NTASKS_PER_NODE");
  if (!per_node) per_node = first_tasks_per_node(env("SLURM_TASKS_PER_NODE"));
  c.info.local_world_size = per_node.value_or(c.info.world_size);
  if (auto addr = env("MASTER_ADDR")) {
    c.info.master_addr = *addr;
  } else {
    auto nodes = env("SLURM_JOB_NODELIST");
    if (!nodes) nodes = env("SLURM_NODELIST");
    if (!nodes)
      throw Error(ErrorKind::config, "SLURM environment: SLURM_JOB_NODELIST is not set and neither is MASTER_ADDR");
    c.info.master_addr = first_slurm_host(*nodes);
  }
  if (auto port = r.integer("MASTER_PORT")) {
    c.info.master_port = *port;
  } else {
    // Every task of the job derives the same port from the job id (as Lightning does), and
    // concurrent jobs on one node rarely collide.
    const auto job = env("SLURM_JOB_ID");
    if (!job) throw Error(ErrorKind::config, "SLURM environment: SLURM_JOB_ID is not set and neither is MASTER_PORT");
    const std::string last4 = job->size() > 4 ? job->substr(job->size() - 4) : *job;
    int64_t tail = 0;
    std::from_chars(last4.data(), last4.data() + last4.size(), tail);
    c.info.master_port = 15000 + tail;
  }
  return c;
}

// mpirun carries no rendezvous address: one node talks over loopback; several need MASTER_ADDR.
void mpi_rendezvous(ClusterEnvironment& c, const Reader& r, const char* export_hint) {
  if (auto addr = r.text("MASTER_ADDR")) {
    c.info.master_addr = *addr;
  } else if (c.info.local_world_size == c.info.world_size) {
    c.info.master_addr = "127.0.0.1";
  } else {
    throw Error(ErrorKind::config,
                fmt::format("{} environment: a job over several nodes needs MASTER_ADDR (the host of rank 0); "
                            "pass it to every rank, e.g. {} MASTER_ADDR=<host>",
                            to_string(c.kind), export_hint));
  }
  c.info.master_port = r.integer("MASTER_PORT").value_or(kDefaultMasterPort);
}

std::optional<ClusterEnvironment> open_mpi(const EnvironmentLookup& env) {
  if (!env("OMPI_COMM_WORLD_RANK") || !env("OMPI_COMM_WORLD_SIZE")) return std::nullopt;
  ClusterEnvironment c;
  c.kind = ClusterKind::open_mpi;
  Reader r(env, "Open MPI");
  c.info.global_rank = r.required("OMPI_COMM_WORLD_RANK");
  c.info.world_size = r.required("OMPI_COMM_WORLD_SIZE");
  c.info.local_rank = r.integer("OMPI_COMM_WORLD_LOCAL_RANK").value_or(0);
  c.info.local_world_size = r.integer("OMPI_COMM_WORLD_LOCAL_SIZE").value_or(c.info.world_size);
  c.info.node_rank = r.integer("OMPI_COMM_WORLD_NODE_RANK").value_or(0);
  mpi_rendezvous(c, r, "mpirun -x");
  return c;
}

std::optional<ClusterEnvironment> mpich(const EnvironmentLookup& env) {
  if (!env("PMI_RANK") || !env("PMI_SIZE")) return std::nullopt;
  ClusterEnvironment c;
  c.kind = ClusterKind::mpich;
  Reader r(env, "MPICH");
  c.info.global_rank = r.required("PMI_RANK");
  c.info.world_size = r.required("PMI_SIZE");
  c.info.local_rank = r.integer("MPI_LOCALRANKID").value_or(0);
  c.info.local_world_size = r.integer("MPI_LOCALNRANKS").value_or(c.info.world_size);
  // Hydra places ranks in blocks per node by default.
  c.info.node_rank = c.info.global_rank / std::max<int64_t>(1, c.info.local_world_size);
  mpi_rendezvous(c, r, "mpiexec -genv");
  return c;
}

}  // namespace

const char* to_string(ClusterKind kind) {
  switch (kind) {
    case ClusterKind::single_process:
      return "single process";
    case ClusterKind::fulgur_launcher:
      return "Fulgur launcher";
    case ClusterKind::torchrun:
      return "torchrun";
    case ClusterKind::slurm:
      return "SLURM";
    case ClusterKind::open_mpi:
      return "Open MPI";
    case ClusterKind::mpich:
      return "MPICH";
  }
  return "unknown";
}

std::optional<std::string> process_environment(const std::string& name) {
  if (const char* v = std::getenv(name.c_str())) return std::string(v);
  return std::nullopt;
}

std::string first_slurm_host(std::string_view nodelist) {
  // The first entry ends at the first comma outside brackets.
  size_t depth = 0, end = 0;
  for (; end < nodelist.size(); ++end) {
    if (nodelist[end] == '[') ++depth;
    if (nodelist[end] == ']' && depth > 0) --depth;
    if (nodelist[end] == ',' && depth == 0) break;
  }
  const std::string_view entry = nodelist.substr(0, end);
  const size_t open = entry.find('[');
  if (open == std::string_view::npos) return std::string(entry);
  const size_t close = entry.find(']', open);
  if (close == std::string_view::npos)
    throw Error(ErrorKind::config, fmt::format("SLURM node list \"{}\" has an unclosed '['", nodelist));
  const std::string_view ranges = entry.substr(open + 1, close - open - 1);
  const size_t first_end = ranges.find_first_of(",-");
  return std::string(entry.substr(0, open)) + std::string(ranges.substr(0, first_end)) +
         std::string(entry.substr(close + 1));
}

ClusterEnvironment detect_cluster_environment(const EnvironmentLookup& env) {
  std::optional<ClusterEnvironment> found = torchrun_like(env);
  if (!found) found = slurm(env);
  if (!found) found = open_mpi(env);
  if (!found) found = mpich(env);
  if (!found) return ClusterEnvironment{};
  validate(*found);
  return *found;
}

}  // namespace fulgur
