// Checkpoints on object storage (fulgur/storage.h, plugins/storage/s3) against a real S3 server:
// moto_server (pinned in scripts/requirements.txt) on a free port with IAM authentication and
// SigV4 signature verification on, its user, key and policy created through its IAM API, and every
// object read back with boto3, a client that shares no code with ours. Skipped (CTest: Skipped)
// where moto_server is missing, which scripts/setup.sh prevents.
#include <fulgur/error.h>
#include <fulgur/registry/storage_loader.h>
#include <fulgur/storage.h>
#include <fulgur/testing/plugin_kit.h>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "test_support.h"
#include "training_job.h"

namespace {

namespace fs = std::filesystem;
namespace kit = fulgur::testing;
using fulgur::test::contains;
using fulgur::test::ProcessRun;
using fulgur::test::TempDir;

fs::path moto_executable() { return fs::path(FULGUR_TEST_PYTHON).parent_path() / "moto_server"; }

bool moto_missing() {
  if (fs::exists(moto_executable())) return false;
  fulgur::test::skip_test(moto_executable().string() + " is missing; scripts/setup.sh installs it (moto[server])");
  return true;
}

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

// A TCP connect only: every HTTP request counts against INITIAL_NO_AUTH_ACTION_COUNT.
bool listening(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
  ::close(fd);
  return ok;
}

// Creates the user, its key and an s3:* policy (the three unauthenticated calls moto allows), then
// the bucket with the new key, which proves the key works; prints the key id and secret.
constexpr const char* kSetup = R"(
import json, sys, boto3
url = "http://127.0.0.1:%s" % sys.argv[1]
iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1",
                   aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap")
iam.create_user(UserName="fulgur")
key = iam.create_access_key(UserName="fulgur")["AccessKey"]
iam.put_user_policy(UserName="fulgur", PolicyName="s3", PolicyDocument=json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                  aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"])
s3.create_bucket(Bucket="ckpts")
print("KEY", key["AccessKeyId"], key["SecretAccessKey"])
)";

// boto3 on the bucket: `list PREFIX` prints "key size" lines; `get KEY FILE` downloads;
// `getprefix PREFIX DIR` downloads every key below PREFIX into DIR; `etag KEY`.
constexpr const char* kClient = R"(
import sys, boto3
url, key_id, secret, action = sys.argv[1:5]
s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                  aws_access_key_id=key_id, aws_secret_access_key=secret)
if action == "list":
    for o in s3.list_objects_v2(Bucket="ckpts", Prefix=sys.argv[5]).get("Contents", []):
        print("OBJ", o["Key"], o["Size"])
elif action == "get":
    s3.download_file("ckpts", sys.argv[5], sys.argv[6])
elif action == "getprefix":
    import os
    prefix, target = sys.argv[5], sys.argv[6]
    os.makedirs(target, exist_ok=True)
    for o in s3.list_objects_v2(Bucket="ckpts", Prefix=prefix).get("Contents", []):
        s3.download_file("ckpts", o["Key"], os.path.join(target, o["Key"][len(prefix):]))
elif action == "etag":
    print("ETAG", s3.head_object(Bucket="ckpts", Key=sys.argv[5])["ETag"])
print("python-ok")
)";

