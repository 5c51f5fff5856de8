/** @file
 * The C door every plugin library opens: one exported entry point (FULGUR_PLUGIN_QUERY_SYMBOL)
 * returning a list of C descriptors, and the ELF note that holds the same facts so that the host
 * lists and checks a plugin from the file alone, without running any of its code.
 *
 * Every struct starts with `struct_size` and only ever grows at the end: a reader checks
 * `struct_size` (FULGUR_STRUCT_SIZE) before touching a field added after ABI minor 0. Removing,
 * reordering or repurposing a field means a new ABI major, which also renames the entry point.
 *
 * This header is C on purpose: it is the only part of the contract that does not assume the
 * plugin and the host share a compiler, a standard library and a libtorch build. Everything behind
 * `create` is C++ and is reached only after the ABI tag matched the host's. Plugin authors do not
 * fill these structs by hand: FULGUR_PLUGIN (fulgur/plugin.h) emits them.
 */
#ifndef FULGUR_ABI_H
#define FULGUR_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Major version of the C door. A plugin of another major is refused before it is loaded; a new
 * major renames FULGUR_PLUGIN_QUERY_SYMBOL. */
#define FULGUR_PLUGIN_ABI_MAJOR 1
/** Minor version of the C door: fields appended to the structs below. The host refuses a plugin
 * whose minor is newer than its own and reads an older one up to its `struct_size`. */
#define FULGUR_PLUGIN_ABI_MINOR 1
/** Major version of the C++ SDK (the six interfaces, Module/DataModule, TrainerContext, the
 * option schema and the extension interfaces). A plugin built against SDK N.x loads in every host
 * N.y with y >= x; a new major is a deliberate break, refused with a "rebuild" message. The
 * version history is in CHANGELOG.md. */
#define FULGUR_SDK_VERSION_MAJOR 1
/** Minor version of the C++ SDK: what was added without changing a vtable or a layout (new
 * extension interfaces, new free functions, new option types). A host refuses a plugin built
 * against a newer minor than its own, naming both versions. */
#define FULGUR_SDK_VERSION_MINOR 6
/** The SDK version as stored in fulgur_abi_tag::sdk_version: (major << 16) | minor. */
#define FULGUR_SDK_VERSION ((FULGUR_SDK_VERSION_MAJOR << 16) | FULGUR_SDK_VERSION_MINOR)
/** Major of fulgur_abi_tag::sdk_version (0 for a plugin built before SDK 1.0). */
#define FULGUR_SDK_VERSION_MAJOR_OF(v) ((uint32_t)(v) >> 16)
/** Minor of fulgur_abi_tag::sdk_version (before SDK 1.0: the old C++ interface major, 2 to 7). */
#define FULGUR_SDK_VERSION_MINOR_OF(v) ((uint32_t)(v)&0xffffu)

/** Name of the one symbol a plugin library exports (a fulgur_plugin_query_fn). It carries the ABI
 * major, so a library of another major simply has no entry point the host looks for. */
#define FULGUR_PLUGIN_QUERY_SYMBOL "fulgur_plugin_query_v1"
/** Owner name of the ELF note (section `.note.fulgur.plugin`) that describes each plugin. */
#define FULGUR_NOTE_OWNER "fulgur"
/** Type of that ELF note: the bytes "FUL1". */
#define FULGUR_NOTE_TYPE 0x46554c31u /* "FUL1" */

/** Size of struct `T` up to and including field `last`: compare it with the struct's
 * `struct_size` before reading `last` from a struct written by a plugin or host of another ABI
 * minor (a smaller `struct_size` means the writer predates the field). */
#define FULGUR_STRUCT_SIZE(T, last) (offsetof(T, last) + sizeof(((T*)0)->last))

