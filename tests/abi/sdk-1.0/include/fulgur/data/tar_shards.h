// Tar shards in the WebDataset layout, streamed in order: an IterableDataset.
#pragma once

#include <fulgur/data/dataset.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fulgur::data {

struct TarShardOptions {
  // The member extension that becomes Sample::input, as raw bytes (uint8, 1-D): decode it with the
  // decode_image() transform, which runs in the loader's workers.
  TarShardOptions& input(std::string v) {
    input_ = std::move(v);
    return *this;
  }
  // The extension that becomes Sample::target: "cls" (an integer as text) gives an int64 scalar,
  // anything else raw bytes. "" for none.
  TarShardOptions& target(std::string v) {
    target_ = std::move(v);
    return *this;
  }
  // Further extensions, as raw bytes in Sample::extra in this order.
  TarShardOptions& extra(std::vector<std::string> v) {
    extra_ = std::move(v);
    return *this;
  }
  // A sample lacking a member, with an unparsable .cls, or a truncated shard's last sample, is
  // skipped (counted in skipped()) instead of failing; a truncated shard ends there.
  TarShardOptions& skip_corrupt(bool v) {
    skip_corrupt_ = v;
    return *this;
  }
  std::string input_ = "jpg";
  std::string target_ = "cls";
  std::vector<std::string> extra_;
  bool skip_corrupt_ = false;
};

// Reads the shards one after the other, each from start to end, never seeking back (a shard can
// be a pipe or a network mount). Members are grouped into samples by key, WebDataset's rule: the
// path up to the first '.' of its file name ("a/000.jpg" and "a/000.cls" are sample "a/000").
// With several replicas, replica r keeps samples r, r+R, r+2R, ... of the stream.
// Reader: POSIX ustar, with pax ('x') and GNU ('L') long names, as Python's tarfile and GNU tar
// write them; each header's checksum is verified, and a short read is an error naming the shard
// and the sample index.
class TarShards final : public IterableDataset {
 public:
  TarShards(std::vector<std::filesystem::path> shards, TarShardOptions options = {});
  ~TarShards() override;
  void start(int64_t epoch, int64_t rank, int64_t num_replicas) override;
  std::optional<Sample> next() override;
  int64_t skip(int64_t count) override;

  int64_t skipped() const { return skipped_; }

 private:
  struct Member;
  struct Group;
  std::optional<Group> next_group(bool want_data);
  std::optional<Member> next_member(bool want_data);
  void consume(Member& member, bool want);
  Sample make_sample(Group& group);
  std::optional<Sample> step(bool build);

  std::vector<std::filesystem::path> shards_;
  TarShardOptions options_;
  size_t shard_ = 0;
  std::unique_ptr<std::ifstream> in_;
  std::unique_ptr<Member> pending_;
  int64_t sample_ = 0;  // index in the stream (all replicas)
  int64_t rank_ = 0, replicas_ = 1;
  int64_t skipped_ = 0;
};

// Writes a tar shard (ustar) of the given members, in order: for tests and small tools.
void write_tar(const std::filesystem::path& file, const std::vector<std::pair<std::string, std::string>>& members);

}  // namespace fulgur::data
