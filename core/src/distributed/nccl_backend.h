// What the core hands to libfulgur_nccl.so's entry point (nccl_backend.cpp), which it finds with
// dlopen/dlsym (nccl_loader.cpp). Both sides are built together from this header.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace fulgur::detail {

struct NcclBackendRequest {
  const c10::intrusive_ptr<c10d::Store>* store = nullptr;
  int rank = 0;
  int size = 0;
  std::chrono::milliseconds timeout{0};
};

// The entry point's name and type: fills `out`, or says why not in `error` and returns false.
inline constexpr const char* kNcclEntryPoint = "fulgur_make_nccl_backend";
using NcclEntryPoint = bool (*)(const NcclBackendRequest*, c10::intrusive_ptr<c10d::Backend>*, std::string*);

// The NCCL backend, from libfulgur_nccl.so next to libfulgur_core.so; throws fulgur::Error when
// this build has none or it cannot be loaded.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout);

}  // namespace fulgur::detail
