// Internal: the two pickle codecs DCP's `.metadata` needs, nothing more.
//
// Reading: Python writes `.metadata` with pickle.dump (protocol 4) of dataclasses. LibTorch's
// torch::jit::unpickle cannot read it: it stops at once with "Only Pickle protocol 2 is
// supported", and beyond that resolves globals only to TorchScript class types (a dataclass is
// none) and keeps NEWOBJ/BUILD only for pre-1.1 TorchScript files. So this is a small unpickler
// that builds generic values and accepts only an allow-list of globals; any other global is
// refused before anything is built, and nothing is ever called (a REDUCE of an allowed global is
// interpreted, not executed).
//
// Writing: a protocol-2 pickle writer with just the opcodes the metadata needs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fulgur::dcp::detail {

// A value of the unpickled object graph.
struct PyValue {
  enum class Kind { none, boolean, integer, floating, string, bytes, tuple, list, dict, global, object };
  Kind kind = Kind::none;
  bool boolean = false;
  int64_t integer = 0;
  double floating = 0;
  std::string text;                             // string, bytes; global and object: "module.name"
  std::vector<std::shared_ptr<PyValue>> items;  // tuple, list
  std::vector<std::pair<std::shared_ptr<PyValue>, std::shared_ptr<PyValue>>> entries;  // dict; object: its fields
  std::shared_ptr<PyValue> state;  // object: a BUILD state that is not a dict (TensorProperties' tuple)

  // Object field by name, or nullptr.
  const PyValue* field(std::string_view name) const;
};
using PyPtr = std::shared_ptr<PyValue>;

// Unpickles `bytes`. Throws std::runtime_error with the problem (the caller names the file): an
// unknown opcode, a global not on the allow-list, a malformed stream.
PyPtr read_pickle(std::string_view bytes);

// Protocol-2 pickle writer. Globals are memoized, so each class name appears once per file.
class PickleWriter {
 public:
  PickleWriter();
  void global(const std::string& module, const std::string& name);
  void none();
  void boolean(bool v);
  void integer(int64_t v);
  void string(std::string_view v);
  void mark();
  void tuple_from_mark();
  void empty_tuple();
  void empty_dict();
  void empty_list();
  void set_items_from_mark();
  void append();
  void newobj();         // cls args -> obj
  void reduce();         // callable args -> obj
  void build();          // obj state -> obj
  std::string finish();  // STOP, and the bytes

 private:
  std::string out_;
  std::vector<std::pair<std::string, uint32_t>> memo_;
};

}  // namespace fulgur::dcp::detail