class MotoServer {
  std::string server_log() const {
    std::ifstream in(dir_ / "moto.log", std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

 public:
  explicit MotoServer(const TempDir& dir) : dir_(dir), port_(free_port()) {
    pid_ = fulgur::test::spawn_process(
        {"/usr/bin/setsid", moto_executable().string(), "-H", "127.0.0.1", "-p", std::to_string(port_)},
        {{"INITIAL_NO_AUTH_ACTION_COUNT", "3"}}, dir_.path(), dir_ / "moto.log");
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);  // a safety net
    while (!listening(port_)) {
      int status = 0;
      // The log is read without an assertion of its own: doctest builds this message under its
      // lock (on every pass with -s), and a nested assertion would wait for that lock forever.
      REQUIRE_MESSAGE(::waitpid(pid_, &status, WNOHANG) == 0, "moto_server exited:\n" << server_log());
      REQUIRE_MESSAGE(std::chrono::steady_clock::now() < until, "moto_server did not listen");
      timespec pause{0, 100'000'000};
      ::nanosleep(&pause, nullptr);
    }
    fulgur::test::write_bytes(dir_ / "setup.py", kSetup);
    fulgur::test::write_bytes(dir_ / "client.py", kClient);
    const ProcessRun setup = fulgur::test::run_process(
        {FULGUR_TEST_PYTHON, (dir_ / "setup.py").string(), std::to_string(port_)}, {}, dir_.path());
    REQUIRE_MESSAGE(setup.exit_code == 0, setup.output);
    std::istringstream words(setup.output.substr(setup.output.find("KEY ")));
    std::string marker;
    words >> marker >> key_id_ >> secret_;
    REQUIRE(!secret_.empty());
  }
  ~MotoServer() {
    ::kill(-pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  MotoServer(const MotoServer&) = delete;
  MotoServer& operator=(const MotoServer&) = delete;

  std::string url() const { return fmt::format("http://127.0.0.1:{}", port_); }

  // What a process needs to reach the bucket: the variables the AWS tools read.
  std::map<std::string, std::string> env(const std::string& secret = "") const {
    return {{"AWS_ENDPOINT_URL", url()},    {"AWS_REGION", "us-east-1"},
            {"AWS_ACCESS_KEY_ID", key_id_}, {"AWS_SECRET_ACCESS_KEY", secret.empty() ? secret_ : secret},
            {"AWS_SESSION_TOKEN", ""},      {"AWS_PROFILE", ""},
            {"FULGUR_LOG_LEVEL", "warn"},   {"FULGUR_PLUGIN_PATH", ""}};
  }

  // No key in the environment: the profile `profile` of a shared credentials file written here,
  // after a [default] profile with a wrong secret.
  std::map<std::string, std::string> profile_env(const std::string& profile) const {
    const fs::path file = dir_ / "aws-credentials";
    fulgur::test::write_bytes(file, fmt::format("[default]\naws_access_key_id = {}\naws_secret_access_key = wrong\n\n"
                                                "# the key the test created\n[{}]\naws_access_key_id = {}\n"
                                                "aws_secret_access_key = {}\n",
                                                key_id_, profile, key_id_, secret_));
    std::map<std::string, std::string> out = env();
    out["AWS_ACCESS_KEY_ID"] = "";
    out["AWS_SECRET_ACCESS_KEY"] = "";
    out["AWS_SHARED_CREDENTIALS_FILE"] = file.string();
    out["AWS_PROFILE"] = profile;
    return out;
  }

  // boto3's view of the bucket.
  std::string client(const std::vector<std::string>& args) const {
    std::vector<std::string> command = {FULGUR_TEST_PYTHON, (dir_ / "client.py").string(), url(), key_id_, secret_};
    command.insert(command.end(), args.begin(), args.end());
    const ProcessRun run = fulgur::test::run_process(command, {}, dir_.path());
    REQUIRE_MESSAGE(contains(run.output, "python-ok"), run.output);
    return run.output;
  }

  // Keys below `prefix`, sorted.
  std::vector<std::string> keys(const std::string& prefix) const {
    std::vector<std::string> out;
    std::istringstream lines(client({"list", prefix}));
    for (std::string line; std::getline(lines, line);)
      if (line.starts_with("OBJ ")) out.push_back(line.substr(4, line.rfind(' ') - 4));
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  const TempDir& dir_;
  int port_;
  pid_t pid_ = -1;
  std::string key_id_, secret_;
};

// `fulgur fit` on the Fashion-MNIST plugins: 4 batches per epoch, model_checkpoint saving every 2
// steps into `dirpath`, keeping the latest one and last.ckpt.
std::string fit_toml(const fs::path& root, int max_epochs, const std::string& dirpath, const std::string& ckpt_path) {
  return fmt::format(
      "[trainer]\nmax_epochs = {}\nseed = 7\nlimit_train_batches = 4\nlimit_val_batches = 2\n"
      "enable_progress_bar = false\nenable_model_summary = false\ndefault_root_dir = \"{}\"\nckpt_path = \"{}\"\n\n"
      "[model]\nname = \"fashion_mnist_mlp\"\nlr = 0.002\n\n[data]\nname = \"fashion_mnist\"\nbatch_size = 32\n\n"
      "[[callbacks]]\nname = \"model_checkpoint\"\ndirpath = \"{}\"\nevery_n_train_steps = 2\nsave_top_k = 1\n"
      "save_last = true\n",
      max_epochs, (root / "runs").string(), ckpt_path, dirpath);
}

ProcessRun fit(const TempDir& dir, const std::string& name, const std::string& toml,
               const std::map<std::string, std::string>& env) {
  fulgur::test::write_bytes(dir / name, toml);
  return fulgur::test::run_process({FULGUR_TEST_FULGUR_BIN, "fit", "--config", name}, env, dir.path());
}

}  // namespace

TEST_CASE("s3 storage: fulgur fit saves to s3://, keeps top-k there and resumes from last bitwise") {
  if (moto_missing()) return;
  TempDir dir;
  MotoServer server(dir);

  // The reference: two epochs in one go, on local disk.
  const ProcessRun reference =
      fit(dir, "reference.toml", fit_toml(dir / "ref", 2, (dir / "ref-ckpt").string(), ""), server.env());
  REQUIRE_MESSAGE(reference.exit_code == 0, reference.output);

  // One epoch to s3://, then a new process resumes from "last", found by listing the bucket.
  const std::string dirpath = "s3://ckpts/run/checkpoints";
  const ProcessRun first = fit(dir, "first.toml", fit_toml(dir / "a", 1, dirpath, ""), server.env());
  REQUIRE_MESSAGE(first.exit_code == 0, first.output);
  // Saved at steps 2 and 4; save_top_k = 1 deleted step 2's object once step 4's was written.
  CHECK(server.keys("run/") ==
        std::vector<std::string>{"run/checkpoints/epoch=0-step=4.ckpt", "run/checkpoints/last.ckpt"});
  CHECK(fulgur::test::job::files_in(dir / "a" / "runs").size() == 1);  // logs stay local (lightning_logs)

  const ProcessRun resumed = fit(dir, "resumed.toml", fit_toml(dir / "a", 2, dirpath, "last"), server.env());
  REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  CHECK(server.keys("run/") ==
        std::vector<std::string>{"run/checkpoints/epoch=1-step=8.ckpt", "run/checkpoints/last.ckpt"});

  // The resumed run ends where the uninterrupted one did, bit for bit.
  server.client({"get", "run/checkpoints/last.ckpt", (dir / "downloaded.ckpt").string()});
  CHECK(fulgur::test::job::same_weights(dir / "downloaded.ckpt", dir / "ref-ckpt" / "last.ckpt"));
  const auto resumed_state = fulgur::test::job::checkpoint_dict(dir / "downloaded.ckpt");
  CHECK(resumed_state.at("global_step").toInt() == 8);

  // An explicit s3:// ckpt_path is a file like any other: validate from it.
  const ProcessRun explicit_path = fit(
      dir, "explicit.toml", fit_toml(dir / "b", 3, (dir / "b-ckpt").string(), dirpath + "/last.ckpt"), server.env());
  REQUIRE_MESSAGE(explicit_path.exit_code == 0, explicit_path.output);
  CHECK(fulgur::test::job::checkpoint_dict(dir / "b-ckpt" / "last.ckpt").at("global_step").toInt() == 12);
}

TEST_CASE("s3 storage: SIGKILL in the middle of an upload leaves the previous last.ckpt and no partial object") {
  if (moto_missing()) return;
  if (!FULGUR_TEST_FAULT_INJECTION) {
    fulgur::test::skip_test("this build has no fault injection (configure with -DFULGUR_FAULT_INJECTION=ON)");
    return;
  }
  TempDir dir;
  MotoServer server(dir);
  const ProcessRun reference =
      fit(dir, "reference.toml", fit_toml(dir / "ref", 2, (dir / "ref-ckpt").string(), ""), server.env());
  REQUIRE_MESSAGE(reference.exit_code == 0, reference.output);

  // Uploads: step 2's epoch=0-step=2.ckpt and last.ckpt, then step 4's epoch=0-step=4.ckpt, the
  // third, dies half sent.
  const std::string dirpath = "s3://ckpts/killed/checkpoints";
  std::map<std::string, std::string> env = server.env();
  env["FULGUR_FAULT_INJECT"] = "s3_upload:3";
  const ProcessRun killed = fit(dir, "killed.toml", fit_toml(dir / "k", 2, dirpath, ""), env);
  INFO(killed.output);
  REQUIRE(killed.exit_code == -SIGKILL);
  CHECK(server.keys("killed/") ==
        std::vector<std::string>{"killed/checkpoints/epoch=0-step=2.ckpt", "killed/checkpoints/last.ckpt"});
  server.client({"get", "killed/checkpoints/last.ckpt", (dir / "at-kill.ckpt").string()});
  CHECK(fulgur::test::job::checkpoint_dict(dir / "at-kill.ckpt").at("global_step").toInt() == 2);

  // A new process resumes from that last.ckpt, mid-epoch, and ends where the uninterrupted run did.
  const ProcessRun resumed = fit(dir, "resumed.toml", fit_toml(dir / "k", 2, dirpath, "last"), server.env());
  REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  server.client({"get", "killed/checkpoints/last.ckpt", (dir / "final.ckpt").string()});
  CHECK(fulgur::test::job::same_weights(dir / "final.ckpt", dir / "ref-ckpt" / "last.ckpt"));
}

TEST_CASE("s3 storage: a wrong secret is refused with the bucket, key, HTTP status and the fix") {
  if (moto_missing()) return;
  TempDir dir;
  MotoServer server(dir);
  const ProcessRun run =
      fit(dir, "wrong.toml", fit_toml(dir.path(), 1, "s3://ckpts/wrong", ""), server.env("not-the-secret"));
  INFO(run.output);
  CHECK(run.exit_code != 0);
  FULGUR_CHECK_CONTAINS(run.output, "bucket 'ckpts'");
  FULGUR_CHECK_CONTAINS(run.output, "s3://ckpts/wrong/");  // model_checkpoint's first look at its directory
  FULGUR_CHECK_CONTAINS(run.output, "HTTP 403 SignatureDoesNotMatch");
  FULGUR_CHECK_CONTAINS(run.output, "check AWS_SECRET_ACCESS_KEY");
  CHECK(server.keys("wrong/").empty());
}

TEST_CASE("s3 storage: objects above the part size go up as a multipart upload, and ranged reads and listing work") {
  if (moto_missing()) return;
  TempDir dir;
  MotoServer server(dir);
  for (const auto& [name, value] : server.env())
    value.empty() ? ::unsetenv(name.c_str()) : ::setenv(name.c_str(), value.c_str(), 1);
  ::setenv("FULGUR_S3_PART_SIZE", "5242880", 1);
  // The storage plugin, created as the core's loader creates it, with its defaults (which take
  // the part size from FULGUR_S3_PART_SIZE).
  const std::shared_ptr<fulgur::Storage> plugin =
      kit::create_plugin<fulgur::Storage>(fulgur::PluginKind::storage, "s3");
  ::unsetenv("FULGUR_S3_PART_SIZE");
  fulgur::Storage& storage = *plugin;

  std::string big(12 << 20, '\0');
  std::mt19937_64 random(7);
  for (char& c : big) c = static_cast<char>(random());
  storage.write("s3://ckpts/big/blob.bin", big);
  // Three parts of at most 5 MiB: S3's multipart ETag is "<md5 of the part md5s>-<parts>".
  FULGUR_CHECK_CONTAINS(server.client({"etag", "big/blob.bin"}), "-3\"");
  CHECK(storage.read("s3://ckpts/big/blob.bin") == big);
  CHECK(storage.read_range("s3://ckpts/big/blob.bin", (5 << 20) - 10, 100) == big.substr((5 << 20) - 10, 100));
  CHECK(storage.read_range("s3://ckpts/big/blob.bin", big.size() - 5, 100) == big.substr(big.size() - 5));

  storage.write("s3://ckpts/big/small.txt", "hello");  // one PUT
  const std::vector<fulgur::StorageObject> listed = storage.list("s3://ckpts/big/");
  REQUIRE(listed.size() == 2);
  CHECK(listed[0].url == "s3://ckpts/big/blob.bin");
  CHECK(listed[0].size == big.size());
  CHECK(storage.stat("s3://ckpts/big/small.txt")->size == 5);
  CHECK(!storage.stat("s3://ckpts/big/none"));
  CHECK(storage.remove("s3://ckpts/big/small.txt"));
  CHECK(!storage.remove("s3://ckpts/big/small.txt"));
  CHECK(server.keys("big/") == std::vector<std::string>{"big/blob.bin"});

  // A bucket that does not exist: named, with the fix.
  const fulgur::Error missing = fulgur::test::error_from([&] { storage.write("s3://nobucket/k", "x"); });
  FULGUR_CHECK_CONTAINS(missing.what(), "NoSuchBucket");
  FULGUR_CHECK_CONTAINS(missing.what(), "create bucket 'nobucket' first");
}

TEST_CASE("storage: local paths and URLs are told apart, and an unknown scheme names the fix") {
  CHECK(fulgur::is_storage_url("s3://bucket/key"));
  CHECK(!fulgur::is_storage_url("/tmp/s3://x"));
  CHECK(!fulgur::is_storage_url("file:///tmp/x"));
  CHECK(!fulgur::is_storage_url("relative/dir"));
  CHECK(fulgur::join_storage_path("s3://b/run/", "last.ckpt") == "s3://b/run/last.ckpt");
  const fulgur::Error error = fulgur::test::error_from([] { fulgur::storage_for("nosuch://bucket/key"); });
  FULGUR_CHECK_CONTAINS(error.what(), "nosuch");
  FULGUR_CHECK_CONTAINS(error.what(), "FULGUR_PLUGIN_PATH");
  TempDir dir;
  fulgur::Storage& local = fulgur::local_storage();
  local.write((dir / "a.bin").string(), "0123456789");
  CHECK(local.read_range((dir / "a.bin").string(), 3, 4) == "3456");
  CHECK(local.list((dir / "a").string()).size() == 1);
  CHECK(local.remove((dir / "a.bin").string()));
  CHECK(!local.exists((dir / "a.bin").string()));
}

TEST_CASE("storage: staging_dir is refused beside a local default_root_dir") {
  TempDir dir;
  std::string toml = fit_toml(dir.path(), 1, (dir / "ckpt").string(), "");
  toml.insert(toml.find("ckpt_path"), "staging_dir = \"stage\"\n");
  const ProcessRun run = fit(dir, "staging.toml", toml, {{"FULGUR_PLUGIN_PATH", ""}});
  INFO(run.output);
  CHECK(run.exit_code != 0);
  FULGUR_CHECK_CONTAINS(run.output, "staging.toml:9:");
  FULGUR_CHECK_CONTAINS(run.output, "staging_dir applies only when default_root_dir is a URL");
  CHECK(!fs::exists(dir / "stage"));
}

namespace {

// fit_toml's run rooted at s3://ckpts/root: the csv logger and the checkpoint callback take their
// places from default_root_dir (no save_dir, no dirpath), local files go to <root>/stage.
std::string url_root_toml(const fs::path& root, int max_epochs, const std::string& ckpt_path) {
  std::string toml = fit_toml(root, max_epochs, "", ckpt_path);
  const std::string local = "default_root_dir = \"" + (root / "runs").string() + "\"";
  toml.replace(toml.find(local), local.size(),
               "default_root_dir = \"s3://ckpts/root\"\nstaging_dir = \"" + (root / "stage").string() + "\"");
  const std::string no_dirpath = "dirpath = \"\"\n";
  toml.erase(toml.find(no_dirpath), no_dirpath.size());
  return toml + "\n[[loggers]]\nlogger = \"csv\"\nflush_logs_every_n_steps = 2\n";
}

}  // namespace

TEST_CASE("s3 storage: default_root_dir = s3:// holds the logs and checkpoints, and ckpt_path = last resumes there") {
  if (moto_missing()) return;
  TempDir dir;
  MotoServer server(dir);
  const ProcessRun reference =
      fit(dir, "reference.toml", fit_toml(dir / "ref", 2, (dir / "ref-ckpt").string(), ""), server.env());
  REQUIRE_MESSAGE(reference.exit_code == 0, reference.output);

  const ProcessRun first = fit(dir, "first.toml", url_root_toml(dir.path(), 1, ""), server.env());
  REQUIRE_MESSAGE(first.exit_code == 0, first.output);
  INFO(first.output);
  // The checkpoints beside the logs, in the run directory on the bucket (Lightning's layout).
  CHECK(server.keys("root/") ==
        std::vector<std::string>{"root/lightning_logs/version_0/checkpoints/epoch=0-step=4.ckpt",
                                 "root/lightning_logs/version_0/checkpoints/last.ckpt",
                                 "root/lightning_logs/version_0/hparams.yaml",
                                 "root/lightning_logs/version_0/metrics.csv"});
  // The logs were staged in staging_dir, and nothing went to a local directory named "s3:".
  const fs::path staged = dir / "stage" / "lightning_logs" / "version_0";
  server.client({"get", "root/lightning_logs/version_0/metrics.csv", (dir / "metrics.csv").string()});
  CHECK(fulgur::test::read_bytes(dir / "metrics.csv") == fulgur::test::read_bytes(staged / "metrics.csv"));
  CHECK(!fs::exists(staged / "checkpoints"));
  CHECK(!fs::exists(dir / "s3:"));

  // A new process finds "last" by listing the root, resumes, and ends where one run of 2 epochs did.
  const ProcessRun resumed = fit(dir, "resumed.toml", url_root_toml(dir.path(), 2, "last"), server.env());
  REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  INFO(resumed.output);
  // Resumed from version_0's last.ckpt; the new run writes version_1, as Lightning's does.
  FULGUR_CHECK_CONTAINS(resumed.output,
                        "changed from s3://ckpts/root/lightning_logs/version_0/checkpoints to "
                        "s3://ckpts/root/lightning_logs/version_1/checkpoints");
  const std::vector<std::string> second = server.keys("root/lightning_logs/version_1/");
  CHECK(std::find(second.begin(), second.end(), "root/lightning_logs/version_1/checkpoints/last.ckpt") != second.end());
  server.client({"get", "root/lightning_logs/version_1/checkpoints/last.ckpt", (dir / "downloaded.ckpt").string()});
  CHECK(fulgur::test::job::checkpoint_dict(dir / "downloaded.ckpt").at("global_step").toInt() == 8);
  CHECK(fulgur::test::job::same_weights(dir / "downloaded.ckpt", dir / "ref-ckpt" / "last.ckpt"));
}

TEST_CASE(
    "s3 storage: an SDK 1.0 logger under an s3:// root keeps its files in staging_dir, checkpoints go to the root") {
  if (moto_missing()) return;
  TempDir dir;
  MotoServer server(dir);
  // The corpus logger (tests/abi/corpus/logger.cpp) is a binary built against the frozen 1.0
  // headers: it knows no LoggerStorageRoot and writes below LoggerSetup::root_dir with mkdir.
  std::string toml = url_root_toml(dir.path(), 1, "");
  const std::string csv = "logger = \"csv\"\nflush_logs_every_n_steps = 2\n";
  toml.replace(toml.find(csv), csv.size(), "logger = \"corpus_rows\"\n");
  toml = "[plugins]\npaths = [\"" + std::string(FULGUR_TEST_ABI_CORPUS_DIR) + "\"]\n\n" + toml;
  const ProcessRun run = fit(dir, "corpus.toml", toml, server.env());
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  INFO(run.output);
  FULGUR_CHECK_CONTAINS(run.output, "logger 'corpus_rows' does not write to object storage");
  // Its rows in the staging directory, where a 1.5 host would have put them under a local root.
  const fs::path rows = dir / "stage" / "corpus_rows" / "version_0" / "rows.csv";
  REQUIRE(fs::exists(rows));
  FULGUR_CHECK_CONTAINS(fulgur::test::read_bytes(rows), "-1,status,success");
  // Its run directory's place, moved to the root, holds the checkpoints; nothing else went there.
  CHECK(server.keys("root/") == std::vector<std::string>{"root/corpus_rows/version_0/checkpoints/epoch=0-step=4.ckpt",
                                                         "root/corpus_rows/version_0/checkpoints/last.ckpt"});
  CHECK(!fs::exists(dir / "stage" / "corpus_rows" / "version_0" / "checkpoints"));
  CHECK(!fs::exists(dir / "s3:"));
}

TEST_CASE("s3 storage: credentials from a profile of the shared credentials file (AWS_PROFILE)") {
  if (moto_missing()) return;
  TempDir dir;
  MotoServer server(dir);
  const ProcessRun run =
      fit(dir, "profile.toml", fit_toml(dir.path(), 1, "s3://ckpts/profile", ""), server.profile_env("training"));
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  CHECK(server.keys("profile/") == std::vector<std::string>{"profile/epoch=0-step=4.ckpt", "profile/last.ckpt"});
  // The [default] profile holds a wrong secret: refused, naming the file and profile it came from.
  std::map<std::string, std::string> env = server.profile_env("training");
  env["AWS_PROFILE"] = "";
  const ProcessRun wrong = fit(dir, "default.toml", fit_toml(dir.path(), 1, "s3://ckpts/default", ""), env);
  INFO(wrong.output);
  CHECK(wrong.exit_code != 0);
  FULGUR_CHECK_CONTAINS(wrong.output, "SignatureDoesNotMatch");
  FULGUR_CHECK_CONTAINS(wrong.output, "aws-credentials [default]");
}

namespace {

// Every tensor of a nested checkpoint value, by its dotted place.
void flatten_tensors(const c10::IValue& value, const std::string& place, std::map<std::string, at::Tensor>& out) {
  if (value.isTensor()) {
    out[place] = value.toTensor();
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict())
      flatten_tensors(
          entry.value(),
          place + "." + (entry.key().isString() ? entry.key().toStringRef() : std::to_string(entry.key().toInt())),
          out);
  } else if (value.isList()) {
    const c10::List<c10::IValue> list = value.toList();
    for (size_t i = 0; i < list.size(); ++i) flatten_tensors(list.get(i), place + "." + std::to_string(i), out);
  }
}

// Every tensor of two checkpoint files (weights, optimizer state, RNG state), compared bit for bit.
void check_same_tensors(const fs::path& a, const fs::path& b) {
  std::map<std::string, at::Tensor> ta, tb;
  flatten_tensors(c10::IValue(fulgur::test::job::checkpoint_dict(a)), "", ta);
  flatten_tensors(c10::IValue(fulgur::test::job::checkpoint_dict(b)), "", tb);
  CHECK(ta.size() == tb.size());
  CHECK(ta.size() > 4);
  for (const auto& [key, tensor] : tb) {
    INFO(key);
    REQUIRE(ta.count(key) == 1);
    CHECK(at::equal(ta.at(key), tensor));
  }
}

// fit_toml's run with [trainer] async_checkpoint = true, every checkpoint kept (save_top_k = -1).
std::string async_toml(std::string toml, bool async) {
  if (async) toml.insert(toml.find("[trainer]\n") + 10, "async_checkpoint = true\n");
  const std::string top_k = "save_top_k = 1\n";
  toml.replace(toml.find(top_k), top_k.size(), "save_top_k = -1\n");
  return toml;
}

}  // namespace

TEST_CASE("async_checkpoint: fulgur fit writes the checkpoints of a synchronous run, in the background") {
  TempDir dir;
  // No last.ckpt: a second save at the same step would wait for the first before training goes on.
  auto toml = [](const fs::path& root, const std::string& dirpath, bool async) {
    std::string text = async_toml(fit_toml(root, 2, dirpath, ""), async);
    text.replace(text.find("save_last = true"), 16, "save_last = false");
    return text;
  };
  std::map<std::string, std::string> env = {{"FULGUR_LOG_LEVEL", "warn"}, {"FULGUR_PLUGIN_PATH", ""}};
  const ProcessRun sync = fit(dir, "sync.toml", toml(dir / "s", (dir / "sync").string(), false), env);
  REQUIRE_MESSAGE(sync.exit_code == 0, sync.output);
  // Each background save waits 300 ms before it writes (where the build has the seam), so that
  // the next steps surely change the weights meanwhile.
  if (FULGUR_TEST_FAULT_INJECTION) env["FULGUR_FAULT_INJECT"] = "async_checkpoint_delay:300";
  const ProcessRun async = fit(dir, "async.toml", toml(dir / "a", (dir / "async").string(), true), env);
  env.erase("FULGUR_FAULT_INJECT");
  REQUIRE_MESSAGE(async.exit_code == 0, async.output);
  // Saved every 2 steps while training went on: each file holds the state of its own step (the
  // host copy taken at the save point), every tensor what the synchronous run wrote.
  const std::vector<std::string> names = fulgur::test::job::files_in(dir / "sync");
  REQUIRE(names == std::vector<std::string>{"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt",
                                            "epoch=1-step=8.ckpt"});
  CHECK(fulgur::test::job::files_in(dir / "async") == names);
  for (const std::string& name : names) {
    INFO(name);
    check_same_tensors(dir / "async" / name, dir / "sync" / name);
    CHECK(fulgur::test::job::checkpoint_dict(dir / "async" / name).at("global_step") ==
          fulgur::test::job::checkpoint_dict(dir / "sync" / name).at("global_step"));
  }

  // The same to object storage, where moto_server is installed.
  if (!fs::exists(moto_executable())) return;
  MotoServer server(dir);
  std::map<std::string, std::string> s3_env = server.env();
  if (FULGUR_TEST_FAULT_INJECTION) s3_env["FULGUR_FAULT_INJECT"] = "async_checkpoint_delay:300";
  const ProcessRun s3 = fit(dir, "s3.toml", toml(dir / "3", "s3://ckpts/async", true), s3_env);
  REQUIRE_MESSAGE(s3.exit_code == 0, s3.output);
  CHECK(server.keys("async/").size() == names.size());
  server.client({"get", "async/epoch=0-step=2.ckpt", (dir / "s3-step2.ckpt").string()});
  check_same_tensors(dir / "s3-step2.ckpt", dir / "sync" / "epoch=0-step=2.ckpt");

  // fulgur predict from that s3:// checkpoint, the prediction writer's files going to s3:// too.
  std::string predict_toml = toml(dir / "3", "s3://ckpts/async", false) +
                             "\n[[callbacks]]\nname = \"prediction_writer\"\noutput_dir = \"s3://ckpts/predictions\"\n"
                             "write_interval = \"batch_and_epoch\"\nformat = \"csv\"\n";
  predict_toml.insert(predict_toml.find("[trainer]\n") + 10, "limit_predict_batches = 2\n");
  fulgur::test::write_bytes(dir / "predict.toml", predict_toml);
  const ProcessRun predict = fulgur::test::run_process({FULGUR_TEST_FULGUR_BIN, "predict", "--config", "predict.toml",
                                                        "--ckpt_path=s3://ckpts/async/epoch=1-step=8.ckpt"},
                                                       server.env(), dir.path());
  REQUIRE_MESSAGE(predict.exit_code == 0, predict.output);
  CHECK(server.keys("predictions/") == std::vector<std::string>{"predictions/predictions_rank0.csv",
                                                                "predictions/predictions_rank0_batch0.csv",
                                                                "predictions/predictions_rank0_batch1.csv"});
  server.client({"get", "predictions/predictions_rank0.csv", (dir / "predictions.csv").string()});
  CHECK(fulgur::test::read_csv(dir / "predictions.csv").at("v9").size() == 64);  // 2 batches of 32, 10 classes
}

TEST_CASE("async_checkpoint: a background save that fails ends the run, naming its checkpoint") {
  TempDir dir;
  // last.ckpt cannot replace a directory of that name: the first save of last.ckpt (step 2, in the
  // background) fails, and the next save (step 4) reports it.
  fs::create_directories(dir / "ckpt" / "last.ckpt" / "occupied");
  std::string toml = async_toml(fit_toml(dir.path(), 2, (dir / "ckpt").string(), ""), true);
  toml += "enable_version_counter = false\n";
  const ProcessRun run = fit(dir, "failing.toml", toml, {{"FULGUR_LOG_LEVEL", "warn"}, {"FULGUR_PLUGIN_PATH", ""}});
  INFO(run.output);
  CHECK(run.exit_code != 0);
  FULGUR_CHECK_CONTAINS(run.output, "the checkpoint '" + (dir / "ckpt" / "last.ckpt").string() +
                                        "' saved in the background ([trainer] async_checkpoint) failed");
  CHECK(fulgur::test::job::files_in(dir / "ckpt") == std::vector<std::string>{"epoch=0-step=2.ckpt", "last.ckpt"});
}

namespace {

// `keys`: a sharded checkpoint at `prefix` saved over an earlier one (dcp_storage.h): its .metadata
// and one data file per rank, each named __<rank>_0.<tag>.distcp.
void check_replaced_sharded(const std::vector<std::string>& keys, const std::string& prefix, int64_t ranks) {
  INFO(prefix);
  REQUIRE(keys.size() == static_cast<size_t>(ranks + 1));
  CHECK(keys[0] == prefix + ".metadata");
  for (int64_t r = 0; r < ranks; ++r) {
    INFO(keys[r + 1]);
    CHECK(keys[r + 1].starts_with(fmt::format("{}__{}_0.", prefix, r)));
    CHECK(keys[r + 1].ends_with(".distcp"));
    CHECK(keys[r + 1] != fmt::format("{}__{}_0.distcp", prefix, r));
  }
}

// fit_toml's run under fsdp on 2 processes, every rank writing its shards (state_dict_type = "sharded").
std::string fsdp_toml(std::string toml) {
  toml.insert(toml.find("[trainer]\n") + 10, "accelerator = \"cpu\"\nstrategy = \"fsdp\"\ndevices = 2\n");
  return toml + "\n[strategy]\nstate_dict_type = \"sharded\"\n";
}

}  // namespace

TEST_CASE("s3 storage: fsdp on 2 ranks saves sharded checkpoints to s3://, resumes from one, and Python reads it") {
  if (moto_missing()) return;
  TempDir dir;
  MotoServer server(dir);
  // The reference: two epochs on local disk, every checkpoint kept (DCP directories).
  const ProcessRun reference =
      fit(dir, "reference.toml",
          fsdp_toml(async_toml(fit_toml(dir / "ref", 2, (dir / "ref-ckpt").string(), ""), false)), server.env());
  REQUIRE_MESSAGE(reference.exit_code == 0, reference.output);

  // One epoch to s3://: each checkpoint a prefix holding each rank's data file and .metadata.
  const std::string dirpath = "s3://ckpts/fsdp";
  const ProcessRun first = fit(dir, "first.toml", fsdp_toml(fit_toml(dir / "a", 1, dirpath, "")), server.env());
  REQUIRE_MESSAGE(first.exit_code == 0, first.output);
  CHECK(server.keys("fsdp/epoch=0-step=4.ckpt/") == std::vector<std::string>{"fsdp/epoch=0-step=4.ckpt/.metadata",
                                                                             "fsdp/epoch=0-step=4.ckpt/__0_0.distcp",
                                                                             "fsdp/epoch=0-step=4.ckpt/__1_0.distcp"});
  // last.ckpt, saved at step 2 and again at step 4: the second save's data files have names of
  // their own, so step 2's stayed whole until step 4's .metadata replaced its own.
  check_replaced_sharded(server.keys("fsdp/last.ckpt/"), "fsdp/last.ckpt/", 2);
  CHECK(server.keys("fsdp/").size() == 6);

  // Python's own tool consolidates the downloaded prefix; every tensor equals the local run's.
  server.client({"getprefix", "fsdp/epoch=0-step=4.ckpt/", (dir / "downloaded").string()});
  const ProcessRun python =
      fulgur::test::run_process({FULGUR_TEST_PYTHON, "-c",
                                 "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                                 "dcp_to_torch_save(sys.argv[1], sys.argv[2])",
                                 (dir / "downloaded").string(), (dir / "consolidated.pt").string()},
                                {}, dir.path());
  REQUIRE_MESSAGE(python.exit_code == 0, python.output);
  std::map<std::string, at::Tensor> from_python, expected;
  flatten_tensors(fulgur::read_checkpoint_file((dir / "consolidated.pt").string()), "", from_python);
  flatten_tensors(c10::IValue(fulgur::test::job::checkpoint_dict(dir / "ref-ckpt" / "epoch=0-step=4.ckpt")), "",
                  expected);
  CHECK(from_python.size() == expected.size());
  CHECK(std::count_if(expected.begin(), expected.end(),
                      [](const auto& e) { return e.first.starts_with(".optimizer_states."); }) > 0);
  for (const auto& [key, tensor] : expected) {
    INFO(key);
    REQUIRE(from_python.count(key) == 1);
    CHECK(at::equal(from_python.at(key), tensor));
  }

  // Two processes resume from "last" (found by listing the prefix) and end where the reference did.
  const ProcessRun resumed = fit(dir, "resumed.toml", fsdp_toml(fit_toml(dir / "a", 2, dirpath, "last")), server.env());
  REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  CHECK(server.keys("fsdp/epoch=0-step=4.ckpt/").empty());  // save_top_k = 1 removed it
  server.client({"getprefix", "fsdp/last.ckpt/", (dir / "resumed-last").string()});
  const auto state = fulgur::test::job::checkpoint_dict(dir / "resumed-last");
  CHECK(state.at("global_step").toInt() == 8);
  CHECK(fulgur::test::job::same_weights(dir / "resumed-last", dir / "ref-ckpt" / "last.ckpt"));

  // fulgur checkpoint and fulgur weights take s3:// URLs for their inputs and outputs.
  auto fulgur_cli = [&](const std::vector<std::string>& args) {
    std::vector<std::string> command = {FULGUR_TEST_FULGUR_BIN};
    command.insert(command.end(), args.begin(), args.end());
    const ProcessRun run = fulgur::test::run_process(command, server.env(), dir.path());
    REQUIRE_MESSAGE(run.exit_code == 0, run.output);
    return run.output;
  };
  FULGUR_CHECK_CONTAINS(fulgur_cli({"checkpoint", "inspect", "s3://ckpts/fsdp/last.ckpt"}),
                        "s3://ckpts/fsdp/last.ckpt: distributed checkpoint");
  fulgur_cli({"checkpoint", "consolidate", "s3://ckpts/fsdp/last.ckpt", "s3://ckpts/whole/last.ckpt"});
  fulgur_cli({"weights", "convert", "s3://ckpts/whole/last.ckpt", "s3://ckpts/whole/model.safetensors"});
  CHECK(server.keys("whole/") == std::vector<std::string>{"whole/last.ckpt", "whole/model.safetensors"});
  FULGUR_CHECK_CONTAINS(fulgur_cli({"weights", "inspect", "s3://ckpts/whole/model.safetensors"}),
                        fmt::format("s3://ckpts/whole/model.safetensors: safetensors, {} tensors",
                                    state.at("state_dict").toGenericDict().size()));
  server.client({"get", "whole/last.ckpt", (dir / "whole.ckpt").string()});
  CHECK(fulgur::test::job::same_weights(dir / "whole.ckpt", dir / "ref-ckpt" / "last.ckpt"));
}

namespace {

// fit_toml's run, async, and killed by SIGKILL after step 5 (tests/fixtures: fixture_kill_at_step),
// when its step-4 save is still being written in the background.
std::string killed_async_toml(const fs::path& root, const fs::path& plugins, const std::string& dirpath, bool save_last,
                              const std::string& ckpt_path) {
  std::string text = fit_toml(root, 2, dirpath, ckpt_path);
  text.insert(text.find("[trainer]\n") + 10, "async_checkpoint = true\n");
  if (!save_last) text.replace(text.find("save_last = true"), 16, "save_last = false");
  return text + fmt::format(
                    "\n[plugins]\npaths = [\"{}\"]\n\n[[callbacks]]\nname = \"fixture_kill_at_step\"\nstep = 5\n"
                    "marker = \"{}\"\n",
                    plugins.string(), (root / "killed").string());
}

// The *.ckpt names in `dir` (a killed write may leave a hidden temporary beside them).
std::vector<std::string> checkpoint_names(const fs::path& dir) {
  std::vector<std::string> out;
  for (const std::string& name : fulgur::test::job::files_in(dir))
    if (name.ends_with(".ckpt") && !name.starts_with(".")) out.push_back(name);
  return out;
}

}  // namespace

TEST_CASE("async_checkpoint: SIGKILL while a save is in flight keeps the top-k file it replaces, and last resumes") {
  if (!FULGUR_TEST_FAULT_INJECTION) {
    fulgur::test::skip_test("this build has no fault injection (configure with -DFULGUR_FAULT_INJECTION=ON)");
    return;
  }
  TempDir dir;
  const fs::path plugins = fulgur::test::job::plugin_dir(dir, {"kill-at-step"});
  std::map<std::string, std::string> env = {{"FULGUR_LOG_LEVEL", "warn"}, {"FULGUR_PLUGIN_PATH", ""}};
  // Each background save waits 3 s before it writes: step 4's save (which replaces step 2's file,
  // save_top_k = 1) is surely still in flight when the process dies after step 5.
  std::map<std::string, std::string> delayed = env;
  delayed["FULGUR_FAULT_INJECT"] = "async_checkpoint_delay:3000";

  // Top-k only: step 2's file is complete (step 4's save waited for it), step 4's never was.
  const ProcessRun topk =
      fit(dir, "topk.toml", killed_async_toml(dir / "t", plugins, (dir / "topk").string(), false, ""), delayed);
  INFO(topk.output);
  REQUIRE(topk.exit_code == -SIGKILL);
  REQUIRE(fs::exists(dir / "t" / "killed"));
  CHECK(checkpoint_names(dir / "topk") == std::vector<std::string>{"epoch=0-step=2.ckpt"});
  CHECK(fulgur::test::job::checkpoint_dict(dir / "topk" / "epoch=0-step=2.ckpt").at("global_step").toInt() == 2);

  // With last.ckpt: "last" resolves to a complete checkpoint, and the resumed run ends where an
  // uninterrupted synchronous one does, bit for bit.
  const ProcessRun reference =
      fit(dir, "reference.toml", fit_toml(dir / "ref", 2, (dir / "ref-ckpt").string(), ""), env);
  REQUIRE_MESSAGE(reference.exit_code == 0, reference.output);
  const std::string last_dir = (dir / "last").string();
  const ProcessRun killed =
      fit(dir, "killed.toml", killed_async_toml(dir / "l", plugins, last_dir, true, "last"), delayed);
  INFO(killed.output);
  REQUIRE(killed.exit_code == -SIGKILL);
  const std::vector<std::string> at_kill = checkpoint_names(dir / "last");
  REQUIRE(std::count(at_kill.begin(), at_kill.end(), "last.ckpt") == 1);
  for (const std::string& name : at_kill) {
    INFO(name);
    CHECK(fulgur::test::job::checkpoint_dict(dir / "last" / name).at("global_step").toInt() > 0);
  }
  const ProcessRun resumed =
      fit(dir, "killed.toml", killed_async_toml(dir / "l", plugins, last_dir, true, "last"), env);
  REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  CHECK(fulgur::test::job::checkpoint_dict(dir / "last" / "last.ckpt").at("global_step").toInt() == 8);
  CHECK(fulgur::test::job::same_weights(dir / "last" / "last.ckpt", dir / "ref-ckpt" / "last.ckpt"));

  // On object storage, where moto_server is installed: the same window, the same answer.
  if (!fs::exists(moto_executable())) return;
  MotoServer server(dir);
  std::map<std::string, std::string> s3_env = server.env();
  s3_env["FULGUR_FAULT_INJECT"] = "async_checkpoint_delay:3000";
  const ProcessRun s3 =
      fit(dir, "s3.toml", killed_async_toml(dir / "s", plugins, "s3://ckpts/killed", false, ""), s3_env);
  INFO(s3.output);
  REQUIRE(s3.exit_code == -SIGKILL);
  CHECK(server.keys("killed/") == std::vector<std::string>{"killed/epoch=0-step=2.ckpt"});
}

namespace {

// A TCP forwarder in front of moto_server: killing it is the S3 server going away for the client,
// while the bucket behind it (moto keeps it in memory) stays to be inspected.
constexpr const char* kProxy = R"(
import socket, sys, threading
listen_port, target_port = int(sys.argv[1]), int(sys.argv[2])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", listen_port))
server.listen(64)
def pipe(source, target):
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            target.sendall(data)
    except OSError:
        pass
    try:
        target.shutdown(socket.SHUT_WR)
    except OSError:
        pass
while True:
    client, _ = server.accept()
    upstream = socket.create_connection(("127.0.0.1", target_port))
    threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
    threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
)";

}  // namespace

TEST_CASE("async_checkpoint: the S3 server killed during a background save fails the run, naming the checkpoint") {
  if (moto_missing()) return;
  if (!FULGUR_TEST_FAULT_INJECTION) {
    fulgur::test::skip_test("this build has no fault injection (configure with -DFULGUR_FAULT_INJECTION=ON)");
    return;
  }
  TempDir dir;
  MotoServer server(dir);
  const int moto_port = std::stoi(server.url().substr(server.url().rfind(':') + 1));
  const int proxy_port = free_port();
  fulgur::test::write_bytes(dir / "proxy.py", kProxy);
  const pid_t proxy = fulgur::test::spawn_process(
      {FULGUR_TEST_PYTHON, (dir / "proxy.py").string(), std::to_string(proxy_port), std::to_string(moto_port)}, {},
      dir.path(), dir / "proxy.log");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);  // safety nets only
  while (!listening(proxy_port)) {
    REQUIRE_MESSAGE(std::chrono::steady_clock::now() < until, fulgur::test::read_bytes(dir / "proxy.log"));
    timespec pause{0, 50'000'000};
    ::nanosleep(&pause, nullptr);
  }

