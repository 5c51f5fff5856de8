// The mlflow logger against a real tracking server: `mlflow server` (pinned in
// scripts/requirements.txt) on a free port with a SQLite store and proxied artifacts in a temporary
// directory, the shipped fashion_mnist program trained from TOML with the mlflow and csv loggers
// side by side, and every value read back through MLflow's own Python client and compared with
// what the csv logger wrote: metrics (every step), params, tags, run name, status and the uploaded
// checkpoints (byte for byte). A server killed mid-run and restarted loses no value; one that
// never comes back costs no checkpoint and leaves the undelivered values on disk.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "test_support.h"
#include "training_job.h"

namespace {

namespace fs = std::filesystem;
namespace job = fulgur::test::job;
using fulgur::test::contains;
using fulgur::test::ProcessRun;
using fulgur::test::TempDir;

// The venv's mlflow next to its python; the suite skips (CTest: Skipped) where it is missing,
// which scripts/setup.sh prevents.
fs::path mlflow_executable() { return fs::path(FULGUR_TEST_PYTHON).parent_path() / "mlflow"; }

bool mlflow_missing() {
  if (fs::exists(mlflow_executable())) return false;
  fulgur::test::skip_test(mlflow_executable().string() + " is missing; scripts/setup.sh installs it");
  return true;
}

// A port nobody listens on right now (the kernel's pick for port 0).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  socklen_t length = sizeof address;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  ::close(fd);
  return ntohs(address.sin_port);
}

