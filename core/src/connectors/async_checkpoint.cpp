#include "async_checkpoint.h"

#include <fulgur/error.h>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <unordered_map>
#include <utility>

namespace fulgur {

namespace {

// Storages already copied, by the storage they copy: views of one buffer stay views of one copy.
using StorageCopies = std::unordered_map<const c10::StorageImpl*, c10::Storage>;

at::Tensor copy_tensor(const at::Tensor& tensor, StorageCopies& copies) {
  if (!tensor.defined()) return tensor;
  // Sparse, quantized or storage-less tensors: an ordinary copy (the pickler writes them as such).
  if (tensor.layout() != c10::kStrided || tensor.is_quantized() || !tensor.has_storage())
    return tensor.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
  const c10::Storage& storage = tensor.storage();
  c10::Storage& copy = copies[storage.unsafeGetStorageImpl()];
  if (!copy) {
    // The whole storage, as bytes: the file holds whole storages whatever part a tensor views.
    const int64_t bytes = static_cast<int64_t>(storage.nbytes());
    at::Tensor source = at::empty({0}, tensor.options().dtype(at::kByte));
    source.set_(storage, /*storage_offset=*/0, {bytes}, {1});
    copy = source.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).storage();
  }
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(tensor.dtype()).device(at::kCPU));
  out.set_(copy, tensor.storage_offset(), tensor.sizes(), tensor.strides());
  // The flag is written into the file (torch._utils._rebuild_tensor_v2).
  if (tensor.requires_grad()) out.set_requires_grad(true);
  return out;
}

c10::IValue copy_value(const c10::IValue& value, StorageCopies& copies) {
  if (value.isTensor()) return copy_tensor(value.toTensor(), copies);
  if (value.isGenericDict()) {
    const c10::impl::GenericDict dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    out.reserve(dict.size());
    for (const auto& entry : dict) out.insert(copy_value(entry.key(), copies), copy_value(entry.value(), copies));
    return out;
  }
  if (value.isList()) {
    const c10::List<c10::IValue> list = value.toList();
    c10::impl::GenericList out(list.elementType());
    out.reserve(list.size());
    for (const c10::IValue& element : list) out.push_back(copy_value(element, copies));
    return out;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const c10::IValue& element : value.toTupleRef().elements()) elements.push_back(copy_value(element, copies));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return value;
}

// Test-only fault injection (compiled in with FULGUR_FAULT_INJECTION, as the SDK's seams), a
// comma-separated list in FULGUR_FAULT_INJECT:
// "async_checkpoint_delay:MS" holds every background save MS milliseconds before it writes, so that
// training surely moves on meanwhile (tests/storage_test.cpp: the files must still hold the state
// of their own step); "async_checkpoint_fail:RANK:N" makes the N-th background save (from 1) of
// global rank RANK throw, the others writing as usual (a failure on one rank of several).
struct InjectedFaults {
  int delay_ms = 0;
  int64_t fail_rank = -1;
  int fail_save = 0;
};

const InjectedFaults& injected_faults() {
  static const InjectedFaults faults = [] {
    InjectedFaults f;
#if defined(FULGUR_FAULT_INJECTION)
    const char* spec = std::getenv("FULGUR_FAULT_INJECT");
    for (const char* item = spec; item && *item; item = std::strchr(item, ',') ? std::strchr(item, ',') + 1 : nullptr) {
      long rank = 0;
      int v = 0;
      if (std::sscanf(item, "async_checkpoint_delay:%d", &v) == 1) f.delay_ms = v;
      if (std::sscanf(item, "async_checkpoint_fail:%ld:%d", &rank, &v) == 2) {
        f.fail_rank = rank;
        f.fail_save = v;
      }
    }
#endif
    return f;
  }();
  return faults;
}

}  // namespace

c10::IValue copy_to_host(const c10::IValue& value) {
  const at::NoGradGuard no_grad;
  StorageCopies copies;
  return copy_value(value, copies);
}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  try {
    wait();
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
  }
}

void AsyncCheckpointWriter::start(std::string path, std::function<void()> write, int64_t rank) {
  if (path_)
    throw Error(ErrorKind::runtime,
                fmt::format("asynchronous checkpoint '{}' started while '{}' is still being written", path, *path_));
  const InjectedFaults& faults = injected_faults();
  ++started_;
  if (faults.fail_rank == rank && faults.fail_save == started_)
    write = [rank, n = started_] {
      throw Error(ErrorKind::io, fmt::format("injected failure of background save {} on rank {} "
                                             "(FULGUR_FAULT_INJECT=async_checkpoint_fail)",
                                             n, rank));
    };
  if (const int ms = faults.delay_ms; ms > 0)
    write = [write = std::move(write), ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      write();
    };
  done_ = std::async(std::launch::async, std::move(write));
  path_ = std::move(path);
}

std::optional<std::string> AsyncCheckpointWriter::wait() {
  if (!path_) return std::nullopt;
  std::optional<std::string> path = path_;
  if (const std::string failure = wait_for_failure(); !failure.empty())
    throw Error(ErrorKind::checkpoint,
                fmt::format("the checkpoint '{}' saved in the background ([trainer] async_checkpoint) failed: {}",
                            *path, failure));
  return path;
}

std::string AsyncCheckpointWriter::wait_for_failure() {
  if (!path_) return {};
  path_.reset();
  try {
    done_.get();
  } catch (const std::exception& e) {
    return e.what()[0] != 0 ? e.what() : "unknown error";
  } catch (...) {
    return "unknown error";
  }
  return {};
}

}  // namespace fulgur