  // One epoch, saves at steps 2 and 4 (save_top_k = 1, no last.ckpt), each held 8 s before it
  // writes: step 4's save starts when step 2's is complete, and the server goes while it waits.
  std::string toml = fit_toml(dir.path(), 1, "s3://ckpts/gone", "");
  toml.insert(toml.find("[trainer]\n") + 10, "async_checkpoint = true\n");
  toml.replace(toml.find("save_last = true"), 16, "save_last = false");
  fulgur::test::write_bytes(dir / "gone.toml", toml);
  std::map<std::string, std::string> env = server.env();
  env["AWS_ENDPOINT_URL"] = fmt::format("http://127.0.0.1:{}", proxy_port);
  env["FULGUR_FAULT_INJECT"] = "async_checkpoint_delay:8000";
  env["FULGUR_S3_MAX_RETRIES"] = "1";
  const pid_t run = fulgur::test::spawn_process({FULGUR_TEST_FULGUR_BIN, "fit", "--config", "gone.toml"}, env,
                                                dir.path(), dir / "gone.log");
  while (server.keys("gone/").empty()) {
    int status = 0;
    REQUIRE_MESSAGE(::waitpid(run, &status, WNOHANG) == 0, fulgur::test::read_bytes(dir / "gone.log"));
    REQUIRE_MESSAGE(std::chrono::steady_clock::now() < until, "step 2's checkpoint never arrived");
  }
  ::kill(proxy, SIGKILL);
  int proxy_status = 0;
  ::waitpid(proxy, &proxy_status, 0);

