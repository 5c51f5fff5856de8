// Distributed checkpoints in torch.distributed.checkpoint's format (sdk/include/fulgur/distributed_checkpoint.h):
// ranks simulated in one process write and re-shard; Python's torch (the pinned one) reads what
// Fulgur wrote and writes what Fulgur reads; corrupt input fails with one line naming the file; a
// failed save leaves the previous checkpoint; `fulgur checkpoint consolidate` in a real process.
#include <fulgur/checkpoint_io.h>
#include <fulgur/communicator.h>
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/error.h>
#include <fulgur/weights.h>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <fmt/format.h>

#include <barrier>
#include <thread>

#include "test_support.h"

namespace fs = std::filesystem;
using fulgur::Error;
using namespace fulgur::test;
using fulgur::ErrorKind;
namespace dcp = fulgur::dcp;

namespace {

constexpr const char* kInteropScript = FULGUR_TEST_SOURCE_DIR "/tests/python/dcp_interop.py";

std::string name(at::ScalarType type) { return c10::toString(type); }

c10::impl::GenericDict dict() { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); }
c10::impl::GenericList list() { return c10::impl::GenericList(c10::AnyType::get()); }

// The whole state: a model, an optimizer state with int keys, lists and non-tensor leaves, and a
// dict key holding a '.' (kept whole by the path, though the flattened key joins it).
struct FullState {
  at::Tensor weight = at::arange(21, at::kFloat).reshape({7, 3}) * 0.5;     // sharded
  at::Tensor bias = (at::arange(7, at::kFloat) - 3).to(at::kBFloat16);      // sharded, bf16
  at::Tensor counts = at::arange(14, at::kLong).reshape({7, 2}) * 1000003;  // sharded, int64
  at::Tensor scale = at::scalar_tensor(2.5);                                // replicated, 0-dim
  at::Tensor table = at::tensor({1.0, -2.0, 3.5, 4.0}).to(at::kBFloat16);   // replicated
  at::Tensor exp_avg = at::arange(21, at::kFloat).reshape({7, 3}).neg();    // sharded
  at::Tensor step = at::scalar_tensor(12.0);                                // replicated, 0-dim
};

// FSDP2's dim-0 rule (torch.chunk): ceil(rows / world) rows per rank, the last ranks get fewer.
std::pair<int64_t, int64_t> rows_of(int64_t rows, int64_t rank, int64_t world) {
  const int64_t per = (rows + world - 1) / world;
  const int64_t begin = std::min(rows, rank * per);
  return {begin, std::min(rows, begin + per) - begin};
}

// Rank `rank` of `world`'s state and placements; `int_keys`: the optimizer state keyed by int (as
// torch writes it) rather than by the string DCP rebuilds.
std::pair<c10::IValue, std::map<std::string, dcp::Chunk>> rank_state(const FullState& full, int64_t rank, int64_t world,
                                                                     bool int_keys = true) {
  std::map<std::string, dcp::Chunk> placements;
  auto shard = [&](const at::Tensor& t, const std::string& key) {
    const auto [begin, count] = rows_of(t.size(0), rank, world);
    std::vector<int64_t> offsets(t.dim(), 0);
    offsets[0] = begin;
    placements[key] = dcp::Chunk().set_global_shape(t.sizes().vec()).set_offsets(offsets);
    return t.narrow(0, begin, count);  // a view: the writer must not save its whole storage
  };
  auto model = dict();
  model.insert("layer.weight", shard(full.weight, "state_dict.layer.weight"));
  model.insert("layer.bias", shard(full.bias, "state_dict.layer.bias"));
  model.insert("counts", shard(full.counts, "state_dict.counts"));
  model.insert("scale", full.scale);
  model.insert("table", full.table);

  auto param_state = dict();
  param_state.insert("exp_avg", shard(full.exp_avg, "optimizer_states.0.state.0.exp_avg"));
  param_state.insert("step", full.step);
  c10::IValue state_by_param;
  if (int_keys) {
    c10::impl::GenericDict d(c10::IntType::get(), c10::AnyType::get());
    d.insert(int64_t{0}, param_state);
    state_by_param = d;
  } else {
    auto d = dict();
    d.insert("0", param_state);
    state_by_param = d;
  }
  auto group = dict();
  group.insert("lr", 0.01);
  group.insert("betas", c10::ivalue::Tuple::create({0.9, 0.999}));
  auto params = list();
  params.push_back(int64_t{0});
  group.insert("params", params);
  group.insert("name", std::string("main"));
  group.insert("nesterov", false);
  group.insert("decay", c10::IValue());
  auto groups = list();
  groups.push_back(group);
  auto optimizer = dict();
  optimizer.insert("state", state_by_param);
  optimizer.insert("param_groups", groups);
  auto optimizers = list();
  optimizers.push_back(optimizer);

  auto root = dict();
  root.insert("state_dict", model);
  root.insert("optimizer_states", optimizers);
  root.insert("epoch", int64_t{4});
  return {root, placements};
}

