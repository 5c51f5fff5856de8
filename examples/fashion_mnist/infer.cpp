// fashion_mnist_infer: serves Fulgur-trained Fashion-MNIST weights without the Trainer, the way a
// production program would: the model class and the weights, nothing else. Two routes:
//   eager  the example's own C++ class (fashion_mnist_nets.h) with the weights loaded into it;
//   aoti   an AOTInductor package that Python exported once (python/deploy.py aoti), with the
//          trained weights swapped in by the package's own constant names.
//
//   fashion_mnist_infer --model fashion_mnist_cnn --weights model.safetensors \
//       --data /usr/share/datasets/fashion-mnist --count 1000 --out logits.safetensors [--aoti model.pt2]
//
// It prints the accuracy on the first `count` test images and writes their logits (tensor
// "logits", [count, 10]) to --out, for comparison with `fulgur predict`.
#include "fashion_mnist_nets.h"

#include <fulgur/error.h>
#include <fulgur/weights.h>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace ex = fulgur::examples;

namespace {

struct Args {
  std::string model = "fashion_mnist_cnn";
  std::string weights;
  std::string data = "/usr/share/datasets/fashion-mnist";
  int64_t count = 10000;
  int64_t batch_size = 64;
  std::string out;
  std::string aoti;
};

constexpr const char* kUsage =
    "usage: fashion_mnist_infer --weights FILE [--model fashion_mnist_cnn|fashion_mnist_mlp] [--data DIR]\n"
    "                           [--count N] [--batch_size N] [--out logits.safetensors] [--aoti model.pt2]\n"
    "  --weights     a Fulgur checkpoint (.ckpt), a state dict (.pt) or a .safetensors file\n"
    "  --aoti        run this AOTInductor package (python/deploy.py aoti) with the weights swapped in\n";

Args parse_args(int argc, char** argv) {
  Args args;
  std::map<std::string, std::string*> strings = {{"--model", &args.model},
                                                 {"--weights", &args.weights},
                                                 {"--data", &args.data},
                                                 {"--out", &args.out},
                                                 {"--aoti", &args.aoti}};
  std::map<std::string, int64_t*> numbers = {{"--count", &args.count}, {"--batch_size", &args.batch_size}};
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i], value;
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (const auto eq = flag.find('='); eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      throw fulgur::Error(fulgur::ErrorKind::config, fmt::format("{} needs a value\n{}", flag, kUsage));
    }
    if (auto s = strings.find(flag); s != strings.end()) {
      *s->second = value;
    } else if (auto n = numbers.find(flag); n != numbers.end()) {
      char* end = nullptr;
      *n->second = std::strtoll(value.c_str(), &end, 10);
      if (end == value.c_str() || *end != '\0' || *n->second < 1)
        throw fulgur::Error(fulgur::ErrorKind::config,
                            fmt::format("{}={}: expected a positive whole number", flag, value));
    } else {
      throw fulgur::Error(fulgur::ErrorKind::config, fmt::format("unknown flag '{}'\n{}", flag, kUsage));
    }
  }
  if (args.weights.empty())
    throw fulgur::Error(fulgur::ErrorKind::config, fmt::format("--weights is required\n{}", kUsage));
  return args;
}

std::shared_ptr<ex::FashionMnistClassifier> make_net(const std::string& name) {
  if (name == "fashion_mnist_cnn") return std::make_shared<ex::FashionMnistCnn>(fulgur::Options{});
  if (name == "fashion_mnist_mlp") return std::make_shared<ex::FashionMnistMlp>(fulgur::Options{});
  throw fulgur::Error(fulgur::ErrorKind::config,
                      fmt::format("unknown model '{}': use fashion_mnist_cnn or fashion_mnist_mlp", name));
}

// The AOTInductor route: the package's constants are named internally ("conv1_weight"); its runner
// maps them to the exporting module's names, which are the C++ class's too. Every constant must be
// replaced (validate_full_updates): a package exported without always_keep_tensor_constants has
// biases folded into its kernels, and a partial swap would serve half-trained weights silently.
std::function<at::Tensor(const at::Tensor&)> aoti_forward(const std::string& package,
                                                          const fulgur::TensorMap& trained) {
  auto loader = std::make_shared<torch::inductor::AOTIModelPackageLoader>(package);
  std::unordered_map<std::string, at::Tensor> constants;
  std::vector<std::string> missing;
  for (const auto& [internal, fqn] : loader->get_runner()->getConstantNamesToOriginalFQNs()) {
    const auto found = trained.find(fqn);
    if (found == trained.end())
      missing.push_back(fqn);
    else
      constants.emplace(internal, found->second.contiguous());
  }
  if (!missing.empty())
    throw fulgur::Error(fulgur::ErrorKind::checkpoint,
                        fmt::format("{}: the package has constants the weights lack: {} (was it exported from "
                                    "another model?)",
                                    package, fmt::join(missing, ", ")));
  if (constants.size() != trained.size())
    throw fulgur::Error(fulgur::ErrorKind::checkpoint,
                        fmt::format("{}: {} of the {} weights are constants of the package: export it with "
                                    "torch._inductor.config.always_keep_tensor_constants = True (python/deploy.py "
                                    "aoti does)",
                                    package, constants.size(), trained.size()));
  loader->update_constant_buffer(constants, /*use_inactive=*/false, /*validate_full_updates=*/true);
  return [loader](const at::Tensor& images) { return loader->run({images}).at(0); };
}

int run(const Args& args) {
  const ex::FashionMnistSplit test = ex::load_fashion_mnist(args.data, /*train=*/false);
  const int64_t count = std::min(args.count, test.images.size(0));
  std::function<at::Tensor(const at::Tensor&)> forward;
  if (args.aoti.empty()) {
    auto net = make_net(args.model);
    fulgur::load_weights(*net, args.weights);  // strict: every key of the class, nothing else
    net->eval();
    forward = [net](const at::Tensor& images) { return net->forward(images); };
  } else {
    forward = aoti_forward(args.aoti, fulgur::read_weights(args.weights));
  }
  c10::InferenceMode inference;
  std::vector<at::Tensor> logits;
  // Batches as `fulgur predict` forms them, so the two compute the same sums in the same order.
  for (int64_t start = 0; start < count; start += args.batch_size)
    logits.push_back(forward(test.images.narrow(0, start, std::min(args.batch_size, count - start))));
  const at::Tensor all = at::cat(logits);
  const double accuracy = all.argmax(1).eq(test.labels.narrow(0, 0, count)).to(at::kFloat).mean().item<double>();
  std::cout << fmt::format("{} test images, {} ({}): accuracy {:.4f}\n", count, args.model,
                           args.aoti.empty() ? "eager" : "aoti " + args.aoti, accuracy);
  if (!args.out.empty()) {
    fulgur::save_safetensors({{"logits", all.contiguous()}}, args.out);
    std::cout << "logits: " << args.out << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const fulgur::Error& e) {
    std::cerr << "fashion_mnist_infer: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fashion_mnist_infer: " << e.what() << "\n";
    return 1;
  }
}
