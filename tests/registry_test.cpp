// The plugin registry against real plugin libraries (tests/fixtures), one failure mode per test:
// each asserts the error kind, that the message names the file and the reason, and that the process
// carries on (usually by creating a good plugin afterwards).
#include "test_support.h"

#include <fulgur/callback.h>
#include <fulgur/host.h>
#include <fulgur/registry/registry.h>

#include <dlfcn.h>
#include <link.h>
#include <boost/dll/shared_library.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>

namespace fulgur {
namespace {

using test::error_from;
using test::fixture;
using test::TempDir;
namespace fs = std::filesystem;

constexpr const char* kGood = "libfulgur-fixture-good.so";

std::vector<SearchDirectory> only(const fs::path& dir, std::string origin = "config") {
  return {{dir, std::move(origin)}};
}

const PluginCandidate* find_candidate(const PluginRegistry& registry, PluginKind kind, std::string_view name) {
  for (const auto& c : registry.candidates())
    if (c.metadata.kind == kind && c.metadata.name == name) return &c;
  return nullptr;
}

const FileProblem* find_problem(const PluginRegistry& registry, const fs::path& file) {
  for (const auto& p : registry.problems())
    if (p.file == file) return &p;
  return nullptr;
}

// Whether the dynamic loader has `file` mapped into this process.
bool is_loaded(const fs::path& file) {
  struct Search {
    std::string wanted;
    bool found = false;
  } search{fs::weakly_canonical(file).string()};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        if (info->dlpi_name && *info->dlpi_name && fs::weakly_canonical(info->dlpi_name).string() == s->wanted)
          s->found = true;
        return 0;
      },
      &search);
  return search.found;
}

Options good_options() {
  Options options("callback 'fixture_good'");
  options.set("greeting", std::string("hi")).set("repeat", int64_t{3}).set("scale", 2.0);
  options.set("tags", std::vector<std::string>{"a", "b"});
  return options;
}

// What the good fixture reports for good_options(): the options crossed the C door intact.
constexpr const char* kGoodState = "hi|3|2.000000|a|b";

std::string state_of(const PluginObject& object) { return plugin_cast<Callback>(object)->state_key(); }

PluginObject create_good(const PluginRegistry& registry) {
  return registry.create(PluginKind::callback, "fixture_good", good_options());
}

std::string torch_version(uint32_t minor) {
  return std::to_string(host_abi_tag().torch_major) + "." + std::to_string(minor);
}

// Offsets of every Fulgur note payload (fulgur_note_header) in a plugin file: the note's type and
// owner "fulgur\0" precede it.
std::vector<size_t> note_headers(const std::string& bytes) {
  std::string marker(4 + 8, '\0');
  const uint32_t type = FULGUR_NOTE_TYPE;
  std::memcpy(marker.data(), &type, 4);
  std::memcpy(marker.data() + 4, FULGUR_NOTE_OWNER, sizeof(FULGUR_NOTE_OWNER));
  std::vector<size_t> out;
  for (size_t at = bytes.find(marker); at != std::string::npos; at = bytes.find(marker, at + 1))
    out.push_back(at + marker.size());
  return out;
}

void patch_u32(std::string& bytes, size_t at, uint32_t value) { std::memcpy(bytes.data() + at, &value, 4); }

// A copy of the good fixture with `patch` applied to its bytes.
template <class Patch>
fs::path patched_good(const fs::path& to, Patch&& patch) {
  std::string bytes = test::read_bytes(fixture(kGood));
  patch(bytes);
  test::write_bytes(to, bytes);
  return to;
}

}  // namespace

TEST_CASE("the SDK library exports the ABI guard symbol the host tag names") {
  const fulgur_abi_tag& tag = host_abi_tag();
  std::string expected = "fulgur_abi_v" + std::to_string(FULGUR_PLUGIN_ABI_MAJOR) + "_sdk" +
                         std::to_string(FULGUR_SDK_VERSION_MAJOR_OF(tag.sdk_version)) + "_torch" +
                         std::to_string(tag.torch_major) + "_" + std::to_string(tag.torch_minor) + "_cxx11abi" +
                         std::to_string(tag.glibcxx_cxx11_abi);
  CHECK(std::string(host_abi_guard_symbol()) == expected);
  CHECK(dlsym(RTLD_DEFAULT, host_abi_guard_symbol()) != nullptr);
}

