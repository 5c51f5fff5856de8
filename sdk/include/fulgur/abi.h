/* Fulgur plugin ABI: the C door every plugin library opens.
 *
 * A plugin library exports exactly one symbol, FULGUR_PLUGIN_QUERY_SYMBOL, returning a list of
 * descriptors. Every struct starts with `struct_size` and only ever grows at the end: a reader
 * checks `struct_size` before touching a field added after ABI minor 0. Removing, reordering or
 * repurposing a field means a new ABI major, which also renames the entry point.
 *
 * The same facts are stored in an ELF note (owner FULGUR_NOTE_OWNER) so that the host lists and
 * checks plugins from the file alone, without running any plugin code.
 *
 * This header is C on purpose: it is the only part of the contract that does not assume the
 * plugin and the host share a compiler, a standard library and a libtorch build. Everything behind
 * `create` is C++ and is reached only after the ABI tag matched the host's.
 */
#ifndef FULGUR_ABI_H
#define FULGUR_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FULGUR_PLUGIN_ABI_MAJOR 1
#define FULGUR_PLUGIN_ABI_MINOR 1
/* Version of the six C++ interfaces as a whole; a new virtual function bumps it. */
/* History: 2 added Strategy::launches_processes/before_training_step and GradientSync; 3 is
 * contract v2 (callback roles and checkpoint providers, a capability-only TrainerContext, the
 * Strategy owning model/optimizer state and checkpoint parts); 4 added the TrainerContext's
 * training batch size and batch-size trials; 5 gave Strategy::configure_model a ModelBuild and
 * BlockHooks block_built (blocks sharded as the Module builds them); 6 added captured steps
 * (Accelerator::make_step_graph and StepGraph, step_capture_refusal on Strategy and Precision),
 * staged batch transfers (Accelerator::stage_transfer/finish_transfer),
 * Accelerator::device_name, Precision::compute_dtype and the TrainerContext's device_name and
 * compute_dtype (peak FLOP/s tables); 7 added steps decided on the device
 * (Precision::device_found_inf/update_after_device_step, Strategy::delegates_optimizer_step). */
#define FULGUR_CXX_INTERFACE_MAJOR 7

#define FULGUR_PLUGIN_QUERY_SYMBOL "fulgur_plugin_query_v1"
#define FULGUR_NOTE_OWNER "fulgur"
#define FULGUR_NOTE_TYPE 0x46554c31u /* "FUL1" */

/* Size of a struct up to and including `last`: what a reader may safely access. */
#define FULGUR_STRUCT_SIZE(T, last) (offsetof(T, last) + sizeof(((T*)0)->last))

typedef enum fulgur_kind {
  FULGUR_KIND_ACCELERATOR = 1,
  FULGUR_KIND_STRATEGY = 2,
  FULGUR_KIND_PRECISION = 3,
  FULGUR_KIND_LOGGER = 4,
  FULGUR_KIND_PROFILER = 5,
  FULGUR_KIND_CALLBACK = 6,
  /* ABI minor 1: the user's side of a run as plugins, so that `fulgur fit` needs no user main().
   * Their C++ interfaces (fulgur::Module, fulgur::DataModule) are the core's user API. */
  FULGUR_KIND_MODEL = 7,
  FULGUR_KIND_DATAMODULE = 8
} fulgur_kind;

typedef enum fulgur_option_type {
  FULGUR_OPTION_BOOL = 1,
  FULGUR_OPTION_INT = 2,
  FULGUR_OPTION_FLOAT = 3, /* accepts integers too */
  FULGUR_OPTION_STRING = 4,
  FULGUR_OPTION_STRING_LIST = 5,
  FULGUR_OPTION_FLOAT_LIST = 6
} fulgur_option_type;

typedef enum fulgur_stdlib {
  FULGUR_STDLIB_UNKNOWN = 0,
  FULGUR_STDLIB_LIBSTDCXX = 1,
  FULGUR_STDLIB_LIBCXX = 2
} fulgur_stdlib;

/* Everything that must equal the host's for the C++ layer behind `create` to be safe. */
typedef struct fulgur_abi_tag {
  uint32_t struct_size;
  uint32_t cxx_interface_major; /* FULGUR_CXX_INTERFACE_MAJOR */
  uint32_t torch_major;         /* TORCH_VERSION_MAJOR */
  uint32_t torch_minor;         /* TORCH_VERSION_MINOR */
  uint32_t glibcxx_cxx11_abi;   /* _GLIBCXX_USE_CXX11_ABI, 0xffffffff when not libstdc++ */
  uint32_t stdlib;              /* fulgur_stdlib */
  uint32_t cuda_version;        /* CUDA version of the libtorch built against (e.g. 13000), 0 if none */
} fulgur_abi_tag;

/* One TOML key a plugin accepts. `default_value` is TOML value syntax ("0.5", "\"max\"",
 * "[]", "true"); NULL means the key is required. */
typedef struct fulgur_option_desc {
  uint32_t struct_size;
  uint32_t type; /* fulgur_option_type */
  const char* key;
  const char* default_value;
  const char* help;
} fulgur_option_desc;

/* Passed to `create`. `options` points to a validated fulgur::Options (C++). The factory never
 * throws: on failure it writes a NUL-terminated message into error_buffer and returns NULL. */
typedef struct fulgur_create_args {
  uint32_t struct_size;
  const void* options;
  char* error_buffer;
  size_t error_buffer_size;
} fulgur_create_args;

typedef struct fulgur_plugin_desc {
  uint32_t struct_size;
  uint32_t abi_major;
  uint32_t abi_minor;
  uint32_t kind;           /* fulgur_kind */
  const char* name;        /* [a-z0-9_.-]{1,63}, unique per kind; what the TOML refers to */
  const char* version;     /* the plugin's own version */
  const char* description; /* one line */
  fulgur_abi_tag abi_tag;
  uint32_t option_count;
  const fulgur_option_desc* options;
  /* Returns the kind's C++ interface pointer (fulgur::Callback*, ...) cast to void*. */
  void* (*create)(const fulgur_create_args* args);
  void (*destroy)(void* object);
} fulgur_plugin_desc;

typedef struct fulgur_plugin_list {
  uint32_t struct_size;
  uint32_t count;
  const fulgur_plugin_desc* const* items;
} fulgur_plugin_list;

typedef const fulgur_plugin_list* (*fulgur_plugin_query_fn)(void);

/* ELF note payload (the note's desc): a fixed header followed by `strings_size` bytes of
 * NUL-terminated strings in this order: name, version, description, then for each option:
 * key, default ("\x01" standing for "required"), help. Pointer-free, so it needs no relocation
 * and reads straight from the file. */
typedef struct fulgur_note_header {
  uint32_t struct_size;
  uint32_t abi_major;
  uint32_t abi_minor;
  uint32_t kind;
  fulgur_abi_tag abi_tag;
  uint32_t option_count;
  uint32_t strings_size;
  /* followed by: uint32_t option_types[option_count]; char strings[strings_size]; */
} fulgur_note_header;

#ifdef __cplusplus
}
#endif

#endif /* FULGUR_ABI_H */
