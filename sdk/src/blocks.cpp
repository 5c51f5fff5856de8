#include <fulgur/blocks.h>
#include <fulgur/error.h>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/ivalue.h>
#include <c10/core/DefaultDtype.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>
#include <torch/nn/module.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <vector>

namespace fulgur {

namespace {

std::atomic<BlockHooks*> installed{nullptr};

// The random state a forward started from, so that its recomputation draws the same numbers
// (dropout masks): the CPU generator's, and the device's when the input lives on one.
struct RandomState {
  at::Tensor cpu;
  std::optional<c10::Device> device;
  at::Tensor device_state;

  static RandomState capture(const at::Tensor& input) {
    RandomState state;
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(cpu.mutex());
      state.cpu = cpu.get_state();
    }
    if (input.defined() && !input.device().is_cpu() && !input.device().is_meta()) {
      state.device = input.device();
      at::Generator generator = at::globalContext().defaultGenerator(*state.device);
      std::lock_guard<std::mutex> lock(generator.mutex());
      state.device_state = generator.get_state();
    }
    return state;
  }
  void restore() const {
    at::Generator cpu_generator = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(cpu_generator.mutex());
      cpu_generator.set_state(cpu);
    }
    if (device) {
      at::Generator generator = at::globalContext().defaultGenerator(*device);
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(device_state);
    }
  }
};

// The numeric context a forward ran in: autocast (enabled and dtype, per device type) and the
// default dtype (a "-true" precision sets it). Backward runs outside the precision's forward
// scope, so the recomputation restores it, as torch.utils.checkpoint does for autocast: otherwise
// a bf16-mixed block would be recomputed in float32 and its gradients would not be the forward's.
struct NumericContext {
  struct Autocast {
    c10::DeviceType device_type;
    bool enabled;
    at::ScalarType dtype;
  };
  std::vector<Autocast> autocast;
  caffe2::TypeMeta default_dtype;

  static NumericContext capture() {
    NumericContext context;
    // Every device type autocast knows (cpu, cuda, xpu, a PrivateUse1 backend, ...), not only
    // cpu and cuda: a plugin device's autocast region must be restored as well.
    for (c10::DeviceType type : at::autocast::_AUTOCAST_SUPPORTED_DEVICES)
      context.autocast.push_back(
          {type, at::autocast::is_autocast_enabled(type), at::autocast::get_autocast_dtype(type)});
    context.default_dtype = c10::get_default_dtype();
    return context;
  }
  void apply() const {
    for (const Autocast& a : autocast) {
      at::autocast::set_autocast_enabled(a.device_type, a.enabled);
      at::autocast::set_autocast_dtype(a.device_type, a.dtype);
    }
    c10::set_default_dtype(default_dtype);
  }
};

// While it lives, `context` is current (nested into autocast as a region of its own); then the
// one it replaced is back, and the cast cache goes with the outermost autocast region.
class NumericScope {
 public:
  explicit NumericScope(const NumericContext& context) : previous_(NumericContext::capture()) {
    context.apply();
    at::autocast::increment_nesting();
  }
  ~NumericScope() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    previous_.apply();
  }
  NumericScope(const NumericScope&) = delete;
  NumericScope& operator=(const NumericScope&) = delete;

 private:
  NumericContext previous_;
};

// What backward needs besides tensors, carried in the autograd context as a capsule.
struct Recompute : torch::CustomClassHolder {
  BlockForward forward;
  RandomState random;
  NumericContext numerics;
  // The parameters as the call passed them: plain references, not saved variables, because a
  // sharded strategy frees and gathers their storage between forward and backward.
  std::vector<at::Tensor> parameters;
};

// forward(input, parameters...) without keeping activations; backward runs the block again with
// gradients on and differentiates that run. The parameters are inputs of the function only so that
// its output requires a gradient whenever they do (the first block's input usually does not), and
// so that their gradients reach them through this node.
struct CheckpointedBlock : torch::autograd::Function<CheckpointedBlock> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, at::TensorList parameters,
                            c10::intrusive_ptr<Recompute> recompute) {
    recompute->random = RandomState::capture(input);
    recompute->numerics = NumericContext::capture();
    recompute->parameters = parameters.vec();
    ctx->save_for_backward({input});
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(recompute);
    const BlockForward& run = recompute->forward;
    return run(input);  // autograd is off inside a Function's forward: nothing is kept
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const at::Tensor saved_input = ctx->get_saved_variables()[0];
    // The parameters come back through the node's inputs: their edges are the gradients to return.
    // One gradient per argument of forward: the input, each parameter, none for the capsule.
    torch::autograd::variable_list result(1 + recompute->parameters.size() + 1);

    at::Tensor input = saved_input.detach();
    input.requires_grad_(saved_input.requires_grad());
    // The block runs again from the random state of its first run; the caller's state is kept.
    const RandomState caller = RandomState::capture(input);
    recompute->random.restore();
    at::Tensor output;
    {
      torch::AutoGradMode enable(true);
      const NumericScope numerics(recompute->numerics);
      output = recompute->forward(input);
    }
    caller.restore();
    if (!output.requires_grad()) return result;
    // Differentiate the recomputation with respect to the input and every parameter that the
    // original call passed in (the same list, in the same order).
    torch::autograd::variable_list wrt;
    std::vector<size_t> slots;
    if (input.requires_grad()) {
      wrt.push_back(input);
      slots.push_back(0);
    }
    const auto& parameters = recompute->parameters;
    for (size_t i = 0; i < parameters.size(); ++i)
      if (parameters[i].requires_grad()) {
        wrt.push_back(parameters[i]);
        slots.push_back(1 + i);
      }
    if (wrt.empty()) return result;
    const auto grads = torch::autograd::grad({output}, wrt, {grad_outputs[0]}, /*retain_graph=*/false,
                                             /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t i = 0; i < grads.size(); ++i) result[slots[i]] = grads[i];
    return result;
  }
};

}  // namespace

BlockHooks::~BlockHooks() = default;

void install_block_hooks(BlockHooks* hooks) { installed.store(hooks); }
void remove_block_hooks(BlockHooks* hooks) {
  BlockHooks* expected = hooks;
  installed.compare_exchange_strong(expected, nullptr);
}
BlockHooks* installed_block_hooks() { return installed.load(); }

at::Tensor run_block(torch::nn::Module& block, const at::Tensor& input, const BlockForward& forward,
                     const BlockOptions& options) {
  BlockForward body = forward;
  if (options.checkpoint_activations() && torch::GradMode::is_enabled()) {
    body = [&block, &forward](const at::Tensor& x) {
      auto recompute = c10::make_intrusive<Recompute>();
      recompute->forward = forward;
      const std::vector<at::Tensor> parameters = block.parameters();
      return CheckpointedBlock::apply(x, at::TensorList(parameters), recompute);
    };
  }
  if (BlockHooks* hooks = installed_block_hooks()) return hooks->run_block(block, input, body);
  return body(input);
}

void block_built(torch::nn::Module& block) {
  if (BlockHooks* hooks = installed_block_hooks()) hooks->block_built(block);
}

FullParameters::FullParameters(torch::nn::Module& module) : module_(module), hooks_(installed_block_hooks()) {
  if (hooks_) hooks_->gather_full_parameters(module_);
}

FullParameters::~FullParameters() {
  if (hooks_) hooks_->release_full_parameters(module_);
}

}  // namespace fulgur
