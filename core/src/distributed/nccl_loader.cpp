// Loads the NCCL backend on demand. libtorch's CUDA half (libtorch_cuda.so and the CUDA libraries
// it needs: cuBLAS, cuDNN, NCCL, cuFFT, ...) costs every process ~0.15 s, ~34 k page faults and
// ~0.09 s of system time to load, so nothing that a CPU run loads links it: the cuda accelerator
// plugin brings it in when a run selects it, and the core reaches NCCL through libfulgur_nccl.so,
// opened here the first time a process group asks for it.
#include <fulgur/error.h>

#include <dlfcn.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <filesystem>
#include <string>

#include "nccl_backend.h"

namespace fulgur::detail {

namespace {

// libfulgur_nccl.so lies next to this library, in the build tree and once installed.
std::filesystem::path nccl_library_path() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<const void*>(&make_nccl_backend), &info) == 0 || info.dli_fname == nullptr)
    return "libfulgur_nccl.so";
  return std::filesystem::path(info.dli_fname).parent_path() / "libfulgur_nccl.so";
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  const std::filesystem::path path = nccl_library_path();
  if (!std::filesystem::exists(path))
    throw Error(ErrorKind::config,
                fmt::format("this Fulgur build has no NCCL ({} does not exist: nccl.h or libtorch_cuda was not "
                            "found at configure time); use backend \"gloo\", or rebuild with the CUDA torch wheel "
                            "and the nvidia-nccl wheel next to it",
                            path.string()));
  // Loaded once and kept: the process group lives until exit.
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr)
    throw Error(ErrorKind::config, fmt::format("cannot load the NCCL backend {}: {}", path.string(), ::dlerror()));
  auto entry = reinterpret_cast<NcclEntryPoint>(::dlsym(handle, kNcclEntryPoint));
  if (entry == nullptr)
    throw Error(ErrorKind::config,
                fmt::format("{} has no {}: it belongs to another Fulgur build", path.string(), kNcclEntryPoint));
  const NcclBackendRequest request{&store, rank, size, timeout};
  c10::intrusive_ptr<c10d::Backend> backend;
  std::string error;
  if (!entry(&request, &backend, &error))
    throw Error(ErrorKind::distributed, fmt::format("NCCL process group: {}", error));
  return backend;
}

}  // namespace fulgur::detail
