/// @file
/// The one header a plugin author includes: the six interfaces, Storage, Options, logging, errors, and
/// FULGUR_PLUGIN, which describes a plugin class to the host (the C descriptor the library's entry
/// point returns, the same facts as an ELF note, and a factory that never throws across the C
/// door).
#pragma once

#include <fulgur/abi.h>
#include <fulgur/abi_tag.h>
#include <fulgur/accelerator.h>
#include <fulgur/callback.h>
#include <fulgur/error.h>
#include <fulgur/log.h>
#include <fulgur/logger.h>
#include <fulgur/option_spec.h>
#include <fulgur/options.h>
#include <fulgur/plugin_options.h>
#include <fulgur/precision.h>
#include <fulgur/profiler.h>
#include <fulgur/storage.h>
#include <fulgur/strategy.h>
#include <fulgur/trainer_context.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <type_traits>
#include <vector>

namespace fulgur {

// The user's side of a run (model and datamodule plugins) derives from the core's user API,
// fulgur/module.h and fulgur/data_module.h; a plugin of those kinds links Fulgur::core. Declared here
// only so that FULGUR_PLUGIN can tell the kinds apart.
class Module;
class DataModule;

namespace detail {

/// The fulgur_kind of plugin class T, from the interface it derives from.
template <class T>
constexpr uint32_t kind_of() {
  if constexpr (std::is_base_of_v<Accelerator, T>)
    return FULGUR_KIND_ACCELERATOR;
  else if constexpr (std::is_base_of_v<Strategy, T>)
    return FULGUR_KIND_STRATEGY;
  else if constexpr (std::is_base_of_v<Precision, T>)
    return FULGUR_KIND_PRECISION;
  else if constexpr (std::is_base_of_v<Logger, T>)
    return FULGUR_KIND_LOGGER;
  else if constexpr (std::is_base_of_v<Profiler, T>)
    return FULGUR_KIND_PROFILER;
  else if constexpr (std::is_base_of_v<Callback, T>)
    return FULGUR_KIND_CALLBACK;
  else if constexpr (std::is_base_of_v<Module, T>)
    return FULGUR_KIND_MODEL;
  else if constexpr (std::is_base_of_v<DataModule, T>)
    return FULGUR_KIND_DATAMODULE;
  else if constexpr (std::is_base_of_v<Storage, T>)
    return FULGUR_KIND_STORAGE;
  else
    static_assert(sizeof(T) == 0,
                  "a Fulgur plugin class must derive from one of the six interfaces, fulgur::Storage, "
                  "fulgur::Module or fulgur::DataModule");
}

/// The interface T implements (what its factory returns for the six kinds and storage).
template <class T>
using interface_of = std::conditional_t<
    std::is_base_of_v<Accelerator, T>, Accelerator,
    std::conditional_t<
        std::is_base_of_v<Strategy, T>, Strategy,
        std::conditional_t<std::is_base_of_v<Precision, T>, Precision,
                           std::conditional_t<std::is_base_of_v<Logger, T>, Logger,
                                              std::conditional_t<std::is_base_of_v<Profiler, T>, Profiler,
                                                                 std::conditional_t<std::is_base_of_v<Storage, T>,
                                                                                    Storage, Callback>>>>>>;

/// What T's factory returns as void*: its interface; model and datamodule plugins hand out the
/// core's user API types.
template <class T>
using created_type_of =
    std::conditional_t<std::is_base_of_v<Module, T>, Module,
                       std::conditional_t<std::is_base_of_v<DataModule, T>, DataModule, interface_of<T>>>;

/// FULGUR_PLUGIN's options as an array.
template <class... O>
constexpr std::array<OptionSpec, sizeof...(O)> make_options(O... options) {
  return {options...};
}

/// FULGUR_PLUGIN without options on a class that declares typed Options (their schema) or
/// hparams_schema (that schema).
template <class T, size_t N>
constexpr auto options_or_schema(std::array<OptionSpec, N> given) {
  if constexpr (N == 0 && HasTypedOptions<T>)
    return T::Options::schema;
  else if constexpr (N == 0 && requires { T::hparams_schema; })
    return T::hparams_schema;
  else
    return given;
}

/// Marks "required" in the note, where a null pointer cannot be stored.
inline constexpr char kRequiredMarker[] = "\x01";

/// Bytes of `s` with its terminating NUL.
constexpr size_t cstr_bytes(const char* s) {
  size_t n = 0;
  while (s[n] != '\0') ++n;
  return n + 1;
}

/// Bytes of the note's strings for plugin Spec.
template <class Spec>
constexpr size_t note_strings_size() {
  size_t n = cstr_bytes(Spec::name) + cstr_bytes(Spec::version) + cstr_bytes(Spec::description);
  for (const OptionSpec& o : Spec::options)
    n += cstr_bytes(o.key) + cstr_bytes(o.default_value ? o.default_value : kRequiredMarker) + cstr_bytes(o.help);
  return n;
}

/// The ELF note as it lies in the file: Elf64_Nhdr, owner, then the pointer-free payload.
template <size_t K, size_t S>
struct alignas(4) NoteImage {
  uint32_t namesz;
  uint32_t descsz;
  uint32_t type;
  char owner[8];
  fulgur_note_header header;
  uint32_t option_types[K == 0 ? 1 : K];
  char strings[(S + 3) / 4 * 4];
};

/// Copies `s` with its NUL to `out`; returns the byte after it.
constexpr char* copy_cstr(char* out, const char* s) {
  while (*s != '\0') *out++ = *s++;
  *out++ = '\0';
  return out;
}

/// The ELF note of plugin Spec, built at compile time.
template <class Spec>
constexpr auto make_note() {
  constexpr size_t K = Spec::options.size();
  constexpr size_t S = note_strings_size<Spec>();
  using Image = NoteImage<K, S>;
  Image note{};
  note.namesz = sizeof(FULGUR_NOTE_OWNER);
  note.descsz = static_cast<uint32_t>(sizeof(Image) - offsetof(Image, header));
  note.type = FULGUR_NOTE_TYPE;
  for (size_t i = 0; i < sizeof(FULGUR_NOTE_OWNER); ++i) note.owner[i] = FULGUR_NOTE_OWNER[i];
  note.header.struct_size = sizeof(fulgur_note_header);
  note.header.abi_major = FULGUR_PLUGIN_ABI_MAJOR;
  note.header.abi_minor = FULGUR_PLUGIN_ABI_MINOR;
  note.header.kind = kind_of<typename Spec::type>();
  note.header.abi_tag = this_abi_tag();
  note.header.option_count = static_cast<uint32_t>(K);
  note.header.strings_size = static_cast<uint32_t>(S);
  char* out = note.strings;
  out = copy_cstr(out, Spec::name);
  out = copy_cstr(out, Spec::version);
  out = copy_cstr(out, Spec::description);
  for (size_t i = 0; i < K; ++i) {
    const OptionSpec& o = Spec::options[i];
    note.option_types[i] = static_cast<uint32_t>(o.type);
    out = copy_cstr(out, o.key);
    out = copy_cstr(out, o.default_value ? o.default_value : kRequiredMarker);
    out = copy_cstr(out, o.help);
  }
  return note;
}

/// Writes `message` into the host's error buffer, truncated to fit.
inline void report_create_error(const fulgur_create_args* args, const char* message) noexcept {
  if (args == nullptr || args->error_buffer == nullptr || args->error_buffer_size == 0) return;
  std::strncpy(args->error_buffer, message, args->error_buffer_size - 1);
  args->error_buffer[args->error_buffer_size - 1] = '\0';
}

/// fulgur_plugin_desc::create for T: constructs T from the host's Options (or by default when T
/// takes none), warns about undeclared callback hooks, and never lets an exception cross the C
/// door: what the constructor throws becomes the error text and a null result.
template <class T>
void* create(const fulgur_create_args* args) noexcept {
  try {
    created_type_of<T>* object = nullptr;
    static const Options kEmpty;
    const Options* options = args && args->options ? static_cast<const Options*>(args->options) : &kEmpty;
    if constexpr (HasTypedOptions<T>) {
      static_assert(std::is_constructible_v<T, const typename T::Options&>,
                    "a plugin class with a FULGUR_OPTIONS struct `Options` takes it in its constructor");
      object = new T(T::Options::from(*options));
    } else if constexpr (std::is_constructible_v<T, const Options&>) {
      object = new T(*options);
    } else {
      object = new T();
    }
    if constexpr (std::is_base_of_v<Callback, T>) {
      // A callback whose hook set depends on its options names those hooks in a static
      // kConditionalHooks (HookSet): leaving them out of hooks() is then intended.
      HookSet overridden = overridden_hooks<T>();
      if constexpr (requires { T::kConditionalHooks; }) overridden &= ~static_cast<HookSet>(T::kConditionalHooks);
      warn_undeclared_hooks(*object, overridden, args);
    }
    return static_cast<void*>(object);
  } catch (const std::exception& e) {
    report_create_error(args, e.what());
  } catch (...) {
    report_create_error(args, "unknown exception (not derived from std::exception)");
  }
  return nullptr;
}

/// fulgur_plugin_desc::destroy for T: deletes through the created type (virtual destructor).
template <class T>
void destroy(void* object) noexcept {
  delete static_cast<created_type_of<T>*>(object);
}

/// The C descriptor of plugin Spec, as static constexpr data of the plugin library.
template <class Spec>
struct Descriptor {
  using T = typename Spec::type;
  static constexpr size_t K = Spec::options.size();
  static constexpr std::array<fulgur_option_desc, K> options = [] {
    std::array<fulgur_option_desc, K> out{};
    for (size_t i = 0; i < K; ++i)
      out[i] = fulgur_option_desc{static_cast<uint32_t>(sizeof(fulgur_option_desc)),
                                  static_cast<uint32_t>(Spec::options[i].type), Spec::options[i].key,
                                  Spec::options[i].default_value, Spec::options[i].help};
    return out;
  }();
  static constexpr fulgur_plugin_desc desc{static_cast<uint32_t>(sizeof(fulgur_plugin_desc)),
                                           FULGUR_PLUGIN_ABI_MAJOR,
                                           FULGUR_PLUGIN_ABI_MINOR,
                                           kind_of<T>(),
                                           Spec::name,
                                           Spec::version,
                                           Spec::description,
                                           this_abi_tag(),
                                           static_cast<uint32_t>(K),
                                           K ? options.data() : nullptr,
                                           &create<T>,
                                           &destroy<T>};
};

/// Per-library list of descriptors, filled by Registrar at static initialisation. Hidden: a
/// default-visibility static here would become a process-wide GNU_UNIQUE object shared by every
/// plugin library.
FULGUR_HIDDEN inline std::vector<const fulgur_plugin_desc*>& descriptors() {
  static std::vector<const fulgur_plugin_desc*> list;
  return list;
}

/// The list the entry point returns (this library's descriptors).
FULGUR_HIDDEN inline const fulgur_plugin_list* plugin_list() {
  static fulgur_plugin_list list{};
  list.struct_size = static_cast<uint32_t>(sizeof(fulgur_plugin_list));
  list.count = static_cast<uint32_t>(descriptors().size());
  list.items = descriptors().data();
  return &list;
}

/// Adds one descriptor to this library's list when the library is loaded (static initialisation).
struct Registrar {
  explicit Registrar(const fulgur_plugin_desc* desc) { descriptors().push_back(desc); }
};

}  // namespace detail
}  // namespace fulgur

