#pragma once
// A client of the Kubernetes API server: what a DRA driver needs (its
// ResourceSlices, the ResourceClaims it prepares, its Node), over HTTPS
// with the server's certificate verified, authenticated by a bearer token
// or a client certificate, every request bounded in time.
//
// Where it comes from: a kubeconfig (the path in the config, or
// $KUBECONFIG) or, in a pod, the service account (in_cluster()).
// The token is never logged, never part of an error message.
#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

namespace sriovd::k8s {

struct ApiConfig {
  std::string host;  // a DNS name or an IP address (IPv6 without brackets)
  std::string port = "443";
  std::string ca_pem;      // the CA(s) that sign the server's certificate
  std::string token;       // a bearer token,
  std::string token_file;  // or one read from this file at each request (it rotates), or:
  std::string client_cert_pem;
  std::string client_key_pem;
  std::chrono::milliseconds timeout{10000};  // each request, connect to last byte
  // Where it came from, for messages ("kubeconfig /root/.kube/config,
  // context ci").
  std::string source;
};

// Throws std::runtime_error naming the file, the entry and what is wrong:
// no current context, a user without credentials, a server that is not
// https://, `insecure-skip-tls-verify` (refused: the server's certificate
// is always verified), a file that cannot be read.
ApiConfig load_kubeconfig(const std::string& path);
// $KUBERNETES_SERVICE_HOST/PORT and the service account's token and CA
// under `account_dir` (/var/run/secrets/kubernetes.io/serviceaccount).
ApiConfig in_cluster(const std::string& account_dir = "/var/run/secrets/kubernetes.io/serviceaccount");

// An error the API server answered (its HTTP status and its Status
// message), as opposed to one of getting an answer (ApiUnreachable).
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, const std::string& what) : std::runtime_error(what), status_(status) {}
  [[nodiscard]] int status() const { return status_; }

 private:
  int status_;
};
class ApiUnreachable : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

class ApiClient {
 public:
  explicit ApiClient(ApiConfig config);
  ~ApiClient();
  ApiClient(const ApiClient&) = delete;
  ApiClient& operator=(const ApiClient&) = delete;

  // GET/POST/PUT/DELETE `path` ("/apis/resource.k8s.io/v1/..."): the JSON
  // the server answered with a 2xx status. Throws ApiError for any other
  // status (404: NotFound, 409: a conflict - a resourceVersion that moved),
  // ApiUnreachable when no answer came within the timeout (connect, TLS,
  // a certificate that does not verify, a reply that is not HTTP or JSON).
  nlohmann::json get(const std::string& path);
  nlohmann::json create(const std::string& path, const nlohmann::json& body);
  nlohmann::json replace(const std::string& path, const nlohmann::json& body);
  // With the object's resourceVersion as a precondition when given.
  void remove(const std::string& path, const std::string& resource_version = "");
  // GET, nullopt on 404.
  std::optional<nlohmann::json> find(const std::string& path);

  [[nodiscard]] const ApiConfig& config() const { return config_; }

 private:
  nlohmann::json request(const char* method, const std::string& path, const std::string& body);
  ApiConfig config_;
  struct Tls;
  std::unique_ptr<Tls> tls_;
};

}  // namespace sriovd::k8s
