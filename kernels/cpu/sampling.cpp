// Greedy sampling on the CPU: the argmax of each row of a step's logits (argmax.h), read in their own dtype.
// torch's argmax carries an index beside every value and runs about ten times slower than this on a [64, 49152]
// bfloat16 block. parallel=False keeps it on the calling thread (a sampler service whose host's other core is the
// engine's during the step). Registered as torch.ops.llmmesh_sampling.argmax_rows when the library loads
// (engine/sample/ops.py calls it).

#include <torch/extension.h>
#include <torch/library.h>

#include "argmax.h"

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

}  // namespace

TORCH_LIBRARY(llmmesh_sampling, m) { m.def("argmax_rows(Tensor logits, bool parallel=True) -> Tensor"); }
TORCH_LIBRARY_IMPL(llmmesh_sampling, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
