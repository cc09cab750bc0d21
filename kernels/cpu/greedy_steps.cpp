// Greedy and sampled steps on the step channel (mesh/sampler/channel.py). A step whose rows are all plain greedy (no
// logprobs, penalties, bans, bias or grammar) goes as a fixed 36-byte frame naming the slot that holds its logits,
// and is answered with each row's argmax (argmax.h). A step whose rows are greedy or shaped by temperature, min-p,
// top-k and top-p alone goes as a sampled step: the same frame followed by each row's settings
// (plain_sampling.h's PlainRow), sampled as the Sampler samples them (sampling.cpp). Both ends run here, the GIL
// released: after a forward pass has emptied the caches, a step's Python costs about 0.2 ms on the service and
// 0.07 ms in the engine; this, a few microseconds. On the service, any other frame is handed back to Python, which
// reads it and answers as before.
//
// Request frame: u32 GREEDY_FLAG | 32 (greedy) or SAMPLED_FLAG | (32 + 40 * rows) (sampled), then u64 step_id,
// i64 generation, u32 slot, u32 dtype (0 float32, 1 bfloat16, 2 float16), u32 rows, u32 vocab, and for a sampled
// step its rows' settings. Answer: u32 8 + 8 * rows, then u64 step_id and rows int64 ids.
// The slot's header (written, reading, done) is kept as SharedSlots keeps it (mesh/sampler/slots.py).

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>

#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "argmax.h"
#include "plain_sampling.h"