// The nested state a reader rebuilds: every tensor whole, dict keys strings.
c10::IValue full_state(const FullState& full) { return rank_state(full, 0, 1, /*int_keys=*/false).first; }

// Writes the checkpoint the way `world` ranks would: each its file, then rank 0 the metadata.
void write_ranks(const fs::path& dir, const FullState& full, int64_t world) {
  fs::create_directories(dir);
  std::vector<dcp::RankWrite> writes;
  for (int64_t r = 0; r < world; ++r) {
    auto [state, placements] = rank_state(full, r, world);
    // Through the string form, as the collective sends it.
    writes.push_back(dcp::RankWrite::deserialize(dcp::write_rank_file(dir.string(), r, state, placements).serialize()));
  }
  dcp::write_metadata(dir.string(), writes);
}

void check_same(const c10::IValue& a, const c10::IValue& b, const std::string& where) {
  INFO(where);
  if (a.isTensor() || b.isTensor()) {
    REQUIRE(a.isTensor());
    REQUIRE(b.isTensor());
    CHECK(name(a.toTensor().scalar_type()) == name(b.toTensor().scalar_type()));
    REQUIRE(a.toTensor().sizes() == b.toTensor().sizes());
    CHECK(at::equal(a.toTensor(), b.toTensor()));
  } else if (a.isGenericDict()) {
    REQUIRE(b.isGenericDict());
    const auto da = a.toGenericDict();
    const auto db = b.toGenericDict();
    REQUIRE(da.size() == db.size());
    for (const auto& entry : da) {
      REQUIRE(db.contains(entry.key()));
      check_same(entry.value(), db.at(entry.key()), where + "." + entry.key().toStringRef());
    }
  } else if (a.isList() || a.isTuple()) {
    REQUIRE(a.isTuple() == b.isTuple());
    const auto la = a.isList() ? a.toListRef().vec() : a.toTupleRef().elements().vec();
    const auto lb = b.isList() ? b.toListRef().vec() : b.toTupleRef().elements().vec();
    REQUIRE(la.size() == lb.size());
    for (size_t i = 0; i < la.size(); ++i) check_same(la[i], lb[i], where + "." + std::to_string(i));
  } else {
    CHECK(a.tagKind() == b.tagKind());
    CHECK(a == b);
  }
}

std::pair<int, std::string> run_python(const std::vector<std::string>& args) {
  std::string command = fmt::format("{} {}", FULGUR_TEST_PYTHON, kInteropScript);
  for (const std::string& a : args) command += " '" + a + "'";
  return run_command(command);
}

void require_python_ok(const std::vector<std::string>& args) {
  const auto [status, output] = run_python(args);
  INFO(output);
  REQUIRE(status == 0);
  REQUIRE(contains(output, "python-ok"));
}

// The one-line error a reader or writer throws.
std::string error_of(const std::function<void()>& action, ErrorKind kind = ErrorKind::checkpoint) {
  try {
    action();
  } catch (const Error& e) {
    CHECK(e.kind() == kind);
    const std::string message = e.what();
    CHECK(message.find('\n') == std::string::npos);
    return message;
  }
  FAIL("no fulgur::Error was thrown");
  return {};
}

// Ranks as threads of one process: all_gather and barrier over a std::barrier. Every other
// collective is unused by dcp::save.
struct ThreadGroup {
  explicit ThreadGroup(int64_t world) : world(world), arrive(static_cast<std::ptrdiff_t>(world)), slots(world) {}
  int64_t world;
  std::barrier<> arrive;
  std::vector<at::Tensor> slots;
};

