#include "metric_store.h"

#include <fulgur/metric.h>

#include <fulgur/error.h>
#include <fulgur/strategy.h>

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <fmt/format.h>

namespace fulgur {

MetricStore::Entry& MetricStore::entry(const std::string& name) {
  for (auto& e : entries_)
    if (e.name == name) return e;
  entries_.push_back(Entry{});
  entries_.back().name = name;
  return entries_.back();
}

namespace {

// A step value reduced across the ranks with the entry's reduction (a mean is the ranks' plain
// mean, as Lightning's sync of a step value).
at::Tensor synced_step_value(Strategy& strategy, const at::Tensor& value, Reduction reduce) {
  const at::Tensor v = value.to(at::kDouble).reshape({});
  switch (reduce) {
    case Reduction::mean:
      return strategy.reduce(v, ReduceOp::sum) / static_cast<double>(strategy.cluster().world_size);
    case Reduction::sum:
      return strategy.reduce(v, ReduceOp::sum);
    case Reduction::max:
      return strategy.reduce(v, ReduceOp::max);
    case Reduction::min:
      return strategy.reduce(v, ReduceOp::min);
  }
  return v;
}

}  // namespace

void MetricStore::log(const std::string& name, const at::Tensor& value, const LogOptions& options,
                      bool training_context, int64_t batch_size, Strategy* sync_strategy) {
  if (value.defined() && value.numel() != 1)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("log('{}'): expected a scalar, got a tensor of shape {}", name, c10::str(value.sizes())));
  Entry& e = entry(name);
  e.on_step = options.on_step_.value_or(training_context);
  e.on_epoch = options.on_epoch_.value_or(!training_context);
  e.prog_bar = options.prog_bar_;
  e.logger = options.logger_;
  e.sync_dist = options.sync_dist_;
  e.reduce = options.reduce_;
  at::Tensor v = value.detach();
  if (e.on_step) {
    const bool sync = e.sync_dist && sync_strategy && sync_strategy->cluster().world_size > 1;
    e.step_value = sync ? synced_step_value(*sync_strategy, v, e.reduce) : v;
    e.step_fresh = true;
  }
  if (e.on_epoch) {
    const double w = static_cast<double>(options.batch_size_.value_or(batch_size > 0 ? batch_size : 1));
    at::Tensor f = v.to(at::kDouble);
    if (!e.epoch_accum.defined()) {
      e.epoch_accum = e.reduce == Reduction::mean ? f * w : f.clone();
    } else {
      switch (e.reduce) {
        case Reduction::mean:
          e.epoch_accum.add_(f, w);
          break;
        case Reduction::sum:
          e.epoch_accum.add_(f);
          break;
        case Reduction::max:
          e.epoch_accum = at::maximum(e.epoch_accum, f);
          break;
        case Reduction::min:
          e.epoch_accum = at::minimum(e.epoch_accum, f);
          break;
      }
    }
    e.epoch_weight += w;
  }
}

MetricMap MetricStore::collect_step(bool logger_only, bool prog_bar_only, bool consume) {
  MetricMap out;
  for (auto& e : entries_) {
    if (!e.on_step || !e.step_fresh) continue;
    if (logger_only && !e.logger) continue;
    if (prog_bar_only && !e.prog_bar) continue;
    const std::string key = e.on_epoch ? e.name + "_step" : e.name;
    out[key] = e.step_value.item<double>();
    if (consume) e.step_fresh = false;
  }
  return out;
}

MetricMap MetricStore::prog_bar_step_values() const {
  MetricMap out;
  for (const auto& e : entries_)
    if (e.on_step && e.prog_bar && e.step_value.defined()) out[e.name] = e.step_value.item<double>();
  return out;
}

void MetricStore::log_metric(const std::string& name, metrics::Metric& metric, const LogOptions& options) {
  Entry& e = entry(name);
  if (e.metric && e.metric != &metric)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("log('{}'): two different metric objects under one name", name));
  e.on_step = false;
  e.on_epoch = true;
  e.prog_bar = options.prog_bar_;
  e.logger = options.logger_;
  e.metric = &metric;
  e.metric_due = true;
}

MetricMap MetricStore::reduce_epoch(Strategy* strategy, bool logger_only, MetricMap* prog_bar_out, MetricMap* all_out) {
  MetricMap out;
  for (auto& e : entries_) {
    if (e.metric) {
      if (!e.metric_due) continue;
      // A collective when the metric is synced: every rank reaches this point at the same epoch end.
      const at::Tensor computed = e.metric->compute();
      e.metric->reset();
      e.metric_due = false;
      if (computed.numel() != 1)
        throw Error(ErrorKind::invalid_argument,
                    fmt::format("log('{}', metric): the metric computes a tensor of shape {}, not a scalar (an average "
                                "of none?); log its elements yourself",
                                e.name, c10::str(computed.sizes())));
      const double value = computed.item<double>();
      if (all_out) (*all_out)[e.name] = value;
      if (prog_bar_out && e.prog_bar) (*prog_bar_out)[e.name] = value;
      if (!logger_only || e.logger) out[e.name] = value;
      continue;
    }
    if (!e.on_epoch || !e.epoch_accum.defined()) continue;
    at::Tensor total = e.epoch_accum;
    double weight = e.epoch_weight;
    if (e.sync_dist && strategy) {
      switch (e.reduce) {
        case Reduction::mean: {
          at::Tensor both = at::stack({total.reshape({}), at::scalar_tensor(weight, total.options())});
          both = strategy->reduce(both, ReduceOp::sum);
          total = both[0];
          weight = both[1].item<double>();
          break;
        }
        case Reduction::sum:
          total = strategy->reduce(total, ReduceOp::sum);
          break;
        case Reduction::max:
          total = strategy->reduce(total, ReduceOp::max);
          break;
        case Reduction::min:
          total = strategy->reduce(total, ReduceOp::min);
          break;
      }
    }
    double value = total.item<double>();
    if (e.reduce == Reduction::mean) value /= weight > 0 ? weight : 1.0;
    const std::string key = e.on_step ? e.name + "_epoch" : e.name;
    if (all_out) {
      (*all_out)[key] = value;
      (*all_out)[e.name] = value;
    }
    if (prog_bar_out && e.prog_bar) (*prog_bar_out)[e.name] = value;
    if (!logger_only || e.logger) out[key] = value;
    e.epoch_accum = at::Tensor();
    e.epoch_weight = 0;
  }
  return out;
}

void MetricStore::clear() { entries_.clear(); }

}  // namespace fulgur
