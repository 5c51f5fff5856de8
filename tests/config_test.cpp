// The TOML config: structure checks (parse_config) and plugin tables checked against the schemas
// in the plugins' notes (validate_plugins). Every error must be ErrorKind::config and say where.
#include "test_support.h"

#include <fulgur/callback.h>
#include <fulgur/config.h>
#include <fulgur/option_spec.h>
#include <fulgur/registry/registry.h>

namespace fulgur {
namespace {

using test::error_from;
using test::fixture;
using test::TempDir;
namespace fs = std::filesystem;

// The config file name used in messages; it need not exist for parse_config.
const fs::path kFile = "/cfg/run.toml";

Error config_error(std::string_view text) {
  return error_from([&] { parse_config(text, kFile); });
}

// Selects the stub accelerator/strategy/precision of the stack fixture, so a config validates
// against fixtures only.
constexpr std::string_view kStubs =
    "[trainer]\n"
    "accelerator = \"stub\"\n"
    "strategy = \"stub\"\n"
    "precision = \"stub\"\n";

// A registry over a private copy of the fixtures that config tests select.
struct FixtureRegistry {
  TempDir dir;
  std::unique_ptr<PluginRegistry> registry;
  FixtureRegistry() {
    test::copy_library(fixture("libfulgur-fixture-good.so"), dir / "libfulgur-fixture-good.so");
    test::copy_library(fixture("libfulgur-fixture-stack.so"), dir / "libfulgur-fixture-stack.so");
    registry = std::make_unique<PluginRegistry>(std::vector<SearchDirectory>{{dir.path(), "config"}});
  }
};

Config validated(const FixtureRegistry& fixtures, std::string_view extra) {
  Config config = parse_config(std::string(kStubs) + std::string(extra), kFile);
  validate_plugins(config, *fixtures.registry);
  return config;
}

Error validation_error(const FixtureRegistry& fixtures, std::string_view extra) {
  return error_from([&] { validated(fixtures, extra); });
}

}  // namespace

TEST_CASE("an empty config gets the documented defaults") {
  Config config = parse_config("", kFile);
  CHECK(config.accelerator.name == "cpu");
  CHECK(config.strategy.name == "single_device");
  CHECK(config.precision.name == "32-true");
  CHECK(config.trainer.get_int("max_epochs") == 1000);  // Lightning's max_epochs = None without max_steps
  CHECK(config.trainer.get_float("limit_train_batches") == 1.0);
  CHECK(fs::path(config.trainer.get_string("default_root_dir")).lexically_relative("/cfg") == ".");  // the TOML's dir
  CHECK(config.loggers.empty());
  CHECK(config.callbacks.empty());
  CHECK_FALSE(config.profiler.has_value());
  CHECK(config.selections().size() == 3);
}

TEST_CASE("a full config is read into typed values") {
  Config config = parse_config(R"(
[plugins]
paths = ["plugins", "/abs/plugins"]
allow_writable = true

[trainer]
accelerator = "cpu"
max_epochs = 3
devices = 2
limit_val_batches = 10
gradient_clip_val = 0.5
deterministic = true

[accelerator]
threads = 4

[[callbacks]]
name = "a"
x = 1

[[callbacks]]
name = "b"

[[loggers]]
name = "csv"

[profiler]
name = "simple"

[model]
hidden = [64, 32]
lr = 0.001
act = "relu"

[logging]
level = "debug"
)",
                               kFile);
  REQUIRE(config.plugin_paths.size() == 2);
  CHECK(config.plugin_paths[0] == "/cfg/plugins");
  CHECK(config.plugin_paths[1] == "/abs/plugins");
  CHECK(config.allow_writable_plugins);
  CHECK(config.trainer.get_int("max_epochs") == 3);
  CHECK(config.trainer.get_string("devices") == "2");  // a count is accepted for the string option
  CHECK(config.trainer.get_float("gradient_clip_val") == 0.5);
  CHECK(config.trainer.get_string("deterministic") == "true");  // the key also takes "warn"
  // An integer for a float option is accepted and keeps meaning "a count of batches".
  CHECK(std::get<int64_t>(config.trainer.values().at("limit_val_batches")) == 10);
  CHECK(config.trainer.get_float("limit_val_batches") == 10.0);
  REQUIRE(config.accelerator.raw.size() == 1);
  CHECK(config.accelerator.raw[0].key == "threads");
  REQUIRE(config.callbacks.size() == 2);
  CHECK(config.callbacks[0].name == "a");
  CHECK(config.callbacks[0].where.str() == "/cfg/run.toml:18:8");
  CHECK(config.callbacks[1].name == "b");
  REQUIRE(config.loggers.size() == 1);
  REQUIRE(config.profiler.has_value());
  CHECK(config.profiler->name == "simple");
  CHECK(config.model.get_float_list("hidden") == std::vector<double>{64, 32});
  CHECK(config.model.get_string("act") == "relu");
  CHECK(config.log_level == "debug");
  CHECK(config.selections().size() == 7);
}

