// Reading a distributed checkpoint (Fulgur's or Python's), any region of any tensor, and
// consolidating it into one torch.save file.
#include <fulgur/checkpoint_io.h>
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/error.h>

#include "distributed_checkpoint_format.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <system_error>

#include <fcntl.h>
#include <unistd.h>

namespace fulgur::dcp {

namespace fs = std::filesystem;

struct Reader::Impl {
  std::string dir;
  detail::Index index;
  std::map<std::string, size_t> by_key;

  [[noreturn]] void fail(const std::string& problem) const {
    throw Error(ErrorKind::checkpoint, fmt::format("cannot read distributed checkpoint '{}': {}", dir, problem));
  }

  const detail::Item& item(const std::string& key) const {
    auto it = by_key.find(key);
    if (it == by_key.end())
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("distributed checkpoint '{}' has no key '{}' (Reader::keys() lists them)", dir, key));
    return index.items[it->second];
  }

  const detail::Item& tensor_item(const std::string& key) const {
    const detail::Item& i = item(key);
    if (!i.is_tensor)
      throw Error(
          ErrorKind::invalid_argument,
          fmt::format("'{}' in distributed checkpoint '{}' is not a tensor; read it with read_value()", key, dir));
    return i;
  }

  std::string read_range(const detail::StoredRange& range) const {
    const std::string path = (fs::path(dir) / range.file).string();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(fmt::format("'{}': {}", path, std::system_category().message(errno)));
    std::string bytes(static_cast<size_t>(range.length), '\0');
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::pread(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(range.offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    ::close(fd);
    if (done != bytes.size()) fail(fmt::format("'{}' is truncated (it ends inside an entry)", path));
    return bytes;
  }

  c10::IValue load(const detail::StoredRange& range, const std::string& key) const {
    try {
      return detail::torch_load_bytes(read_range(range));
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      fail(fmt::format("the entry of '{}' in '{}' is corrupt: {}", key, (fs::path(dir) / range.file).string(),
                       e.what()));
    }
  }

  at::Tensor load_chunk(const detail::Item& i, const detail::StoredChunk& chunk) const {
    const c10::IValue v = load(chunk.range, i.key);
    if (!v.isTensor() || v.toTensor().scalar_type() != i.dtype || v.toTensor().sizes().vec() != chunk.sizes)
      fail(fmt::format("the chunk of '{}' at offsets ({}) in '{}' is not a {} tensor of sizes ({})", i.key,
                       fmt::join(chunk.offsets, ", "), chunk.range.file, c10::toString(i.dtype),
                       fmt::join(chunk.sizes, ", ")));
    return v.toTensor();
  }
};

namespace {

std::string slurp(const fs::path& path, std::string& problem) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    problem = std::system_category().message(errno);
    return {};
  }
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// DCP's set_element (torch/distributed/checkpoint/_traverse.py): walk `path` from `root`,
// creating dicts for string keys and lists (padded with None) for indices.
void set_element(c10::impl::GenericDict& root, const Path& path, const c10::IValue& value, const std::string& dir) {
  auto conflict = [&] {
    throw Error(ErrorKind::checkpoint, fmt::format("cannot read distributed checkpoint '{}': the nesting of '{}' "
                                                   "conflicts with another key's",
                                                   dir, flatten_key(path)));
  };
  auto fresh = [](const PathElement& next) -> c10::IValue {
    if (std::holds_alternative<std::string>(next))
      return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
    return c10::impl::GenericList(c10::AnyType::get());
  };
  auto key_text = [](const PathElement& e) {
    return std::holds_alternative<std::string>(e) ? std::get<std::string>(e) : std::to_string(std::get<int64_t>(e));
  };
  // Returns the child at `at` of `container`, creating `fill` there when absent (or None).
  auto step = [&](c10::IValue container, const PathElement& at, const c10::IValue& fill, bool assign) -> c10::IValue {
    if (container.isGenericDict()) {
      c10::impl::GenericDict d = container.toGenericDict();
      const c10::IValue k(key_text(at));
      if (assign || !d.contains(k)) d.insert_or_assign(k, fill);
      return d.at(k);
    }
    if (!container.isList() || !std::holds_alternative<int64_t>(at)) conflict();
    c10::impl::GenericList l = container.toList();
    const auto index = static_cast<size_t>(std::get<int64_t>(at));
    while (l.size() <= index) l.push_back(c10::IValue());
    if (assign || l.get(index).isNone()) l.set(index, fill);
    return l.get(index);
  };
  c10::IValue current = root;
  for (size_t i = 0; i + 1 < path.size(); ++i) {
    current = step(current, path[i], fresh(path[i + 1]), false);
    if (!current.isGenericDict() && !current.isList()) conflict();
  }
  step(current, path.back(), value, true);
}

}  // namespace

Reader::Reader(const std::string& dir) : impl_(std::make_unique<Impl>()) {
  impl_->dir = dir;
  std::error_code ec;
  if (!fs::exists(dir, ec)) impl_->fail("the directory does not exist");
  if (!fs::is_directory(dir, ec))
    impl_->fail(
        "it is not a directory (a distributed checkpoint is a directory with a .metadata file; read a "
        "single checkpoint file with read_checkpoint_file)");
  const fs::path metadata = fs::path(dir) / ".metadata";
  if (!fs::exists(metadata, ec))
    impl_->fail(
        fmt::format("'{}' does not exist (the directory is not a distributed checkpoint, or its save did "
                    "not finish)",
                    metadata.string()));
  std::string problem;
  const std::string bytes = slurp(metadata, problem);
  if (!problem.empty()) impl_->fail(fmt::format("'{}': {}", metadata.string(), problem));
  try {
    impl_->index = detail::decode_metadata(bytes);
  } catch (const std::exception& e) {
    impl_->fail(fmt::format("'{}' is corrupt or not DCP metadata: {}", metadata.string(), e.what()));
  }
  // Every byte range must lie inside its file: a truncated data file is reported now, by name.
  std::map<std::string, uintmax_t> sizes;
  auto check = [&](const detail::StoredRange& range, const std::string& key) {
    auto [it, fresh] = sizes.emplace(range.file, 0);
    const fs::path file = fs::path(dir) / range.file;
    if (fresh) {
      it->second = fs::file_size(file, ec);
      if (ec) impl_->fail(fmt::format("'{}', which holds '{}', cannot be read: {}", file.string(), key, ec.message()));
    }
    if (static_cast<uintmax_t>(range.offset) + static_cast<uintmax_t>(range.length) > it->second)
      impl_->fail(fmt::format("'{}' is truncated: '{}' needs bytes [{}, {}) but the file has {} bytes", file.string(),
                              key, range.offset, range.offset + range.length, it->second));
  };
  for (size_t i = 0; i < impl_->index.items.size(); ++i) {
    const detail::Item& item = impl_->index.items[i];
    if (!impl_->by_key.emplace(item.key, i).second)
      impl_->fail(fmt::format("'{}' holds the key '{}' twice", metadata.string(), item.key));
    if (item.is_tensor)
      for (const detail::StoredChunk& chunk : item.chunks) check(chunk.range, item.key);
    else
      check(item.bytes, item.key);
  }
}

Reader::~Reader() = default;
Reader::Reader(Reader&&) noexcept = default;
Reader& Reader::operator=(Reader&&) noexcept = default;

const std::string& Reader::directory() const { return impl_->dir; }

std::vector<std::string> Reader::keys() const {
  std::vector<std::string> out;
  for (const detail::Item& item : impl_->index.items) out.push_back(item.key);
  return out;
}

bool Reader::contains(const std::string& key) const { return impl_->by_key.count(key) > 0; }
bool Reader::is_tensor(const std::string& key) const { return impl_->item(key).is_tensor; }
std::vector<int64_t> Reader::shape(const std::string& key) const { return impl_->tensor_item(key).shape; }
at::ScalarType Reader::dtype(const std::string& key) const { return impl_->tensor_item(key).dtype; }
Path Reader::path(const std::string& key) const { return impl_->item(key).path; }

at::Tensor Reader::read(const std::string& key, const std::vector<int64_t>& offsets,
                        const std::vector<int64_t>& sizes) const {
  const detail::Item& item = impl_->tensor_item(key);
  const size_t rank = item.shape.size();
  bool inside = offsets.size() == rank && sizes.size() == rank;
  for (size_t d = 0; inside && d < rank; ++d)
    inside = offsets[d] >= 0 && sizes[d] >= 0 && offsets[d] + sizes[d] <= item.shape[d];
  if (!inside)
    throw Error(
        ErrorKind::invalid_argument,
        fmt::format("cannot read the region at offsets ({}) of sizes ({}) of '{}' in distributed checkpoint "
                    "'{}': the tensor's shape is ({})",
                    fmt::join(offsets, ", "), fmt::join(sizes, ", "), key, impl_->dir, fmt::join(item.shape, ", ")));
  // Before allocating the region: the chunks that overlap it must be able to fill it, each from
  // the bytes its file holds for it. Otherwise shapes in a corrupt `.metadata` would size the
  // allocation (a few bytes declaring a 1e12-element tensor).
  const int64_t element_size = static_cast<int64_t>(c10::elementSize(item.dtype));
  int64_t wanted = 1, coverable = 0;
  for (size_t d = 0; d < rank; ++d)
    if (__builtin_mul_overflow(wanted, sizes[d], &wanted)) wanted = INT64_MAX;
  for (const detail::StoredChunk& chunk : item.chunks) {
    if (chunk.offsets.size() != rank || chunk.sizes.size() != rank) continue;
    int64_t count = 1, held = 1;
    for (size_t d = 0; d < rank; ++d) {
      const int64_t lo = std::max(offsets[d], chunk.offsets[d]);
      const int64_t hi = std::min(offsets[d] + sizes[d], chunk.offsets[d] + std::max<int64_t>(chunk.sizes[d], 0));
      if (__builtin_mul_overflow(count, std::max<int64_t>(hi - lo, 0), &count)) count = INT64_MAX;
      if (__builtin_mul_overflow(held, std::max<int64_t>(chunk.sizes[d], 0), &held)) held = INT64_MAX;
    }
    if (count == 0) continue;
    if (held > chunk.range.length / element_size)
      impl_->fail(fmt::format(
          "the chunk of '{}' at offsets ({}) declares sizes ({}), more than the {} bytes of its "
          "entry in '{}' can hold; the checkpoint's .metadata is corrupt",
          key, fmt::join(chunk.offsets, ", "), fmt::join(chunk.sizes, ", "), chunk.range.length, chunk.range.file));
    if (__builtin_add_overflow(coverable, count, &coverable)) coverable = INT64_MAX;
  }
  if (coverable < wanted)
    impl_->fail(
        fmt::format("its chunks of '{}' hold at most {} of the {} elements at offsets ({}) of sizes ({}); the "
                    "checkpoint is incomplete",
                    key, coverable, wanted, fmt::join(offsets, ", "), fmt::join(sizes, ", ")));
  at::Tensor out = at::empty(sizes, at::TensorOptions().dtype(item.dtype));
  if (out.numel() == 0) return out;
  int64_t covered = 0;
  for (const detail::StoredChunk& chunk : item.chunks) {
    std::vector<int64_t> lo(rank), length(rank);
    bool overlaps = true;
    for (size_t d = 0; d < rank && overlaps; ++d) {
      lo[d] = std::max(offsets[d], chunk.offsets[d]);
      const int64_t hi = std::min(offsets[d] + sizes[d], chunk.offsets[d] + chunk.sizes[d]);
      length[d] = hi - lo[d];
      overlaps = length[d] > 0;
    }
    if (!overlaps) continue;
    at::Tensor source = impl_->load_chunk(item, chunk);
    at::Tensor target = out;
    int64_t count = 1;
    for (size_t d = 0; d < rank; ++d) {
      const auto dim = static_cast<int64_t>(d);
      source = source.narrow(dim, lo[d] - chunk.offsets[d], length[d]);
      target = target.narrow(dim, lo[d] - offsets[d], length[d]);
      count *= length[d];
    }
    target.copy_(source);
    covered += count;
  }
  if (covered != out.numel())
    impl_->fail(
        fmt::format("its chunks of '{}' hold {} of the {} elements at offsets ({}) of sizes ({}); the "
                    "checkpoint is incomplete",
                    key, covered, out.numel(), fmt::join(offsets, ", "), fmt::join(sizes, ", ")));
  return out;
}

at::Tensor Reader::read(const std::string& key) const {
  const detail::Item& item = impl_->tensor_item(key);
  return read(key, std::vector<int64_t>(item.shape.size(), 0), item.shape);
}

c10::IValue Reader::read_value(const std::string& key) const {
  const detail::Item& item = impl_->item(key);
  if (item.is_tensor)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("'{}' in distributed checkpoint '{}' is a tensor; read it with read()", key, impl_->dir));
  return impl_->load(item.bytes, key);
}

