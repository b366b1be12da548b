#include "tests/test_support.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "client/health_check.h"
#include "common/channel.h"
#include "common/dtype.h"
#include "common/exclusive_port.h"

extern char** environ;

namespace logprob::testing {

std::string GoldenDir() { return LOGPROB_GOLDEN_DIR; }

std::string PoolSecretFile() {
  static const std::string path = [] {
    const std::string p = ::testing::TempDir() + "/pool_secret." + std::to_string(getpid());
    const int fd = open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    const std::string secret = "test-pool-secret-" + std::to_string(getpid()) + "-0123456789abcdef\n";
    if (fd < 0 || write(fd, secret.data(), secret.size()) != static_cast<ssize_t>(secret.size()))
      ADD_FAILURE() << "cannot write " << p;
    if (fd >= 0) close(fd);
    return p;
  }();
  return path;
}

std::vector<int> ListeningPorts(const std::vector<pid_t>& pids) {
  std::set<std::string> inodes;
  for (const pid_t pid : pids) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
      std::error_code lec;
      const std::string target = std::filesystem::read_symlink(entry.path(), lec).string();
      if (!lec && target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
    }
  }
  std::set<int> ports;
  for (const auto& [inode, port] : ListeningTcpSockets())
    if (inodes.count(inode)) ports.insert(port);
  return {ports.begin(), ports.end()};
}
std::string BinDir() { return LOGPROB_BIN_DIR; }

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

std::unique_ptr<ServerProcess> ServerProcess::Start(int workers, const std::vector<std::string>& extra) {
  return Start(workers, extra, [](const std::string& address) { return client::MakeChannel(address); });
}

pid_t SpawnProcess(const std::vector<std::string>& args, const std::string& stderr_path) {
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!stderr_path.empty())
    posix_spawn_file_actions_addopen(&actions, 2, stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    ADD_FAILURE() << "cannot spawn " << argv[0];
    return -1;
  }
  return pid;
}

std::unique_ptr<ServerProcess> ServerProcess::Launch(const std::vector<std::string>& args,
                                                     const std::string& stderr_path) {
  auto p = std::unique_ptr<ServerProcess>(new ServerProcess);
  p->address_ = "127.0.0.1:" + std::to_string(FreePort());
  std::vector<std::string> all = {BinDir() + "/logprob-server", "--listen", p->address_};
  all.insert(all.end(), args.begin(), args.end());
  p->pid_ = SpawnProcess(all, stderr_path);
  if (p->pid_ < 0) return nullptr;
  return p;
}

std::unique_ptr<ServerProcess> ServerProcess::Start(int workers, const std::vector<std::string>& extra,
                                                    const ChannelFactory& wait_channel,
                                                    const std::string& stderr_path) {
  std::vector<std::string> args = {"--workers", std::to_string(workers), "--backend", "cpu"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto p = Launch(args, stderr_path);
  if (!p) return nullptr;
  const auto st = client::WaitForServing(wait_channel(p->address_), std::chrono::seconds(60));
  if (!st.ok()) {
    ADD_FAILURE() << "server with " << workers << " workers did not become SERVING: " << st;
    return nullptr;
  }
  return p;
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGTERM);
    waitpid(pid_, nullptr, 0);
  }
}

bool ServerProcess::Alive() const { return pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0; }

std::vector<pid_t> ServerProcess::WorkerPids() const {
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    // Fields after the parenthesised command: state, ppid, ...
    std::istringstream rest(line.substr(line.rfind(')') + 1));
    std::string state;
    pid_t ppid = 0;
    if (rest >> state >> ppid && ppid == pid_ && state != "Z") out.push_back(std::stoi(name));
  }
  return out;
}

int ServerProcess::SignalAndWait(int sig) {
  if (pid_ <= 0) return -1;
  kill(pid_, sig);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

v1::ScoreRequest RandomHiddenRequest(int64_t T, int64_t H, int64_t V, uint32_t seed) {
  return RandomPackedRequest("hidden_states", T, H, V, seed);
}

v1::ScoreRequest RandomPackedRequest(const std::string& input, int64_t T, int64_t width, int64_t V, uint32_t seed) {
  const int64_t H = width;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> h(T * H);
  for (auto& x : h) x = FloatToBf16(normal(rng));
  std::vector<int64_t> ids(T);
  for (auto& id : ids) id = static_cast<int64_t>(rng() % V);
  const int64_t cu[2] = {0, T};
  v1::ScoreRequest req;
  auto add = [&](const char* name, DType dtype, std::vector<int64_t> shape, const void* data, size_t bytes) {
    v1::Tensor* t = req.add_inputs();
    t->set_name(name);
    t->set_dtype(dtype);
    for (int64_t d : shape) t->add_shape(d);
    t->set_data(data, bytes);
  };
  add(input.c_str(), v1::BF16, {T, H}, h.data(), h.size() * 2);
  add("input_ids", v1::I64, {T}, ids.data(), ids.size() * 8);
  add("cu_seqlens", v1::I64, {2}, cu, sizeof cu);
  req.mutable_options()->set_entropy(true);
  return req;
}

absl::Status WriteRandomLmHead(const std::string& path, int64_t V, int64_t H, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 0.05f);
  std::vector<uint16_t> w(V * H);
  for (auto& x : w) x = FloatToBf16(normal(rng));
  v1::Tensor t;
  t.set_name("lm_head.weight");
  t.set_dtype(v1::BF16);
  t.add_shape(V);
  t.add_shape(H);
  t.set_data(w.data(), w.size() * 2);
  return WriteSafetensors(path, {t});
}

