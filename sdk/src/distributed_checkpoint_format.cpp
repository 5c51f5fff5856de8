// DCP's Metadata in both directions, and the torch.save blobs of a data file.
//
// The layout follows torch/distributed/checkpoint/metadata.py and filesystem.py (torch 2.11):
//   Metadata(state_dict_metadata={fqn: TensorStorageMetadata | BytesStorageMetadata},
//            planner_data={fqn: (path elements)}, storage_data={MetadataIndex: _StorageInfo},
//            storage_meta=None, version="1.0.0")
// Dataclasses pickle as NEWOBJ of the class with no arguments, then BUILD with their field dict;
// TensorProperties as BUILD with its __getstate__ tuple (dtype, layout, requires_grad,
// memory-format enum, pin_memory); torch.Size as REDUCE of the class with a tuple of ints.
#include "distributed_checkpoint_format.h"

#include "distributed_checkpoint_pickle.h"
#include "pickle_compat.h"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <map>
#include <stdexcept>

namespace fulgur::dcp::detail {

namespace {

constexpr const char* kMetadataModule = "torch.distributed.checkpoint.metadata";

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr std::array kDtypeNames = {DtypeName{at::kFloat, "float32"},
                                    DtypeName{at::kDouble, "float64"},
                                    DtypeName{at::kHalf, "float16"},
                                    DtypeName{at::kBFloat16, "bfloat16"},
                                    DtypeName{at::kChar, "int8"},
                                    DtypeName{at::kByte, "uint8"},
                                    DtypeName{at::kShort, "int16"},
                                    DtypeName{at::kInt, "int32"},
                                    DtypeName{at::kLong, "int64"},
                                    DtypeName{at::kBool, "bool"},
                                    DtypeName{at::kComplexFloat, "complex64"},
                                    DtypeName{at::kComplexDouble, "complex128"},
                                    DtypeName{at::kComplexHalf, "complex32"},
                                    DtypeName{at::kUInt16, "uint16"},
                                    DtypeName{at::kUInt32, "uint32"},
                                    DtypeName{at::kUInt64, "uint64"},
                                    DtypeName{at::kFloat8_e4m3fn, "float8_e4m3fn"},
                                    DtypeName{at::kFloat8_e5m2, "float8_e5m2"},
                                    DtypeName{at::kFloat8_e4m3fnuz, "float8_e4m3fnuz"},
                                    DtypeName{at::kFloat8_e5m2fnuz, "float8_e5m2fnuz"}};

[[noreturn]] void bad(const std::string& what) { throw std::runtime_error(what); }

// --- encoding ------------------------------------------------------------------------------------

void write_size(PickleWriter& w, const std::vector<int64_t>& dims) {
  w.global("torch", "Size");
  w.mark();
  w.mark();
  for (int64_t d : dims) w.integer(d);
  w.tuple_from_mark();
  w.tuple_from_mark();
  w.reduce();
}

// NEWOBJ of a dataclass, then its fields (written by `fields`) as the BUILD state.
template <typename Fields>
void write_dataclass(PickleWriter& w, const char* module, const char* name, Fields&& fields) {
  w.global(module, name);
  w.empty_tuple();
  w.newobj();
  w.empty_dict();
  w.mark();
  fields();
  w.set_items_from_mark();
  w.build();
}

void write_properties(PickleWriter& w, at::ScalarType dtype) {
  w.global(kMetadataModule, "TensorProperties");
  w.empty_tuple();
  w.newobj();
  w.mark();
  w.global("torch", dtype_name(dtype));
  w.global("torch.serialization", "_get_layout");
  w.mark();
  w.string("torch.strided");
  w.tuple_from_mark();
  w.reduce();
  w.boolean(false);  // requires_grad
  w.global(kMetadataModule, "_MEM_FORMAT_ENCODING");
  w.mark();
  w.integer(0);  // TORCH_CONTIGUOUS_FORMAT
  w.tuple_from_mark();
  w.reduce();
  w.boolean(false);  // pin_memory
  w.tuple_from_mark();
  w.build();
}

void write_range(PickleWriter& w, const StoredRange& range) {
  write_dataclass(w, "torch.distributed.checkpoint.filesystem", "_StorageInfo", [&] {
    w.string("relative_path");
    w.string(range.file);
    w.string("offset");
    w.integer(range.offset);
    w.string("length");
    w.integer(range.length);
  });
}

void write_index_key(PickleWriter& w, const std::string& fqn, const std::vector<int64_t>* offsets, int64_t index) {
  write_dataclass(w, kMetadataModule, "MetadataIndex", [&] {
    w.string("fqn");
    w.string(fqn);
    w.string("offset");
    if (offsets)
      write_size(w, *offsets);
    else
      w.none();
    w.string("index");
    if (offsets)
      w.integer(index);
    else
      w.none();
  });
}

// --- decoding ------------------------------------------------------------------------------------

const PyValue& field(const PyValue& object, std::string_view name, const std::string& where) {
  const PyValue* v = object.field(name);
  if (!v) bad(fmt::format("{} has no '{}'", where, name));
  return *v;
}

std::vector<int64_t> int_tuple(const PyValue& v, const std::string& where) {
  if (v.kind != PyValue::Kind::tuple && v.kind != PyValue::Kind::list) bad(fmt::format("{} is not a size", where));
  std::vector<int64_t> out;
  for (const PyPtr& d : v.items) {
    if (d->kind != PyValue::Kind::integer) bad(fmt::format("{} holds a non-integer", where));
    out.push_back(d->integer);
  }
  return out;
}

int64_t integer(const PyValue& v, const std::string& where) {
  if (v.kind != PyValue::Kind::integer) bad(fmt::format("{} is not an integer", where));
  return v.integer;
}

const std::string& text(const PyValue& v, const std::string& where) {
  if (v.kind != PyValue::Kind::string) bad(fmt::format("{} is not a string", where));
  return v.text;
}

at::ScalarType decode_dtype(const PyValue& properties, const std::string& key) {
  const std::string where = fmt::format("the properties of '{}'", key);
  const PyValue* dtype = nullptr;
  if (properties.state && properties.state->kind == PyValue::Kind::tuple && !properties.state->items.empty()) {
    const auto& s = properties.state->items;
    dtype = s[0].get();
    if (s.size() > 1 && s[1]->kind == PyValue::Kind::string && s[1]->text != "torch.strided")
      bad(fmt::format("'{}' has layout {}; only dense (torch.strided) tensors are supported", key, s[1]->text));
  } else {
    dtype = properties.field("dtype");
  }
  if (!dtype || dtype->kind != PyValue::Kind::global || dtype->text.rfind("torch.", 0) != 0)
    bad(fmt::format("{} name no dtype", where));
  return dtype_from_name(std::string_view(dtype->text).substr(6));
}

}  // namespace

std::string dtype_name(at::ScalarType type) {
  for (const DtypeName& d : kDtypeNames)
    if (d.type == type) return d.name;
  bad(fmt::format("tensors of dtype {} cannot be stored in a distributed checkpoint", c10::toString(type)));
}

at::ScalarType dtype_from_name(std::string_view name) {
  for (const DtypeName& d : kDtypeNames)
    if (name == d.name) return d.type;
  bad(fmt::format("unknown dtype torch.{}", name));
}

std::string encode_metadata(const Index& index) {
  PickleWriter w;
  write_dataclass(w, kMetadataModule, "Metadata", [&] {
    w.string("state_dict_metadata");
    w.empty_dict();
    w.mark();
    for (const Item& item : index.items) {
      w.string(item.key);
      if (!item.is_tensor) {
        w.global(kMetadataModule, "BytesStorageMetadata");
        w.empty_tuple();
        w.newobj();
        continue;
      }
      write_dataclass(w, kMetadataModule, "TensorStorageMetadata", [&] {
        w.string("properties");
        write_properties(w, item.dtype);
        w.string("size");
        write_size(w, item.shape);
        w.string("chunks");
        w.empty_list();
        for (const StoredChunk& chunk : item.chunks) {
          write_dataclass(w, kMetadataModule, "ChunkStorageMetadata", [&] {
            w.string("offsets");
            write_size(w, chunk.offsets);
            w.string("sizes");
            write_size(w, chunk.sizes);
          });
          w.append();
        }
      });
    }
    w.set_items_from_mark();

    w.string("planner_data");
    w.empty_dict();
    w.mark();
    for (const Item& item : index.items) {
      w.string(item.key);
      w.mark();
      for (const PathElement& e : item.path) {
        if (const auto* s = std::get_if<std::string>(&e))
          w.string(*s);
        else
          w.integer(std::get<int64_t>(e));
      }
      w.tuple_from_mark();
    }
    w.set_items_from_mark();

    w.string("storage_data");
    w.empty_dict();
    w.mark();
    for (const Item& item : index.items) {
      if (!item.is_tensor) {
        write_index_key(w, item.key, nullptr, 0);
        write_range(w, item.bytes);
        continue;
      }
      for (size_t i = 0; i < item.chunks.size(); ++i) {
        write_index_key(w, item.key, &item.chunks[i].offsets, static_cast<int64_t>(i));
        write_range(w, item.chunks[i].range);
      }
    }
    w.set_items_from_mark();

    w.string("storage_meta");
    w.none();  // Python's reader fills one in
    w.string("version");
    w.string("1.0.0");  // torch's CURRENT_DCP_VERSION
  });
  return w.finish();
}

Index decode_metadata(std::string_view bytes) {
  const PyPtr root = read_pickle(bytes);
  if (root->kind != PyValue::Kind::object || root->text != std::string(kMetadataModule) + ".Metadata")
    bad("it does not hold a torch.distributed.checkpoint Metadata object");
  const PyValue& sdm = field(*root, "state_dict_metadata", "the metadata");
  if (sdm.kind != PyValue::Kind::dict) bad("state_dict_metadata is not a dict");
  const PyValue* planner = root->field("planner_data");
  const PyValue* storage = root->field("storage_data");
  if (!storage || storage->kind != PyValue::Kind::dict) bad("storage_data is missing or not a dict");

  // (fqn, chunk offsets or none) -> where the bytes are.
  std::map<std::pair<std::string, std::vector<int64_t>>, StoredRange> tensor_ranges;
  std::map<std::string, StoredRange> byte_ranges;
  for (const auto& [k, v] : storage->entries) {
    if (k->kind != PyValue::Kind::object || v->kind != PyValue::Kind::object)
      bad("a storage_data entry is not MetadataIndex: _StorageInfo");
    const std::string& fqn = text(field(*k, "fqn", "a MetadataIndex"), "a MetadataIndex's fqn");
    const std::string where = fmt::format("the storage of '{}'", fqn);
    StoredRange range;
    range.file = text(field(*v, "relative_path", where), where);
    range.offset = integer(field(*v, "offset", where), where);
    range.length = integer(field(*v, "length", where), where);
    if (const PyValue* t = v->field("transform_descriptors"); t && t->kind != PyValue::Kind::none && !t->items.empty())
      bad(
          fmt::format("'{}' was written with storage transforms (e.g. compression), which Fulgur cannot read; "
                      "save without them",
                      fqn));
    if (range.offset < 0 || range.length < 0 || range.file.empty() || range.file.find('/') != std::string::npos)
      bad(fmt::format("{} is not a byte range of a file in the checkpoint", where));
    const PyValue* offset = k->field("offset");
    if (!offset || offset->kind == PyValue::Kind::none)
      byte_ranges[fqn] = range;
    else
      tensor_ranges[{fqn, int_tuple(*offset, where)}] = range;
  }

  Index index;
  for (const auto& [k, v] : sdm.entries) {
    Item item;
    item.key = text(*k, "a state_dict_metadata key");
    item.path = {item.key};
    if (planner && planner->kind == PyValue::Kind::dict) {
      for (const auto& [pk, pv] : planner->entries) {
        if (pk->kind != PyValue::Kind::string || pk->text != item.key) continue;
        if (pv->kind != PyValue::Kind::tuple && pv->kind != PyValue::Kind::list)
          bad(fmt::format("the planner_data of '{}' is not a path", item.key));
        item.path.clear();
        for (const PyPtr& e : pv->items) {
          if (e->kind == PyValue::Kind::string)
            item.path.emplace_back(e->text);
          else if (e->kind == PyValue::Kind::integer && e->integer >= 0)
            item.path.emplace_back(e->integer);
          else
            bad(fmt::format("the planner_data of '{}' holds an element that is neither a key nor an index", item.key));
        }
        if (item.path.empty()) bad(fmt::format("the planner_data of '{}' is empty", item.key));
      }
    }
    if (v->kind != PyValue::Kind::object) bad(fmt::format("the metadata of '{}' is not an object", item.key));
    if (v->text == std::string(kMetadataModule) + ".BytesStorageMetadata") {
      auto it = byte_ranges.find(item.key);
      if (it == byte_ranges.end()) bad(fmt::format("'{}' has no storage_data entry", item.key));
      item.bytes = it->second;
    } else if (v->text == std::string(kMetadataModule) + ".TensorStorageMetadata") {
      item.is_tensor = true;
      const std::string where = fmt::format("the metadata of '{}'", item.key);
      item.dtype = decode_dtype(field(*v, "properties", where), item.key);
      item.shape = int_tuple(field(*v, "size", where), where + " size");
      if (std::any_of(item.shape.begin(), item.shape.end(), [](int64_t n) { return n < 0; }))
        bad(fmt::format("'{}' has a negative size", item.key));
      const PyValue& chunks = field(*v, "chunks", where);
      if (chunks.kind != PyValue::Kind::list) bad(where + " has no chunk list");
      for (const PyPtr& c : chunks.items) {
        if (c->kind != PyValue::Kind::object) bad(where + " has a chunk that is not an object");
        StoredChunk chunk;
        chunk.offsets = int_tuple(field(*c, "offsets", where), where + " chunk offsets");
        chunk.sizes = int_tuple(field(*c, "sizes", where), where + " chunk sizes");
        if (chunk.offsets.size() != item.shape.size() || chunk.sizes.size() != item.shape.size())
          bad(fmt::format("a chunk of '{}' has a different rank than the tensor", item.key));
        for (size_t d = 0; d < item.shape.size(); ++d)
          if (chunk.offsets[d] < 0 || chunk.sizes[d] < 0 || chunk.offsets[d] > item.shape[d] ||
              chunk.sizes[d] > item.shape[d] - chunk.offsets[d])
            bad(fmt::format("a chunk of '{}' lies outside the tensor", item.key));
        auto it = tensor_ranges.find({item.key, chunk.offsets});
        if (it == tensor_ranges.end())
          bad(fmt::format("the chunk of '{}' at offsets ({}) has no storage_data entry", item.key,
                          fmt::join(chunk.offsets, ", ")));
        chunk.range = it->second;
        item.chunks.push_back(std::move(chunk));
      }
    } else {
      bad(fmt::format("the metadata of '{}' is a {}", item.key, v->text));
    }
    index.items.push_back(std::move(item));
  }
  return index;
}

std::string torch_save_bytes(const c10::IValue& value) {
  // Plain (untagged) pickling, as write_checkpoint_file does: torch.jit type tags would make
  // Python's torch.load(weights_only=True) refuse the blob.
  std::vector<char> pickle_bytes;
  torch::jit::Pickler pickler(
      [&](const char* data, size_t size) { pickle_bytes.insert(pickle_bytes.end(), data, data + size); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(fulgur::detail::plain_containers(value));
  pickler.stop();
  std::string out;
  caffe2::serialize::PyTorchStreamWriter writer([&out](const void* data, size_t size) -> size_t {
    out.append(static_cast<const char*>(data), size);
    return size;
  });
  const std::vector<at::Tensor>& storages = pickler.tensorData();
  for (size_t i = 0; i < storages.size(); ++i) {
    const torch::jit::WriteableTensorData data = torch::jit::getWriteableTensorData(storages[i]);
    writer.writeRecord(fmt::format("data/{}", i), data.data(), data.sizeInBytes());
  }
  writer.writeRecord("data.pkl", pickle_bytes.data(), pickle_bytes.size());
  writer.writeEndOfFile();
  return out;
}

c10::IValue torch_load_bytes(std::string bytes) {
  try {
    // What torch::jit::pickle_load does, with the checks read_checkpoint_file makes first: LibTorch
    // sizes a record's buffer, and the unpickler a string, by what the bytes declare, before it
    // finds them missing (a corrupt entry could otherwise cost gigabytes).
    caffe2::serialize::PyTorchStreamReader reader(
        std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(), static_cast<off_t>(bytes.size())));
    for (const std::string& name : reader.getAllRecords())
      if (const size_t declared = reader.getRecordSize(name); declared > bytes.size() * 1032 + 1024)
        throw std::runtime_error(
            fmt::format("its record '{}' declares {} bytes in an entry of {} bytes", name, declared, bytes.size()));
    if (reader.hasRecord("data.pkl")) {
      auto [record, size] = reader.getRecord("data.pkl");
      const std::string problem =
          fulgur::detail::pickle_memo_problem(std::string_view(static_cast<const char*>(record.get()), size));
      if (!problem.empty()) throw std::runtime_error(problem);
    }
    return torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"",
                                             /*type_resolver=*/std::nullopt, /*obj_loader=*/std::nullopt,
                                             /*device=*/std::nullopt, reader);
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
}

}  // namespace fulgur::dcp::detail
