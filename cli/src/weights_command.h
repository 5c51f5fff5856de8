// `fulgur weights ...`: convert and inspect weight files (torch.save, Lightning .ckpt, safetensors).
#pragma once

#include <string>
#include <vector>

namespace fulgur::cli {

// positional = {"weights", SUBCOMMAND, ...}; returns the exit status. Throws fulgur::Error.
int weights_main(const std::vector<std::string>& positional);

}  // namespace fulgur::cli
