// Built-in callback `backbone_finetuning`: Lightning's BackboneFinetuning. The parameters whose
// dotted name starts with `backbone` ("backbone.0.weight") are frozen when fit starts
// (requires_grad = false; with train_bn, BatchNorm parameters stay trainable) and taken out of the
// optimizer's parameter groups. At epoch unfreeze_backbone_at_epoch they become trainable again
// and are added to the first optimizer as a new parameter group (Lightning's
// unfreeze_and_add_param_group), with lr = backbone_initial_lr, or backbone_initial_ratio_lr times
// the first group's lr. In each later epoch that group's lr is multiplied by lambda_func
// (Lightning's default lambda is the constant 1.5) and, with should_align, capped at the first
// group's lr.
//
// Lightning's initial_denom_lr is not offered: BackboneFinetuning always passes an lr to
// unfreeze_and_add_param_group, which then ignores the denominator.
//
// Resume: the state records whether the backbone was unfrozen and its lr; at fit start the group
// is re-created before the optimizer's saved state is loaded into it.
#include <fulgur/plugin.h>

#include "../common/callback_conventions.h"
#include "../common/model_weights.h"

#include <fmt/format.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace {

namespace support = fulgur::callback_conventions;
namespace weights = fulgur::model_weights;
using fulgur::Error;
using fulgur::ErrorKind;

constexpr char kOwner[] = "callback 'backbone_finetuning'";

double round_to(double value, int64_t digits) {
  const double scale = std::pow(10.0, static_cast<double>(digits));
  return std::round(value * scale) / scale;
}

class BackboneFinetuning final : public fulgur::CallbackBase<BackboneFinetuning> {
 public:
  FULGUR_OPTIONS(Options,
                 (integer, unfreeze_backbone_at_epoch, "Epoch (0-based) at which the backbone is unfrozen", 10),
                 (string, backbone, "Name of the backbone submodule: the prefix of its parameters' names", "backbone"),
                 (floating, lambda_func,
                  "Factor the backbone lr is multiplied by each epoch after unfreezing (Lightning's "
                  "default lambda returns 1.5)",
                  1.5),
                 (floating, backbone_initial_ratio_lr,
                  "Backbone lr at unfreezing, as a fraction of the first group's lr", 0.1),
                 (floating, backbone_initial_lr, "Backbone lr at unfreezing; nan: use the ratio", nan),
                 (boolean, should_align, "Cap the backbone lr at the first group's lr", true),
                 (boolean, train_bn, "Keep the backbone's BatchNorm parameters trainable while frozen", true),
                 (boolean, verbose, "Log the learning rates at each change", false),
                 (integer, rounding, "Decimal digits of the learning rates in the verbose log", 12));

  explicit BackboneFinetuning(const Options& options)
      : unfreeze_at_(options.unfreeze_backbone_at_epoch),
        backbone_(options.backbone),
        lambda_(options.lambda_func),
        initial_ratio_(options.backbone_initial_ratio_lr),
        initial_lr_(options.backbone_initial_lr),
        should_align_(options.should_align),
        train_bn_(options.train_bn),
        verbose_(options.verbose),
        rounding_(options.rounding) {
    options.check(unfreeze_at_ >= 0, "unfreeze_backbone_at_epoch", "must be >= 0");
    if (backbone_.empty())
      throw Error(ErrorKind::config, fmt::format("{}: backbone is empty; give the name of the backbone submodule "
                                                 "(the prefix of its parameters' names), e.g. \"features\"",
                                                 kOwner));
    options.check(lambda_ > 0.0, "lambda_func", "must be > 0 (the factor the backbone lr is multiplied by each epoch)");
    options.check(initial_ratio_ > 0.0, "backbone_initial_ratio_lr", "must be > 0");
    options.check(std::isnan(initial_lr_) || initial_lr_ > 0.0, "backbone_initial_lr",
                  "must be > 0, or nan to use backbone_initial_ratio_lr");
    options.check(rounding_ >= 0, "rounding", "must be >= 0");
  }

  void on_fit_start(fulgur::TrainerContext& trainer) override {
    weights::require_one_process_to_change_trainable(trainer, kOwner);
    auto optimizers = trainer.optimizers();
    if (optimizers.empty())
      throw Error(ErrorKind::config, fmt::format("{}: the Module configured no optimizer; there is nothing to add the "
                                                 "backbone's parameters to",
                                                 kOwner));
    optimizer_ = optimizers.front();
    collect(trainer.model());
    if (pending_) {
      unfrozen_ = support::get_optional_int(kOwner, *pending_, "unfrozen").value_or(0) != 0;
      previous_lr_ = support::get_optional_double(kOwner, *pending_, "previous_backbone_lr").value_or(0.0);
      last_epoch_ = support::get_optional_int(kOwner, *pending_, "last_epoch").value_or(-1);
      pending_.reset();
    } else {
      unfrozen_ = false;
      previous_lr_ = 0.0;
      last_epoch_ = -1;
    }
    // Out of their groups in every case: the backbone gets its own group when it is unfrozen (or
    // now, on resume, so that the optimizer's saved state finds the groups it was saved with).
    for (auto* optimizer : optimizers) weights::remove_from_groups(*optimizer, frozen_);
    if (unfrozen_) {
      set_trainable(true);
      weights::add_param_group(*optimizer_, frozen_, previous_lr_);
    } else {
      set_trainable(false);
    }
  }