  int status = 0;
  REQUIRE(::waitpid(run, &status, 0) == run);
  const std::string output = fulgur::test::read_bytes(dir / "gone.log");
  INFO(output);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) != 0);
  FULGUR_CHECK_CONTAINS(output,
                        "the checkpoint 's3://ckpts/gone/epoch=0-step=4.ckpt' saved in the background "
                        "([trainer] async_checkpoint) failed");
  FULGUR_CHECK_CONTAINS(output, "cannot reach");
  // The previous checkpoint is whole and still there: its removal waited for a save that failed.
  CHECK(server.keys("gone/") == std::vector<std::string>{"gone/epoch=0-step=2.ckpt"});
  server.client({"get", "gone/epoch=0-step=2.ckpt", (dir / "previous.ckpt").string()});
  CHECK(fulgur::test::job::checkpoint_dict(dir / "previous.ckpt").at("global_step").toInt() == 2);
}

TEST_CASE("s3 storage: the csv and tensorboard loggers' files go to save_dir = s3://, staged and uploaded") {
  if (moto_missing()) return;
  TempDir dir;
  MotoServer server(dir);
  auto toml = [&](const fs::path& root) {
    return fit_toml(root, 1, (root / "ckpt").string(), "") +
           "\n[[loggers]]\nlogger = \"csv\"\nsave_dir = \"s3://ckpts/logs\"\nflush_logs_every_n_steps = 2\n\n"
           "[[loggers]]\nlogger = \"tensorboard\"\nsave_dir = \"s3://ckpts/logs\"\n";
  };
  const ProcessRun first = fit(dir, "first.toml", toml(dir / "a"), server.env());
  REQUIRE_MESSAGE(first.exit_code == 0, first.output);
  // Staged under default_root_dir (log_dir), uploaded whole: the objects are the local files.
  const fs::path staged = dir / "a" / "runs" / "lightning_logs" / "version_0";
  const std::vector<std::string> keys = server.keys("logs/");
  REQUIRE(keys.size() == 3);
  CHECK(keys[0] ==
        "logs/lightning_logs/version_0/events.out.tfevents." + keys[0].substr(keys[0].rfind("tfevents.") + 9));
  CHECK(keys[1] == "logs/lightning_logs/version_0/hparams.yaml");
  CHECK(keys[2] == "logs/lightning_logs/version_0/metrics.csv");
  for (const std::string& key : keys) {
    INFO(key);
    const std::string name = key.substr(key.rfind('/') + 1);
    server.client({"get", key, (dir / name).string()});
    CHECK(fulgur::test::read_bytes(dir / name) == fulgur::test::read_bytes(staged / name));
  }
  CHECK(fulgur::test::read_csv(dir / "metrics.csv").at("step").size() >= 2);
  FULGUR_CHECK_CONTAINS(fulgur::test::read_bytes(dir / "hparams.yaml"), "model.lr: 0.002");

  // A second run in a fresh local directory takes the next version on the bucket.
  const ProcessRun second = fit(dir, "second.toml", toml(dir / "b"), server.env());
  REQUIRE_MESSAGE(second.exit_code == 0, second.output);
  CHECK(server.keys("logs/lightning_logs/version_1/").size() == 3);
  CHECK(fs::exists(dir / "b" / "runs" / "lightning_logs" / "version_1" / "metrics.csv"));
}

