#include "event_file.h"

#include <fulgur/error.h>

#include <fmt/format.h>
#include <boost/crc.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>

#include <fcntl.h>
#include <unistd.h>

#include "proto_writer.h"

namespace fulgur::tensorboard {

namespace {

// CRC-32C: polynomial 0x1EDC6F41, reflected, initial and final XOR all ones.
using Crc32c = boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true>;

void append_le(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

}  // namespace

uint32_t masked_crc32c(std::string_view data) {
  Crc32c crc;
  crc.process_bytes(data.data(), data.size());
  const uint32_t value = crc.checksum();
  // TFRecord's mask keeps a CRC of data that itself contains CRCs from looking like one.
  return ((value >> 15) | (value << 17)) + 0xa282ead8u;
}

EventFile::~EventFile() {
  if (file_) std::fclose(file_);
}

void EventFile::open(const std::string& dir, std::string_view owner) {
  owner_ = std::string(owner);
  static std::atomic<int> counter{0};
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  const double wall_time = std::chrono::duration<double>(now).count();
  path_ = fmt::format("{}/events.out.tfevents.{}.{}.{}.{}", dir, static_cast<int64_t>(wall_time), host_name(),
                      ::getpid(), counter++);
  const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) fail("creating");
  file_ = ::fdopen(fd, "w");
  if (!file_) {
    ::close(fd);
    fail("opening");
  }
  ProtoWriter event;
  event.double_field(1, wall_time);       // Event.wall_time
  event.bytes_field(3, "brain.Event:2");  // Event.file_version
  write(event.bytes());
  flush();
}

void EventFile::write(std::string_view event) {
  if (!file_) return;
  record_.clear();
  append_le(record_, event.size(), 8);
  append_le(record_, masked_crc32c(record_), 4);
  record_.append(event);
  append_le(record_, masked_crc32c(event), 4);
  if (std::fwrite(record_.data(), 1, record_.size(), file_) != record_.size()) fail("writing");
}

void EventFile::flush() {
  if (file_ && std::fflush(file_) != 0) fail("flushing");
}

void EventFile::close() {
  if (!file_) return;
  std::FILE* file = file_;
  file_ = nullptr;
  if (std::fclose(file) != 0) fail("closing");
}

void EventFile::fail(std::string_view what) const {
  throw Error(ErrorKind::io,
              fmt::format("{}: {} the event file '{}' failed: {}; check the disk space and permissions of its "
                          "directory",
                          owner_, what, path_, std::strerror(errno)));
}

}  // namespace fulgur::tensorboard
