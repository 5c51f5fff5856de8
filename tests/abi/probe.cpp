// The ABI probe: a shared library whose only exported functions take every type the SDK 1.x
// promise freezes, so that its DWARF (compiled with full debug info and every class's definition,
// tests/abi/CMakeLists.txt) describes their layouts and vtables as the current headers declare them.
// tests/abi/abi_check.sh dumps it with libabigail's abidw and compares it with the stored 1.0
// baseline (tests/abi/baseline/): a changed layout, a virtual function inserted, removed or moved,
// a changed signature fails; a new type or function (what a minor adds) passes.
//
// When a minor release adds a stable type (an extension interface, a struct a new free function
// takes), add a probe for it here and store that release's baseline (scripts/abi_check.sh --help).
#include <fulgur/abi.h>
#include <fulgur/accelerator.h>
#include <fulgur/async_save.h>
#include <fulgur/blocks.h>
#include <fulgur/callback.h>
#include <fulgur/checkpoint_queue.h>
#include <fulgur/closure_step.h>
#include <fulgur/communicator.h>
#include <fulgur/data_module.h>
#include <fulgur/data_values.h>
#include <fulgur/device_mesh.h>
#include <fulgur/error.h>
#include <fulgur/log.h>
#include <fulgur/logger.h>
#include <fulgur/lr_scheduler.h>
#include <fulgur/model_parallel.h>
#include <fulgur/module.h>
#include <fulgur/nn/batch_norm.h>
#include <fulgur/nn/float8.h>
#include <fulgur/nn/linear.h>
#include <fulgur/nn/tensor_parallel.h>
#include <fulgur/option_spec.h>
#include <fulgur/options.h>
#include <fulgur/precision.h>
#include <fulgur/profiler.h>
#include <fulgur/scheduler_names.h>
#include <fulgur/storage.h>
#include <fulgur/storage_root.h>
#include <fulgur/strategy.h>
#include <fulgur/trainer_context.h>
#include <fulgur/types.h>

// One exported function per type, named after it (C linkage: the report names the probe plainly).
#define FULGUR_ABI_PROBE(name, ...) \
  extern "C" __attribute__((visibility("default"))) void fulgur_abi_probe_##name(__VA_ARGS__*) {}

// The C door (fulgur/abi.h).
FULGUR_ABI_PROBE(plugin_desc, fulgur_plugin_desc)
FULGUR_ABI_PROBE(plugin_list, fulgur_plugin_list)
FULGUR_ABI_PROBE(option_desc, fulgur_option_desc)
FULGUR_ABI_PROBE(create_args, fulgur_create_args)
FULGUR_ABI_PROBE(abi_tag, fulgur_abi_tag)
FULGUR_ABI_PROBE(note_header, fulgur_note_header)
FULGUR_ABI_PROBE(kind, fulgur_kind)
FULGUR_ABI_PROBE(option_type, fulgur_option_type)
FULGUR_ABI_PROBE(stdlib, fulgur_stdlib)
FULGUR_ABI_PROBE(query_fn, fulgur_plugin_query_fn)

