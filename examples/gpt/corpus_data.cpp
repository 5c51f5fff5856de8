// CharCorpusDataModule: a text corpus written once as byte-token files, then memory-mapped.
#include "gpt.h"

#include <fulgur/data/data_loader.h>
#include <fulgur/data/token_file.h>
#include <fulgur/error.h>
#include <fulgur/log.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <system_error>

#include <fcntl.h>
#include <unistd.h>

namespace fulgur::examples {

namespace fs = std::filesystem;

namespace {

// The corpus is split in chunks of this many bytes, a fraction of them (spread evenly) held out
// for validation: every part of the corpus (each fortune file, say) is represented on both sides,
// and a validation window crosses at most one seam between chunks.
constexpr size_t kSplitChunk = 8192;
// Bumped when the token file layout or the split changes, so old cached files are not reused.
constexpr int kTokenFormat = 1;

[[noreturn]] void bad(const Options& hp, const std::string& what) {
  throw Error(ErrorKind::config, fmt::format("{}: {}", hp.owner(), what));
}

std::vector<fs::path> list_corpus(const fs::path& corpus) {
  std::error_code ec;
  if (fs::is_regular_file(corpus, ec)) return {corpus};
  if (!fs::is_directory(corpus, ec))
    throw Error(ErrorKind::io, fmt::format("corpus {} does not exist; {}", corpus.string(), kFortunesPackageHint));
  std::vector<fs::path> files;
  for (const fs::directory_entry& e : fs::directory_iterator(corpus, ec)) {
    // Symlinks are skipped: the fortunes package links every file as NAME.u8 -> NAME.
    if (!e.is_regular_file(ec) || e.is_symlink(ec) || e.path().extension() == ".dat") continue;
    files.push_back(e.path());
  }
  if (ec) throw Error(ErrorKind::io, fmt::format("corpus {}: cannot list: {}", corpus.string(), ec.message()));
  std::sort(files.begin(), files.end());
  if (files.empty())
    throw Error(ErrorKind::io,
                fmt::format("corpus directory {} holds no text files; {}", corpus.string(), kFortunesPackageHint));
  return files;
}

// FNV-1a: a stable name for the token files of one corpus content and split.
uint64_t fnv1a(std::string_view text, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

fs::path default_cache_dir() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0')
    return fs::path(xdg) / "fulgur/gpt";
  const char* home = std::getenv("HOME");
  return fs::path(home != nullptr && *home != '\0' ? home : "/tmp") / ".cache/fulgur/gpt";
}

std::string read_file(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in)
    throw Error(ErrorKind::io, fmt::format("corpus file {}: cannot read: {}", file.string(), std::strerror(errno)));
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Writes `tokens` as uint16 to `target` so that a reader sees the old file or the whole new one,
// never a part: a temporary file in the same directory, fsync, rename, fsync of the directory.
void write_token_file_atomically(const fs::path& target, const std::vector<uint16_t>& tokens) {
  const fs::path tmp = target.parent_path() / fmt::format(".{}.tmp-{}", target.filename().string(), ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(ErrorKind::io, fmt::format("{}: cannot create: {}", tmp.string(), std::strerror(errno)));
  const auto* p = reinterpret_cast<const char*>(tokens.data());
  size_t left = tokens.size() * sizeof(uint16_t);
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error(ErrorKind::io, fmt::format("{}: cannot write: {}", tmp.string(), std::strerror(e)));
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw Error(ErrorKind::io, fmt::format("{}: cannot sync: {}", tmp.string(), std::strerror(errno)));
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    throw Error(ErrorKind::io, fmt::format("{}: cannot rename into place: {}", target.string(), std::strerror(e)));
  }
  if (const int dir = ::open(target.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

}  // namespace

CharCorpusDataModule::CharCorpusDataModule(const Options& given) {
  hparams = with_defaults(given, kCharCorpusHyperParams, "[data]");
  const Options& hp = hparams;
  for (const char* key : {"block_size", "batch_size", "predict_samples"})
    if (hp.get_int(key) <= 0) bad(hp, fmt::format("{} = {} must be positive", key, hp.get_int(key)));
  for (const char* key : {"num_workers", "seed", "max_bytes"})
    if (hp.get_int(key) < 0) bad(hp, fmt::format("{} = {} must be >= 0", key, hp.get_int(key)));
  const double val_fraction = hp.get_float("val_fraction");
  if (!(val_fraction >= 0 && val_fraction < 1))
    bad(hp, fmt::format("val_fraction = {} must be in [0, 1) (0: no validation)", val_fraction));
  if (hp.get_string("corpus").empty()) bad(hp, fmt::format("corpus must not be empty; {}", kFortunesPackageHint));

  corpus_files_ = list_corpus(hp.get_string("corpus"));
  // The token files are named after what they are made of: the files (path, size, mtime), the
  // slice and the split. A changed corpus gets new files; an unchanged one reuses the old ones.
  std::string identity =
      fmt::format("format {}\nmax_bytes {}\nval_fraction {}\n", kTokenFormat, hp.get_int("max_bytes"), val_fraction);
  for (const fs::path& f : corpus_files_) {
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    const auto mtime = fs::last_write_time(f, ec).time_since_epoch().count();
    identity += fmt::format("{} {} {}\n", f.string(), size, mtime);
  }
  const std::string cache = hp.get_string("cache_dir");
  const fs::path cache_dir = cache.empty() ? default_cache_dir() : fs::path(cache);
  const fs::path corpus(hp.get_string("corpus"));
  token_dir_ = cache_dir / fmt::format("{}-{:016x}", corpus.filename().string(), fnv1a(identity));
}

void CharCorpusDataModule::prepare_data() {
  const bool want_val = hparams.get_float("val_fraction") > 0;
  std::error_code ec;
  if (fs::exists(train_file(), ec) && (!want_val || fs::exists(val_file(), ec))) {
    log::info(fmt::format("gpt data: reusing the token files in {}", token_dir_.string()));
    return;
  }
  fs::create_directories(token_dir_, ec);
  if (ec)
    throw Error(ErrorKind::io, fmt::format("{}: cannot create the token cache directory {}: {}; set cache_dir",
                                           hparams.owner(), token_dir_.string(), ec.message()));
  std::string text;
  const auto max_bytes = static_cast<size_t>(hparams.get_int("max_bytes"));
  for (const fs::path& f : corpus_files_) {
    text += read_file(f);
    if (max_bytes > 0 && text.size() >= max_bytes) break;
  }
  if (max_bytes > 0 && text.size() > max_bytes) text.resize(max_bytes);

  const double f = hparams.get_float("val_fraction");
  std::vector<uint16_t> train, val;
  train.reserve(text.size());
  for (size_t chunk = 0, at = 0; at < text.size(); ++chunk, at += kSplitChunk) {
    // Chunk i is held out when floor((i + 1) f) > floor(i f): exactly floor(n f) of n chunks,
    // evenly spaced.
    const bool held_out = std::floor(static_cast<double>(chunk + 1) * f) > std::floor(static_cast<double>(chunk) * f);
    std::vector<uint16_t>& side = held_out ? val : train;
    for (size_t i = at; i < std::min(text.size(), at + kSplitChunk); ++i)
      side.push_back(static_cast<unsigned char>(text[i]));
  }
  const auto need = static_cast<size_t>(hparams.get_int("block_size") + 1);
  if (train.size() < need || (want_val && val.size() < need))
    throw Error(ErrorKind::config,
                fmt::format("{}: the corpus ({} bytes) is too small: at val_fraction = {} it gives {} training and {} "
                            "validation tokens, and each side needs block_size + 1 = {}; use a larger corpus or "
                            "max_bytes, or val_fraction = 0",
                            hparams.owner(), text.size(), f, train.size(), val.size(), need));
  // val.bin first: train.bin is the one whose presence says "done".
  if (want_val) write_token_file_atomically(val_file(), val);
  write_token_file_atomically(train_file(), train);
  log::info(fmt::format("gpt data: wrote {} training and {} validation tokens ({} corpus files) to {}", train.size(),
                        val.size(), corpus_files_.size(), token_dir_.string()));
}

void CharCorpusDataModule::setup(Stage stage) {
  // Other ranks wait at the Trainer's barrier after prepare_data; a DataModule used without a
  // Trainer gets its files here.
  if (stage != Stage::predict) prepare_data();
}

std::unique_ptr<BatchLoader> CharCorpusDataModule::train_loader() {
  const Options& hp = hparams;
  // stride 1: every offset starts a window, and the shuffled order draws them at random.
  auto tokens = std::make_shared<data::TokenFile>(
      train_file(), data::TokenFileOptions(hp.get_int("block_size")).stride(1).vocab_size(kByteVocabSize));
  return data::make_data_loader(std::move(tokens), data::DataLoaderOptions()
                                                       .batch_size(hp.get_int("batch_size"))
                                                       .shuffle(true)
                                                       .drop_last(true)
                                                       .seed(static_cast<uint64_t>(hp.get_int("seed")))
                                                       .num_workers(hp.get_int("num_workers")));
}

std::unique_ptr<BatchLoader> CharCorpusDataModule::val_loader() {
  const Options& hp = hparams;
  if (hp.get_float("val_fraction") == 0) return nullptr;
  auto tokens = std::make_shared<data::TokenFile>(
      val_file(), data::TokenFileOptions(hp.get_int("block_size")).vocab_size(kByteVocabSize));
  return data::make_data_loader(
      std::move(tokens),
      data::DataLoaderOptions().batch_size(hp.get_int("batch_size")).num_workers(hp.get_int("num_workers")));
}

std::unique_ptr<BatchLoader> CharCorpusDataModule::predict_loader() {
  const int64_t n = hparams.get_int("predict_samples");
  const at::Tensor rows = at::arange(n, at::kLong);
  return make_tensor_loader(rows, rows, TensorLoaderOptions().batch_size(n));
}

}  // namespace fulgur::examples
