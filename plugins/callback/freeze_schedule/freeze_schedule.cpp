// Built-in callback `freeze_schedule`: freezes and unfreezes parameters by name at given epochs
// (Lightning's BaseFinetuning, driven by a table instead of a subclass). Each entry of `schedule`
// is "EPOCH:freeze:PATTERN" or "EPOCH:unfreeze:PATTERN"; PATTERN is a shell pattern on the dotted
// parameter names ("features.*", "*.bias"). At the start of epoch EPOCH (0-based), in the order
// given, matching parameters get requires_grad = false (their gradient is dropped, so the
// optimizers leave them alone) or true. A parameter that is unfrozen and that no parameter group
// of the first optimizer holds (the Module built its optimizer from the trainable parameters only)
// is added to it as a new parameter group with the first group's hyperparameters, so it is
// trained; the state remembers those groups so a resumed run re-creates them before the
// optimizer's saved state is loaded.
#include <fulgur/plugin.h>

#include "../common/callback_conventions.h"
#include "../common/model_weights.h"

#include <fmt/format.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace support = fulgur::callback_conventions;
namespace weights = fulgur::model_weights;
using fulgur::Error;
using fulgur::ErrorKind;

constexpr char kOwner[] = "callback 'freeze_schedule'";

struct Entry {
  int64_t epoch;
  bool freeze;
  std::string pattern;
};

std::vector<Entry> parse_schedule(const std::vector<std::string>& schedule) {
  if (schedule.empty())
    throw Error(ErrorKind::config, fmt::format("{}: schedule is empty; give entries such as "
                                               "schedule = [\"0:freeze:features.*\", \"3:unfreeze:features.*\"]",
                                               kOwner));
  std::vector<Entry> out;
  for (const auto& text : schedule) {
    const size_t a = text.find(':');
    const size_t b = a == std::string::npos ? a : text.find(':', a + 1);
    Entry entry{};
    bool ok = b != std::string::npos && b + 1 < text.size();
    if (ok) {
      auto [ptr, ec] = std::from_chars(text.data(), text.data() + a, entry.epoch);
      ok = ec == std::errc() && ptr == text.data() + a && entry.epoch >= 0;
      const std::string action = text.substr(a + 1, b - a - 1);
      ok = ok && (action == "freeze" || action == "unfreeze");
      entry.freeze = action == "freeze";
      entry.pattern = text.substr(b + 1);
    }
    if (!ok)
      throw Error(ErrorKind::config,
                  fmt::format("{}: schedule entry \"{}\" is not EPOCH:freeze:PATTERN or "
                              "EPOCH:unfreeze:PATTERN with EPOCH >= 0, e.g. \"2:unfreeze:encoder.*\"",
                              kOwner, text));
    out.push_back(entry);
  }
  std::stable_sort(out.begin(), out.end(), [](const Entry& x, const Entry& y) { return x.epoch < y.epoch; });
  return out;
}

class FreezeSchedule final : public fulgur::CallbackBase<FreezeSchedule> {
 public:
  FULGUR_OPTIONS(Options,
                 (string_list, schedule,
                  "Entries \"EPOCH:freeze:PATTERN\" / \"EPOCH:unfreeze:PATTERN\" (shell patterns "
                  "on dotted parameter names)"),
                 (boolean, verbose, "Log each freeze and unfreeze", false));
  explicit FreezeSchedule(const Options& options)
      : entries_(parse_schedule(options.schedule)), verbose_(options.verbose) {}

