// fulgur/data readers on files the tests write: CSV/TSV, image folders (JPEG, PNG), token files,
// tar shards. Each reader on good input, on corrupt or truncated input (an error naming the file
// and the sample), and with skip_corrupt (the sample left out and counted).
#include <fulgur/data/csv.h>
#include <fulgur/data/data_loader.h>
#include <fulgur/data/image.h>
#include <fulgur/data/image_folder.h>
#include <fulgur/data/tar_shards.h>
#include <fulgur/data/token_file.h>
#include <fulgur/error.h>

#include <ATen/ATen.h>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <fstream>
#include <set>
#include <sstream>

#include "image_files.h"
#include "loader_checks.h"
#include "test_support.h"

namespace {

namespace d = fulgur::data;
namespace fs = std::filesystem;
using fulgur::test::contains;
using fulgur::test::error_from;
using fulgur::test::read_bytes;
using fulgur::test::TempDir;
using fulgur::test::write_bytes;

using fulgur::test::epoch;
using fulgur::test::require_same;

std::string encoded(const fs::path& dir, const std::string& name, const at::Tensor& hwc, bool png) {
  const fs::path f = dir / name;
  png ? fulgur::test::write_png(f, hwc) : fulgur::test::write_jpeg(f, hwc);
  return read_bytes(f);
}

}  // namespace

TEST_CASE("data readers: CSV and TSV tables with numeric and categorical columns") {
  TempDir dir;
  write_bytes(dir / "t.csv",
              "age,city,score,label\n"
              "31,paris,1.5,yes\n"
              "\"42\",\"new york, ny\",-2e1,no\n"
              "\n"
              "7,paris,0,yes\n");
  d::CsvDataset csv(dir / "t.csv", d::CsvOptions().target("label").categorical({"city", "label"}));
  REQUIRE(csv.size() == 3);
  CHECK(csv.numeric_columns() == std::vector<std::string>{"age", "score"});
  CHECK(csv.categories("city") == std::vector<std::string>{"paris", "new york, ny"});
  d::Sample s = csv.get(1);
  CHECK(s.input.equal(at::tensor({42.0f, -20.0f})));
  CHECK(s.extra.at(0).equal(at::tensor({int64_t{1}})));
  CHECK(s.target.item<int64_t>() == 1);  // "no": second label seen

  write_bytes(dir / "t.tsv", "x\ty\n1\t2\n3\t4\n");
  d::CsvDataset tsv(dir / "t.tsv", d::CsvOptions().target("y"));
  CHECK(tsv.get(1).input.equal(at::tensor({3.0f})));
  CHECK(tsv.get(1).target.item<float>() == 4.0f);

  // Corrupt rows: the error names the file, line, row and column; skip_corrupt leaves them out.
  write_bytes(dir / "bad.csv", "a,b\n1,2\n3,oops\n5\n7,8\n");
  const fulgur::Error e = error_from([&] { d::CsvDataset(dir / "bad.csv", d::CsvOptions().target("b")); });
  CHECK(e.kind() == fulgur::ErrorKind::io);
  CHECK(contains(e.what(), "bad.csv:3: row 1"));
  CHECK(contains(e.what(), "'oops' is not a number"));
  d::CsvDataset skipped(dir / "bad.csv", d::CsvOptions().target("b").skip_corrupt(true));
  CHECK(skipped.size() == 2);
  CHECK(skipped.skipped() == 2);
  CHECK(skipped.get(1).input.item<float>() == 7.0f);
  // A fixed vocabulary refuses unknown values.
  CHECK(contains(
      error_from([&] {
        d::CsvDataset(dir / "t.csv", d::CsvOptions().categorical({"city", "label"}).categories("city", {"paris"}));
      }).what(),
      "not one of its categories"));
  CHECK(contains(error_from([&] { d::CsvDataset(dir / "t.csv", d::CsvOptions().target("lable")); }).what(),
                 "no target column 'lable'"));
}

