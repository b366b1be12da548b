#include "server/heads/lm_heads.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/error_reason.h"
#include "common/untrusted_text.h"
#include "server/heads/lm_head_declared.h"

namespace logprob {
namespace {

bool AllOf(const std::string& s, const char* extra) {
  return std::all_of(s.begin(), s.end(), [extra](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           std::string_view(extra).find(c) != std::string_view::npos;
  });
}

}  // namespace

internal::v1::LmHeadRef LmHeadVersion::Ref() const {
  internal::v1::LmHeadRef ref;
  ref.set_name(head);
  ref.set_version(version);
  ref.set_serial(serial);
  return ref;
}

std::shared_future<std::string> KnownSha256(std::string hex) {
  std::promise<std::string> known;
  known.set_value(std::move(hex));
  return known.get_future().share();
}

std::string LmHeadVersion::Sha256IfKnown() const {
  if (!sha256.valid() || sha256.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return "";
  return sha256.get();
}

internal::v1::LmHeadLoad LmHeadVersion::Load() const {
  internal::v1::LmHeadLoad load;
  *load.mutable_head() = Ref();
  auto* s = load.mutable_source();
  s->set_file(source.file);
  s->set_tensor(source.tensor);
  s->set_dtype(source.dtype);
  s->set_vocab_size(source.vocab_size);
  s->set_hidden_size(source.hidden_size);
  s->set_data_offset(source.data_offset);
  s->set_immutable(origin == kUpdateOrigin);
  s->set_logit_scale(source.transform.logit_scale);
  s->set_final_logit_softcapping(source.transform.softcap);
  if (source.transform.has_bias) {
    s->set_bias_file(source.bias.file);
    s->set_bias_tensor(source.bias.tensor);
    s->set_bias_dtype(source.bias.dtype);
    s->set_bias_offset(source.bias.data_offset);
  }
  return load;
}

absl::Status CheckLmHeadName(const std::string& name, const std::string& field) {
  if (name.empty() || name.size() > 64 || !AllOf(name, "._-"))
    return absl::InvalidArgumentError(
        absl::StrCat(field, " \"", Printable(name, 64), "\": an lm_head name is 1..64 characters of [A-Za-z0-9._-]"));
  return absl::OkStatus();
}

absl::Status CheckLmHeadVersionName(const std::string& version, const std::string& field) {
  if (version.empty() || version.size() > 128 || !AllOf(version, "._:+-"))
    return absl::InvalidArgumentError(absl::StrCat(field, " \"", Printable(version, 128),
                                                   "\": an lm_head version is 1..128 characters of [A-Za-z0-9._:+-]"));
  return absl::OkStatus();
}

std::shared_ptr<const LmHeadVersion> LmHeads::Share(LmHeadVersion v) {
  auto on_release = options_.on_release;
  return std::shared_ptr<const LmHeadVersion>(new LmHeadVersion(std::move(v)), [on_release](const LmHeadVersion* p) {
    if (on_release) on_release(*p);
    delete p;
  });
}

absl::Status LmHeads::Add(LmHeadVersion first) {
  if (first.serial == 0) first.serial = NewSerial();
  auto shared = Share(std::move(first));
  absl::MutexLock lock(&mu_);
  if (heads_.count(shared->head))
    return absl::AlreadyExistsError(absl::StrCat("--lm-head: a second head named \"", shared->head, "\""));
  alive_.push_back(shared);
  Head& head = heads_[shared->head];
  head.names[shared->version] = shared->sha256;
  head.retained.push_front(std::move(shared));
  return absl::OkStatus();
}

absl::Status LmHeads::Declare(LmHeadVersion placeholder) {
  auto shared = std::make_shared<const LmHeadVersion>(std::move(placeholder));
  absl::MutexLock lock(&mu_);
  if (heads_.count(shared->head))
    return absl::AlreadyExistsError(absl::StrCat("a second head named \"", shared->head, "\""));
  heads_[shared->head].retained.push_front(std::move(shared));  // no version name taken, nothing alive
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const LmHeadVersion>> LmHeads::Current(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<const Head*> head = Named(name);
  if (!head.ok()) return head.status();
  return (*head)->retained.front();
}

uint64_t LmHeads::NewSerial() {
  absl::MutexLock lock(&mu_);
  return next_serial_++;
}

std::optional<std::shared_future<std::string>> LmHeads::Taken(const std::string& name,
                                                              const std::string& version) const {
  absl::MutexLock lock(&mu_);
  auto it = heads_.find(name);
  if (it == heads_.end()) return std::nullopt;
  auto n = it->second.names.find(version);
  if (n == it->second.names.end()) return std::nullopt;
  return n->second;
}

bool LmHeads::empty() const {
  absl::MutexLock lock(&mu_);
  return heads_.empty();
}

absl::StatusOr<const LmHeads::Head*> LmHeads::Named(const std::string& name) const {
  if (name.empty() && heads_.size() == 1) return &heads_.begin()->second;
  const std::string& want = name.empty() ? std::string(kDefaultLmHead) : name;
  if (auto it = heads_.find(want); it != heads_.end()) return &it->second;
  std::vector<std::string> names;
  for (const auto& [n, h] : heads_) names.push_back(n);
  return WithReason(
      absl::NotFoundError(
          absl::StrCat(name.empty() ? "the request names no lm_head (field head) and the server has no head \"default\""
                                    : absl::StrCat("head \"", name, "\": the server holds no such lm_head"),
                       names.empty() ? "; it was started without --lm-head"
                                     : absl::StrCat("; it holds: ", absl::StrJoin(names, ", ")))),
      names.empty() ? v1::NO_LM_HEAD : v1::ERROR_REASON_UNSPECIFIED);
}

absl::StatusOr<std::shared_ptr<const LmHeadVersion>> LmHeads::Bind(const std::string& name,
                                                                   const std::string& pinned) const {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<const Head*> head = Named(name);
  if (!head.ok()) return head.status();
  const auto& retained = (*head)->retained;
  if (IsDeclaredPlaceholder(*retained.front()))
    return WithReason(absl::FailedPreconditionError(absl::StrCat(
                          "lm_head \"", retained.front()->head,
                          "\" was declared by shape (--lm-head-declare) and has no weights yet: an lm_head update "
                          "(update_lm_head) fills it")),
                      v1::LM_HEAD_VERSION_UNAVAILABLE);
  if (pinned.empty()) return retained.front();
  for (const auto& v : retained)
    if (v->version == pinned) return v;
  std::vector<std::string> held;
  for (const auto& v : retained) held.push_back(v->version);
  return WithReason(
      absl::FailedPreconditionError(absl::StrCat("head_version \"", pinned, "\": lm_head \"", retained.front()->head,
                                                 "\" does not hold this version (it holds ", absl::StrJoin(held, ", "),
                                                 "; current: ", held.front(), ")")),
      v1::LM_HEAD_VERSION_UNAVAILABLE);
}

std::shared_ptr<const LmHeadVersion> LmHeads::Find(const std::string& name, const std::string& version) const {
  absl::MutexLock lock(&mu_);
  auto it = heads_.find(name);
  if (it == heads_.end()) return nullptr;
  for (const auto& v : it->second.retained)
    if (v->version == version && !IsDeclaredPlaceholder(*v)) return v;
  return nullptr;
}

absl::Status LmHeads::Commit(LmHeadVersion next, const std::function<bool()>& still_valid) {
  if (next.committed_unix_ms == 0)
    next.committed_unix_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
  auto shared = Share(std::move(next));
  std::vector<std::shared_ptr<const LmHeadVersion>> leaving;  // released outside the lock
  {
    absl::MutexLock lock(&mu_);
    auto it = heads_.find(shared->head);
    if (it == heads_.end())
      return absl::NotFoundError(absl::StrCat("lm_head \"", shared->head, "\": the server holds no such head"));
    if (still_valid && !still_valid())
      return absl::FailedPreconditionError(
          absl::StrCat("lm_head \"", shared->head, "\" version \"", shared->version,
                       "\": the worker pool was re-formed while the version loaded; nothing changed, update again"));
    if (it->second.names.count(shared->version))
      return absl::AlreadyExistsError(absl::StrCat("lm_head \"", shared->head, "\" version \"", shared->version,
                                                   "\": the name was taken by an earlier version of the head"));
    it->second.names[shared->version] = shared->sha256;
    auto& retained = it->second.retained;
    if (IsDeclaredPlaceholder(*retained.front())) retained.clear();  // a declared head's first version
    retained.push_front(shared);
    alive_.push_back(shared);
    while (static_cast<int>(retained.size()) > std::max(options_.retain, 1)) {
      leaving.push_back(std::move(retained.back()));
      retained.pop_back();
    }
  }
  return absl::OkStatus();
}

std::vector<internal::v1::LmHeadLoad> LmHeads::Alive() const {
  std::vector<std::shared_ptr<const LmHeadVersion>> alive;  // released outside the lock
  std::vector<internal::v1::LmHeadLoad> loads;
  absl::MutexLock lock(&mu_);
  alive_.erase(std::remove_if(alive_.begin(), alive_.end(), [](const auto& w) { return w.expired(); }), alive_.end());
  for (const auto& w : alive_)
    if (auto v = w.lock()) {
      loads.push_back(v->Load());
      alive.push_back(std::move(v));
    }
  return loads;
}

int64_t LmHeads::AliveBytesPerWorker() const {
  std::vector<std::shared_ptr<const LmHeadVersion>> alive;  // released outside the lock
  int64_t bytes = 0;
  absl::MutexLock lock(&mu_);
  for (const auto& w : alive_)
    if (auto v = w.lock()) {
      bytes += v->bytes_per_worker;
      alive.push_back(std::move(v));
    }
  return bytes;
}

v1::LmHeadInfo LmHeads::InfoOf(const std::string& name, const Head& head, const LmHeadVersion& v) const {
  v1::LmHeadInfo info;
  info.set_name(name);
  info.set_version(v.version);  // "" for a declared head not yet filled
  for (const auto& r : head.retained)
    if (!IsDeclaredPlaceholder(*r)) info.add_retained_versions(r->version);
  info.set_vocab_size(v.source.vocab_size);
  info.set_hidden_size(v.source.hidden_size);
  info.set_dtype(v.source.dtype);
  if (options_.precision_of) info.set_precision(options_.precision_of(v.source.dtype));
  info.set_sha256(v.Sha256IfKnown());
  info.set_bytes_per_worker(v.bytes_per_worker);
  info.set_source(v.origin);
  info.set_tied_embeddings(v.source.tied_embeddings);
  info.set_has_bias(v.source.transform.has_bias);
  info.set_logit_scale(v.source.transform.logit_scale);
  info.set_final_logit_softcapping(v.source.transform.softcap);
  info.set_frozen(Frozen(name));
  info.set_committed_unix_ms(v.committed_unix_ms);
  return info;
}

std::vector<v1::LmHeadInfo> LmHeads::List() const {
  std::vector<v1::LmHeadInfo> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, head] : heads_) out.push_back(InfoOf(name, head, *head.retained.front()));
  return out;
}

absl::StatusOr<v1::LmHeadInfo> LmHeads::Describe(const LmHeadVersion& v) const {
  absl::MutexLock lock(&mu_);
  auto it = heads_.find(v.head);
  if (it == heads_.end()) return absl::NotFoundError(absl::StrCat("lm_head \"", v.head, "\": no such head"));
  return InfoOf(v.head, it->second, v);
}

}  // namespace logprob
