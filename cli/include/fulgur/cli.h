// Whole runs from the command line (Lightning's LightningCLI):
//
//   fulgur fit --config run.toml [--config more.toml] [--trainer.max_epochs=3] [--model.lr=3e-4]
//              [--ckpt_path=last] [--print-config] [--help]
//   fulgur validate | test | predict   (the same flags)
//
// Precedence: schema defaults < config files in order < flags. `--print-config` prints the merged,
// defaulted TOML and exits; every run writes that TOML as config.toml into its log directory, and
// feeding it back reproduces the run.
//
// The `fulgur` executable takes the model and the datamodule from plugins named in [model] / [data].
// A program that links its own classes gets the same command line in one call:
//
//   int main(int argc, char** argv) { return fulgur::cli_main<MyModel, MyData>(argc, argv); }
//
// where each class declares its hyperparameters as a typed FULGUR_OPTIONS struct `Options`
// (fulgur/plugin_options.h) and takes it in its constructor, or is constructible from
// `const fulgur::Options&` and may declare `static constexpr auto hparams_schema =
// fulgur::option_schema(...)` (fulgur/option_spec.h): [model] / [data] are then checked and
// defaulted against that schema exactly as a plugin's table is; without one they are free-form.
#pragma once

#include <fulgur/option_spec.h>
#include <fulgur/options.h>
#include <fulgur/plugin_options.h>
#include <fulgur/registry/metadata.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace fulgur {

class Module;
class DataModule;

// What a program brings to the command line. Empty factories: [model] / [data] name plugins.
struct CliApp {
  std::string program = "fulgur";  // in usage and error lines
  std::function<std::shared_ptr<Module>(const Options&)> make_model;
  std::function<std::shared_ptr<DataModule>(const Options&)> make_data;
  std::optional<std::vector<OptionSchema>> model_schema;  // nullopt: free-form [model]
  std::optional<std::vector<OptionSchema>> data_schema;
  std::string model_type;  // how messages name the program's classes (empty: by their table)
  std::string data_type;
};

// Runs `PROGRAM SUBCOMMAND ...` (argv[1] is the subcommand). Returns the exit status: 0, 1 for a
// failed run, 2 for bad input (nothing was started). Errors are printed as one line.
int run_cli(int argc, char** argv, const CliApp& app);

// True for the subcommands run_cli handles (the `fulgur` executable dispatches on it).
bool is_run_subcommand(std::string_view word);

// The typed schema of constexpr option specs (defaults parsed from their TOML text).
std::vector<OptionSchema> schema_from_specs(const OptionSpec* specs, size_t count);

namespace detail {
template <class T>
std::optional<std::vector<OptionSchema>> hparams_schema_of() {
  if constexpr (HasTypedOptions<T>)
    return schema_from_specs(T::Options::schema.data(), T::Options::schema.size());
  else if constexpr (requires { T::hparams_schema; })
    return schema_from_specs(T::hparams_schema.data(), T::hparams_schema.size());
  else
    return std::nullopt;
}
// T from the checked [model] / [data] table: its typed Options filled in, or the table itself.
template <class T, class Interface>
std::shared_ptr<Interface> make_from_hparams(const Options& hp) {
  if constexpr (HasTypedOptions<T>)
    return std::make_shared<T>(T::Options::from(hp));
  else
    return std::make_shared<T>(hp);
}
}  // namespace detail

template <class ModelT, class DataT>
int cli_main(int argc, char** argv) {
  CliApp app;
  app.program = argc > 0 && argv[0] ? argv[0] : "fulgur";
  app.make_model = [](const Options& hp) { return detail::make_from_hparams<ModelT, Module>(hp); };
  app.make_data = [](const Options& hp) { return detail::make_from_hparams<DataT, DataModule>(hp); };
  app.model_schema = detail::hparams_schema_of<ModelT>();
  app.data_schema = detail::hparams_schema_of<DataT>();
  return run_cli(argc, argv, app);
}

}  // namespace fulgur
