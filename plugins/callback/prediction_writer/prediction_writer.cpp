// Built-in callback `prediction_writer`: Lightning's BasePredictionWriter with the writing done.
// During predict it writes what predict_step returned, per process (file names carry the global
// rank, so the ranks of a distributed predict never overwrite each other):
//   write_interval = "batch":  <output_dir>/predictions_rank<R>_batch<I>.<ext> after each batch;
//   write_interval = "epoch":  <output_dir>/predictions_rank<R>.<ext> at the end of predict;
//   "batch_and_epoch": both.
// format = "pt": a PyTorch zip archive that Python's torch.load(path, weights_only=True) opens: per
// batch {"prediction": tensor, "batch_idx": int}; per epoch {"predictions": [tensor, ...],
// "batch_indices": [int, ...]} (Lightning's write_on_epoch_end arguments).
// format = "csv": one row per sample, "batch_idx,sample,v0,v1,..." (each prediction flattened
// from its first dimension on).
#include <fulgur/checkpoint_io.h>
#include <fulgur/plugin.h>
#include <fulgur/storage.h>

#include "../common/callback_conventions.h"

#include <ATen/core/List.h>
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace support = fulgur::callback_conventions;
using fulgur::Error;
using fulgur::ErrorKind;

constexpr char kOwner[] = "callback 'prediction_writer'";

class PredictionWriter final : public fulgur::CallbackBase<PredictionWriter> {
 public:
  FULGUR_OPTIONS(Options, (string, write_interval, "\"batch\", \"epoch\" or \"batch_and_epoch\"", "batch"),
                 (string, output_dir, "Directory for the files; \"\": <default_root_dir>/predictions", ""),
                 (string, format, "\"pt\" (torch.load opens it) or \"csv\"", "pt"));
  explicit PredictionWriter(const Options& options) : output_dir_(options.output_dir), format_(options.format) {
    const std::string& interval = options.write_interval;
    if (interval == "batch") {
      per_batch_ = true;
    } else if (interval == "epoch") {
      per_epoch_ = true;
    } else if (interval == "batch_and_epoch") {
      per_batch_ = per_epoch_ = true;
    } else {
      options.reject("write_interval", "is not understood; use \"batch\", \"epoch\" or \"batch_and_epoch\"");
    }
    options.check(format_ == "pt" || format_ == "csv", "format",
                  "is not understood; use \"pt\" (torch.load opens it) or \"csv\"");
  }

  void on_predict_start(fulgur::TrainerContext& trainer) override {
    // output_dir may be an object store's URL (s3://bucket/prefix, fulgur/storage.h): files are
    // written there whole, and there are no directories to create.
    dir_ = output_dir_.empty()
               ? fulgur::join_storage_path(fulgur::callback_conventions::default_root(trainer), "predictions")
               : output_dir_;
    std::error_code ec;
    if (!fulgur::is_storage_url(dir_)) std::filesystem::create_directories(dir_, ec);
    if (ec)
      throw Error(ErrorKind::io, fmt::format("{}: cannot create output_dir {}: {}; choose a writable directory", kOwner,
                                             dir_, ec.message()));
    rank_ = trainer.cluster().global_rank;
    predictions_.clear();
    indices_.clear();
  }

  void on_predict_batch_end(fulgur::TrainerContext&, const at::Tensor& prediction, const fulgur::Batch&,
                            int64_t batch_idx) override {
    if (!prediction.defined()) return;
    const at::Tensor cpu = prediction.detach().to(at::kCPU);
    if (per_batch_) {
      const std::string path =
          fulgur::join_storage_path(dir_, fmt::format("predictions_rank{}_batch{}.{}", rank_, batch_idx, format_));
      if (format_ == "pt") {
        auto dict = support::new_state_dict();
        dict.insert("prediction", cpu);
        dict.insert("batch_idx", batch_idx);
        fulgur::write_checkpoint_file(c10::IValue(dict), path);
      } else {
        write_csv(path, {cpu}, {batch_idx});
      }
    }
    if (per_epoch_) {
      predictions_.push_back(cpu);
      indices_.push_back(batch_idx);
    }
  }

  void on_predict_epoch_end(fulgur::TrainerContext&) override {
    if (!per_epoch_) return;
    const std::string path = fulgur::join_storage_path(dir_, fmt::format("predictions_rank{}.{}", rank_, format_));
    if (format_ == "pt") {
      c10::List<at::Tensor> list;
      for (const auto& p : predictions_) list.push_back(p);
      auto dict = support::new_state_dict();
      dict.insert("predictions", list);
      dict.insert("batch_indices", c10::List<int64_t>(indices_));
      fulgur::write_checkpoint_file(c10::IValue(dict), path);
    } else {
      write_csv(path, predictions_, indices_);
    }
    fulgur::log::info(fmt::format("{}: wrote {} batches of predictions to {}", kOwner, predictions_.size(), path));
    predictions_.clear();
    indices_.clear();
  }

 private:
  // Written atomically (atomic_write_text: beside the final name and renamed over it, or one
  // object upload): a reader never sees half a file.
  static void write_csv(const std::string& path, const std::vector<at::Tensor>& predictions,
                        const std::vector<int64_t>& indices) {
    std::ostringstream out;
    {
      int64_t width = 0;
      for (const auto& p : predictions) width = std::max<int64_t>(width, p.dim() == 0 ? 1 : p.numel() / p.size(0));
      out << "batch_idx,sample";
      for (int64_t c = 0; c < width; ++c) out << ",v" << c;
      out << "\n";
      for (size_t b = 0; b < predictions.size(); ++b) {
        // float64 stays float64; everything else is written as float32, each value in the shortest
        // text that reads back to the same number.
        const bool wide = predictions[b].scalar_type() == at::kDouble;
        const at::Tensor rows = (predictions[b].dim() == 0 ? predictions[b].reshape({1, 1})
                                                           : predictions[b].reshape({predictions[b].size(0), -1}))
                                    .to(wide ? at::kDouble : at::kFloat)
                                    .contiguous();
        for (int64_t r = 0; r < rows.size(0); ++r) {
          out << indices[b] << ',' << r;
          for (int64_t c = 0; c < rows.size(1); ++c) {
            const int64_t i = r * rows.size(1) + c;
            out << ','
                << (wide ? fmt::format("{}", rows.data_ptr<double>()[i])
                         : fmt::format("{}", rows.data_ptr<float>()[i]));
          }
          out << "\n";
        }
      }
    }
    fulgur::atomic_write_text(path, out.str());
  }

  std::string output_dir_;
  std::string format_;
  bool per_batch_ = false;
  bool per_epoch_ = false;
  std::string dir_;  // a local directory or a URL
  int64_t rank_ = 0;
  std::vector<at::Tensor> predictions_;
  std::vector<int64_t> indices_;
};

}  // namespace

FULGUR_PLUGIN(PredictionWriter, "prediction_writer", "0.1.0",
              "Writes predict_step outputs to files per batch and/or per predict epoch, per rank (Lightning's "
              "BasePredictionWriter)")
