// Internal: joins this process to the job's c10d process group. The only door to c10d; its
// implementation (c10d_communicator.cpp, nccl_backend.cpp) holds every c10d include of Fulgur.
#pragma once

#include <fulgur/communicator.h>

#include <functional>
#include <memory>
#include <string>

namespace fulgur::detail {

// Rendezvous over a TCPStore at cluster.master_addr:master_port (rank 0 serves it), then a Gloo
// or NCCL backend on `device`. Throws fulgur::Error(distributed) with the cause and a fix.
std::shared_ptr<Communicator> connect_process_group(const ClusterInfo& cluster, const CommunicatorOptions& options);

// Appended to collective errors: who is known to have died (set by the local launcher, which
// sees its children's exit status). Returns "" when nothing is known.
void set_peer_failure_reporter(std::function<std::string()> reporter);
std::string describe_peer_failures();

}  // namespace fulgur::detail