TEST_CASE("bad TOML syntax is reported with line and column") {
  Error e = config_error("[trainer]\nmax_epochs = = 3\n");
  CHECK(e.kind() == ErrorKind::config);
  FULGUR_CHECK_CONTAINS(e.what(), "/cfg/run.toml:2:");
  FULGUR_CHECK_CONTAINS(e.what(), "invalid TOML");
}

TEST_CASE("an unknown table is named with its location and a suggestion") {
  Error e = config_error("[trainer]\nmax_epochs = 1\n\n[trainr]\nx = 1\n");
  CHECK(e.kind() == ErrorKind::config);
  FULGUR_CHECK_CONTAINS(e.what(), "/cfg/run.toml:4:1: unknown table 'trainr'; did you mean 'trainer'?");
}

TEST_CASE("an unknown trainer key is named with its location and a suggestion") {
  Error e = config_error("[trainer]\nmax_epoch = 3\n");
  CHECK(e.kind() == ErrorKind::config);
  FULGUR_CHECK_CONTAINS(e.what(),
                        "/cfg/run.toml:2:13: unknown key 'max_epoch' for [trainer]; did you mean 'max_epochs'?");
}

TEST_CASE("a trainer value of the wrong type names the expected and the found type") {
  Error e = config_error("[trainer]\nmax_epochs = \"ten\"\n");
  CHECK(e.kind() == ErrorKind::config);
  FULGUR_CHECK_CONTAINS(e.what(), "/cfg/run.toml:2:14: [trainer]: 'max_epochs' must be integer, found string");
  FULGUR_CHECK_CONTAINS(e.what(), "(default: 1000)");
}

TEST_CASE("structural mistakes are config errors with a location") {
  SUBCASE("[[callbacks]] without a name") {
    Error e = config_error("[[callbacks]]\nmonitor = \"loss\"\n");
    CHECK(e.kind() == ErrorKind::config);
    FULGUR_CHECK_CONTAINS(e.what(), "/cfg/run.toml:1:");
    FULGUR_CHECK_CONTAINS(e.what(), "[[callbacks]] needs a name");
  }
  SUBCASE("[trainer] that is not a table") {
    Error e = config_error("trainer = 3\n");
    CHECK(e.kind() == ErrorKind::config);
    FULGUR_CHECK_CONTAINS(e.what(), "/cfg/run.toml:1:11: 'trainer' must be a table");
  }
  SUBCASE("callbacks that are not an array of tables") {
    Error e = config_error("callbacks = \"x\"\n");
    FULGUR_CHECK_CONTAINS(e.what(), "'callbacks' must be an array of tables");
  }
  SUBCASE("an unknown [plugins] key") {
    Error e = config_error("[plugins]\npath = [\"x\"]\n");
    FULGUR_CHECK_CONTAINS(e.what(), "/cfg/run.toml:2:8: unknown key 'path' for [plugins]; did you mean 'paths'?");
  }
  SUBCASE("[accelerator] name contradicting [trainer]") {
    Error e = config_error("[trainer]\naccelerator = \"cpu\"\n[accelerator]\nname = \"cuda\"\n");
    FULGUR_CHECK_CONTAINS(e.what(),
                          "/cfg/run.toml:4:8: [accelerator] name = \"cuda\" contradicts [trainer] accelerator");
  }
  SUBCASE("a nested table in [model]") {
    Error e = config_error("[model]\nsub = { a = 1 }\n");
    FULGUR_CHECK_CONTAINS(e.what(), "/cfg/run.toml:2:7: [model]: 'sub' is a table");
  }
}

TEST_CASE("a missing config file is a config error naming the path") {
  Error e = error_from([] { load_config("/nonexistent/fulgur.toml"); });
  CHECK(e.kind() == ErrorKind::config);
  FULGUR_CHECK_CONTAINS(e.what(), "/nonexistent/fulgur.toml: cannot open the config file");
}

TEST_CASE("load_config reads the file and reports locations in it") {
  TempDir dir;
  const fs::path file = dir / "run.toml";
  test::write_bytes(file, "[trainer]\nmax_epochs = 2\n[plugins]\npaths = [\"p\"]\n");
  Config config = load_config(file);
  CHECK(config.trainer.get_int("max_epochs") == 2);
  CHECK(config.plugin_paths.at(0) == dir / "p");
  test::write_bytes(file, "[trainer]\nmax_epochs = true\n");
  Error e = error_from([&] { load_config(file); });
  FULGUR_CHECK_CONTAINS(e.what(), file.string() + ":2:14:");
}

