// An out-of-tree datamodule plugin: points on the line y = 3x - 1 for line_model.cpp. It serves
// in-memory tensors with the data library's loader, so it links Fulgur::data.
#include <fulgur/data.h>
#include <fulgur/plugin.h>

#include <torch/torch.h>

class LineData : public fulgur::DataModule {
 public:
  FULGUR_OPTIONS(Options, (integer, samples, "Points on the line", 256), (integer, batch_size, "Points per batch", 32));

  explicit LineData(const Options& hp) : samples_(hp.samples), batch_(hp.batch_size) {}
  std::unique_ptr<fulgur::BatchLoader> train_loader() override { return loader(/*shuffle=*/true); }
  std::unique_ptr<fulgur::BatchLoader> val_loader() override { return loader(/*shuffle=*/false); }

 private:
  std::unique_ptr<fulgur::BatchLoader> loader(bool shuffle) const {
    at::Tensor x = torch::linspace(-1, 1, samples_).unsqueeze(1);
    return fulgur::make_tensor_loader(x, 3 * x - 1,
                                      fulgur::TensorLoaderOptions().batch_size(batch_).shuffle(shuffle).seed(1));
  }
  int64_t samples_, batch_;
};

FULGUR_PLUGIN(LineData, "line_data", "1.0.0", "Points on the line y = 3x - 1")