TEST_CASE("s3 storage: fsdp ranks SIGKILLed while they replace a sharded last.ckpt leave the previous one whole") {
  if (moto_missing()) return;
  if (!FULGUR_TEST_FAULT_INJECTION) {
    fulgur::test::skip_test("this build has no fault injection (configure with -DFULGUR_FAULT_INJECTION=ON)");
    return;
  }
  TempDir dir;
  MotoServer server(dir);
  const ProcessRun reference =
      fit(dir, "reference.toml", fsdp_toml(fit_toml(dir / "ref", 2, (dir / "ref-ckpt").string(), "")), server.env());
  REQUIRE_MESSAGE(reference.exit_code == 0, reference.output);

  // Each rank's second data file of last.ckpt (step 4's, replacing step 2's) dies half sent.
  const std::string dirpath = "s3://ckpts/sharded";
  std::map<std::string, std::string> env = server.env();
  env["FULGUR_FAULT_INJECT"] = "s3_upload:2:last.ckpt/__";
  const ProcessRun killed = fit(dir, "killed.toml", fsdp_toml(fit_toml(dir / "k", 2, dirpath, "")), env);
  INFO(killed.output);
  REQUIRE(killed.exit_code != 0);
  // Step 2's last.ckpt is whole: its .metadata and the data files it names.
  const std::vector<std::string> last = server.keys("sharded/last.ckpt/");
  CHECK(last == std::vector<std::string>{"sharded/last.ckpt/.metadata", "sharded/last.ckpt/__0_0.distcp",
                                         "sharded/last.ckpt/__1_0.distcp"});
  server.client({"getprefix", "sharded/last.ckpt/", (dir / "at-kill").string()});
  CHECK(fulgur::test::job::checkpoint_dict(dir / "at-kill").at("global_step").toInt() == 2);

  // Two new processes resume from it and end where the uninterrupted run did; the replaced files
  // went once the new .metadata was in place.
  const ProcessRun resumed = fit(dir, "resumed.toml", fsdp_toml(fit_toml(dir / "k", 2, dirpath, "last")), server.env());
  REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  check_replaced_sharded(server.keys("sharded/last.ckpt/"), "sharded/last.ckpt/", 2);
  server.client({"getprefix", "sharded/last.ckpt/", (dir / "final").string()});
  CHECK(fulgur::test::job::checkpoint_dict(dir / "final").at("global_step").toInt() == 8);
  CHECK(fulgur::test::job::same_weights(dir / "final", dir / "ref-ckpt" / "last.ckpt"));
}

