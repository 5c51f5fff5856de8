// ABI corpus, callback `corpus_epoch_marker`: built against the frozen SDK 1.0 headers. At the end
// of every training epoch rank zero appends `epoch=E step=S` to <default_root_dir>/<file>; it keeps
// the number of epochs it saw as its checkpointed state and stamps `corpus_epochs` into every
// checkpoint it sees saved.
#include <fulgur/plugin.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <fstream>
#include <string>

namespace {

class CorpusEpochMarker final : public fulgur::CallbackBase<CorpusEpochMarker> {
 public:
  explicit CorpusEpochMarker(const fulgur::Options& options) : file_(options.get_string("file")) {}

  void on_train_epoch_end(fulgur::TrainerContext& trainer) override {
    ++epochs_;
    if (!trainer.is_global_zero()) return;
    std::ofstream out(trainer.default_root_dir() + "/" + file_, std::ios::app);
    out << "epoch=" << trainer.current_epoch() << " step=" << trainer.global_step() << '\n';
    if (!out) throw fulgur::Error(fulgur::ErrorKind::io, "callback 'corpus_epoch_marker': cannot append to " + file_);
  }
  void on_save_checkpoint(fulgur::TrainerContext&, c10::IValue& checkpoint) override {
    checkpoint.toGenericDict().insert_or_assign("corpus_epochs", epochs_);
  }

  std::string state_key() const override { return "corpus_epoch_marker"; }
  void state_dict(c10::IValue& out) const override { out = epochs_; }
  void load_state_dict(const c10::IValue& state) override {
    if (!state.isInt())
      throw fulgur::Error(fulgur::ErrorKind::checkpoint, "callback 'corpus_epoch_marker': its state is not an int");
    epochs_ = state.toInt();
  }

 private:
  std::string file_;
  int64_t epochs_ = 0;
};

}  // namespace

FULGUR_PLUGIN(CorpusEpochMarker, "corpus_epoch_marker", "1.0.0",
              "ABI corpus: a line per training epoch in a file, its count in checkpoints",
              FULGUR_OPTION(string, file, "File under default_root_dir the epoch lines are appended to",
                            "corpus_epochs.txt"))