  void on_fit_start(fulgur::TrainerContext& trainer) override {
    weights::require_one_process_to_change_trainable(trainer, kOwner);
    auto optimizers = trainer.optimizers();
    optimizer_ = optimizers.empty() ? nullptr : optimizers.front();
    params_.clear();
    for (const auto& item : trainer.model().named_parameters(/*recurse=*/true)) params_[item.key()] = item.value();
    for (const auto& entry : entries_) {
      bool any = false;
      for (const auto& [name, p] : params_) any = any || weights::name_matches(entry.pattern, name);
      if (!any) {
        std::vector<std::string> names;
        for (const auto& [name, p] : params_) names.push_back(name);
        const std::string hint = support::closest_match(entry.pattern, names);
        throw Error(ErrorKind::config,
                    fmt::format("{}: pattern \"{}\" matches no parameter of the model{}; parameter names look like "
                                "\"{}\"",
                                kOwner, entry.pattern, hint.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", hint),
                                names.empty() ? std::string() : names.front()));
      }
    }
    applied_through_ = -1;
    added_groups_.clear();
    if (pending_) {
      applied_through_ = support::get_optional_int(kOwner, *pending_, "applied_through_epoch").value_or(-1);
      std::vector<std::vector<std::string>> groups;
      if (auto g = support::find_value(*pending_, "added_groups"); g && g->isList())
        for (const auto& group : g->toListRef()) {
          std::vector<std::string> names;
          for (const auto& n : group.toListRef()) names.push_back(n.toStringRef());
          groups.push_back(std::move(names));
        }
      pending_.reset();
      // The requires_grad flags as they were, then the groups the run had added, in order.
      for (const auto& entry : entries_)
        if (entry.epoch <= applied_through_) apply(entry, /*add_groups=*/false);
      for (const auto& names : groups) {
        std::vector<at::Tensor> tensors;
        for (const auto& n : names) {
          auto it = params_.find(n);
          if (it == params_.end())
            throw Error(ErrorKind::checkpoint, fmt::format("{}: the checkpoint's state names parameter '{}', which "
                                                           "the model does not have",
                                                           kOwner, n));
          tensors.push_back(it->second);
        }
        if (optimizer_) {
          weights::remove_from_groups(*optimizer_, tensors);
          weights::add_param_group(*optimizer_, tensors, optimizer_->param_groups().front().options().get_lr());
        }
        added_groups_.push_back(names);
      }
    }
  }

  void on_train_epoch_start(fulgur::TrainerContext& trainer) override {
    const int64_t epoch = trainer.current_epoch();
    if (epoch <= applied_through_) return;
    for (const auto& entry : entries_)
      if (entry.epoch > applied_through_ && entry.epoch <= epoch) apply(entry, /*add_groups=*/true);
    applied_through_ = epoch;
  }

  std::string state_key() const override { return "FreezeSchedule"; }
  void state_dict(c10::IValue& out) const override {
    auto state = support::new_state_dict();
    state.insert("applied_through_epoch", applied_through_);
    c10::impl::GenericList groups(c10::ListType::ofStrings());
    for (const auto& names : added_groups_) groups.push_back(c10::List<std::string>(names));
    state.insert("added_groups", groups);
    out = c10::IValue(state);
  }
  void load_state_dict(const c10::IValue& state) override { pending_ = support::expect_dict(kOwner, state); }

 private:
  void apply(const Entry& entry, bool add_groups) {
    std::vector<at::Tensor> orphans;
    std::vector<std::string> orphan_names;
    size_t count = 0;
    for (auto& [name, p] : params_) {
      if (!weights::name_matches(entry.pattern, name)) continue;
      ++count;
      p.set_requires_grad(!entry.freeze);
      if (entry.freeze) p.mutable_grad() = at::Tensor();
      if (!entry.freeze && add_groups && optimizer_ && weights::group_of(*optimizer_, p) < 0) {
        orphans.push_back(p);
        orphan_names.push_back(name);
      }
    }
    if (!orphans.empty()) {
      weights::add_param_group(*optimizer_, orphans, optimizer_->param_groups().front().options().get_lr());
      added_groups_.push_back(orphan_names);
    }
    if (verbose_)
      fulgur::log::info(fmt::format(
          "{}: epoch {}: {} {} parameter(s) matching \"{}\"{}", kOwner, entry.epoch, entry.freeze ? "froze" : "unfroze",
          count, entry.pattern,
          orphans.empty() ? std::string()
                          : fmt::format(" ({} added to the optimizer as a new parameter group)", orphans.size())));
  }

  std::vector<Entry> entries_;
  bool verbose_;
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::map<std::string, at::Tensor> params_;
  int64_t applied_through_ = -1;
  std::vector<std::vector<std::string>> added_groups_;
  std::optional<c10::impl::GenericDict> pending_;
};

}  // namespace

FULGUR_PLUGIN(FreezeSchedule, "freeze_schedule", "0.1.0",
              "Freezes and unfreezes parameters by name pattern at given epochs; unfrozen parameters the optimizer "
              "lacks join it as a new parameter group")
