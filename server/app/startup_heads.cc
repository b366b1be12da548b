#include "server/app/startup_heads.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <tuple>
#include <vector>

#include "common/log_line.h"
#include "common/partition.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "server/app/memory_bound.h"
#include "server/heads/lm_head_declared.h"

namespace logprob {

std::pair<std::string, std::string> SplitLmHeadArg(const std::string& arg) {
  if (const size_t eq = arg.find('='); eq != std::string::npos && !std::filesystem::exists(arg))
    return {arg.substr(0, eq), arg.substr(eq + 1)};
  return {kDefaultLmHead, arg};
}

absl::StatusOr<int64_t> LmHeadStoreBound(const ServerFlags& flags) {
  if (!flags.allow_lm_head_updates) return 0;
  const std::vector<std::string>& frozen = flags.lm_head_frozen;
  int64_t bytes = 0;
  const auto add = [&bytes, retain = std::max(1, flags.lm_head_retain)](const LmHeadSource& source) {
    bytes += LmHeadStoreBytes(source.vocab_size * source.hidden_size * static_cast<int64_t>(DTypeSize(source.dtype)),
                              retain);
  };
  for (const std::string& arg : flags.lm_heads) {
    const auto [name, path] = SplitLmHeadArg(arg);
    if (std::find(frozen.begin(), frozen.end(), name) != frozen.end()) continue;
    auto source = ResolveLmHead(path, {});
    if (!source.ok())
      return absl::InvalidArgumentError("--lm-head " + arg + ": " + std::string(source.status().message()));
    add(*source);
  }
  // Declared heads (--lm-head-declare NAME=VxH:DTYPE): their shape is the flag's.
  for (const std::string& arg : flags.lm_head_declares) {
    auto declared = ParseDeclaredLmHead(arg, 1);
    if (!declared.ok())
      return absl::InvalidArgumentError("--lm-head-declare " + arg + ": " + std::string(declared.status().message()));
    add(declared->source);
  }
  return bytes;
}

absl::StatusOr<LmHeadVersion> LoadStartupHead(const std::string& arg, const std::string& version, int workers,
                                              const LmHeadScalarFlags& scalars, LmHeadPrecision precision,
                                              bool device) {
  LmHeadVersion v;
  std::string path;
  std::tie(v.head, path) = SplitLmHeadArg(arg);
  LOGPROB_RETURN_IF_ERROR(CheckLmHeadName(v.head, "--lm-head NAME"));
  LOGPROB_ASSIGN_OR_RETURN(v.source, ResolveLmHead(path, scalars));
  v.version = version;
  v.origin = path;
  const int64_t row_bytes = v.source.hidden_size * static_cast<int64_t>(DTypeSize(v.source.dtype));
  v.bytes_per_worker = LmHeadWorkerBytes(SplitRange(v.source.vocab_size, workers, 0).second, v.source.hidden_size,
                                         v.source.dtype, precision, device);
  const auto t0 = std::chrono::steady_clock::now();
  Sha256Stream sha;
  std::string buf;
  const int64_t rows_per_read = std::max<int64_t>(1, (int64_t{16} << 20) / row_bytes);
  for (int64_t r = 0; r < v.source.vocab_size; r += rows_per_read) {
    const int64_t e = std::min(v.source.vocab_size, r + rows_per_read);
    buf.resize(static_cast<size_t>((e - r) * row_bytes));
    LOGPROB_RETURN_IF_ERROR(ReadLmHeadRows(v.source, r, e, buf.data()));
    sha.Update(buf);
  }
  v.sha256 = KnownSha256(sha.FinishHex());
  LogLine() << "logprob-server: lm_head \"" << v.head << "\" version " << v.version << ": " << v.source.tensor << " ["
            << v.source.vocab_size << ", " << v.source.hidden_size << "] " << DTypeName(v.source.dtype) << " from "
            << v.source.file
            << (v.source.tied_embeddings ? " (no lm_head.weight: tied embeddings, using the input embedding)" : "")
            << ", transform " << v.source.transform.ToString()
            << (v.source.config_file.empty() ? "" : " (" + v.source.config_file + ")") << ", sha256 "
            << v.sha256.get().substr(0, 16) << "… ("
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s)";
  return v;
}

absl::Status AddStartupHeads(const ServerFlags& flags, LmHeads& heads) {
  for (const std::string& arg : flags.lm_heads) {
    auto head = LoadStartupHead(arg, flags.lm_head_version, flags.pool_workers, flags.lm_head_scalars,
                                flags.lm_head_precision, /*device=*/flags.backend == "cuda");
    if (!head.ok())
      return absl::Status(head.status().code(), "--lm-head " + arg + ": " + std::string(head.status().message()));
    LOGPROB_RETURN_IF_ERROR(heads.Add(*std::move(head)));
  }
  for (const std::string& arg : flags.lm_head_declares) {
    auto declared = ParseDeclaredLmHead(arg, flags.pool_workers);
    if (!declared.ok()) return declared.status();
    if (!flags.allow_lm_head_updates)
      return absl::InvalidArgumentError("--lm-head-declare " + arg +
                                        ": a declared head is filled by an update; add --allow-lm-head-updates");
    if (auto st = heads.Declare(*std::move(declared)); !st.ok())
      return absl::Status(st.code(), "--lm-head-declare " + arg + ": " + std::string(st.message()));
    LogLine() << "logprob-server: lm_head declared " << arg << " (not servable until an update fills it)";
  }
  for (const std::string& name : std::set<std::string>(flags.lm_head_frozen.begin(), flags.lm_head_frozen.end()))
    if (heads.Find(name, flags.lm_head_version) == nullptr)
      return absl::InvalidArgumentError("--lm-head-frozen " + name + ": no --lm-head of that name");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StoreFolder>> MakeStoreFolder(const std::string& root_flag) {
  int stale = 0;
  std::string root = root_flag.empty() ? "/dev/shm" : root_flag;
  absl::StatusOr<std::unique_ptr<StoreFolder>> folder = StoreFolder::Make(root, &stale);
  if (!folder.ok() && root_flag.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    const std::string fallback = std::string(tmp && *tmp ? tmp : "/tmp");
    LogLine() << "logprob-server: lm_head store: cannot use /dev/shm (" << folder.status().message()
              << "); using a folder under " << fallback << " instead (on disk: updates may be slower)";
    root = fallback;
    folder = StoreFolder::Make(root, &stale);
  }
  if (!folder.ok()) return folder.status();
  if (stale > 0)
    LogLine() << "logprob-server: removed " << stale << " stale lm_head store(s) of exited front-ends under " << root;
  LogLine() << "logprob-server: lm_head store " << (*folder)->path();
  return folder;
}

}  // namespace logprob