TEST_CASE("data readers: an image folder decodes JPEG and PNG, and names a corrupt file and its sample") {
  TempDir dir;
  const fs::path root = dir.subdir("images");
  fs::create_directories(root / "cat");
  fs::create_directories(root / "dog");
  const at::Tensor a = fulgur::test::pattern_image(20, 30, 1), b = fulgur::test::pattern_image(16, 12, 2);
  fulgur::test::write_png(root / "cat" / "b.png", a);
  fulgur::test::write_jpeg(root / "cat" / "a.JPG", b);
  fulgur::test::write_png(root / "dog" / "c.png", b.narrow(2, 0, 1).contiguous());  // grey
  write_bytes(root / "dog" / "notes.txt", "not an image");

  d::ImageFolder folder(root);
  REQUIRE(folder.size() == 3);
  CHECK(folder.classes() == std::vector<std::string>{"cat", "dog"});
  CHECK(folder.path(0).filename() == "a.JPG");
  d::Sample png = folder.get(1);
  CHECK(png.input.sizes() == at::IntArrayRef{3, 20, 30});
  CHECK(png.input.equal(a.permute({2, 0, 1})));  // PNG is lossless
  CHECK(png.target.item<int64_t>() == 0);
  d::Sample jpg = folder.get(0);
  CHECK(jpg.input.sizes() == at::IntArrayRef{3, 16, 12});
  CHECK((jpg.input.to(at::kFloat) - b.permute({2, 0, 1}).to(at::kFloat)).abs().mean().item<float>() < 20);  // lossy
  d::Sample grey = folder.get(2);
  CHECK(grey.input.sizes() == at::IntArrayRef{3, 16, 12});
  CHECK(grey.input[0].equal(grey.input[2]));
  CHECK(grey.target.item<int64_t>() == 1);
  CHECK(d::ImageFolder(root, d::ImageFolderOptions().channels(1)).get(1).input.size(0) == 1);

  // Truncated JPEG and PNG, and garbage: errors naming file and sample; skipped and counted on request.
  std::string jpeg_bytes = read_bytes(root / "cat" / "a.JPG"), png_bytes = read_bytes(root / "cat" / "b.png");
  write_bytes(root / "cat" / "a.JPG", jpeg_bytes.substr(0, jpeg_bytes.size() / 2));
  const fulgur::Error e = error_from([&] { folder.get(0); });
  CHECK(contains(e.what(), "a.JPG (sample 0)"));
  CHECK(contains(e.what(), "JPEG"));
  write_bytes(root / "cat" / "b.png", png_bytes.substr(0, png_bytes.size() - 20));
  CHECK(contains(error_from([&] { folder.get(1); }).what(), "b.png (sample 1)"));
  write_bytes(root / "cat" / "b.png", "garbage");
  CHECK(contains(error_from([&] { folder.get(1); }).what(), "neither a JPEG nor a PNG"));

  auto skipping = std::make_shared<d::ImageFolder>(root, d::ImageFolderOptions().skip_corrupt(true));
  d::DataLoader loader(skipping, d::DataLoaderOptions().batch_size(2).num_workers(2));
  std::ostringstream log;
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(
      std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_st>(log)));
  std::vector<fulgur::Batch> batches;
  try {
    batches = epoch(loader, 0);
  } catch (...) {
    spdlog::set_default_logger(previous);
    throw;
  }
  spdlog::set_default_logger(previous);
  // The skipped samples are counted in the run's log, once, at the end of the epoch.
  CHECK(contains(log.str(), "DataLoader: epoch 0 left out 2 corrupt sample(s)"));
  // Batch 0 (samples 0 and 1) lost both: no batch; batch 1 holds sample 2.
  REQUIRE(batches.size() == 1);
  CHECK(batches[0].size() == 1);
  CHECK(loader.skipped_samples() == 2);
  CHECK(skipping->skipped() == 2);
  // Without skip_corrupt, the loader's error names the sample and keeps the reader's message.
  d::DataLoader failing(std::make_shared<d::ImageFolder>(root), d::DataLoaderOptions().batch_size(2).num_workers(2));
  failing.start_epoch(0);
  CHECK(contains(error_from([&] { failing.next(); }).what(), "DataLoader: sample 0"));
}

