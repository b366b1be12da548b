#include "server/input_source.h"

#include <cstring>
#include <utility>

namespace logprob {
namespace {

class InMemory final : public InputSource {
 public:
  InMemory(std::string_view data, std::shared_ptr<const void> owner)
      : InputSource(InputKind::kBytes, static_cast<int64_t>(data.size())), data_(data), owner_(std::move(owner)) {}
  std::optional<std::string_view> memory() const override { return data_; }
  bool Read(int64_t offset, size_t n, char* dst) const override {
    std::memcpy(dst, data_.data() + offset, n);
    return true;
  }

 private:
  const std::string_view data_;
  const std::shared_ptr<const void> owner_;
};

}  // namespace

std::shared_ptr<const InputSource> MemorySource(std::string_view data, std::shared_ptr<const void> owner) {
  return std::make_shared<InMemory>(data, std::move(owner));
}

}  // namespace logprob