TEST_CASE("a good plugin is listed from its note without loading, then created with its options") {
  TempDir dir;
  const fs::path file = test::copy_library(fixture(kGood), dir / kGood);
  PluginRegistry registry(only(dir.path()));

  const PluginCandidate* c = find_candidate(registry, PluginKind::callback, "fixture_good");
  REQUIRE(c != nullptr);
  CHECK(c->status == CandidateStatus::available);
  CHECK(c->file == file);
  CHECK(c->metadata.version == "1.2.3");
  CHECK(c->metadata.description == "Test fixture callback");
  CHECK(c->metadata.abi_major == FULGUR_PLUGIN_ABI_MAJOR);
  CHECK(std::memcmp(&c->metadata.abi_tag, &host_abi_tag(), sizeof(fulgur_abi_tag)) == 0);
  REQUIRE(c->metadata.options.size() == 4);
  const OptionSchema* repeat = c->metadata.find_option("repeat");
  REQUIRE(repeat != nullptr);
  CHECK(repeat->type == OptionType::integer);
  CHECK_FALSE(repeat->default_value.has_value());  // required
  const OptionSchema* scale = c->metadata.find_option("scale");
  REQUIRE(scale != nullptr);
  CHECK(scale->type == OptionType::floating);
  CHECK(std::get<double>(*scale->default_value) == 1.5);
  CHECK(std::get<std::string>(*c->metadata.find_option("greeting")->default_value) == "hello");
  CHECK(std::get<std::vector<std::string>>(*c->metadata.find_option("tags")->default_value).empty());
  CHECK(registry.problems().empty());
  CHECK_FALSE(is_loaded(file));  // discovery ran none of its code

  PluginObject object = create_good(registry);
  REQUIRE(object);
  CHECK(is_loaded(file));
  CHECK(state_of(object) == kGoodState);
  CHECK(plugin_cast<Callback>(object)->hooks() == static_cast<HookSet>(Hook::fit_start));
}

TEST_CASE("a created object stays usable after its registry is gone (plugin libraries are never unloaded)") {
  TempDir dir;
  const fs::path file = test::copy_library(fixture(kGood), dir / kGood);
  PluginObject object;
  {
    PluginRegistry registry(only(dir.path()));
    object = create_good(registry);
  }
  // Calls into the plugin's code after the registry that loaded it was destroyed.
  CHECK(state_of(object) == kGoodState);
  CHECK(plugin_cast<Callback>(object)->hooks() == static_cast<HookSet>(Hook::fit_start));
  object.reset();  // runs the plugin's destroy
  // The policy (a plugin may leave thread-locals or atexit handlers behind): the library stays
  // mapped after its last object is gone. A change to unload-on-last-object fails here.
  CHECK(is_loaded(file));
}

TEST_CASE("a stripped plugin is still discovered and created") {
  TempDir dir;
  const fs::path file = test::copy_library(fixture("libfulgur-fixture-good-stripped.so"), dir / kGood);
  PluginRegistry registry(only(dir.path()));
  const PluginCandidate* c = find_candidate(registry, PluginKind::callback, "fixture_good");
  REQUIRE(c != nullptr);
  CHECK(c->status == CandidateStatus::available);
  CHECK(c->metadata.options.size() == 4);
  CHECK(state_of(create_good(registry)) == kGoodState);
}

