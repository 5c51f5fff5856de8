// The `.metadata` pickle codecs. See distributed_checkpoint_pickle.h for why they exist.
#include "distributed_checkpoint_pickle.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <stdexcept>

namespace fulgur::dcp::detail {

namespace {

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

class Unpickler {
 public:
  explicit Unpickler(std::string_view bytes) : p_(bytes) {}

  PyPtr run() {
    while (true) {
      if (at_ >= p_.size()) malformed(at_, "it ends without STOP (the file is truncated)");
      const size_t start = at_;
      const auto op = static_cast<uint8_t>(p_[at_++]);
      switch (op) {
        case 0x80:  // PROTO
          take(1);
          break;
        case 0x95:  // FRAME: a length hint only
          take(8);
          break;
        case '.':  // STOP
          if (stack_.size() != 1 || !marks_.empty()) malformed(start, "STOP with an unbalanced stack");
          return stack_.back();
        case '(':
          marks_.push_back(stack_.size());
          break;
        case '0':  // POP
          pop(start);
          break;
        case '1':  // POP_MARK
          pop_to_mark(start);
          break;
        case 'N':
          push(make(PyValue::Kind::none));
          break;
        case 0x88:
        case 0x89: {  // NEWTRUE, NEWFALSE
          auto v = make(PyValue::Kind::boolean);
          v->boolean = op == 0x88;
          push(v);
          break;
        }
        case 'K':
          push_int(static_cast<int64_t>(le(take(1), 1)));
          break;
        case 'M':
          push_int(static_cast<int64_t>(le(take(2), 2)));
          break;
        case 'J':
          push_int(static_cast<int32_t>(static_cast<uint32_t>(le(take(4), 4))));
          break;
        case 0x8a: {  // LONG1: little-endian two's complement
          const size_t n = static_cast<uint8_t>(take(1)[0]);
          if (n > 8) malformed(start, "an integer wider than 64 bits");
          const std::string_view b = take(n);
          uint64_t v = le(b, n);
          if (n > 0 && n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
          push_int(static_cast<int64_t>(v));
          break;
        }
        case 'G': {  // BINFLOAT: big-endian IEEE double
          const std::string_view b = take(8);
          uint64_t bits = 0;
          for (char c : b) bits = (bits << 8) | static_cast<uint8_t>(c);
          auto v = make(PyValue::Kind::floating);
          std::memcpy(&v->floating, &bits, sizeof bits);
          push(v);
          break;
        }
        case 0x8c:  // SHORT_BINUNICODE
          push_text(PyValue::Kind::string, take(static_cast<uint8_t>(take(1)[0])));
          break;
        case 'X':  // BINUNICODE
          push_text(PyValue::Kind::string, take(le(take(4), 4)));
          break;
        case 0x8d:  // BINUNICODE8
          push_text(PyValue::Kind::string, take(le(take(8), 8)));
          break;
        case 'C':  // SHORT_BINBYTES
          push_text(PyValue::Kind::bytes, take(static_cast<uint8_t>(take(1)[0])));
          break;
        case 'B':  // BINBYTES
          push_text(PyValue::Kind::bytes, take(le(take(4), 4)));
          break;
        case 0x94:  // MEMOIZE
          memo_.push_back(top(start));
          break;
        case 'q':
        case 'r': {  // BINPUT, LONG_BINPUT
          const uint64_t index = le(take(op == 'q' ? 1 : 4), op == 'q' ? 1 : 4);
          if (index > p_.size()) malformed(start, fmt::format("memo index {} in {} bytes", index, p_.size()));
          if (memo_.size() <= index) memo_.resize(index + 1);
          memo_[index] = top(start);
          break;
        }
        case 'h':
        case 'j': {  // BINGET, LONG_BINGET
          const uint64_t index = le(take(op == 'h' ? 1 : 4), op == 'h' ? 1 : 4);
          if (index >= memo_.size() || !memo_[index]) malformed(start, fmt::format("unknown memo entry {}", index));
          push(memo_[index]);
          break;
        }
        case 'c': {  // GLOBAL: "module\nname\n"
          const std::string module = line(start);
          const std::string name = line(start);
          push(global(start, module, name));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          const PyPtr name = pop(start);
          const PyPtr module = pop(start);
          if (module->kind != PyValue::Kind::string || name->kind != PyValue::Kind::string)
            malformed(start, "STACK_GLOBAL of a non-string");
          push(global(start, module->text, name->text));
          break;
        }
        case ')':
          push(make(PyValue::Kind::tuple));
          break;
        case '}':
          push(make(PyValue::Kind::dict));
          break;
        case ']':
          push(make(PyValue::Kind::list));
          break;
        case 0x85:
        case 0x86:
        case 0x87: {  // TUPLE1-3
          const size_t n = op - 0x84u;
          if (stack_.size() < n + floor()) malformed(start, "TUPLEn on a short stack");
          auto t = make(PyValue::Kind::tuple);
          t->items.assign(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          push(t);
          break;
        }
        case 't':
        case 'l': {  // TUPLE, LIST
          auto t = make(op == 't' ? PyValue::Kind::tuple : PyValue::Kind::list);
          t->items = pop_to_mark(start);
          push(t);
          break;
        }
        case 'd': {  // DICT
          auto d = make(PyValue::Kind::dict);
          add_items(start, *d, pop_to_mark(start));
          push(d);
          break;
        }
        case 's': {  // SETITEM
          const PyPtr value = pop(start);
          const PyPtr key = pop(start);
          PyValue& d = expect(top(start), PyValue::Kind::dict, start, "SETITEM");
          d.entries.emplace_back(key, value);
          break;
        }
        case 'u': {  // SETITEMS
          std::vector<PyPtr> items = pop_to_mark(start);
          add_items(start, expect(top(start), PyValue::Kind::dict, start, "SETITEMS"), items);
          break;
        }
        case 'a': {  // APPEND
          const PyPtr value = pop(start);
          expect(top(start), PyValue::Kind::list, start, "APPEND").items.push_back(value);
          break;
        }
        case 'e': {  // APPENDS
          std::vector<PyPtr> items = pop_to_mark(start);
          PyValue& list = expect(top(start), PyValue::Kind::list, start, "APPENDS");
          list.items.insert(list.items.end(), items.begin(), items.end());
          break;
        }
        case 0x81: {  // NEWOBJ: cls.__new__(cls, *args)
          const PyPtr args = pop(start);
          const PyPtr cls = pop(start);
          push(newobj(start, *cls, *args));
          break;
        }
        case 'R': {  // REDUCE: callable(*args)
          const PyPtr args = pop(start);
          const PyPtr callable = pop(start);
          push(reduce(start, *callable, expect(args, PyValue::Kind::tuple, start, "REDUCE arguments")));
          break;
        }
        case 'b': {  // BUILD: obj.__setstate__(state) or obj.__dict__.update(state)
          const PyPtr state = pop(start);
          build(start, top(start), state);
          break;
        }
        default:
          malformed(start, fmt::format("opcode 0x{:02x} is not one a DCP .metadata uses", op));
      }
    }
  }

 private:
  std::string_view take(uint64_t n) {
    if (n > p_.size() - at_) malformed(at_, "it ends in the middle of a value (the file is truncated)");
    const std::string_view s = p_.substr(at_, n);
    at_ += n;
    return s;
  }
  static uint64_t le(std::string_view b, size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(b[i])} << (8 * i);
    return v;
  }
  std::string line(size_t start) {
    const size_t end = p_.find('\n', at_);
    if (end == std::string_view::npos) malformed(start, "GLOBAL without a newline");
    std::string s(p_.substr(at_, end - at_));
    at_ = end + 1;
    return s;
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
  size_t at_ = 0;
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
