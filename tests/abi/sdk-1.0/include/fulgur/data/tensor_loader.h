// Batches from tensors already in memory: the DataLoader's fast path for data that fits in RAM.
#pragma once

#include <fulgur/data/data_loader.h>

#include <ATen/core/Tensor.h>

#include <memory>

namespace fulgur {

/// The options of make_tensor_loader are the DataLoader's: one options type for every loader.
using TensorLoaderOptions = data::DataLoaderOptions;

/// Batches from in-memory tensors (first dimension = samples; `targets` may be undefined).
///
/// With batch size, shuffle, seed, drop_last, num_workers and prefetch only, whole batches are
/// gathered with one index_select (in-order single-replica epochs are views, as in a hand-written
/// loop): no per-sample Sample objects, no collate. The order of an epoch is a pure function of
/// (seed, epoch), so a run resumed mid-epoch (skip_batches) sees exactly what the uninterrupted run
/// saw. With several replicas each sees a disjoint, equally sized slice, like torch's
/// DistributedSampler: padded by wrapping around, or with drop_last the uneven tail is dropped (and,
/// as DataLoader's drop_last, the last incomplete batch of each replica).
///
/// Options that work per sample (sampler, transform, collate) or on the batch (pin_memory) are
/// honoured by serving the tensors through the general DataLoader, one sample per row.
///
/// Throws fulgur::Error(invalid_argument) for inputs without a sample dimension, a targets count
/// that differs from the inputs', or a batch size below 1.
std::unique_ptr<BatchLoader> make_tensor_loader(at::Tensor inputs, at::Tensor targets, TensorLoaderOptions options);

}  // namespace fulgur