// True when GET /health on 127.0.0.1:port answers 200 (plain sockets: the test needs no HTTP library).
bool healthy(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string answer;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) {
    const std::string request = "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size())) {
      char buffer[256];
      const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
      if (n > 0) answer.assign(buffer, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  return answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200");
}

// `mlflow server` in its own session, so that killing it also kills the uvicorn worker it forks.
class MlflowServer {
 public:
  MlflowServer(const TempDir& dir, int port) : dir_(dir), port_(port) { start(); }
  ~MlflowServer() { kill(); }
  MlflowServer(const MlflowServer&) = delete;
  MlflowServer& operator=(const MlflowServer&) = delete;

  std::string uri() const { return fmt::format("http://127.0.0.1:{}", port_); }

  void start() {
    const fs::path log = dir_ / fmt::format("mlflow-server-{}.log", starts_++);
    // The background job runner is off: it is for MLflow's GenAI jobs and only slows the start.
    pid_ = fulgur::test::spawn_process(
        {"/usr/bin/setsid", mlflow_executable().string(), "server", "--backend-store-uri",
         "sqlite:///" + (dir_ / "mlflow.db").string(), "--artifacts-destination", (dir_ / "artifacts").string(),
         "--host", "127.0.0.1", "--port", std::to_string(port_), "--workers", "1"},
        {{"MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false"}}, dir_.path(), log);
    // A safety net, not a measurement: the first start creates the database (~15 s on a busy machine).
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(180);
    while (!healthy(port_)) {
      int status = 0;
      REQUIRE_MESSAGE(::waitpid(pid_, &status, WNOHANG) == 0, "mlflow server exited before answering:\n"
                                                                  << fulgur::test::read_bytes(log));
      REQUIRE_MESSAGE(std::chrono::steady_clock::now() < until, "mlflow server did not answer:\n"
                                                                    << fulgur::test::read_bytes(log));
      timespec pause{0, 100'000'000};
      ::nanosleep(&pause, nullptr);
    }
  }

  // SIGKILL to the whole session (the server and its workers): the server vanishes mid-request.
  void kill() {
    if (pid_ <= 0) return;
    ::kill(-pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    // The worker is killed too but reaped by init; wait until the port is free again.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (healthy(port_) && std::chrono::steady_clock::now() < until) {
      timespec pause{0, 50'000'000};
      ::nanosleep(&pause, nullptr);
    }
  }

 private:
  const TempDir& dir_;
  int port_;
  pid_t pid_ = -1;
  int starts_ = 0;
};

// The fashion_mnist job: `epochs` x `batches`, log_every_n_steps = 5, the mlflow logger (first,
// so model_checkpoint's default dirpath is its run directory) with `mlflow_options`, the csv
// logger as the reference, and `extra` (callbacks).
std::string job_toml(const TempDir& dir, int epochs, int batches, const std::string& mlflow_options,
                     const std::string& extra) {
  return job::toml(dir.path(), dir.subdir("plugins"), epochs, batches, "",
                   "[[loggers]]\nname = \"mlflow\"\n" + mlflow_options + "\n[[loggers]]\nname = \"csv\"\n" + extra);
}

// Reads the run back with MlflowClient and compares it with the csv logger's files. Arguments:
// tracking URI, experiment, the csv run directory, the checkpoint directory ("" = the mlflow run's
// <log_dir>/checkpoints under `root`), root. `checks` is more Python, run with `run`, `client`.
constexpr const char* kReadBack = R"(
import csv, hashlib, math, os, sys, tempfile
from mlflow.tracking import MlflowClient
uri, experiment, csv_dir, ckpt_dir, root = sys.argv[1:6]
client = MlflowClient(tracking_uri=uri)
exp = client.get_experiment_by_name(experiment)
assert exp is not None, "experiment %s was not created" % experiment
runs = client.search_runs([exp.experiment_id])
assert len(runs) == 1, runs
run = runs[0]
rid = run.info.run_id
assert run.info.status == "FINISHED", run.info.status

# Every metric value of every step, against metrics.csv (the same rows, same doubles).
expected = {}
for row in csv.DictReader(open(os.path.join(csv_dir, "metrics.csv"))):
    for key, value in row.items():
        if key != "step" and value != "":
            expected.setdefault(key, []).append((int(row["step"]), float(value)))
got = {key: [(m.step, m.value) for m in client.get_metric_history(rid, key)] for key in run.data.metrics}
assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
for key in expected:
    assert sorted(got[key]) == sorted(expected[key]), (key, sorted(got[key]), sorted(expected[key]))
assert sum(len(v) for v in expected.values()) >= 10, expected

# Params: every hyperparameter hparams.yaml holds (the module's and the data's), strings without
# their TOML quotes, and the trainer's and plugins' keys, which hparams.yaml leaves out (#42.10).
hparams = dict(line.rstrip("\n").split(": ", 1) for line in open(os.path.join(csv_dir, "hparams.yaml")))
assert hparams and all(k.startswith(("model.", "data.")) for k in hparams), sorted(hparams)
assert sorted(k for k in run.data.params if k.startswith(("model.", "data."))) == sorted(hparams), (
    sorted(run.data.params), sorted(hparams))
assert run.data.params["model.arch"] == "mlp", run.data.params["model.arch"]
assert "trainer.limit_train_batches" in run.data.params, sorted(run.data.params)

# The checkpoints, byte for byte, under checkpoints/ in the run's artifacts.
if not ckpt_dir:
    ckpt_dir = os.path.join(root, "mlruns", exp.experiment_id, rid, "checkpoints")
local = {f: hashlib.sha256(open(os.path.join(ckpt_dir, f), "rb").read()).hexdigest()
         for f in os.listdir(ckpt_dir) if f.endswith(".ckpt")}
uploaded = {}
for a in client.list_artifacts(rid, "checkpoints"):
    path = client.download_artifacts(rid, a.path, tempfile.mkdtemp())
    uploaded[os.path.basename(a.path)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
assert "last.ckpt" in local, local
assert uploaded == local, (uploaded, local)
)";

void read_back(const TempDir& dir, const MlflowServer& server, const std::string& experiment, const fs::path& ckpt_dir,
               const std::string& checks) {
  const fs::path script = dir / "read_back.py";
  std::ofstream(script) << kReadBack << checks << "\nprint(\"python-ok\")\n";
  const ProcessRun run = fulgur::test::run_process(
      {FULGUR_TEST_PYTHON, script.string(), server.uri(), experiment,
       (dir / "runs" / "lightning_logs" / "version_0").string(), ckpt_dir.string(), (dir / "runs").string()},
      {{"MLFLOW_TRACKING_URI", ""}}, dir.path());
  INFO(run.output);
  CHECK(run.exit_code == 0);
  CHECK(contains(run.output, "python-ok"));
}

// The job of dir/job.toml in the background (its output in dir/work/output.txt).
std::vector<std::string> job_command(const TempDir& dir) {
  return {FULGUR_TEST_FASHION_MNIST, "--config", (dir / "job.toml").string()};
}
const std::map<std::string, std::string> kJobEnv{{"FULGUR_LOG_LEVEL", "info"}, {"MLFLOW_TRACKING_URI", ""}};

// Waits (a safety net of 120 s, not a measurement) until `log` contains `text`.
bool wait_for_output(const fs::path& log, const std::string& text) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < until) {
    std::ifstream in(log);
    const std::string content{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    if (contains(content, text)) return true;
    timespec pause{0, 10'000'000};
    ::nanosleep(&pause, nullptr);
  }
  return false;
}

