#include "server/inputs/input_source.h"

#include <cstring>

namespace logprob {
namespace {

class InMemory final : public InputSource {
 public:
  explicit InMemory(std::string_view data)
      : InputSource(InputKind::kBytes, static_cast<int64_t>(data.size())), data_(data) {}
  std::optional<std::string_view> memory() const override { return data_; }
  bool Read(int64_t offset, size_t n, char* dst) const override {
    std::memcpy(dst, data_.data() + offset, n);
    return true;
  }

 private:
  const std::string_view data_;
};

}  // namespace

std::shared_ptr<const InputSource> MemorySource(std::string_view data) { return std::make_shared<InMemory>(data); }

}  // namespace logprob
