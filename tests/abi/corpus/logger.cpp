// ABI corpus, logger `corpus_rows`: built against the frozen SDK 1.0 headers. Rank zero writes one
// CSV row per value (`step,key,value`) to <root_dir>/corpus_rows/version_N/<file>, and the
// hyperparameters to hparams.csv next to it; the run's status is the last row.
#include <fulgur/plugin.h>

#include <sys/stat.h>
#include <sys/types.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <string>

namespace {

void make_directory(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST)
    throw fulgur::Error(fulgur::ErrorKind::io,
                        "logger 'corpus_rows': cannot create " + path + ": " + std::strerror(errno));
}

bool exists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0;
}

class CorpusRows final : public fulgur::Logger {
 public:
  explicit CorpusRows(const fulgur::Options& options) : file_(options.get_string("file")) {}

  void setup(const fulgur::LoggerSetup& setup) override {
    const std::string base = setup.root_dir + "/corpus_rows";
    int version = 0;
    while (exists(base + "/version_" + std::to_string(version))) ++version;
    dir_ = base + "/version_" + std::to_string(version);
    if (setup.global_rank != 0) return;
    make_directory(setup.root_dir);
    make_directory(base);
    make_directory(dir_);
    rows_.open(dir_ + "/" + file_);
    if (!rows_) throw fulgur::Error(fulgur::ErrorKind::io, "logger 'corpus_rows': cannot write " + dir_ + "/" + file_);
    rows_ << "step,key,value\n";
  }
  void log_metrics(const fulgur::MetricMap& metrics, int64_t step) override {
    if (!rows_.is_open()) return;
    for (const auto& [key, value] : metrics) rows_ << step << ',' << key << ',' << value << '\n';
  }
  void log_hyperparams(const std::map<std::string, std::string>& params) override {
    if (!rows_.is_open()) return;
    std::ofstream out(dir_ + "/hparams.csv");
    out << "key,value\n";
    for (const auto& [key, value] : params) out << key << ",\"" << value << "\"\n";
  }
  void save() override {
    if (rows_.is_open()) rows_.flush();
  }
  void finalize(fulgur::RunStatus status) override {
    if (!rows_.is_open()) return;
    rows_ << "-1,status," << fulgur::to_string(status) << '\n';
    rows_.close();
  }
  std::string log_dir() const override { return dir_; }

 private:
  std::string file_, dir_;
  std::ofstream rows_;
};

}  // namespace

FULGUR_PLUGIN(CorpusRows, "corpus_rows", "1.0.0", "ABI corpus: metrics as step,key,value rows of a CSV file",
              FULGUR_OPTION(string, file, "File name of the rows, in the run directory", "rows.csv"))
