// DeviceMeshReceiver: the model side of the device mesh.
#include <fulgur/model_parallel.h>

#include <torch/nn/module.h>

namespace fulgur {

DeviceMeshReceiver::~DeviceMeshReceiver() = default;

DeviceMeshReceiver* find_device_mesh_receiver(torch::nn::Module& model) noexcept {
  return dynamic_cast<DeviceMeshReceiver*>(&model);
}

}  // namespace fulgur
