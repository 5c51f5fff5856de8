// Internal: what is left of an epoch after `consumed` samples of its global order, dealt to the
// replicas as torch's DistributedSampler deals a whole epoch (fulgur/sample_position.h).
#pragma once

#include <cstdint>
#include <vector>

namespace fulgur::data::detail {

// How many samples each of `replicas` gets from `remaining`: with drop_last the uneven tail is
// dropped, otherwise the last round is padded.
inline int64_t dealt_per_replica(int64_t remaining, int64_t replicas, bool drop_last) {
  return drop_last ? remaining / replicas : (remaining + replicas - 1) / replicas;
}

// Replica `rank`'s part of order[consumed:]: positions rank, rank + R, ... of it, padded (unless
// drop_last) with the epoch's first samples, wrapping for tiny datasets, as DistributedSampler
// pads. With consumed = 0 this is exactly the whole epoch's deal.
inline std::vector<int64_t> deal_remaining(const std::vector<int64_t>& order, int64_t consumed, int64_t rank,
                                           int64_t replicas, bool drop_last) {
  const int64_t n = static_cast<int64_t>(order.size());
  const int64_t remaining = n - consumed;
  const int64_t per = dealt_per_replica(remaining, replicas, drop_last);
  std::vector<int64_t> mine;
  if (n == 0) return mine;
  mine.reserve(static_cast<size_t>(per));
  for (int64_t j = 0; j < per; ++j) {
    const int64_t at = j * replicas + rank;  // position in the remainder, padding beyond its end
    mine.push_back(at < remaining ? order[static_cast<size_t>(consumed + at)]
                                  : order[static_cast<size_t>((at - remaining) % n)]);
  }
  return mine;
}

}  // namespace fulgur::data::detail
