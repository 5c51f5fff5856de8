// The search of Lightning's BatchSizeFinder, apart from the Trainer: which batch size to try next
// after each trial, in "power" mode (double until a trial fails) or "binsearch" mode (double until
// a trial fails, then bisect between the last size that fit and the first that did not), within
// max_trials trials and at most max_val (the size of the dataset: a larger batch is the same
// batch). A trial is whatever the caller runs at that size (Lightning: steps_per_trial training
// steps) and reports as fitting or not.
//
// Semantics kept from Lightning: the search starts at init_val; in power mode a failure before any
// success halves the size and tries again, a failure after one ends the search with the last size
// that fit; the result is the last size that fit (nullopt when none did).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace fulgur::batch_size_finder {

enum class SearchMode { power, binsearch };

struct BatchSizeSearchOptions {
  BatchSizeSearchOptions& mode(SearchMode v) {
    mode_ = v;
    return *this;
  }
  BatchSizeSearchOptions& init_val(int64_t v) {
    init_val_ = v;
    return *this;
  }
  BatchSizeSearchOptions& max_trials(int64_t v) {
    max_trials_ = v;
    return *this;
  }
  // The largest size worth trying (the number of training samples); 0: no limit.
  BatchSizeSearchOptions& max_val(int64_t v) {
    max_val_ = v;
    return *this;
  }
  SearchMode mode_ = SearchMode::power;
  int64_t init_val_ = 2;
  int64_t max_trials_ = 25;
  int64_t max_val_ = 0;
};

class BatchSizeSearch {
 public:
  explicit BatchSizeSearch(BatchSizeSearchOptions options) : o_(options), size_(cap(options.init_val_)) {
    if (o_.init_val_ < 1) throw std::invalid_argument("init_val must be >= 1");
    if (o_.max_trials_ < 1) throw std::invalid_argument("max_trials must be >= 1");
  }

  bool done() const { return done_; }
  // The size to try next (meaningful while !done()).
  int64_t next() const { return size_; }
  int64_t trials() const { return trials_; }
  // The largest size that fit so far.
  std::optional<int64_t> result() const { return best_; }

  // Reports the outcome of the trial at next(). `whole_dataset`: that batch already held every
  // training sample (one batch per epoch), so a larger size would train the same batch.
  void report(bool fits, bool whole_dataset = false) {
    if (done_) return;
    ++trials_;
    if (fits) {
      best_ = std::max(best_.value_or(0), size_);
      if (whole_dataset) return finish();
      // Power mode after a failure: twice this size is the one that failed.
      if (high_ && (o_.mode_ == SearchMode::power || *high_ - size_ <= 1)) return finish();
      const int64_t grown = high_ ? (size_ + *high_) / 2 : cap(size_ * 2);
      if (grown == size_) return finish();  // max_val reached
      size_ = grown;
    } else {
      high_ = size_;
      const int64_t low = best_.value_or(0);
      if (size_ <= 1 || *high_ - low <= 1) return finish();
      if (o_.mode_ == SearchMode::power && best_) return finish();
      size_ = o_.mode_ == SearchMode::binsearch && low > 0 ? (low + *high_) / 2 : size_ / 2;
    }
    if (trials_ >= o_.max_trials_) finish();
  }

 private:
  int64_t cap(int64_t size) const { return o_.max_val_ > 0 ? std::min(size, o_.max_val_) : size; }
  void finish() { done_ = true; }

  BatchSizeSearchOptions o_;
  int64_t size_;
  int64_t trials_ = 0;
  std::optional<int64_t> best_;
  std::optional<int64_t> high_;  // binsearch: the smallest size known not to fit
  bool done_ = false;
};

}  // namespace fulgur::batch_size_finder
