// A write-only encoder for the protocol buffer wire format, just enough for the few TensorBoard
// messages this logger writes (Event, Summary, TensorProto, hparams plugin data).
//
// Why not libprotobuf: the process already holds libtorch's bundled protobuf, and libtorch_cpu.so
// exports some google::protobuf symbols, which would interpose on a second (Debian) protobuf
// runtime loaded into the same process; generated code would also need protoc at build time. The
// wire format is small and stable, we only ever write it, and the tests read every file back with
// TensorBoard's own (Python protobuf) reader.
#pragma once

#include <bit>
#include <cstdint>
#include <string>
#include <string_view>

namespace fulgur::tensorboard {

class ProtoWriter {
 public:
  // int32/int64/uint64/bool/enum fields (wire type 0). Negative values take ten bytes, as
  // protobuf encodes int64.
  void varint_field(uint32_t field, uint64_t value) {
    tag(field, 0);
    varint(value);
  }
  void int64_field(uint32_t field, int64_t value) { varint_field(field, static_cast<uint64_t>(value)); }
  void bool_field(uint32_t field, bool value) { varint_field(field, value ? 1 : 0); }

  // double (wire type 1) and float (wire type 5), little-endian.
  void double_field(uint32_t field, double value) {
    tag(field, 1);
    fixed(std::bit_cast<uint64_t>(value), 8);
  }
  void float_field(uint32_t field, float value) {
    tag(field, 5);
    fixed(std::bit_cast<uint32_t>(value), 4);
  }

  // string / bytes / embedded message (wire type 2).
  void bytes_field(uint32_t field, std::string_view bytes) {
    tag(field, 2);
    varint(bytes.size());
    out_.append(bytes);
  }
  void message_field(uint32_t field, const ProtoWriter& message) { bytes_field(field, message.bytes()); }

  const std::string& bytes() const { return out_; }
  void clear() { out_.clear(); }

 private:
  void tag(uint32_t field, uint32_t wire_type) { varint((uint64_t{field} << 3) | wire_type); }
  void varint(uint64_t value) {
    while (value >= 0x80) {
      out_.push_back(static_cast<char>((value & 0x7f) | 0x80));
      value >>= 7;
    }
    out_.push_back(static_cast<char>(value));
  }
  void fixed(uint64_t value, int bytes) {
    for (int i = 0; i < bytes; ++i) out_.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  }

  std::string out_;
};

}  // namespace fulgur::tensorboard