namespace {

// fit_toml's run under ddp on 2 processes (Gloo), every checkpoint kept, no last.ckpt.
std::string ddp_async_toml(const fs::path& root, const std::string& dirpath, bool async) {
  std::string toml = async_toml(fit_toml(root, 2, dirpath, ""), async);
  toml.replace(toml.find("save_last = true"), 16, "save_last = false");
  toml.insert(toml.find("[trainer]\n") + 10, "accelerator = \"cpu\"\nstrategy = \"ddp\"\ndevices = 2\n");
  return toml;
}

constexpr const char* kSavedSynchronously = "saves its checkpoints synchronously";

}  // namespace

TEST_CASE("async_checkpoint: ddp on 2 ranks writes in the background what a synchronous run writes, local and s3") {
  TempDir dir;
  std::map<std::string, std::string> env = {{"FULGUR_LOG_LEVEL", "warn"}, {"FULGUR_PLUGIN_PATH", ""}};
  const ProcessRun sync = fit(dir, "sync.toml", ddp_async_toml(dir / "s", (dir / "sync").string(), false), env);
  REQUIRE_MESSAGE(sync.exit_code == 0, sync.output);
  // Each background save waits 300 ms before it writes (where the build has the seam): the next
  // steps, and their gradient all-reduces, surely run meanwhile.
  if (FULGUR_TEST_FAULT_INJECTION) env["FULGUR_FAULT_INJECT"] = "async_checkpoint_delay:300";
  const ProcessRun async = fit(dir, "async.toml", ddp_async_toml(dir / "a", (dir / "async").string(), true), env);
  REQUIRE_MESSAGE(async.exit_code == 0, async.output);
  INFO(async.output);
  // Saved in the background (ddp offers fulgur.strategy.async_save/1), not synchronously.
  CHECK(!contains(async.output, kSavedSynchronously));
  const std::vector<std::string> names = fulgur::test::job::files_in(dir / "sync");
  REQUIRE(names == std::vector<std::string>{"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt",
                                            "epoch=1-step=8.ckpt"});
  CHECK(fulgur::test::job::files_in(dir / "async") == names);
  for (const std::string& name : names) {
    INFO(name);
    check_same_tensors(dir / "async" / name, dir / "sync" / name);
  }

  // The same to object storage, where moto_server is installed.
  if (!fs::exists(moto_executable())) return;
  MotoServer server(dir);
  std::map<std::string, std::string> s3_env = server.env();
  if (FULGUR_TEST_FAULT_INJECTION) s3_env["FULGUR_FAULT_INJECT"] = "async_checkpoint_delay:300";
  const ProcessRun s3 = fit(dir, "s3.toml", ddp_async_toml(dir / "3", "s3://ckpts/ddp", true), s3_env);
  REQUIRE_MESSAGE(s3.exit_code == 0, s3.output);
  CHECK(!contains(s3.output, kSavedSynchronously));
  std::vector<std::string> keys;
  for (const std::string& name : names) keys.push_back("ddp/" + name);
  CHECK(server.keys("ddp/") == keys);
  for (const std::string& name : names) {
    INFO(name);
    server.client({"get", "ddp/" + name, (dir / ("s3-" + name)).string()});
    check_same_tensors(dir / ("s3-" + name), dir / "sync" / name);
  }
}

TEST_CASE("async_checkpoint: a background save failing on one ddp rank fails every rank, naming checkpoint and rank") {
  if (!FULGUR_TEST_FAULT_INJECTION) {
    fulgur::test::skip_test("this build has no fault injection (configure with -DFULGUR_FAULT_INJECTION=ON)");
    return;
  }
  TempDir dir;
  // save_top_k = 1: step 4's save replaces step 2's file. Rank 1's part of it (the second
  // background save there) fails; step 6's save finds out, on both ranks.
  std::string toml = ddp_async_toml(dir.path(), (dir / "ckpt").string(), true);
  toml.replace(toml.find("save_top_k = -1"), 15, "save_top_k = 1");
  const ProcessRun run = fit(
      dir, "failing.toml", toml,
      {{"FULGUR_LOG_LEVEL", "warn"}, {"FULGUR_PLUGIN_PATH", ""}, {"FULGUR_FAULT_INJECT", "async_checkpoint_fail:1:2"}});
  INFO(run.output);
  CHECK(run.exit_code != 0);
  const std::string named = "the checkpoint '" + (dir / "ckpt" / "epoch=0-step=4.ckpt").string() +
                            "' saved in the background ([trainer] async_checkpoint) failed on rank 1";
  // Both ranks fail with this message (rank 0 learns rank 1's reason from it).
  FULGUR_CHECK_CONTAINS(run.output, named + ": injected failure of background save 2 on rank 1");
  // The checkpoint step 4's was to replace is still there and whole: its removal waited for a save
  // that failed.
  const std::vector<std::string> files = fulgur::test::job::files_in(dir / "ckpt");
  REQUIRE(std::count(files.begin(), files.end(), "epoch=0-step=2.ckpt") == 1);
  CHECK(fulgur::test::job::checkpoint_dict(dir / "ckpt" / "epoch=0-step=2.ckpt").at("global_step").toInt() == 2);
  CHECK(std::count(files.begin(), files.end(), "epoch=0-step=6.ckpt") == 0);
}

namespace {

// fit_toml's run under fsdp on 2 processes writing sharded (DCP) checkpoints, every one kept, no
// last.ckpt.
std::string fsdp_async_toml(const fs::path& root, const std::string& dirpath, bool async) {
  std::string toml = async_toml(fit_toml(root, 2, dirpath, ""), async);
  toml.replace(toml.find("save_last = true"), 16, "save_last = false");
  return fsdp_toml(toml);
}

}  // namespace

TEST_CASE("async_checkpoint: fsdp on 2 ranks writes sharded checkpoints in the background as sync does, local and s3") {
  TempDir dir;
  std::map<std::string, std::string> env = {{"FULGUR_LOG_LEVEL", "warn"}, {"FULGUR_PLUGIN_PATH", ""}};
  const ProcessRun sync = fit(dir, "sync.toml", fsdp_async_toml(dir / "s", (dir / "sync").string(), false), env);
  REQUIRE_MESSAGE(sync.exit_code == 0, sync.output);
  if (FULGUR_TEST_FAULT_INJECTION) env["FULGUR_FAULT_INJECT"] = "async_checkpoint_delay:300";
  const ProcessRun async = fit(dir, "async.toml", fsdp_async_toml(dir / "a", (dir / "async").string(), true), env);
  REQUIRE_MESSAGE(async.exit_code == 0, async.output);
  INFO(async.output);
  CHECK(!contains(async.output, kSavedSynchronously));
  const std::vector<std::string> names = fulgur::test::job::files_in(dir / "sync");
  REQUIRE(names == std::vector<std::string>{"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt",
                                            "epoch=1-step=8.ckpt"});
  // Each a DCP directory with every rank's data file and .metadata; no temporary directory left.
  CHECK(fulgur::test::job::files_in(dir / "async") == names);
  for (const auto& entry : fs::directory_iterator(dir / "async"))
    CHECK(!entry.path().filename().string().starts_with("."));
  for (const std::string& name : names) {
    INFO(name);
    CHECK(fs::exists(dir / "async" / name / ".metadata"));
    check_same_tensors(dir / "async" / name, dir / "sync" / name);
  }

  // The same to object storage, where moto_server is installed: each checkpoint a prefix.
  if (!fs::exists(moto_executable())) return;
  MotoServer server(dir);
  std::map<std::string, std::string> s3_env = server.env();
  if (FULGUR_TEST_FAULT_INJECTION) s3_env["FULGUR_FAULT_INJECT"] = "async_checkpoint_delay:300";
  const ProcessRun s3 = fit(dir, "s3.toml", fsdp_async_toml(dir / "3", "s3://ckpts/fsdp", true), s3_env);
  REQUIRE_MESSAGE(s3.exit_code == 0, s3.output);
  CHECK(!contains(s3.output, kSavedSynchronously));
  std::vector<std::string> keys;
  for (const std::string& name : names)
    for (const char* file : {"/.metadata", "/__0_0.distcp", "/__1_0.distcp"}) keys.push_back("fsdp/" + name + file);
  CHECK(server.keys("fsdp/") == keys);
  for (const std::string& name : names) {
    INFO(name);
    server.client({"getprefix", "fsdp/" + name + "/", (dir / ("s3-" + name)).string()});
    check_same_tensors(dir / ("s3-" + name), dir / "sync" / name);
  }
}

