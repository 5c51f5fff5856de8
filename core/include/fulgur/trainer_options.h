// Kept for source compatibility within 1.x: TrainerOptions is fulgur::ConfigBuilder since 1.1.
#pragma once

#include <fulgur/config_builder.h>
