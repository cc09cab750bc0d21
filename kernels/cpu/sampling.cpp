// Greedy sampling on the CPU: the argmax of each row of a step's logits (argmax.h), read in their own dtype.
// Also the plain rows of plain_sampling.h: temperature, min-p, top-k and top-p, with engine/sample/ops.py's draws.
// torch's argmax carries an index beside every value and runs about ten times slower than this on a [64, 49152]
// bfloat16 block. parallel=False keeps it on the calling thread (a sampler service whose host's other core is the
// engine's during the step). Registered as torch.ops.llmmesh_sampling.argmax_rows when the library loads
// (engine/sample/ops.py calls it).

#include <torch/extension.h>
#include <torch/library.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "argmax.h"
#include "plain_sampling.h"

namespace {

using llmmesh_argmax::argmax_rows_of;

at::Tensor argmax_rows(const at::Tensor& logits, bool parallel) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, vocab] with vocab > 0");
  TORCH_CHECK(logits.stride(1) == 1, "each row of logits must be contiguous");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  switch (logits.scalar_type()) {
    case at::kFloat:
      argmax_rows_of(logits.const_data_ptr<float>(), rows, vocab, stride, ids, parallel);
      break;
    case at::kBFloat16:
      argmax_rows_of(logits.const_data_ptr<at::BFloat16>(), rows, vocab, stride, ids, parallel);
      break;
    case at::kHalf:
      argmax_rows_of(logits.const_data_ptr<at::Half>(), rows, vocab, stride, ids, parallel);
      break;
    default:
      TORCH_CHECK(false, "logits must be float32, bfloat16 or float16, got ", logits.scalar_type());
  }
  return out;
}

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

at::Tensor longs(const std::vector<int64_t>& v) { return at::tensor(v, at::kLong); }
at::Tensor floats(const std::vector<float>& v) { return at::tensor(v, at::kFloat); }

// Positions among the random rows, as engine/sample/metadata.py's _subset: none when they are all of them.
std::optional<at::Tensor> subset(const std::vector<int64_t>& rows, size_t total) {
  if (rows.size() == total) return std::nullopt;
  return longs(rows);
}

// fn on the given rows only (none: all of them), written back (the Sampler's _on_rows).
template <typename Fn>
at::Tensor on_rows(Fn fn, at::Tensor logits, const std::optional<at::Tensor>& rows) {
  if (!rows) return fn(logits);
  logits.index_put_({*rows}, fn(logits.index({*rows})));
  return logits;
}

// The ops.py functions of the same names, op for op.
at::Tensor apply_min_p(at::Tensor logits, const at::Tensor& min_p) {
  const at::Tensor probs = logits.softmax(-1);
  const at::Tensor threshold = probs.amax({-1}, true) * min_p.unsqueeze(1);
  return logits.masked_fill_(probs < threshold, NEG_INF);
}

at::Tensor apply_top_k_top_p(at::Tensor logits, const at::Tensor& k, const std::optional<at::Tensor>& p,
                             int64_t max_k) {
  auto [top_values, top_ids] = logits.topk(max_k, -1);
  const at::Tensor kth = top_values.gather(1, (k - 1).unsqueeze(1));
  top_values.masked_fill_(top_values < kth, NEG_INF);
  if (p) {
    const at::Tensor probs = top_values.softmax(-1);
    const at::Tensor more_likely_mass = probs.cumsum(-1) - probs;
    top_values.masked_fill_(more_likely_mass >= p->unsqueeze(1), NEG_INF);
  }
  return logits.fill_(NEG_INF).scatter_(1, top_ids, top_values);
}

at::Tensor sorted_top_p(at::Tensor logits, const at::Tensor& p) {
  auto [logits_sort, logits_idx] = logits.sort(-1);
  const at::Tensor cum_probs = logits_sort.softmax(-1).cumsum_(-1);
  at::Tensor drop = cum_probs <= at::rsub(p.unsqueeze(1), 1);
  drop.select(1, -1).fill_(false);
  logits_sort.masked_fill_(drop, NEG_INF);
  return logits.scatter_(1, logits_idx, logits_sort);
}

