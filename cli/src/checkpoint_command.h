// `fulgur checkpoint ...`: distributed (torch.distributed.checkpoint) checkpoint directories.
#pragma once

#include <string>
#include <vector>

namespace fulgur::cli {

// positional = {"checkpoint", SUBCOMMAND, ...}; returns the exit status. Throws fulgur::Error.
int checkpoint_main(const std::vector<std::string>& positional);

}  // namespace fulgur::cli
