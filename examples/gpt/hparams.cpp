// The GPT example's byte tokenizer.
#include "gpt.h"

#include <ATen/ATen.h>

#include <string>

namespace fulgur::examples {

at::Tensor encode_bytes(std::string_view text) {
  at::Tensor tokens = at::empty({static_cast<int64_t>(text.size())}, at::kLong);
  int64_t* out = tokens.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string decode_bytes(const at::Tensor& tokens) {
  const at::Tensor t = tokens.to(at::kLong).contiguous().view({-1});
  const int64_t* in = t.data_ptr<int64_t>();
  std::string text(static_cast<size_t>(t.numel()), '\0');
  for (int64_t i = 0; i < t.numel(); ++i) text[static_cast<size_t>(i)] = static_cast<char>(in[i] & 0xff);
  return text;
}

}  // namespace fulgur::examples
