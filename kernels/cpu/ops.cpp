// The Python module of the CPU kernels: one library for paged_attention.cpp, mla_decode.cpp, layers.cpp, moe.cpp
// greedy_steps.cpp and sampling.cpp's plain rows.

#include <torch/extension.h>

#include <optional>

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           const at::Tensor& block_table, double scale, std::optional<int64_t> sliding_window,
                           std::optional<double> logits_soft_cap, const std::optional<at::Tensor>& sinks);
at::Tensor mla_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& seq_lens,
                      const at::Tensor& block_table, int64_t v_dim, double scale);
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slot_mapping);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids);
at::Tensor fused_moe_quant(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w13_scales,
                           const at::Tensor& w13_zeros, const at::Tensor& w2, const at::Tensor& w2_scales,
                           const at::Tensor& w2_zeros, const at::Tensor& topk_weights, const at::Tensor& topk_ids);
std::tuple<int64_t, std::string> serve_greedy_steps(int64_t fd, at::Tensor headers, at::Tensor data);
bool send_greedy_step(int64_t fd, at::Tensor headers, at::Tensor data, int64_t slot, int64_t generation,
                      const at::Tensor& logits, int64_t step_id);
std::tuple<at::Tensor, int64_t> recv_greedy_answer(int64_t fd, int64_t step_id, int64_t rows, double timeout);
bool send_sampled_step(int64_t fd, at::Tensor headers, at::Tensor data, int64_t slot, int64_t generation,
                       const at::Tensor& logits, int64_t step_id, const std::string& rows);
at::Tensor sample_plain_rows_packed(const at::Tensor& logits, const std::string& packed);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Causal attention over the paged KV cache, read in place", py::arg("query"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_table"),
        py::arg("scale"), py::arg("sliding_window") = py::none(), py::arg("logits_soft_cap") = py::none(),
        py::arg("sinks") = py::none());
  m.def("mla_decode", &mla_decode, "Multi-head latent attention's decode, absorbed, over the latent cache in place",
        py::arg("query"), py::arg("kv_cache"), py::arg("seq_lens"), py::arg("block_table"), py::arg("v_dim"),
        py::arg("scale"));
  m.def("reshape_and_cache", &reshape_and_cache, "Write K/V rows into their cache slots");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("rotary_embedding", &rotary_embedding, "Rotate-half RoPE, in place on q and k");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused gate_up output");
  m.def("fused_moe", &fused_moe, "A mixture-of-experts layer's experts, the tokens grouped by expert");
  m.def("fused_moe_quant", &fused_moe_quant, "fused_moe over group-wise quantized experts, dequantized row by row");
  m.def("serve_greedy_steps", &serve_greedy_steps, "Answer a step channel's greedy steps until another frame comes",
        py::call_guard<py::gil_scoped_release>());
  m.def("send_greedy_step", &send_greedy_step, "Write a greedy step's logits into its slot and send the step",
        py::call_guard<py::gil_scoped_release>());
  m.def("recv_greedy_answer", &recv_greedy_answer, "Wait for a greedy or sampled step's tokens",
        py::call_guard<py::gil_scoped_release>());
  m.def("send_sampled_step", &send_sampled_step,
        "Write a sampled step's logits into its slot and send the step with its rows' settings",
        py::call_guard<py::gil_scoped_release>());
  m.def("sample_plain_rows", &sample_plain_rows_packed, "Sample rows shaped by temperature, min-p, top-k, top-p alone",
        py::call_guard<py::gil_scoped_release>());
}
