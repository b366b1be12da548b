// A backward pass over W ranks (worker/scoring/backward_pass.h) as threads
// over the in-process communicator, each with its slice of a reference
// problem's head (tests/head_backward_reference.h) through a SliceBackward
// the test makes (the CPU's or the GPU's): the ranks' dL/dh shares summed
// in rank order, and their dL/dW / dL/db after the flush.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "tests/head_backward_reference.h"
#include "tests/in_process_communicator.h"
#include "worker/scoring/backward_pass.h"

namespace logprob::testing {

/// Makes rank `rank`'s SliceBackward over the head's rows [vb, ve) of `p`.
using MakeSliceBackward = std::function<absl::StatusOr<std::unique_ptr<SliceBackward>>(
    const kernels::backward_reference::Case& c, const kernels::backward_reference::Problem& p, int64_t vb, int64_t ve)>;

/// Rows [row_begin, row_begin + rows) of `p` through W ranks, `round_rows`
/// rows per round. Failures are test failures (EXPECT).
inline kernels::backward_reference::Grads BackwardPass(const kernels::backward_reference::Case& c,
                                                       const kernels::backward_reference::Problem& p, int W,
                                                       int64_t row_begin, int64_t rows, int64_t round_rows,
                                                       const MakeSliceBackward& make) {
  using kernels::backward_reference::H;
  using kernels::backward_reference::V;
  kernels::backward_reference::Grads out;
  out.dh.assign(rows * H, 0.0f);
  out.dw.assign(V * H, 0.0f);
  out.db.assign(V, 0.0f);
  std::vector<std::vector<float>> shares(W, std::vector<float>(rows * H));
  std::vector<absl::Status> status(W);
  InProcessGroup group(W);
  std::vector<std::thread> ranks;
  for (int r = 0; r < W; ++r)
    ranks.emplace_back([&, r] {
      const int64_t vb = V * r / W, ve = V * (r + 1) / W;
      auto bw = make(c, p, vb, ve);
      if (!bw.ok()) {
        status[r] = bw.status();
        group.Abort();
        return;
      }
      InProcessCommunicator comm(group, r);
      BackwardPassRows in;
      in.hidden = p.h.data() + row_begin * H;  // f32
      in.rows = rows;
      in.targets = p.targets.data() + row_begin;
      in.grad_logprobs = p.g_lp.data() + row_begin;
      in.grad_entropy = p.g_ent.data() + row_begin;
      in.round_rows = round_rows;
      status[r] = RunBackwardPass(in, **bw, V, comm, shares[r].data(), out.dw.data() + vb * H, out.db.data() + vb);
      if (status[r].ok()) status[r] = (*bw)->Flush(out.dw.data() + vb * H, out.db.data() + vb);
      if (!status[r].ok()) group.Abort();
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < W; ++r) {
    EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    for (int64_t k = 0; k < rows * H; ++k) out.dh[k] += shares[r][k];  // rank order
  }
  return out;
}

}  // namespace logprob::testing
