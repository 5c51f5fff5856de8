// Visibility of the SDK's own symbols. Plugins are built with hidden visibility; everything the
// host and plugins must agree on (interfaces' typeinfo, Error) is exported explicitly so that
// exceptions and dynamic_cast work across library boundaries on every standard library.
#pragma once

#define FULGUR_SDK_API __attribute__((visibility("default")))
#define FULGUR_HIDDEN __attribute__((visibility("hidden")))
