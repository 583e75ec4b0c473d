// The device plugin against hostile peers (issue 24 items 3 and 8, and the
// pool and CDI lifecycle): a kubelet that listens and never answers, local
// peers that are not the kubelet, a flood of ListAndWatch streams, a pool
// dropped and added again while the watcher still holds the old one, and
// CDI specs a crashed run left.
#include "sriovd/k8s/device_plugin.hpp"

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "deviceplugin_v1beta1.grpc.pb.h"
#include "sriovd/util/fd.hpp"
#include "support/process.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::k8s {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr const char* kResource = "sriovd.test/pool";

Pool pool() { return {kResource, {{"0000:3b:02.0", true, 0, "0000:3b:00.0", 40, ""}}}; }

// A "kubelet" that accepts connections on kubelet.sock and never answers
// (no gRPC at all): a Register waits for its deadline unless cancelled.
class SilentKubelet {
 public:
  explicit SilentKubelet(const std::string& dir) : path_(dir + "/kubelet.sock") {
    fd_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path_.c_str(), sizeof a.sun_path - 1);
    EXPECT_EQ(::bind(fd_.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(fd_.get(), 64), 0);
    thread_ = std::thread([this] { run(); });
  }
  ~SilentKubelet() {
    stop_ = true;
    thread_.join();
  }
  int accepted() const { return accepted_.load(); }
  int closed() const { return closed_.load(); }

 private:
  void run() {
    std::vector<UniqueFd> conns;
    while (!stop_) {
      std::vector<pollfd> p{{fd_.get(), POLLIN, 0}};
      for (auto& c : conns) p.push_back({c.get(), POLLIN, 0});
      if (::poll(p.data(), p.size(), 20) <= 0) continue;
      if (p[0].revents & POLLIN) {
        conns.emplace_back(::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
        ++accepted_;
      }
      for (size_t i = 1; i < p.size(); ++i) {
        if (!(p[i].revents & (POLLIN | POLLHUP))) continue;
        char buf[4096];
        if (::read(conns[i - 1].get(), buf, sizeof buf) <= 0) {
          ++closed_;
          conns[i - 1].reset();
        }
      }
      std::erase_if(conns, [](const UniqueFd& c) { return !c.valid(); });
    }
  }
  std::string path_;
  UniqueFd fd_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0}, closed_{0};
};

template <typename F>
std::chrono::milliseconds timed(F fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
}

// Item 3: the kubelet's socket appears (a kubelet start), and the kubelet
// listens but never answers. Registration retried 30 x 3 s, and the
// daemon's exit (on its control thread) waited for all of it.
TEST(NodeAgentHostile, AKubeletThatNeverAnswersHoldsUpNoStop) {
  test::TempDir dir;
  auto agent = std::make_unique<NodeAgent>(dir.file("plugins"), dir.file("cdi"));
  agent->update({pool()});
  SilentKubelet kubelet(dir.file("plugins"));  // made after: the watcher sees a kubelet start
  ASSERT_TRUE(test::wait_until([&] { return kubelet.accepted() >= 1; }, 5s)) << "no registration was tried";
  const auto took = timed([&] { agent.reset(); });
  EXPECT_LT(took, 1500ms) << "the stop waited for the kubelet";
}

// Item 3 again: a reload drops the pool being registered (its call is
// cancelled and not retried), and the stop after it has nothing to wait for.
TEST(NodeAgentHostile, DroppingAPoolCancelsItsRegistration) {
  test::TempDir dir;
  auto agent = std::make_unique<NodeAgent>(dir.file("plugins"), dir.file("cdi"));
  agent->update({pool()});
  SilentKubelet kubelet(dir.file("plugins"));
  ASSERT_TRUE(test::wait_until([&] { return kubelet.accepted() >= 1; }, 5s));
  EXPECT_LT(timed([&] { agent->update({}); }), 1000ms);
  EXPECT_LT(timed([&] { agent.reset(); }), 1000ms) << "the watcher was still registering a pool that is gone";
}

// "Also seen": a pool dropped and added again while the watcher still
// holds the old server. The old one's late end removed the new one's
// socket and CDI spec.
TEST(NodeAgentHostile, APoolAddedAgainKeepsItsFilesWhenTheOldServerGoes) {
  test::TempDir dir;
  fs::create_directories(dir.file("plugins"));
  SilentKubelet kubelet(dir.file("plugins"));  // there first: one Register per kick
  NodeAgent agent(dir.file("plugins"), dir.file("cdi"));
  agent.update({pool()});
  ASSERT_TRUE(test::wait_until([&] { return kubelet.accepted() >= 1; }, 5s));
  agent.update({});
  agent.update({pool()});
  const std::string socket = dir.file("plugins") + "/sriovd-sriovd.test_pool.sock";
  const std::string spec = dir.file("cdi") + "/sriovd-sriovd.test_pool.json";
  ASSERT_TRUE(fs::exists(socket));
  ASSERT_TRUE(fs::exists(spec));
  // The old server's registration had a 3 s deadline: past it, the watcher
  // has let go of the old server whether or not the drop cancelled the
  // call. (A wait for something that must not happen: it has no condition.)
  std::this_thread::sleep_for(3500ms);
  EXPECT_TRUE(fs::exists(socket)) << "the old server removed the new one's socket";
  EXPECT_TRUE(fs::exists(spec)) << "the old server removed the new one's CDI spec";
}