HiddenWorkload::HiddenWorkload(const std::string& tag, int64_t v, int64_t h, uint32_t seed, int64_t slow_tokens,
                               int64_t quick_tokens)
    : lm_head(::testing::TempDir() + "/" + tag + "_lm_head." + std::to_string(getpid()) + ".safetensors"),
      slow(RandomHiddenRequest(slow_tokens, h, v, seed + 1)),
      quick(RandomHiddenRequest(quick_tokens, h, v, seed + 2)) {
  const absl::Status st = WriteRandomLmHead(lm_head, v, h, seed);
  EXPECT_TRUE(st.ok()) << st;
}

HiddenWorkload::~HiddenWorkload() { std::filesystem::remove(lm_head); }

int64_t PeakRssBytes(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  while (status >> key) {
    if (key == "VmHWM:") {
      int64_t kib = -1;
      status >> kib;
      return kib * 1024;
    }
    status.ignore(1 << 20, '\n');
  }
  return -1;
}

CommandResult RunCommand(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

CommandResult ScrapeMetrics(int port) {
  return RunCommand("curl -sS --max-time 10 http://127.0.0.1:" + std::to_string(port) + "/metrics");
}

double MetricSample(const std::string& scrape, const std::string& series) {
  std::istringstream in(scrape);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::strtod(line.c_str() + series.size() + 1, nullptr);
  }
  return -1;
}

::testing::AssertionResult WaitUntil(const std::string& what, const std::function<bool()>& condition,
                                     std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (condition()) return ::testing::AssertionSuccess();
    if (std::chrono::steady_clock::now() >= end)
      return ::testing::AssertionFailure()
             << "timed out after " << timeout.count() / 1000.0 << " s waiting for " << what;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // poll interval, not a synchronisation
  }
}

::testing::AssertionResult WaitForMetric(int port, const std::string& series, double value,
                                         std::chrono::milliseconds timeout) {
  double last = -1;
  auto r = WaitUntil(
      series + " == " + std::to_string(value) + " on /metrics of port " + std::to_string(port),
      [&] {
        const CommandResult scrape = ScrapeMetrics(port);
        last = scrape.code == 0 ? MetricSample(scrape.output, series) : -1;
        return last == value;
      },
      timeout);
  if (!r) r << " (last value seen: " << last << ")";
  return r;
}

std::unique_ptr<v1::LogprobService::Stub> ServerProcess::NewStub() const {
  return v1::LogprobService::NewStub(client::MakeChannel(address_));
}

grpc::Status ScoreGolden(v1::LogprobService::Stub& stub, const GoldenCase& c, v1::ScoreResponse* resp) {
  grpc::ClientContext ctx;
  return stub.Score(&ctx, GoldenRequest(c), resp);
}