class ThreadCommunicator final : public fulgur::Communicator {
 public:
  ThreadCommunicator(ThreadGroup& group, int64_t rank) : group_(group), rank_(rank) {}
  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return group_.world; }
  std::string backend() const override { return "gloo"; }
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override {
    group_.slots[rank_] = tensor.clone();
    group_.arrive.arrive_and_wait();
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : group_.slots) out.push_back(t.clone());
    group_.arrive.arrive_and_wait();
    return out;
  }
  void barrier() override { group_.arrive.arrive_and_wait(); }
  void all_reduce(at::Tensor&, fulgur::ReduceOp) override { unused(); }
  std::unique_ptr<fulgur::PendingCollective> all_reduce_async(at::Tensor&, fulgur::ReduceOp) override { unused(); }
  void broadcast(at::Tensor&, int64_t) override { unused(); }
  void broadcast_coalesced(std::vector<at::Tensor>&, int64_t) override { unused(); }
  void reduce_scatter(at::Tensor&, const at::Tensor&, fulgur::ReduceOp) override { unused(); }
  std::unique_ptr<fulgur::PendingCollective> reduce_scatter_async(at::Tensor&, const at::Tensor&,
                                                                  fulgur::ReduceOp) override {
    unused();
  }
  void all_gather_into_tensor(at::Tensor&, const at::Tensor&) override { unused(); }
  std::unique_ptr<fulgur::PendingCollective> all_gather_into_tensor_async(at::Tensor&, const at::Tensor&) override {
    unused();
  }
  void all_gather_into_tensor_coalesced(std::vector<at::Tensor>&, const std::vector<at::Tensor>&) override { unused(); }
  void reduce_scatter_coalesced(std::vector<at::Tensor>&, const std::vector<at::Tensor>&, fulgur::ReduceOp) override {
    unused();
  }
  [[noreturn]] void rethrow(const char*, std::exception_ptr error) override { std::rethrow_exception(error); }
  std::unique_ptr<fulgur::GradientSync> make_gradient_sync(std::vector<at::Tensor>,
                                                           const fulgur::GradientSyncOptions&) override {
    unused();
  }

 private:
  [[noreturn]] static void unused() { throw std::logic_error("not used by dcp::save"); }
  ThreadGroup& group_;
  int64_t rank_;
};

