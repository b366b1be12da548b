// The packed partial record: the one layout that the CPU kernel
// (kernels::ComputePartial / CombinePartials, row_stats.h), the CUDA
// kernels (worker/cuda/row_partials.cu, topk_select.cuh) and every rank of
// a vocab-parallel job (worker/scoring/scorer.cc sends records through the
// communicator) share. One record describes one row over one vocabulary
// slice [vocab_begin, vocab_begin + len):
//
//   word  field                      type
//   0     m       max x of the slice f32   (-inf: nothing kept)
//   1     target_x  x at the target  f32   (kAbsentXBits: not in the slice,
//                                           or the row has no target)
//   2-3   s = sum exp(x - m)         f64   (little-endian: low word first)
//   4-5   u = sum exp(x - m)(x - m)  f64
//   6-7   q = sum exp(2(x - m))      f64   (log_sum_sq_probs; 0 unless asked)
//   8-9   zsum = sum of x over the   f64   (mean_logits; 0 unless asked)
//         slice BEFORE the sampling filters
//   10    pre_target_max             f32   (is_top1; -inf unless asked) max x
//         over the slice's ids < target: the slice's m when the whole
//         slice lies before the target, -inf when it lies after it (or
//         the row has no target)
//   11    reserved                   u32   0 (the header stays 8-byte sized)
//   12... gather_x[gather_k]         f32   (kAbsentXBits: not in the slice)
//   ...   topk_x[topk]               f32   best first; padding -inf
//   ...   topk_id[topk]              i32   global ids; padding kNoTopkId
//
// x = logits / temperature (float32), entries below the row's keep_min
// (sampling filters) are -inf (except in zsum, which is taken before the
// filters). Plain C++ (constexpr, no device code), so that g++, clang and
// nvcc (host and device code) all include it.
//
// q, zsum and pre_target_max are always in the header (24 bytes more per
// record, small next to a row of logits or hidden states, and one layout
// for every request) and computed only when the request asks for
// log_sum_sq_probs / mean_logits / is_top1 (kernels::StatsSpec); otherwise
// they hold 0, 0 and -inf. They combine exactly across slices, in rank
// order (kernels::CombinePartials): Q = sum_i q_i exp(2(m_i - M)),
// log_sum_sq_probs = log Q - 2 log S; mean_logits = (sum_i zsum_i) / V;
// is_top1 = target_x >= M && target_x > max_i pre_target_max_i (TRL's
// `max_before_target` rule: among equal maxima the lowest id is the
// argmax). pre_target_max may use the filtered x: the sampling filters
// always keep the maximum, and a removed id has x below the smallest kept
// value, so it can never tie or beat a kept target; a removed target has
// target_x = -inf and is not the argmax either way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "common/host_device.h"

namespace logprob::record {

/// The record's header as a C++ struct: documents the byte offsets below
/// (static_asserts), never read or written as a struct (records are
/// uint32 arrays, doubles go through memcpy / two words).
struct Header {
  float m;
  float target_x;
  double s;
  double u;
  double q;
  double zsum;
  float pre_target_max;
  uint32_t reserved;
};

/// Word offsets of the header fields.
constexpr int kMaxWord = 0;            // m (f32)
constexpr int kTargetWord = 1;         // target_x (f32)
constexpr int kSWord = 2;              // s (f64, 2 words)
constexpr int kUWord = 4;              // u (f64, 2 words)
constexpr int kQWord = 6;              // q (f64, 2 words)
constexpr int kZSumWord = 8;           // zsum (f64, 2 words)
constexpr int kPreTargetMaxWord = 10;  // pre_target_max (f32)
constexpr int kReservedWord = 11;      // 0
/// Words of the header; the gather values start here.
constexpr int kHeaderWords = 12;

/// Top-k padding id (slice shorter than K): no vocabulary id can be it.
constexpr int32_t kNoTopkId = std::numeric_limits<int32_t>::max();
/// Bits of target_x / gather_x for an id outside the slice: the quiet NaN
/// std::nanf("") returns (CombinePartials takes the one non-NaN value).
constexpr uint32_t kAbsentXBits = 0x7fc00000u;

static_assert(sizeof(float) == 4 && sizeof(double) == 8 && sizeof(int32_t) == 4, "32-bit words");
static_assert(kMaxWord * 4 == offsetof(Header, m), "m: word 0");
static_assert(kTargetWord * 4 == offsetof(Header, target_x), "target_x: word 1");
static_assert(kSWord * 4 == offsetof(Header, s), "s: words 2-3");
static_assert(kUWord * 4 == offsetof(Header, u), "u: words 4-5");
static_assert(kQWord * 4 == offsetof(Header, q), "q: words 6-7");
static_assert(kZSumWord * 4 == offsetof(Header, zsum), "zsum: words 8-9");
static_assert(kPreTargetMaxWord * 4 == offsetof(Header, pre_target_max), "pre_target_max: word 10");
static_assert(kReservedWord * 4 == offsetof(Header, reserved), "reserved: word 11");
static_assert(kTargetWord == kMaxWord + 1 && kSWord == kTargetWord + 1 && kUWord == kSWord + 2 &&
                  kQWord == kUWord + 2 && kZSumWord == kQWord + 2 && kPreTargetMaxWord == kZSumWord + 2 &&
                  kReservedWord == kPreTargetMaxWord + 1 && kHeaderWords == kReservedWord + 1,
              "header fields are contiguous, in this order");
static_assert(kHeaderWords * 4 == sizeof(Header), "header: 12 words");
static_assert(kNoTopkId == 2147483647, "padding id: INT32_MAX");

/// Word of gather value j (0 <= j < gather_k).
LOGPROB_HOST_DEVICE constexpr int64_t GatherWord(int64_t j) { return kHeaderWords + j; }
/// Word of the top-k value j (0 <= j < topk).
LOGPROB_HOST_DEVICE constexpr int64_t TopkValueWord(int gather_k, int64_t j) { return kHeaderWords + gather_k + j; }
/// Word of the top-k id j (0 <= j < topk).
LOGPROB_HOST_DEVICE constexpr int64_t TopkIdWord(int gather_k, int topk, int64_t j) {
  return kHeaderWords + gather_k + int64_t{topk} + j;
}
/// Words of a record with `gather_k` gather ids and `topk` candidates.
LOGPROB_HOST_DEVICE constexpr int64_t Words(int gather_k, int topk) {
  return kHeaderWords + gather_k + 2 * int64_t{topk};
}

static_assert(GatherWord(0) == kHeaderWords, "gather_x follows the header");
static_assert(TopkValueWord(3, 0) == GatherWord(3), "topk_x follows gather_x");
static_assert(TopkIdWord(3, 5, 0) == TopkValueWord(3, 5), "topk_id follows topk_x");
static_assert(Words(3, 5) == TopkIdWord(3, 5, 5), "the record ends after topk_id");
static_assert(Words(0, 0) == kHeaderWords, "a record without gather and top-k is its header");

}  // namespace logprob::record
