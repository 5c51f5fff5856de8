// One TensorBoard event file: TFRecord framing (length, masked CRC32C of the length, payload,
// masked CRC32C of the payload) around serialized Event messages, buffered through stdio.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace fulgur::tensorboard {

// The CRC32C (Castagnoli) of `data`, masked as TFRecord stores it.
uint32_t masked_crc32c(std::string_view data);

class EventFile {
 public:
  EventFile() = default;
  ~EventFile();
  EventFile(const EventFile&) = delete;
  EventFile& operator=(const EventFile&) = delete;

  // Creates <dir>/events.out.tfevents.<seconds>.<host>.<pid>.<n> (the "tfevents" part is how
  // TensorBoard finds it) and writes the file-version event first, as every reader expects.
  void open(const std::string& dir, std::string_view owner);
  bool is_open() const { return file_ != nullptr; }
  // Appends one serialized Event (buffered; see flush()).
  void write(std::string_view event);
  void flush();
  void close();
  const std::string& path() const { return path_; }

 private:
  [[noreturn]] void fail(std::string_view what) const;

  std::FILE* file_ = nullptr;
  std::string path_;
  std::string owner_;
  std::string record_;  // reused framing buffer: no allocation per event once it has grown
};

}  // namespace fulgur::tensorboard
