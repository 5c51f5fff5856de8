// The GPT example as plugins: `fulgur fit --config gpt.toml` trains it and `fulgur predict` samples
// from a checkpoint, with no program of its own. The schemas are the classes' hparams_schema
// (the tables in gpt.h).
#include <fulgur/plugin.h>

#include "gpt.h"

namespace ex = fulgur::examples;

FULGUR_PLUGIN(ex::GptModel, "gpt", "1.0.0",
              "Decoder-only transformer on byte tokens: pre-LN causal self-attention, AdamW, warm-up + cosine, "
              "sampling in predict")
FULGUR_PLUGIN(ex::CharCorpusDataModule, "char_corpus", "1.0.0",
              "A text corpus (file or directory) as byte tokens in memory-mapped token files written once")