TEST_CASE("plugin tables are validated against the schema from the plugin's note") {
  FixtureRegistry fixtures;

  SUBCASE("valid options are typed and defaults filled in") {
    Config config =
        validated(fixtures, "[strategy]\nbucket_mb = 50\n[[callbacks]]\nname = \"fixture_good\"\nrepeat = 2\n");
    CHECK(config.strategy.options.get_int("bucket_mb") == 50);
    CHECK(config.precision.options.get_float("init_scale") == 65536.0);
    const Options& options = config.callbacks.at(0).options;
    CHECK(options.get_int("repeat") == 2);
    CHECK(options.get_string("greeting") == "hello");
    CHECK(options.get_float("scale") == 1.5);
    CHECK(options.get_string_list("tags").empty());
    CHECK(options.owner() == "callback 'fixture_good'");
  }
  SUBCASE("an integer where a float is expected is accepted") {
    Config config = validated(fixtures, "[[callbacks]]\nname = \"fixture_good\"\nrepeat = 2\nscale = 3\n");
    CHECK(config.callbacks.at(0).options.get_float("scale") == 3.0);
  }
  SUBCASE("an unknown key names its location and suggests the closest") {
    Error e = validation_error(fixtures, "[[callbacks]]\nname = \"fixture_good\"\nrepaet = 2\n");
    CHECK(e.kind() == ErrorKind::config);
    FULGUR_CHECK_CONTAINS(e.what(),
                          "/cfg/run.toml:7:10: unknown key 'repaet' for callback 'fixture_good'; did you mean "
                          "'repeat'?");
    FULGUR_CHECK_CONTAINS(e.what(), "Known keys: greeting, repeat, scale, tags.");
  }
  SUBCASE("an unknown key in a single-selection table") {
    Error e = validation_error(fixtures, "[strategy]\nbucket_md = 1\n");
    CHECK(e.kind() == ErrorKind::config);
    FULGUR_CHECK_CONTAINS(e.what(),
                          "/cfg/run.toml:6:13: unknown key 'bucket_md' for strategy 'stub'; did you mean "
                          "'bucket_mb'?");
  }
  SUBCASE("a key for a plugin that takes no options") {
    Error e = validation_error(fixtures, "[accelerator]\nthreads = 1\n");
    FULGUR_CHECK_CONTAINS(e.what(), "unknown key 'threads' for accelerator 'stub'");
    FULGUR_CHECK_CONTAINS(e.what(), "It accepts no options.");
  }
  SUBCASE("a wrong type names the expected and the found type") {
    Error e = validation_error(fixtures, "[[callbacks]]\nname = \"fixture_good\"\nrepeat = 2\ntags = [1, 2]\n");
    CHECK(e.kind() == ErrorKind::config);
    FULGUR_CHECK_CONTAINS(e.what(),
                          "/cfg/run.toml:8:8: callback 'fixture_good': 'tags' must be array of strings, "
                          "found array containing integer");
  }
  SUBCASE("a missing required key names the key, its type and its help") {
    Error e = validation_error(fixtures, "[[callbacks]]\nname = \"fixture_good\"\n");
    CHECK(e.kind() == ErrorKind::config);
    FULGUR_CHECK_CONTAINS(e.what(),
                          "/cfg/run.toml:6:8: callback 'fixture_good': required key 'repeat' (integer) is "
                          "missing: How often (required)");
  }
  SUBCASE("an unknown plugin name is plugin_not_found at the name's location") {
    Error e = validation_error(fixtures, "[[callbacks]]\nname = \"fixture_god\"\n");
    CHECK(e.kind() == ErrorKind::plugin_not_found);
    FULGUR_CHECK_CONTAINS(e.what(),
                          "/cfg/run.toml:6:8: no callback plugin named 'fixture_god'; did you mean "
                          "'fixture_good'?");
  }
}

TEST_CASE("validated options reach the plugin unchanged") {
  FixtureRegistry fixtures;
  Config config = validated(fixtures,
                            "[[callbacks]]\nname = \"fixture_good\"\nrepeat = 4\ngreeting = \"yo\"\n"
                            "tags = [\"x\"]\nscale = 2\n");
  const PluginSelection& sel = config.callbacks.at(0);
  PluginObject object = fixtures.registry->create(sel.kind, sel.name, sel.options);
  CHECK(plugin_cast<Callback>(object)->state_key() == "yo|4|2.000000|x");
}

}  // namespace fulgur

TEST_CASE("#42.16 with_defaults: an unknown key ends its sentence before the list of known keys") {
  const fulgur::OptionSpec schema[] = {FULGUR_OPTION(integer, repeat, "Times", 1),
                                       FULGUR_OPTION(string, greeting, "Text", "hi")};
  fulgur::Options given("callback 'x'");
  given.set("zzzzzzzz", int64_t{1});
  try {
    (void)fulgur::with_defaults(given, schema, "callback 'x'");
    FAIL("accepted an unknown key");
  } catch (const fulgur::Error& e) {
    FULGUR_CHECK_CONTAINS(e.what(), "callback 'x': unknown key 'zzzzzzzz'. Known keys: repeat, greeting.");
  }
  given = fulgur::Options("callback 'x'");
  given.set("repaet", int64_t{1});
  try {
    (void)fulgur::with_defaults(given, schema, "callback 'x'");
    FAIL("accepted an unknown key");
  } catch (const fulgur::Error& e) {
    FULGUR_CHECK_CONTAINS(e.what(), "unknown key 'repaet'; did you mean 'repeat'? Known keys: repeat, greeting.");
  }
}
