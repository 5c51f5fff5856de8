// Internal: the DCP metadata as both sides of distributed_checkpoint use it, its pickle encoding
// and decoding, and the torch.save byte blobs a data file is made of.
#pragma once

#include <fulgur/distributed_checkpoint.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur::dcp::detail {

// Where an entry's bytes are: [offset, offset + length) of `file` (relative to the checkpoint).
struct StoredRange {
  std::string file;
  int64_t offset = 0;
  int64_t length = 0;
};

struct StoredChunk {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  StoredRange range;
};

// One flattened key of a checkpoint: a tensor and its chunks, or a torch.save blob.
struct Item {
  std::string key;
  Path path;
  bool is_tensor = false;
  at::ScalarType dtype = at::ScalarType::Float;
  std::vector<int64_t> shape;
  std::vector<StoredChunk> chunks;
  StoredRange bytes;
};

// DCP's Metadata, reduced to what reading needs; items in the checkpoint's order.
struct Index {
  std::vector<Item> items;
};

// torch's name for a dtype ("float32", "bfloat16"); throws std::runtime_error for one DCP has no name for.
std::string dtype_name(at::ScalarType type);
// The dtype of a torch name; throws std::runtime_error naming it when unknown.
at::ScalarType dtype_from_name(std::string_view name);

// The `.metadata` pickle of `index` (a Metadata dataclass as Python's dcp.save writes it).
std::string encode_metadata(const Index& index);
// Parses `.metadata` bytes. Throws std::runtime_error with the problem (the caller names the file).
Index decode_metadata(std::string_view bytes);

// torch.save bytes of a value (a tensor must be compact and on the CPU): a zip archive without
// TorchScript type tags, which Python's torch.load(weights_only=True) opens.
std::string torch_save_bytes(const c10::IValue& value);
// Reads torch.save bytes (Python's or torch_save_bytes'). Throws std::runtime_error on corruption.
c10::IValue torch_load_bytes(std::string bytes);

}  // namespace fulgur::dcp::detail
