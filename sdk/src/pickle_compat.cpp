// The LibTorch <-> Python pickle adaptations. See pickle_compat.h for why each exists.
#include "pickle_compat.h"

#include "pickle_walker.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/jit_type.h>

#include <fmt/format.h>

#include <set>
#include <utility>
#include <vector>

namespace fulgur::detail {

using pickle::Op;

c10::IValue plain_containers(const c10::IValue& value) {
  if (value.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    const c10::ArrayRef<c10::IValue> items = value.toListRef();
    out.reserve(items.size());
    for (const c10::IValue& item : items) out.push_back(plain_containers(item));
    return out;
  }
  if (value.isGenericDict()) {
    const c10::impl::GenericDict dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), c10::AnyType::get());
    out.reserve(dict.size());
    for (const auto& entry : dict) out.insert(entry.key(), plain_containers(entry.value()));
    return out;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> items;
    for (const c10::IValue& item : value.toTupleRef().elements()) items.push_back(plain_containers(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return value;
}

namespace {

// The opcodes the memo guard walks: every one the walker decodes, a superset of those LibTorch's
// unpickler reads. Stopping at one that torch reads would hand it the BINPUTs after it unchecked
// (the guard once stopped at LIST, and "(l" before a LONG_BINPUT got a 16 GiB memo table through).
constexpr pickle::OpSet kMemoGuardOps{
    // clang-format off
    Op::proto, Op::frame, Op::stop, Op::mark, Op::pop, Op::pop_mark,
    Op::binint1, Op::binint2, Op::binint, Op::binfloat, Op::long1, Op::long4, Op::none, Op::newtrue, Op::newfalse,
    Op::short_binunicode, Op::binunicode, Op::binunicode8, Op::short_binbytes, Op::binbytes, Op::short_binstring,
    Op::binstring, Op::empty_dict, Op::empty_list, Op::empty_tuple, Op::tuple, Op::tuple1, Op::tuple2, Op::tuple3,
    Op::list, Op::dict, Op::append, Op::appends, Op::setitem, Op::setitems,
    Op::binget, Op::long_binget, Op::binput, Op::long_binput, Op::memoize,
    Op::global, Op::stack_global, Op::reduce, Op::build, Op::newobj, Op::binpersid,
    // clang-format on
};

// The opcodes the OrderedDict rewrite follows: what torch.save writes (protocol 2); not protocol
// 4's framing, POP, ...
constexpr pickle::OpSet kRewriteOps{
    // clang-format off
    Op::proto, Op::stop, Op::mark,
    Op::binint1, Op::binint2, Op::binint, Op::binfloat, Op::long1, Op::long4, Op::none, Op::newtrue, Op::newfalse,
    Op::short_binunicode, Op::binunicode, Op::short_binbytes, Op::binbytes, Op::short_binstring, Op::binstring,
    Op::empty_dict, Op::empty_list, Op::empty_tuple, Op::tuple, Op::tuple1, Op::tuple2, Op::tuple3,
    Op::list, Op::dict, Op::append, Op::appends, Op::setitem, Op::setitems,
    Op::binget, Op::long_binget, Op::binput, Op::long_binput,
    Op::global, Op::reduce, Op::build, Op::newobj, Op::binpersid,
    // clang-format on
};

// What the walk knows about a value on the pickle stack: where its opcodes begin in the output
// (so they can be replaced) and whether it is the OrderedDict class or an instance of it.
enum class Tag { other, ordered_dict_class, ordered_dict };
struct Slot {
  size_t out_offset;
  Tag tag;
};

}  // namespace

std::string pickle_memo_problem(std::string_view pickle) {
  pickle::Walker walker(pickle, kMemoGuardOps);
  pickle::Instruction in;
  pickle::Status status;
  while ((status = walker.next(in)) == pickle::Status::ok && in.op != Op::stop)
    if ((in.op == Op::binput || in.op == Op::long_binput) && !pickle::memo_index_possible(in.number, pickle.size()))
      return fmt::format("its pickle names memo entry {} in {} bytes", in.number, pickle.size());
  // An argument that runs past the end: LibTorch's unpickler sizes the string it reads into by the
  // declared length before it finds the bytes missing (a 1.7 KB fuzzed checkpoint declaring a
  // 4 GiB BINUNICODE made it allocate 4 GiB).
  if (status == pickle::Status::truncated)
    return fmt::format(
        "its pickle is cut short: the argument of opcode 0x{:02x} at offset {} runs past the end of "
        "the pickle ({} bytes){}",
        static_cast<unsigned>(in.op), in.start, pickle.size(),
        in.number == 0
            ? std::string()
            : fmt::format(" (it declares {} bytes, {} are left)", in.number, pickle.size() - walker.problem_at()));
  return {};
}

// LibTorch's unpickler has no POP, so values cannot be discarded after the fact; instead the walk
// tracks the stack (which output bytes built each value) and replaces bytes already written:
//   `OrderedDict` `()` REDUCE      -> EMPTY_DICT   (the SETITEMS that follow fill it)
//   <ordered dict> <state> BUILD   -> <ordered dict>   (the state's opcodes are dropped)
std::optional<std::string> plain_dicts_for_ordered_dicts(std::string_view pickle) {
  if (pickle.find("collections\nOrderedDict\n") == std::string_view::npos) return std::nullopt;

  std::string out;
  out.reserve(pickle.size());
  std::vector<Slot> stack;
  std::vector<std::pair<size_t, size_t>> marks;  // (stack size, output offset) at each MARK
  std::set<uint64_t> class_memo;                 // memo ids holding the OrderedDict class
  bool rewritten = false;
  // Pops `k` values and pushes one that starts where the first popped one started.
  auto combine = [&](size_t k) -> bool {
    if (stack.size() < k) return false;
    const size_t offset = stack[stack.size() - k].out_offset;
    stack.resize(stack.size() - k);
    stack.push_back({offset, Tag::other});
    return true;
  };
  // Pops back to the last MARK; with `push`, one value that starts at the MARK.
  auto to_mark = [&](bool push) -> bool {
    if (marks.empty() || marks.back().first > stack.size()) return false;
    const auto [size, offset] = marks.back();
    marks.pop_back();
    stack.resize(size);
    if (push) stack.push_back({offset, Tag::other});
    return true;
  };

  pickle::Walker walker(pickle, kRewriteOps);
  pickle::Instruction in;
  pickle::Status status;
  while ((status = walker.next(in)) == pickle::Status::ok) {
    const size_t out_start = out.size();
    bool ok = true;
    switch (in.op) {
      case Op::proto:
      case Op::stop:
        break;
      case Op::global:
        stack.push_back(
            {out_start, in.module == "collections" && in.name == "OrderedDict" ? Tag::ordered_dict_class : Tag::other});
        break;
      case Op::binget:
      case Op::long_binget:
        stack.push_back({out_start, class_memo.count(in.number) ? Tag::ordered_dict_class : Tag::other});
        break;
      case Op::binput:
      case Op::long_binput:
        if (stack.empty()) return std::nullopt;
        if (stack.back().tag == Tag::ordered_dict_class)
          class_memo.insert(in.number);
        else
          class_memo.erase(in.number);
        break;
      case Op::binint1:
      case Op::binint2:
      case Op::binint:
      case Op::binfloat:
      case Op::long1:
      case Op::long4:
      case Op::short_binunicode:
      case Op::binunicode:
      case Op::short_binbytes:
      case Op::binbytes:
      case Op::short_binstring:
      case Op::binstring:
      case Op::empty_dict:
      case Op::empty_list:
      case Op::empty_tuple:
      case Op::none:
      case Op::newtrue:
      case Op::newfalse:
        stack.push_back({out_start, Tag::other});
        break;
      case Op::mark:
        marks.emplace_back(stack.size(), out_start);
        break;
      case Op::append:
        ok = stack.size() >= 2;
        if (ok) stack.pop_back();
        break;
      case Op::setitem:
        ok = stack.size() >= 3;
        if (ok) stack.resize(stack.size() - 2);
        break;
      case Op::appends:
      case Op::setitems:
        ok = to_mark(false);
        break;
      case Op::tuple:
      case Op::list:
      case Op::dict:
        ok = to_mark(true);
        break;
      case Op::tuple1:
      case Op::binpersid:
        ok = combine(1);
        break;
      case Op::tuple2:
      case Op::newobj:
        ok = combine(2);
        break;
      case Op::tuple3:
        ok = combine(3);
        break;
      case Op::reduce: {
        if (stack.size() < 2) return std::nullopt;
        const Slot callable = stack[stack.size() - 2];
        if (callable.tag == Tag::ordered_dict_class) {
          // Python pickles OrderedDict(items) as OrderedDict() then SETITEMS; anything else is
          // left to torch.
          if (out.compare(stack.back().out_offset, std::string::npos, ")") != 0) return std::nullopt;
          // Everything since the class was pushed (its memo put, the argument tuple) becomes {}.
          out.resize(callable.out_offset);
          out.push_back('}');
          stack.resize(stack.size() - 2);
          stack.push_back({callable.out_offset, Tag::ordered_dict});
          rewritten = true;
          continue;  // the REDUCE itself is not copied
        }
        ok = combine(2);
        break;
      }
      case Op::build: {
        if (stack.size() < 2) return std::nullopt;
        if (stack[stack.size() - 2].tag == Tag::ordered_dict) {
          out.resize(stack.back().out_offset);  // drop the state's opcodes
          stack.pop_back();
          rewritten = true;
          continue;
        }
        stack.pop_back();
        break;
      }
      default:
        return std::nullopt;  // outside kRewriteOps: the walker stops before
    }
    if (!ok) return std::nullopt;
    out.append(pickle.substr(in.start, in.end - in.start));
  }
  if (status != pickle::Status::end || !rewritten) return std::nullopt;
  return out;
}

}  // namespace fulgur::detail
