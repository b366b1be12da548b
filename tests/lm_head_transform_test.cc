// The head's logit transform (common/lm_head_transform.h): the rule reading
// it from a Hugging Face config.json, and its application against float64.
#include "common/lm_head_transform.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "worker/kernels/lm_head_transform_simd.h"

namespace logprob {
namespace {

absl::StatusOr<LmHeadScalars> Parse(const std::string& json) { return LmHeadScalarsFromConfig(json, "config.json"); }

TEST(LmHeadConfig, NoTransform) {
  auto s = Parse(R"({"model_type": "llama", "vocab_size": 32000, "tie_word_embeddings": false})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->logit_scale, 1.0);
  EXPECT_EQ(s->softcap, 0.0);
  EXPECT_TRUE(s->logit_scale_from.empty());
  EXPECT_TRUE(s->softcap_from.empty());
  EXPECT_FALSE(s->bias_required);
}

TEST(LmHeadConfig, EachAttribute) {
  struct Case {
    std::string json;
    double scale, softcap;
    std::string scale_from, softcap_from;
  };
  const std::vector<Case> cases = {
      {R"({"model_type": "gemma2", "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0})", 1, 30, "",
       "final_logit_softcapping"},
      {R"({"model_type": "cohere", "logit_scale": 0.0625})", 0.0625, 0, "logit_scale", ""},
      {R"({"model_type": "x", "output_multiplier": 0.25, "final_logit_softcapping": 20})", 0.25, 20,
       "output_multiplier", "final_logit_softcapping"},
      {R"({"model_type": "falcon_h1", "lm_head_multiplier": 0.0390625})", 0.0390625, 0, "lm_head_multiplier", ""},
      {R"({"model_type": "granite", "logits_scaling": 8.0})", 0.125, 0, "logits_scaling", ""},
      {R"({"model_type": "minicpm3", "logits_scaling": 4})", 0.25, 0, "logits_scaling", ""},
      {R"({"model_type": "hyperclovax", "logits_scaling": 0.5})", 0.5, 0, "logits_scaling", ""},
      {R"({"model_type": "recurrent_gemma", "logits_soft_cap": 30})", 1, 30, "", "logits_soft_cap"},
      {R"({"model_type": "xlstm", "output_logit_soft_cap": 15})", 1, 15, "", "output_logit_soft_cap"},
      // TRL's order: logit_scale before logits_scaling
      {R"({"model_type": "x", "logit_scale": 2, "logits_scaling": 8})", 2, 0, "logit_scale", ""},
      // null is none (TRL reads None as unscaled), then the next attribute
      {R"({"model_type": "mpt", "logit_scale": null, "final_logit_softcapping": null})", 1, 0, "", ""},
      {R"({"model_type": "x", "logit_scale": null, "lm_head_multiplier": 3})", 3, 0, "lm_head_multiplier", ""},
      // transformers' model_type defaults when the attribute is absent
      {R"({"model_type": "gemma2"})", 1, 30, "", "final_logit_softcapping"},
      {R"({"model_type": "cohere2"})", 0.0625, 0, "logit_scale", ""},
      // multimodal: the text config
      {R"({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "final_logit_softcapping": 25}})", 1,
       25, "", "text_config.final_logit_softcapping"},
      {R"({"model_type": "granite4_vision", "text_config": {"model_type": "granite", "logits_scaling": 16}})", 1.0 / 16,
       0, "text_config.logits_scaling", ""},
      // HyperCLOVA X's vision model multiplies by its text config's logits_scaling
      {R"({"model_type": "hyperclovax_vision_v2", "text_config": {"model_type": "hyperclovax", "logits_scaling": 2}})",
       2, 0, "text_config.logits_scaling", ""},
      {R"({"model_type": "hyperclovax_vision_v2", "text_config": {"logits_scaling": 2}})", 2, 0,
       "text_config.logits_scaling", ""},
      // defaults of a text config by its model_type, or its model's "_text" one
      {R"({"model_type": "gemma3n", "text_config": {"model_type": "gemma3n_text"}})", 1, 30, "",
       "text_config.final_logit_softcapping"},
      {R"({"model_type": "gemma3n", "text_config": {}})", 1, 30, "", "text_config.final_logit_softcapping"},
      {R"({"model_type": "granite_docling", "text_config": {"model_type": "granite_docling_text"}})", 0.25, 0,
       "text_config.logits_scaling", ""},
      {R"({"model_type": "muse_spark", "text_config": {"model_type": "muse_spark_text"}})", 0.1767766952966369, 20,
       "text_config.output_multiplier", "text_config.final_logit_softcapping"},
  };
  for (const Case& c : cases) {
    auto s = Parse(c.json);
    ASSERT_TRUE(s.ok()) << c.json << ": " << s.status();
    EXPECT_DOUBLE_EQ(s->logit_scale, c.scale) << c.json;
    EXPECT_DOUBLE_EQ(s->softcap, c.softcap) << c.json;
    EXPECT_EQ(s->logit_scale_from, c.scale_from) << c.json;
    EXPECT_EQ(s->softcap_from, c.softcap_from) << c.json;
  }
}

TEST(LmHeadConfig, BiasRequired) {
  auto s = Parse(R"({"model_type": "phimoe", "lm_head_bias": true})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->bias_required);
  auto bad = Parse(R"({"lm_head_bias": "yes"})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("lm_head_bias"), std::string::npos) << bad.status();
}

TEST(LmHeadConfig, RefusalNamesTheAttribute) {
  struct Case {
    std::string json, attribute;
  };
  const std::vector<Case> cases = {
      {R"({"model_type": "mpt", "logit_scale": "inv_sqrt_d_model"})", "logit_scale"},
      {R"({"logit_scale": 0})", "logit_scale"},
      {R"({"logits_scaling": -2})", "logits_scaling"},
      {R"({"final_logit_softcapping": 0.0})", "final_logit_softcapping"},
      {R"({"final_logit_softcapping": "30"})", "final_logit_softcapping"},
      {R"({"lm_head_multiplier": [1, 2]})", "lm_head_multiplier"},
      {R"({"output_multiplier": true})", "output_multiplier"},
      {R"({"logits_mup_width_multiplier": 2.0})", "logits_mup_width_multiplier"},
      {R"({"final_logits_bias": 1})", "final_logits_bias"},
      {R"({"my_lm_head_scale": 2})", "my_lm_head_scale"},
      {R"({"text_config": {"logit_temperature": 2}})", "text_config.logit_temperature"},
      {R"({"text_config": {}, "output_logit_bias": 1})", "output_logit_bias"},
      {R"({"final_logit_softcapping": 30, "logits_soft_cap": 20})", "logits_soft_cap"},
      {R"({"text_config": {}, "decoder": {}})", "text_config"},
  };
  for (const Case& c : cases) {
    auto s = Parse(c.json);
    ASSERT_FALSE(s.ok()) << c.json;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_NE(s.status().message().find(c.attribute), std::string::npos) << c.json << ": " << s.status();
    EXPECT_NE(s.status().message().find("config.json"), std::string::npos) << s.status();
  }
  EXPECT_FALSE(Parse("[1, 2]").ok());
  EXPECT_FALSE(Parse("{").ok());
}

// Transform scalars have documented ranges (common/lm_head_transform.h):
// a head whose scalars alone overflow float32 is refused wherever it comes
// from (config.json here; flags, updates and workers share the rule).
TEST(LmHeadConfig, ScalarsOutsideTheirRangesAreRefused) {
  EXPECT_TRUE(CheckLmHeadScalars(0.0625, 30).ok());
  EXPECT_TRUE(CheckLmHeadScalars(kMaxLogitScale, 0).ok());
  EXPECT_TRUE(CheckLmHeadScalars(kMinLogitScale, kMaxLogitScale).ok());
  for (const double bad : {1e308, 1e7, 1e-7, 0.0, -1.0, std::nan(""), HUGE_VAL})
    EXPECT_EQ(CheckLmHeadScalars(bad, 0).code(), absl::StatusCode::kInvalidArgument) << bad;
  for (const double bad : {1e308, 1e7, 1e-9, -1.0, std::nan("")})
    EXPECT_EQ(CheckLmHeadScalars(1, bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  const auto huge = Parse(R"({"logit_scale": 1e308})");
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("config.json: logit_scale 1e+308: must be in [1e-06, 1e+06]"),
            std::string::npos)
      << huge.status();
  const auto cap = Parse(R"({"final_logit_softcapping": 1e300})");
  EXPECT_EQ(cap.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(cap.status().message().find("final_logit_softcapping"), std::string::npos) << cap.status();
}

TEST(LmHeadConfig, KnownNonHeadKeysAreIgnored) {
  auto s = Parse(R"({"attn_logit_softcapping": 50, "output_router_logits": false, "num_logits_to_keep": 1,
                     "moe_router_logit_softcapping": 30, "tie_word_embeddings": true})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->logit_scale, 1.0);
  EXPECT_EQ(s->softcap, 0.0);
}

// softcap(scale * (x + b)) in float64 against the float32 application.
TEST(LmHeadTransformApply, MatchesFloat64) {
  const int64_t M = 7, N = 301;
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 40.0f);
  std::vector<float> x(M * N), bias(N);
  for (float& v : x) v = dist(rng);
  for (float& v : bias) v = dist(rng) / 8;
  for (const LmHeadTransform t :
       {LmHeadTransform{true, 1.0, 0.0}, LmHeadTransform{false, 0.125, 0.0}, LmHeadTransform{false, 1.0, 30.0},
        LmHeadTransform{true, 0.0625, 30.0}, LmHeadTransform{true, 3.0, 5.0}, LmHeadTransform{}}) {
    std::vector<float> y = x, v = x;
    ApplyLmHeadTransform(t, t.has_bias ? bias.data() : nullptr, M, N, y.data());
    kernels::ApplyLmHeadTransformSimd(t, t.has_bias ? bias.data() : nullptr, M, N, v.data());
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double z = (static_cast<double>(x[m * N + n]) + (t.has_bias ? bias[n] : 0.0)) * t.logit_scale;
        if (t.softcap > 0) z = t.softcap * std::tanh(z / t.softcap);
        ASSERT_NEAR(y[m * N + n], z, 2e-6 + 2e-6 * std::abs(z)) << t.ToString() << " at " << m << ", " << n;
        ASSERT_NEAR(v[m * N + n], z, 2e-6 + 2e-6 * std::abs(z)) << "SIMD " << t.ToString() << " at " << m << ", " << n;
        // Without a softcap the two are the same float operations.
        if (t.softcap == 0) {
          ASSERT_EQ(v[m * N + n], y[m * N + n]) << t.ToString() << " at " << m << ", " << n;
        }
      }
  }
}

// One element's value does not depend on its row or on the others.
TEST(LmHeadTransformApply, ElementWise) {
  const LmHeadTransform t{true, 0.5, 30.0};
  const int64_t N = 64;
  std::vector<float> bias(N), rows(3 * N);
  for (int64_t n = 0; n < N; ++n) bias[n] = 0.1f * n;
  for (int64_t i = 0; i < 3 * N; ++i) rows[i] = 0.37f * (i % N) - 5;
  std::vector<float> one(rows.begin(), rows.begin() + N);
  ApplyLmHeadTransform(t, bias.data(), 3, N, rows.data());
  ApplyLmHeadTransform(t, bias.data(), 1, N, one.data());
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t n = 0; n < N; ++n) ASSERT_EQ(rows[r * N + n], one[n]);
}

