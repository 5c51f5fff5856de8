// Helpers shared by the test files: temporary plugin directories, fixture libraries, byte patches.
#pragma once

#include <fulgur/error.h>

#include <doctest/doctest.h>

#include <fcntl.h>
#include <ftw.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace fulgur::test {

namespace fs = std::filesystem;

// Where tests/fixtures/CMakeLists.txt puts the fixture plugin libraries.
inline fs::path fixture(std::string_view file) {
  fs::path path = fs::path(FULGUR_TEST_FIXTURE_DIR) / file;
  REQUIRE_MESSAGE(fs::exists(path), "fixture missing (build the fulgur_tests target): " << path.string());
  return path;
}

// A private 0755 directory, removed with everything in it at scope exit. Mode bits are set
// explicitly: the registry refuses group- or world-writable plugin directories, and the umask of
// whoever runs the tests must not decide the outcome.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "fulgur-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = pattern;
    fs::permissions(path_, fs::perms(0755));
  }
  ~TempDir() {
    // Not std::filesystem::remove_all: libtorch.so exports its own copy, built with GCC 13, which
    // calls a libstdc++ 13 function through a weak reference; with Debian 12's libstdc++ that
    // reference is null and remove_all jumps to address 0 (SIGSEGV).
    std::error_code ec;
    fs::permissions(path_, fs::perms(0755), ec);
    ::nftw(
        path_.c_str(), [](const char* file, const struct stat*, int, FTW*) { return std::remove(file); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const fs::path& path() const { return path_; }
  fs::path operator/(std::string_view name) const { return path_ / name; }

  // A subdirectory, 0755.
  fs::path subdir(std::string_view name) const {
    fs::path dir = path_ / name;
    fs::create_directories(dir);
    fs::permissions(dir, fs::perms(0755));
    return dir;
  }

 private:
  fs::path path_;
};

// Copies `from` to `to` with mode 0755, as an installed library would have.
inline fs::path copy_library(const fs::path& from, const fs::path& to) {
  fs::copy_file(from, to, fs::copy_options::overwrite_existing);
  fs::permissions(to, fs::perms(0755));
  return to;
}

inline std::string read_bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot read " << file.string());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const fs::path& file, const std::string& bytes) {
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    REQUIRE_MESSAGE(out.good(), "cannot write " << file.string());
  }
  fs::permissions(file, fs::perms(0755));
}

// Replaces every occurrence of `from` by `to` (same length, so no offset moves); returns the count.
inline size_t replace_all(std::string& bytes, std::string_view from, std::string_view to) {
  REQUIRE(from.size() == to.size());
  size_t count = 0;
  for (size_t at = bytes.find(from); at != std::string::npos; at = bytes.find(from, at + to.size())) {
    bytes.replace(at, to.size(), to);
    ++count;
  }
  return count;
}

// Runs `f`, which must throw fulgur::Error, and returns that error; any other outcome fails the test.
template <class F>
Error error_from(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (const Error& e) {
    return e;
  }
  throw std::runtime_error("expected a fulgur::Error, but nothing was thrown");
}

inline bool contains(std::string_view text, std::string_view part) { return text.find(part) != std::string_view::npos; }

// Runs `command` through the shell with stderr joined to stdout; returns pclose's raw wait status
// and the output.
inline std::pair<int, std::string> run_command(const std::string& command) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), pipe)) output += buffer;
  return {::pclose(pipe), output};
}

// What a test prints when it cannot run here: tests/CMakeLists.txt gives every test the CTest
// property SKIP_REGULAR_EXPRESSION "FULGUR_TEST_SKIPPED:", so CTest reports it as Skipped, not
// passed (scripts/gpu_check.sh also looks for this line). Printed directly: doctest shows a
// MESSAGE only for a failing test. The caller returns right after (CTest would report a failure
// after the marker as a skip too).
inline void skip_test(std::string_view reason) {
  std::printf("FULGUR_TEST_SKIPPED: %.*s\n", static_cast<int>(reason.size()), reason.data());
  std::fflush(stdout);
}

// A program run to its end: exit code (minus the signal number when a signal ended it), its own
// minor page faults, and stdout and stderr together.
struct ProcessRun {
  int exit_code = -1;
  long minor_faults = 0;
  std::string output;
};

// Starts `args` (argv[0] a path) in `dir` with the variables in `env` set (an empty value unsets
// one), its stdout and stderr into `log`; returns the child's pid without waiting.
inline pid_t spawn_process(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
                           const fs::path& dir, const fs::path& log) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    if (::chdir(dir.c_str()) != 0) ::_exit(126);
    for (const auto& [k, v] : env) v.empty() ? ::unsetenv(k.c_str()) : ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// Runs `args` like spawn_process and waits for it; the output goes through a file in `dir`, so a
// killed child loses none.
inline ProcessRun run_process(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
                              const fs::path& dir) {
  const fs::path log = dir / "output.txt";
  const pid_t pid = spawn_process(args, env, dir, log);
  int status = 0;
  rusage ru{};
  REQUIRE(::wait4(pid, &status, 0, &ru) == pid);
  ProcessRun r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  r.minor_faults = ru.ru_minflt;
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  r.output = text.str();
  return r;
}

// A CSV file (a logger's metrics.csv) as column -> cells, empty cells kept, in row order.
inline std::map<std::string, std::vector<std::string>> read_csv(const fs::path& file) {
  std::ifstream in(file);
  REQUIRE_MESSAGE(in.good(), "cannot read " << file.string());
  std::string line;
  std::getline(in, line);
  std::vector<std::string> header;
  std::stringstream hs(line);
  for (std::string cell; std::getline(hs, cell, ',');) header.push_back(cell);
  std::map<std::string, std::vector<std::string>> columns;
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    size_t start = 0;
    while (true) {
      const size_t comma = line.find(',', start);
      cells.push_back(line.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    for (size_t i = 0; i < header.size(); ++i) columns[header[i]].push_back(i < cells.size() ? cells[i] : "");
  }
  return columns;
}

}  // namespace fulgur::test

// CHECK that `text` contains `part`, printing both when it does not.
#define FULGUR_CHECK_CONTAINS(text, part)                 \
  CHECK_MESSAGE(::fulgur::test::contains((text), (part)), \
                "\n  text:     " << std::string(text) << "\n  expected: " << std::string(part))