// Runs dcp::save on `world` threads; returns each rank's error message ("" when it succeeded).
std::vector<std::string> save_on_threads(const fs::path& dir, const FullState& full, int64_t world,
                                         const std::function<void(int64_t, c10::IValue&)>& tamper = {}) {
  ThreadGroup group(world);
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      ThreadCommunicator communicator(group, r);
      auto [state, placements] = rank_state(full, r, world);
      if (tamper) tamper(r, state);
      try {
        dcp::save(dir.string(), state, placements, &communicator);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

}  // namespace

TEST_CASE("dcp: simulated ranks write, read back whole and re-shard 1, 2 and 3 ways") {
  TempDir tmp;
  const FullState full;
  const c10::IValue expected = full_state(full);
  for (int64_t written_by : {1, 2, 3}) {
    const fs::path dir = tmp / fmt::format("ckpt{}", written_by);
    write_ranks(dir, full, written_by);
    INFO("written by " << written_by << " ranks");
    for (int64_t r = 0; r < written_by; ++r) CHECK(fs::exists(dir / fmt::format("__{}_0.distcp", r)));
    REQUIRE(dcp::is_distributed_checkpoint(dir.string()));

    dcp::Reader reader(dir.string());
    CHECK(reader.is_tensor("state_dict.layer.weight"));
    CHECK(reader.shape("state_dict.layer.weight") == std::vector<int64_t>{7, 3});
    CHECK(name(reader.dtype("state_dict.layer.bias")) == name(at::kBFloat16));
    CHECK(name(reader.dtype("state_dict.counts")) == name(at::kLong));
    CHECK(reader.shape("state_dict.scale").empty());
    CHECK_FALSE(reader.is_tensor("epoch"));
    CHECK(reader.contains("optimizer_states.0.param_groups.0.betas"));
    CHECK_FALSE(reader.contains("optimizer_states.0.param_groups"));  // a list of dicts is walked
    CHECK(reader.read_value("optimizer_states.0.param_groups.0.lr").toDouble() == 0.01);
    CHECK(reader.read_value("epoch").toInt() == 4);
    CHECK(at::equal(reader.read("state_dict.counts"), full.counts));
    CHECK(at::equal(reader.read("optimizer_states.0.state.0.step"), full.step));
    check_same(reader.read_all(), expected, "read_all");

    // Every rank of another world size reads its own rows: re-sharding.
    for (int64_t world : {1, 2, 3}) {
      for (int64_t r = 0; r < world; ++r) {
        const auto [begin, count] = rows_of(7, r, world);
        CHECK(at::equal(reader.read("state_dict.layer.weight", {begin, 0}, {count, 3}),
                        full.weight.narrow(0, begin, count)));
        CHECK(at::equal(reader.read("state_dict.layer.bias", {begin}, {count}), full.bias.narrow(0, begin, count)));
        CHECK(at::equal(reader.read("optimizer_states.0.state.0.exp_avg", {begin, 1}, {count, 2}),
                        full.exp_avg.narrow(0, begin, count).narrow(1, 1, 2)));
      }
    }
    // A region that crosses every chunk boundary, and an empty one.
    CHECK(at::equal(reader.read("state_dict.counts", {1, 1}, {5, 1}), full.counts.narrow(0, 1, 5).narrow(1, 1, 1)));
    CHECK(reader.read("state_dict.counts", {7, 0}, {0, 2}).numel() == 0);
    FULGUR_CHECK_CONTAINS(error_of(
                              [&] {
                                reader.read("state_dict.counts", {6, 0}, {2, 2});
                              },
                              ErrorKind::invalid_argument),
                          "the tensor's shape is (7, 2)");
    FULGUR_CHECK_CONTAINS(error_of([&] { reader.read("nope"); }, ErrorKind::invalid_argument), "has no key 'nope'");
  }
  // Only rank 0 writes replicated tensors and non-tensor leaves (DCP's dedup): rank 1's file holds
  // just its three sharded chunks' worth of entries.
  const fs::path two = tmp / "ckpt2";
  CHECK(fs::file_size(two / "__1_0.distcp") < fs::file_size(two / "__0_0.distcp"));
}

TEST_CASE("dcp: a chunk that is a view of a larger tensor is written alone, not with its whole storage") {
  TempDir tmp;
  auto state = dict();
  state.insert("big", at::arange(100000, at::kFloat).narrow(0, 500, 10));
  std::map<std::string, dcp::Chunk> placements;
  placements["big"] = dcp::Chunk().set_global_shape({20}).set_offsets({10});
  const dcp::RankWrite written = dcp::write_rank_file(tmp.path().string(), 1, state, placements);
  REQUIRE(written.entries.size() == 1);
  CHECK(written.entries[0].length < 4096);  // 400 KB if the view's storage went along
  CHECK(written.entries[0].sizes == std::vector<int64_t>{10});
}

TEST_CASE("dcp: the writer refuses placements that do not tile the tensor, and unknown placement keys") {
  TempDir tmp;
  const FullState full;
  auto [state, placements] = rank_state(full, 0, 2);
  // Only rank 0's half: the metadata would describe a tensor with missing rows.
  const dcp::RankWrite only_rank0 = dcp::write_rank_file(tmp.path().string(), 0, state, placements);
  FULGUR_CHECK_CONTAINS(error_of([&] { dcp::write_metadata(tmp.path().string(), {only_rank0}); }),
                        "the chunks of 'state_dict.layer.weight' hold 12 of its 21 elements");
  CHECK_FALSE(fs::exists(tmp / ".metadata"));
  // Two ranks claiming the same rows.
  auto [state1, placements1] = rank_state(full, 0, 2);
  const dcp::RankWrite again = dcp::write_rank_file(tmp.path().string(), 1, state1, placements1);
  FULGUR_CHECK_CONTAINS(error_of([&] {
                          dcp::write_metadata(tmp.path().string(), {only_rank0, again});
                        }),
                        "two ranks hold the chunk of");

  placements["state_dict.typo"] = dcp::Chunk().set_global_shape({7}).set_offsets({0});
  FULGUR_CHECK_CONTAINS(error_of([&] { dcp::write_rank_file(tmp.path().string(), 0, state, placements); }),
                        "a placement names 'state_dict.typo', which is not a tensor in the state");
  placements.erase("state_dict.typo");
  placements["state_dict.layer.weight"].global_shape = {3, 3};
  FULGUR_CHECK_CONTAINS(error_of([&] { dcp::write_rank_file(tmp.path().string(), 0, state, placements); }),
                        "does not fit in its global_shape (3, 3)");
}

TEST_CASE("dcp: Python's torch.distributed.checkpoint reads a checkpoint Fulgur's ranks wrote") {
  TempDir tmp;
  const FullState full;
  const fs::path expected = tmp / "expected.pt";
  fulgur::write_checkpoint_file(full_state(full), expected.string());
  for (int64_t world : {1, 3}) {
    const fs::path dir = tmp / fmt::format("ckpt{}", world);
    write_ranks(dir, full, world);
    // dcp_to_torch_save, and dcp.load(no_dist=True) into a state dict of the right shapes.
    require_python_ok({"check", dir.string(), expected.string()});
  }
}

TEST_CASE("dcp: Fulgur reads a checkpoint Python's dcp.save wrote") {
  TempDir tmp;
  const fs::path dir = tmp / "py";
  const fs::path expected = tmp / "expected.pt";
  require_python_ok({"write", dir.string(), expected.string()});
  dcp::Reader reader(dir.string());
  check_same(reader.read_all(), fulgur::read_checkpoint_file(expected.string()), "read_all");
  CHECK(name(reader.dtype("model.layer.bias")) == name(at::kBFloat16));
  const at::Tensor weight = reader.read("model.layer.weight");
  CHECK(at::equal(reader.read("model.layer.weight", {2, 1}, {4, 2}), weight.narrow(0, 2, 4).narrow(1, 1, 2)));
  CHECK(reader.read_value("optim.param_groups.0.name").toStringRef() == "main");

  // Consolidated, Python opens it with weights_only=True.
  const fs::path out = tmp / "full.pt";
  dcp::consolidate(dir.string(), out.string());
  require_python_ok({"check-file", out.string(), expected.string()});
}

TEST_CASE("dcp: Fulgur reads a 2-rank FSDP2 checkpoint Python wrote on Gloo") {
  TempDir tmp;
  const fs::path dir = tmp / "fsdp2";
  const fs::path expected = tmp / "expected.pt";
  require_python_ok({"fsdp2", dir.string(), expected.string()});
  dcp::Reader reader(dir.string());
  // Each sharded parameter is in two chunks, one per rank's file.
  CHECK(fs::exists(dir / "__0_0.distcp"));
  CHECK(fs::exists(dir / "__1_0.distcp"));
  CHECK(reader.shape("model.0.weight") == std::vector<int64_t>{7, 3});
  CHECK(at::equal(reader.read("model.0.weight", {4, 0}, {3, 3}), reader.read("model.0.weight").narrow(0, 4, 3)));
  check_same(reader.read_all(), fulgur::read_checkpoint_file(expected.string()), "read_all");
}

TEST_CASE("dcp: consolidate writes one file torch.load(weights_only=True) opens") {
  TempDir tmp;
  const FullState full;
  const fs::path dir = tmp / "ckpt";
  write_ranks(dir, full, 3);
  const fs::path out = tmp / "full.pt";
  dcp::consolidate(dir.string(), out.string());
  check_same(fulgur::read_checkpoint_file(out.string()), full_state(full), "consolidated");
  const fs::path expected = tmp / "expected.pt";
  fulgur::write_checkpoint_file(full_state(full), expected.string());
  require_python_ok({"check-file", out.string(), expected.string()});
}

TEST_CASE("dcp: a missing or corrupt checkpoint fails with one line naming the file") {
  TempDir tmp;
  const FullState full;
  const fs::path good = tmp / "good";
  write_ranks(good, full, 2);
  const std::string metadata = read_bytes(good / ".metadata");
  auto copy_of_good = [&](const std::string& name) {
    const fs::path dir = tmp / name;
    fs::copy(good, dir, fs::copy_options::recursive);
    return dir;
  };
  auto open = [](const fs::path& dir) { return [dir] { dcp::Reader reader(dir.string()); }; };

  FULGUR_CHECK_CONTAINS(error_of(open(tmp / "absent")), "the directory does not exist");
  fs::create_directories(tmp / "empty");
  FULGUR_CHECK_CONTAINS(error_of(open(tmp / "empty")), (tmp / "empty" / ".metadata").string() + "' does not exist");
  CHECK_FALSE(dcp::is_distributed_checkpoint((tmp / "empty").string()));

  const fs::path garbage = copy_of_good("garbage");
  write_bytes(garbage / ".metadata", "not a pickle at all");
  FULGUR_CHECK_CONTAINS(error_of(open(garbage)), (garbage / ".metadata").string() + "' is corrupt");

  const fs::path cut = copy_of_good("cut");
  write_bytes(cut / ".metadata", metadata.substr(0, metadata.size() / 2));
  FULGUR_CHECK_CONTAINS(error_of(open(cut)), "truncated");

  // A global outside the allow-list is refused before anything is built; nothing runs.
  const fs::path foreign = copy_of_good("foreign");
  std::string evil = metadata;
  const size_t at = evil.find("ctorch\nSize\n");  // GLOBAL torch.Size (the first use; later ones are memo gets)
  REQUIRE(at != std::string::npos);
  evil.replace(at, 12, "cos\nsystem\n");
  write_bytes(foreign / ".metadata", evil);
  const std::string refused = error_of(open(foreign));
  FULGUR_CHECK_CONTAINS(refused, (foreign / ".metadata").string());
  FULGUR_CHECK_CONTAINS(refused, "the global 'os.system'");

  const fs::path truncated = copy_of_good("truncated");
  const std::string data = read_bytes(truncated / "__1_0.distcp");
  write_bytes(truncated / "__1_0.distcp", data.substr(0, data.size() - 100));
  const std::string short_file = error_of(open(truncated));
  FULGUR_CHECK_CONTAINS(short_file, (truncated / "__1_0.distcp").string() + "' is truncated");

  // Bytes damaged inside an entry: the entry is reported when read, naming the file.
  const fs::path damaged = copy_of_good("damaged");
  std::string bytes = read_bytes(damaged / "__1_0.distcp");
  for (size_t i = 0; i < 64; ++i) bytes[i] = 'x';
  write_bytes(damaged / "__1_0.distcp", bytes);
  dcp::Reader reader(damaged.string());
  FULGUR_CHECK_CONTAINS(error_of([&] { reader.read("state_dict.layer.weight"); }), "__1_0.distcp' is corrupt");
}

TEST_CASE("dcp: save replaces a checkpoint only with a complete one") {
  TempDir tmp;
  const fs::path dir = tmp / "ckpt";
  FullState first;
  auto [state, placements] = rank_state(first, 0, 1);
  dcp::save(dir.string(), state, placements, nullptr);
  CHECK(at::equal(dcp::Reader(dir.string()).read("state_dict.layer.weight"), first.weight));

  FullState second;
  second.weight = second.weight + 100;
  auto [state2, placements2] = rank_state(second, 0, 1);

  // A file where the temporary directory goes: the save fails, the first checkpoint stays.
  const fs::path temp = tmp / ".ckpt.dcp-tmp";
  write_bytes(temp, "in the way");
  FULGUR_CHECK_CONTAINS(error_of([&] { dcp::save(dir.string(), state2, placements2, nullptr); }),
                        "'" + temp.string() + "' is in the way");
  CHECK(at::equal(dcp::Reader(dir.string()).read("state_dict.layer.weight"), first.weight));
  fs::remove(temp);

  // A value that cannot be serialized: the same.
  auto broken = state2.toGenericDict().copy();
  broken.insert("future", c10::IValue(c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get())));
  FULGUR_CHECK_CONTAINS(error_of([&] { dcp::save(dir.string(), broken, placements2, nullptr); }),
                        "'future' cannot be serialized");
  CHECK(at::equal(dcp::Reader(dir.string()).read("state_dict.layer.weight"), first.weight));
  CHECK_FALSE(fs::exists(temp));

  // A complete save replaces it, and leaves nothing else behind.
  dcp::save(dir.string(), state2, placements2, nullptr);
  CHECK(at::equal(dcp::Reader(dir.string()).read("state_dict.layer.weight"), second.weight));
  size_t entries = 0;
  for (const auto& entry : fs::directory_iterator(tmp.path())) entries += entry.path().filename() == "ckpt" ? 0 : 1;
  CHECK(entries == 0);

  // A directory that is not a checkpoint is never replaced.
  fs::create_directories(tmp / "mine");
  write_bytes(tmp / "mine" / "notes.txt", "keep");
  FULGUR_CHECK_CONTAINS(
      error_of([&] { dcp::save((tmp / "mine").string(), state2, placements2, nullptr); }, ErrorKind::checkpoint),
      "is not a distributed checkpoint");
  CHECK(read_bytes(tmp / "mine" / "notes.txt") == "keep");
}

