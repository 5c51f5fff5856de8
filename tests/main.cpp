// The one test executable's main. Test files are listed in tests/CMakeLists.txt.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
