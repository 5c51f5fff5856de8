// Lightning 2.6's progress trackers as checkpoint dicts. Each tracker is a dataclass restored
// with __dict__.update: exactly its own fields are written, no others.
#include "lightning_progress.h"

#include "../ivalue_dict.h"

namespace fulgur::lightning {

namespace {

c10::impl::GenericDict processed(const Counts& c) {
  auto d = string_dict();
  d.insert("ready", c.ready);
  d.insert("started", c.started);
  d.insert("processed", c.processed);
  d.insert("completed", c.completed);
  return d;
}

c10::impl::GenericDict ready_completed(int64_t n) {
  auto d = string_dict();
  d.insert("ready", n);
  d.insert("completed", n);
  return d;
}

c10::impl::GenericDict started(int64_t n) {
  auto d = string_dict();
  d.insert("ready", n);
  d.insert("started", n);
  d.insert("completed", n);
  return d;
}

c10::impl::GenericDict pair(c10::impl::GenericDict total, c10::impl::GenericDict current) {
  auto d = string_dict();
  d.insert("total", std::move(total));
  d.insert("current", std::move(current));
  return d;
}

}  // namespace

c10::impl::GenericDict progress(const Counts& total, const Counts& current) {
  return pair(processed(total), processed(current));
}

c10::impl::GenericDict batch_progress(const Counts& total, const Counts& current, bool is_last_batch) {
  auto d = progress(total, current);
  d.insert("is_last_batch", is_last_batch);
  return d;
}

c10::impl::GenericDict ready_completed_progress(int64_t total, int64_t current) {
  return pair(ready_completed(total), ready_completed(current));
}

c10::impl::GenericDict optimization_progress(int64_t total_steps, int64_t current_steps) {
  auto optimizer = string_dict();
  optimizer.insert("step", ready_completed_progress(total_steps, current_steps));
  optimizer.insert("zero_grad", pair(started(total_steps), started(current_steps)));
  auto d = string_dict();
  d.insert("optimizer", optimizer);
  return d;
}

c10::impl::GenericDict empty_state() { return string_dict(); }

}  // namespace fulgur::lightning
