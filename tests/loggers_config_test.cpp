// Choosing loggers from the user's side (issue #42 items 7 and 8): `[trainer] logger = false`
// means no logging at all, as in Lightning; `logger = "..."` selects the plugin in [[loggers]] so
// that the csv / tensorboard `name` option can be set; `--loggers=[]` clears the list.
#include "tabular_example.h"

#include <doctest/doctest.h>

namespace {

using namespace fulgur::test;
using namespace fulgur::test::tabular;

// The iris run in `dir` (runs under dir/runs), with `trainer_extra` and `extra`.
fs::path write_run(const TempDir& dir, const std::string& trainer_extra, const std::string& extra) {
  write_bytes(dir / "run.toml", iris_toml(kIris.string(), 1, trainer_extra, extra));
  return dir / "run.toml";
}

}  // namespace

TEST_CASE("[trainer] logger = false turns every [[loggers]] entry off, as Lightning's logger=False") {
  TempDir dir;
  const fs::path toml =
      write_run(dir, "logger = false\n", "[[loggers]]\nlogger = \"csv\"\n\n[[loggers]]\nname = \"tensorboard\"\n");
  const ProcessRun run = run_fulgur(dir.path(), {"fit", "--config", toml.string()});
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  CHECK_MESSAGE(find_files(dir / "runs", "metrics.csv").empty(), run.output);
  CHECK_MESSAGE(find_files(dir / "runs", "events.out").empty(), run.output);
  FULGUR_CHECK_CONTAINS(run.output, "logger = false: the 2 [[loggers]] entries write nothing");
  // And back on from the command line, without editing the file.
  const ProcessRun on = run_fulgur(dir.path(), {"fit", "--config", toml.string(), "--trainer.logger=true"});
  REQUIRE_MESSAGE(on.exit_code == 0, on.output);
  CHECK(find_files(dir / "runs", "metrics.csv").size() == 1);
}

TEST_CASE("[[loggers]] logger = \"csv\" selects the plugin, so the csv logger's own name can be set") {
  TempDir dir;
  const fs::path toml =
      write_run(dir, "", "[[loggers]]\nlogger = \"csv\"\nname = \"exp1\"\nversion = 3\nflush_logs_every_n_steps = 1\n");
  const ProcessRun run = run_fulgur(dir.path(), {"fit", "--config", toml.string()});
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  const fs::path version = dir / "runs" / "exp1" / "version_3";
  CHECK(fs::exists(version / "metrics.csv"));
  // The saved config selects with `logger` and keeps the name; it loads back as the same run.
  const std::string saved = read_bytes(version / "config.toml");
  FULGUR_CHECK_CONTAINS(saved, "[[loggers]]\nlogger = \"csv\"\n");
  FULGUR_CHECK_CONTAINS(saved, "name = \"exp1\"\n");
  write_bytes(dir / "saved.toml", saved);
  const ProcessRun check = run_fulgur(dir.path(), {"config", "check", (dir / "saved.toml").string()});
  CHECK_MESSAGE(check.exit_code == 0, check.output);

  // An override addresses the entry by the plugin it selects.
  const ProcessRun flag = run_fulgur(dir.path(), {"fit", "--config", toml.string(), "--loggers.csv.version=4"});
  REQUIRE_MESSAGE(flag.exit_code == 0, flag.output);
  CHECK(fs::exists(dir / "runs" / "exp1" / "version_4" / "metrics.csv"));

  // The old spelling, `name` selecting the plugin, still runs (with Lightning's default name).
  TempDir old;
  const ProcessRun old_run =
      run_fulgur(old.path(), {"fit", "--config", write_run(old, "", "[[loggers]]\nname = \"csv\"\n").string()});
  REQUIRE_MESSAGE(old_run.exit_code == 0, old_run.output);
  CHECK(fs::exists(old / "runs" / "lightning_logs" / "version_0" / "metrics.csv"));

  // `name = "exp1"` alone, meant as the experiment name, is told the new spelling.
  TempDir meant;
  const ProcessRun wrong =
      run_fulgur(meant.path(), {"fit", "--config", write_run(meant, "", "[[loggers]]\nname = \"exp1\"\n").string()});
  CHECK(wrong.exit_code != 0);
  FULGUR_CHECK_CONTAINS(wrong.output, "write logger = \"csv\" and name = \"exp1\"");
}

TEST_CASE("--loggers=[] clears the files' [[loggers]]: no logger runs, not even the default one") {
  TempDir dir;
  const fs::path toml = write_run(dir, "",
                                  "[[loggers]]\nlogger = \"csv\"\n\n[[callbacks]]\nname = \"model_checkpoint\"\n"
                                  "dirpath = \"ckpts\"\n");
  const ProcessRun run = run_fulgur(dir.path(), {"fit", "--config", toml.string(), "--loggers=[]"});
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  CHECK_MESSAGE(find_files(dir / "runs", "metrics.csv").empty(), run.output);
  CHECK(!find_files(dir / "ckpts", ".ckpt").empty());  // the callbacks stay
  const auto saved = find_files(dir / "runs", "config.toml");
  REQUIRE(saved.size() == 1);
  FULGUR_CHECK_CONTAINS(read_bytes(saved[0]), "loggers = []");

  // --callbacks=[] clears that list the same way.
  TempDir other;
  const fs::path toml2 = write_run(other, "", "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"ckpts\"\n");
  const ProcessRun cleared = run_fulgur(other.path(), {"fit", "--config", toml2.string(), "--callbacks=[]"});
  REQUIRE_MESSAGE(cleared.exit_code == 0, cleared.output);
  CHECK(find_files(other / "ckpts", ".ckpt").empty());

  // Anything but a list is told how to write it.
  const ProcessRun wrong = run_fulgur(dir.path(), {"fit", "--config", toml.string(), "--loggers=csv"});
  CHECK(wrong.exit_code != 0);
  FULGUR_CHECK_CONTAINS(wrong.output, "--loggers=[] removes every [[loggers]] entry");
}
