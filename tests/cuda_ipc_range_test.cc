// The range check of CUDA IPC inputs (worker/cuda/cuda_ipc.h
// CudaIpcRangeLimit), on the CPU: the importer's mapping may be rounded up
// to whole pages, so the allocation's size the client sent bounds the
// range when given (issue 35 item 4). No device needed.
#include <gtest/gtest.h>

#include <string>

#include "worker/cuda/cuda_ipc.h"

namespace logprob::cuda {
namespace {

TEST(CudaIpcRange, TheSizeTheClientSentBoundsTheRange) {
  // A 1000-byte allocation mapped as a whole 4096-byte page.
  auto limit = CudaIpcRangeLimit(0, 1000, 4096, 1000);
  ASSERT_TRUE(limit.ok()) << limit.status();
  EXPECT_EQ(*limit, 1000);
  limit = CudaIpcRangeLimit(996, 4, 4096, 1000);  // ends exactly at its end
  ASSERT_TRUE(limit.ok()) << limit.status();
  // Past the allocation but inside the page: refused, not scored.
  limit = CudaIpcRangeLimit(996, 8, 4096, 1000);
  EXPECT_EQ(limit.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(limit.status().message()),
            "CUDA IPC input: bytes [996, 996 + 8) are outside the client's allocation of 1000 bytes");
  limit = CudaIpcRangeLimit(1001, 0, 4096, 1000);
  EXPECT_EQ(limit.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaIpcRange, WithoutAClientSizeTheMappingBoundsIt) {
  auto limit = CudaIpcRangeLimit(4000, 96, 4096, 0);
  ASSERT_TRUE(limit.ok()) << limit.status();
  EXPECT_EQ(*limit, 4096);
  limit = CudaIpcRangeLimit(4000, 97, 4096, 0);
  EXPECT_EQ(limit.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(limit.status().message()).find("(as mapped here; the client sent no size)"), std::string::npos)
      << limit.status();
}

TEST(CudaIpcRange, ASizeLargerThanTheMappingIsRefused) {
  const auto limit = CudaIpcRangeLimit(0, 16, 4096, 8192);
  EXPECT_EQ(limit.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(limit.status().message()),
            "CUDA IPC input: the client says its allocation has 8192 bytes, but the mapping of its handle has 4096");
  EXPECT_EQ(CudaIpcRangeLimit(0, 16, 4096, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaIpcRangeLimit(-1, 16, 4096, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaIpcRangeLimit(0, -16, 4096, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace logprob::cuda
