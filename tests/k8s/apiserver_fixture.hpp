#pragma once
// What the API-server tests share: certificates made by openssl for each
// run, and tests/k8s/apiserver_standin.py started on them.
#include <chrono>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "sriovd/k8s/api_client.hpp"
#include "support/process.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::k8s::test_support {

using namespace std::chrono_literals;
namespace test = sriovd::test;

inline const std::string kToken = "s3cr3t-token-never-logged";

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Throws what openssl said when it fails.
inline void openssl(const std::vector<std::string>& args) {
  std::vector<std::string> argv{"/usr/bin/openssl"};
  argv.insert(argv.end(), args.begin(), args.end());
  const test::RunResult r = test::run(argv);
  if (r.exit_code != 0) throw std::runtime_error("openssl " + args[0] + ": " + r.output);
}

// A CA, a server certificate for 127.0.0.1 signed by it, a client
// certificate signed by it, and a CA of nobody's.
class Pki {
 public:
  Pki() {
    const auto d = [&](const char* f) { return dir.file(f); };
    for (const char* ca : {"ca", "other"})
      openssl({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
               d(ca) + ".key", "-out", d(ca) + ".crt", "-subj", std::string("/CN=") + ca, "-days", "2"});
    dir.write("server.ext", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n");
    dir.write("client.ext", "extendedKeyUsage=clientAuth\n");
    for (const char* who : {"server", "client"}) {
      const std::string w = who;
      openssl({"req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", d(who) + ".key",
               "-out", d(who) + ".csr", "-subj", "/CN=" + w});
      openssl({"x509", "-req", "-in", d(who) + ".csr", "-CA", d("ca.crt"), "-CAkey", d("ca.key"), "-CAcreateserial",
               "-out", d(who) + ".crt", "-days", "2", "-extfile", d(who) + ".ext"});
    }
  }
  test::TempDir dir;
};

class ApiServer {
 public:
  ApiServer(const Pki& pki, const std::vector<std::string>& extra) {
    std::vector<std::string> argv{"/usr/bin/python3",
                                  std::string(SRIOVD_SOURCE_DIR) + "/tests/k8s/apiserver_standin.py",
                                  "--cert",
                                  pki.dir.file("server.crt"),
                                  "--key",
                                  pki.dir.file("server.key"),
                                  "--port-file",
                                  dir.file("port")};
    argv.insert(argv.end(), extra.begin(), extra.end());
    process = std::make_unique<test::Process>(argv, dir.file("log"));
    EXPECT_TRUE(test::wait_until([&] { return !slurp(dir.file("port")).empty(); }, 20s)) << process->log();
    port = slurp(dir.file("port"));
  }
  test::TempDir dir;
  std::unique_ptr<test::Process> process;
  std::string port;
};

// A client of `server` with the token, trusting the test CA.
inline ApiConfig config_for(const Pki& pki, const ApiServer& s) {
  ApiConfig c;
  c.host = "127.0.0.1";
  c.port = s.port;
  c.ca_pem = slurp(pki.dir.file("ca.crt"));
  c.token = kToken;
  c.timeout = 5s;
  c.source = "the test";
  return c;
}

// A suite with the certificates made once. A suite set-up that throws
// makes gtest skip the tests: the error is kept and each test fails on it
// instead.
class WithPki : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    try {
      pki = new Pki();
    } catch (const std::exception& e) {
      pki_error = e.what();
    }
  }
  static void TearDownTestSuite() {
    delete pki;
    pki = nullptr;
  }
  void SetUp() override { ASSERT_NE(pki, nullptr) << "the certificates: " << pki_error; }
  static inline Pki* pki = nullptr;
  static inline std::string pki_error;
};

}  // namespace sriovd::k8s::test_support