/** What a plugin is: which C++ interface its `create` returns. */
typedef enum fulgur_kind {
  FULGUR_KIND_ACCELERATOR = 1, /**< fulgur::Accelerator */
  FULGUR_KIND_STRATEGY = 2,    /**< fulgur::Strategy */
  FULGUR_KIND_PRECISION = 3,   /**< fulgur::Precision */
  FULGUR_KIND_LOGGER = 4,      /**< fulgur::Logger */
  FULGUR_KIND_PROFILER = 5,    /**< fulgur::Profiler */
  FULGUR_KIND_CALLBACK = 6,    /**< fulgur::Callback */
  /** fulgur::Module. ABI minor 1 added the user's side of a run as plugins, so that `fulgur fit`
   * needs no user main(). Their C++ interfaces (fulgur::Module, fulgur::DataModule) are the
   * core's user API: such a plugin links Fulgur::core. */
  FULGUR_KIND_MODEL = 7,
  FULGUR_KIND_DATAMODULE = 8, /**< fulgur::DataModule (ABI minor 1, as FULGUR_KIND_MODEL) */
  /** fulgur::Storage (SDK 1.5): serves the URLs of one scheme, the plugin's name ("s3" for
   * s3://...). Selected by the URL a path gives, configured by the [storage] table. A host of SDK
   * 1.4 or older refuses the plugin by its SDK minor before it reads this kind. */
  FULGUR_KIND_STORAGE = 9
} fulgur_kind;

/** Type of one option (TOML value) a plugin accepts; the host checks the TOML against it before
 * any plugin code runs. Mirrors fulgur::OptionType. */
typedef enum fulgur_option_type {
  FULGUR_OPTION_BOOL = 1,        /**< TOML boolean */
  FULGUR_OPTION_INT = 2,         /**< TOML integer (int64_t) */
  FULGUR_OPTION_FLOAT = 3,       /**< TOML float; accepts integers too */
  FULGUR_OPTION_STRING = 4,      /**< TOML string */
  FULGUR_OPTION_STRING_LIST = 5, /**< TOML array of strings */
  FULGUR_OPTION_FLOAT_LIST = 6,  /**< TOML array of numbers (read as doubles) */
  /** TOML string naming a file or directory (SDK 1.2). The host resolves a relative path against
   * the directory of the TOML file that gave it (a command-line override's: the working
   * directory) and hands the plugin, the saved config.toml and the checkpoint the absolute path;
   * an empty string stays empty (not set). */
  FULGUR_OPTION_PATH = 7
} fulgur_option_type;

/** The C++ standard library a plugin or the host was built with (fulgur_abi_tag::stdlib). */
typedef enum fulgur_stdlib {
  FULGUR_STDLIB_UNKNOWN = 0,   /**< neither was detected (never written by FULGUR_PLUGIN) */
  FULGUR_STDLIB_LIBSTDCXX = 1, /**< GNU libstdc++ */
  FULGUR_STDLIB_LIBCXX = 2     /**< LLVM libc++ */
} fulgur_stdlib;

/** Everything that must equal the host's for the C++ layer behind `create` to be safe. The
 * registry compares each field with fulgur::host_abi_tag() and refuses a plugin that differs,
 * naming the field, both values and the fix. */
typedef struct fulgur_abi_tag {
  uint32_t struct_size;       /**< sizeof(fulgur_abi_tag) as the writer knew it */
  uint32_t sdk_version;       /**< FULGUR_SDK_VERSION; before SDK 1.0 the C++ interface major (2..7) */
  uint32_t torch_major;       /**< TORCH_VERSION_MAJOR */
  uint32_t torch_minor;       /**< TORCH_VERSION_MINOR */
  uint32_t glibcxx_cxx11_abi; /**< _GLIBCXX_USE_CXX11_ABI, 0xffffffff when not libstdc++ */
  uint32_t stdlib;            /**< a fulgur_stdlib value */
  uint32_t cuda_version;      /**< CUDA version of the libtorch built against (e.g. 13000), 0 if none */
} fulgur_abi_tag;

/** One TOML key a plugin accepts (its option schema, one entry per key). */
typedef struct fulgur_option_desc {
  uint32_t struct_size; /**< sizeof(fulgur_option_desc) as the writer knew it */
  uint32_t type;        /**< a fulgur_option_type value */
  const char* key;      /**< the TOML key, e.g. "monitor" */
  /** The default in TOML value syntax (`0.5`, `"max"`, `[]`, `true`); NULL means the key is
   * required. */
  const char* default_value;
  const char* help; /**< one line for `fulgur plugins list` and error messages */
} fulgur_option_desc;

