// The NCCL process group for CUDA ranks. Separate from c10d_communicator.cpp because its headers
// need CUDA's and NCCL's (the nvidia-nccl wheel next to torch); builds without them get a stub
// that says so.
#include <fulgur/error.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fmt/format.h>

#include <chrono>

#ifdef FULGUR_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace fulgur::detail {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout) {
#ifdef FULGUR_WITH_NCCL
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  (void)store, (void)rank, (void)size, (void)timeout;
  throw Error(ErrorKind::config,
              "this Fulgur build has no NCCL (nccl.h was not found at configure time); use backend \"gloo\", or "
              "rebuild with the nvidia-nccl wheel installed next to torch");
#endif
}

}  // namespace fulgur::detail