// Once the job's first checkpoint exists (it is training), kills the server while the job is
// stopped, so the job's next requests find no server.
void kill_server_mid_run(job::BackgroundProcess& training, MlflowServer& server, const fs::path& first_checkpoint) {
  REQUIRE_MESSAGE(training.wait_for_file(first_checkpoint), training.wait().output);
  ::kill(training.pid(), SIGSTOP);
  server.kill();
  ::kill(training.pid(), SIGCONT);
}

}  // namespace

TEST_CASE("mlflow: metrics of every step, params, tags, status and checkpoints reach a real tracking server") {
  if (mlflow_missing()) return;
  TempDir dir;
  MlflowServer server(dir, free_port());
  // tracking_uri is empty: MLFLOW_TRACKING_URI names the server, as with MLflow's own client.
  std::ofstream(dir / "job.toml") << job_toml(dir, 2, 10,
                                              "experiment_name = \"fulgur-e2e\"\nrun_name = \"mlp-baseline\"\n"
                                              "tags = [\"team=vision\", \"note=a=b\"]\nbatch_size = 4\n"
                                              "log_model_checkpoints = true\n",
                                              "[[callbacks]]\nname = \"model_checkpoint\"\nsave_last = true\n");
  const ProcessRun run = job::run_example(dir / "job.toml", dir.path(), {{"MLFLOW_TRACKING_URI", server.uri()}});
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  FULGUR_CHECK_CONTAINS(run.output, "logger 'mlflow': created experiment 'fulgur-e2e'");
  CHECK(!contains(run.output, "[warning] logger 'mlflow'"));

  // The run's end state reaches the server: SIGTERM (interrupted) is KILLED, an exception in a
  // hook (early_stopping's missing monitor) is FAILED.
  const fs::path plugins = job::plugin_dir(dir, {"signal-at-step"});
  auto short_job = [&](const std::string& experiment, const std::string& callback) {
    std::ofstream(dir / "end.toml") << job::toml(
        dir.path(), plugins, 1, 6, "",
        "[[loggers]]\nname = \"mlflow\"\nexperiment_name = \"" + experiment + "\"\n" + callback);
    return job::run_example(dir / "end.toml", dir.path(), {{"MLFLOW_TRACKING_URI", server.uri()}});
  };
  const ProcessRun killed = short_job("killed",
                                      "[[callbacks]]\nname = \"fixture_signal_at_step\"\nstep = 2\nsignal = "
                                      "\"SIGTERM\"\nrank = -1\nmarker = \"" +
                                          (dir / "marker").string() + "\"\n");
  CHECK_MESSAGE(killed.exit_code == 143, killed.output);
  const ProcessRun failed =
      short_job("failed", "[[callbacks]]\nname = \"early_stopping\"\nmonitor = \"val/missing\"\n");
  CHECK_MESSAGE(failed.exit_code != 0, failed.output);

  read_back(dir, server, "fulgur-e2e", "", R"(
for name, status in (("killed", "KILLED"), ("failed", "FAILED")):
    ended = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    assert [r.info.status for r in ended] == [status], (name, [r.info.status for r in ended])
assert run.info.run_name == "mlp-baseline", run.info.run_name
tags = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")}
assert tags == {"team": "vision", "note": "a=b"}, tags
# log_dir is <default_root_dir>/mlruns/<experiment>/<run>: model_checkpoint saved there.
assert os.path.isfile(os.path.join(root, "mlruns", exp.experiment_id, rid, "checkpoints", "last.ckpt"))
)");
}

