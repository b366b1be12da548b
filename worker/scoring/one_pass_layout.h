// The arithmetic of the one-pass hidden-states path (ScoringBackend::
// HiddenItemPartials), in one place: the CUDA backend (device buffers and
// collectives), the NCCL communicator (all-to-all displacements) and the
// host test double of tests/scorer_test.cc all call it, and
// tests/one_pass_layout_test.cc checks it on the CPU for W = 1..8.
//
// An item of n rows is split over W ranks in rank order (SplitRows). It is
// scored in passes of at most `pass_rows` rows of every rank's share, so
// device memory per pass is bounded whatever n. In pass p, rank q holds
// share rows [p * pass_rows, min((p + 1) * pass_rows, count[q])), i.e. item
// rows [first[q] + p * pass_rows, + PassLayout::count[q]). Each rank's pass
// rows sit in a slot of `slot_rows` rows (the largest count of the pass,
// rounded up to kSlotAlignRows so every slot and GEMM chunk starts aligned),
// slot q at byte q * slot_rows * row_bytes, which an in-place all-gather
// fills. The pass's records are packed in rank order (rank q's rows from
// record row `record_row[q]`), so the all-to-all sends count[q] records to
// q and every rank receives count[me] records from each rank: the received
// buffer is [W][count[me]][words]. They land in the item's own records,
// [W][count[me] of the item][words] (RecordIndex), at row pass_row0 + i.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace logprob {

/// Rows of every slot and GEMM chunk start at a multiple of this.
inline constexpr int64_t kSlotAlignRows = 16;

/// `rows` rounded up to a multiple of kSlotAlignRows (0 stays 0).
int64_t AlignRows(int64_t rows);

/// Per-rank row ranges of an item: rank q holds item rows [first[q],
/// first[q] + count[q]); first[0] == 0 and the ranges tile [0, n) in rank
/// order.
struct RankRows {
  std::vector<int64_t> first, count;
  int size() const { return static_cast<int>(count.size()); }
  /// Sum of count.
  int64_t total() const;
  /// The largest count (0 for an empty item).
  int64_t most() const;
};

/// The balanced split of n rows over W ranks (SplitRange, larger shares
/// first), the planner's and the scorer's. W >= 1.
RankRows SplitRows(int64_t n, int W);

/// Exclusive prefix sums of `sizes`: where block q starts when the blocks
/// are consecutive in rank order (AllToAllV send / receive offsets).
std::vector<int64_t> Displacements(const std::vector<int64_t>& sizes);

/// Where rank q's contribution of `bytes` bytes sits in an all-gather's
/// output (q * bytes); in-place all-gathers read rank q's input there.
inline size_t AllGatherOffset(int q, size_t bytes) { return static_cast<size_t>(q) * bytes; }

/// Index (in words) of record i of vocabulary slice (rank) q in a record
/// buffer laid out [W][rows][words], rank-major: what one all-to-all of
/// records delivers (rows = this rank's row count).
inline size_t RecordIndex(int q, int64_t i, int64_t rows, size_t words) {
  return static_cast<size_t>(static_cast<int64_t>(q) * rows + i) * words;
}

/// One pass of a one-pass item (see the file comment).
struct PassLayout {
  int64_t pass_row0 = 0;  // first share row of every rank in this pass
  int64_t slot_rows = 0;  // rows of every rank's slot: AlignRows(largest count), >= kSlotAlignRows when any row
  std::vector<int64_t> item_first;  // per rank: item row of its first row in this pass
  std::vector<int64_t> count;       // per rank: its rows in this pass (0 <= count <= pass_rows)
  std::vector<int64_t> record_row;  // per rank: first row of its rows in the pass's packed records

