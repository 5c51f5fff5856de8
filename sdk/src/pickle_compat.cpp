#include "pickle_compat.h"

#include <set>
#include <string_view>
#include <vector>

namespace fulgur::detail {

namespace {

// What the walk knows about a value on the pickle stack: where its opcodes begin in the output
// (so they can be replaced) and whether it is the OrderedDict class or an instance of it.
enum class Tag { other, ordered_dict_class, ordered_dict };
struct Slot {
  size_t out_offset;
  Tag tag;
};

}  // namespace

// LibTorch's unpickler has no POP, so values cannot be discarded after the fact; instead the walk
// tracks the stack (which output bytes built each value) and replaces bytes already written:
//   `OrderedDict` `()` REDUCE      -> EMPTY_DICT   (the SETITEMS that follow fill it)
//   <ordered dict> <state> BUILD   -> <ordered dict>   (the state's opcodes are dropped)
std::optional<std::string> plain_dicts_for_ordered_dicts(const uint8_t* p, size_t n) {
  constexpr std::string_view kOrderedDict = "collections\nOrderedDict\n";
  const std::string_view all(reinterpret_cast<const char*>(p), n);
  if (all.find(kOrderedDict) == std::string_view::npos) return std::nullopt;

  std::string out;
  out.reserve(n);
  std::vector<Slot> stack;
  std::vector<std::pair<size_t, size_t>> marks;  // (stack size, output offset) at each MARK
  std::set<uint64_t> class_memo;                 // memo ids holding the OrderedDict class
  bool rewritten = false;
  auto le = [&](size_t from, size_t k) {
    uint64_t v = 0;
    for (size_t i = 0; i < k; ++i) v |= uint64_t{p[from + i]} << (8 * i);
    return v;
  };
  // Pops `k` values and pushes one that starts where the first popped one started.
  auto combine = [&](size_t k, Tag tag) -> bool {
    if (stack.size() < k) return false;
    const size_t offset = stack[stack.size() - k].out_offset;
    stack.resize(stack.size() - k);
    stack.push_back({offset, tag});
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

  size_t at = 0;
  while (at < n) {
    const size_t start = at;
    const size_t out_start = out.size();
    const uint8_t op = p[at++];
    size_t arg = 0;
    bool ok = true;
    switch (op) {
      case 0x80:  // PROTO
        arg = 1;
        break;
      case '.':  // STOP
        break;
      case 'c': {  // GLOBAL: two newline-terminated lines
        size_t end = at;
        for (int line = 0; line < 2; ++line) {
          while (end < n && p[end] != '\n') ++end;
          if (end >= n) return std::nullopt;
          ++end;
        }
        arg = end - at;
        stack.push_back({out_start, all.substr(at, arg) == kOrderedDict ? Tag::ordered_dict_class : Tag::other});
        break;
      }
      case 'h':
      case 'j': {  // BINGET, LONG_BINGET
        arg = op == 'h' ? 1 : 4;
        if (n - at < arg) return std::nullopt;
        stack.push_back({out_start, class_memo.count(le(at, arg)) ? Tag::ordered_dict_class : Tag::other});
        break;
      }
      case 'q':
      case 'r': {  // BINPUT, LONG_BINPUT
        arg = op == 'q' ? 1 : 4;
        if (n - at < arg || stack.empty()) return std::nullopt;
        if (stack.back().tag == Tag::ordered_dict_class)
          class_memo.insert(le(at, arg));
        else
          class_memo.erase(le(at, arg));
        break;
      }
      case 'K':
        arg = 1;
        stack.push_back({out_start, Tag::other});
        break;
      case 'M':
        arg = 2;
        stack.push_back({out_start, Tag::other});
        break;
      case 'J':
        arg = 4;
        stack.push_back({out_start, Tag::other});
        break;
      case 'G':
        arg = 8;
        stack.push_back({out_start, Tag::other});
        break;
      case 0x8a:
      case 0x8c:
      case 'C':
      case 'U':  // LONG1, SHORT_BINUNICODE, SHORT_BINBYTES, SHORT_BINSTRING
        if (n - at < 1) return std::nullopt;
        arg = 1 + p[at];
        stack.push_back({out_start, Tag::other});
        break;
      case 'X':
      case 'B':
      case 'T':
      case 0x8b:  // BINUNICODE, BINBYTES, BINSTRING, LONG4
        if (n - at < 4) return std::nullopt;
        arg = 4 + le(at, 4);
        stack.push_back({out_start, Tag::other});
        break;
      case '}':
      case ']':
      case ')':
      case 'N':
      case 0x88:
      case 0x89:  // EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, NONE, NEWTRUE, NEWFALSE
        stack.push_back({out_start, Tag::other});
        break;
      case '(':
        marks.emplace_back(stack.size(), out_start);
        break;
      case 'a':  // APPEND
        ok = stack.size() >= 2;
        if (ok) stack.pop_back();
        break;
      case 's':  // SETITEM
        ok = stack.size() >= 3;
        if (ok) stack.resize(stack.size() - 2);
        break;
      case 'e':
      case 'u':  // APPENDS, SETITEMS
        ok = to_mark(false);
        break;
      case 't':
      case 'l':
      case 'd':  // TUPLE, LIST, DICT
        ok = to_mark(true);
        break;
      case 0x85:
        ok = combine(1, Tag::other);
        break;
      case 0x86:
        ok = combine(2, Tag::other);
        break;
      case 0x87:
        ok = combine(3, Tag::other);
        break;
      case 'Q':  // BINPERSID
        ok = combine(1, Tag::other);
        break;
      case 0x81:  // NEWOBJ
        ok = combine(2, Tag::other);
        break;
      case 'R': {  // REDUCE
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
        ok = combine(2, Tag::other);
        break;
      }
      case 'b': {  // BUILD
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
        return std::nullopt;  // protocol 4 framing, text opcodes, ...: not what torch.save writes
    }
    if (!ok || arg > n - at) return std::nullopt;
    out.append(all.substr(start, 1 + arg));
    at += arg;
  }
  if (!rewritten) return std::nullopt;
  return out;
}

}  // namespace fulgur::detail