TEST_CASE("dcp: save is a collective: 3 ranks write one checkpoint, and one rank's failure fails all") {
  TempDir tmp;
  const fs::path dir = tmp / "ckpt";
  const FullState full;
  for (const std::string& e : save_on_threads(dir, full, 3)) CHECK(e.empty());
  dcp::Reader reader(dir.string());
  check_same(reader.read_all(), full_state(full), "read_all");
  for (int64_t r = 0; r < 3; ++r) CHECK(fs::exists(dir / fmt::format("__{}_0.distcp", r)));

  FullState second;
  second.exp_avg = second.exp_avg * 3;
  const std::vector<std::string> errors = save_on_threads(dir, second, 3, [](int64_t rank, c10::IValue& state) {
    if (rank == 2) {
      auto d = state.toGenericDict();
      d.insert("bad", at::ones({2}).to_sparse());  // rank 2 cannot write its file
    }
  });
  for (const std::string& e : errors) {
    INFO(e);
    CHECK(contains(e, "failed on rank 2"));
    CHECK(contains(e, "'bad' is not a dense tensor"));
  }
  CHECK(at::equal(dcp::Reader(dir.string()).read("optimizer_states.0.state.0.exp_avg"), full.exp_avg));
  CHECK_FALSE(fs::exists(tmp / ".ckpt.dcp-tmp"));
}