extern "C" {
/// The link-time ABI guard symbol named after this translation unit's ABI (FULGUR_ABI_GUARD),
/// defined by the SDK library of a matching build only.
FULGUR_SDK_API extern const int FULGUR_ABI_GUARD;

/// The library's entry point, FULGUR_PLUGIN_QUERY_SYMBOL (emitted once per library even when many
/// TUs include this header): every plugin FULGUR_PLUGIN described in the library. Called by the
/// host after loading the library; never throws.
__attribute__((visibility("default"), used)) inline const fulgur_plugin_list* fulgur_plugin_query_v1() {
  return ::fulgur::detail::plugin_list();
}
}

namespace {
/// Referencing the guard makes a plugin built for another ABI fail to load with a named symbol.
[[gnu::used]] const int* const fulgur_abi_guard_reference = &FULGUR_ABI_GUARD;
}  // namespace

/// FULGUR_PLUGIN with an explicit unique `Id` for the generated names; use FULGUR_PLUGIN.
#define FULGUR_PLUGIN_IMPL(Class, Name, Version, Description, Id, ...)                                                 \
  namespace {                                                                                                          \
  struct FULGUR_PP_CAT(fulgur_spec_, Id) {                                                                             \
    using type = Class;                                                                                                \
    static constexpr const char* name = Name;                                                                          \
    static constexpr const char* version = Version;                                                                    \
    static constexpr const char* description = Description;                                                            \
    static constexpr auto options =                                                                                    \
        ::fulgur::detail::options_or_schema<Class>(::fulgur::detail::make_options(__VA_ARGS__));                       \
  };                                                                                                                   \
  [[gnu::section(".note.fulgur.plugin"), gnu::used, gnu::aligned(4)]] constexpr auto FULGUR_PP_CAT(fulgur_note_, Id) = \
      ::fulgur::detail::make_note<FULGUR_PP_CAT(fulgur_spec_, Id)>();                                                  \
  const ::fulgur::detail::Registrar FULGUR_PP_CAT(fulgur_registrar_, Id){                                              \
      &::fulgur::detail::Descriptor<FULGUR_PP_CAT(fulgur_spec_, Id)>::desc};                                           \
  }

