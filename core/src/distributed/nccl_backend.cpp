// The NCCL process group for CUDA ranks, in a library of its own (libfulgur_nccl.so) that the core
// loads only when a run asks for NCCL: it links libtorch_cuda and with it cuBLAS, cuDNN, NCCL and
// the rest of CUDA, which a CPU run should not pay for at start-up (see nccl_loader.cpp).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <exception>
#include <string>

#include "nccl_backend.h"

extern "C" __attribute__((visibility("default"))) bool fulgur_make_nccl_backend(
    const fulgur::detail::NcclBackendRequest* request, c10::intrusive_ptr<c10d::Backend>* out, std::string* error) {
  try {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = request->timeout;
    *out = c10::make_intrusive<c10d::ProcessGroupNCCL>(*request->store, request->rank, request->size, options);
    return true;
  } catch (const std::exception& e) {
    *error = e.what();
    return false;
  }
}
