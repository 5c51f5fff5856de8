// The pickle opcode decoder. See pickle_walker.h.
#include "pickle_walker.h"

namespace fulgur::detail::pickle {

namespace {

// How an opcode's argument is laid out after it.
struct Layout {
  enum Kind { none, fixed, length_prefixed, two_lines, unknown } kind;
  size_t width = 0;  // fixed: the argument's bytes; length_prefixed: the prefix's
};

constexpr Layout layout_of(Op op) {
  switch (op) {
    // clang-format off
    case Op::proto: case Op::binint1: case Op::binget: case Op::binput:
      return {Layout::fixed, 1};
    case Op::binint2:
      return {Layout::fixed, 2};
    case Op::binint: case Op::long_binget: case Op::long_binput:
      return {Layout::fixed, 4};
    case Op::binfloat: case Op::frame:
      return {Layout::fixed, 8};
    case Op::long1: case Op::short_binunicode: case Op::short_binbytes: case Op::short_binstring:
      return {Layout::length_prefixed, 1};
    case Op::binunicode: case Op::binbytes: case Op::binstring: case Op::long4:
      return {Layout::length_prefixed, 4};
    case Op::binunicode8:
      return {Layout::length_prefixed, 8};
    case Op::global:
      return {Layout::two_lines};
    case Op::mark: case Op::stop: case Op::pop: case Op::pop_mark: case Op::none: case Op::newtrue:
    case Op::newfalse: case Op::empty_dict: case Op::empty_list: case Op::empty_tuple: case Op::tuple:
    case Op::tuple1: case Op::tuple2: case Op::tuple3: case Op::list: case Op::dict: case Op::append:
    case Op::appends: case Op::setitem: case Op::setitems: case Op::stack_global: case Op::memoize:
    case Op::reduce: case Op::build: case Op::newobj: case Op::binpersid:
      return {Layout::none};
  }
  // clang-format on
  return {Layout::unknown};  // a byte that names no Op
}

}  // namespace

Status Walker::next(Instruction& in) {
  in = Instruction{};
  in.start = at_;
  if (at_ >= bytes_.size()) return Status::end;
  const auto code = static_cast<uint8_t>(bytes_[at_]);
  in.op = static_cast<Op>(code);
  const Layout layout = layout_of(in.op);
  if (!understood_.contains(code) || layout.kind == Layout::unknown) return Status::unknown_opcode;

  size_t at = at_ + 1;
  // The argument's next `count` bytes; false when they are not all there.
  auto take = [&](uint64_t count, std::string_view& out) {
    problem_at_ = at;
    if (count > bytes_.size() - at) return false;
    out = bytes_.substr(at, count);
    at += count;
    return true;
  };
  // The argument's next newline-terminated line, without the newline.
  auto line = [&](std::string_view& out) {
    problem_at_ = at;
    const size_t newline = bytes_.find('\n', at);
    if (newline == std::string_view::npos) return false;
    out = bytes_.substr(at, newline - at);
    at = newline + 1;
    return true;
  };

  std::string_view prefix;
  switch (layout.kind) {
    case Layout::fixed:
      if (!take(layout.width, in.data)) return Status::truncated;
      in.number = little_endian(in.data);
      break;
    case Layout::length_prefixed:
      if (!take(layout.width, prefix)) return Status::truncated;
      in.number = little_endian(prefix);
      if (!take(in.number, in.data)) return Status::truncated;
      break;
    case Layout::two_lines:
      if (!line(in.module) || !line(in.name)) return Status::truncated;
      break;
    case Layout::none:
    case Layout::unknown:
      break;
  }
  in.end = at;
  at_ = at;
  return Status::ok;
}

}  // namespace fulgur::detail::pickle
