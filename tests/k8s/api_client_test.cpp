// The API server client against tests/k8s/apiserver_standin.py (HTTPS,
// tokens, client certificates, resourceVersion preconditions), with
// certificates made by openssl for each run.
#include "sriovd/k8s/api_client.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>

#include "k8s/apiserver_fixture.hpp"

namespace sriovd::k8s {
namespace {

using namespace std::chrono_literals;

using namespace test_support;

class ApiClientTest : public WithPki {
 protected:
  ApiConfig config(const ApiServer& s) const { return config_for(*pki, s); }
};

const nlohmann::json kSlice = {{"apiVersion", "resource.k8s.io/v1"},
                               {"kind", "ResourceSlice"},
                               {"metadata", {{"name", "node-a-sriovd.io-x"}}},
                               {"spec",
                                {{"driver", "sriovd.io"},
                                 {"nodeName", "node-a"},
                                 {"pool", {{"name", "node-a"}, {"generation", 1}, {"resourceSliceCount", 1}}},
                                 {"devices", nlohmann::json::array()}}}};
const std::string kSlices = "/apis/resource.k8s.io/v1/resourceslices";

TEST_F(ApiClientTest, WritesWithResourceVersionsAsPreconditions) {
  ApiServer server(*pki, {"--token", kToken});
  ApiClient api(config(server));
  const nlohmann::json made = api.create(kSlices, kSlice);
  const std::string rv = made["metadata"]["resourceVersion"];
  ASSERT_FALSE(rv.empty());
  EXPECT_EQ(api.get(kSlices + "/node-a-sriovd.io-x")["spec"]["driver"], "sriovd.io");
  try {
    (void)api.create(kSlices, kSlice);
    FAIL() << "created twice";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 409) << e.what();
  }
  nlohmann::json update = made;
  update["spec"]["pool"]["generation"] = 2;
  const nlohmann::json updated = api.replace(kSlices + "/node-a-sriovd.io-x", update);
  // The old version is stale now: an update or a delete on it is refused.
  try {
    (void)api.replace(kSlices + "/node-a-sriovd.io-x", update);
    FAIL() << "a stale update was taken";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 409) << e.what();
    EXPECT_NE(std::string(e.what()).find("modified"), std::string::npos) << e.what();
  }
  EXPECT_THROW(api.remove(kSlices + "/node-a-sriovd.io-x", rv), ApiError);
  api.remove(kSlices + "/node-a-sriovd.io-x", updated["metadata"]["resourceVersion"]);
  EXPECT_FALSE(api.find(kSlices + "/node-a-sriovd.io-x").has_value());
}

TEST_F(ApiClientTest, AWrongTokenIsRefusedAndNeverRepeated) {
  ApiServer server(*pki, {"--token", "the-right-one"});
  ApiClient api(config(server));
  try {
    (void)api.get(kSlices);
    FAIL() << "a wrong token was taken";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 401);
    EXPECT_EQ(std::string(e.what()).find(kToken), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("GET https://127.0.0.1:" + server.port + kSlices), std::string::npos)
        << e.what();
  }
}

TEST_F(ApiClientTest, AServerCertificateOfAnotherCaIsNotTrusted) {
  ApiServer server(*pki, {"--token", kToken});
  ApiConfig c = config(server);
  c.ca_pem = slurp(pki->dir.file("other.crt"));
  ApiClient api(c);
  try {
    (void)api.get(kSlices);
    FAIL() << "a server of another CA was trusted";
  } catch (const ApiUnreachable& e) {
    EXPECT_NE(std::string(e.what()).find("TLS handshake"), std::string::npos) << e.what();
  }
}

TEST_F(ApiClientTest, ACertificateThatDoesNotNameTheHostIsRefused) {
  ApiServer server(*pki, {"--token", kToken});
  ApiConfig c = config(server);
  c.host = "localhost";  // 127.0.0.1, but the certificate names only the IP
  ApiClient api(c);
  try {
    (void)api.get(kSlices);
    FAIL() << "a certificate for 127.0.0.1 was taken for localhost";
  } catch (const ApiUnreachable& e) {
    EXPECT_NE(std::string(e.what()).find("TLS handshake"), std::string::npos) << e.what();
  }
}

TEST_F(ApiClientTest, AClientCertificateAuthenticates) {
  ApiServer server(*pki, {"--client-ca", pki->dir.file("ca.crt")});
  ApiConfig c = config(server);
  c.token.clear();
  ApiClient anonymous(c);
  try {
    (void)anonymous.find(kSlices + "/x");
    FAIL() << "no credentials, and an answer";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 401);
  }
  c.client_cert_pem = slurp(pki->dir.file("client.crt"));
  c.client_key_pem = slurp(pki->dir.file("client.key"));
  ApiClient api(c);
  EXPECT_FALSE(api.find(kSlices + "/x").has_value());
}

TEST_F(ApiClientTest, AServerThatNeverAnswersIsGivenUpOnAtTheTimeout) {
  ApiServer server(*pki, {"--hang"});
  ApiConfig c = config(server);
  c.timeout = 300ms;
  ApiClient api(c);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    (void)api.get(kSlices);
    FAIL() << "an answer from a server that gives none";
  } catch (const ApiUnreachable& e) {
    EXPECT_NE(std::string(e.what()).find("no answer within 300 ms"), std::string::npos) << e.what();
  }
  // Bounded: not the kernel's TCP timeouts (minutes).
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s);
}

