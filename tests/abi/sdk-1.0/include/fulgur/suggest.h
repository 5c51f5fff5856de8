/// @file
/// "Did you mean": the closest of a set of names, shared by the registry, the config loader and
/// plugins (unknown plugin names, option keys, metric names).
#pragma once

#include <fulgur/export.h>

#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

/// Levenshtein distance between two names (insertions, deletions and substitutions of bytes).
FULGUR_SDK_API size_t edit_distance(std::string_view a, std::string_view b);

/// The choice closest to `word` by edit distance, or empty when nothing is close enough (a
/// distance above max(2, size of `word` / 3)). Ties go to the earliest choice.
FULGUR_SDK_API std::string closest_match(std::string_view word, const std::vector<std::string>& choices);

}  // namespace fulgur
