#include "bench/batch_invariance.h"

#include <cuda_runtime.h>

#include <cstring>
#include <functional>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "bench/synthetic_rows.h"
#include "worker/comm/communicator.h"
#include "worker/cuda/device_buffers.h"

namespace logprob {
namespace {

constexpr int kPoolRows = 64;  // distinct filler rows
constexpr size_t kMaxReported = 10;

/// One batch: M rows of `row_bytes` input bytes, their targets and gather
/// ids, and where each probe row sits (-1: not in this batch).
struct Batch {
  int64_t M = 0, offset = 0;
  std::vector<char> inputs;
  std::vector<int64_t> targets, gather;
  std::vector<int64_t> probe_at;
  BlockRows rows(const kernels::StatsSpec& spec) const {
    return BlockRows{M, targets.data(), spec.gather_k ? gather.data() : nullptr};
  }
};

/// Builds the batches of `options` over rows of `width` values of `dtype`
/// and targets in [0, V), and checks the records `score` writes for them.
class Checker {
 public:
  using Score = std::function<absl::Status(const Batch& batch, uint32_t* records)>;

  Checker(const InvarianceOptions& options, DType dtype, int64_t width, float scale, int64_t V)
      : o_(options), V_(V), row_bytes_(static_cast<size_t>(width) * DTypeSize(dtype)) {
    for (int p = 0; p < o_.probe_rows; ++p) probes_.push_back(HashBytes(Key(1, p), width, scale, dtype));
    for (int j = 0; j < kPoolRows; ++j) pool_.push_back(HashBytes(Key(2, j), width, scale, dtype));
  }

  absl::StatusOr<InvarianceResult> Run(const Score& score) {
    const size_t words = kernels::PartialWords(o_.spec);
    std::vector<uint32_t> records;
    for (int64_t M : o_.batch_sizes) {
      for (int64_t offset : o_.offsets) {
        if (M <= 0 || offset < 0 || offset >= M) continue;
        const Batch b = Make(M, offset);
        records.assign(static_cast<size_t>(M) * words, 0xdeadbeefu);
        if (absl::Status st = score(b, records.data()); !st.ok())
          return absl::Status(st.code(), absl::StrCat("batch M=", M, " offset=", offset, ": ", st.message()));
        ++result_.batches;
        for (int p = 0; p < o_.probe_rows; ++p)
          if (b.probe_at[p] >= 0) Compare(p, b, records.data() + b.probe_at[p] * words);
      }
    }
    return result_;
  }

 private:
  uint64_t Key(uint64_t kind, uint64_t i) const { return HashMix(o_.seed * 7 + kind, i); }

  Batch Make(int64_t M, int64_t offset) const {
    Batch b;
    b.M = M;
    b.offset = offset;
    b.inputs.resize(static_cast<size_t>(M) * row_bytes_);
    b.targets.resize(M);
    b.gather.resize(static_cast<size_t>(M) * o_.spec.gather_k);
    b.probe_at.assign(o_.probe_rows, -1);
    const uint64_t batch_key = Key(3, static_cast<uint64_t>(M) * 100003u + static_cast<uint64_t>(offset));
    for (int64_t i = 0; i < M; ++i) {
      const int64_t p = i - offset;
      const bool probe = p >= 0 && p < o_.probe_rows;
      const uint32_t h = HashMix(batch_key, i);
      const std::vector<char>& src = probe ? probes_[p] : pool_[h % kPoolRows];
      std::memcpy(b.inputs.data() + i * row_bytes_, src.data(), row_bytes_);
      if (probe) {
        b.probe_at[p] = i;
        b.targets[i] = Key(4, p) % V_;
        for (int g = 0; g < o_.spec.gather_k; ++g) b.gather[i * o_.spec.gather_k + g] = Key(5, p * 64 + g) % V_;
      } else {
        b.targets[i] = (h >> 8) % 5 == 0 ? -1 : HashMix(batch_key, M + i) % V_;
        for (int g = 0; g < o_.spec.gather_k; ++g)
          b.gather[i * o_.spec.gather_k + g] = HashMix(batch_key, 2 * M + i * 64 + g) % V_;
      }
    }
    return b;
  }

  /// The bits of CombinePartials' outputs of one record.
  std::vector<uint32_t> Outputs(const uint32_t* record, bool has_target) const {
    kernels::StatsSpec s = o_.spec;
    s.vocab_size = V_;
    // token_logprob, entropy, top-k, gathered, log_sum_sq_probs, mean_logits.
    std::vector<float> f(4 + s.topk + s.gather_k);
    std::vector<int64_t> ids(s.topk);
    int32_t top1 = 0;
    kernels::RowOutput out{&f[0], &f[1], s.topk ? &f[2] : nullptr, s.topk ? ids.data() : nullptr,
                           s.gather_k ? &f[2 + s.topk] : nullptr};
    out.log_sum_sq_probs = &f[2 + s.topk + s.gather_k];
    out.mean_logits = &f[3 + s.topk + s.gather_k];
    out.is_top1 = &top1;
    kernels::CombinePartials(&record, 1, s, has_target, out);
    std::vector<uint32_t> bits(f.size() + 2 * ids.size() + 1);
    std::memcpy(bits.data(), f.data(), f.size() * 4);
    std::memcpy(bits.data() + f.size(), ids.data(), ids.size() * 8);
    std::memcpy(bits.data() + f.size() + 2 * ids.size(), &top1, 4);
    return bits;
  }

