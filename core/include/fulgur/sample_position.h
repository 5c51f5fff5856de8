// Positions in global samples: what a mid-epoch checkpoint records so that a run resumed with
// another number of processes deals out exactly the samples of the epoch that are left.
//
// Not part of the SDK 1.x promise yet (BatchLoader is frozen and has no extension() to ask): the
// built-in loaders offer it, and a BatchLoader of a plugin may derive from it too.
#pragma once

#include <cstdint>

namespace fulgur {

class BatchLoader;

/// A BatchLoader whose epoch is one global order of samples (a function of seed and epoch) dealt
/// to the replicas as torch's DistributedSampler deals it: replica r of R takes the positions r,
/// r + R, r + 2R, ... With drop_last the tail that does not divide evenly is dropped; otherwise the
/// last round is padded with the epoch's first samples (those repeat, as DistributedSampler's).
class SamplePositionLoader {
 public:
  virtual ~SamplePositionLoader();
  /// Samples in an epoch's global order (all replicas together, before padding or dropping);
  /// -1: not known before the epoch is read (a stream dealt round robin, as TarShards).
  virtual int64_t epoch_samples() const = 0;
  /// Samples of the current epoch's global order consumed once every replica has handed out
  /// `batches` batches since the epoch (or its remainder) started, at most epoch_samples();
  /// -1: this loader cannot say where an epoch stands in samples (a stream that splits itself).
  virtual int64_t samples_consumed(int64_t batches) const = 0;
  /// Starts `epoch` with the first `consumed` samples of its global order already seen (by any
  /// number of replicas) and deals the rest to this loader's replicas as a whole epoch is dealt.
  /// Returns the number of batches this replica hands out, -1 for a stream (until it ends).
  virtual int64_t start_epoch_at_sample(int64_t epoch, int64_t consumed) = 0;
};

/// The loader's SamplePositionLoader, or nullptr: one it derives from, or one a library
/// registered for it (a loader whose class layout is frozen).
SamplePositionLoader* sample_position_of(BatchLoader& loader);

/// Registers `position` as `loader`'s until unregister_sample_position(loader); for a loader class
/// that cannot derive from SamplePositionLoader without changing its layout.
void register_sample_position(const BatchLoader& loader, SamplePositionLoader* position);
/// Forgets what register_sample_position registered for `loader` (before it is destroyed).
void unregister_sample_position(const BatchLoader& loader);

}  // namespace fulgur
