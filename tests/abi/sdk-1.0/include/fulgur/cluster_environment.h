// Where this process sits in a job, read from the variables its launcher set: Fulgur's own
// launcher, torchrun, SLURM's srun, Open MPI's mpirun, or MPICH/Intel MPI (PMI).
#pragma once

#include <fulgur/types.h>

#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace fulgur {

enum class ClusterKind { single_process, fulgur_launcher, torchrun, slurm, open_mpi, mpich };

const char* to_string(ClusterKind kind);

struct ClusterEnvironment {
  ClusterKind kind = ClusterKind::single_process;
  ClusterInfo info;
  bool detected() const { return kind != ClusterKind::single_process; }
};

// Reads one environment variable (tests pass a map instead of the process environment).
using EnvironmentLookup = std::function<std::optional<std::string>(const std::string& name)>;
std::optional<std::string> process_environment(const std::string& name);

// Detection order: explicit torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT:
// torchrun, Fulgur's launcher or set by hand) win over a scheduler's, so torchrun inside a SLURM
// allocation works; then SLURM (not in an interactive `bash` job), Open MPI, MPICH/PMI. Throws
// fulgur::Error(config) naming the variable when a value is malformed or inconsistent.
ClusterEnvironment detect_cluster_environment(const EnvironmentLookup& env = process_environment);

// First host of a SLURM node list: "gpu[003-005,9],login1" -> "gpu003".
std::string first_slurm_host(std::string_view nodelist);

}  // namespace fulgur
