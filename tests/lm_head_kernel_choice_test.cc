// The pool's CPU kernel for the bf16 lm_head GEMM (worker/kernels/
// lm_head_kernel_choice.h): the flag's values, an explicit choice kept or
// refused, auto by ISA (no bf16 matmul: widen; AMX: bf16) and, between
// them, by a measurement whose figures the choice follows. ctest runs the
// binary twice: as the CPU is, and with oneDNN capped at AVX512_CORE_BF16
// (lm_head_kernel_choice_without_amx), where auto measures on an AMX box.
#include "worker/kernels/lm_head_kernel_choice.h"

#include <gtest/gtest.h>

#include <string>

#include "worker/kernels/lm_head_gemm.h"

namespace logprob::kernels {
namespace {

TEST(LmHeadCpuKernelFlag, ParsesItsThreeValuesAndNamesTheFlagOtherwise) {
  for (LmHeadCpuKernel k : {LmHeadCpuKernel::kAuto, LmHeadCpuKernel::kBf16, LmHeadCpuKernel::kWiden}) {
    auto parsed = ParseLmHeadCpuKernel(LmHeadCpuKernelName(k));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, k);
  }
  for (const char* bad : {"", "BF16", "amx", "widen "}) {
    auto parsed = ParseLmHeadCpuKernel(bad);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(parsed.status().message().find("--lm-head-cpu-kernel '"), std::string::npos) << parsed.status();
  }
}

TEST(LmHeadCpuKernelChoice, AnExplicitKernelIsKeptOrRefused) {
  auto widen = ChooseLmHeadCpuKernel(LmHeadCpuKernel::kWiden, 256, 1);
  ASSERT_TRUE(widen.ok()) << widen.status();
  EXPECT_EQ(widen->kernel, LmHeadCpuKernel::kWiden);
  EXPECT_NE(widen->why.find("set by --lm-head-cpu-kernel"), std::string::npos) << widen->why;
  auto native = ChooseLmHeadCpuKernel(LmHeadCpuKernel::kBf16, 256, 1);
  if (Bf16MatmulSupported()) {
    ASSERT_TRUE(native.ok()) << native.status();
    EXPECT_EQ(native->kernel, LmHeadCpuKernel::kBf16);
  } else {
    EXPECT_EQ(native.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(native.status().message().find("--lm-head-cpu-kernel widen"), std::string::npos) << native.status();
  }
}

TEST(LmHeadCpuKernelChoice, AutoFollowsTheIsaThenTheMeasurement) {
  const std::string isa = EffectiveCpuIsa();
  auto c = ChooseLmHeadCpuKernel(LmHeadCpuKernel::kAuto, 256, 1);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NE(c->kernel, LmHeadCpuKernel::kAuto);
  EXPECT_NE(c->why.find("ISA " + isa), std::string::npos) << c->why;
  if (!Bf16MatmulSupported()) {
    EXPECT_EQ(c->kernel, LmHeadCpuKernel::kWiden) << c->why;
  } else if (isa == "avx512_core_amx") {
    EXPECT_EQ(c->kernel, LmHeadCpuKernel::kBf16) << c->why;
  } else {
    EXPECT_NE(c->why.find("measured on [128, 256] x [256, 1024], 1 thread(s): bf16 "), std::string::npos) << c->why;
  }
}

// A pool without a head at start-up scores no hidden states yet: auto
// measures nothing (the front-end starts at once) and keeps bf16 where it runs.
TEST(LmHeadCpuKernelChoice, AutoWithoutAHeadDoesNotMeasure) {
  auto c = ChooseLmHeadCpuKernel(LmHeadCpuKernel::kAuto, 0, 1);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->kernel, Bf16MatmulSupported() ? LmHeadCpuKernel::kBf16 : LmHeadCpuKernel::kWiden) << c->why;
  EXPECT_EQ(c->why.find("measured"), std::string::npos) << c->why;
}

TEST(LmHeadCpuKernelChoice, TheMeasurementTimesBothKernelsOnTheShape) {
  if (!Bf16MatmulSupported()) {
    EXPECT_EQ(MeasureLmHeadKernels(256, 1).status().code(), absl::StatusCode::kFailedPrecondition);
    GTEST_SKIP() << "no bf16 matmul: only widen runs here";
  }
  auto f = MeasureLmHeadKernels(192, 1, /*rows=*/64, /*cols=*/256, /*rounds=*/3);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->rows, 64);
  EXPECT_EQ(f->cols, 256);
  EXPECT_EQ(f->hidden_size, 192);
  EXPECT_GT(f->bf16_gflops, 0);
  EXPECT_GT(f->widen_gflops, 0);
  EXPECT_EQ(MeasureLmHeadKernels(0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MeasureLmHeadKernels(64, 1, 8, 128, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace logprob::kernels