c10::IValue Reader::read_all() const { return read_all(nullptr); }

c10::IValue Reader::read_all(const std::function<at::Tensor(const std::string& key)>& read_tensor) const {
  c10::impl::GenericDict root(c10::StringType::get(), c10::AnyType::get());
  for (const detail::Item& item : impl_->index.items) {
    c10::IValue value;
    if (item.is_tensor) {
      at::Tensor tensor = read_tensor ? read_tensor(item.key) : at::Tensor();
      value = tensor.defined() ? tensor : read(item.key);
    } else {
      value = read_value(item.key);
    }
    set_element(root, item.path, value, impl_->dir);
  }
  return root;
}

namespace {

bool is_index(const std::string& key) {
  return !key.empty() && key.size() < 19 &&
         std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

// An optimizer state whose "state" dict has decimal-string keys, with integer keys instead.
c10::IValue with_index_keys(const c10::IValue& optimizer) {
  if (!optimizer.isGenericDict()) return optimizer;
  const auto dict = optimizer.toGenericDict();
  auto found = dict.find("state");
  if (found == dict.end() || !found->value().isGenericDict()) return optimizer;
  auto state = c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get());
  for (const auto& entry : found->value().toGenericDict()) {
    const bool index = entry.key().isString() && is_index(entry.key().toStringRef());
    state.insert(index ? c10::IValue(static_cast<int64_t>(std::stoll(entry.key().toStringRef()))) : entry.key(),
                 entry.value());
  }
  auto copy = c10::impl::GenericDict(dict.keyType(), dict.valueType());
  for (const auto& entry : dict)
    copy.insert(entry.key(), entry.key() == c10::IValue("state") ? c10::IValue(state) : entry.value());
  return copy;
}

bool is_distributed_checkpoint(const std::string& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && fs::is_regular_file(fs::path(dir) / ".metadata", ec);
}

void consolidate(const std::string& dir, const std::string& out_file) {
  write_checkpoint_file(Reader(dir).read_all(), out_file);
}

}  // namespace fulgur::dcp
