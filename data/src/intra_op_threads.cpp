// One intra-op thread for the calling thread only. ATen's OpenMP backend reads the thread count
// with omp_get_max_threads(), a per-thread setting, while at::set_num_threads() also changes the
// process-wide default every new thread starts from. So a loader worker first lets ATen run its
// lazy per-thread initialisation (which would otherwise reset the count at its first parallel
// region), then lowers its own OpenMP setting. Without this each worker thread opens an OpenMP
// team as large as the training step's (issue #16 saw 8 threads on 2 cores).
#include <fulgur/data/data_loader.h>

#include <ATen/Parallel.h>

// Declared weak: resolved from the libgomp that libtorch_cpu loads; null in a torch without OpenMP
// (whose native thread pool has no per-thread setting: the workers then share it).
extern "C" void omp_set_num_threads(int) noexcept __attribute__((weak));

namespace fulgur::data {

int limit_intra_op_threads_for_this_thread(int threads) {
  at::internal::lazy_init_num_threads();
  const int before = at::get_num_threads();
  if (omp_set_num_threads != nullptr) omp_set_num_threads(threads < 1 ? 1 : threads);
  return before;
}

}  // namespace fulgur::data
