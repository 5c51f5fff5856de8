// Internal: one decoder of pickle opcodes, shared by every piece of the SDK that reads a pickle
// itself (the memo guard and the OrderedDict rewrite in front of LibTorch's unpickler, and the
// DCP `.metadata` unpickler).
//
// The walker only decodes: each opcode with its argument, every length checked against the bytes
// that are there, because the pickles come from files on disk. What an opcode means (the stack,
// the memo, which values are allowed) is the caller's: each walks with the set of opcodes it
// understands and gets the first one outside it reported, not skipped.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string_view>

namespace fulgur::detail::pickle {

/// The opcodes the walker decodes: those of protocols 2 to 4 that torch.save, LibTorch's pickler
/// and Python's pickle of DCP's `.metadata` write (names as in Python's pickletools).
enum class Op : uint8_t {
  mark = '(',
  stop = '.',
  pop = '0',
  pop_mark = '1',
  binint = 'J',
  binint1 = 'K',
  binint2 = 'M',
  none = 'N',
  binpersid = 'Q',
  reduce = 'R',
  binstring = 'T',
  short_binstring = 'U',
  binunicode = 'X',
  binbytes = 'B',
  short_binbytes = 'C',
  binfloat = 'G',
  append = 'a',
  build = 'b',
  global = 'c',
  dict = 'd',
  appends = 'e',
  binget = 'h',
  long_binget = 'j',
  list = 'l',
  binput = 'q',
  long_binput = 'r',
  setitem = 's',
  tuple = 't',
  setitems = 'u',
  empty_dict = '}',
  empty_list = ']',
  empty_tuple = ')',
  proto = 0x80,
  newobj = 0x81,
  tuple1 = 0x85,
  tuple2 = 0x86,
  tuple3 = 0x87,
  newtrue = 0x88,
  newfalse = 0x89,
  long1 = 0x8a,
  long4 = 0x8b,
  short_binunicode = 0x8c,
  binunicode8 = 0x8d,
  stack_global = 0x93,
  memoize = 0x94,
  frame = 0x95,
};

/// A set of opcodes: the ones a caller understands.
class OpSet {
 public:
  constexpr OpSet(std::initializer_list<Op> ops) {
    for (Op op : ops) bits_[static_cast<uint8_t>(op) / 64] |= uint64_t{1} << (static_cast<uint8_t>(op) % 64);
  }
  constexpr bool contains(uint8_t code) const { return (bits_[code / 64] >> (code % 64)) & 1; }

 private:
  std::array<uint64_t, 4> bits_{};
};

/// One decoded opcode.
struct Instruction {
  Op op{};           ///< the opcode; for Status::unknown_opcode the raw byte, which may name no Op
  size_t start = 0;  ///< offset of the opcode byte
  size_t end = 0;    ///< offset just past its argument
  /// A fixed-width argument (PROTO, BININT*, the memo index of BINGET/BINPUT, FRAME), read little-
  /// endian; for a length-prefixed one, the length it declares (set even when the bytes it
  /// declares are not all there).
  uint64_t number = 0;
  /// The argument's bytes: those of a fixed-width argument (BINFLOAT's 8 are big-endian), the
  /// payload of a length-prefixed one (strings, bytes, LONG1's integer).
  std::string_view data;
  std::string_view module, name;  ///< GLOBAL's two lines, without their newlines
};

/// Why Walker::next stopped, or Status::ok.
enum class Status {
  ok,              ///< an instruction was decoded
  end,             ///< no bytes left
  unknown_opcode,  ///< an opcode outside the caller's set (or one the walker does not know)
  truncated,       ///< the argument runs past the end (a GLOBAL without its two newlines included)
};

/// Walks a pickle opcode by opcode. After a status other than ok it stays where it stopped.
class Walker {
 public:
  /// `bytes` must outlive the walker and its instructions (they point into it).
  Walker(std::string_view bytes, OpSet understood) : bytes_(bytes), understood_(understood) {}

  /// Decodes the next instruction into `in`. On Status::truncated, `problem_at` is the offset of
  /// the part of the argument that is cut short (its length prefix or the bytes it declares).
  Status next(Instruction& in);

  size_t problem_at() const { return problem_at_; }

 private:
  std::string_view bytes_;
  OpSet understood_;
  size_t at_ = 0;
  size_t problem_at_ = 0;
};

/// Whether a BINPUT/LONG_BINPUT memo index can occur in a pickle of `size` bytes. Each memo entry
/// takes at least one opcode, so a larger index is corrupt; an unpickler that sizes its memo
/// table by the index would allocate gigabytes for it (a 2 KB fuzzed checkpoint naming index
/// 2.5e9 made LibTorch's allocate 40 GB).
constexpr bool memo_index_possible(uint64_t index, size_t size) { return index <= size; }

/// `bytes` (at most 8) as an unsigned little-endian integer.
constexpr uint64_t little_endian(std::string_view bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < bytes.size() && i < 8; ++i) v |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  return v;
}

}  // namespace fulgur::detail::pickle
