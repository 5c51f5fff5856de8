/// @file
/// Visibility of the SDK's own symbols. Plugins are built with hidden visibility; everything the
/// host and plugins must agree on (interfaces' typeinfo, Error) is exported explicitly so that
/// exceptions and dynamic_cast work across library boundaries on every standard library.
#pragma once

/// Exports a symbol of the SDK library (interfaces, Error, free functions) to the host and plugins.
#define FULGUR_SDK_API __attribute__((visibility("default")))
/// Keeps a symbol inside the library that defines it (per-plugin-library state in headers).
#define FULGUR_HIDDEN __attribute__((visibility("hidden")))