/// Describes plugin class `Class` to the host: FULGUR_PLUGIN(Class, "name", "version",
/// "description", FULGUR_OPTION(...)...). Write it once per plugin class, at namespace scope in one
/// source file of the plugin library (a library may hold several plugins). `Class` derives from one
/// of the six interfaces (or fulgur::Storage, fulgur::Module, fulgur::DataModule) and is constructible from
/// `const fulgur::Options&` (its validated TOML table) or by default; its constructor may throw
/// (fulgur::Error, with a message that says what to fix), its destructor must not (it runs inside
/// the noexcept `destroy`). `name` is what the TOML selects ([a-z0-9_.-], unique per kind). The
/// options declare the TOML keys it accepts, read from the TOML table that selects the plugin; none
/// given means the class's typed `Options` (a FULGUR_OPTIONS struct, fulgur/plugin_options.h:
/// the constructor then takes that struct, filled in) or its `hparams_schema`, if it has one.
///
/// @code
///   #include <fulgur/plugin.h>
///   class Hello : public fulgur::Callback {
///    public:
///     explicit Hello(const fulgur::Options& o) : greeting_(o.get_string("greeting")) {}
///     fulgur::HookSet hooks() const override { return fulgur::Hook::fit_start | fulgur::Hook::fit_end; }
///     void on_fit_start(fulgur::TrainerContext&) override { std::puts(greeting_.c_str()); }
///    private:
///     std::string greeting_;
///   };
///   FULGUR_PLUGIN(Hello, "hello", "1.0.0", "Prints a greeting when fit starts",
///                 FULGUR_OPTION(string, greeting, "What to print", "hello"))
/// @endcode
#define FULGUR_PLUGIN(Class, Name, Version, Description, ...) \
  FULGUR_PLUGIN_IMPL(Class, Name, Version, Description, __COUNTER__, __VA_ARGS__)
