// The data library (target Fulgur::data): the engine's DataModule and BatchLoader interfaces plus
// the in-memory loader. Datasets, samplers, transforms, readers and the threaded DataLoader have
// their own headers under fulgur/data/.
#pragma once

#include <fulgur/data/tensor_loader.h>
#include <fulgur/data_module.h>