at::Tensor apply_top_p(at::Tensor logits, const at::Tensor& p, int64_t first_k = 256) {
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  at::Tensor keep = at::zeros_like(probs, at::kBool);
  at::Tensor rows = at::arange(probs.size(0), at::kLong);
  int64_t k = first_k;
  const int64_t vocab = probs.size(-1);
  std::vector<at::Tensor> to_sort;
  while (rows.numel() && 4 * k < vocab) {
    auto [top, ids] = probs.index({rows}).topk(k, -1);
    const at::Tensor mass = top.cumsum(-1);
    const at::Tensor row_p = p.index({rows});
    const at::Tensor done = mass.select(1, -1) >= row_p;
    const at::Tensor done_rows = rows.index({done});
    keep.index_put_({done_rows}, keep.index({done_rows})
                                     .scatter_(1, ids.index({done}),
                                               (mass - top).index({done}) < row_p.index({done}).unsqueeze(1)));
    const at::Tensor reachable = mass.select(1, -1) + top.select(1, -1) * (15 * k) >= row_p;
    to_sort.push_back(rows.index({~done & ~reachable}));
    rows = rows.index({~done & reachable});
    k *= 16;
  }
  to_sort.push_back(rows);
  const at::Tensor sort_rows = at::cat(to_sort);
  if (sort_rows.numel() == logits.size(0)) return sorted_top_p(logits, p);
  keep.index_put_({sort_rows}, true);
  logits.masked_fill_(~keep, NEG_INF);
  if (sort_rows.numel()) logits.index_put_({sort_rows}, sorted_top_p(logits.index({sort_rows}), p.index({sort_rows})));
  return logits;
}

// engine/sample/ops.py's draw_seed: splitmix64 of (seed, index).
uint64_t draw_seed(uint64_t seed, uint64_t index) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + index;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// What is wrong with a random row's settings (SamplingParams' own checks), or "".
std::string check_row(const llmmesh_sampling::PlainRow& r, size_t i) {
  const std::string row = "sampled step: row " + std::to_string(i) + ": ";
  if (!(std::isfinite(r.temperature) && r.temperature > 0))
    return row + "temperature must be a positive number, got " + std::to_string(r.temperature);
  if (!(r.top_p > 0 && r.top_p <= 1)) return row + "top_p must be in (0, 1], got " + std::to_string(r.top_p);
  if (!(r.min_p >= 0 && r.min_p <= 1)) return row + "min_p must be in [0, 1], got " + std::to_string(r.min_p);
  return "";
}

}  // namespace