  void on_train_epoch_start(fulgur::TrainerContext& trainer) override {
    const int64_t epoch = trainer.current_epoch();
    if (epoch <= last_epoch_) return;  // resumed mid-epoch: this epoch's change is made already
    last_epoch_ = epoch;
    auto& groups = optimizer_->param_groups();
    const double current_lr = groups.front().options().get_lr();
    if (epoch == unfreeze_at_ && !unfrozen_) {
      previous_lr_ = std::isnan(initial_lr_) ? current_lr * initial_ratio_ : initial_lr_;
      set_trainable(true);
      weights::add_param_group(*optimizer_, frozen_, previous_lr_);
      unfrozen_ = true;
      if (verbose_)
        fulgur::log::info(fmt::format("{}: epoch {}: unfroze {} backbone parameters, lr {} (current lr {})", kOwner,
                                      epoch, frozen_.size(), round_to(previous_lr_, rounding_),
                                      round_to(current_lr, rounding_)));
    } else if (epoch > unfreeze_at_ && unfrozen_) {
      double next = lambda_ * previous_lr_;
      if (should_align_ && next > current_lr) next = current_lr;
      groups.back().options().set_lr(next);
      previous_lr_ = next;
      if (verbose_)
        fulgur::log::info(fmt::format("{}: epoch {}: current lr {}, backbone lr {}", kOwner, epoch,
                                      round_to(current_lr, rounding_), round_to(next, rounding_)));
    }
  }

  std::string state_key() const override { return "BackboneFinetuning"; }
  void state_dict(c10::IValue& out) const override {
    auto state = support::new_state_dict();
    state.insert("unfrozen", int64_t{unfrozen_ ? 1 : 0});
    state.insert("previous_backbone_lr", previous_lr_);
    state.insert("last_epoch", last_epoch_);
    out = c10::IValue(state);
  }
  void load_state_dict(const c10::IValue& state) override { pending_ = support::expect_dict(kOwner, state); }

 private:
  // The backbone's parameters that freeze: all of them, less BatchNorm's with train_bn.
  void collect(torch::nn::Module& model) {
    frozen_.clear();
    std::set<const void*> batch_norm;
    if (train_bn_)
      for (const auto& item : model.named_modules("", /*include_self=*/false))
        if (item.value()->name().find("BatchNorm") != std::string::npos)
          for (const auto& p : item.value()->parameters(/*recurse=*/false)) batch_norm.insert(p.unsafeGetTensorImpl());
    std::vector<std::string> names;
    size_t matched = 0;
    for (const auto& item : model.named_parameters(/*recurse=*/true)) {
      const std::string& name = item.key();
      names.push_back(name);
      const bool in_backbone = name == backbone_ || name.rfind(backbone_ + ".", 0) == 0;
      if (!in_backbone) continue;
      ++matched;
      if (batch_norm.count(item.value().unsafeGetTensorImpl()) == 0) frozen_.push_back(item.value());
    }
    if (matched == 0) {
      std::set<std::string> top;
      for (const auto& n : names) top.insert(n.substr(0, n.find('.')));
      std::string listed;
      for (const auto& t : top) listed += fmt::format("{}\"{}\"", listed.empty() ? "" : ", ", t);
      throw Error(ErrorKind::config, fmt::format("{}: backbone = \"{}\" names no parameter of the model; its top-level "
                                                 "submodules are {}",
                                                 kOwner, backbone_, listed.empty() ? "none" : listed));
    }
  }

  void set_trainable(bool trainable) {
    for (auto& p : frozen_) {
      p.set_requires_grad(trainable);
      if (!trainable) p.mutable_grad() = at::Tensor();
    }
  }

  int64_t unfreeze_at_;
  std::string backbone_;
  double lambda_;
  double initial_ratio_;
  double initial_lr_;
  bool should_align_;
  bool train_bn_;
  bool verbose_;
  int64_t rounding_;
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::vector<at::Tensor> frozen_;
  bool unfrozen_ = false;
  double previous_lr_ = 0.0;
  int64_t last_epoch_ = -1;
  std::optional<c10::impl::GenericDict> pending_;
};

}  // namespace

FULGUR_PLUGIN(BackboneFinetuning, "backbone_finetuning", "0.1.0",
              "Freezes the backbone, then unfreezes it at an epoch as a new optimizer parameter group with its own, "
              "growing lr (Lightning's BackboneFinetuning)")
