// Entry points of the fuzz targets. Each takes arbitrary bytes and returns 0; a crash, a sanitizer
// report or an exception that is not a fulgur::Error (every reader must turn bad input into one)
// is a finding. libFuzzer calls them through LLVMFuzzerTestOneInput (scripts/fuzz.sh builds them
// with clang, FULGUR_LIBFUZZER defined); the test suite runs them over the seed corpora
// (tests/fuzz/corpus/<target>/) with the ordinary gcc build.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fulgur::fuzz {

int config(const uint8_t* data, size_t size);        // TOML config, parse + schema validation
int elf_note(const uint8_t* data, size_t size);      // plugin ELF-note reader
int checkpoint(const uint8_t* data, size_t size);    // checkpoint archive reader
int idx(const uint8_t* data, size_t size);           // Fashion-MNIST IDX reader (plain and gzip)
int safetensors(const uint8_t* data, size_t size);   // safetensors reader
int csv(const uint8_t* data, size_t size);           // CSV record reader/writer and CsvDataset
int image(const uint8_t* data, size_t size);         // JPEG / PNG decoding through ImageFolder
int tar(const uint8_t* data, size_t size);           // WebDataset tar shard reader
int token(const uint8_t* data, size_t size);         // token file reader (GPT example's data)
int dcp_metadata(const uint8_t* data, size_t size);  // distributed checkpoint `.metadata` + read

}  // namespace fulgur::fuzz

#ifdef FULGUR_LIBFUZZER
#define FULGUR_FUZZ_ENTRY(function) \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return function(data, size); }
#else
#define FULGUR_FUZZ_ENTRY(function)
#endif