TEST_CASE("async_checkpoint: a sharded fsdp save failing on one rank fails every rank and leaves no checkpoint") {
  if (!FULGUR_TEST_FAULT_INJECTION) {
    fulgur::test::skip_test("this build has no fault injection (configure with -DFULGUR_FAULT_INJECTION=ON)");
    return;
  }
  TempDir dir;
  std::string toml = fsdp_async_toml(dir.path(), (dir / "ckpt").string(), true);
  toml.replace(toml.find("save_top_k = -1"), 15, "save_top_k = 1");
  const ProcessRun run = fit(
      dir, "failing.toml", toml,
      {{"FULGUR_LOG_LEVEL", "warn"}, {"FULGUR_PLUGIN_PATH", ""}, {"FULGUR_FAULT_INJECT", "async_checkpoint_fail:1:2"}});
  INFO(run.output);
  CHECK(run.exit_code != 0);
  const std::string named = "the checkpoint '" + (dir / "ckpt" / "epoch=0-step=4.ckpt").string() +
                            "' saved in the background ([trainer] async_checkpoint) failed on rank 1";
  FULGUR_CHECK_CONTAINS(run.output, named + ": injected failure of background save 2 on rank 1");
  // Step 4's checkpoint does not exist (rank 0's data file went with the temporary directory);
  // step 2's, which it was to replace, is whole.
  std::vector<std::string> entries;
  for (const auto& entry : fs::directory_iterator(dir / "ckpt")) entries.push_back(entry.path().filename().string());
  CHECK(entries == std::vector<std::string>{"epoch=0-step=2.ckpt"});
  CHECK(fulgur::test::job::checkpoint_dict(dir / "ckpt" / "epoch=0-step=2.ckpt").at("global_step").toInt() == 2);

  // The same on object storage: step 4's prefix holds nothing (no .metadata, no data files).
  if (!fs::exists(moto_executable())) return;
  MotoServer server(dir);
  std::string s3_toml = fsdp_async_toml(dir / "3", "s3://ckpts/failing", true);
  s3_toml.replace(s3_toml.find("save_top_k = -1"), 15, "save_top_k = 1");
  std::map<std::string, std::string> env = server.env();
  env["FULGUR_FAULT_INJECT"] = "async_checkpoint_fail:1:2";
  const ProcessRun s3 = fit(dir, "s3.toml", s3_toml, env);
  INFO(s3.output);
  CHECK(s3.exit_code != 0);
  FULGUR_CHECK_CONTAINS(s3.output,
                        "the checkpoint 's3://ckpts/failing/epoch=0-step=4.ckpt' saved in the background "
                        "([trainer] async_checkpoint) failed on rank 1: injected failure");
  CHECK(server.keys("failing/") == std::vector<std::string>{"failing/epoch=0-step=2.ckpt/.metadata",
                                                            "failing/epoch=0-step=2.ckpt/__0_0.distcp",
                                                            "failing/epoch=0-step=2.ckpt/__1_0.distcp"});
  server.client({"getprefix", "failing/epoch=0-step=2.ckpt/", (dir / "s3-step2").string()});
  CHECK(fulgur::test::job::checkpoint_dict(dir / "s3-step2").at("global_step").toInt() == 2);
}

TEST_CASE("async_checkpoint: fsdp on 2 ranks writes full-state checkpoints in the background, as a synchronous run") {
  TempDir dir;
  // state_dict_type = "full" (the default): rank 0 writes one file of gathered tensors.
  auto full_toml = [](const fs::path& root, const std::string& dirpath, bool async) {
    std::string toml = fsdp_async_toml(root, dirpath, async);
    return toml.replace(toml.find("state_dict_type = \"sharded\""), 27, "state_dict_type = \"full\"");
  };
  std::map<std::string, std::string> env = {{"FULGUR_LOG_LEVEL", "warn"}, {"FULGUR_PLUGIN_PATH", ""}};
  const ProcessRun sync = fit(dir, "sync.toml", full_toml(dir / "s", (dir / "sync").string(), false), env);
  REQUIRE_MESSAGE(sync.exit_code == 0, sync.output);
  if (FULGUR_TEST_FAULT_INJECTION) env["FULGUR_FAULT_INJECT"] = "async_checkpoint_delay:300";
  const ProcessRun async = fit(dir, "async.toml", full_toml(dir / "a", (dir / "async").string(), true), env);
  REQUIRE_MESSAGE(async.exit_code == 0, async.output);
  INFO(async.output);
  CHECK(!contains(async.output, kSavedSynchronously));
  const std::vector<std::string> names = fulgur::test::job::files_in(dir / "sync");
  REQUIRE(names.size() == 4);
  CHECK(fulgur::test::job::files_in(dir / "async") == names);
  for (const std::string& name : names) {
    INFO(name);
    CHECK(fs::is_regular_file(dir / "async" / name));
    check_same_tensors(dir / "async" / name, dir / "sync" / name);
  }
}

// ---- Storage plugins (SDK 1.5): a plugin kind named after its URL scheme, configured by [storage] ----

