// The `.metadata` pickle codecs. See distributed_checkpoint_pickle.h for why they exist.
#include "distributed_checkpoint_pickle.h"

#include "pickle_walker.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <stdexcept>

namespace fulgur::dcp::detail {

namespace {

namespace pickle = fulgur::detail::pickle;
using pickle::Op;

constexpr std::string_view kMetadataModule = "torch.distributed.checkpoint.metadata";

// The globals a DCP `.metadata` names (torch 2.3 to 2.11): the dataclasses, torch.Size, dtypes,
// the layout and memory-format helpers, and pathlib paths (StorageMeta.checkpoint_id).
bool allowed_global(const std::string& module, const std::string& name) {
  static const std::set<std::string> metadata_classes = {
      "Metadata",      "TensorStorageMetadata", "TensorProperties",    "ChunkStorageMetadata", "BytesStorageMetadata",
      "MetadataIndex", "StorageMeta",           "_MEM_FORMAT_ENCODING"};
  static const std::set<std::string> torch_names = {
      "Size",     "float32",       "float64",     "float16",         "bfloat16",
      "int8",     "uint8",         "int16",       "int32",           "int64",
      "bool",     "complex64",     "complex128",  "uint16",          "uint32",
      "uint64",   "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
      "complex32"};
  if (module == kMetadataModule) return metadata_classes.count(name) > 0;
  if (module == "torch.distributed.checkpoint.filesystem") return name == "_StorageInfo";
  if (module == "torch") return torch_names.count(name) > 0;
  if (module == "torch.serialization") return name == "_get_layout";
  if (module == "pathlib")
    return name == "PosixPath" || name == "PurePosixPath" || name == "WindowsPath" || name == "PureWindowsPath" ||
           name == "Path";
  if (module == "collections") return name == "OrderedDict";
  return false;
}

PyPtr make(PyValue::Kind kind) {
  auto v = std::make_shared<PyValue>();
  v->kind = kind;
  return v;
}

[[noreturn]] void malformed(size_t at, std::string_view what) {
  throw std::runtime_error(fmt::format("malformed pickle at byte {}: {}", at, what));
}

// The opcodes a `.metadata` pickle uses (Python's pickle.dump, protocol 4).
constexpr pickle::OpSet kMetadataOps{
    // clang-format off
    Op::proto, Op::frame, Op::stop, Op::mark, Op::pop, Op::pop_mark,
    Op::none, Op::newtrue, Op::newfalse, Op::binint1, Op::binint2, Op::binint, Op::long1, Op::binfloat,
    Op::short_binunicode, Op::binunicode, Op::binunicode8, Op::short_binbytes, Op::binbytes,
    Op::memoize, Op::binput, Op::long_binput, Op::binget, Op::long_binget, Op::global, Op::stack_global,
    Op::empty_tuple, Op::empty_dict, Op::empty_list, Op::tuple1, Op::tuple2, Op::tuple3, Op::tuple, Op::list,
    Op::dict, Op::setitem, Op::setitems, Op::append, Op::appends, Op::newobj, Op::reduce, Op::build,
    // clang-format on
};

class Unpickler {
 public:
  explicit Unpickler(std::string_view bytes) : p_(bytes), walker_(bytes, kMetadataOps) {}