namespace {

constexpr uint32_t GREEDY_FLAG = 1u << 31;
constexpr uint32_t SAMPLED_FLAG = 1u << 30;  // a protobuf's length is at most 64 MiB: neither bit is ever set in it
// The frame's dtype field indexes this (mesh/sampler/channel.py's GREEDY_DTYPES).
constexpr at::ScalarType DTYPES[] = {at::kFloat, at::kBFloat16, at::kHalf};
constexpr uint32_t NUM_DTYPES = sizeof DTYPES / sizeof DTYPES[0];
constexpr uint32_t MAX_ROWS = (64u << 20) / 8 - 1;  // the answer within the channel's 64 MiB (grpc_policy.py)
using llmmesh_sampling::PlainRow;

struct GreedyStep {
  uint64_t step_id;
  int64_t generation;
  uint32_t slot, dtype, rows, vocab;
};
static_assert(sizeof(GreedyStep) == 32, "the frame's layout");

double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

enum Read { READ_OK, READ_CLOSED, READ_TIMEOUT };

// Exactly n bytes (on a blocking or non-blocking socket) before the deadline (none: -1); READ_CLOSED when the
// peer closed or the socket failed.
Read read_exact(int fd, void* buffer, size_t n, double deadline = -1) {
  char* p = static_cast<char*>(buffer);
  while (n) {
    const ssize_t got = ::recv(fd, p, n, MSG_DONTWAIT);
    if (got > 0) {
      p += got;
      n -= got;
      continue;
    }
    if (got == 0 || (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) return READ_CLOSED;
    int wait_ms = -1;
    if (deadline >= 0) {
      const double left = deadline - now();
      if (left <= 0) return READ_TIMEOUT;
      wait_ms = static_cast<int>(left * 1000) + 1;
    }
    pollfd pfd{fd, POLLIN, 0};
    ::poll(&pfd, 1, wait_ms);
  }
  return READ_OK;
}

bool write_all(int fd, const void* buffer, size_t n) {
  const char* p = static_cast<const char*>(buffer);
  while (n) {
    const ssize_t sent = ::send(fd, p, n, MSG_NOSIGNAL);
    if (sent > 0) {
      p += sent;
      n -= sent;
    } else if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pfd{fd, POLLOUT, 0};
      ::poll(&pfd, 1, -1);
    } else if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

int64_t load(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// What is wrong with the step, or "" (it can be sampled from its slot).
std::string check(const GreedyStep& s, int64_t num_slots, int64_t slot_bytes, const std::string& kind) {
  if (s.slot >= num_slots)
    return kind + ": slot must be in [0, " + std::to_string(num_slots) + "), got " + std::to_string(s.slot);
  if (s.dtype >= NUM_DTYPES)
    return kind + ": dtype must be 0 (float32), 1 (bfloat16) or 2 (float16), got " + std::to_string(s.dtype);
  if (s.rows == 0 || s.vocab == 0)
    return kind + ": rows and vocab must be at least 1, got " + std::to_string(s.rows) + " and " +
           std::to_string(s.vocab);
  if (s.rows > MAX_ROWS)
    return kind + ": rows must be at most " + std::to_string(MAX_ROWS) + ", got " + std::to_string(s.rows);
  if (static_cast<int64_t>(s.rows) > slot_bytes / static_cast<int64_t>(c10::elementSize(DTYPES[s.dtype])) / s.vocab)
    return kind + ": " + std::to_string(s.rows) + " rows of " + std::to_string(s.vocab) +
           " logits do not fit a slot of " + std::to_string(slot_bytes) + " bytes";
  return "";
}

template <typename scalar_t>
void argmax_of(const uint8_t* data, const GreedyStep& s, int64_t* ids) {
  llmmesh_argmax::argmax_rows_of(reinterpret_cast<const scalar_t*>(data), s.rows, s.vocab, s.vocab, ids, false);
}

void argmax(const uint8_t* data, const GreedyStep& s, int64_t* ids) {
  switch (DTYPES[s.dtype]) {
    case at::kFloat: return argmax_of<float>(data, s, ids);
    case at::kBFloat16: return argmax_of<at::BFloat16>(data, s, ids);
    default: return argmax_of<at::Half>(data, s, ids);
  }
}

}  // namespace

// Serve the channel's greedy steps until another frame comes: (its length, "") with only its 4-byte length read;
// (-1, "") when the engine closed the channel; (-2, why) for a greedy step that cannot be served. headers:
// [num_slots, 8] int64 over the slots' headers; data: [num_slots, slot_bytes] uint8 over their logits.
std::tuple<int64_t, std::string> serve_greedy_steps(int64_t fd, at::Tensor headers, at::Tensor data) {
  TORCH_CHECK(headers.dim() == 2 && headers.size(1) == 8 && headers.scalar_type() == at::kLong &&
                  headers.is_contiguous(),
              "headers must be a contiguous [num_slots, 8] int64 tensor");
  TORCH_CHECK(data.dim() == 2 && data.size(0) == headers.size(0) && data.scalar_type() == at::kByte &&
                  data.is_contiguous(),
              "data must be a contiguous [num_slots, slot_bytes] uint8 tensor");
  const int64_t num_slots = data.size(0), slot_bytes = data.size(1);
  int64_t* header_base = headers.data_ptr<int64_t>();
  const uint8_t* data_base = data.data_ptr<uint8_t>();
  std::vector<char> answer;
  std::vector<PlainRow> rows;
  for (;;) {
    uint32_t word;
    if (read_exact(fd, &word, sizeof word) != READ_OK) return {-1, ""};
    const bool sampled = !(word & GREEDY_FLAG) && (word & SAMPLED_FLAG);
    if (!(word & GREEDY_FLAG) && !sampled) return {word, ""};
    const std::string kind = sampled ? "sampled step" : "greedy step";
    const uint32_t length = word & ~(sampled ? SAMPLED_FLAG : GREEDY_FLAG);
    // Refused before anything more is read: a sampled step is the step and whole rows.
    if (sampled ? length < sizeof(GreedyStep) || (length - sizeof(GreedyStep)) % sizeof(PlainRow)
                : length != sizeof(GreedyStep))
      return {-2, kind + ": a frame of " + std::to_string(length) + " bytes; the step has " +
                      std::to_string(sizeof(GreedyStep)) + (sampled ? ", then 40 for each row" : "")};
    GreedyStep s;
    if (read_exact(fd, &s, sizeof s) != READ_OK) return {-1, ""};
    std::string error = check(s, num_slots, slot_bytes, kind);
    if (error.empty() && sampled && length != sizeof s + sizeof(PlainRow) * static_cast<uint64_t>(s.rows))
      error = "sampled step: a frame of " + std::to_string(length) + " bytes for " + std::to_string(s.rows) +
              " rows; it must have " + std::to_string(sizeof s + sizeof(PlainRow) * s.rows);
    if (!error.empty()) return {-2, error};
    if (sampled) {
      rows.resize(s.rows);
      if (read_exact(fd, rows.data(), sizeof(PlainRow) * s.rows) != READ_OK) return {-1, ""};
    }
    int64_t* header = header_base + 8 * s.slot;  // written, reading, done
    if (load(header) != s.generation)
      return {-2, kind + ": generation " + std::to_string(s.generation) + " of slot " +
                      std::to_string(s.slot) + " is not what the slot holds (generation " +
                      std::to_string(load(header)) + ")"};
    store(header + 1, s.generation);
    const uint32_t answer_length = 8 + 8 * s.rows;
    answer.resize(4 + answer_length);
    std::memcpy(answer.data(), &answer_length, 4);
    std::memcpy(answer.data() + 4, &s.step_id, 8);
    int64_t* ids = reinterpret_cast<int64_t*>(answer.data() + 12);
    const uint8_t* logits = data_base + s.slot * slot_bytes;
    if (sampled) {
      at::Tensor tokens;
      try {
        const at::Tensor view = at::from_blob(const_cast<uint8_t*>(logits), {s.rows, s.vocab},
                                              at::TensorOptions().dtype(DTYPES[s.dtype]));
        tokens = llmmesh_sampling::sample_plain_rows(view, rows.data(), error);
      } catch (const std::exception& e) {
        error = std::string("sampled step: ") + e.what();
      }
      if (!error.empty()) return {-2, error};
      std::memcpy(ids, tokens.const_data_ptr<int64_t>(), 8 * s.rows);
    } else {
      argmax(logits, s, ids);
    }
    if (load(header) != s.generation)
      return {-2, kind + ": slot " + std::to_string(s.slot) + " was written while it was read"};
    store(header + 2, s.generation);
    if (!write_all(fd, answer.data(), answer.size())) return {-1, ""};
  }
}

namespace {

// Copy logits ([rows, vocab], contiguous, float32 / bfloat16 / float16) into the slot, set its `written` to
// generation, and send the step with `rows` after it (a sampled step's settings); false when the channel is closed.
bool send_step(int64_t fd, at::Tensor headers, at::Tensor data, int64_t slot, int64_t generation,
               const at::Tensor& logits, int64_t step_id, uint32_t flag, const std::string& rows) {
  const auto* found = std::find(std::begin(DTYPES), std::end(DTYPES), logits.scalar_type());
  TORCH_CHECK(found != std::end(DTYPES), "logits must be float32, bfloat16 or float16");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.nbytes() <= static_cast<size_t>(data.size(1)),
              "logits must be a contiguous [rows, vocab] block that fits a slot");
  TORCH_CHECK(0 <= slot && slot < data.size(0), "no such slot");
  TORCH_CHECK(flag == GREEDY_FLAG ? rows.empty() : rows.size() == logits.size(0) * sizeof(PlainRow),
              "a sampled step has one row of settings per row of logits");
  // torch's copy runs on the thread pool the forward pass has just left awake (faster than one memcpy at 64 rows)
  at::from_blob(data.data_ptr<uint8_t>() + slot * data.size(1), logits.sizes(), logits.options()).copy_(logits);
  store(headers.data_ptr<int64_t>() + 8 * slot, generation);
  const GreedyStep s{static_cast<uint64_t>(step_id), generation, static_cast<uint32_t>(slot),
                     static_cast<uint32_t>(found - std::begin(DTYPES)), static_cast<uint32_t>(logits.size(0)),
                     static_cast<uint32_t>(logits.size(1))};
  std::vector<char> frame(4 + sizeof s + rows.size());
  const uint32_t word = flag | static_cast<uint32_t>(sizeof s + rows.size());
  std::memcpy(frame.data(), &word, 4);
  std::memcpy(frame.data() + 4, &s, sizeof s);
  std::memcpy(frame.data() + 4 + sizeof s, rows.data(), rows.size());
  return write_all(fd, frame.data(), frame.size());
}

}  // namespace

// The engine's side of a greedy step: send_step without rows.
bool send_greedy_step(int64_t fd, at::Tensor headers, at::Tensor data, int64_t slot, int64_t generation,
                      const at::Tensor& logits, int64_t step_id) {
  return send_step(fd, headers, data, slot, generation, logits, step_id, GREEDY_FLAG, "");
}

// The engine's side of a sampled step: rows are the rows' PlainRow settings, packed.
bool send_sampled_step(int64_t fd, at::Tensor headers, at::Tensor data, int64_t slot, int64_t generation,
                       const at::Tensor& logits, int64_t step_id, const std::string& rows) {
  return send_step(fd, headers, data, slot, generation, logits, step_id, SAMPLED_FLAG, rows);
}

// The answer to the step: (its rows' tokens, 0); (empty, 1) when the channel closed, (empty, 2) past timeout seconds,
// (empty, 3) for an answer to another step or of another length than rows tokens.
std::tuple<at::Tensor, int64_t> recv_greedy_answer(int64_t fd, int64_t step_id, int64_t rows, double timeout) {
  const double deadline = now() + std::max(0.0, timeout);
  struct {
    uint32_t length;
    uint64_t step_id;
  } __attribute__((packed)) head;
  const Read r = read_exact(fd, &head, sizeof head, deadline);
  if (r != READ_OK) return {at::Tensor(), r == READ_CLOSED ? 1 : 2};
  if (head.length != 8 + 8 * rows || head.step_id != static_cast<uint64_t>(step_id)) return {at::Tensor(), 3};
  at::Tensor tokens = at::empty({rows}, at::kLong);
  const Read t = read_exact(fd, tokens.data_ptr<int64_t>(), 8 * rows, deadline);
  if (t != READ_OK) return {at::Tensor(), t == READ_CLOSED ? 1 : 2};
  return {tokens, 0};
}