v1::ServerInfo Info(v1::LogprobService::Stub& stub) {
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  EXPECT_TRUE(stub.GetServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
  return info;
}

GoldenCase LoadGolden(const std::string& name) {
  GoldenCase c;
  c.name = name;
  auto in = ReadSafetensors(GoldenDir() + "/" + name + ".safetensors");
  auto ex = ReadSafetensors(GoldenDir() + "/" + name + ".expected.safetensors");
  EXPECT_TRUE(in.ok()) << in.status();
  EXPECT_TRUE(ex.ok()) << ex.status();
  if (!in.ok() || !ex.ok()) return c;
  c.inputs = *in;
  c.expected = *ex;
  const auto& m = c.inputs.metadata;
  auto get = [&](const char* k) -> std::string {
    auto it = m.find(k);
    return it == m.end() ? "" : it->second;
  };
  if (get("alignment") == "same_position") c.options.set_alignment(v1::SAME_POSITION);
  if (!get("temperature").empty()) c.options.set_temperature(std::stof(get("temperature")));
  if (!get("sampling_top_k").empty()) c.options.set_sampling_top_k(std::stoi(get("sampling_top_k")));
  if (!get("sampling_top_p").empty()) c.options.set_sampling_top_p(std::stof(get("sampling_top_p")));
  if (!get("topk").empty()) c.options.set_topk(std::stoi(get("topk")));
  c.options.set_entropy(c.expected.Find("entropy") != nullptr);
  c.options.set_log_sum_sq_probs(c.expected.Find("log_sum_sq_probs") != nullptr);
  c.options.set_mean_logits(c.expected.Find("mean_logits") != nullptr);
  c.options.set_is_top1(c.expected.Find("is_top1") != nullptr);
  return c;
}

std::vector<std::string> LogitsGoldenNames() {
  return {"basic_f32", "llama_vocab_bf16", "odd_vocab_f16", "sampling_f32", "packed_bf16", "top1_ties_bf16"};
}

std::vector<std::string> TransformGoldenNames() { return {"hidden_softcap_bias_bf16", "hidden_scale_bias_bf16"}; }

std::string GoldenLmHead(const GoldenCase& c) {
  auto it = c.inputs.metadata.find("lm_head");
  return it == c.inputs.metadata.end() ? "" : GoldenDir() + "/" + it->second;
}

void ExpectTransformGoldensMatch(const std::vector<std::string>& extra) {
  for (const std::string& name : TransformGoldenNames()) {
    const GoldenCase c = LoadGolden(name);
    ASSERT_FALSE(GoldenLmHead(c).empty()) << name;
    for (int workers : {1, 2}) {
      SCOPED_TRACE(name + ", " + std::to_string(workers) + " workers");
      std::vector<std::string> flags = extra;
      flags.insert(flags.end(), {"--parallelism", "vocab", "--lm-head", GoldenLmHead(c)});
      auto server = ServerProcess::Start(workers, flags);
      ASSERT_TRUE(server);
      auto stub = server->NewStub();
      v1::ScoreResponse resp;
      const grpc::Status st = ScoreGolden(*stub, c, &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
      EXPECT_EQ(CompareOutputs(c.expected.tensors, {resp.outputs().begin(), resp.outputs().end()}), "");
    }
  }
}

std::string CliOptionFlags(const GoldenCase& c) {
  std::string f;
  const auto& o = c.options;
  if (o.alignment() == v1::SAME_POSITION) f += " --alignment same_position";
  if (o.entropy()) f += " --entropy";
  if (o.log_sum_sq_probs()) f += " --log-sum-sq-probs";
  if (o.mean_logits()) f += " --mean-logits";
  if (o.is_top1()) f += " --is-top1";
  if (o.topk()) f += " --topk " + std::to_string(o.topk());
  if (o.has_temperature()) f += " --temperature " + std::to_string(o.temperature());
  if (o.sampling_top_k()) f += " --sampling-top-k " + std::to_string(o.sampling_top_k());
  if (o.has_sampling_top_p()) f += " --sampling-top-p " + std::to_string(o.sampling_top_p());
  return f;
}

v1::ScoreRequest GoldenRequest(const GoldenCase& c) {
  v1::ScoreRequest req;
  req.set_id(c.name);
  for (const auto& t : c.inputs.tensors) *req.add_inputs() = t;
  *req.mutable_options() = c.options;
  return req;
}

std::vector<float> Floats(const v1::Tensor& t) {
  std::vector<float> v(t.data().size() / 4);
  std::memcpy(v.data(), t.data().data(), v.size() * 4);
  return v;
}

const v1::Tensor* FindOutput(const v1::ScoreResponse& r, const std::string& name) {
  for (const auto& t : r.outputs())
    if (t.name() == name) return &t;
  return nullptr;
}

std::string CompareOutputs(const std::vector<v1::Tensor>& expected, const std::vector<v1::Tensor>& got) {
  std::ostringstream err;
  for (const auto& e : expected) {
    const v1::Tensor* g = nullptr;
    for (const auto& t : got)
      if (t.name() == e.name()) g = &t;
    if (!g) {
      err << "missing output " << e.name() << "\n";
      continue;
    }
    if (std::vector<int64_t>(e.shape().begin(), e.shape().end()) !=
            std::vector<int64_t>(g->shape().begin(), g->shape().end()) ||
        e.dtype() != g->dtype()) {
      err << e.name() << ": shape or dtype differs\n";
      continue;
    }
    int bad = 0;
    if (IsIntDType(e.dtype())) {  // ids (I64), is_top1 (I32): exact
      const size_t w = DTypeSize(e.dtype()), n = e.data().size() / w;
      for (size_t i = 0; i < n && bad < 5; ++i) {
        const int64_t a = ReadInt(e.dtype(), e.data().data(), i), b = ReadInt(g->dtype(), g->data().data(), i);
        if (a != b) err << e.name() << "[" << i << "]: expected " << a << " got " << b << "\n", ++bad;
      }
    } else {
      const auto ev = Floats(e), gv = Floats(*g);
      for (size_t i = 0; i < ev.size() && bad < 5; ++i) {
        const double x = ev[i], y = gv[i];
        const bool ok = std::isinf(x) ? x == y : std::abs(x - y) <= 2e-4 + 2e-5 * std::abs(x);
        if (!ok) err << e.name() << "[" << i << "]: expected " << x << " got " << y << "\n", ++bad;
      }
    }
  }
  return err.str();
}

}  // namespace logprob::testing
