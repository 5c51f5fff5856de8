// ZeRO stages 1 and 2 of the fsdp strategy with overlap_reduce: the gradients are averaged in
// buckets while backward still runs, instead of in one collective after it.
//
// The parameters are cut into buckets of about reduce_bucket_mb, for the first backward in the
// reverse of the collectives' layout (the optimizers' param groups), from then on in the order the
// first backward produced their gradients (rank 0's, broadcast once: DDP's rebuilt buckets), the
// parameters that got none last. A hook after each parameter's gradient accumulation
// counts it; when a bucket has every gradient its backward can produce, its gradients are packed
// (rank-major, as Shards::reduce_gradients packs them) and an asynchronous reduce-scatter (stage
// 2) or all-reduce (stage 1) starts, while backward goes on with the earlier layers. Buckets start
// strictly in their order, so the collectives pair up on every rank even when a rank's backward
// skips a parameter (that bucket, and those after it, start at the end of backward). The end of
// backward starts what is left, waits for every bucket in order and lands each rank's rows on the
// shards (land_gradient).
//
// Each rank's slice of a bucket ends with one flag per parameter (1: this rank has a gradient for
// it), averaged with the gradients: a parameter no rank gave a gradient keeps none, as in one
// process, without the blocking path's extra all-reduce of flags. The gradients' elements are
// reduced by the same operation as in the blocking path (a sum over ranks, then a division by the
// world size), so on 2 ranks the result is bitwise the same (a + b = b + a); on more ranks Gloo's
// ring may add the ranks' values in another order for an element, a difference of float rounding.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "sharded_parameter.h"

namespace torch::autograd {
struct Node;  // a parameter's gradient accumulator (torch/csrc/autograd/function.h)
}  // namespace torch::autograd

namespace fulgur::fsdp {

/// The buckets and the hooks that start them; see the file comment.
class GradientBuckets {
 public:
  /// `options` and `group` belong to the strategy and outlive this object.
  GradientBuckets(const ShardingOptions& options, const RankGroup& group) : options_(options), group_(group) {}
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;
  ~GradientBuckets() { clear(); }

  /// Lays out buckets of at most `bucket_bytes` of gradients (in the reduce dtype; a larger
  /// parameter is a bucket of its own) over `shards.ordered` in reverse, and hooks every trainable
  /// parameter. Replaces what an earlier call made.
  void set_up(Shards& shards, int64_t bucket_bytes);
  /// Removes the hooks and forgets the buckets (they refer to the shards).
  void clear();
  bool empty() const { return buckets_.empty(); }

  /// Around a backward whose gradients are averaged: the hooks start buckets only in between.
  void begin_backward();
  /// A backward that threw: the hooks do nothing until the next begin_backward.
  void abandon();
  /// Starts the buckets not started yet, waits for all and lands this rank's rows.
  void finish_backward();

  /// Buckets, and those of the last backward that started before its end (for the debug log).
  int64_t bucket_count() const { return static_cast<int64_t>(buckets_.size()); }
  int64_t started_during_backward() const { return started_during_backward_; }

 private:
  struct Bucket {
    std::vector<ShardedParameter*> parameters;
    int64_t expected = 0;   // gradients backward can produce (trainable parameters)
    int64_t ready = 0;      // of them accumulated in this backward
    int64_t slice = 0;      // one rank's part: its rows of every parameter, padded, then one flag each
    int64_t numel = 0;      // the gradients' part of the slice
    at::Tensor flat, mine;  // while under way: every rank's rows, and this rank's averaged ones
    std::unique_ptr<PendingCollective> pending;
  };
  struct Hook {
    std::shared_ptr<torch::autograd::Node> accumulator;  // kept alive: the parameter holds it weakly
    uintptr_t key = 0;
    const ShardedParameter* parameter = nullptr;
  };

  static bool hookable(const ShardedParameter& p);
  void lay_out();
  void remove_hooks();
  void learn_order();
  void on_gradient(size_t bucket, size_t position);
  void start_ready_buckets();
  void start(Bucket& bucket);
  void land(Bucket& bucket);

  const ShardingOptions& options_;
  const RankGroup& group_;
  Shards* shards_ = nullptr;  // what set_up laid out
  int64_t bucket_bytes_ = 0;
  std::vector<ShardedParameter*> sequence_;  // the parameters in the buckets' order
  bool learned_ = false;                     // sequence_ follows a backward's order
  std::vector<size_t> ready_order_;          // the first backward: positions in sequence_, as ready
  std::vector<Bucket> buckets_;
  std::vector<Hook> hooks_;
  at::ScalarType dtype_ = at::kFloat;  // the gradients travel in
  bool armed_ = false;
  size_t next_ = 0;  // the first bucket not started
  int64_t started_during_backward_ = 0;
};

}  // namespace fulgur::fsdp