TEST_CASE("dcp: fulgur checkpoint consolidate IN OUT in a real process") {
  TempDir tmp;
  const FullState full;
  const fs::path dir = tmp / "ckpt";
  write_ranks(dir, full, 2);
  const fs::path out = tmp / "full.ckpt";
  const ProcessRun run =
      run_process({FULGUR_TEST_FULGUR_BIN, "checkpoint", "consolidate", dir.string(), out.string()}, {}, tmp.path());
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  FULGUR_CHECK_CONTAINS(run.output, out.string());
  check_same(fulgur::read_checkpoint_file(out.string()), full_state(full), "consolidated");

  const ProcessRun listed =
      run_process({FULGUR_TEST_FULGUR_BIN, "checkpoint", "inspect", dir.string()}, {}, tmp.path());
  INFO(listed.output);
  CHECK(listed.exit_code == 0);
  FULGUR_CHECK_CONTAINS(listed.output, "2 data files");
  FULGUR_CHECK_CONTAINS(listed.output, "optimizer_states.0.state.0.exp_avg");

  // The consolidated file is a checkpoint like any other: its weights convert to safetensors.
  const fs::path weights = tmp / "model.safetensors";
  const ProcessRun converted =
      run_process({FULGUR_TEST_FULGUR_BIN, "weights", "convert", out.string(), weights.string()}, {}, tmp.path());
  INFO(converted.output);
  REQUIRE(converted.exit_code == 0);
  const fulgur::TensorMap tensors = fulgur::read_weights(weights.string());
  CHECK(tensors.size() == 5);
  CHECK(at::equal(tensors.at("layer.weight"), full.weight));
  CHECK(at::equal(tensors.at("layer.bias"), full.bias));

  const ProcessRun bad = run_process(
      {FULGUR_TEST_FULGUR_BIN, "checkpoint", "consolidate", (tmp / "nope").string(), (tmp / "x.ckpt").string()}, {},
      tmp.path());
  CHECK(bad.exit_code != 0);
  FULGUR_CHECK_CONTAINS(bad.output, "the directory does not exist");
  CHECK_FALSE(fs::exists(tmp / "x.ckpt"));
}