TEST_CASE("mlflow: a server killed mid-run and restarted on the same port and database loses no metric") {
  if (mlflow_missing()) return;
  TempDir dir;
  MlflowServer server(dir, free_port());
  const fs::path checkpoints = dir / "ckpts";
  // Small batches (3 values per request) so that requests go out all through the run, and a
  // short back-off (0.1 + 0.2 + 0.4 s) so that requests fail for good while the server is away:
  // their values must stay buffered and go out once it is back.
  std::ofstream(dir / "job.toml") << job_toml(dir, 3, 20,
                                              fmt::format("tracking_uri = \"{}\"\nexperiment_name = \"restart\"\n"
                                                          "batch_size = 3\nmax_retries = 3\nretry_backoff = 0.1\n"
                                                          "log_model_checkpoints = true\ncheckpoint_dir = \"{}\"\n",
                                                          server.uri(), checkpoints.string()),
                                              job::checkpointing(checkpoints, 2));
  const fs::path work = dir.subdir("work");
  job::BackgroundProcess training(job_command(dir), kJobEnv, work);
  kill_server_mid_run(training, server, checkpoints / "last.ckpt");
  // Training goes on without the server; once a request has failed for good, the job is held while
  // the server restarts, so that it still has values to send when the server is back.
  const std::string gave_up = "logger 'mlflow': the tracking server at " + server.uri() + " is unreachable (";
  REQUIRE_MESSAGE(wait_for_output(work / "output.txt", gave_up), fulgur::test::read_bytes(work / "output.txt"));
  ::kill(training.pid(), SIGSTOP);
  server.start();
  ::kill(training.pid(), SIGCONT);
  const ProcessRun run = training.wait();
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  FULGUR_CHECK_CONTAINS(run.output, "logger 'mlflow': runs/log-batch at " + server.uri() + " failed (");
  FULGUR_CHECK_CONTAINS(run.output, "logger 'mlflow': the tracking server at " + server.uri() + " is back");
  CHECK(!contains(run.output, "were not delivered"));
  read_back(dir, server, "restart", checkpoints, "");
}

TEST_CASE("mlflow: a server that never comes back costs no checkpoint and leaves the undelivered values on disk") {
  if (mlflow_missing()) return;
  TempDir dir;
  MlflowServer server(dir, free_port());
  const fs::path checkpoints = dir / "ckpts";
  std::ofstream(dir / "job.toml") << job_toml(
      dir, 2, 10,
      fmt::format("tracking_uri = \"{}\"\nbatch_size = 3\nmax_retries = 2\nretry_backoff = 0.05\n"
                  "log_model_checkpoints = true\ncheckpoint_dir = \"{}\"\n",
                  server.uri(), checkpoints.string()),
      job::checkpointing(checkpoints, 2));
  job::BackgroundProcess training(job_command(dir), kJobEnv, dir.subdir("work"));
  kill_server_mid_run(training, server, checkpoints / "last.ckpt");
  const ProcessRun run = training.wait();
  INFO(run.output);
  // Training is not the logger's to fail: the run ends normally with its checkpoints.
  CHECK(run.exit_code == 0);
  CHECK(job::checkpoint_dict(checkpoints / "last.ckpt").contains("state_dict"));
  FULGUR_CHECK_CONTAINS(run.output, "logger 'mlflow': the tracking server at " + server.uri() + " is unreachable (");
  FULGUR_CHECK_CONTAINS(
      run.output, "logger 'mlflow': the tracking server at " + server.uri() + " could not be told the run FINISHED");
  FULGUR_CHECK_CONTAINS(run.output, "the checkpoints were not uploaded and stay in " + checkpoints.string());
  // What was not delivered is on disk, in runs/log-batch's shape: the last epoch's values, the
  // test stage's (logged after fit) and the final status.
  const fs::path unsent_dir = dir / "runs" / "mlruns";
  const fs::path script = dir / "unsent.py";
  std::ofstream(script) << R"(
import csv, glob, json, sys
files = glob.glob(sys.argv[1] + "/*/*/mlflow_unsent.json")
assert len(files) == 1, files
unsent = json.load(open(files[0]))
assert unsent["status"] == "FINISHED", unsent.get("status")
keys = {(m["key"], m["step"], m["value"]) for m in unsent["metrics"]}
rows = list(csv.DictReader(open(sys.argv[2] + "/metrics.csv")))
last = [(k, int(r["step"]), float(v)) for r in rows[-3:] for k, v in r.items() if k != "step" and v != ""]
assert last and all(v in keys for v in last), (last, sorted(keys))
assert any(k == "test/acc" for k, _, _ in keys), keys
print("python-ok")
)";
  const ProcessRun check = fulgur::test::run_process({FULGUR_TEST_PYTHON, script.string(), unsent_dir.string(),
                                                      (dir / "runs" / "lightning_logs" / "version_0").string()},
                                                     {}, dir.path());
  INFO(check.output);
  CHECK(contains(check.output, "python-ok"));
}