  /// Rows of all ranks in this pass (the pass's records).
  int64_t total() const;
  /// Byte offset of rank q's slot, rows of `row_bytes` bytes.
  size_t SlotOffset(int q, size_t row_bytes) const { return AllGatherOffset(q, SlotBytes(row_bytes)); }
  /// Bytes of one slot (every rank's all-gather contribution).
  size_t SlotBytes(size_t row_bytes) const { return static_cast<size_t>(slot_rows) * row_bytes; }
  /// The all-to-all of the pass's records (`words` uint32 words each) on
  /// rank `me`: bytes sent to each rank (count[q] records) and received
  /// from each (count[me] records).
  void RecordExchange(int me, size_t words, std::vector<int64_t>* send_bytes, std::vector<int64_t>* recv_bytes) const;
};

/// The passes of one item on every rank (identical on all ranks given the
/// same rows and pass_rows). Immutable; thread-safe.
class OnePassLayout {
 public:
  /// `rows` must tile the item in rank order (CheckRankRows); `pass_rows`
  /// >= 1 is the most rows of one rank's share per pass.
  OnePassLayout(RankRows rows, int64_t pass_rows);

  const RankRows& rows() const { return rows_; }
  int64_t pass_rows() const { return pass_rows_; }
  /// Number of passes: ceil(rows().most() / pass_rows), 0 for an empty item.
  int64_t passes() const { return passes_; }
  /// Pass p, 0 <= p < passes().
  PassLayout Pass(int64_t p) const;
  /// The largest slot_rows and total() over all passes (buffer sizes).
  int64_t max_slot_rows() const;
  int64_t max_total_rows() const;

 private:
  RankRows rows_;
  int64_t pass_rows_, passes_;
};

/// INVALID_ARGUMENT unless `rows` has W ranges that tile [0, n) in rank
/// order with counts >= 0.
absl::Status CheckRankRows(const RankRows& rows, int W, int64_t n);

/// The most rows of a rank's share per pass for a budget of `pass_bytes`
/// bytes of gathered hidden states (W slots of rows of `row_bytes`): a
/// multiple of kSlotAlignRows, at least kSlotAlignRows.
int64_t PassRowsForBudget(size_t pass_bytes, int W, size_t row_bytes);

/// What a rank brings to the agreement before a pass's collectives.
enum class PassVote : int64_t {
  kGo = 0,         // ready
  kCancelled = 1,  // its call was cancelled or its deadline passed
  kFailed = 2,     // a local failure (e.g. device memory for the pass)
};

/// Agreement before a pass (one host all-gather of 16 bytes per rank), so
/// that either every rank enters the pass's device collectives or none
/// does: a rank that could not allocate, or must stop, never leaves its
/// peers waiting in a collective until the timeout. `pass_rows` is this
/// rank's proposal; on OK every rank goes on with the smallest proposal
/// (returned). Errors: when a rank voted kFailed, `failure` on that rank
/// and RESOURCE_EXHAUSTED naming the lowest failed rank on the others;
/// else, when a rank voted kCancelled, CANCELLED on every rank; the
/// collective's error when it fails.
absl::StatusOr<int64_t> AgreeOnPass(Communicator& comm, PassVote vote, int64_t pass_rows, const absl::Status& failure);

/// The first agreement of a pass, once this rank's uploads ran (issue 35
/// item 3). `queued`: the status of queuing the rank's uploads (and for
/// W == 1 its GEMMs) asynchronously, OK when `stopping` (none queued).
/// Unless `stopping` or `queued` failed, calls `wait`, which returns once
/// the queued work ran, with its execution error (a CUDA IPC copy fault, a
/// staging copy); then AgreeOnPass with kFailed (`queued`'s or `wait`'s
/// failure), kCancelled (`stopping`) or kGo. An upload
/// that fails while running is thus voted on before any device
/// collective: no peer enters the all-gather alone and waits there for
/// the collective timeout. Returns OK when every rank may go on, else
/// AgreeOnPass's error (this rank's own failure, or RESOURCE_EXHAUSTED /
/// CANCELLED naming the peers'). Call from every rank; the callbacks run
/// on the calling thread.
absl::Status AgreeAfterUploads(Communicator& comm, bool stopping, int64_t pass_rows, const absl::Status& queued,
                               absl::FunctionRef<absl::Status()> wait);

}  // namespace logprob