// The SIMD application: an element's bits depend only on its value, bias
// and the scalars, not on its row, M, or where it falls in a vector (the
// ragged end of a row included): the same values at every offset and
// row width give the same bits.
TEST(LmHeadTransformApply, SimdElementsDoNotDependOnPositionOrM) {
  const LmHeadTransform t{true, 0.5, 30.0};
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 50.0f);
  std::vector<float> values(37), biases(37);
  for (float& v : values) v = dist(rng);
  for (float& b : biases) b = dist(rng) / 10;
  // The reference bits: each (value, bias) alone, as a 1 x 1 tile.
  std::vector<float> alone(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    float x = values[i];
    kernels::ApplyLmHeadTransformSimd(t, &biases[i], 1, 1, &x);
    alone[i] = x;
  }
  for (int64_t N : {1, 7, 16, 37, 61}) {
    for (int64_t M : {1, 3}) {
      // Column n holds pair n % 37 in every row (the bias is per column).
      std::vector<float> tile(M * N), bias(N);
      for (int64_t n = 0; n < N; ++n) bias[n] = biases[n % 37];
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) tile[m * N + n] = values[n % 37];
      kernels::ApplyLmHeadTransformSimd(t, bias.data(), M, N, tile.data());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) ASSERT_EQ(tile[m * N + n], alone[n % 37]) << N << " x " << M << " at " << n;
    }
  }
}

}  // namespace
}  // namespace logprob