/** What the host passes to fulgur_plugin_desc::create. Valid only during that call. */
typedef struct fulgur_create_args {
  uint32_t struct_size; /**< sizeof(fulgur_create_args) as the host knew it */
  /** A `const fulgur::Options*`: the plugin's TOML table, already checked against its schema with
   * defaults filled in. Owned by the host; copy what you keep. */
  const void* options;
  /** Where `create` writes a NUL-terminated message when it fails (the host reports it with the
   * plugin's name and file). Owned by the host. */
  char* error_buffer;
  size_t error_buffer_size; /**< bytes available at error_buffer, including the terminating NUL */
} fulgur_create_args;

/** One plugin of a library: its identity, schema, ABI facts and factory. Static data of the
 * plugin library; the host reads it after loading the library and never writes it. */
typedef struct fulgur_plugin_desc {
  uint32_t struct_size;              /**< sizeof(fulgur_plugin_desc) as the writer knew it */
  uint32_t abi_major;                /**< FULGUR_PLUGIN_ABI_MAJOR of the plugin's build */
  uint32_t abi_minor;                /**< FULGUR_PLUGIN_ABI_MINOR of the plugin's build */
  uint32_t kind;                     /**< a fulgur_kind value */
  const char* name;                  /**< [a-z0-9_.-]{1,63}, unique per kind; what the TOML refers to */
  const char* version;               /**< the plugin's own version */
  const char* description;           /**< one line */
  fulgur_abi_tag abi_tag;            /**< what the plugin was built against; must equal the host's */
  uint32_t option_count;             /**< number of entries at `options` */
  const fulgur_option_desc* options; /**< the option schema; NULL when option_count is 0 */
  /** Creates one object. Returns the kind's C++ interface pointer (fulgur::Callback*, ...) cast to
   * void*, owned by the host until it passes it to `destroy`. Never throws (no exception may cross
   * the C door): on failure it writes a message into args->error_buffer and returns NULL. Called
   * by the registry when the host builds a Trainer or checks a config, possibly several times per
   * process: an object may be created only to check its options (`fulgur config check`,
   * accelerator = "auto") and destroyed without any other call, so keep side effects out of
   * construction. */
  void* (*create)(const fulgur_create_args* args);
  /** Destroys an object `create` returned (as the created interface type). Never throws. The host
   * keeps the library loaded while any of its objects lives. */
  void (*destroy)(void* object);
} fulgur_plugin_desc;

/** What the entry point returns: every plugin the library holds. Static data of the library. */
typedef struct fulgur_plugin_list {
  uint32_t struct_size;                   /**< sizeof(fulgur_plugin_list) as the writer knew it */
  uint32_t count;                         /**< number of entries at `items` */
  const fulgur_plugin_desc* const* items; /**< one descriptor per plugin, each valid while the library is loaded */
} fulgur_plugin_list;

/** Type of the entry point FULGUR_PLUGIN_QUERY_SYMBOL. Called by the host after loading the
 * library; returns a list that stays valid while the library is loaded. Never throws. */
typedef const fulgur_plugin_list* (*fulgur_plugin_query_fn)(void);

/** ELF note payload (the note's desc): a fixed header followed by `strings_size` bytes of
 * NUL-terminated strings in this order: name, version, description, then for each option:
 * key, default (`"\x01"` standing for "required"), help. Pointer-free, so it needs no relocation
 * and reads straight from the file. */
typedef struct fulgur_note_header {
  uint32_t struct_size;   /**< sizeof(fulgur_note_header) as the writer knew it */
  uint32_t abi_major;     /**< as fulgur_plugin_desc::abi_major */
  uint32_t abi_minor;     /**< as fulgur_plugin_desc::abi_minor */
  uint32_t kind;          /**< a fulgur_kind value */
  fulgur_abi_tag abi_tag; /**< as fulgur_plugin_desc::abi_tag */
  uint32_t option_count;  /**< number of options (entries of option_types) */
  uint32_t strings_size;  /**< bytes of NUL-terminated strings after option_types */
  /* followed by: uint32_t option_types[option_count]; char strings[strings_size]; */
} fulgur_note_header;

#ifdef __cplusplus
}
#endif

#endif /* FULGUR_ABI_H */
