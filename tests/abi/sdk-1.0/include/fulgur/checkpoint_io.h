/// @file
/// Checkpoint files and other run artifacts, written so that a crash or a full disk never leaves a
/// half-written file under the final name and never destroys the previous version. Plain file
/// operations: not collectives (in a multi-process run, one rank writes).
#pragma once

#include <fulgur/export.h>

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace c10 {
struct IValue;
}

namespace fulgur {

/// Writes `checkpoint` to `path` atomically: a temporary file in the same directory, fsync, rename
/// over `path`, fsync of the directory. The directory must exist. The file is a PyTorch zip
/// archive laid out as torch::pickle_save lays it out, minus its TorchScript type tags
/// (torch.load(weights_only=True) refuses those): Python opens it with
/// `torch.load(path, weights_only=True)` when it holds dicts, lists, tuples, strings, numbers,
/// booleans, None and tensors (build dicts as c10::impl::GenericDict(StringType, AnyType)).
/// Tensors are streamed to the file (no second in-memory copy of the archive); tensors on a device
/// are copied to the CPU one by one. Throws fulgur::Error naming the path: ErrorKind::io for what
/// the OS refused (with its reason), ErrorKind::checkpoint when the value cannot be serialized. On
/// any failure the temporary file is removed and a previous file at `path` is left exactly as it
/// was.
FULGUR_SDK_API void write_checkpoint_file(const c10::IValue& checkpoint, const std::string& path);

/// Reads a checkpoint written by write_checkpoint_file or Python's torch.save, with every tensor
/// placed on `map_location` (the CPU by default, as Lightning loads checkpoints). A missing,
/// unreadable, truncated or corrupt file throws fulgur::Error(ErrorKind::checkpoint) naming the
/// path and what is wrong; no c10::Error escapes. Containers come back untyped, as from any
/// torch.save file: dicts as GenericDict(Any, Any), lists as List[Any] (read them with toList(),
/// not toIntList()).
FULGUR_SDK_API c10::IValue read_checkpoint_file(const std::string& path,
                                                c10::Device map_location = c10::Device(c10::DeviceType::CPU));

/// When the checkpoint at `path` was completed, in nanoseconds since the epoch (for "which is
/// newer"): a checkpoint file's mtime, or that of a distributed checkpoint directory's `.metadata`,
/// which its writer puts there last. nullopt when `path` is neither. Does not throw for a missing
/// path.
FULGUR_SDK_API std::optional<int64_t> checkpoint_completed_ns(const std::string& path);

/// Replaces the file at `path` with `content` atomically (same temp + fsync + rename protocol).
/// For small text artifacts such as hparams.yaml or profiler reports. The directory must exist.
/// Throws fulgur::Error(io) naming the path; a previous file is then left as it was.
FULGUR_SDK_API void atomic_write_text(const std::string& path, std::string_view content);

}  // namespace fulgur