// The six interfaces and what they exchange.
FULGUR_ABI_PROBE(accelerator, fulgur::Accelerator)
FULGUR_ABI_PROBE(step_graph, fulgur::StepGraph)
FULGUR_ABI_PROBE(strategy, fulgur::Strategy)
FULGUR_ABI_PROBE(strategy_environment, fulgur::StrategyEnvironment)
FULGUR_ABI_PROBE(checkpoint_parts, fulgur::CheckpointParts)
FULGUR_ABI_PROBE(model_build, fulgur::ModelBuild)
FULGUR_ABI_PROBE(communicator, fulgur::Communicator)
FULGUR_ABI_PROBE(communicator_options, fulgur::CommunicatorOptions)
FULGUR_ABI_PROBE(pending_collective, fulgur::PendingCollective)
FULGUR_ABI_PROBE(gradient_sync, fulgur::GradientSync)
FULGUR_ABI_PROBE(gradient_sync_options, fulgur::GradientSyncOptions)
FULGUR_ABI_PROBE(block_hooks, fulgur::BlockHooks)
FULGUR_ABI_PROBE(block_options, fulgur::BlockOptions)
FULGUR_ABI_PROBE(full_parameters, fulgur::FullParameters)
FULGUR_ABI_PROBE(precision, fulgur::Precision)
FULGUR_ABI_PROBE(precision_scope, fulgur::PrecisionScope)
FULGUR_ABI_PROBE(logger, fulgur::Logger)
FULGUR_ABI_PROBE(logger_setup, fulgur::LoggerSetup)
FULGUR_ABI_PROBE(profiler, fulgur::Profiler)
FULGUR_ABI_PROBE(profile_scope, fulgur::ProfileScope)
FULGUR_ABI_PROBE(callback, fulgur::Callback)
FULGUR_ABI_PROBE(checkpoint_provider, fulgur::CheckpointProvider)
FULGUR_ABI_PROBE(hook, fulgur::Hook)
FULGUR_ABI_PROBE(callback_role, fulgur::CallbackRole)

// The 1.0 extension interfaces (fulgur/extension.h).
FULGUR_ABI_PROBE(step_graph_factory, fulgur::StepGraphFactory)
FULGUR_ABI_PROBE(staged_transfers, fulgur::StagedTransfers)
FULGUR_ABI_PROBE(device_step_strategy, fulgur::DeviceStepStrategy)
FULGUR_ABI_PROBE(device_step_precision, fulgur::DeviceStepPrecision)

// SDK 1.1: loggers that observe checkpoints (fulgur/logger.h).
FULGUR_ABI_PROBE(checkpoint_observer, fulgur::CheckpointObserver)
FULGUR_ABI_PROBE(saved_checkpoint, fulgur::SavedCheckpoint)

// SDK 1.2: model-side building blocks (fulgur/nn/), precisions that step closure optimizers
// (fulgur/closure_step.h), datamodules that offer values to [links] (fulgur/data_values.h).
FULGUR_ABI_PROBE(nn_batch_norm, fulgur::nn::BatchNormImpl)
FULGUR_ABI_PROBE(nn_batch_norm_options, fulgur::nn::BatchNormOptions)
FULGUR_ABI_PROBE(closure_step_precision, fulgur::ClosureStepPrecision)
FULGUR_ABI_PROBE(data_values, fulgur::DataValues)

// SDK 1.3: device meshes and tensor-parallel layers (fulgur/device_mesh.h, fulgur/model_parallel.h,
// fulgur/nn/tensor_parallel.h), object storage (fulgur/storage.h), quantizable linear layers
// (fulgur/nn/linear.h).
FULGUR_ABI_PROBE(device_mesh, fulgur::DeviceMesh)
FULGUR_ABI_PROBE(communicator_groups, fulgur::CommunicatorGroups)
FULGUR_ABI_PROBE(device_mesh_receiver, fulgur::DeviceMeshReceiver)
FULGUR_ABI_PROBE(scheduler_names, fulgur::SchedulerNames)
FULGUR_ABI_PROBE(storage, fulgur::Storage)
FULGUR_ABI_PROBE(storage_object, fulgur::StorageObject)
FULGUR_ABI_PROBE(nn_linear, fulgur::nn::LinearImpl)
FULGUR_ABI_PROBE(nn_linear_options, fulgur::nn::LinearOptions)
FULGUR_ABI_PROBE(nn_quantize_options, fulgur::nn::QuantizeOptions)
FULGUR_ABI_PROBE(nn_fake_quantize_options, fulgur::nn::FakeQuantizeOptions)
FULGUR_ABI_PROBE(nn_column_parallel_linear, fulgur::nn::ColumnParallelLinearImpl)
FULGUR_ABI_PROBE(nn_row_parallel_linear, fulgur::nn::RowParallelLinearImpl)
FULGUR_ABI_PROBE(nn_parallel_linear_options, fulgur::nn::ParallelLinearOptions)
FULGUR_ABI_PROBE(nn_vocab_parallel_embedding, fulgur::nn::VocabParallelEmbeddingImpl)
FULGUR_ABI_PROBE(nn_vocab_parallel_embedding_options, fulgur::nn::VocabParallelEmbeddingOptions)
FULGUR_ABI_PROBE(nn_tensor_parallel_rng, fulgur::nn::TensorParallelRng)

