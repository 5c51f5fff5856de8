/// @file
/// DeviceMesh: the job's ranks laid out as an n-dimensional grid with named dimensions ("dp",
/// "tp"), and one Communicator per dimension over the ranks that share every other coordinate.
/// The layout is PyTorch's init_device_mesh: ranks in row-major order, the last dimension fastest,
/// so on a (dp = 2, tp = 2) mesh rank r sits at (r / 2, r % 2), tp groups are {0, 1}, {2, 3} and
/// dp groups {0, 2}, {1, 3}. Not yet part of a released SDK (added for SDK 1.3).
#pragma once

#include <fulgur/export.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

class Communicator;

/// Extension of a Communicator: sub-groups over some of its ranks (c10d's new_group). The core's
/// Communicator implements it; find it with find_communicator_groups (Communicator predates
/// extension(), so the lookup is a cross-cast inside the SDK).
class FULGUR_SDK_API CommunicatorGroups {
 public:
  /// The extension's id.
  static constexpr std::string_view kExtensionId = "fulgur.communicator.groups/1";
  /// Destroys the interface.
  virtual ~CommunicatorGroups();
  /// A communicator over `ranks` (global ranks, ascending, this rank among them); its rank() is
  /// this rank's index in `ranks`. `name` must be unique per group in the job and the same on
  /// every member. A collective over the members only: every member calls it with the same
  /// arguments; other ranks need not. Throws fulgur::Error(invalid_argument) for a bad rank list,
  /// fulgur::Error(distributed) when the group cannot be formed.
  virtual std::shared_ptr<Communicator> new_group(std::span<const int64_t> ranks, std::string_view name) = 0;
};

/// `communicator`'s CommunicatorGroups, or nullptr when it offers none.
FULGUR_SDK_API CommunicatorGroups* find_communicator_groups(Communicator& communicator) noexcept;

/// A grid of ranks with named dimensions and a Communicator per dimension. Cheap to copy (shared
/// state); the communicators live as long as any copy.
class FULGUR_SDK_API DeviceMesh {
 public:
  /// A mesh of `shape` (its product must equal world.world_size()) with dimension `names`
  /// (distinct, non-empty) over `world`, which must offer CommunicatorGroups. A collective: every
  /// rank of `world` calls it with the same arguments. Dimensions of size 1 get a one-rank group.
  /// Throws fulgur::Error(invalid_argument) naming what does not fit.
  static DeviceMesh create(Communicator& world, std::vector<int64_t> shape, std::vector<std::string> names);
  /// A mesh from communicators made elsewhere: groups[i] must be this rank's group along
  /// dimension i (size shape[i]). For tests and for strategies that already hold their groups.
  static DeviceMesh from_groups(int64_t global_rank, std::vector<int64_t> shape, std::vector<std::string> names,
                                std::vector<std::shared_ptr<Communicator>> groups);

  /// The global ranks of the group of `global_rank` along dimension `dim` of a mesh of `shape`
  /// (row-major, last dimension fastest), ascending. Pure layout: no communication.
  static std::vector<int64_t> group_ranks(std::span<const int64_t> shape, int64_t global_rank, int64_t dim);
  /// `global_rank`'s coordinate in a mesh of `shape`.
  static std::vector<int64_t> coordinate_of(std::span<const int64_t> shape, int64_t global_rank);

  int64_t ndim() const;                           ///< number of dimensions
  const std::vector<int64_t>& shape() const;      ///< size per dimension
  const std::vector<std::string>& names() const;  ///< name per dimension
  int64_t global_rank() const;                    ///< this rank in the whole mesh
  std::vector<int64_t> coordinate() const;        ///< this rank's coordinate
  /// The index of dimension `name`; throws fulgur::Error(invalid_argument) listing the names.
  int64_t dim(std::string_view name) const;
  /// Whether the mesh has a dimension `name`.
  bool has_dim(std::string_view name) const;
  int64_t size(std::string_view name) const;        ///< ranks along `name`
  int64_t local_rank(std::string_view name) const;  ///< this rank's coordinate along `name`
  /// This rank's group along `name` (its rank() is local_rank(name)).
  std::shared_ptr<Communicator> group(std::string_view name) const;
  /// The global ranks of this rank's group along `name`.
  std::vector<int64_t> group_ranks(std::string_view name) const;

 private:
  struct State;
  explicit DeviceMesh(std::shared_ptr<const State> state);
  std::shared_ptr<const State> state_;
};

}  // namespace fulgur