  void Compare(int p, const Batch& b, const uint32_t* record) {
    const size_t words = kernels::PartialWords(o_.spec);
    std::vector<uint32_t> rec(record, record + words);
    std::vector<uint32_t> out = Outputs(record, true);
    const std::string where = absl::StrCat("M=", b.M, " offset=", b.offset, " (row ", b.probe_at[p], ")");
    auto it = first_.find(p);
    if (it == first_.end()) {
      first_.emplace(p, First{where, std::move(rec), std::move(out)});
      return;
    }
    ++result_.comparisons;
    const First& f = it->second;
    std::string what;
    for (size_t w = 0; w < words && what.empty(); ++w)
      if (rec[w] != f.record[w])
        what = absl::StrCat("record word ", w, ": 0x", absl::Hex(rec[w]), " vs 0x", absl::Hex(f.record[w]));
    for (size_t w = 0; w < out.size() && what.empty(); ++w)
      if (out[w] != f.outputs[w])
        what = absl::StrCat("combined output word ", w, ": 0x", absl::Hex(out[w]), " vs 0x", absl::Hex(f.outputs[w]));
    if (what.empty()) return;
    ++result_.mismatches;
    if (result_.first_mismatches.size() < kMaxReported)
      result_.first_mismatches.push_back(
          absl::StrCat("probe row ", p, " at ", where, " differs from ", f.where, ": ", what));
  }

  struct First {
    std::string where;
    std::vector<uint32_t> record, outputs;
  };
  const InvarianceOptions& o_;
  const int64_t V_;
  const size_t row_bytes_;
  std::vector<std::vector<char>> probes_, pool_;
  std::map<int, First> first_;
  InvarianceResult result_;
};

/// cudaMalloc memory that grows, freed on destruction.
class DeviceScratch {
 public:
  ~DeviceScratch() {
    if (p_) cudaFree(p_);
  }
  absl::StatusOr<void*> Hold(const std::vector<char>& bytes) {
    if (bytes.size() > size_) {
      if (p_) cudaFree(p_);
      p_ = nullptr;
      size_ = 0;
      if (cudaError_t e = cudaMalloc(&p_, bytes.size()); e != cudaSuccess)
        return absl::InternalError(absl::StrCat("cudaMalloc of ", bytes.size(), " bytes: ", cudaGetErrorString(e)));
      size_ = bytes.size();
    }
    // On the device before the backend's (non-blocking) streams read it.
    if (absl::Status st = cuda::UploadAndWait(p_, bytes.data(), bytes.size()); !st.ok()) return st;
    return p_;
  }

 private:
  void* p_ = nullptr;
  size_t size_ = 0;
};

}  // namespace

std::string InvarianceResult::Summary() const {
  std::ostringstream s;
  s << batches << " batches, " << comparisons << " probe-row comparisons, " << mismatches << " mismatches";
  for (const std::string& m : first_mismatches) s << "\n  " << m;
  return s.str();
}

absl::StatusOr<InvarianceResult> CheckHiddenItemInvariance(ScoringBackend& backend, const LmHeadWeights& lm_head,
                                                           DType dtype, bool on_device,
                                                           const InvarianceOptions& options) {
  if (!IsFloatDType(dtype)) return absl::InvalidArgumentError("hidden states dtype must be F32, BF16 or F16");
  Checker checker(options, dtype, lm_head.hidden_size(), 1.f, lm_head.rows());
  DeviceScratch device;
  SelfCommunicator self;
  return checker.Run([&](const Batch& b, uint32_t* records) -> absl::Status {
    HiddenItemRows item;
    item.dtype = dtype;
    item.own = b.inputs.data();
    if (on_device) {
      auto p = device.Hold(b.inputs);
      if (!p.ok()) return p.status();
      item.own = *p;
    }
    item.own_on_device = on_device;
    item.vocab_begin = 0;
    item.first = {0};
    item.count = {b.M};
    item.rows = b.rows(options.spec);
    return backend.HiddenItemPartials(lm_head, item, self, options.spec, records);
  });
}

absl::StatusOr<InvarianceResult> CheckSliceInvariance(ScoringBackend& backend, DType dtype, int64_t V,
                                                      const InvarianceOptions& options) {
  if (!IsFloatDType(dtype) || V <= 0) return absl::InvalidArgumentError("logits must be F32, BF16 or F16, V > 0");
  Checker checker(options, dtype, V, 8.f, V);
  return checker.Run([&](const Batch& b, uint32_t* records) {
    return backend.SlicePartials(LogitsBlock{dtype, b.inputs.data(), 0, V}, b.rows(options.spec), options.spec,
                                 records);
  });
}

}  // namespace logprob