TEST_CASE("data readers: token files give language-model windows, and refuse truncated or out-of-vocabulary data") {
  TempDir dir;
  std::vector<uint16_t> t16(50);
  for (size_t i = 0; i < t16.size(); ++i) t16[i] = static_cast<uint16_t>(i * 3);
  write_bytes(dir / "a.bin", std::string(reinterpret_cast<const char*>(t16.data()), t16.size() * 2));
  d::TokenFile tokens(dir / "a.bin", d::TokenFileOptions(8));
  CHECK(tokens.num_tokens() == 50);
  CHECK(tokens.size() == 6);  // windows of 9 starting at 0, 8, ..., 40
  d::Sample s = tokens.get(2);
  CHECK(s.input.equal(at::arange(16, 24, at::kLong) * 3));
  CHECK(s.target.equal(at::arange(17, 25, at::kLong) * 3));
  CHECK(d::TokenFile(dir / "a.bin", d::TokenFileOptions(8).stride(1)).size() == 42);

  std::vector<uint32_t> t32{1, 2, 3, 70000, 5, 6, 7};
  write_bytes(dir / "b.bin", std::string(reinterpret_cast<const char*>(t32.data()), t32.size() * 4));
  d::TokenFile wide(dir / "b.bin", d::TokenFileOptions(2).dtype(d::TokenType::uint32));
  CHECK(wide.get(1).input.equal(at::tensor({int64_t{3}, int64_t{70000}})));
  const fulgur::Error vocab = error_from([&] {
    d::TokenFile(dir / "b.bin", d::TokenFileOptions(2).dtype(d::TokenType::uint32).vocab_size(50000)).get(1);
  });
  CHECK(contains(vocab.what(), "b.bin: sample 1"));
  CHECK(contains(vocab.what(), "token 70000"));
  auto skipping = std::make_shared<d::TokenFile>(
      dir / "b.bin", d::TokenFileOptions(2).dtype(d::TokenType::uint32).vocab_size(50000).skip_corrupt(true));
  d::DataLoader loader(skipping, d::DataLoaderOptions().batch_size(1));
  CHECK(epoch(loader, 0).size() == 2);  // windows 0 and 2; window 1 holds 70000
  CHECK(loader.skipped_samples() == 1);

  // A truncated file (odd byte count for uint16).
  write_bytes(dir / "c.bin", read_bytes(dir / "a.bin").substr(0, 99));
  CHECK(contains(error_from([&] { d::TokenFile(dir / "c.bin", d::TokenFileOptions(8)); }).what(),
                 "not a whole number of 2-byte tokens"));
  CHECK(d::TokenFile(dir / "c.bin", d::TokenFileOptions(8).skip_corrupt(true)).num_tokens() == 49);
  CHECK(contains(error_from([&] { d::TokenFile(dir / "a.bin", d::TokenFileOptions(50)); }).what(),
                 "fewer than one window"));

  // Through the loader: shuffled windows, worker-count invariant and resumable.
  auto data = std::make_shared<d::TokenFile>(dir / "a.bin", d::TokenFileOptions(4).stride(2));
  d::DataLoader l0(data, d::DataLoaderOptions().batch_size(3).shuffle(true).seed(1)),
      l2(data, d::DataLoaderOptions().batch_size(3).shuffle(true).seed(1).num_workers(2));
  auto full = epoch(l0, 1);
  require_same(epoch(l2, 1), full);
  require_same(epoch(l2, 1, 2), std::vector<fulgur::Batch>(full.begin() + 2, full.end()));
}