namespace llmmesh_sampling {

// The Sampler's sample(), for rows that are greedy or shaped by temperature, min-p, top-k and top-p alone.
at::Tensor sample_plain_rows(const at::Tensor& raw, const PlainRow* params, std::string& error) {
  const at::Tensor logits = raw.to(at::kFloat);
  const int64_t n = logits.size(0), vocab = logits.size(1);
  std::vector<int64_t> random;
  for (int64_t i = 0; i < n; ++i) {
    if (params[i].flags & GREEDY) continue;
    if (!(error = check_row(params[i], i)).empty()) return at::Tensor();
    random.push_back(i);
  }
  at::Tensor greedy;
  if (random.size() < static_cast<size_t>(n)) {
    greedy = at::empty({n}, at::kLong);
    argmax_rows_of(logits.const_data_ptr<float>(), n, vocab, vocab, greedy.data_ptr<int64_t>(), false);
  }
  if (random.empty()) return greedy;
  const size_t r = random.size();
  const std::optional<at::Tensor> random_rows = subset(random, n);
  at::Tensor x = random_rows ? logits.index({*random_rows}) : logits;
  // Each random row's settings, by its position among them (metadata.py's _set_random_row_settings).
  std::vector<float> temperature, min_p, top_k_top_p, top_p;
  std::vector<int64_t> min_p_rows, top_k_rows, top_k, top_p_rows;
  bool any_temperature = false, any_top_k_top_p = false;
  int64_t max_top_k = 0;
  for (size_t j = 0; j < r; ++j) {
    const PlainRow& row = params[random[j]];
    temperature.push_back(row.temperature);
    any_temperature |= (row.flags & TEMPERATURE) != 0;
    if (row.flags & MIN_P) {
      min_p_rows.push_back(j);
      min_p.push_back(row.min_p);
    }
    if (0 < row.top_k && row.top_k < vocab) {
      top_k_rows.push_back(j);
      top_k.push_back(row.top_k);
      top_k_top_p.push_back(row.top_p);
      max_top_k = std::max<int64_t>(max_top_k, row.top_k);
      any_top_k_top_p |= (row.flags & TOP_P) != 0;
    } else if (row.flags & TOP_P) {
      top_p_rows.push_back(j);
      top_p.push_back(row.top_p);
    }
  }
  if (any_temperature) x.div_(floats(temperature).unsqueeze(1));
  if (!min_p_rows.empty()) {
    const at::Tensor values = floats(min_p);
    x = on_rows([&](at::Tensor t) { return apply_min_p(t, values); }, x, subset(min_p_rows, r));
  }
  if (!top_k_rows.empty()) {
    const at::Tensor k = longs(top_k);
    const std::optional<at::Tensor> p = any_top_k_top_p ? std::optional<at::Tensor>(floats(top_k_top_p)) : std::nullopt;
    x = on_rows([&](at::Tensor t) { return apply_top_k_top_p(t, k, p, max_top_k); }, x, subset(top_k_rows, r));
  }
  if (!top_p_rows.empty()) {
    const at::Tensor p = floats(top_p);
    x = on_rows([&](at::Tensor t) { return apply_top_p(t, p); }, x, subset(top_p_rows, r));
  }
  // ops.py's random_sample: one U a row (a seeded row's from its own generator), then the first token whose running
  // total of the row's probabilities (float64) exceeds U times the row's total (at most the last token).
  const at::Tensor probs = x.softmax(-1);
  at::Tensor u = at::empty({static_cast<int64_t>(r), 1}, probs.options().dtype(at::kDouble));
  std::vector<size_t> seeded;
  for (size_t j = 0; j < r; ++j)
    if (params[random[j]].flags & SEEDED) seeded.push_back(j);
  if (seeded.size() < r) u.uniform_(0, 1);
  for (size_t j : seeded) {
    const PlainRow& row = params[random[j]];
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(draw_seed(row.seed, row.index));
    u.select(0, j).uniform_(0, 1, generator);
  }
  const at::Tensor totals = probs.to(at::kDouble).cumsum_(-1);
  const at::Tensor target = u * totals.narrow(1, totals.size(1) - 1, 1);
  const at::Tensor drawn =
      at::searchsorted(totals, target, /*out_int32=*/false, /*right=*/true).squeeze(1).clamp_max_(totals.size(1) - 1);
  if (!random_rows) return drawn;
  return greedy.index_copy_(0, *random_rows, drawn);
}

}  // namespace llmmesh_sampling

// sample_plain_rows over rows packed as mesh/sampler/remote.py packs them (ops.cpp's module; ValueError for a bad
// row).
at::Tensor sample_plain_rows_packed(const at::Tensor& logits, const std::string& packed) {
  using llmmesh_sampling::PlainRow;
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be a contiguous [rows, vocab] block");
  TORCH_CHECK(packed.size() == logits.size(0) * sizeof(PlainRow), "one packed row per row of logits");
  std::vector<PlainRow> rows(logits.size(0));
  std::memcpy(rows.data(), packed.data(), packed.size());
  std::string error;
  at::Tensor out = llmmesh_sampling::sample_plain_rows(logits, rows.data(), error);
  TORCH_CHECK_VALUE(error.empty(), error);
  return out;
}

TORCH_LIBRARY(llmmesh_sampling, m) { m.def("argmax_rows(Tensor logits, bool parallel=True) -> Tensor"); }
TORCH_LIBRARY_IMPL(llmmesh_sampling, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