TEST_CASE("mlflow: bad options and a server that is not there are refused before training, naming what to fix") {
  TempDir dir;
  auto config_check = [&](const std::string& options, const std::map<std::string, std::string>& env = {}) {
    std::ofstream(dir / "job.toml") << "[trainer]\nmax_epochs = 1\n[[loggers]]\nname = \"mlflow\"\n" + options;
    std::map<std::string, std::string> environment{{"FULGUR_LOG_LEVEL", "warn"}, {"MLFLOW_TRACKING_URI", ""}};
    for (const auto& [k, v] : env) environment[k] = v;
    return fulgur::test::run_process({FULGUR_TEST_FULGUR_BIN, "config", "check", (dir / "job.toml").string()},
                                     environment, dir.path());
  };
  const std::string uri = "tracking_uri = \"http://127.0.0.1:1\"\n";
  CHECK(config_check(uri).exit_code == 0);
  CHECK(config_check("", {{"MLFLOW_TRACKING_URI", "http://127.0.0.1:1"}}).exit_code == 0);
  const std::vector<std::pair<std::string, std::string>> refused{
      {"tracking_uri = \"file:///tmp/mlruns\"\n",
       "tracking_uri = \"file:///tmp/mlruns\" is not an http:// or https://"},
      {uri + "batch_size = 0\n", "batch_size = 0 is outside 1..1000"},
      {uri + "batch_size = 1001\n", "batch_size = 1001 is outside 1..1000"},
      {uri + "tags = [\"team\"]\n", "tags entry \"team\" is not \"key=value\""},
      {uri + "checkpoint_dir = \"ckpts\"\n", "checkpoint_dir = \"ckpts\" is set but log_model_checkpoints = false"},
      {uri + "upload_when = \"often\"\n", "upload_when = \"often\" is neither \"end\" nor \"saved\""},
      {uri + "upload_when = \"saved\"\n",
       "upload_when = \"saved\" uploads nothing while log_model_checkpoints = false"},
      {uri + "log_model_checkpoints = true\nupload_when = \"saved\"\ncheckpoint_dir = \"c\"\n",
       "checkpoint_dir = \"c\" is read at the end only"},
      {uri + "max_retries = -1\n", "max_retries = -1 is outside 0..30"},
      {uri + "retry_backoff = -0.5\n", "retry_backoff = -0.5 s is outside 0..60"},
      {uri + "experiment_name = \"\"\n", "experiment_name = \"\" is empty"}};
  for (const auto& [options, message] : refused) {
    const ProcessRun run = config_check(options);
    INFO(options << run.output);
    CHECK(run.exit_code != 0);
    FULGUR_CHECK_CONTAINS(run.output, message);
  }
  {  // MLFLOW_TRACKING_URI is checked like the option, and named as the source.
    const ProcessRun run = config_check("", {{"MLFLOW_TRACKING_URI", "databricks"}});
    CHECK(run.exit_code != 0);
    FULGUR_CHECK_CONTAINS(run.output, "MLFLOW_TRACKING_URI = \"databricks\" is not an http:// or https:// URI");
  }

  // No server named at all: refused when the run starts (creating the plugin with its defaults,
  // as `fulgur plugins check` does, is not an error).
  CHECK(config_check("").exit_code == 0);
  std::ofstream(dir / "no_uri.toml") << job::toml(dir.path(), dir.subdir("plugins"), 1, 5, "",
                                                  "[[loggers]]\nname = \"mlflow\"\n");
  const ProcessRun no_uri = job::run_example(dir / "no_uri.toml", dir.path(), {{"MLFLOW_TRACKING_URI", ""}});
  CHECK(no_uri.exit_code != 0);
  FULGUR_CHECK_CONTAINS(no_uri.output, "logger 'mlflow': no tracking server: set tracking_uri");
  CHECK(!contains(no_uri.output, "epoch 0:"));

  // Nobody listens: setup fails after its retries, naming the plugin, the URI and the fix, and no
  // training step runs (no checkpoint is written).
  const int port = free_port();
  std::ofstream(dir / "run.toml") << job::toml(dir.path(), dir.subdir("plugins"), 1, 5, "",
                                               fmt::format("[[loggers]]\nname = \"mlflow\"\ntracking_uri = "
                                                           "\"http://127.0.0.1:{}\"\nmax_retries = 1\nretry_backoff = "
                                                           "0.01\n",
                                                           port));
  const ProcessRun run = job::run_example(dir / "run.toml", dir.path(), {{"MLFLOW_TRACKING_URI", ""}});
  INFO(run.output);
  CHECK(run.exit_code != 0);
  FULGUR_CHECK_CONTAINS(run.output, fmt::format("logger 'mlflow': experiments/get-by-name at http://127.0.0.1:{} "
                                                "failed: ",
                                                port));
  FULGUR_CHECK_CONTAINS(run.output, "after 2 attempt(s); start the server");
  CHECK(!contains(run.output, "epoch 0:"));
}

