/// @file
/// Optional extension interfaces: how the SDK grows after 1.0 without changing a vtable.
///
/// The base interfaces (Accelerator, Strategy, Precision, Logger, Profiler, Callback,
/// TrainerContext, Module, DataModule) are frozen at SDK 1.0: their virtual functions, their order
/// and the types they exchange never change within 1.x, so a plugin binary built against 1.N keeps
/// loading and running in every later 1.x host. A capability added later is an *extension
/// interface*: a small abstract class with a unique, versioned id (`kExtensionId`). An object that
/// offers it derives from it and answers `extension(id)` with a pointer to it; everything else
/// answers nullptr and the caller takes the default path. An extension, once released, is frozen
/// as well: a changed one is a new class with a new id ("/2").
///
/// A plugin opts in by listing the extensions it implements:
///
///   class CudaAccelerator final
///       : public fulgur::WithExtensions<fulgur::Accelerator, fulgur::StepGraphFactory> {
///     std::unique_ptr<fulgur::StepGraph> make_step_graph(const c10::Device& d) override;
///     ...
///   };
///
/// and the host (or another plugin) asks for it:
///
///   if (auto* graphs = fulgur::find_extension<fulgur::StepGraphFactory>(accelerator)) ...
///
/// This is COM's QueryInterface / PJRT's extension chain, kept in C++: the id is a string compared
/// by value, so it works across libraries loaded with RTLD_LOCAL and needs no RTTI.
#pragma once

#include <concepts>
#include <string_view>

namespace fulgur {

/// An extension interface: a class with `static constexpr std::string_view kExtensionId`, by
/// convention "fulgur.<kind>.<name>/<version>" (third parties use their own prefix).
template <class Ext>
concept ExtensionInterface = requires {
  { Ext::kExtensionId } -> std::convertible_to<std::string_view>;
};

/// `object`'s implementation of the extension `Ext`, or nullptr when it does not offer it.
/// `Object` is any SDK interface (they all declare `void* extension(std::string_view)`). The
/// pointer lives as long as the object.
template <ExtensionInterface Ext, class Object>
Ext* find_extension(Object& object) noexcept {
  return static_cast<Ext*>(object.extension(Ext::kExtensionId));
}

/// As above, for a pointer that may be null (then nullptr).
template <ExtensionInterface Ext, class Object>
Ext* find_extension(Object* object) noexcept {
  return object ? find_extension<Ext>(*object) : nullptr;
}

/// A plugin class of interface `Base` that implements the extension interfaces `Exts`: derive from
/// it instead of `Base`, override the extensions' functions, and `extension(id)` answers for each
/// of them (then defers to `Base`). Constructors of `Base` are inherited.
template <class Base, ExtensionInterface... Exts>
class WithExtensions : public Base, public Exts... {
 public:
  using Base::Base;

  /// The extension named `id` among `Exts`, else Base's answer.
  void* extension(std::string_view id) noexcept override {
    void* found = nullptr;
    ((found = (found == nullptr && id == Exts::kExtensionId) ? static_cast<void*>(static_cast<Exts*>(this)) : found),
     ...);
    return found != nullptr ? found : Base::extension(id);
  }
};

}  // namespace fulgur