TEST_CASE("SDK 1.x: a plugin built before SDK 1.0 or against a newer SDK minor is refused naming both versions") {
  TempDir dir;
  const fs::path old_file = test::copy_library(fixture("libfulgur-fixture-pre-sdk1.so"), dir / "libfulgur-pre.so");
  const fs::path new_file = test::copy_library(fixture("libfulgur-fixture-newer-sdk.so"), dir / "libfulgur-newer.so");
  test::copy_library(fixture(kGood), dir / kGood);
  PluginRegistry registry(only(dir.path()));
  const std::string host = std::to_string(FULGUR_SDK_VERSION_MAJOR) + "." + std::to_string(FULGUR_SDK_VERSION_MINOR);

  const PluginCandidate* old_plugin = find_candidate(registry, PluginKind::callback, "fixture_pre_sdk1");
  REQUIRE(old_plugin != nullptr);
  CHECK(old_plugin->status == CandidateStatus::rejected);
  FULGUR_CHECK_CONTAINS(old_plugin->reason, "before 1.0 (C++ interface 7)");
  FULGUR_CHECK_CONTAINS(old_plugin->reason, "this host (SDK " + host + ")");
  FULGUR_CHECK_CONTAINS(old_plugin->reason, "rebuild the plugin against Fulgur 1.x");
  FULGUR_CHECK_CONTAINS(old_plugin->reason, "find_package(Fulgur " + host + ")");
  Error e = error_from([&] { registry.create(PluginKind::callback, "fixture_pre_sdk1", Options{}); });
  CHECK(e.kind() == ErrorKind::plugin_rejected);
  FULGUR_CHECK_CONTAINS(e.what(), old_file.string());
  CHECK_FALSE(is_loaded(old_file));

  const PluginCandidate* newer = find_candidate(registry, PluginKind::callback, "fixture_newer_sdk");
  REQUIRE(newer != nullptr);
  CHECK(newer->status == CandidateStatus::rejected);
  FULGUR_CHECK_CONTAINS(newer->reason, "built against Fulgur SDK 1.99, newer than this host's SDK " + host);
  FULGUR_CHECK_CONTAINS(newer->reason, "upgrade Fulgur to 1.99 or later");
  CHECK_FALSE(is_loaded(new_file));
  // The host's own SDK version loads.
  CHECK(state_of(create_good(registry)) == kGoodState);
}

TEST_CASE("a plugin built against another libtorch is refused at the metadata phase") {
  TempDir dir;
  const fs::path file = test::copy_library(fixture("libfulgur-fixture-other-abi.so"), dir / "libfulgur-other.so");
  test::copy_library(fixture(kGood), dir / kGood);
  PluginRegistry registry(only(dir.path()));

  const PluginCandidate* c = find_candidate(registry, PluginKind::callback, "fixture_other_abi");
  REQUIRE(c != nullptr);
  CHECK(c->status == CandidateStatus::rejected);
  const std::string both_versions = "libtorch: plugin " + torch_version(FULGUR_TEST_OTHER_TORCH_MINOR) + ", host " +
                                    torch_version(host_abi_tag().torch_minor);
  FULGUR_CHECK_CONTAINS(c->reason, both_versions);

  Error e = error_from([&] { registry.create(PluginKind::callback, "fixture_other_abi", Options{}); });
  CHECK(e.kind() == ErrorKind::plugin_rejected);
  FULGUR_CHECK_CONTAINS(e.what(), file.string());
  FULGUR_CHECK_CONTAINS(e.what(), both_versions);
  FULGUR_CHECK_CONTAINS(e.what(), "rebuild");
  CHECK_FALSE(is_loaded(file));
  CHECK(state_of(create_good(registry)) == kGoodState);
}