TEST(NodeAgentHostile, CdiSpecsOfAPreviousRunAreRemovedAtStart) {
  test::TempDir dir;
  fs::create_directories(dir.file("cdi"));
  const std::string stale = dir.file("cdi") + "/sriovd-vendor.example_gone.json";
  const std::string other = dir.file("cdi") + "/nvidia.json";
  std::ofstream(stale) << "{\"kind\": \"vendor.example/gone\"}";
  std::ofstream(other) << "{}";
  NodeAgent agent(dir.file("plugins"), dir.file("cdi"));
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(other)) << "another tool's spec was removed";
}

std::unique_ptr<v1beta1::DevicePlugin::Stub> plugin(const std::string& socket) {
  return v1beta1::DevicePlugin::NewStub(grpc::CreateChannel("unix://" + socket, grpc::InsecureChannelCredentials()));
}

size_t threads_now() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Item 8: only root (the kubelet) or the daemon's uid is served; another
// local user is closed at accept, even on a socket it may connect to.
TEST(NodeAgentHostile, APeerThatIsNotTheKubeletIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: the refused peer is another uid";
  test::TempDir dir;
  NodeAgent agent(dir.file("plugins"), dir.file("cdi"));
  agent.update({pool()});
  const std::string socket = dir.file("plugins") + "/sriovd-sriovd.test_pool.sock";
  ASSERT_TRUE(test::wait_until([&] { return fs::exists(socket); }, 2s));
  struct stat st {};
  ASSERT_EQ(::stat(socket.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600U);
  // Let the kernel admit anyone, so that the daemon's own check is what is tested.
  ASSERT_EQ(::chmod(socket.c_str(), 0666), 0);
  ::chmod(dir.path().c_str(), 0755);
  ::chmod(dir.file("plugins").c_str(), 0755);
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(2);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, socket.c_str(), sizeof a.sun_path - 1);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) ::_exit(3);
    // The HTTP/2 preface; a served peer would get the server's SETTINGS.
    static const char preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    // (MSG_NOSIGNAL: the daemon may have closed it already.)
    (void)::send(fd, preface, sizeof preface - 1, MSG_NOSIGNAL);
    char buf[64];
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 3000) != 1) ::_exit(4);           // neither closed nor answered
    ::_exit(::read(fd, buf, sizeof buf) <= 0 ? 0 : 5);  // closed (or reset) without a byte
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(agent.status()[0].value("refused_peers", 0), 1) << agent.status().dump();
  // Root is served.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  v1beta1::DevicePluginOptions options;
  EXPECT_TRUE(plugin(socket)->GetDevicePluginOptions(&ctx, v1beta1::Empty(), &options).ok());
}

// Item 8: a thread per ListAndWatch stream, 1000 streams, 1000 threads.
// Now a few streams are served and the rest refused at once.
TEST(NodeAgentHostile, ListAndWatchStreamsAreCapped) {
  test::TempDir dir;
  NodeAgent agent(dir.file("plugins"), dir.file("cdi"));
  agent.update({pool()});
  const std::string socket = dir.file("plugins") + "/sriovd-sriovd.test_pool.sock";
  ASSERT_TRUE(test::wait_until([&] { return fs::exists(socket); }, 2s));
  const size_t before = threads_now();
  auto stub = plugin(socket);
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1beta1::ListAndWatchResponse>>> streams;
  int listed = 0, refused = 0;
  for (int i = 0; i < 64; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() + 10s);
    streams.push_back(stub->ListAndWatch(contexts.back().get(), v1beta1::Empty()));
    v1beta1::ListAndWatchResponse r;
    if (streams.back()->Read(&r)) {
      ++listed;
    } else {
      const grpc::Status st = streams.back()->Finish();
      if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) ++refused;
    }
  }
  EXPECT_GE(listed, 1);
  EXPECT_LE(listed, 4);
  EXPECT_EQ(listed + refused, 64);
  EXPECT_LT(threads_now(), before + 40) << "threads grew with the streams";
  for (auto& c : contexts) c->TryCancel();
}

}  // namespace
}  // namespace sriovd::k8s
