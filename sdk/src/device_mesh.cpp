// DeviceMesh: PyTorch's init_device_mesh layout over Communicator sub-groups.
#include <fulgur/communicator.h>
#include <fulgur/device_mesh.h>
#include <fulgur/error.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <set>

namespace fulgur {

CommunicatorGroups::~CommunicatorGroups() = default;

CommunicatorGroups* find_communicator_groups(Communicator& communicator) noexcept {
  // Communicator has no extension() (SDK 1.0 vtable); its implementations that offer groups derive
  // from both, and the typeinfo of both lives in this library, so the cross-cast works across
  // plugins loaded with RTLD_LOCAL.
  return dynamic_cast<CommunicatorGroups*>(&communicator);
}

struct DeviceMesh::State {
  int64_t global_rank = 0;
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  std::vector<std::shared_ptr<Communicator>> groups;
};

namespace {

int64_t product(std::span<const int64_t> shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

void check_layout(const std::vector<int64_t>& shape, const std::vector<std::string>& names) {
  if (shape.empty() || shape.size() != names.size())
    throw Error(ErrorKind::invalid_argument,
                fmt::format("DeviceMesh: {} dimension sizes ({}) for {} names ({}); give one name per dimension",
                            shape.size(), fmt::join(shape, ", "), names.size(), fmt::join(names, ", ")));
  std::set<std::string> seen;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 1)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("DeviceMesh: dimension '{}' has size {}; sizes must be at least 1", names[i], shape[i]));
    if (names[i].empty() || !seen.insert(names[i]).second)
      throw Error(
          ErrorKind::invalid_argument,
          fmt::format("DeviceMesh: dimension names must be distinct and non-empty, got ({})", fmt::join(names, ", ")));
  }
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<const State> state) : state_(std::move(state)) {}

std::vector<int64_t> DeviceMesh::coordinate_of(std::span<const int64_t> shape, int64_t global_rank) {
  std::vector<int64_t> coordinate(shape.size());
  int64_t rest = global_rank;
  for (size_t d = shape.size(); d-- > 0;) {
    coordinate[d] = rest % shape[d];
    rest /= shape[d];
  }
  return coordinate;
}

std::vector<int64_t> DeviceMesh::group_ranks(std::span<const int64_t> shape, int64_t global_rank, int64_t dim) {
  if (dim < 0 || dim >= static_cast<int64_t>(shape.size()) || global_rank < 0 || global_rank >= product(shape))
    throw Error(ErrorKind::invalid_argument,
                fmt::format("DeviceMesh::group_ranks: dimension {} or rank {} outside a mesh of shape ({})", dim,
                            global_rank, fmt::join(shape, ", ")));
  // Row-major: the stride of dimension d is the product of the sizes after it.
  int64_t stride = 1;
  for (size_t d = static_cast<size_t>(dim) + 1; d < shape.size(); ++d) stride *= shape[d];
  const int64_t coordinate = (global_rank / stride) % shape[static_cast<size_t>(dim)];
  const int64_t first = global_rank - coordinate * stride;
  std::vector<int64_t> ranks;
  for (int64_t i = 0; i < shape[static_cast<size_t>(dim)]; ++i) ranks.push_back(first + i * stride);
  return ranks;
}

DeviceMesh DeviceMesh::create(Communicator& world, std::vector<int64_t> shape, std::vector<std::string> names) {
  check_layout(shape, names);
  if (product(shape) != world.world_size())
    throw Error(ErrorKind::invalid_argument,
                fmt::format("DeviceMesh: a mesh of shape ({}) = {} ranks over a job of {}; the sizes' product must "
                            "equal the number of processes",
                            fmt::join(shape, " x "), product(shape), world.world_size()));
  CommunicatorGroups* groups = find_communicator_groups(world);
  if (groups == nullptr && world.world_size() > 1)
    throw Error(ErrorKind::invalid_argument,
                "DeviceMesh: the communicator cannot form sub-groups (it does not implement "
                "fulgur::CommunicatorGroups); use the host's communicator from StrategyEnvironment::connect");
  auto state = std::make_shared<State>();
  state->global_rank = world.rank();
  for (size_t d = 0; d < shape.size(); ++d) {
    const std::vector<int64_t> ranks = group_ranks(shape, world.rank(), static_cast<int64_t>(d));
    if (groups == nullptr) {
      state->groups.push_back(nullptr);  // one process: every group is this rank alone
      continue;
    }
    // Each group forms over a store prefix of its own, named by dimension and first member; the
    // groups along one dimension are disjoint, so ranks form them in the same order without waiting
    // on each other.
    state->groups.push_back(
        groups->new_group(ranks, fmt::format("mesh/{}/{}/{}", fmt::join(names, "_"), names[d], ranks.front())));
  }
  state->shape = std::move(shape);
  state->names = std::move(names);
  return DeviceMesh(std::move(state));
}

DeviceMesh DeviceMesh::from_groups(int64_t global_rank, std::vector<int64_t> shape, std::vector<std::string> names,
                                   std::vector<std::shared_ptr<Communicator>> groups) {
  check_layout(shape, names);
  if (groups.size() != shape.size())
    throw Error(ErrorKind::invalid_argument,
                fmt::format("DeviceMesh::from_groups: {} groups for {} dimensions", groups.size(), shape.size()));
  for (size_t d = 0; d < shape.size(); ++d)
    if (groups[d] && groups[d]->world_size() != shape[d])
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("DeviceMesh::from_groups: the group of dimension '{}' has {} ranks, the mesh {}",
                              names[d], groups[d]->world_size(), shape[d]));
  auto state = std::make_shared<State>();
  state->global_rank = global_rank;
  state->shape = std::move(shape);
  state->names = std::move(names);
  state->groups = std::move(groups);
  return DeviceMesh(std::move(state));
}

int64_t DeviceMesh::ndim() const { return static_cast<int64_t>(state_->shape.size()); }
const std::vector<int64_t>& DeviceMesh::shape() const { return state_->shape; }
const std::vector<std::string>& DeviceMesh::names() const { return state_->names; }
int64_t DeviceMesh::global_rank() const { return state_->global_rank; }
std::vector<int64_t> DeviceMesh::coordinate() const { return coordinate_of(state_->shape, state_->global_rank); }

bool DeviceMesh::has_dim(std::string_view name) const {
  return std::find(state_->names.begin(), state_->names.end(), name) != state_->names.end();
}

int64_t DeviceMesh::dim(std::string_view name) const {
  const auto it = std::find(state_->names.begin(), state_->names.end(), name);
  if (it == state_->names.end())
    throw Error(ErrorKind::invalid_argument,
                fmt::format("DeviceMesh: no dimension '{}'; the mesh has ({})", name, fmt::join(state_->names, ", ")));
  return it - state_->names.begin();
}

int64_t DeviceMesh::size(std::string_view name) const { return state_->shape[static_cast<size_t>(dim(name))]; }
int64_t DeviceMesh::local_rank(std::string_view name) const { return coordinate()[static_cast<size_t>(dim(name))]; }
std::shared_ptr<Communicator> DeviceMesh::group(std::string_view name) const {
  return state_->groups[static_cast<size_t>(dim(name))];
}
std::vector<int64_t> DeviceMesh::group_ranks(std::string_view name) const {
  return group_ranks(state_->shape, state_->global_rank, dim(name));
}

}  // namespace fulgur