TEST_CASE("the link-time ABI guard stops a mismatched plugin even when the checks are bypassed") {
  TempDir dir;
  const fs::path file = test::copy_library(fixture("libfulgur-fixture-other-abi.so"), dir / "libfulgur-other.so");
  const std::string guard = "fulgur_abi_v" + std::to_string(FULGUR_PLUGIN_ABI_MAJOR) + "_sdk" +
                            std::to_string(FULGUR_SDK_VERSION_MAJOR_OF(host_abi_tag().sdk_version)) + "_torch" +
                            std::to_string(host_abi_tag().torch_major) + "_" +
                            std::to_string(FULGUR_TEST_OTHER_TORCH_MINOR) + "_cxx11abi" +
                            std::to_string(host_abi_tag().glibcxx_cxx11_abi);

  SUBCASE("Boost.DLL directly") {
    std::string what;
    try {
      boost::dll::shared_library lib(boost::dll::fs::path(file.string()),
                                     boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
    } catch (const std::exception& e) {
      what = e.what();
    }
    FULGUR_CHECK_CONTAINS(what, "undefined symbol: " + guard);
  }
  SUBCASE("the registry's loader, skipping the metadata checks") {
    PluginRegistry registry(only(dir.path()));
    const PluginCandidate* c = find_candidate(registry, PluginKind::callback, "fixture_other_abi");
    REQUIRE(c != nullptr);
    Error e = error_from([&] { registry.load(*c); });
    CHECK(e.kind() == ErrorKind::plugin_load);
    FULGUR_CHECK_CONTAINS(e.what(), file.string());
    FULGUR_CHECK_CONTAINS(e.what(), "undefined symbol: " + guard);
    FULGUR_CHECK_CONTAINS(e.what(), host_abi_guard_symbol());  // the hint names what the host has
  }
  CHECK_FALSE(is_loaded(file));
}

TEST_CASE("a plugin with an undefined symbol fails at load, not when the symbol is first used") {
  TempDir dir;
  const fs::path file = test::copy_library(fixture("libfulgur-fixture-undefined.so"), dir / "libfulgur-undef.so");
  test::copy_library(fixture(kGood), dir / kGood);
  PluginRegistry registry(only(dir.path()));
  REQUIRE(find_candidate(registry, PluginKind::callback, "fixture_undefined")->status == CandidateStatus::available);

  Options options;
  options.set("repeat", int64_t{1});
  for (int attempt = 0; attempt < 2; ++attempt) {  // a failed load leaves nothing half-registered
    Error e = error_from([&] { registry.create(PluginKind::callback, "fixture_undefined", options); });
    CHECK(e.kind() == ErrorKind::plugin_load);
    FULGUR_CHECK_CONTAINS(e.what(), file.string());
    FULGUR_CHECK_CONTAINS(e.what(), "undefined symbol: fulgur_fixture_missing_function");
    FULGUR_CHECK_CONTAINS(e.what(), "--no-undefined");
  }
  CHECK(state_of(create_good(registry)) == kGoodState);
}

TEST_CASE("a factory that throws becomes plugin_create with the plugin's own message") {
  TempDir dir;
  const fs::path file = test::copy_library(fixture("libfulgur-fixture-throws.so"), dir / "libfulgur-throws.so");
  test::copy_library(fixture(kGood), dir / kGood);
  PluginRegistry registry(only(dir.path()));

  Options options;
  options.set("greeting", std::string("grumpy")).set("repeat", int64_t{1}).set("scale", 1.0);
  options.set("tags", std::vector<std::string>{});
  for (int attempt = 0; attempt < 2; ++attempt) {
    Error e = error_from([&] { registry.create(PluginKind::callback, "fixture_throws", options); });
    CHECK(e.kind() == ErrorKind::plugin_create);
    FULGUR_CHECK_CONTAINS(e.what(), "callback 'fixture_throws'");
    FULGUR_CHECK_CONTAINS(e.what(), file.string());
    FULGUR_CHECK_CONTAINS(e.what(), "fixture refuses to start: greeting 'grumpy'");
  }
  CHECK(is_loaded(file));  // it loaded fine; only its constructor failed
  CHECK(state_of(create_good(registry)) == kGoodState);
}

TEST_CASE("the same plugin in two directories: the first in search order wins, the other is shadowed") {
  TempDir root;
  const fs::path first = test::copy_library(fixture(kGood), root.subdir("first") / kGood);
  const fs::path second = test::copy_library(fixture(kGood), root.subdir("second") / kGood);
  PluginRegistry registry({{root / "first", "config"}, {root / "second", "FULGUR_PLUGIN_PATH"}});

  REQUIRE(registry.candidates().size() == 2);
  const PluginCandidate& winner = registry.resolve(PluginKind::callback, "fixture_good");
  CHECK(winner.file == first);
  CHECK(winner.status == CandidateStatus::available);
  const PluginCandidate& loser = registry.candidates()[1];
  CHECK(loser.file == second);
  CHECK(loser.status == CandidateStatus::shadowed);
  FULGUR_CHECK_CONTAINS(loser.reason, first.string());

  PluginObject object = create_good(registry);
  CHECK(is_loaded(first));
  CHECK_FALSE(is_loaded(second));
}

TEST_CASE("the same plugin twice in one directory is ambiguous, an error only when selected") {
  TempDir dir;
  const fs::path a = test::copy_library(fixture(kGood), dir / "libfulgur-a.so");
  const fs::path b = test::copy_library(fixture(kGood), dir / "libfulgur-b.so");
  test::copy_library(fixture("libfulgur-fixture-stack.so"), dir / "libfulgur-stack.so");
  PluginRegistry registry(only(dir.path()));  // scanning is fine

  for (const auto& c : registry.candidates())
    if (c.metadata.name == "fixture_good") CHECK(c.status == CandidateStatus::ambiguous);
  Error e = error_from([&] { registry.create(PluginKind::callback, "fixture_good", good_options()); });
  CHECK(e.kind() == ErrorKind::plugin_ambiguous);
  FULGUR_CHECK_CONTAINS(e.what(), a.string());
  FULGUR_CHECK_CONTAINS(e.what(), b.string());
  FULGUR_CHECK_CONTAINS(e.what(), "remove all but one");

  // Another plugin from the same directory is unaffected.
  PluginObject accelerator = registry.create(PluginKind::accelerator, "stub", Options{});
  CHECK(accelerator);
}

TEST_CASE("plugins that other users can write to are refused unless allowed") {
  TempDir dir;
  const fs::path file = test::copy_library(fixture(kGood), dir / kGood);

  SUBCASE("world-writable directory") {
    fs::permissions(dir.path(), fs::perms(0777));
    PluginRegistry registry(only(dir.path()));
    Error e = error_from([&] { create_good(registry); });
    CHECK(e.kind() == ErrorKind::plugin_rejected);
    FULGUR_CHECK_CONTAINS(e.what(), file.string());
    FULGUR_CHECK_CONTAINS(e.what(), "directory " + dir.path().string() + " is writable by all users");
    FULGUR_CHECK_CONTAINS(e.what(), "allow_writable");
    CHECK_FALSE(is_loaded(file));

    PluginRegistry allowed(only(dir.path()), RegistryOptions{.allow_writable = true});
    CHECK(state_of(create_good(allowed)) == kGoodState);
  }
  SUBCASE("world-writable file") {
    fs::permissions(file, fs::perms(0777));
    PluginRegistry registry(only(dir.path()));
    Error e = error_from([&] { create_good(registry); });
    CHECK(e.kind() == ErrorKind::plugin_rejected);
    FULGUR_CHECK_CONTAINS(e.what(), file.string());
    FULGUR_CHECK_CONTAINS(e.what(), "file is writable by all users");
  }
  SUBCASE("group-writable directory") {
    fs::permissions(dir.path(), fs::perms(0775));
    PluginRegistry registry(only(dir.path()));
    Error e = error_from([&] { create_good(registry); });
    CHECK(e.kind() == ErrorKind::plugin_rejected);
    FULGUR_CHECK_CONTAINS(e.what(), "writable by its group");
  }
}

TEST_CASE("a built-in name is reserved outside the install directory") {
  TempDir dir;
  const fs::path file = test::copy_library(fixture("libfulgur-fixture-reserved.so"), dir / "libfulgur-mine.so");
  {
    PluginRegistry registry(only(dir.path(), "user"));
    Error e = error_from([&] { registry.create(PluginKind::callback, "model_checkpoint", good_options()); });
    CHECK(e.kind() == ErrorKind::plugin_rejected);
    FULGUR_CHECK_CONTAINS(e.what(), file.string());
    FULGUR_CHECK_CONTAINS(e.what(), "name 'model_checkpoint' is reserved for Fulgur's built-in callback");
  }
  {
    PluginRegistry registry(only(dir.path(), "install"));  // where the built-ins live
    CHECK(registry.resolve(PluginKind::callback, "model_checkpoint").status == CandidateStatus::available);
  }
}

TEST_CASE("an unknown name is plugin_not_found with a suggestion and the search path") {
  TempDir dir;
  test::copy_library(fixture(kGood), dir / kGood);
  PluginRegistry registry(only(dir.path()));
  Error e = error_from([&] { registry.create(PluginKind::callback, "fixture_god", Options{}); });
  CHECK(e.kind() == ErrorKind::plugin_not_found);
  FULGUR_CHECK_CONTAINS(e.what(), "no callback plugin named 'fixture_god'");
  FULGUR_CHECK_CONTAINS(e.what(), "did you mean 'fixture_good'?");
  FULGUR_CHECK_CONTAINS(e.what(), dir.path().string() + " (config)");

  // The right name, the wrong kind: no suggestion from another kind.
  Error kind = error_from([&] { registry.resolve(PluginKind::logger, "fixture_good"); });
  CHECK(kind.kind() == ErrorKind::plugin_not_found);
  FULGUR_CHECK_CONTAINS(kind.what(), "No logger plugins are available");
}

TEST_CASE("a plugin for another CPU architecture is reported by name, never loaded") {
  TempDir dir;
  const fs::path file = patched_good(dir / "libfulgur-arm.so", [](std::string& bytes) {
    const uint16_t aarch64 = 183;  // EM_AARCH64
    std::memcpy(bytes.data() + offsetof(Elf64_Ehdr, e_machine), &aarch64, sizeof(aarch64));
  });
  test::copy_library(fixture("libfulgur-fixture-stack.so"), dir / "libfulgur-stack.so");
  PluginRegistry registry(only(dir.path()));

  const FileProblem* p = find_problem(registry, file);
  REQUIRE(p != nullptr);
  CHECK(p->is_plugin_error);
  CHECK(p->error_kind == ErrorKind::plugin_rejected);
  FULGUR_CHECK_CONTAINS(p->reason, "wrong architecture");
  FULGUR_CHECK_CONTAINS(p->reason, "aarch64");

  // Its name cannot be read, so selecting it is "not found", with the refused file and why.
  Error e = error_from([&] { create_good(registry); });
  CHECK(e.kind() == ErrorKind::plugin_not_found);
  FULGUR_CHECK_CONTAINS(e.what(), file.string() + ": wrong architecture");
  CHECK(registry.create(PluginKind::accelerator, "stub", Options{}));
}

TEST_CASE("a note from another plugin ABI is refused at the metadata phase") {
  TempDir dir;
  SUBCASE("newer ABI major") {
    const fs::path file = patched_good(dir / kGood, [](std::string& bytes) {
      for (size_t at : note_headers(bytes)) patch_u32(bytes, at + offsetof(fulgur_note_header, abi_major), 2);
    });
    PluginRegistry registry(only(dir.path()));
    Error e = error_from([&] { create_good(registry); });
    CHECK(e.kind() == ErrorKind::plugin_rejected);
    FULGUR_CHECK_CONTAINS(e.what(), file.string());
    FULGUR_CHECK_CONTAINS(e.what(), "built for plugin ABI 2.x, this host implements ABI 1.1");
  }
  SUBCASE("newer ABI minor") {
    const fs::path file = patched_good(dir / kGood, [](std::string& bytes) {
      for (size_t at : note_headers(bytes)) patch_u32(bytes, at + offsetof(fulgur_note_header, abi_minor), 7);
    });
    PluginRegistry registry(only(dir.path()));
    Error e = error_from([&] { create_good(registry); });
    CHECK(e.kind() == ErrorKind::plugin_rejected);
    FULGUR_CHECK_CONTAINS(e.what(), file.string());
    FULGUR_CHECK_CONTAINS(e.what(), "needs plugin ABI 1.7");
  }
}

TEST_CASE("a corrupt or truncated note is a reported broken plugin") {
  TempDir dir;
  fs::path file;
  std::string reason;
  SUBCASE("strings run past the note") {
    file = patched_good(dir / kGood, [](std::string& bytes) {
      const std::vector<size_t> notes = note_headers(bytes);
      REQUIRE(notes.size() == 1);
      patch_u32(bytes, notes[0] + offsetof(fulgur_note_header, strings_size), 0xffff);
    });
    reason = "corrupt Fulgur metadata note: note strings (65535 bytes) run past the payload";
  }
  SUBCASE("unknown option type") {
    file = patched_good(dir / kGood, [](std::string& bytes) {
      const size_t at = note_headers(bytes).at(0);
      uint32_t header_size = 0;
      std::memcpy(&header_size, bytes.data() + at, 4);
      patch_u32(bytes, at + header_size, 99);  // option_types[0]
    });
    reason = "option #0 has unknown type code 99";
  }
  SUBCASE("truncated file") {
    file = patched_good(dir / kGood, [](std::string& bytes) { bytes.resize(sizeof(Elf64_Ehdr) + 8); });
    reason = "program header table runs past the end of the file";
  }
  PluginRegistry registry(only(dir.path()));
  const FileProblem* p = find_problem(registry, file);
  REQUIRE(p != nullptr);
  CHECK(p->is_plugin_error);
  FULGUR_CHECK_CONTAINS(p->reason, reason);
  Error e = error_from([&] { create_good(registry); });
  CHECK(e.kind() == ErrorKind::plugin_not_found);
  FULGUR_CHECK_CONTAINS(e.what(), file.string() + ": " + p->reason);
}

TEST_CASE("a descriptor that disagrees with its note is refused at load") {
  TempDir dir;
  const fs::path file = patched_good(dir / kGood, [](std::string& bytes) {
    // The version string right after the name in the note; the descriptor keeps "1.2.3".
    const size_t at = bytes.find("1.2.3", note_headers(bytes).at(0));
    REQUIRE(at != std::string::npos);
    bytes.replace(at, 5, "9.9.9");
  });
  PluginRegistry registry(only(dir.path()));
  REQUIRE(registry.resolve(PluginKind::callback, "fixture_good").metadata.version == "9.9.9");
  Error e = error_from([&] { create_good(registry); });
  CHECK(e.kind() == ErrorKind::plugin_load);
  FULGUR_CHECK_CONTAINS(e.what(), file.string());
  FULGUR_CHECK_CONTAINS(e.what(), "metadata mismatch");
  FULGUR_CHECK_CONTAINS(e.what(), "version '1.2.3' in code, '9.9.9' in note");
}

TEST_CASE("a library without the entry point is refused at load") {
  TempDir dir;
  const fs::path file = patched_good(dir / kGood, [](std::string& bytes) {
    // Same length, so every offset stays valid; only the exported name changes.
    CHECK(test::replace_all(bytes, FULGUR_PLUGIN_QUERY_SYMBOL, "fulgur_plugin_query_v9") > 0);
  });
  test::copy_library(fixture("libfulgur-fixture-stack.so"), dir / "libfulgur-stack.so");
  PluginRegistry registry(only(dir.path()));
  Error e = error_from([&] { create_good(registry); });
  CHECK(e.kind() == ErrorKind::plugin_load);
  FULGUR_CHECK_CONTAINS(e.what(), file.string());
  FULGUR_CHECK_CONTAINS(e.what(), std::string("entry point ") + FULGUR_PLUGIN_QUERY_SYMBOL + " not found");
  CHECK(registry.create(PluginKind::accelerator, "stub", Options{}));
}

TEST_CASE("a shared library without a Fulgur note is skipped, not an error") {
  TempDir dir;
  const fs::path plain = test::copy_library(fixture("libfulgur-fixture-plain.so"), dir / "libplain.so");
  PluginRegistry registry(only(dir.path()));
  CHECK(registry.candidates().empty());
  const FileProblem* p = find_problem(registry, plain);
  REQUIRE(p != nullptr);
  CHECK_FALSE(p->is_plugin_error);
  FULGUR_CHECK_CONTAINS(p->reason, "not a plugin");
  CHECK_FALSE(is_loaded(plain));
}

TEST_CASE("broken plugins that nobody selects do not prevent creating a good one") {
  TempDir dir;
  test::copy_library(fixture(kGood), dir / kGood);
  test::copy_library(fixture("libfulgur-fixture-other-abi.so"), dir / "libfulgur-other.so");
  test::copy_library(fixture("libfulgur-fixture-undefined.so"), dir / "libfulgur-undef.so");
  test::copy_library(fixture("libfulgur-fixture-throws.so"), dir / "libfulgur-throws.so");
  test::copy_library(fixture("libfulgur-fixture-plain.so"), dir / "libplain.so");
  patched_good(dir / "libfulgur-arm.so", [](std::string& bytes) { bytes[offsetof(Elf64_Ehdr, e_machine)] = 40; });
  patched_good(dir / "libfulgur-cut.so", [](std::string& bytes) { bytes.resize(100); });
  test::write_bytes(dir / "libfulgur-text.so", "not a library at all\n");

  PluginRegistry registry(only(dir.path()));
  CHECK(state_of(create_good(registry)) == kGoodState);
  CHECK(find_candidate(registry, PluginKind::callback, "fixture_other_abi")->status == CandidateStatus::rejected);
  size_t broken = 0;
  for (const auto& p : registry.problems()) broken += p.is_plugin_error;
  CHECK(broken == 2);                                  // the wrong-architecture and truncated copies
  CHECK(registry.problems().size() == 4);              // plus the plain library and the text file
  CHECK_FALSE(is_loaded(dir / "libfulgur-undef.so"));  // never selected, never loaded
}

// Sets an environment variable for the current scope, restoring the previous value after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST_CASE("the search path is config, FULGUR_PLUGIN_PATH, user directory, install directory") {
  ScopedEnv plugin_path("FULGUR_PLUGIN_PATH", "/opt/a::/opt/b");
  ScopedEnv data_home("XDG_DATA_HOME", "/xdg");
  SearchPathOptions options;
  options.config_paths = {"/from/toml"};
  std::vector<SearchDirectory> path = plugin_search_path(options);
  REQUIRE(path.size() == 5);
  CHECK(path[0].path == "/from/toml");
  CHECK(path[0].origin == "config");
  CHECK(path[1].path == "/opt/a");
  CHECK(path[2].path == "/opt/b");
  CHECK(path[2].origin == "FULGUR_PLUGIN_PATH");
  CHECK(path[3].path == "/xdg/fulgur/plugins");
  CHECK(path[3].origin == "user");
  CHECK(path[4].origin == "install");
  CHECK(path[4].path.filename() == "plugins");
  CHECK(fs::exists(path[4].path.parent_path().parent_path() / "libfulgur_registry.so"));

  options.use_environment = options.use_user_directory = options.use_install_directory = false;
  CHECK(plugin_search_path(options).size() == 1);
}

TEST_CASE("a configured plugin directory that does not exist is reported") {
  TempDir dir;
  PluginRegistry registry({{dir / "missing", "config"}, {dir / "missing-too", "user"}});
  REQUIRE(registry.problems().size() == 1);  // the user directory is optional
  CHECK(registry.problems()[0].is_plugin_error);
  FULGUR_CHECK_CONTAINS(registry.problems()[0].reason, "plugin directory from config does not exist");
}

}  // namespace fulgur