  PyPtr run() {
    pickle::Instruction in;
    while (true) {
      next(in);
      const size_t start = in.start;
      switch (in.op) {
        case Op::proto:
        case Op::frame:  // a length hint only
          break;
        case Op::stop:
          if (stack_.size() != 1 || !marks_.empty()) malformed(start, "STOP with an unbalanced stack");
          return stack_.back();
        case Op::mark:
          marks_.push_back(stack_.size());
          break;
        case Op::pop:
          pop(start);
          break;
        case Op::pop_mark:
          pop_to_mark(start);
          break;
        case Op::none:
          push(make(PyValue::Kind::none));
          break;
        case Op::newtrue:
        case Op::newfalse: {
          auto v = make(PyValue::Kind::boolean);
          v->boolean = in.op == Op::newtrue;
          push(v);
          break;
        }
        case Op::binint1:
        case Op::binint2:
          push_int(static_cast<int64_t>(in.number));
          break;
        case Op::binint:
          push_int(static_cast<int32_t>(static_cast<uint32_t>(in.number)));
          break;
        case Op::long1: {  // little-endian two's complement (next() refused more than 8 bytes)
          const size_t n = in.data.size();
          uint64_t v = pickle::little_endian(in.data);
          if (n > 0 && n < 8 && (static_cast<uint8_t>(in.data[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
          push_int(static_cast<int64_t>(v));
          break;
        }
        case Op::binfloat: {  // big-endian IEEE double
          uint64_t bits = 0;
          for (char c : in.data) bits = (bits << 8) | static_cast<uint8_t>(c);
          auto v = make(PyValue::Kind::floating);
          std::memcpy(&v->floating, &bits, sizeof bits);
          push(v);
          break;
        }
        case Op::short_binunicode:
        case Op::binunicode:
        case Op::binunicode8:
          push_text(PyValue::Kind::string, in.data);
          break;
        case Op::short_binbytes:
        case Op::binbytes:
          push_text(PyValue::Kind::bytes, in.data);
          break;
        case Op::memoize:
          memo_.push_back(top(start));
          break;
        case Op::binput:
        case Op::long_binput: {
          const uint64_t index = in.number;
          if (!pickle::memo_index_possible(index, p_.size()))
            malformed(start, fmt::format("memo index {} in {} bytes", index, p_.size()));
          if (memo_.size() <= index) memo_.resize(index + 1);
          memo_[index] = top(start);
          break;
        }
        case Op::binget:
        case Op::long_binget: {
          const uint64_t index = in.number;
          if (index >= memo_.size() || !memo_[index]) malformed(start, fmt::format("unknown memo entry {}", index));
          push(memo_[index]);
          break;
        }
        case Op::global:  // "module\nname\n"
          push(global(start, std::string(in.module), std::string(in.name)));
          break;
        case Op::stack_global: {
          const PyPtr name = pop(start);
          const PyPtr module = pop(start);
          if (module->kind != PyValue::Kind::string || name->kind != PyValue::Kind::string)
            malformed(start, "STACK_GLOBAL of a non-string");
          push(global(start, module->text, name->text));
          break;
        }
        case Op::empty_tuple:
          push(make(PyValue::Kind::tuple));
          break;
        case Op::empty_dict:
          push(make(PyValue::Kind::dict));
          break;
        case Op::empty_list:
          push(make(PyValue::Kind::list));
          break;
        case Op::tuple1:
        case Op::tuple2:
        case Op::tuple3: {
          const size_t n = static_cast<uint8_t>(in.op) - 0x84u;
          if (stack_.size() < n + floor()) malformed(start, "TUPLEn on a short stack");
          auto t = make(PyValue::Kind::tuple);
          t->items.assign(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          push(t);
          break;
        }
        case Op::tuple:
        case Op::list: {
          auto t = make(in.op == Op::tuple ? PyValue::Kind::tuple : PyValue::Kind::list);
          t->items = pop_to_mark(start);
          push(t);
          break;
        }
        case Op::dict: {
          auto d = make(PyValue::Kind::dict);
          add_items(start, *d, pop_to_mark(start));
          push(d);
          break;
        }
        case Op::setitem: {
          const PyPtr value = pop(start);
          const PyPtr key = pop(start);
          PyValue& d = expect(top(start), PyValue::Kind::dict, start, "SETITEM");
          d.entries.emplace_back(key, value);
          break;
        }
        case Op::setitems: {
          std::vector<PyPtr> items = pop_to_mark(start);
          add_items(start, expect(top(start), PyValue::Kind::dict, start, "SETITEMS"), items);
          break;
        }
        case Op::append: {
          const PyPtr value = pop(start);
          expect(top(start), PyValue::Kind::list, start, "APPEND").items.push_back(value);
          break;
        }
        case Op::appends: {
          std::vector<PyPtr> items = pop_to_mark(start);
          PyValue& list = expect(top(start), PyValue::Kind::list, start, "APPENDS");
          list.items.insert(list.items.end(), items.begin(), items.end());
          break;
        }
        case Op::newobj: {  // cls.__new__(cls, *args)
          const PyPtr args = pop(start);
          const PyPtr cls = pop(start);
          push(newobj(start, *cls, *args));
          break;
        }
        case Op::reduce: {  // callable(*args)
          const PyPtr args = pop(start);
          const PyPtr callable = pop(start);
          push(reduce(start, *callable, expect(args, PyValue::Kind::tuple, start, "REDUCE arguments")));
          break;
        }
        case Op::build: {  // obj.__setstate__(state) or obj.__dict__.update(state)
          const PyPtr state = pop(start);
          build(start, top(start), state);
          break;
        }
        default:  // outside kMetadataOps: next() refused it already
          unknown_opcode(in);
      }
    }
  }

 private:
  // The next instruction, or the problem that ends the walk.
  void next(pickle::Instruction& in) {
    const pickle::Status status = walker_.next(in);
    // LONG1's width is judged first, whether or not the bytes it declares are all there.
    if (in.op == Op::long1 && in.number > 8) malformed(in.start, "an integer wider than 64 bits");
    switch (status) {
      case pickle::Status::ok:
        return;
      case pickle::Status::end:
        malformed(p_.size(), "it ends without STOP (the file is truncated)");
      case pickle::Status::unknown_opcode:
        unknown_opcode(in);
      case pickle::Status::truncated:
        if (in.op == Op::global) malformed(in.start, "GLOBAL without a newline");
        malformed(walker_.problem_at(), "it ends in the middle of a value (the file is truncated)");
    }
  }
  [[noreturn]] static void unknown_opcode(const pickle::Instruction& in) {
    malformed(in.start, fmt::format("opcode 0x{:02x} is not one a DCP .metadata uses", static_cast<uint8_t>(in.op)));
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  void push(PyPtr v) { stack_.push_back(std::move(v)); }
  void push_int(int64_t v) {
    auto p = make(PyValue::Kind::integer);
    p->integer = v;
    push(p);
  }
  void push_text(PyValue::Kind kind, std::string_view s) {
    auto p = make(kind);
    p->text = std::string(s);
    push(p);
  }
  PyPtr pop(size_t start) {
    if (stack_.size() <= floor()) malformed(start, "pop from an empty stack");
    PyPtr v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  const PyPtr& top(size_t start) const {
    if (stack_.size() <= floor()) malformed(start, "the stack is empty");
    return stack_.back();
  }
  std::vector<PyPtr> pop_to_mark(size_t start) {
    if (marks_.empty()) malformed(start, "no MARK");
    const size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<PyPtr> items(stack_.begin() + static_cast<std::ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return items;
  }
  static PyValue& expect(const PyPtr& v, PyValue::Kind kind, size_t start, std::string_view what) {
    if (v->kind != kind) malformed(start, fmt::format("{} on the wrong kind of value", what));
    return *v;
  }
  static void add_items(size_t start, PyValue& dict, const std::vector<PyPtr>& items) {
    if (items.size() % 2 != 0) malformed(start, "an odd number of dict items");
    for (size_t i = 0; i < items.size(); i += 2) dict.entries.emplace_back(items[i], items[i + 1]);
  }

  PyPtr global(size_t start, const std::string& module, const std::string& name) {
    if (!allowed_global(module, name))
      throw std::runtime_error(
          fmt::format("it names the global '{}.{}' at byte {}, which is not part of a DCP "
                      "checkpoint's metadata; refusing to read it (nothing was executed)",
                      module, name, start));
    auto g = make(PyValue::Kind::global);
    g->text = module + "." + name;
    return g;
  }

  PyPtr newobj(size_t start, const PyValue& cls, const PyValue& args) {
    if (cls.kind != PyValue::Kind::global || cls.text.rfind("torch.distributed.checkpoint.", 0) != 0 ||
        cls.text.ends_with("._MEM_FORMAT_ENCODING"))
      malformed(start, fmt::format("NEWOBJ of '{}'", cls.text));
    if (args.kind != PyValue::Kind::tuple || !args.items.empty())
      malformed(start, fmt::format("NEWOBJ of '{}' with arguments", cls.text));
    auto o = make(PyValue::Kind::object);
    o->text = cls.text;
    return o;
  }

  PyPtr reduce(size_t start, const PyValue& callable, const PyValue& args) {
    const std::string& f = callable.kind == PyValue::Kind::global ? callable.text : std::string();
    auto arg = [&](size_t i, PyValue::Kind kind) -> const PyValue& {
      if (args.items.size() <= i || args.items[i]->kind != kind) malformed(start, fmt::format("{}() arguments", f));
      return *args.items[i];
    };
    if (f == "torch.Size") {  // torch.Size((d0, d1, ...)) -> a tuple of ints
      auto t = make(PyValue::Kind::tuple);
      for (const PyPtr& d : arg(0, PyValue::Kind::tuple).items) {
        if (d->kind != PyValue::Kind::integer) malformed(start, "torch.Size of a non-integer");
        t->items.push_back(d);
      }
      return t;
    }
    if (f == "torch.serialization._get_layout") {  // the layout's name
      auto s = make(PyValue::Kind::string);
      s->text = arg(0, PyValue::Kind::string).text;
      return s;
    }
    if (f == std::string(kMetadataModule) + "._MEM_FORMAT_ENCODING") {  // the enum's value
      auto i = make(PyValue::Kind::integer);
      i->integer = arg(0, PyValue::Kind::integer).integer;
      return i;
    }
    if (f.rfind("pathlib.", 0) == 0) {  // PosixPath('/', 'a', 'b') -> "/a/b"
      auto s = make(PyValue::Kind::string);
      for (const PyPtr& part : args.items) {
        if (part->kind != PyValue::Kind::string) malformed(start, "a path part that is not a string");
        if (!s->text.empty() && !s->text.ends_with('/')) s->text += '/';
        s->text += part->text;
      }
      return s;
    }
    if (f == "collections.OrderedDict" && args.items.empty()) return make(PyValue::Kind::dict);
    malformed(start, fmt::format("REDUCE of '{}'", f.empty() ? std::string("a non-global") : f));
  }

  static void build(size_t start, const PyPtr& obj, const PyPtr& state) {
    if (obj->kind != PyValue::Kind::object) malformed(start, "BUILD of a value that is not an object");
    auto merge = [&](const PyValue& fields) {
      for (const auto& [k, v] : fields.entries) {
        if (k->kind != PyValue::Kind::string) malformed(start, "an object field name that is not a string");
        obj->entries.emplace_back(k, v);
      }
    };
    if (state->kind == PyValue::Kind::dict) {
      merge(*state);
    } else if (state->kind == PyValue::Kind::tuple && state->items.size() == 2 &&
               (state->items[0]->kind == PyValue::Kind::none || state->items[0]->kind == PyValue::Kind::dict) &&
               state->items[1]->kind == PyValue::Kind::dict) {
      // (dict state, slot state), as pickle writes for classes with __slots__.
      if (state->items[0]->kind == PyValue::Kind::dict) merge(*state->items[0]);
      merge(*state->items[1]);
    } else {
      obj->state = state;  // a __setstate__ argument (TensorProperties' tuple)
    }
  }

  std::string_view p_;
  pickle::Walker walker_;
  std::vector<PyPtr> stack_;
  std::vector<size_t> marks_;
  std::vector<PyPtr> memo_;
};

}  // namespace

const PyValue* PyValue::field(std::string_view name) const {
  // The last assignment wins, as with repeated __dict__ updates.
  for (auto it = entries.rbegin(); it != entries.rend(); ++it)
    if (it->first->kind == Kind::string && it->first->text == name) return it->second.get();
  return nullptr;
}

PyPtr read_pickle(std::string_view bytes) { return Unpickler(bytes).run(); }

PickleWriter::PickleWriter() { out_ += "\x80\x02"; }  // PROTO 2

void PickleWriter::global(const std::string& module, const std::string& name) {
  const std::string key = module + "\n" + name + "\n";
  for (const auto& [k, index] : memo_) {
    if (k != key) continue;
    out_ += 'j';  // LONG_BINGET
    for (int i = 0; i < 4; ++i) out_ += static_cast<char>((index >> (8 * i)) & 0xff);
    return;
  }
  out_ += 'c';
  out_ += key;
  const auto index = static_cast<uint32_t>(memo_.size());
  memo_.emplace_back(key, index);
  out_ += 'r';  // LONG_BINPUT
  for (int i = 0; i < 4; ++i) out_ += static_cast<char>((index >> (8 * i)) & 0xff);
}

void PickleWriter::none() { out_ += 'N'; }
void PickleWriter::boolean(bool v) { out_ += static_cast<char>(v ? 0x88 : 0x89); }

void PickleWriter::integer(int64_t v) {
  if (v >= 0 && v < 256) {
    out_ += 'K';
    out_ += static_cast<char>(v);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out_ += 'J';
    const auto u = static_cast<uint32_t>(static_cast<int32_t>(v));
    for (int i = 0; i < 4; ++i) out_ += static_cast<char>((u >> (8 * i)) & 0xff);
  } else {
    out_ += '\x8a';  // LONG1 with 8 bytes, two's complement
    out_ += '\x08';
    const auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) out_ += static_cast<char>((u >> (8 * i)) & 0xff);
  }
}

void PickleWriter::string(std::string_view v) {
  out_ += 'X';  // BINUNICODE: the text is UTF-8 already
  const auto n = static_cast<uint32_t>(v.size());
  for (int i = 0; i < 4; ++i) out_ += static_cast<char>((n >> (8 * i)) & 0xff);
  out_ += v;
}

void PickleWriter::mark() { out_ += '('; }
void PickleWriter::tuple_from_mark() { out_ += 't'; }
void PickleWriter::empty_tuple() { out_ += ')'; }
void PickleWriter::empty_dict() { out_ += '}'; }
void PickleWriter::empty_list() { out_ += ']'; }
void PickleWriter::set_items_from_mark() { out_ += 'u'; }
void PickleWriter::append() { out_ += 'a'; }
void PickleWriter::newobj() { out_ += '\x81'; }
void PickleWriter::reduce() { out_ += 'R'; }
void PickleWriter::build() { out_ += 'b'; }

std::string PickleWriter::finish() {
  out_ += '.';
  return std::move(out_);
}

}  // namespace fulgur::dcp::detail
