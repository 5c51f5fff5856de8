// Memory-mapped token files (a flat array of uint16 or uint32 token ids, as nanoGPT's train.bin)
// as a map-style dataset of language-model windows.
#pragma once

#include <fulgur/data/dataset.h>

#include <atomic>
#include <filesystem>
#include <memory>

namespace fulgur::data {

enum class TokenType { uint16, uint32 };

struct TokenFileOptions {
  explicit TokenFileOptions(int64_t block_size) : block_size_(block_size) {}
  TokenFileOptions& dtype(TokenType v) {
    dtype_ = v;
    return *this;
  }
  // Distance between window starts (default: block_size, windows that share one token).
  TokenFileOptions& stride(int64_t v) {
    stride_ = v;
    return *this;
  }
  // Token ids must be < vocab_size (0: not checked).
  TokenFileOptions& vocab_size(int64_t v) {
    vocab_size_ = v;
    return *this;
  }
  // A window holding an id >= vocab_size is skipped (SkipSample, counted), and a trailing partial
  // token (a truncated file) ignored, instead of failing.
  TokenFileOptions& skip_corrupt(bool v) {
    skip_corrupt_ = v;
    return *this;
  }
  int64_t block_size_;
  TokenType dtype_ = TokenType::uint16;
  int64_t stride_ = 0;
  int64_t vocab_size_ = 0;
  bool skip_corrupt_ = false;
};

// Window i covers tokens [i * stride, i * stride + block_size + 1): Sample::input is its first
// block_size tokens, Sample::target the last block_size (shifted by one), both int64. The file is
// mapped read-only (the page cache holds it, not the process), so it may be larger than memory.
class TokenFile final : public Dataset {
 public:
  TokenFile(std::filesystem::path file, TokenFileOptions options);
  ~TokenFile() override;
  int64_t size() const override;
  Sample get(int64_t index) const override;

  int64_t num_tokens() const { return tokens_; }
  int64_t skipped() const { return skipped_.load(); }

 private:
  std::filesystem::path file_;
  TokenFileOptions options_;
  const unsigned char* map_ = nullptr;
  size_t map_size_ = 0;
  int64_t tokens_ = 0, windows_ = 0;
  mutable std::atomic<int64_t> skipped_{0};
};

}  // namespace fulgur::data