TEST_CASE("data readers: tar shards stream WebDataset samples in order, resumable and worker-count invariant") {
  TempDir dir;
  std::vector<fs::path> shards;
  int64_t key = 0;
  for (int s = 0; s < 3; ++s) {
    std::vector<std::pair<std::string, std::string>> members;
    for (int i = 0; i < 5; ++i, ++key) {
      const std::string name = fmt::format("part{}/{:06d}", s, key);
      members.emplace_back(name + ".jpg", encoded(dir.path(), "tmp.jpg", fulgur::test::pattern_image(20, 24, key),
                                                  /*png=*/key % 2 == 1));
      members.emplace_back(name + ".cls", std::to_string(key % 4));
      members.emplace_back(name + ".txt", "caption");
    }
    shards.push_back(dir / fmt::format("shard-{}.tar", s));
    d::write_tar(shards.back(), members);
  }
  auto stream = std::make_shared<d::TarShards>(shards, d::TarShardOptions().extra({"txt"}));
  stream->start(0, 0, 1);
  int64_t n = 0;
  while (auto s = stream->next()) {
    CHECK(s->target.item<int64_t>() == n % 4);
    CHECK(s->extra.at(0).size(0) == 7);
    CHECK(s->input.numel() > 0);
    ++n;
  }
  CHECK(n == 15);

  auto transform = d::compose({d::decode_image(), d::random_resized_crop(d::RandomResizedCropOptions(8)),
                               d::random_horizontal_flip(), d::normalize({0.5}, {0.5})});
  auto make = [&](int64_t workers) {
    return d::DataLoader(stream,
                         d::DataLoaderOptions().batch_size(4).seed(9).num_workers(workers).transform(transform));
  };
  d::DataLoader l0 = make(0);
  CHECK(l0.num_batches() == -1);
  auto full = epoch(l0, 0);
  REQUIRE(full.size() == 4);
  CHECK(full.back().size() == 3);
  CHECK(full[0].input.sizes() == at::IntArrayRef{4, 3, 8, 8});
  for (int64_t workers : {1, 2, 4}) {
    d::DataLoader lw = make(workers);
    require_same(epoch(lw, 0), full);
    require_same(epoch(lw, 0, 1), std::vector<fulgur::Batch>(full.begin() + 1, full.end()));
  }
  // Two replicas: alternate samples, together everything once.
  std::multiset<int64_t> seen;
  for (int64_t r = 0; r < 2; ++r) {
    d::DataLoader lr(stream, d::DataLoaderOptions().batch_size(4).transform(d::decode_image()));
    lr.set_replica(r, 2);
    for (auto& b : epoch(lr, 0)) seen.insert(b.target.data_ptr<int64_t>(), b.target.data_ptr<int64_t>() + b.size());
  }
  CHECK(seen.size() == 15);

  // Damage: a missing member, a non-integer .cls, then a truncated shard.
  d::write_tar(dir / "bad-0.tar",
               {{"000.jpg", encoded(dir.path(), "x.png", fulgur::test::pattern_image(8, 8, 0), true)},
                {"000.cls", "1"},
                {"001.cls", "2"},  // no .jpg
                {"002.jpg", "x"},
                {"002.cls", "two"}});
  std::string good = read_bytes(shards[0]);
  write_bytes(dir / "bad-1.tar", good.substr(0, good.size() / 2 + 100));  // mid-block: never a clean end
  const std::vector<fs::path> bad{dir / "bad-0.tar", dir / "bad-1.tar", shards[1]};
  auto strict = std::make_shared<d::TarShards>(bad);
  strict->start(0, 0, 1);
  CHECK(strict->next().has_value());
  const fulgur::Error missing = error_from([&] { strict->next(); });
  CHECK(contains(missing.what(), "bad-0.tar: sample 1"));
  CHECK(contains(missing.what(), "has no .jpg member"));
  CHECK(contains(error_from([&] { strict->next(); }).what(), "not an integer"));
  // Through the loader, the first error ends the epoch and names the stream position.
  d::DataLoader failing(strict, d::DataLoaderOptions().batch_size(2).num_workers(2));
  failing.start_epoch(0);
  CHECK(contains(error_from([&] { failing.next(); }).what(), "DataLoader: sample 1"));

  auto lenient = std::make_shared<d::TarShards>(bad, d::TarShardOptions().skip_corrupt(true));
  lenient->start(0, 0, 1);
  std::vector<int64_t> labels;
  while (auto s = lenient->next()) labels.push_back(s->target.item<int64_t>());
  // bad-0: sample 0 kept, 1 and 2 skipped; bad-1: whole samples before the cut kept, the cut one
  // skipped; shard 1 read in full.
  CHECK(lenient->skipped() == 3);
  CHECK(labels.front() == 1);
  CHECK(labels.size() >= 6);
  CHECK(std::vector<int64_t>(labels.end() - 5, labels.end()) == std::vector<int64_t>{1, 2, 3, 0, 1});
  // Skipping (resume) validates as reading does: the same samples follow.
  lenient->start(0, 0, 1);
  CHECK(lenient->skip(2) == 2);
  CHECK(lenient->next()->target.item<int64_t>() == labels[2]);
}