namespace {

// This process's AWS variables unset (an earlier test in it may have set them).
void clear_aws_environment() {
  for (const char* name : {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                           "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "FULGUR_S3_PART_SIZE"})
    ::unsetenv(name);
}

// The third-party example's mirror:// storage plugin, alone in a directory of its own (the
// fixture directory also holds plugins that are broken on purpose).
fs::path mirror_plugin_directory(const TempDir& dir) {
  const fs::path plugins = dir / "plugins";
  fs::create_directories(plugins);
  fs::copy_file(fulgur::test::fixture("libfulgur-fixture-mirror-storage.so"), plugins / "libfulgur-mirror.so");
  return plugins;
}

// fit_toml's run with its checkpoints at `dirpath`, the mirror plugin on the search path and the
// given [storage] table.
std::string mirror_toml(const TempDir& dir, int max_epochs, const std::string& ckpt_path, const std::string& storage) {
  return fmt::format("[plugins]\npaths = [\"{}\"]\n\n{}\n{}", (dir / "plugins").string(),
                     fit_toml(dir.path(), max_epochs, "mirror://bucket/run", ckpt_path), storage);
}

}  // namespace

TEST_CASE("storage plugins: the kit's conformance check passes on local files, mirror:// and s3:// (moto)") {
  TempDir dir;
  kit::check_storage_conformance(std::shared_ptr<fulgur::Storage>(&fulgur::local_storage(), [](fulgur::Storage*) {}),
                                 (dir / "local").string() + "/");
  const fs::path plugins = mirror_plugin_directory(dir);
  kit::check_storage_conformance(
      kit::create_plugin<fulgur::Storage>(fulgur::PluginKind::storage, "mirror", {{"root", (dir / "store").string()}},
                                          {plugins.string()}),
      "mirror://bucket/");
  CHECK(fs::is_directory(dir / "store" / "bucket" / "kit"));  // it wrote below its root, then cleaned up

  // A broken storage fails the check, saying what: a storage whose remove() does nothing.
  struct ForgetfulStorage final : fulgur::Storage {
    explicit ForgetfulStorage(fulgur::Storage& inner) : inner(inner) {}
    void write(const std::string& u, std::string_view b) override { inner.write(u, b); }
    std::string read(const std::string& u) override { return inner.read(u); }
    std::string read_range(const std::string& u, uint64_t o, uint64_t n) override { return inner.read_range(u, o, n); }
    std::vector<fulgur::StorageObject> list(const std::string& p) override { return inner.list(p); }
    bool remove(const std::string&) override { return true; }
    std::optional<fulgur::StorageObject> stat(const std::string& u) override { return inner.stat(u); }
    fulgur::Storage& inner;
  };
  try {
    kit::check_storage_conformance(std::make_shared<ForgetfulStorage>(fulgur::local_storage()),
                                   (dir / "broken").string() + "/");
    FAIL("a storage whose remove() does nothing passed the conformance check");
  } catch (const std::runtime_error& e) {
    FULGUR_CHECK_CONTAINS(e.what(), "remove() of a missing object answers false");
  }

  if (moto_missing()) return;
  MotoServer server(dir);
  // No credentials in this process's environment (an earlier test may have set some): they come
  // from the plugin's options.
  clear_aws_environment();
  const std::map<std::string, std::string> env = server.profile_env("kit");
  kit::check_storage_conformance(
      kit::create_plugin<fulgur::Storage>(fulgur::PluginKind::storage, "s3",
                                          {{"endpoint", server.url()},
                                           {"credentials_file", env.at("AWS_SHARED_CREDENTIALS_FILE")},
                                           {"profile", std::string("kit")}}),
      "s3://ckpts/conformance/");
}

TEST_CASE("storage plugins: fulgur fit keeps checkpoints on a third-party mirror:// storage and resumes from it") {
  TempDir dir;
  mirror_plugin_directory(dir);
  const std::string storage = "\n[storage]\nname = \"mirror\"\nroot = \"store\"\n";
  const ProcessRun first = fit(dir, "first.toml", mirror_toml(dir, 1, "", storage), {{"FULGUR_PLUGIN_PATH", ""}});
  REQUIRE_MESSAGE(first.exit_code == 0, first.output);
  // `root` is a path option: relative to the TOML's directory.
  CHECK(fs::exists(dir / "store" / "bucket" / "run" / "last.ckpt"));
  CHECK(fs::exists(dir / "store" / "bucket" / "run" / "epoch=0-step=4.ckpt"));
  CHECK(!fs::exists(dir / "store" / "bucket" / "run" / "epoch=0-step=2.ckpt"));  // top-k deleted through it

  // "last" is found by listing mirror://bucket/run; the run goes on from step 4.
  const ProcessRun resumed = fit(dir, "resumed.toml", mirror_toml(dir, 2, "last", storage),
                                 {{"FULGUR_PLUGIN_PATH", ""}, {"FULGUR_LOG_LEVEL", "info"}});
  REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  FULGUR_CHECK_CONTAINS(resumed.output, "Restored training state from mirror://bucket/run/last.ckpt");
  CHECK(fulgur::test::job::checkpoint_dict(dir / "store" / "bucket" / "run" / "last.ckpt").at("global_step").toInt() ==
        8);
  // The saved config records the [storage] table, so a rerun from it reaches the same store.
  const fs::path saved = dir / "runs" / "lightning_logs" / "version_1" / "config.toml";
  REQUIRE(fs::exists(saved));
  FULGUR_CHECK_CONTAINS(fulgur::test::read_bytes(saved), "[storage]\nname = \"mirror\"");

  // Mistakes in the table are named before anything trains: a misspelt key, a missing required
  // one, a plugin that does not exist, and a URL whose scheme no plugin serves.
  const ProcessRun typo =
      fit(dir, "typo.toml", mirror_toml(dir, 1, "", "\n[storage]\nname = \"mirror\"\nrot = \"s\"\n"),
          {{"FULGUR_PLUGIN_PATH", ""}});
  CHECK(typo.exit_code != 0);
  FULGUR_CHECK_CONTAINS(typo.output, "unknown key 'rot' for storage 'mirror'; did you mean 'root'?");
  const ProcessRun missing = fit(dir, "missing.toml", mirror_toml(dir, 1, "", "\n[storage]\nname = \"mirror\"\n"),
                                 {{"FULGUR_PLUGIN_PATH", ""}});
  CHECK(missing.exit_code != 0);
  FULGUR_CHECK_CONTAINS(missing.output, "root");
  const ProcessRun unknown = fit(dir, "unknown.toml", mirror_toml(dir, 1, "", "\n[storage]\nname = \"mirorr\"\n"),
                                 {{"FULGUR_PLUGIN_PATH", ""}});
  CHECK(unknown.exit_code != 0);
  FULGUR_CHECK_CONTAINS(unknown.output, "did you mean 'mirror'");
  std::string other = mirror_toml(dir, 1, "", "");
  other.replace(other.find("mirror://bucket/run"), 19, "gcs://bucket/run");
  const ProcessRun scheme = fit(dir, "scheme.toml", other, {{"FULGUR_PLUGIN_PATH", ""}});
  CHECK(scheme.exit_code != 0);
  FULGUR_CHECK_CONTAINS(scheme.output, "no storage plugin serves gcs:// URLs");
  FULGUR_CHECK_CONTAINS(scheme.output, "mirror://");  // the storage plugins that do exist
}

TEST_CASE("storage plugins: a pre-1.5 storage library (FULGUR_STORAGE_BACKEND, no note) still loads by file name") {
  TempDir dir;
  const fs::path plugins = dir / "plugins";
  fs::create_directories(plugins);
  fs::copy_file(fulgur::test::fixture("libfulgur-fixture-legacy-storage.so"), plugins / "libfulgur-storage-legacy.so");
  fulgur::install_storage_loader({{plugins, "test"}}, /*allow_writable=*/false);
  fulgur::Storage& legacy = fulgur::storage_for("legacy://bucket/key");
  legacy.write("legacy://bucket/key", "kept");
  CHECK(legacy.read("legacy://bucket/key") == "kept");
  CHECK(&fulgur::storage_for("legacy://bucket/other") == &legacy);  // one instance per scheme
}

TEST_CASE("s3 storage: the [storage] table configures endpoint, credentials and part size over the environment") {
  if (moto_missing()) return;
  TempDir dir;
  MotoServer server(dir);
  const std::map<std::string, std::string> profile = server.profile_env("kit");
  clear_aws_environment();  // for the plugins this process creates below
  // The environment has no endpoint and no key: everything comes from [storage].
  std::map<std::string, std::string> env = server.env();
  env["AWS_ENDPOINT_URL"] = "";
  env["AWS_ACCESS_KEY_ID"] = "";
  env["AWS_SECRET_ACCESS_KEY"] = "";
  env["AWS_SHARED_CREDENTIALS_FILE"] = "/nonexistent/credentials";
  const std::string storage =
      fmt::format("\n[storage]\nname = \"s3\"\nendpoint = \"{}/\"\ncredentials_file = \"{}\"\nprofile = \"kit\"\n",
                  server.url(), profile.at("AWS_SHARED_CREDENTIALS_FILE"));
  const ProcessRun run =
      fit(dir, "configured.toml", fit_toml(dir.path(), 1, "s3://ckpts/configured", "") + storage, env);
  REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  CHECK(server.keys("configured/") ==
        std::vector<std::string>{"configured/epoch=0-step=4.ckpt", "configured/last.ckpt"});
  // Without the table, the same environment reaches AWS itself and finds no credentials file.
  const ProcessRun bare = fit(dir, "bare.toml", fit_toml(dir.path(), 1, "s3://ckpts/bare", ""), env);
  CHECK(bare.exit_code != 0);
  FULGUR_CHECK_CONTAINS(bare.output, "s3: no credentials");

  // `fulgur weights` and `fulgur checkpoint` take [storage] from the run's TOML with --config; without
  // it they read the same environment as the bare run and find no credentials either.
  const auto fulgur_cli = [&](std::vector<std::string> args) {
    args.insert(args.begin(), FULGUR_TEST_FULGUR_BIN);
    return fulgur::test::run_process(args, env, dir.path());
  };
  const ProcessRun inspected =
      fulgur_cli({"weights", "inspect", "s3://ckpts/configured/last.ckpt", "--config", "configured.toml"});
  REQUIRE_MESSAGE(inspected.exit_code == 0, inspected.output);
  FULGUR_CHECK_CONTAINS(inspected.output, "s3://ckpts/configured/last.ckpt: torch.save, 4 tensors");
  const ProcessRun converted =
      fulgur_cli({"weights", "convert", "--config", "configured.toml", "s3://ckpts/configured/last.ckpt",
                  "s3://ckpts/configured/model.safetensors"});
  REQUIRE_MESSAGE(converted.exit_code == 0, converted.output);
  CHECK(server.keys("configured/") == std::vector<std::string>{"configured/epoch=0-step=4.ckpt", "configured/last.ckpt",
                                                               "configured/model.safetensors"});
  const ProcessRun unconfigured = fulgur_cli({"weights", "inspect", "s3://ckpts/configured/last.ckpt"});
  CHECK(unconfigured.exit_code != 0);
  FULGUR_CHECK_CONTAINS(unconfigured.output, "s3: no credentials");
  // A flag these commands do not take is refused, not ignored.
  const ProcessRun flagged = fulgur_cli({"checkpoint", "inspect", "s3://ckpts/configured", "--all"});
  CHECK(flagged.exit_code != 0);
  FULGUR_CHECK_CONTAINS(flagged.output, "fulgur checkpoint takes no flag but --config");
  // A [storage] value the plugin refuses fails before any download, naming the table.
  fulgur::test::write_bytes(dir / "bad-storage.toml", "[storage]\nname = \"s3\"\npart_size_mb = 3\n");
  const ProcessRun bad =
      fulgur_cli({"weights", "inspect", "s3://ckpts/configured/last.ckpt", "--config", "bad-storage.toml"});
  CHECK(bad.exit_code != 0);
  FULGUR_CHECK_CONTAINS(bad.output, "storage 's3'");
  FULGUR_CHECK_CONTAINS(bad.output, "S3 parts are 5 to 5120 MiB");

  // part_size_mb: 6 MiB in parts of 5 MiB is a 2-part upload (S3's ETag ends in "-2").
  const auto s3 = [&](std::vector<std::pair<std::string, fulgur::OptionValue>> options) {
    options.emplace_back("endpoint", server.url());
    options.emplace_back("credentials_file", profile.at("AWS_SHARED_CREDENTIALS_FILE"));
    options.emplace_back("profile", std::string("kit"));
    return kit::create_plugin<fulgur::Storage>(fulgur::PluginKind::storage, "s3", options);
  };
  s3({{"part_size_mb", int64_t{5}}})->write("s3://ckpts/parts/six.bin", std::string(6 << 20, 'x'));
  FULGUR_CHECK_CONTAINS(server.client({"etag", "parts/six.bin"}), "-2\"");
  s3({})->write("s3://ckpts/parts/one.bin", std::string(6 << 20, 'x'));  // default 64 MiB: one PUT
  const std::string single = server.client({"etag", "parts/one.bin"});
  CHECK(single.substr(0, single.find('\n')).find('-') == std::string::npos);  // a multipart ETag ends in -<parts>

  // max_retries = 0 against a port nobody listens on: one attempt, then the error says so.
  const auto unreachable =
      kit::create_plugin<fulgur::Storage>(fulgur::PluginKind::storage, "s3",
                                          {{"endpoint", fmt::format("http://127.0.0.1:{}", free_port())},
                                           {"max_retries", int64_t{0}},
                                           {"credentials_file", profile.at("AWS_SHARED_CREDENTIALS_FILE")},
                                           {"profile", std::string("kit")}});
  FULGUR_CHECK_CONTAINS(fulgur::test::error_from([&] { unreachable->read("s3://ckpts/x"); }).what(), "after 0 retries");

  // Values the plugin refuses, each with what is accepted.
  const auto refused = [&](const std::string& key, fulgur::OptionValue value) {
    try {
      s3({{key, std::move(value)}});
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  FULGUR_CHECK_CONTAINS(fulgur::test::error_from([&] {
                          kit::create_plugin<fulgur::Storage>(fulgur::PluginKind::storage, "s3",
                                                              {{"endpoint", std::string("127.0.0.1:9000")}});
                        }).what(),
                        "is not a URL: write http://host:port");
  FULGUR_CHECK_CONTAINS(refused("part_size_mb", int64_t{3}), "S3 parts are 5 to 5120 MiB");
  FULGUR_CHECK_CONTAINS(refused("max_retries", int64_t{500}), "at most 100");
  FULGUR_CHECK_CONTAINS(refused("connect_timeout_s", int64_t{0}), "at least 1 second");
  FULGUR_CHECK_CONTAINS(refused("stall_timeout_s", int64_t{0}), "at least 1 second");
}
