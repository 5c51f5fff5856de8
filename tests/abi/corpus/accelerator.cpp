// ABI corpus, accelerator `corpus_cpu`: built against the frozen SDK 1.0 headers (tests/abi/sdk-1.0)
// and loaded by the current host, as a third party's binary would be. The host CPU as one device,
// with the 1.0 extension StagedTransfers: a CPU has no copy stream, so a staged batch is transferred
// at once; the host still takes its staging path (stage_transfer, then finish_transfer before the
// step), through the extension's vtable as it was at 1.0.
#include <fulgur/plugin.h>

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace {

class CorpusCpu final : public fulgur::WithExtensions<fulgur::Accelerator, fulgur::StagedTransfers> {
 public:
  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }
  bool is_available() const override { return true; }
  int64_t device_count() const override { return 1; }

  std::vector<c10::Device> parse_devices(std::string_view spec) const override {
    if (spec == "auto" || spec == "1" || spec == "-1") return {c10::Device(c10::DeviceType::CPU)};
    throw fulgur::Error(fulgur::ErrorKind::config, "accelerator 'corpus_cpu': devices = \"" + std::string(spec) +
                                                       "\" is not understood; it offers one device (1 or \"auto\")");
  }
  void setup_device(const c10::Device&) override {}
  std::string default_collective_backend() const override { return "gloo"; }
  void synchronize(const c10::Device&) override {}
  fulgur::MetricMap device_stats(const c10::Device&) const override {
    return {{"staged_batches", static_cast<double>(staged_)}, {"finished_batches", static_cast<double>(finished_)}};
  }
  std::string device_name(const c10::Device&) const override { return "corpus cpu"; }

  bool stage_transfer(const c10::Device&, const std::function<void()>& transfer) override {
    transfer();
    ++staged_;
    return true;
  }
  void finish_transfer(const c10::Device&, fulgur::Batch&) override { ++finished_; }

 private:
  int64_t staged_ = 0, finished_ = 0;
};

}  // namespace

FULGUR_PLUGIN(CorpusCpu, "corpus_cpu", "1.0.0", "ABI corpus: the host CPU, batches staged at once")