// SDK 1.4: FP8 training of linear layers (fulgur/nn/float8.h).
FULGUR_ABI_PROBE(nn_float8_options, fulgur::nn::Float8Options)
FULGUR_ABI_PROBE(nn_float8_tensor, fulgur::nn::Float8Tensor)

// SDK 1.5: storage plugins (FULGUR_KIND_STORAGE, probed through fulgur_kind above), checkpoints
// saved in the background (fulgur/checkpoint_queue.h, fulgur/async_save.h), activation
// fake-quantization and learned scales in quantization-aware training (fulgur/nn/linear.h).
FULGUR_ABI_PROBE(checkpoint_save_queue, fulgur::CheckpointSaveQueue)
FULGUR_ABI_PROBE(async_save_strategy, fulgur::AsyncSaveStrategy)
FULGUR_ABI_PROBE(nn_activation_quantization, fulgur::nn::ActivationQuantization)
FULGUR_ABI_PROBE(nn_qat_options, fulgur::nn::QatOptions)

// SDK 1.6: runs rooted on object storage, default_root_dir = "s3://..." (fulgur/storage_root.h).
FULGUR_ABI_PROBE(storage_root, fulgur::StorageRoot)
FULGUR_ABI_PROBE(logger_storage_root, fulgur::LoggerStorageRoot)

// The Trainer as callbacks see it.
FULGUR_ABI_PROBE(trainer_context, fulgur::TrainerContext)
FULGUR_ABI_PROBE(batch_size_trial, fulgur::BatchSizeTrial)

// The user's side: Module and DataModule (model and datamodule plugins).
FULGUR_ABI_PROBE(module, fulgur::Module)
FULGUR_ABI_PROBE(log_options, fulgur::LogOptions)
FULGUR_ABI_PROBE(optimizer_config, fulgur::OptimizerConfig)
FULGUR_ABI_PROBE(optimizer_handle, fulgur::OptimizerHandle)
FULGUR_ABI_PROBE(lr_scheduler, fulgur::LRScheduler)
FULGUR_ABI_PROBE(data_module, fulgur::DataModule)
FULGUR_ABI_PROBE(batch_loader, fulgur::BatchLoader)

// Shared vocabulary: the option schema, errors, logging, the types every interface exchanges.
FULGUR_ABI_PROBE(options, fulgur::Options)
FULGUR_ABI_PROBE(option_value, fulgur::OptionValue)
FULGUR_ABI_PROBE(option_spec, fulgur::OptionSpec)
FULGUR_ABI_PROBE(option_type_enum, fulgur::OptionType)
FULGUR_ABI_PROBE(error, fulgur::Error)
FULGUR_ABI_PROBE(error_kind, fulgur::ErrorKind)
FULGUR_ABI_PROBE(log_level, fulgur::log::Level)
FULGUR_ABI_PROBE(batch, fulgur::Batch)
FULGUR_ABI_PROBE(step_output, fulgur::StepOutput)
FULGUR_ABI_PROBE(cluster_info, fulgur::ClusterInfo)
FULGUR_ABI_PROBE(metric_map, fulgur::MetricMap)
FULGUR_ABI_PROBE(stage, fulgur::Stage)
FULGUR_ABI_PROBE(run_status, fulgur::RunStatus)
FULGUR_ABI_PROBE(reduce_op, fulgur::ReduceOp)
FULGUR_ABI_PROBE(grad_clip_algorithm, fulgur::GradClipAlgorithm)
FULGUR_ABI_PROBE(reduction, fulgur::Reduction)
