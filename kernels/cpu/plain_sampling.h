// A step's rows sampled as engine/sample/sampler.py's Sampler samples them when nothing but temperature, min-p,
// top-k and top-p shapes a row (no logprobs, penalties, bans, bias or grammar): the same ATen operations in the same
// order, so a seeded row draws the same token. The sampler service's sampled steps (greedy_steps.cpp) run it.

#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace llmmesh_sampling {

// One row's settings, as mesh/sampler/remote.py packs them (PLAIN_ROW): 40 bytes.
struct PlainRow {
  float temperature, top_p, min_p;
  int32_t top_k;  // off unless 0 < top_k < vocab
  uint64_t seed;  // the request's seed mod 2**64, with SEEDED
  uint32_t flags;
  uint32_t unused;
  uint64_t index;  // the token's index in the request's output: its seeded draw's place
};
static_assert(sizeof(PlainRow) == 40, "the row's layout");

// flags: greedy (temperature 0); a seed; temperature != 1; top_p < 1; min_p > 0 (the Python-side decisions, so a
// float32 rounding cannot turn a setting on or off).
constexpr uint32_t GREEDY = 1, SEEDED = 2, TEMPERATURE = 4, TOP_P = 8, MIN_P = 16;

// The rows' tokens ([rows] int64) from logits [rows, vocab] (float32, bfloat16 or float16); "" or what is wrong
// with a row's settings in `error` (then the tensor is undefined).
at::Tensor sample_plain_rows(const at::Tensor& logits, const PlainRow* rows, std::string& error);

}  // namespace llmmesh_sampling