TEST_CASE("mlflow: upload_when = \"saved\" uploads each checkpoint as it is written, \"end\" what the run kept") {
  if (mlflow_missing()) return;
  TempDir dir;
  MlflowServer server(dir, free_port());
  // model_checkpoint writes outside the logger's run directory and keeps only its newest step file:
  // 10 steps, a checkpoint every 2, so 5 step files are written and 4 deleted again.
  auto run_job = [&](const std::string& experiment, const std::string& when) {
    const fs::path checkpoints = dir / ("ckpts-" + experiment);
    std::ofstream(dir / "job.toml") << job_toml(
        dir, 1, 10,
        fmt::format("tracking_uri = \"{}\"\nexperiment_name = \"{}\"\nlog_model_checkpoints = true\n"
                    "upload_when = \"{}\"\n",
                    server.uri(), experiment, when),
        "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"" + checkpoints.string() +
            "\"\nevery_n_train_steps = 2\nsave_top_k = 1\nsave_last = false\n");
    const ProcessRun run = job::run_example(dir / "job.toml", dir.path(), {{"MLFLOW_TRACKING_URI", ""}});
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    CHECK(job::files_in(checkpoints) == std::vector<std::string>{"epoch=0-step=10.ckpt"});
    return run.output;
  };
  // "saved": the step files model_checkpoint deleted later were uploaded when they were written.
  const std::string saved = run_job("as-saved", "saved");
  FULGUR_CHECK_CONTAINS(saved, "uploaded " + (dir / "ckpts-as-saved" / "epoch=0-step=2.ckpt").string());
  run_job("at-end", "end");

  const fs::path script = dir / "artifacts.py";
  std::ofstream(script) << R"(
import sys
from mlflow.tracking import MlflowClient
client = MlflowClient(tracking_uri=sys.argv[1])
def uploaded(experiment):
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id])
    return sorted(a.path for a in client.list_artifacts(run.info.run_id, "checkpoints"))
every = ["checkpoints/epoch=0-step=%d.ckpt" % s for s in (10, 2, 4, 6, 8)]
assert uploaded("as-saved") == sorted(every), uploaded("as-saved")
assert uploaded("at-end") == ["checkpoints/epoch=0-step=10.ckpt"], uploaded("at-end")
print("python-ok")
)";
  const ProcessRun check =
      fulgur::test::run_process({FULGUR_TEST_PYTHON, script.string(), server.uri()}, {}, dir.path());
  INFO(check.output);
  CHECK(contains(check.output, "python-ok"));
}
