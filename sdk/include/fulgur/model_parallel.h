/// @file
/// How a model gets the strategy's DeviceMesh (Lightning's `self.device_mesh` in
/// `configure_model`): a model that splits its layers across ranks derives from DeviceMeshReceiver
/// as well as fulgur::Module, and a strategy that lays the ranks out as a mesh (model_parallel)
/// hands the mesh over right before the model's configure_model runs, where the model builds its
/// tensor-parallel layers on mesh.group("tp"). Not yet part of a released SDK (added for SDK 1.3).
#pragma once

#include <fulgur/device_mesh.h>
#include <fulgur/export.h>

#include <string_view>

namespace torch::nn {
class Module;
}

namespace fulgur {

/// Extension of a model: receives the strategy's device mesh.
class FULGUR_SDK_API DeviceMeshReceiver {
 public:
  /// The extension's id.
  static constexpr std::string_view kExtensionId = "fulgur.module.device_mesh/1";
  /// Destroys the interface.
  virtual ~DeviceMeshReceiver();
  /// Called once per stage, before configure_model, on every rank, with this rank's mesh (named
  /// dimensions "dp" and "tp"). The mesh's communicators live until the strategy's teardown.
  virtual void set_device_mesh(const DeviceMesh& mesh) = 0;
};

/// `model`'s DeviceMeshReceiver, or nullptr when the model does not derive from it (the model
/// object reaches strategies as a torch::nn::Module, which predates extension(): a cross-cast
/// inside the SDK).
FULGUR_SDK_API DeviceMeshReceiver* find_device_mesh_receiver(torch::nn::Module& model) noexcept;

}  // namespace fulgur