TEST_F(ApiClientTest, AKubeconfigWithItsFilesAndATokenFile) {
  ApiServer server(*pki, {"--token", kToken});
  test::TempDir dir;
  dir.write("ca.crt", slurp(pki->dir.file("ca.crt")));
  dir.write("token", kToken + "\n");
  const std::string path = dir.write("config", R"(apiVersion: v1
kind: Config
current-context: ci
contexts:
  - name: other
    context: {cluster: nowhere, user: nobody}
  - name: ci
    context: {cluster: test, user: driver}
clusters:
  - name: test
    cluster: {server: "https://127.0.0.1:)" + server.port +
                                                   R"(", certificate-authority: ca.crt}
users:
  - name: driver
    user: {tokenFile: token}
)");
  const ApiConfig c = load_kubeconfig(path);
  EXPECT_EQ(c.host, "127.0.0.1");
  EXPECT_EQ(c.port, server.port);
  EXPECT_EQ(c.source, "kubeconfig " + path + ", context ci");
  ApiClient api(c);
  EXPECT_FALSE(api.find(kSlices + "/x").has_value());
}

TEST_F(ApiClientTest, AKubeconfigWithInlineData) {
  test::TempDir dir;
  const test::RunResult ca = test::run({"/usr/bin/base64", "-w0", pki->dir.file("ca.crt")});
  ASSERT_EQ(ca.exit_code, 0);
  const std::string path = dir.write("config", R"(current-context: c
contexts: [{name: c, context: {cluster: k, user: u}}]
clusters: [{name: k, cluster: {server: "https://[fd00::1]:6443/", certificate-authority-data: )" +
                                                   ca.output +
                                                   R"(}}]
users: [{name: u, user: {token: abc}}]
)");
  const ApiConfig c = load_kubeconfig(path);
  EXPECT_EQ(c.host, "fd00::1");
  EXPECT_EQ(c.port, "6443");
  EXPECT_EQ(c.ca_pem, slurp(pki->dir.file("ca.crt")));
  EXPECT_EQ(c.token, "abc");
}

TEST(Kubeconfig, WhatIsWrongIsNamed) {
  test::TempDir dir;
  const auto error_of = [&](const std::string& text) {
    const std::string path = dir.write("config", text);
    try {
      (void)load_kubeconfig(path);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string head = "current-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n";
  const std::string user = "users: [{name: u, user: {token: t}}]\n";
  const auto cluster = [](const std::string& c) { return "clusters: [{name: k, cluster: {" + c + "}}]\n"; };
  EXPECT_NE(error_of("contexts: []\n").find("no current-context"), std::string::npos);
  EXPECT_NE(error_of("current-context: zz\ncontexts: []\n").find("no context 'zz' in contexts"), std::string::npos);
  EXPECT_NE(error_of(head + cluster("server: \"http://10.0.0.1\"") + user).find("is not https://"), std::string::npos);
  EXPECT_NE(error_of(head + cluster("server: \"https://10.0.0.1\", insecure-skip-tls-verify: true") + user)
                .find("insecure-skip-tls-verify is refused"),
            std::string::npos);
  EXPECT_NE(error_of(head + cluster("server: \"https://10.0.0.1:99999\"") + user).find("port '99999'"),
            std::string::npos);
  EXPECT_NE(error_of(head + cluster("server: \"https://10.0.0.1\"") + "users: [{name: u, user: {}}]\n")
                .find("no token and no client certificate"),
            std::string::npos);
  EXPECT_NE(
      error_of(head + cluster("server: \"https://10.0.0.1\"") + "users: [{name: u, user: {exec: {command: aws}}}]\n")
          .find("exec and auth-provider"),
      std::string::npos);
  EXPECT_NE(error_of(head + cluster("server: \"https://10.0.0.1\", certificate-authority: missing.crt") + user)
                .find("cannot read " + dir.path() + "/missing.crt"),
            std::string::npos);
  EXPECT_NE(error_of(head + cluster("server: \"https://10.0.0.1\", certificate-authority-data: \"%%%\"") + user)
                .find("not base64"),
            std::string::npos);
  // A good one, for contrast: the default port.
  EXPECT_EQ(error_of(head + cluster("server: \"https://10.0.0.1\"") + user), "no error");
}

TEST(InCluster, TheServiceAccountsTokenAndCa) {
  test::TempDir dir;
  dir.write("token", "tok");
  dir.write("ca.crt", "PEM");
  ::setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1", 1);
  ::setenv("KUBERNETES_SERVICE_PORT", "443", 1);
  const ApiConfig c = in_cluster(dir.path());
  EXPECT_EQ(c.host, "10.96.0.1");
  EXPECT_EQ(c.port, "443");
  EXPECT_EQ(c.token_file, dir.file("token"));
  EXPECT_EQ(c.ca_pem, "PEM");
  ::unsetenv("KUBERNETES_SERVICE_HOST");
  EXPECT_THROW((void)in_cluster(dir.path()), std::runtime_error);
  ::unsetenv("KUBERNETES_SERVICE_PORT");
}

}  // namespace
}  // namespace sriovd::k8s
